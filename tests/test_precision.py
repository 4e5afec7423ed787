"""Mixed precision: bf16/fp16 autocast of the forward keeps DP-SGD's per-example bound (the argument is in the
fastdp.algorithms.dpsgd docstring); variants whose bound low-precision rounding can break refuse it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastdp.algorithms import DPSGD, JL, VARIANTS, BackpropClip, Batch, Clipless, NonPrivate, WeightClip
from fastdp.algorithms import dpsgd as dpsgd_module
from fastdp.algorithms.base import DEFAULT_LOSS_SCALE, per_example_cross_entropy
from fastdp.algorithms.dpsgd import per_example_gradients
from fastdp.train.trainer import TrainConfig, Trainer

C = 0.5
SLACK = 1 + 1e-5  # fp32 rounding of the fp32 norm and sum computations
B, CLASSES = 10, 3


class MeanOverPositions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, CLASSES))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                         nn.Flatten(), nn.Linear(4 * 2 * 2, CLASSES))  # fmt: skip


def _sequence() -> nn.Module:
    """Transformer-style token-wise layers on [B, T, d] inputs: T = 6 takes the ghost norm in the wide Linear layers
    (2 T^2 < p d) and the per-example gradient in the narrow one."""
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4),
                         MeanOverPositions(), nn.Linear(4, CLASSES))  # fmt: skip


class _Tokens(nn.Module):
    """Embedding of token ids + a learned position embedding (batch-first position ids) + token-wise layers."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(40, 16), nn.Embedding(6, 16)
        self.body = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.ReLU(), MeanOverPositions(),
                                  nn.Linear(16, CLASSES))  # fmt: skip

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        return self.body(self.tokens(ids) + self.positions(positions))


MODELS = {"mlp": (_mlp, (10,)), "cnn": (_cnn, (1, 6, 6)), "sequence": (_sequence, (6, 8))}


def _inputs(shape: tuple[int, ...], adversarial: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, *shape, generator=gen)
    y = torch.randint(0, CLASSES, (B,), generator=gen)
    if adversarial:  # huge rows (finite in fp32; some overflow bf16/fp16 or the fp32 norms), inf and NaN
        scales = torch.tensor([1.0, 1e2, 1e4, 1e6, 1e12, 1e20, 1e30, 1.0, 1.0, 1.0])
        x = x * scales.reshape(-1, *([1] * len(shape)))
        x[7].view(-1)[0] = math.inf
        x[8].view(-1)[0] = math.nan
    return x, y


def _variant(precision: str, clip: float, mode: str = "ghost") -> DPSGD:
    variant = DPSGD(clip, 0.0, 1.0, 1, mode=mode)  # expected batch size 1: the clipped sum itself
    variant.set_precision(precision)
    return variant


def _sums(variant: DPSGD, model: nn.Module, x: torch.Tensor, y: torch.Tensor, only: int | None) -> list[torch.Tensor]:
    mask = torch.ones(B, dtype=torch.bool) if only is None else torch.arange(B) == only
    sums, loss = variant.clipped_sum(model, Batch(x, y, mask), step=0)
    assert all(s.dtype == torch.float64 for s in sums), [s.dtype for s in sums]  # fastdp.ops.summation
    assert torch.isfinite(loss), loss
    return sums


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(t.double().square().sum().item() for t in tensors))


def _contributions(variant, model, x, y) -> list[float]:
    """Each example's contribution to the clipped sum, the other rows masked: its fp32 sums' norm (in fp64)."""
    return [_norm(_sums(variant, model, x, y, only=i)) for i in range(B)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("adversarial", [False, True], ids=["plain", "adversarial"])
def test_each_example_contributes_at_most_c(precision, model_name, adversarial):
    """Acceptance: under autocast every example's contribution to the clipped sum has fp32 norm <= C (1 + 1e-5),
    huge, infinite and NaN inputs included, and the whole batch's sum is finite and the sum of those contributions
    (a non-finite example is left out per example: the others are untouched)."""
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model, (x, y) = build(), _inputs(shape, adversarial)
    variant = _variant(precision, C)
    alone = _contributions(variant, model, x, y)
    assert max(alone) <= C * SLACK, alone
    kept = [n for n in alone if n > 0]
    assert len(kept) >= (4 if adversarial else B), alone  # the bound is not met by dropping everything
    before = int(variant.nonfinite_examples)
    together = _sums(variant, model, x, y, only=None)
    assert all(torch.isfinite(s).all() for s in together)
    dropped = int(variant.nonfinite_examples) - before
    separately = [sum(parts) for parts in zip(*(_sums(variant, model, x, y, only=i) for i in range(B)), strict=True)]
    for a, b in zip(together, separately, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if adversarial:  # the inf/NaN rows can never be finite: left out, and counted in nonfinite_examples
        assert alone[7] == 0 and alone[8] == 0
        assert dropped == sum(n == 0 for n in alone) >= 2, (dropped, alone)
    else:
        assert dropped == 0


@pytest.mark.parametrize("precision, rtol", [("bf16", 0.08), ("fp16", 0.01)])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_low_precision_norms_are_close_to_fp32_per_example_gradients(precision, rtol, model_name):
    """Acceptance (torch.func check in fp32 on the same inputs): with no clipping (C huge) each example's
    contribution is its low-precision per-example gradient, whose norm is close to, not equal to, the fp32
    per-example gradient's norm from torch.func; with C = 0.5 it is min(C, that norm) up to the same rounding."""
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model, (x, y) = build(), _inputs(shape, adversarial=False)
    low = _contributions(_variant(precision, 1e30), model, x, y)
    per_example = per_example_gradients(model, per_example_cross_entropy, x, y)  # fp32, model as converted
    exact = [_norm([g[i] for g in per_example]) for i in range(B)]
    torch.testing.assert_close(torch.tensor(low), torch.tensor(exact), rtol=rtol, atol=0)
    assert max(abs(a / b - 1) for a, b in zip(low, exact, strict=True)) > 1e-6, "autocast did not lower the precision"
    clipped = _contributions(_variant(precision, C), model, x, y)
    expected = torch.tensor([min(C, n) for n in exact])
    torch.testing.assert_close(torch.tensor(clipped), expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tokens_and_embeddings_keep_the_bound(precision):
    torch.manual_seed(0)
    model = _Tokens()
    ids = torch.randint(0, 40, (B, 6), generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, CLASSES, (B,), generator=torch.Generator().manual_seed(5))
    alone = _contributions(_variant(precision, 0.05), model, ids, y)
    assert max(alone) <= 0.05 * SLACK and min(alone) > 0, alone
    low = _contributions(_variant(precision, 1e30), model, ids, y)
    exact = [_norm([g[i] for g in per_example_gradients(model, per_example_cross_entropy, ids, y)]) for i in range(B)]
    torch.testing.assert_close(torch.tensor(low), torch.tensor(exact), rtol=0.08, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reference_mode_refuses_low_precision(precision):
    """torch.func's vmap fails on an autocast LayerNorm's backward: the reference mode stays fp32, saying so."""
    with pytest.raises(ValueError, match="mode='ghost'"):
        DPSGD(C, 1.0, 0.1, 100, mode="reference").set_precision(precision)


def test_only_the_forward_runs_under_autocast(monkeypatch):
    """Norms, clip factors and clipped sums (``_clip_and_sum``) run outside autocast, where a matmul of fp32 tensors
    stays fp32; the model's forward runs inside it (its Linear outputs are bf16)."""
    seen = {}
    clip_and_sum = dpsgd_module._clip_and_sum

    def spy(layers, saved, grads_out, *args):
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["dtypes"] = {(a[0].dtype, g.dtype) for a, g in zip(saved, grads_out, strict=True)}
        return clip_and_sum(layers, saved, grads_out, *args)

    monkeypatch.setattr(dpsgd_module, "_clip_and_sum", spy)
    torch.manual_seed(0)
    model, (x, y) = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, CLASSES)), _inputs((10,), False)
    _sums(_variant("bf16", C), model, x, y, only=None)
    assert seen == {"autocast": False, "dtypes": {(torch.bfloat16, torch.bfloat16)}}
    assert not torch.is_autocast_enabled("cpu")


def test_fp16_loss_scaling_is_unscaled_exactly():
    """The loss scale multiplies G and is divided out of the norms and factors: scales 1 and 2**10 give the same
    clipped sums where nothing underflows (well-scaled inputs), and a non-power-of-two scale is refused."""
    torch.manual_seed(0)
    model, (x, y) = _mlp(), _inputs((10,), adversarial=False)
    results = []
    for scale in (1.0, 2.0**10):
        variant = DPSGD(C, 0.0, 1.0, 1)
        variant.set_precision("fp16", loss_scale=scale)
        results.append(_sums(variant, model, x, y, only=None))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-5)
    assert DPSGD(C, 0.0, 1.0, 1).loss_scale == 1.0
    variant = DPSGD(C, 0.0, 1.0, 1)
    variant.set_precision("fp16")
    assert variant.loss_scale == DEFAULT_LOSS_SCALE
    for bad in (1000.0, 0.5, math.inf, 2.0**30):
        with pytest.raises(ValueError, match="power of two"):
            variant.set_precision("fp16", loss_scale=bad)
    with pytest.raises(ValueError, match="fp16 only"):
        variant.set_precision("bf16", loss_scale=1024.0)
    with pytest.raises(ValueError, match="unknown precision"):
        variant.set_precision("fp8")


@pytest.mark.parametrize("cls", [JL, Clipless, WeightClip, BackpropClip])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_variants_with_in_network_bounds_refuse_low_precision(cls, precision):
    """clipless/weightclip (analytic Lipschitz bounds), backprop (clip layers inside the network) and jl (exact
    Gaussian projections assumed by its accountant) refuse AMP, saying why and to use fp32."""
    with pytest.raises(ValueError, match=rf"cannot train in {precision}: .*--precision fp32"):
        cls.check_precision(precision)
    config = TrainConfig(variant=cls.name, precision=precision, noise_multiplier=1.0, accountant="pld")
    with pytest.raises(ValueError, match="cannot train in"):
        config.validate()
    cls.check_precision("fp32")


def test_which_variants_accept_low_precision():
    assert {name for name, cls in VARIANTS.items() if cls.low_precision_refusal is None} == {"dpsgd", "nonprivate"}


@pytest.mark.parametrize("variant, precision", [("dpsgd", "bf16"), ("dpsgd", "fp16"), ("nonprivate", "bf16")])
def test_low_precision_training_learns_and_reports_epsilon(variant, precision):
    """Acceptance: a bf16 (and fp16) DP-SGD run on breast_cancer learns and reports its epsilon."""
    private = variant == "dpsgd"
    config = TrainConfig(variant=variant, dataset="breast_cancer", epochs=8, batch_size=64, lr=0.1, precision=precision,
                         epsilon=3.0 if private else None, quiet=True, progress=False,
                         reproducible_privacy_seed=0)  # a deterministic threshold  # fmt: skip
    trainer = Trainer(config)
    result = trainer.run()
    assert result["test_accuracy"] > 0.85, result["history"]
    assert result["variant_config"].get("precision", precision) == precision
    if private:
        assert 0 < result["epsilon"] <= 3.0
        assert result["variant_config"]["nonfinite_examples"] == 0
    assert all(math.isfinite(r["train_loss"]) for r in result["history"])


def test_nonprivate_fp16_unscales_its_gradient():
    """Non-private fp16: the gradient of the scaled loss divided by the scale, close to the fp32 gradient."""
    torch.manual_seed(0)
    model, (x, y) = _mlp(), _inputs((10,), adversarial=False)
    grads = []
    for precision in ("fp32", "fp16"):
        variant = NonPrivate()
        variant.set_precision(precision)
        variant.gradient(model, Batch(x, y, torch.ones(B, dtype=torch.bool)), step=0)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)
