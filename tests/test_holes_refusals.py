"""Three privacy holes an independent review found, each a way for one example to move the released gradient sum
beyond its claimed bound, and their refusals (rows of docs/bad-inputs.md, "Models with unsupported layers"):

* hole 2, batch statistics in eval mode: a BatchNorm without running statistics normalises with the batch's
  statistics in eval mode too (``fastdp.nn.mixes_examples``, refused by every variant);
* hole 3, backprop clipping with a parameter used more than once in a forward (a layer called twice, tied weights):
  the gradient sums the uses while one use's bound C1 C2 is credited;
* hole 4, bf16/fp16 parameters: the batch's gradient is summed in low precision (``Variant.check_parameters``).

Each test first measures, below the refusal, that the bound would break, then checks the refusal."""

import importlib
import math

import pytest
import torch
from torch import nn

import fastdp.nn as dpnn
from fastdp.algorithms import Batch
from fastdp.algorithms.base import per_example_cross_entropy, summed_loss_gradients
from fastdp.algorithms.dpsgd import clipped_gradient_sum, ghost_clipped_gradient_sum
from fastdp.nn import UnsupportedLayerError, mixes_examples
from fastdp.nn.backprop import BackpropClipLinear, convert_backprop, parameter_sensitivities
from tests.variants import make_variant, small_model


def _norm(tensors) -> float:
    return math.sqrt(sum(t.double().square().sum().item() for t in tensors))


def _batch(x: torch.Tensor, y: torch.Tensor | None = None) -> Batch:
    y = torch.randint(0, 2, (x.shape[0],)) if y is None else y
    return Batch(x, y, torch.ones(x.shape[0], dtype=torch.bool))


# ------------------------------------------------------------------------- hole 2: batch statistics in eval mode


def _norm_layer(kind: str, running: bool, mode: str) -> nn.Module:
    layer = {"batch": nn.BatchNorm1d, "instance": nn.InstanceNorm1d}[kind](3, track_running_stats=running)
    return layer.train() if mode == "train" else layer.eval()


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("running", [True, False], ids=["running-stats", "no-running-stats"])
@pytest.mark.parametrize("kind", ["batch", "instance"])
def test_mixes_examples_is_what_torch_does(kind, running, mode):
    """The predicate against an experiment: change one example and see whether the others' outputs (or the running
    statistics written into the model) change. BatchNorm mixes in training mode and, without running statistics, in
    eval mode; InstanceNorm normalises each example alone in both modes, and only writes the batch into the model
    when it updates running statistics (training mode, track_running_stats=True)."""
    torch.manual_seed(0)
    layer = _norm_layer(kind, running, mode)
    x = torch.randn(6, 3, 5)
    other = x.clone()
    other[5] = 100 * torch.randn(3, 5)
    before = None if layer.running_mean is None else layer.running_mean.clone()
    first = layer(x)
    after_first = None if before is None else layer.running_mean.clone()
    second = layer(other)
    outputs_mix = not torch.allclose(first[:5], second[:5])
    state_mixes = before is not None and not torch.equal(after_first, layer.running_mean)
    assert mixes_examples(layer) == (outputs_mix or state_mixes)
    expected = {("batch", "train"): True, ("batch", "eval"): not running, ("instance", "train"): running,
                ("instance", "eval"): False}  # fmt: skip
    assert mixes_examples(layer) == expected[kind, mode]


def test_mixes_examples_other_cases():
    bn = nn.BatchNorm1d(3).eval()
    assert not mixes_examples(bn)
    bn.running_mean = None  # buffers removed: torch's eval forward falls back to batch statistics
    assert mixes_examples(bn)
    assert mixes_examples(nn.SyncBatchNorm(3).train())
    assert mixes_examples(nn.SyncBatchNorm(3, track_running_stats=False).eval())
    assert mixes_examples(nn.BatchNorm2d(3, track_running_stats=False).eval())
    assert not any(mixes_examples(m) for m in (nn.LayerNorm(3), nn.GroupNorm(1, 3), nn.Linear(3, 3), nn.ReLU()))


def _eval_batch_statistics_model(features: int = 30, classes: int = 2) -> nn.Module:
    """Eval mode, but BatchNorm without running statistics: it normalises with the batch's statistics anyway.
    Parameter-free (affine=False), so no 'trainable non-DP module' check catches it first."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8, track_running_stats=False, affine=False)
    return nn.Sequential(nn.Linear(features, 8), bn, nn.ReLU(), nn.Linear(8, classes)).eval()


def test_eval_mode_batch_statistics_break_dpsgd_bound_without_the_refusal(monkeypatch):
    """The hole, measured: with the predicate switched off, DP-SGD's clipped sum (C = 1) moves by more than 2 C when
    one example is removed (every other example's normalised activations, hence gradient, change)."""
    monkeypatch.setattr(importlib.import_module("fastdp.nn.validate"), "mixes_examples", lambda module: False)
    model = dpnn.convert(_eval_batch_statistics_model(6).double())
    torch.manual_seed(1)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 2, (16,))
    x[0] *= 1000
    full, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, _batch(x, y), 1.0)
    less, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, _batch(x[1:], y[1:]), 1.0)
    assert _norm([a - b for a, b in zip(full, less, strict=True)]) > 2.0
    monkeypatch.undo()
    with pytest.raises(UnsupportedLayerError, match=r"in eval mode without running statistics.*1 \(BatchNorm1d\)"):
        ghost_clipped_gradient_sum(model, per_example_cross_entropy, _batch(x, y), 1.0)


EVAL_BATCH_STATISTICS = {
    "dpsgd": (UnsupportedLayerError, r"these layers use batch statistics in training mode, or in eval mode without "
                                     r"running statistics .*: 1 \(BatchNorm1d\)\. Use GroupNorm or LayerNorm"),
    "dpsgd-reference": (UnsupportedLayerError, r"DPSGD\(mode='reference'\) takes each example's gradient alone, but "
                                               r"these layers use batch statistics .*in eval mode without running "
                                               r"statistics.*: 1 \(BatchNorm1d\)"),
    "jl": (UnsupportedLayerError, r"these layers use batch statistics in training mode, or in eval mode without "
                                  r"running statistics .*: 1 \(BatchNorm1d\)\. Use GroupNorm or LayerNorm"),
    "backprop": (UnsupportedLayerError, r"backprop clipping bounds each example's own input and upstream gradient, "
                                        r"but these layers use batch statistics .*in eval mode without running "
                                        r"statistics.*: 1 \(BatchNorm1d\)"),
    "clipless": (ValueError, r"no Lipschitz bound rule.*1 \(BatchNorm1d\)"),
    "weightclip": (ValueError, r"no Lipschitz bound rule.*1 \(BatchNorm1d\)"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EVAL_BATCH_STATISTICS))
def test_every_variant_refuses_batch_statistics_in_eval_mode(name):
    """BatchNorm1d(track_running_stats=False) in eval mode, formerly accepted by dpsgd (ghost), backprop and jl
    (and a torch error in dpsgd reference mode); clipless/weightclip have no Lipschitz rule for it."""
    error, message = EVAL_BATCH_STATISTICS[name]
    model, variant = _eval_batch_statistics_model(), make_variant(name, 8, 80)
    with pytest.raises(error, match=message):
        variant.gradient(model, _batch(torch.randn(8, 30)), 0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["dpsgd", "dpsgd-reference", "jl", "backprop"])
def test_running_statistics_in_eval_mode_are_still_accepted(name):
    model = _eval_batch_statistics_model()
    model[1] = nn.BatchNorm1d(8, affine=False).eval()  # running statistics (public: never updated from the data)
    make_variant(name, 8, 80).gradient(model, _batch(torch.randn(8, 30)), 0)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_instance_norm_without_running_statistics_is_per_example_and_accepted():
    """InstanceNorm normalises each example alone (formerly refused in training mode): DP-SGD's ghost and reference
    clipped sums agree, and jl trains through it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.InstanceNorm1d(3), nn.Flatten(), nn.Linear(15, 2)).double().train()
    batch = _batch(torch.randn(6, 3, 5, dtype=torch.float64))
    reference, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.5)
    ghost, _ = ghost_clipped_gradient_sum(dpnn.convert(model), per_example_cross_entropy, batch, 0.5)
    for a, b in zip(ghost, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    make_variant("jl", 6, 60).gradient(model, batch, 0)
    model[0] = nn.InstanceNorm1d(3, track_running_stats=True).double().train()  # writes the batch into the model
    with pytest.raises(ValueError, match=r"0 \(InstanceNorm1d\)"):
        make_variant("jl", 6, 60).gradient(model, batch, 0)


# ----------------------------------------------------------- hole 3: backprop clipping, a parameter used k times


class _Twice(nn.Module):
    """y = b(a(x)) with b the same layer as a (reused) or a second layer holding a's weight (tied)."""

    def __init__(self, d: int, tied: bool) -> None:
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        if tied:
            self.b = nn.Linear(d, d, bias=False)
            self.b.weight = self.a.weight
        with torch.no_grad():
            self.a.weight.copy_(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "b", self.a)(self.a(x))


def _one_example_gradient_over_bound(model: nn.Module, d: int) -> float:
    """Backprop clipping (C1 = C2 = 1) swapped in by hand (convert_backprop refuses tied weights): one example's
    gradient norm over the sensitivity credited to the weight. x = 0.99 e_1 (inside C1), W = I and a linear loss
    100 <e_1, y> (upstream gradient clipped to C2 at both calls): the two uses' terms add up to 2 * 0.99 C1 C2."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = BackpropClipLinear
            m.input_clip, m.grad_clip = 1.0, 1.0
    e1 = torch.zeros(d, dtype=torch.float64)
    e1[0] = 1.0
    x = (0.99 * e1).reshape(1, d)
    sums, _ = summed_loss_gradients(model, lambda out, y: 100 * (out @ e1), _batch(x))
    (weight,) = [p for p in model.parameters()]
    return _norm(sums) / parameter_sensitivities(model)[weight]


@pytest.mark.parametrize("tied", [False, True], ids=["layer-called-twice", "tied-weights"])
def test_backprop_bound_breaks_when_a_parameter_is_used_twice(tied):
    """The hole, measured: the one parameter's per-example gradient is 1.98 times the C1 C2 credited to it."""
    assert _one_example_gradient_over_bound(_Twice(4, tied).double(), 4) == pytest.approx(1.98)


def test_backprop_refuses_a_layer_called_twice_in_one_forward():
    model, variant = _Twice(4, tied=False), make_variant("backprop", 8, 80)
    with pytest.raises(UnsupportedLayerError, match=r"called more than once in one forward, so their gradient sums "
                                                    r"the calls.*: a \(BackpropClipLinear, 2 calls\)\. Use a separate "
                                                    r"layer"):  # fmt: skip
        variant.gradient(model, _batch(torch.randn(8, 4), torch.randint(0, 4, (8,))), 0)
    assert model.a.weight.grad is None
    reused = nn.Linear(4, 4)  # the same layer twice in a Sequential
    model = nn.Sequential(reused, nn.ReLU(), reused, nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(UnsupportedLayerError, match=r": 0 \(BackpropClipLinear, 2 calls\)"):
        make_variant("backprop", 8, 80).gradient(model, _batch(torch.randn(8, 4)), 0)


def test_backprop_refuses_tied_weights():
    model, variant = _Twice(4, tied=True), make_variant("backprop", 8, 80)
    with pytest.raises(UnsupportedLayerError, match=r"a trainable parameter is shared by a and b \(tied weights\): "
                                                    r"backprop clipping credits it with one layer's"):  # fmt: skip
        variant.gradient(model, _batch(torch.randn(8, 4), torch.randint(0, 4, (8,))), 0)
    assert model.a.weight.grad is None
    # tied after the conversion: refused at the next step
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    variant = make_variant("backprop", 8, 80)
    variant.gradient(model, _batch(torch.randn(8, 4)), 0)
    model[2].weight = model[0].weight
    with pytest.raises(UnsupportedLayerError, match=r"shared by 0 and 2 \(tied weights\)"):
        variant.gradient(model, _batch(torch.randn(8, 4)), 1)


def test_backprop_accepts_a_frozen_layer_used_twice():
    """No bound is credited to a frozen layer, and the trainable layers clip their own inputs and gradients."""
    frozen = nn.Linear(4, 4).requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 4), frozen, nn.ReLU(), frozen, nn.Linear(4, 2))
    make_variant("backprop", 8, 80).gradient(model, _batch(torch.randn(8, 4)), 0)
    assert model[0].weight.grad is not None and frozen.weight.grad is None


# ------------------------------------------------------------------------------- hole 4: bf16/fp16 parameters


def test_bf16_parameters_break_the_backprop_bound_without_the_refusal():
    """The hole, measured below the refusal: with bf16 parameters the batch's gradient (4096 examples, one class,
    so the sums grow with the batch) is rounded after the examples are summed, and removing one example moves a
    tensor's sum by more than 1.5 times its sensitivity; in fp32 never more than once."""

    def worst_ratio(dtype: torch.dtype) -> float:
        torch.manual_seed(0)
        model = convert_backprop(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), 1.0, 1.0).to(dtype)
        n = 4096
        x, y = torch.randn(n, 8).to(dtype), torch.zeros(n, dtype=torch.int64)
        full, _ = summed_loss_gradients(model, per_example_cross_entropy, _batch(x, y))
        bounds = [parameter_sensitivities(model)[p] for p in model.parameters()]
        worst = 0.0
        for i in range(8):
            keep = torch.arange(n) != i
            less, _ = summed_loss_gradients(model, per_example_cross_entropy, _batch(x[keep], y[keep]))
            worst = max(
                worst, *((a - b).double().norm().item() / s for a, b, s in zip(full, less, bounds, strict=True))
            )
        return worst

    assert worst_ratio(torch.float32) <= 1.0
    assert worst_ratio(torch.bfloat16) > 1.5


LOW_PRECISION_VARIANTS = ["dpsgd", "dpsgd-reference", "dpsgd-per-layer", "jl", "clipless", "weightclip", "backprop"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", LOW_PRECISION_VARIANTS)
def test_every_private_variant_refuses_low_precision_parameters(name, dtype):
    """A model cast with .bfloat16()/.half(), formerly trained by every variant (clipless: one example moved the
    sum by 3.76 Delta at batch 4096): refused before anything of the step is computed, naming the parameters."""
    model, variant = small_model(name, 30, 2).to(dtype), make_variant(name, 8, 80)
    short = str(dtype).removeprefix("torch.")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    advice = ("use set_precision\\('bf16'\\) \\(CLI --precision bf16\\)" if name.startswith("dpsgd")
              else f"variant '{name}' trains in fp32 only")  # fmt: skip
    message = (rf"variant '{name.split('-')[0]}' trains float32 or float64 parameters only, but these trainable "
               rf"parameters are in low precision: {names[0]} \({short}\), .*Keep the trainable parameters in "
               rf"float32 \(do not cast the model with .half\(\), .bfloat16\(\) or .to\(torch.bfloat16\)\); "
               rf"{advice}")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        variant.gradient(model, _batch(torch.randn(8, 30).to(dtype)), 0)
    assert all(p.grad is None for p in model.parameters())


def test_low_precision_parameter_refusal_lists_them_and_spares_frozen_ones():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)]).bfloat16()
    with pytest.raises(ValueError, match=r"0.weight \(bfloat16\), 0.bias \(bfloat16\), .*3.bias \(bfloat16\) and 4 "
                                         r"more\. With bf16/fp16 parameters"):  # fmt: skip
        make_variant("dpsgd", 8, 80).gradient(model, _batch(torch.randn(8, 4).bfloat16()), 0)
    # only the trainable ones: frozen low-precision parameters get no gradient sum
    variant = make_variant("dpsgd", 8, 80)
    variant.check_parameters(model.requires_grad_(False))
    model[5].float().requires_grad_(True)
    variant.check_parameters(model)


@pytest.mark.parametrize("name", ["dpsgd", "backprop", "nonprivate"])
def test_float64_parameters_and_nonprivate_low_precision_are_accepted(name):
    model = small_model(name, 30, 2).double()
    make_variant(name, 8, 80).gradient(model, _batch(torch.randn(8, 30, dtype=torch.float64)), 0)
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())
    if name == "nonprivate":  # no bound to keep
        model = small_model(name, 30, 2).bfloat16()
        make_variant(name, 8, 80).gradient(model, _batch(torch.randn(8, 30).bfloat16()), 0)
