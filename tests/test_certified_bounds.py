"""The cheap certified spectral-norm bounds of the Lipschitz variants (issue 19): the certified Björck step, the
Cholesky-checked estimate, the carried bound, and LipschitzLinear's certificate across steps and tampering."""

import copy
import math
import os
from fractions import Fraction

import pytest
import torch
from torch import nn

import fastdp
from fastdp import _ext
from fastdp.algorithms import Batch, Clipless, WeightClip
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear, project_
from fastdp.ops import certified_bjorck_step, certified_norm_cholesky, frobenius_distance_up
from fastdp.ref.spectral import CHOLESKY_MARGIN


def sigma(w: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(w.detach().double(), 2))


def orthogonal(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    w = torch.empty(rows, cols)
    torch.manual_seed(seed)
    nn.init.orthogonal_(w)
    return w


# ------------------------------------------------------------------------------------------ certified Björck step


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (80, 80), (1, 50), (50, 1), (260, 300), (300, 260)])
@pytest.mark.parametrize("scale", [1.0, 3.0, 0.25])
def test_bjorck_step_bound_holds_and_is_tight_near_orthogonal(shape, scale):
    w = scale * (orthogonal(*shape) + 1e-3 * torch.randn(shape) / math.sqrt(max(shape)))
    out, bound = certified_bjorck_step(w, scale)
    assert bound.dtype == torch.float64 and out.shape == w.shape and out.dtype == w.dtype
    assert sigma(out) <= float(bound) <= scale * (1 + 2e-3)
    s = torch.linalg.svdvals(out.double())
    assert (s / scale - 1).abs().max() < 1e-5  # one step: the deviation squared


@pytest.mark.parametrize("start", ["huge", "gaussian", "rank-one", "tiny", "zero"])
def test_bjorck_step_never_leaves_the_ball_from_any_start(start):
    gen = torch.Generator().manual_seed(1)
    w = {"huge": 1e20 * torch.randn(30, 40, generator=gen), "gaussian": 3 * torch.randn(30, 40, generator=gen),
         "rank-one": torch.outer(torch.randn(30, generator=gen), 5 * torch.randn(40, generator=gen)),
         "tiny": 1e-30 * torch.randn(30, 40, generator=gen), "zero": torch.zeros(30, 40)}[start]  # fmt: skip
    for _ in range(3):
        w, bound = certified_bjorck_step(w, 2.0)
        assert torch.isfinite(w).all() and sigma(w) <= float(bound) <= 2.0 * (1 + 1e-3)


def test_bjorck_step_converges_to_orthogonal_from_a_far_start():
    w = 5 * torch.randn(24, 40, generator=torch.Generator().manual_seed(2))
    for _ in range(25):
        w, bound = certified_bjorck_step(w, 1.0)
    s = torch.linalg.svdvals(w.double())
    assert (s - 1).abs().max() < 1e-5 and float(bound) < 1 + 1e-4


def test_bjorck_step_ignores_reduced_precision_settings():
    """TF32/bf16 products would void the rounding bound: the op runs IEEE float32 whatever the global setting."""
    w = orthogonal(64, 64) + 0.01 * torch.randn(64, 64)
    reference = certified_bjorck_step(w, 1.0)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        out, bound = certified_bjorck_step(w, 1.0)
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.equal(out, reference[0]) and torch.equal(bound, reference[1])


def test_bjorck_step_non_finite_weights_give_an_infinite_bound():
    w = torch.randn(8, 8)
    w[2, 3] = float("nan")
    assert math.isinf(float(certified_bjorck_step(w, 1.0)[1]))


@pytest.mark.parametrize(("w", "scale", "match"), [
    (torch.randn(4, 4, dtype=torch.float16), 1.0, "float32 or float64"),
    (torch.randn(4, 4), 0.0, "scale"),
    (torch.randn(4, 4), math.inf, "scale"),
    (torch.randn(4), 1.0, "2-D"),
])  # fmt: skip
def test_bjorck_step_refuses_bad_input(w, scale, match):
    with pytest.raises((TypeError, ValueError), match=match):
        certified_bjorck_step(w, scale)


# ----------------------------------------------------------------------------------- Cholesky-checked estimate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_bound_holds_and_is_within_its_margin(dtype):
    gen = torch.Generator().manual_seed(3)
    for shape in [(40, 70), (70, 40), (1, 9), (33, 33)]:
        w = torch.randn(shape, generator=gen).to(dtype)
        bound, vector = certified_norm_cholesky(w)
        assert vector.shape == (min(shape),)
        # the claim is theta (1 + margin) >= lambda_max = sigma^2, with theta <= lambda_max
        assert sigma(w) <= float(bound) <= sigma(w) * math.sqrt(1 + CHOLESKY_MARGIN) * (1 + 1e-9)


def test_cholesky_check_fails_to_infinity_on_a_bad_estimate_never_below():
    """One Lanczos step from a vector orthogonal to the top singular vector underestimates: the factorisation of
    theta' I - a fails and the bound is +inf (the caller's carried certificate covers it), never a low number."""
    u = torch.linalg.qr(torch.randn(20, 20, generator=torch.Generator().manual_seed(4), dtype=torch.float64)).Q
    w = (u * torch.linspace(1, 10, 20, dtype=torch.float64)) @ u.T
    bound, _ = certified_norm_cholesky(w, u[:, 0], steps=1)
    assert math.isinf(float(bound))
    assert float(certified_norm_cholesky(w)[0]) >= sigma(w)


def test_cholesky_zero_and_non_finite():
    assert float(certified_norm_cholesky(torch.zeros(5, 7))[0]) >= 0
    w = torch.randn(5, 7)
    w[0, 0] = float("inf")
    assert math.isinf(float(certified_norm_cholesky(w)[0]))


# ---------------------------------------------------------------------------------------------- carried bound


@pytest.fixture(params=["torch", "cuda"])
def distance_backend(request, monkeypatch, restore_backend):
    """The CPU Frobenius distance from the torch reference or from fastdp._C's one-pass kernel (``cuda``; a
    failure when FASTDP_REQUIRE_EXT=1 and it was not built, else a skip); the kernel's calls are counted."""
    calls = []
    if request.param == "cuda":
        kernel = getattr(_ext._C, "frobenius_distance_sq", None)
        if kernel is None:
            if os.environ.get("FASTDP_REQUIRE_EXT") == "1":
                pytest.fail("fastdp._C must be built with frobenius_distance_sq for this run")
            pytest.skip("fastdp._C without the Frobenius distance kernel")

        class Counting:
            def __getattr__(self, name):
                return getattr(_ext._C, name)

            def frobenius_distance_sq(self, a, b):
                calls.append(a.shape)
                return kernel(a, b)

        monkeypatch.setattr(_ext, "_C", Counting())
    fastdp.set_backend(request.param)
    return request.param, calls


def exact_distance_sq(a: torch.Tensor, b: torch.Tensor) -> Fraction:
    return sum((Fraction(float(x)) - Fraction(float(y))) ** 2 for x, y in zip(a.flatten(), b.flatten(), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_frobenius_distance_is_exactly_zero_for_equal_tensors_and_above_the_exact_value(distance_backend, dtype):
    gen = torch.Generator().manual_seed(5)
    span = 20 if dtype in (torch.float32, torch.bfloat16) else (100 if dtype == torch.float64 else 2)
    f64 = dict(generator=gen, dtype=torch.float64)
    a = (torch.randn(7, 5, **f64) * torch.logspace(-span, span, 5, dtype=torch.float64)).to(dtype)  # many binades
    b = a + (torch.randn(7, 5, **f64) * torch.logspace(-span - 10, span - 10, 5, dtype=torch.float64)).to(dtype)
    assert float(frobenius_distance_up(a, a)) == 0.0
    exact = exact_distance_sq(a, b)
    bound = Fraction(float(frobenius_distance_up(a, b)))
    assert bound**2 >= exact and bound**2 <= exact * (1 + Fraction(1, 10**9))
    backend, calls = distance_backend
    assert len(calls) == (2 if backend == "cuda" else 0)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 32768, 32768 * 3 + 13])
def test_frobenius_distance_kernel_chunks_lanes_and_layouts(distance_backend, size):
    """Sizes around the kernel's 8 lanes and 32768-element chunks, a transposed (non-contiguous) pair, and the
    differences that underflow when squared: the bound is above the exact distance, within 1e-9 of it."""
    gen = torch.Generator().manual_seed(size)
    a = torch.randn(size, generator=gen, dtype=torch.float64)
    b = a + torch.randn(size, generator=gen, dtype=torch.float64) * 1e-3
    exact = torch.linalg.vector_norm(a - b).item()  # to 1e-15: far inside the checked 1e-9
    assert exact <= frobenius_distance_up(a, b).item() <= exact * (1 + 1e-9)
    if size > 1:
        m = a[: size - size % 7].reshape(7, -1).T  # [cols, 7], strides (1, cols)
        n = b[: size - size % 7].reshape(7, -1).T
        exact = torch.linalg.vector_norm(m - n).item()
        assert exact <= frobenius_distance_up(m, n).item() <= exact * (1 + 1e-9)
    small = a * 1e-170
    tiny = small * (1 + 1e-3)  # differences ~1e-173: their squares underflow to 0
    assert (tiny != small).any() and ((tiny - small) ** 2 == 0).all()
    assert frobenius_distance_up(small, tiny).item() > 0.0
    backend, calls = distance_backend
    assert len(calls) == ((3 if size > 1 else 2) if backend == "cuda" else 0)


def test_frobenius_distance_non_finite_and_shape_errors(distance_backend):
    a = torch.randn(3, 3)
    for bad in (float("nan"), float("inf"), -float("inf")):
        b = a.clone()
        b[1, 1] = bad
        assert math.isinf(float(frobenius_distance_up(a, b))) and math.isinf(float(frobenius_distance_up(b, a)))
    both = a.clone()
    both[0, 0] = float("inf")
    assert math.isinf(float(frobenius_distance_up(both, both.clone())))  # inf - inf is NaN: not 0
    with pytest.raises(ValueError, match="shapes differ"):
        frobenius_distance_up(a, torch.randn(3, 4))
    assert float(frobenius_distance_up(torch.empty(0, 3), torch.empty(0, 3))) == 0.0


# ------------------------------------------------------------------------------------ LipschitzLinear certificate


def test_certificate_is_carried_and_covers_weights_changed_behind_its_back():
    layer = LipschitzLinear(30, 20)
    first = layer.lipschitz()  # no certificate yet: the Gram iteration, which becomes it
    assert sigma(layer.weight) <= float(first) <= 1 + 1e-3
    assert torch.equal(layer.lipschitz(), first)  # unchanged weights: the same bound, for a difference of 0
    with torch.no_grad():
        layer.weight.data.add_(0.2 * torch.randn(20, 30))  # .data: no version bump, no hook
    assert float(layer.lipschitz()) >= sigma(layer.weight) > float(first)
    layer.weight.data = layer.weight.data.double()  # another dtype: the certificate no longer fits, recomputed
    assert float(layer.lipschitz()) >= sigma(layer.weight)
    layer.weight = nn.Parameter(5 * torch.randn(20, 30))  # a new parameter altogether
    assert float(layer.lipschitz()) >= sigma(layer.weight)


@pytest.mark.parametrize("projection", ["clip", "fixed"])
def test_rescaling_projection_certifies_its_result(projection):
    layer = LipschitzLinear(30, 20, bias=True, projection=projection, max_norm=1.5)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    layer.project_()
    bound = float(layer.lipschitz())
    assert sigma(layer.weight) <= bound <= 1.5 * (1 + 2.0**-8)
    assert sigma(layer.weight) >= 1.5 * (1 - 2.0**-8)  # rescaled to C, not below it by more than the margin


def test_legacy_power_iteration_vector_in_a_state_dict_is_ignored():
    """A checkpoint from before the certificates: its `_u` is dropped, the certificate entries are absent."""
    layer = LipschitzLinear(6, 4)
    state = {"weight": layer.weight.detach().clone(), "_u": torch.ones(6)}
    layer.load_state_dict(state)  # strict: the old buffer dropped, the missing entries filled, no error
    assert layer._certificate is None and float(layer.lipschitz()) >= sigma(layer.weight)


def test_deepcopy_keeps_a_valid_certificate():
    layer = LipschitzLinear(12, 12)
    layer.lipschitz()
    clone = copy.deepcopy(layer)
    with torch.no_grad():
        clone.weight.mul_(2.0)
    assert float(clone.lipschitz()) >= sigma(clone.weight)


@pytest.mark.parametrize("variant_cls", [Clipless, WeightClip])
def test_every_release_bound_holds_during_training_with_large_steps(variant_cls):
    """At every release the bound the noise is calibrated to is >= the float64 SVD of the weights it describes, with
    steps larger than the weights (lr 3) and a tampered weight in the middle."""
    torch.manual_seed(6)
    if variant_cls is Clipless:
        model = nn.Sequential(BoundedInput(3.0), LipschitzLinear(10, 16), GroupSort2(), LipschitzLinear(16, 3))
    else:
        model = nn.Sequential(BoundedInput(3.0), LipschitzLinear(10, 16, bias=True, projection="clip"), nn.ReLU(),
                              LipschitzLinear(16, 3, bias=True, projection="clip"))  # fmt: skip
    variant = variant_cls(1.0, sample_rate=0.5, num_examples=16, reproducible_seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=3.0)
    layers = [m for m in model if isinstance(m, LipschitzLinear)]
    for step in range(8):
        batch = Batch(3 * torch.randn(8, 10), torch.randint(0, 3, (8,)), torch.ones(8, dtype=torch.bool))
        for layer in layers:
            assert float(layer.lipschitz()) >= sigma(layer.weight)
        variant.gradient(model, batch, step)
        optimizer.step()
        if step == 4:
            layers[0].weight.data[0, 0] = 40.0
        for layer in layers:
            assert float(layer.lipschitz()) >= sigma(layer.weight)
        variant.after_step(model)
    for layer in layers:
        assert sigma(layer.weight) <= float(layer.lipschitz()) <= 1 + 1e-2


def test_orthogonal_projection_keeps_a_trained_layer_orthogonal_with_one_step_per_update():
    """Small updates (the clipless regime): one Björck step per training step keeps every singular value at 1."""
    layer = LipschitzLinear(300, 300)  # 300^3 multiply-adds: above the automatic budget, one step
    assert layer.bjorck_steps == 1
    for _ in range(5):
        with torch.no_grad():
            layer.weight.add_(1e-3 * torch.randn(300, 300))
        project_(layer)
        s = torch.linalg.svdvals(layer.weight.double())
        assert (s - 1).abs().max() < 5e-3  # the update moves singular values by ~0.035, one step leaves ~its square


# -------------------------------------------------------------------------------- certificates in a state dict


def test_certify_norm_at_most_accepts_true_bounds_and_refuses_low_ones():
    from fastdp.ops import certify_norm_at_most

    gen = torch.Generator().manual_seed(7)
    for shape in [(40, 70), (3, 8), (64, 64)]:
        w = torch.randn(shape, generator=gen)
        s = sigma(w)
        assert bool(certify_norm_at_most(w, s * (1 + 1e-9)))
        assert not bool(certify_norm_at_most(w, s * (1 - 1e-9)))
        assert not bool(certify_norm_at_most(w, math.nan))
        assert not bool(certify_norm_at_most(w, -1.0))


def test_a_saved_certificate_is_adopted_only_when_it_holds_for_the_loaded_weights():
    layer = LipschitzLinear(20, 12)
    with torch.no_grad():
        layer.weight.add_(0.01 * torch.randn(12, 20))
    project_(layer)
    state = layer.state_dict()
    fresh = LipschitzLinear(20, 12)
    fresh.load_state_dict(state)
    assert fresh._certificate is not None and torch.equal(fresh.lipschitz(), layer.lipschitz())  # resumed exactly
    tampered = dict(state, _certified_norm=torch.tensor(0.5, dtype=torch.float64))  # a bound below the norm
    victim = LipschitzLinear(20, 12)
    victim.load_state_dict(tampered)
    assert victim._certificate is None  # refused: the bound is recomputed from the weights
    assert float(victim.lipschitz()) >= sigma(victim.weight) > 0.5
    swapped = dict(state, weight=3 * state["weight"])  # weights that the saved bound does not cover
    victim.load_state_dict(swapped)
    assert float(victim.lipschitz()) >= sigma(victim.weight)


def test_a_saved_snapshot_carries_its_bound_and_a_forged_one_cannot_lower_it():
    """Saved between projections, the state dict holds the weights the bound certifies (the snapshot): the loaded
    layer carries bound + ||W - snapshot||_F exactly as the saved one did; a forged snapshot (zeros, with the bound 0
    that it does satisfy) is proven and then carries ||W||_F, still above ||W||_2."""
    torch.manual_seed(3)
    layer = LipschitzLinear(20, 12)
    layer.lipschitz()
    with torch.no_grad():
        layer.weight.add_(0.05 * torch.randn(12, 20))  # a step without projection: the carried bound
    state = layer.state_dict()
    assert not torch.equal(state["_certified_weight"], state["weight"])
    fresh = LipschitzLinear(20, 12)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.lipschitz(), layer.lipschitz())
    forged = dict(state, _certified_weight=torch.zeros(12, 20), _certified_norm=torch.zeros((), dtype=torch.float64))
    victim = LipschitzLinear(20, 12)
    victim.load_state_dict(forged)
    assert float(victim.lipschitz()) >= sigma(victim.weight)
    for bad in (torch.zeros(3, 3), torch.zeros(12, 20, dtype=torch.float64), "x"):  # unusable: the weights instead
        victim.load_state_dict(dict(state, _certified_weight=bad))
        assert float(victim.lipschitz()) >= sigma(victim.weight)
