"""fastdp.privacy.jl: the DP-SGD-JL accountant (papers/03 §2.3, §5 check 5-6).

Reference values are one step without subsampling at delta = 1e-5 (papers/03 §2.3 table), and an independent
scipy quadrature of the mixture ``delta(eps) = E_{c ~ chi2_r}[delta_N(eps; sqrt(r / c) / sigma)]``. The accountant
is an upper bound, so it may sit above the references (by its binning of the sensitivity, about 0.3-0.5 % in
epsilon) but never below them beyond float rounding.
"""

import math
from itertools import pairwise

import numpy as np
import pytest

pytest.importorskip("dp_accounting")
stats = pytest.importorskip("scipy.stats")
special = pytest.importorskip("scipy.special")
integrate = pytest.importorskip("scipy.integrate")

from dp_accounting.pld import pld_pmf  # noqa: E402
from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType, GaussianPrivacyLoss  # noqa: E402

from fastdp.privacy import jl  # noqa: E402
from fastdp.privacy.accounting import PrivacyAccountant, get_noise_multiplier  # noqa: E402
from fastdp.privacy.jl import (  # noqa: E402
    JL_MAX_MU,
    check_jl_mechanism,
    jl_epsilon,
    jl_epsilon_of_runs,
    jl_privacy_loss_distribution,
    jl_tail_mass,
)

DELTA = 1e-5

# papers/03 §2.3: single step, no subsampling, delta = 1e-5 (sigma, r, epsilon); the whole table.
PAPER_EPS = [
    (1.0, 5, 78.41),
    (1.0, 10, 12.08),
    (1.0, 30, 5.585),
    (1.0, 100, 4.676),
    (1.0, math.inf, 4.377),
    (2.0, 5, 20.61),
    (2.0, 10, 4.302),
    (2.0, 30, 2.425),
    (2.0, 100, 2.104),
    (2.0, math.inf, 1.993),
]


def gaussian_delta(eps, mu):
    """delta_N(eps; mu) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), the Gaussian mechanism's curve."""
    return special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2)


def mixture_delta(eps, sigma, r):
    """E_{c ~ chi2_r}[delta_N(eps; sqrt(r / c) / sigma)] by adaptive quadrature, split where the integrand lives."""

    def integrand(c):
        return stats.chi2.pdf(c, r) * gaussian_delta(eps, math.sqrt(r / c) / sigma)

    cuts = [0.0, *(r * np.geomspace(1e-5, 1.0, 16)), 3.0 * r, math.inf]
    return sum(integrate.quad(integrand, a, b, limit=200, epsabs=0.0, epsrel=1e-10)[0] for a, b in pairwise(cuts))


# ----------------------------------------------------------------------------------------------------------------
# Unit values (papers/03 §5 check 5)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sigma", "r", "expected"), PAPER_EPS)
def test_single_step_matches_paper(sigma, r, expected):
    eps = jl_epsilon(sigma, 1.0, r, 1, DELTA)
    assert expected * (1 - 0.002) <= eps <= expected * 1.01, f"sigma={sigma} r={r}: {eps} vs paper {expected}"


@pytest.mark.parametrize(
    ("sigma", "r", "epsilons"),
    [(1.0, 10, [1.0, 5.0, 12.0]), (2.0, 10, [1.0, 5.0]), (1.0, 5, [1.0, 10.0, 100.0]), (1.0, 30, [1.0, 5.0])],
)
def test_delta_upper_bounds_mixture_integral(sigma, r, epsilons):
    pld = jl_privacy_loss_distribution(sigma, 1.0, r)
    for eps in epsilons:
        exact = mixture_delta(eps, sigma, r)
        ours = float(pld.get_delta_for_epsilon(eps))
        assert ours >= exact * (1 - 1e-9), f"sigma={sigma} r={r} eps={eps}: accountant {ours} < integral {exact}"
        assert ours <= exact * 1.05, f"sigma={sigma} r={r} eps={eps}: accountant {ours} far above integral {exact}"


def test_heavy_tail_matches_paper():
    """papers/03 §2.3: at sigma = 1, r = 5, delta(eps) = 2.01e-1, 2.04e-3, 5.40e-6 for eps = 1, 10, 100."""
    pld = jl_privacy_loss_distribution(1.0, 1.0, 5)
    for eps, expected in [(1.0, 2.01e-1), (10.0, 2.04e-3), (100.0, 5.40e-6)]:
        delta = float(pld.get_delta_for_epsilon(eps))
        assert expected * 0.995 <= delta <= expected * 1.03, f"eps={eps}: {delta} vs {expected}"


def test_epsilon_decreases_in_r_and_converges():
    eps = {r: jl_epsilon(1.0, 1.0, r, 1, DELTA) for r in (5, 10, 30, 100, 1000, math.inf)}
    values = list(eps.values())
    assert all(a > b for a, b in pairwise(values)), eps
    assert eps[1000] <= eps[math.inf] * 1.015, eps  # r -> inf approaches the Gaussian mechanism


# ----------------------------------------------------------------------------------------------------------------
# Subsampled composition (papers/03 §5 check 6)
# ----------------------------------------------------------------------------------------------------------------


def test_exact_norms_match_gaussian_pld_accountant():
    sigma, q, n = 1.0, 0.01, 100
    reference = PrivacyAccountant("pld")
    reference.step(sigma, q, n)
    expected = reference.get_epsilon(DELTA)
    eps = jl_epsilon(sigma, q, math.inf, n, DELTA)
    assert expected * (1 - 1e-3) <= eps <= expected * 1.01, f"{eps} vs PrivacyAccountant('pld') {expected}"


def test_subsampled_epsilon_above_gaussian_and_decreasing_in_r():
    sigma, q, n = 1.0, 0.01, 100
    reference = PrivacyAccountant("pld")
    reference.step(sigma, q, n)
    gaussian = reference.get_epsilon(DELTA)
    eps = [jl_epsilon(sigma, q, r, n, DELTA) for r in (5, 10, 30, 100)]
    assert all(a > b for a, b in pairwise(eps)), eps
    assert eps[-1] > gaussian, (eps, gaussian)


@pytest.mark.parametrize("r", [10, math.inf])
def test_sampling_rate_one_reduces_to_unsubsampled(r):
    """The q < 1 path (separate add and remove curves) tends to the q = 1 path (one symmetric curve)."""
    full = jl_epsilon(1.0, 1.0, r, 1, DELTA)
    almost = jl_epsilon(1.0, 1 - 1e-9, r, 1, DELTA, value_discretization_interval=1e-3)
    assert almost == pytest.approx(full, rel=1e-3)
    assert jl_epsilon(1.0, 0.5, r, 1, DELTA) < full


def test_runs_compose_and_merge():
    sigma, q, r = 1.0, 0.01, 30
    whole = jl_epsilon(sigma, q, r, 200, DELTA)
    assert jl_epsilon_of_runs([(sigma, q, r, 120), (sigma, q, float(r), 80)], DELTA) == pytest.approx(whole)
    mixed = jl_epsilon_of_runs([(sigma, q, r, 100), (2.0, q, math.inf, 100)], DELTA)
    assert jl_epsilon(sigma, q, r, 100, DELTA) < mixed < whole
    free = [(math.inf, q, r, 10), (sigma, 0.0, r, 10), (sigma, q, r, 0)]
    assert jl_epsilon_of_runs(free, DELTA) == 0.0
    assert jl_epsilon_of_runs(free + [(sigma, q, r, 200)], DELTA) == pytest.approx(whole)


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------


def test_noise_multiplier_calibration():
    target, q, n, r = 3.0, 0.01, 1000, 30
    sigma = get_noise_multiplier(target, DELTA, q, n, accountant="pld", projections=r)
    eps = jl_epsilon(sigma, q, r, n, DELTA)
    assert 0.99 * target <= eps <= target, f"sigma={sigma}: epsilon {eps}"
    assert sigma > get_noise_multiplier(target, DELTA, q, n, accountant="pld")  # JL needs more noise


def test_noise_multiplier_unreachable():
    with pytest.raises(ValueError, match="unreachable"):
        get_noise_multiplier(1.0, DELTA, 1.0, 1, accountant="pld", projections=1, max_noise_multiplier=2.0)


# ----------------------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------------------


def test_rdp_refused():
    assert check_jl_mechanism("pld") == "pld"
    with pytest.raises(ValueError, match=r"RDP cannot account DP-SGD-JL.*r/2.*use 'pld'"):
        check_jl_mechanism("rdp")
    with pytest.raises(ValueError, match="RDP cannot account DP-SGD-JL"):
        jl_epsilon(1.0, 0.01, 10, 100, DELTA, mechanism="rdp")
    with pytest.raises(ValueError, match="RDP cannot account DP-SGD-JL"):
        get_noise_multiplier(3.0, DELTA, 0.01, 100, accountant="rdp", projections=10)
    with pytest.raises(ValueError, match="unknown accountant mechanism"):
        check_jl_mechanism("moments")


@pytest.mark.parametrize("r", [0, -1, 2.5, math.nan, True, "10", None])
def test_bad_projections(r):
    with pytest.raises(ValueError, match="projections"):
        jl_epsilon(1.0, 0.01, r, 10, DELTA)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(noise_multiplier=0.0), "noise_multiplier"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=math.nan), "noise_multiplier"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(sample_rate=-0.1), "sample_rate"),
        (dict(steps=-1), "steps"),
        (dict(steps=1.5), "steps"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(bins=0), "bins"),
        (dict(value_discretization_interval=0.0), "value_discretization_interval"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = dict(noise_multiplier=1.0, sample_rate=0.01, projections=10, steps=10, delta=DELTA) | kwargs
    with pytest.raises(ValueError, match=match):
        jl_epsilon(**args)


def test_bad_runs():
    with pytest.raises(ValueError, match=r"runs\[0\].*expected \(noise_multiplier, sample_rate, projections, steps\)"):
        jl_epsilon_of_runs([(1.0, 0.01, 100)], DELTA)
    with pytest.raises(ValueError, match=r"runs\[1\].*projections"):
        jl_epsilon_of_runs([(1.0, 0.01, 10, 5), (1.0, 0.01, 0, 5)], DELTA)


def test_integral_projections_accepted():
    assert jl_epsilon(1.0, 1.0, 10.0, 1, DELTA) == jl_epsilon(1.0, 1.0, np.int64(10), 1, DELTA)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks against dp-accounting
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [1.0, 0.3, 0.01, 1e-4])
@pytest.mark.parametrize("mu", [0.05, 1.0, 3.0, JL_MAX_MU])
def test_subsampled_gaussian_curves_match_dp_accounting(q, mu):
    eps = np.concatenate([np.linspace(-45, 5, 151), np.linspace(5, 600, 120)])
    for adjacency, curve in [(AdjacencyType.REMOVE, jl._delta_remove), (AdjacencyType.ADD, jl._delta_add)]:
        ours = curve(eps, np.array([mu]), q)[0]
        reference = GaussianPrivacyLoss(1.0, sensitivity=mu, sampling_prob=q, adjacency_type=adjacency)
        expected = reference.get_delta_for_epsilon(eps)
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-14, err_msg=f"{adjacency} q={q} mu={mu}")


def test_connect_the_dots_matches_dp_accounting():
    index = jl._grid(-3000, 5000)
    assert np.all(np.diff(index) >= 1) and index[0] == -3000 and index[-1] == 5000
    deltas = GaussianPrivacyLoss(1.0, sensitivity=2.0, sampling_prob=0.3).get_delta_for_epsilon(index * 1e-3)
    ours = jl._connect_the_dots(index, deltas, 1e-3)
    expected = pld_pmf.create_pmf_pessimistic_connect_dots(1e-3, index, deltas).to_dense_pmf()
    assert ours._lower_loss == expected._lower_loss
    np.testing.assert_allclose(ours._probs, expected._probs, rtol=0, atol=1e-15)
    assert ours._infinity_mass == pytest.approx(expected._infinity_mass)


def test_tail_mass():
    assert jl_tail_mass(1.0, 10) == pytest.approx(stats.chi2.cdf(10 / JL_MAX_MU**2, 10), rel=1e-12)
    assert 4e-14 < jl_tail_mass(1.0, 10) < 5e-14
    assert jl_tail_mass(2.0, 10) < jl_tail_mass(1.0, 10)
    assert jl_tail_mass(1.0, math.inf) == 0.0
    zs, weights, tail = jl._sensitivity_bins(1.0, 10.0, 200)
    assert zs.max() == pytest.approx(JL_MAX_MU) and tail == pytest.approx(jl_tail_mass(1.0, 10))
    assert weights.sum() + tail == pytest.approx(1.0, abs=1e-15)
