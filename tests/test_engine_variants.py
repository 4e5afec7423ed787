"""The Lipschitz variants (clipless, weightclip) and backpropagation clipping through ``fastdp.PrivacyEngine``:
the user's own loop, the variant API's release for the same batch and key, and each example's bound whatever loss
the user writes."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.algorithms import BackpropClip, Batch, Clipless, WeightClip
from fastdp.nn.lipschitz import MulticlassKR, TauCrossEntropy
from fastdp.train.models import build_model

SEED = 7
DERIVED = (SEED * 0x9E3779B97F4A7C15 + 1) % 2**63  # the noise key the engine derives from reproducible_seed
N, BATCH = 40, 10


def _data(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=gen), torch.randint(0, 3, (N,), generator=gen)


def _model(variant, seed=0):
    torch.manual_seed(seed)
    if variant == "clipless":
        return build_model("lipschitz_mlp", (6,), 3, hidden=8, depth=2, input_bound=2.0)
    if variant == "weightclip":
        return build_model("weightclip_mlp", (6,), 3, hidden=8, depth=2, input_bound=2.0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


BOUNDS = {"clipless": {}, "weightclip": {}, "backprop": {"input_clip": 1.5, "grad_clip": 0.7}}


def _reference(variant, sigma=0.8):
    keys = {"reproducible_seed": DERIVED}
    if variant == "clipless":
        return Clipless(sigma, BATCH / N, N, **keys)
    if variant == "weightclip":
        return WeightClip(sigma, BATCH / N, N, **keys)
    return BackpropClip(1.5, 0.7, sigma, BATCH / N, N, **keys)


def _private(variant, model, x, y, sigma=0.8, reduction="mean", criterion=None, **kwargs):
    """(engine, private model, optimizer, criterion): Opacus' ghost-clipping front door, whose criterion (a
    ``fastdp.engine.DPLoss`` of ``criterion``, cross-entropy by default) gives the loss, the per-example losses'
    mean or sum (``reduction``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, criterion, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma, variant=variant,
        loss_reduction=reduction, reproducible_seed=SEED, criterion=criterion, grad_sample_mode="ghost",
        **{**BOUNDS[variant], **kwargs},
    )  # fmt: skip
    return engine, model, opt, criterion


def _loop_step(model, opt, criterion, x, y):
    opt.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()


@pytest.mark.parametrize("variant", ["clipless", "weightclip", "backprop"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_released_gradient_equals_the_variant_apis_for_the_same_batch_and_key(variant, reduction):
    """The loss is make_private's criterion's, its mean or its sum."""
    x, y = _data()
    xb, yb = x[:9], y[:9]
    _, model, opt, criterion = _private(variant, _model(variant), x, y, reduction=reduction)
    assert all(p.grad is None for p in model.parameters())
    _loop_step(model, opt, criterion, xb, yb)
    reference = _model(variant)
    _reference(variant).gradient(reference, Batch(xb, yb, torch.ones(9, dtype=torch.bool)), 0)
    scale = BATCH if reduction == "sum" else 1.0  # "sum": the noisy sum (Opacus), not divided by q N
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad * scale, rtol=1e-5, atol=1e-6)
    assert opt.steps_taken == 1 and opt.accountant.history == [(0.8, 0.25, 1)]


@pytest.mark.parametrize("variant", ["clipless", "backprop"])
def test_each_examples_change_of_the_release_stays_within_its_bound_whatever_the_users_loss(variant):
    """A loss 1000 times cross-entropy (its output gradient far beyond sqrt(2)), a squared loss, as the DP criterion:
    the noiseless release with and without one example differs, per parameter tensor, by at most that tensor's
    per-example bound divided by the expected batch size ("mean") or by the bound itself ("sum"). The user's own
    plain batch mean, or sum, is refused under either reduction (a fourth review: a hand-written mean under "sum"
    moved the release of backprop clipping by 1.8 C)."""
    x, y = _data(3)
    x = x * 50  # beyond every input bound
    per_example = {
        "ce-x1000": lambda out, t: 1000 * nn.functional.cross_entropy(out, t, reduction="none"),
        "squared": lambda out, t: (out**2).sum(1) * 300,
    }
    plain_mean = {
        "ce-x1000": lambda out, t: 1000 * nn.functional.cross_entropy(out, t),
        "squared": lambda out, t: (out**2).sum(1).mean() * 300,
    }
    cases = [(reduction, name, fn) for reduction in ("mean", "sum") for name, fn in per_example.items()]
    for reduction, name, criterion_of in cases:  # the DP criterion of the per-example losses
        grads = []
        for rows in (slice(0, 8), slice(0, 7)):
            _, model, opt, criterion = _private(variant, _model(variant), x, y, sigma=0.0, reduction=reduction,
                                                criterion=criterion_of)  # fmt: skip
            _loop_step(model, opt, criterion, x[rows], y[rows])
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        variant_obj = opt.variant
        if variant == "clipless":
            bounds = variant_obj.last_bounds.tolist()
        else:
            from fastdp.nn.backprop import parameter_sensitivities

            sens = parameter_sensitivities(model._module)
            bounds = [sens[p] for p in model.parameters()]
        divisor = variant_obj.expected_batch_size if reduction == "mean" else 1.0
        for with_, without, bound in zip(*grads, bounds, strict=True):
            change = (with_ - without).norm().item() * divisor
            assert change <= bound * (1 + 1e-5), (variant, reduction, name, change, bound)
    written = [*plain_mean.items()] + [(f"{name}-sum", lambda out, t, fn=fn: fn(out, t).sum())
                                       for name, fn in per_example.items()]  # fmt: skip
    for reduction in ("mean", "sum"):  # the user's own loss: refused, nothing released
        for name, fn in written:
            _, model, opt, _ = _private(variant, _model(variant), x, y, sigma=0.0, reduction=reduction)
            with pytest.raises(ValueError, match="loss must come from fastdp's DP criterion"):
                _loop_step(model, opt, fn, x[:8], y[:8])
            assert opt.steps_taken == 0 and opt.accountant.history == [], name
            assert all(p.grad is None or not p.grad.any() for p in model.parameters()), name


def test_a_lipschitz_criterion_sets_the_output_gradient_bound_and_a_contradicting_one_is_refused():
    x, y = _data()
    for loss in (MulticlassKR(), TauCrossEntropy(tau=3.0)):  # per-example losses: the front door's criterion too
        _, model, opt, criterion = _private("clipless", _model("clipless"), x, y, criterion=loss)
        assert opt.variant.loss_fn is loss
        _loop_step(model, opt, criterion, x[:9], y[:9])
        reference = _model("clipless")
        Clipless(0.8, BATCH / N, N, loss=loss, reproducible_seed=DERIVED).gradient(
            reference, Batch(x[:9], y[:9], torch.ones(9, dtype=torch.bool)), 0
        )
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    _, _, opt, _ = _private("clipless", _model("clipless"), x, y, output_grad_bound=0.5)
    assert opt.variant.loss_fn.lipschitz == 0.5
    with pytest.raises(ValueError, match="contradicts the criterion's Lipschitz constant"):
        _private("clipless", _model("clipless"), x, y, criterion=TauCrossEntropy(), output_grad_bound=0.5)


def test_refusals_name_the_variants_own_bound_parameters():
    x, y = _data()
    with pytest.raises(ValueError, match="does not clip per-example gradients"):
        _private("clipless", _model("clipless"), x, y, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="projections is not a bound parameter of variant 'weightclip'"):
        _private("weightclip", _model("weightclip"), x, y, projections=4)
    with pytest.raises(TypeError, match="needs grad_clip"):
        _private("backprop", _model("backprop"), x, y, grad_clip=None)
    with pytest.raises(ValueError, match="no Lipschitz bound rule"):
        _private("clipless", _model("backprop"), x, y)  # an ordinary MLP has no certified bounds
    _, model, _, _ = _private("clipless", _model("clipless"), x, y)
    with pytest.raises(ValueError, match="cannot train under autocast"), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x[:4])


def test_a_model_that_does_not_return_one_batch_tensor_is_refused():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(x), x

    x, y = _data()
    _, model, _, _ = _private("backprop", Pair(), x, y)
    with pytest.raises(ValueError, match="must return one tensor whose rows are the batch's 5 examples"):
        model(x[:5])


def test_a_layer_called_twice_in_one_forward_is_refused_under_backprop_clipping():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return self.lin(self.lin(x))

    x, y = _data()
    _, model, _, _ = _private("backprop", Twice(), x, y)
    with pytest.raises(ValueError, match="called more than once"):
        model(x[:5])


def test_gradients_sent_into_the_model_by_another_path_are_never_released():
    """A loss that also reaches the parameters through a direct call of a submodule: that path's gradient is
    dropped; the release is the one of the output's gradient alone. A term that sends gradient into the DP
    criterion's input (the model's output) besides the criterion is refused under "mean"."""
    x, y = _data()
    _, model, opt, criterion = _private("backprop", _model("backprop"), x, y, sigma=0.0)
    opt.zero_grad()
    loss = criterion(model(x[:6]), y[:6]) + 1e6 * model._module[0](x[:6]).sum()
    loss.backward()
    opt.step()
    reference = _model("backprop")
    _reference("backprop", sigma=0.0).gradient(reference, Batch(x[:6], y[:6], torch.ones(6, dtype=torch.bool)), 0)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    opt.zero_grad()
    out = model(x[6:12])
    (criterion(out, y[6:12]) + 1e6 * out.pow(2).mean()).backward()
    with pytest.raises(ValueError, match="the model also got gradient from other terms of the loss"):
        opt.step()
    assert opt.steps_taken == 1 and len(opt.accountant.history) == 1  # nothing more released
    assert all(p.grad is None for p in model.parameters())  # zero_grad's None: no release wrote it


def test_clipless_trains_through_the_front_door_and_keeps_its_constraints():
    torch.manual_seed(0)
    x = torch.randn(400, 6)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model = _model("clipless")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=100),
        target_epsilon=8.0, target_delta=1e-4, epochs=5, variant="clipless", criterion=nn.CrossEntropyLoss(),
        grad_sample_mode="ghost",
    )  # fmt: skip
    for _ in range(5):
        for xb, yb in loader:
            _loop_step(model, opt, criterion, xb, yb)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.5  # three classes: chance is below 0.4
    assert engine.get_epsilon(1e-4) <= 8.0
    for m in model._module.modules():  # the projection ran after each step: every layer within its constraint
        if hasattr(m, "weight") and m.weight.dim() == 2:
            assert torch.linalg.matrix_norm(m.weight.detach().double(), 2) <= 1 + 1e-4
