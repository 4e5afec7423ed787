"""Regression tests for the privacy review's holes 10 and 11 in the Lipschitz (clipless, weightclip) machinery.

Hole 10: L2NormPool2d had a NaN gradient at an all-zero window (sqrt at 0), so one black image made the release
non-finite. Hole 11: certified spectral norms were 0 for tiny matrices and NaN for huge ones (Gram powers under-
and overflowing), and bounds were rounded to nearest (down, half the time) where they met float32 or were
multiplied together.
"""

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdp.algorithms import Batch, Clipless
from fastdp.nn.lipschitz import (
    AddBias,
    BoundedInput,
    ClipGradient,
    GroupSort2,
    L2NormPool2d,
    LipschitzConv2d,
    LipschitzLinear,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    Residual,
    TauCrossEntropy,
    add_up,
    lipschitz_bounds,
    mul_up,
    norm_up,
    project_,
    sqrt_up,
    sum_up,
)
from fastdp.ops import certified_spectral_norm, certified_spectral_norms
from fastdp.ops.spectral import deferred_finite_checks
from fastdp.ref import spectral as ref_spectral


def _old_pool(x: torch.Tensor, k: int) -> torch.Tensor:
    """The formula L2NormPool2d used before the fix (values away from zero windows must not change)."""
    return (F.avg_pool2d(x * x, k, stride=k) * (k * k)).clamp(min=0).sqrt()


def _top64(w: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(w.detach().double(), 2))


def _f32_up(value) -> Fraction:
    """The float32 value a bound ends up as (rounded up once, as the clipless variant does), as a fraction."""
    v = value.detach().double() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
    return Fraction(float(ref_spectral.round_up(v, torch.float32)))


def _frac(value) -> Fraction:
    return Fraction(float(value))


# ---------------------------------------------------------------------------------------- hole 10: L2NormPool2d


def test_l2_norm_pool_zero_window_has_finite_zero_gradient():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 7)  # 7: one border column dropped
    x[0, 1, 2:4, 0:2] = 0.0  # one all-zero window
    x[1] = 0.0  # a whole all-zero example
    x.requires_grad_(True)
    y = L2NormPool2d(2)(x)
    assert y.shape == (2, 3, 3, 3) and torch.isfinite(y).all()
    assert y[0, 1, 1, 0] == 0 and (y[1] == 0).all()
    torch.testing.assert_close(y, _old_pool(x.detach(), 2))
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, g)
    assert torch.isfinite(grad).all()
    assert (grad[0, 1, 2:4, 0:2] == 0).all() and (grad[1] == 0).all() and (grad[..., 6] == 0).all()
    # elsewhere the gradient of ||x_window|| is g x / ||x_window||, as before
    xr = x.detach().clone().requires_grad_(True)
    (old,) = torch.autograd.grad(_old_pool(xr, 2), xr, g)
    mask = torch.isfinite(old)
    assert not mask.all()  # the old formula's NaN at the zero windows
    torch.testing.assert_close(grad[mask], old[mask])


def test_l2_norm_pool_unbatched_input_and_float64():
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(L2NormPool2d(2)(x), _old_pool(x, 2))
    with pytest.raises(ValueError, match="smaller than one 3x3 window"):
        L2NormPool2d(3)(torch.randn(1, 1, 2, 5))
    with pytest.raises(ValueError, match=r"takes \[B, C, H, W\] or \[C, H, W\] inputs"):
        L2NormPool2d(2)(torch.randn(4, 4))


@pytest.mark.parametrize("scale", [1e-22, 2e-23, 1e-40, 1e18, 1e30])
def test_l2_norm_pool_tiny_and_huge_windows_keep_norm_and_unit_gradient(scale):
    """x**2 subnormal (or overflowing) in float32 gave a norm off by up to 40 % and a gradient of norm up to 1.4
    (or inf/0): the 1-Lipschitz property broke. The window is now scaled by its largest entry first."""
    torch.manual_seed(1)
    base = torch.rand(4, 1, 2, 2, dtype=torch.float64) + 0.2
    x = (base * scale).float()
    exact = x.double().flatten(1).norm(dim=1)
    xr = x.clone().requires_grad_(True)
    y = L2NormPool2d(2)(xr)
    torch.testing.assert_close(y.double().flatten(), exact, rtol=1e-6, atol=1.5e-45)  # a subnormal y is rounded
    (grad,) = torch.autograd.grad(y.sum(), xr)
    norms = grad.double().flatten(1).norm(dim=1)
    assert torch.isfinite(norms).all()
    assert (norms <= 1 + 1e-6).all() and (norms >= 1 - 1e-6).all(), norms


def test_l2_norm_pool_under_vmap_grad():
    from torch.func import grad, vmap

    x = torch.randn(3, 1, 4, 4)
    x[1] = 0.0
    grads = vmap(grad(lambda xi: L2NormPool2d(2)(xi.unsqueeze(0)).sum()))(x)
    assert torch.isfinite(grads).all() and (grads[1] == 0).all()


def _cnn() -> nn.Module:
    return nn.Sequential(BoundedInput(5.0), LipschitzConv2d(1, 4, 3, (8, 8), padding=1), GroupSort2(), L2NormPool2d(2),
                         nn.Flatten(), LipschitzLinear(4 * 4 * 4, 3, bias=True))  # fmt: skip


@pytest.mark.parametrize("all_black", [False, True])
def test_black_image_through_the_clipless_step_gives_a_finite_release(all_black):
    torch.manual_seed(0)
    model = _cnn()
    x = torch.randn(6, 1, 8, 8)
    x[2] = 0.0  # one black image
    if all_black:
        x.zero_()
    variant = Clipless(1.0, 0.1, 60)
    batch = Batch(x, torch.randint(0, 3, (6,)), torch.ones(6, dtype=torch.bool))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        variant.gradient(model, batch, step)
        for p in model.parameters():
            assert torch.isfinite(p.grad).all(), f"step {step}: non-finite release"
        optimizer.step()
        variant.after_step(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -------------------------------------------------------------------- hole 11b: certified norms at any magnitude


@pytest.mark.parametrize("scale", [1e-300, 1e-200, 1e-170, 1e-161, 1e154, 1e160, 1e200, 1e300])
@pytest.mark.parametrize("shape", [(6, 5), (3, 9), (1, 4), (7, 1)])
def test_certified_norm_of_tiny_and_huge_float64_matrices(scale, shape):
    w = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * scale
    true = _top64(w)
    for bound in (
        certified_spectral_norm(w),
        certified_spectral_norms([w])[0],
        ref_spectral.certified_spectral_norm(w),
    ):
        assert bound.dtype == torch.float64 and math.isfinite(float(bound))
        assert true <= float(bound) <= true * 1.05, (scale, shape, float(bound), true)


@pytest.mark.parametrize("value", [5e-324, 1e-320, 1e-310, 1.7e308])
def test_certified_norm_at_the_float64_extremes(value):
    w = torch.full((3, 4), value, dtype=torch.float64)
    w[0, 0] = -value
    bound = float(certified_spectral_norm(w))
    true = _top64(w)  # may be inf (the norm of the 1.7e308 matrix is beyond float64): then so is the bound
    assert bound >= true and not math.isnan(bound)
    if math.isfinite(true):
        assert bound <= true * 1.05 + 2e-323


@pytest.mark.parametrize("value", [1.4e-45, 1e-44, 1e-40, 1.2e-38, 1e-30, 1e30, 1e37, 2.2e38])
def test_certified_norm_at_the_float32_extremes(value):
    gen = torch.Generator().manual_seed(4)
    w = ((torch.rand(5, 4, dtype=torch.float64, generator=gen) + 0.5) * value).float()
    assert (w > 0).all()
    bound = certified_spectral_norm(w)
    assert bound.dtype == torch.float32
    true = _top64(w)
    assert float(bound) >= true and not math.isnan(float(bound))
    if true * 1.05 < 3.4e38:
        assert float(bound) <= true * 1.05 + 3e-45


def test_certified_norm_of_zero_and_non_finite_matrices():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert certified_spectral_norm(torch.zeros(4, 3, dtype=dtype)) == 0
    for bad in (math.nan, math.inf, -math.inf):
        w = torch.randn(4, 3)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            certified_spectral_norm(w)
        with deferred_finite_checks():  # no check (no host sync): the bound is +inf, never NaN
            assert float(certified_spectral_norm(w)) == math.inf
            assert float(certified_spectral_norms([w, torch.ones(2, 2)])[0]) == math.inf
        assert float(ref_spectral.certified_spectral_norm(w.double())) == math.inf


def test_lipschitz_layers_with_tiny_and_huge_float64_weights():
    for scale in (1e-200, 1e200):
        layer = LipschitzLinear(6, 4).double()
        with torch.no_grad():
            layer.weight.mul_(scale)
        assert float(layer.lipschitz()) >= _top64(layer.weight) > 0
        for projection in ("clip", "fixed"):
            clipped = LipschitzLinear(6, 4, projection=projection, max_norm=2.0).double()
            with torch.no_grad():
                clipped.weight.copy_(layer.weight)
            clipped.project_()
            assert torch.isfinite(clipped.weight).all()
            assert _top64(clipped.weight) <= 2.0 * (1 + 1e-9)


def test_fixed_projection_of_a_zero_matrix_stays_finite():
    layer = LipschitzLinear(5, 3, projection="fixed", max_norm=2.0)
    with torch.no_grad():
        layer.weight.zero_()
    layer.project_()
    assert (layer.weight == 0).all()  # formerly 0 * (2 / 0) = NaN


# ------------------------------------------------------------------------ hole 11c: every bound is rounded up

_INPUTS = [0.1, 1 / 3, 0.7, 1.1, 2.3, 3.7, 5.9, 7.1, 1e-3, 12.345, 0.3, 0.9, 1.7, 2.9, 4.1, 6.7]


def test_bound_arithmetic_rounds_up_and_is_tight():
    torch.manual_seed(5)
    values = [*_INPUTS, 0.0, 1.0, 2.0, 0.5, 1e-300, 1e300, 5e-324]
    for a in values:
        assert Fraction(sqrt_up(a)) ** 2 >= Fraction(a)
        assert _frac(sqrt_up(torch.tensor(a, dtype=torch.float64))) ** 2 >= Fraction(a)
        for b in values:
            pairs = [(a, b), (torch.tensor(a, dtype=torch.float64), b)]
            if b < 3e38:
                pairs.append((a, torch.tensor(b, dtype=torch.float32)))
            for x, y in pairs:
                exact_mul, exact_add = _frac(x) * _frac(y), _frac(x) + _frac(y)
                m, s = mul_up(x, y), add_up(x, y)
                if math.isfinite(float(m)):
                    assert exact_mul <= _frac(m) <= exact_mul * (1 + Fraction(1, 2**50)) + Fraction(2**-1073)
                assert exact_add <= _frac(s) <= exact_add * (1 + Fraction(1, 2**50)) + Fraction(2**-1073)
            if a == 0 or b == 0:
                assert mul_up(torch.tensor(a, dtype=torch.float64), b) == 0 and mul_up(a, b) == 0
    assert sqrt_up(0.0) == 0 and sqrt_up(4.0) == 2.0  # exact roots are not stepped up
    t = torch.rand(1000, dtype=torch.float64) * 1e3
    assert _frac(sum_up(t)) >= sum(Fraction(float(v)) for v in t)


@pytest.mark.parametrize(
    "t", [torch.randn(37), torch.randn(5, dtype=torch.float64) * 1e-200, torch.randn(5, dtype=torch.float64) * 1e200,
          torch.full((3,), 1e-45), torch.full((3,), 3e38), torch.zeros(4), torch.tensor([0.1, 1 / 3, 0.7])],
)  # fmt: skip
def test_norm_up_is_an_upper_bound(t):
    exact_sq = sum(Fraction(float(v)) ** 2 for v in t.double())
    bound = norm_up(t)
    assert bound.dtype == torch.float64
    assert _frac(bound) ** 2 >= exact_sq
    assert _frac(bound) ** 2 <= exact_sq * (1 + Fraction(1, 10**11)) + Fraction(2**-1070) ** 2
    if abs(float(bound)) < 3e38:
        assert _f32_up(bound) ** 2 >= exact_sq
    for value in (math.nan, math.inf):  # a non-finite tensor: +inf, never NaN
        bad = t.double().clone()
        bad[0] = value
        assert float(norm_up(bad)) == math.inf


def test_loss_constants_are_upper_bounds():
    for loss in (TauCrossEntropy(), MulticlassKR()):
        assert Fraction(loss.lipschitz) ** 2 >= 2 and _f32_up(loss.lipschitz) ** 2 >= 2
    for alpha in (0.1, 1 / 3, 5.0, 10.0, 7.3):
        hkr = MulticlassHKR(alpha)
        rest = Fraction(hkr.lipschitz) - Fraction(alpha) * Fraction(MulticlassHinge().lipschitz)
        assert rest >= 0 and rest**2 >= 2
        rest32 = _f32_up(hkr.lipschitz) - Fraction(alpha)
        assert rest32 >= 0 and rest32**2 >= 2


def _check_rule(value, exact: Fraction, what: str) -> None:
    assert _frac(value) >= exact, f"{what}: {float(value)!r} < exact {float(exact)!r}"
    assert _f32_up(value) >= exact, f"{what}: float32 {float(_f32_up(value))!r} < exact {float(exact)!r}"


@pytest.mark.parametrize("as_tensor", [False, True])
def test_every_layer_rule_is_rounded_up(as_tensor):
    """Each rule evaluated at inputs whose products and sums round: the float64 value and its float32 (rounded up
    once) are >= the rule's exact value, computed with fractions from the layer's certified norm."""
    torch.manual_seed(6)
    lin = LipschitzLinear(7, 5, bias=True)
    with torch.no_grad():
        lin.weight.mul_(1.3)
        lin.bias.copy_(torch.randn(5) * 0.37)
    conv = LipschitzConv2d(2, 3, 3, input_hw=(6, 6), stride=2, padding=1)
    bias = AddBias(5, 0.5)
    with torch.no_grad():
        bias.bias.copy_(torch.randn(5) * 0.1)
    inner = LipschitzLinear(5, 5)
    res = Residual(inner, GroupSort2())
    l_lin, l_conv, l_inner = (_frac(m) for m in (lin.lipschitz(), conv._factor() / 2, inner.lipschitz()))
    assert conv._root_overlap() == 2
    bias_sq = sum(Fraction(float(v)) ** 2 for v in lin.bias.detach())
    add_sq = sum(Fraction(float(v)) ** 2 for v in bias.bias.detach())
    for x in _INPUTS:
        for g in _INPUTS[::3]:
            xb = torch.tensor(x, dtype=torch.float32) if as_tensor else x
            gb = torch.tensor(g, dtype=torch.float32) if as_tensor else g
            fx, fg = (
                Fraction(float(torch.tensor(x, dtype=torch.float32))) if as_tensor else Fraction(x),
                (Fraction(float(torch.tensor(g, dtype=torch.float32))) if as_tensor else Fraction(g)),
            )
            # LipschitzLinear: l x + ||b||; g l; weight g x; bias g
            out = lin.propagate(xb)
            rest = _f32_up(out) - l_lin * fx
            assert rest >= 0 and rest**2 >= bias_sq, f"linear propagate({x})"
            rest = _frac(out) - l_lin * fx
            assert rest >= 0 and rest**2 >= bias_sq
            _check_rule(lin.backpropagate(gb), fg * l_lin, f"linear backpropagate({g})")
            sens = lin.sensitivities(xb, gb)
            _check_rule(sens[lin.weight], fg * fx, f"linear weight sensitivity({x}, {g})")
            _check_rule(sens[lin.bias], fg, "linear bias sensitivity")
            # LipschitzConv2d: sqrt(m) ||M|| x; sqrt(m) ||M|| g; weight sqrt(m) x g (sqrt(m) = 2 here)
            _check_rule(conv.propagate(xb), 2 * l_conv * fx, f"conv propagate({x})")
            _check_rule(conv.backpropagate(gb), 2 * l_conv * fg, f"conv backpropagate({g})")
            _check_rule(conv.sensitivities(xb, gb)[conv.weight], 2 * fx * fg, f"conv sensitivity({x}, {g})")
            # AddBias: x + ||b||
            rest = _f32_up(bias.propagate(xb)) - fx
            assert rest >= 0 and rest**2 >= add_sq, f"add-bias propagate({x})"
            # Residual(Linear, GroupSort2): (x + l x) / 2; g / 2 + l g / 2; inner weight (g / 2) x
            _check_rule(res.propagate(xb), (fx + l_inner * fx) / 2, f"residual propagate({x})")
            _check_rule(res.backpropagate(gb), fg / 2 + l_inner * fg / 2, f"residual backpropagate({g})")
            _check_rule(res.sensitivities(xb, gb)[inner.weight], fg / 2 * fx, f"residual sensitivity({x}, {g})")
            # BoundedInput, ClipGradient: minima (exact)
            _check_rule(BoundedInput(0.3).propagate(xb), min(Fraction(0.3), fx), "bounded input")
            _check_rule(ClipGradient(0.7).backpropagate(gb), min(Fraction(0.7), fg), "clip gradient")


def _bounds_and_stds(model, loss, sigma, strategy, input_bound=None):
    variant = Clipless(sigma, 0.1, 100, input_bound=input_bound, loss=loss, strategy=strategy)
    stds = variant.noise_stds(model)
    bounds = lipschitz_bounds(model, loss, math.inf if input_bound is None else input_bound)
    params = [p for p in model.parameters() if p.requires_grad]
    return [_frac(bounds[p]) for p in params], variant.last_bounds, stds


@pytest.mark.parametrize("strategy", ["per-layer", "global"])
def test_clipless_stds_and_bounds_are_rounded_up_to_float32(strategy):
    """sqrt(2) (the loss constant) went to float32 as 1.41421354 < sqrt(2), and sigma sqrt(D) Delta was a float32
    product rounded to nearest: the float32 bounds and stds must be >= their exact values."""
    torch.manual_seed(7)
    models = [
        nn.Sequential(BoundedInput(1.0), LipschitzLinear(6, 3)),  # Delta = sqrt(2) X_0: a constant
        nn.Sequential(BoundedInput(0.7), LipschitzLinear(6, 8, bias=True), GroupSort2(), AddBias(8, 0.3),
                      Residual(LipschitzLinear(8, 8), GroupSort2()), LipschitzLinear(8, 3)),
        _cnn(),
    ]  # fmt: skip
    for model in models:
        for sigma in (0.1, 0.3, 0.7, 1.1, 1 / 3, 2.9, 1.3, 0.9):
            exact, bounds32, stds = _bounds_and_stds(model, TauCrossEntropy(), sigma, strategy)
            assert bounds32.dtype == torch.float32 and stds.dtype == torch.float32
            d = len(exact)
            for b, b32 in zip(exact, bounds32, strict=True):
                assert _frac(b32) >= b
            if strategy == "per-layer":
                for b, s in zip(exact, stds, strict=True):
                    assert _frac(s) >= 0 and _frac(s) ** 2 >= Fraction(sigma) ** 2 * d * b**2, (sigma, float(s))
            else:
                total = sum(b * b for b in exact)
                for s in stds:
                    assert _frac(s) ** 2 >= Fraction(sigma) ** 2 * total, (sigma, float(s))
    # the constant bound itself: sqrt(2) X_0 with X_0 = 1
    _, bounds32, _ = _bounds_and_stds(models[0], TauCrossEntropy(), 1.0, strategy)
    assert _frac(bounds32[0]) ** 2 >= 2


def test_zero_noise_multiplier_gives_zero_stds():
    model = nn.Sequential(BoundedInput(1.0), LipschitzLinear(6, 3))
    for strategy in ("per-layer", "global"):
        assert (Clipless(0.0, 0.1, 100, strategy=strategy).noise_stds(model) == 0).all()


def test_bounds_of_a_trained_projected_model_stay_above_the_gradients():
    """After projected steps the bounds (rounded up) still cover the per-example gradients (a smoke check that the
    rounding changes nothing else)."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(8)
    model = _cnn()
    loss = TauCrossEntropy(2.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(2):
        x = torch.randn(16, 1, 8, 8) * 3
        x[0] = 0.0
        y = torch.randint(0, 3, (16,))
        bounds = lipschitz_bounds(model, loss)
        params = {n: p.detach() for n, p in model.named_parameters()}
        by_name = dict(model.named_parameters())

        def one(ps, xi, yi):
            return loss(functional_call(model, ps, (xi.unsqueeze(0),)), yi.unsqueeze(0)).sum()

        grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        for n, g in grads.items():
            norms = g.reshape(g.shape[0], -1).norm(dim=1)
            assert torch.isfinite(norms).all() and norms.max() <= bounds[by_name[n]] * (1 + 1e-5)
        optimizer.zero_grad()
        loss(model(x), y).sum().backward()
        optimizer.step()
        project_(model)
