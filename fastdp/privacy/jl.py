"""Privacy accounting for DP-SGD-JL (per-example norms estimated from r JL projections; Bu et al. 2021 §2.3, App. B).

What is accounted
    One step of DP-SGD-JL (Bu et al. 2021 Alg. 1/4) with r Gaussian projections ``v_1..v_r`` shared by the batch, clip
    norm C, noise std ``noise_multiplier * C`` (sigma * C) on the **sum** of the re-weighted per-example gradients,
    Poisson sampling with rate q, **add/remove-one** adjacency. The clip factor ``min(1, C / M_0)`` of the added or
    removed example uses the JL estimate ``M_0 = ||g_0|| sqrt(chi2_r / r)``, so its contribution can exceed C.
    Theorem B.7 (Bu et al. 2021) dominates the step by the pair

        (Z, N(Z, sigma^2))  vs  (Z, N(0, sigma^2)),        Z = Z_r = 1 / sqrt(chi2_r / r),

    in which Z is **revealed**: its law is the same in both worlds and independent of the data (the proof reveals
    the projections, hence ``M_0 / ||g_0||``). Its privacy loss distribution (PLD) is therefore the **mixture over
    Z** of the PLDs of the Poisson-subsampled Gaussian mechanism with sensitivity Z and noise std sigma (noise
    multiplier sigma / Z), weighted by the law of Z; without subsampling
    ``delta(eps) = E_{c ~ chi2_r}[delta_N(eps; mu = sqrt(r / c) / sigma)]`` with
    ``delta_N(eps; mu) = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)``. Steps compose by convolving PLDs
    (dp-accounting's FFT composition); ``r = math.inf`` (exact norms) is the plain subsampled Gaussian and agrees
    with ``fastdp.privacy.accounting.PrivacyAccountant("pld")``.

What is *not* the JL mechanism
    dp-accounting's ``MixtureGaussianPrivacyLoss`` / ``from_mixture_gaussian_mechanism`` models a **hidden** random
    sensitivity: the output is a mixture of Gaussians whose centre is random and unobserved. That is not what
    Theorem B.7 proves for JL: its proof reveals the projections ``v_j`` (the other examples' clip factors depend
    on the same ``v_j``), so Z is observed, and a hidden mixture is strictly more private than the revealed one.
    Using it would **under-report epsilon**; this module never does.

Why no RDP
    The JL privacy loss has moments only of order below r / 2 (Bu et al. 2021 §2.1: ``delta(eps) ~ eps^(-r/2)``), so
    Renyi DP of the step is infinite at every order worth using; :func:`check_jl_mechanism` refuses ``"rdp"``.

How the upper bound is built (every approximation below is pessimistic)
    1. **Sensitivity bins.** Z is cut into ``bins`` bins spaced geometrically between its 1e-6 quantile and
       ``z_max``; each bin's probability goes to the **largest** Z of the bin (the lowest bin also takes Z below
       the 1e-6 quantile). A larger sensitivity is worse by Lemma B.6 (a coupling with Z >= Z'), so rounding Z up
       is an upper bound. Its cost is a relative rounding of the sensitivity by the bin ratio
       ``(z_max / z_low)^(1/bins)`` (about 0.4 % for r = 10, sigma = 1 and the default 1000 bins). Measured
       against the exact mixture (delta = 1e-5): one step without subsampling, epsilon is 0.34 % high for r = 10
       (sigma = 1 and 2), 0.2 % for r = 30, 0.4 % for r = 5; 1000 steps at q = 0.01, sigma = 1 are about 0.5 % high
       (r = 10 and 30). At a fixed epsilon, delta is 0.3-5 % high (it falls like eps^(-r/2)). The excess halves
       with each doubling of ``bins`` (and the time doubles).
    2. **Tail.** Z above ``z_max = JL_MAX_MU * sigma`` (mu = Z / sigma above ``JL_MAX_MU`` = 30) is treated as an
       infinite sensitivity: removing the example then reveals it whenever it is sampled (loss +inf with
       probability q, dp-accounting's infinity mass), adding it gives loss ``-log(1 - q)``. Its probability is
       ``P(chi2_r < r / z_max^2)`` (:func:`jl_tail_mass`): at sigma = 1 about 2.7e-2 for r = 1, 1.1e-3 for r = 2,
       1.2e-7 for r = 5, 4.4e-14 for r = 10, 7.8e-27 for r = 20 and 1.6e-39 for r = 30; it shrinks fast with sigma
       (r = 10, sigma = 2: 4.3e-17). Per step it adds q times that to delta, so r <= 2 mostly gives epsilon = inf
       (their true curves fall like eps^(-1/2) and eps^(-1): no useful epsilon either). mu = 30 keeps every
       component representable: its losses reach about mu^2 / 2 + 12 mu = 810. Z beyond its 1 - 1e-30 quantile is
       also sent to the tail (negligible mass).
    3. **PLD discretisation** (dp-accounting's "connect the dots", Doroshenko et al. 2022, which is an upper bound
       for any set of grid points): the mixed hockey-stick curve ``delta(eps) = sum_k w_k delta_k(eps)`` is
       evaluated on loss grid points that are multiples of ``value_discretization_interval`` (Delta): every
       multiple of Delta for |loss| <= 1000 Delta, then a relative spacing of 1e-3 (e.g. 0.1 at loss 100), which
       the heavy tail needs and a Gaussian of width >= 1 does not notice. Losses below -50 are moved up to -50
       (probability <= e^-50); the part of delta above the last grid point (<= 1e-24) is infinity mass.
       :func:`jl_epsilon` ends the grid earlier, where delta falls below ``1e-3 * delta / steps`` (rounded down to
       a power of 10): all steps together then move at most 1e-3 * delta to the infinity mass, and the heavy tail
       no longer sets the array length. The default Delta is ``clip(q / 10, 1e-4, 1e-3)``; with Delta = 1e-3 the
       Gaussian (r = inf) epsilon of q = 0.01, sigma = 1, 1000 steps is 0.04 % above the Delta = 1e-4 value, while
       Delta = 1e-3 at q = 0.001 would be 1.7 % high (hence q / 10). Smaller Delta: tighter, slower, more memory.
    4. ``r = math.inf`` uses the same construction with Z = 1 (one bin); sigma < 1 / JL_MAX_MU then counts as an
       infinite sensitivity too (epsilon = inf), a regime of no practical use.

    Step PLDs are cached per (sigma, q, r, Delta, bins, tail cut). Measured on 2 CPU cores: a step PLD takes
    0.3-0.7 s (r >= 10, q >= 0.01; r = 5 about 1.5 s), so one step at sigma = 1, or 1000 steps at q = 0.01 with
    r = 10, cost about 0.6 s in all; 10000 steps at q = 0.001, r = 10 (Delta = 1e-4) about 2.5 s; r = 5 there
    about 17 s (its tail is heavy). Calibration (``fastdp.privacy.accounting.get_noise_multiplier`` with
    ``projections=r``) needs several such evaluations.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from fastdp.privacy.accounting import _check_delta, _check_sample_rate, _count, _real

__all__ = [
    "JL_MAX_MU",
    "check_jl_mechanism",
    "jl_epsilon",
    "jl_epsilon_of_runs",
    "jl_privacy_loss_distribution",
    "jl_tail_mass",
    "jl_z_floor",
]

JL_MAX_MU = 30.0  # largest mu = Z / sigma given a Gaussian component; larger Z goes to the infinity mass
DEFAULT_BINS = 1000

_Z_LOW_QUANTILE = 1e-6  # Z below its 1e-6 quantile is rounded up into the lowest bin
_Z_NEGLIGIBLE = 1e-30  # Z above its 1 - 1e-30 quantile joins the tail even when z_max is larger
_TAIL_SDS = 12.0  # grid reaches mu^2/2 + 12 mu for the largest component: delta there <= Phi(-12) ~ 2e-33
_TRIM_DELTA = 1e-24  # grid ends at the first point where the mixed delta is below this (the rest -> infinity)
_MIN_LOSS = -50.0  # losses below are moved up to here (their probability is <= e^-50)
_RELATIVE_SPACING = 1e-3  # grid spacing max(Delta, 1e-3 |loss|)
_BIN_CHUNK = 32  # bins evaluated together (memory: chunk x grid points)
_CACHE_SIZE = 8  # step PLDs; each up to ~800 / Delta floats


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


def check_jl_mechanism(mechanism: Any) -> str:
    """Return ``"pld"`` if ``mechanism`` can account DP-SGD-JL; ``ValueError`` otherwise.

    Only privacy loss distributions can: the JL step's privacy loss has moments only of order below r / 2
    (Bu et al. 2021 §2.1), so RDP (and the moments accountant) cannot bound it, and a Gaussian RDP accountant with the
    same sigma under-reports epsilon.
    """
    if mechanism == "rdp":
        raise ValueError(
            "RDP cannot account DP-SGD-JL: its privacy loss has only moments below r/2 (Bu et al. 2021 §2.1), so Renyi "
            "DP does not bound it and a Gaussian RDP accountant under-reports epsilon; use 'pld'"
        )
    if mechanism != "pld":
        raise ValueError(f"unknown accountant mechanism {mechanism!r} for DP-SGD-JL; use 'pld'")
    return mechanism


def _check_projections(projections: Any) -> float:
    """r as a float: an integer >= 1 (int, or an integral float such as 10.0), or ``math.inf`` for exact norms."""
    what = "projections (JL dimension r) must be an integer >= 1, or math.inf for exact norms"
    if isinstance(projections, bool):
        raise ValueError(f"{what}; got {projections!r}")
    if isinstance(projections, numbers.Real) and not isinstance(projections, numbers.Integral):
        r = float(projections)
        if r == math.inf:
            return r
        if not (math.isfinite(r) and r.is_integer()):
            raise ValueError(f"{what}; got {projections!r}")
        projections = int(r)
    try:
        r = operator.index(projections)
    except TypeError:
        raise ValueError(f"{what}; got {projections!r} of type {type(projections).__name__}") from None
    if r < 1:
        raise ValueError(f"{what}; got {r}")
    return float(r)


def _check_sigma(noise_multiplier: Any) -> float:
    sigma = _real(noise_multiplier, "noise_multiplier")
    if not sigma > 0:
        raise ValueError(
            f"noise_multiplier must be > 0 (noise std / clip norm on the summed gradient; math.inf for noise "
            f"only), got {sigma}"
        )
    return sigma


def _check_interval(value: Any, q: float) -> float:
    """The PLD grid step Delta: ``None`` gives ``clip(q / 10, 1e-4, 1e-3)``."""
    if value is None:
        return min(max(q / 10, 1e-4), 1e-3)
    d = _real(value, "value_discretization_interval")
    if not 1e-6 <= d <= 0.1:
        raise ValueError(
            f"value_discretization_interval must be in [1e-6, 0.1] (privacy-loss grid step; about q / 10 keeps "
            f"the composition tight), got {d}"
        )
    return d


def _check_runs(runs: Iterable[Any]) -> list[tuple[float, float, float, int]]:
    checked = []
    for i, run in enumerate(runs):
        if not isinstance(run, (tuple, list)) or len(run) != 4:
            raise ValueError(f"runs[{i}] = {run!r}; expected (noise_multiplier, sample_rate, projections, steps)")
        sigma, q, r, n = run
        try:
            checked.append((_check_sigma(sigma), _check_sample_rate(q), _check_projections(r), _count(n, "steps", 0)))
        except ValueError as err:
            raise ValueError(f"runs[{i}] = {run!r}: {err}") from None
    return checked


# ----------------------------------------------------------------------------------------------------------------
# Law of the sensitivity Z = 1 / sqrt(chi2_r / r)
# ----------------------------------------------------------------------------------------------------------------


def jl_tail_mass(noise_multiplier: float, projections: float) -> float:
    """``P(Z_r > JL_MAX_MU * sigma) = P(chi2_r < r / (JL_MAX_MU sigma)^2)``: the probability of the JL sensitivity
    that the accountant treats as infinite (per step, delta grows by ``sample_rate`` times this). For r = inf
    (Z = 1) it is 0, or 1 when sigma < 1 / JL_MAX_MU."""
    sigma = _check_sigma(noise_multiplier)
    r = _check_projections(projections)
    if math.isinf(sigma):
        return 0.0
    if math.isinf(r):
        return 0.0 if JL_MAX_MU * sigma >= 1 else 1.0
    from scipy import stats

    return float(stats.chi2.cdf(r / (JL_MAX_MU * sigma) ** 2, r))


def jl_z_floor(projections: float, noise_multiplier: float) -> float:
    """The smallest sensitivity factor the JL accountant credits a step with: the lowest edge of its bins, Z's 1e-6
    quantile ``sqrt(r / chi2_r^-1(1 - 1e-6))`` (or the tail cut when that is lower). Every Z is accounted as at least
    this (smaller Z are rounded up into the lowest bin), so a step whose example moves the sum by at most
    ``C max(Z, jl_z_floor(r, sigma))`` is accounted; DP-SGD-JL uses it to absorb its rounding
    (``fastdp.algorithms.jl.jl_weights``). 1 for exact norms (r = inf)."""
    r, sigma = _check_projections(projections), _check_sigma(noise_multiplier)
    if math.isinf(r):
        return 1.0
    return _z_range(sigma, r)[0]


def _z_range(sigma: float, r: float) -> tuple[float, float]:
    """(z_low, z_cut): the bins' lowest edge and the tail cut (finite r)."""
    from scipy import stats

    chi2 = stats.chi2(r)
    z_cut = min(JL_MAX_MU * sigma, math.sqrt(r / chi2.ppf(_Z_NEGLIGIBLE)))
    return min(math.sqrt(r / chi2.isf(_Z_LOW_QUANTILE)), z_cut), z_cut


def _sensitivity_bins(sigma: float, r: float, bins: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Bin representatives z_k (each the largest Z of its bin), their probabilities w_k, and the tail mass
    ``P(Z > z_k.max())`` that the accountant treats as an infinite sensitivity."""
    if math.isinf(r):  # exact norms: Z = 1
        return (np.ones(1), np.ones(1), 0.0) if JL_MAX_MU * sigma >= 1 else (np.empty(0), np.empty(0), 1.0)
    from scipy import stats

    chi2 = stats.chi2(r)
    z_low, z_cut = _z_range(sigma, r)
    edges = np.geomspace(z_low, z_cut, bins + 1)
    below = chi2.sf(r / edges**2)  # P(Z <= z) = P(chi2_r >= r / z^2): accurate where small (low Z)
    above = chi2.cdf(r / edges**2)  # P(Z > z): accurate where small (the heavy upper tail of Z)
    weights = np.where(above[1:] < 0.5, -np.diff(above), np.diff(below))
    weights[0] += below[0]
    tail = float(above[-1])
    keep = weights > 0
    return edges[1:][keep], weights[keep], tail


# ----------------------------------------------------------------------------------------------------------------
# Hockey-stick curves of the Poisson-subsampled Gaussian (add/remove), vectorised over (bins, epsilons)
# ----------------------------------------------------------------------------------------------------------------


def _log_diff_exp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``exp(a) - exp(b)`` for a >= b, computed as ``exp(a) * (1 - exp(b - a))`` (0 where it would be < 0)."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.exp(a) * -np.expm1(np.minimum(b - a, 0.0))
    return np.where(np.isfinite(out), out, 0.0)


def _delta_remove(eps: np.ndarray, mu: np.ndarray, q: float) -> np.ndarray:
    """delta(eps) of P = (1-q) N(0,1) + q N(mu,1) against Q = N(0,1) (remove one example), shape (bins, eps).

    For eps > log(1-q) the optimal set is {x > x*}, ``x* = mu/2 + log((e^eps - 1 + q) / q) / mu``, and
    ``delta = q Phi(mu - x*) - (e^eps - 1 + q) Phi(-x*)``; for eps <= log(1-q), ``delta = 1 - e^eps``.
    """
    from scipy.special import log_ndtr

    mu = mu[:, None]
    inside = eps > (math.log1p(-q) if q < 1 else -math.inf)
    e = np.where(inside, eps, 1.0)  # placeholder outside, overwritten below
    with np.errstate(divide="ignore"):
        log_a = e + np.log1p(-(1 - q) * np.exp(np.minimum(-e, 700.0)))  # log(e^eps - 1 + q)
    x = mu / 2 + (log_a - math.log(q)) / mu
    delta = _log_diff_exp(math.log(q) + log_ndtr(mu - x), log_a + log_ndtr(-x))
    return np.where(inside, delta, -np.expm1(np.minimum(eps, 0.0)))


def _delta_add(eps: np.ndarray, mu: np.ndarray, q: float) -> np.ndarray:
    """delta(eps) of P = N(0,1) against Q = (1-q) N(0,1) + q N(mu,1) (add one example), shape (bins, eps).

    For eps < -log(1-q) the optimal set is {x < x'}, ``x' = mu/2 + log((e^-eps - 1 + q) / q) / mu``, and
    ``delta = e^eps [(e^-eps - 1 + q) Phi(x') - q Phi(x' - mu)]``; for eps >= -log(1-q), ``delta = 0``.
    """
    from scipy.special import log_ndtr

    mu = mu[:, None]
    inside = eps < (-math.log1p(-q) if q < 1 else math.inf)
    e = np.where(inside, eps, 0.0)
    with np.errstate(divide="ignore"):
        log_b = -e + np.log1p(-(1 - q) * np.exp(np.minimum(e, 700.0)))  # log(e^-eps - 1 + q)
    x = mu / 2 + (log_b - math.log(q)) / mu
    delta = _log_diff_exp(e + log_b + log_ndtr(x), e + math.log(q) + log_ndtr(x - mu))
    return np.where(inside, delta, 0.0)


def _delta_infinite(eps: np.ndarray, q: float, remove: bool) -> np.ndarray:
    """delta(eps) of the subsampled mechanism with infinite sensitivity (the tail of Z).

    Remove: ``q + max(0, 1 - q - e^eps)`` (the example is revealed whenever sampled). Add: ``max(0, 1 - (1-q) e^eps)``.
    """
    with np.errstate(over="ignore"):
        if remove:
            return q + np.maximum(0.0, 1 - q - np.exp(eps))
        return np.maximum(0.0, 1 - (1 - q) * np.exp(eps))


# ----------------------------------------------------------------------------------------------------------------
# Step PLD: mixture over Z on a connect-the-dots grid
# ----------------------------------------------------------------------------------------------------------------


def _grid(lo: int, hi: int) -> np.ndarray:
    """Sorted integer grid indices in [lo, hi] (loss = index * Delta): all integers with |i| <= u, then
    ``ceil(u (1 + 1e-3)^j)`` outward (relative spacing 1e-3), plus lo and hi; ``u = 1 / 1e-3``."""
    u = round(1 / _RELATIVE_SPACING)
    reach = max(abs(lo), abs(hi), u)
    steps = math.ceil(math.log(reach / u) / math.log1p(_RELATIVE_SPACING)) + 1
    outer = np.unique(np.ceil(u * np.exp(np.arange(1, steps + 1) * math.log1p(_RELATIVE_SPACING))).astype(np.int64))
    points = np.concatenate([-outer[::-1], np.arange(-u, u + 1, dtype=np.int64), outer, [lo, hi]])
    points = points[(points >= lo) & (points <= hi)]
    return np.unique(points)


def _connect_the_dots(index: np.ndarray, deltas: np.ndarray, interval: float):
    """Pessimistic connect-the-dots PMF (Doroshenko et al. 2022, Algorithm 1; the same formula as
    ``dp_accounting.pld.pld_pmf.create_pmf_pessimistic_connect_dots``) on the sorted grid ``index * interval``,
    returned as a dense dp-accounting PMF. delta at the last point becomes the infinity mass."""
    from dp_accounting.pld import pld_pmf

    deltas = np.minimum.accumulate(np.clip(deltas, 0.0, 1.0))
    eps_gaps = np.diff(index) * interval
    delta_gaps = np.diff(deltas)
    probs = np.append(1 - deltas[0], delta_gaps / np.expm1(-eps_gaps)) + np.append(delta_gaps / np.expm1(eps_gaps), 0.0)
    probs = np.maximum(probs, 0.0)
    dense = np.zeros(int(index[-1] - index[0]) + 1)
    dense[index - index[0]] = probs
    return pld_pmf.DensePLDPmf(interval, int(index[0]), dense, float(deltas[-1]), True)


def _mixed_pmf(
    mus: np.ndarray,
    weights: np.ndarray,
    tail: float,
    q: float,
    remove: bool,
    lo: int,
    hi: int,
    interval: float,
    trim: float,
):
    """Connect-the-dots PMF of the mixture ``sum_k w_k delta_k + tail * delta_inf`` on the grid [lo, hi], ended
    at the first grid point where the mixed delta is <= ``trim`` (that delta becomes infinity mass)."""
    index = _grid(lo, hi)
    eps = index * interval
    curve = _delta_remove if remove else _delta_add
    mixed = np.zeros(eps.shape)
    for start in range(0, len(mus), _BIN_CHUNK):
        chunk = slice(start, start + _BIN_CHUNK)
        mixed += weights[chunk] @ curve(eps, mus[chunk], q)
    if tail > 0:
        mixed += tail * _delta_infinite(eps, q, remove)
    # End the grid where the mixed delta has become negligible: the rest is infinity mass (pessimistic).
    above = np.nonzero(mixed > trim)[0]
    end = min(len(index), (above[-1] + 2) if len(above) else 1)
    return _connect_the_dots(index[:end], mixed[:end], interval)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _step_pld(sigma: float, q: float, r: float, interval: float, bins: int, trim: float = _TRIM_DELTA):
    """dp-accounting PrivacyLossDistribution of one DP-SGD-JL step (cached); losses whose hockey-stick delta is
    below ``trim`` go to the infinity mass."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    zs, weights, tail = _sensitivity_bins(sigma, r, bins)
    mus = zs / sigma
    mu_top = float(mus.max()) if len(mus) else 0.0
    top = math.ceil((mu_top**2 / 2 + _TAIL_SDS * mu_top + 1) / interval)
    bottom = math.floor(_MIN_LOSS / interval)
    if q < 1:
        remove_lo = max(bottom, math.floor(math.log1p(-q) / interval))
        pmf_remove = _mixed_pmf(mus, weights, tail, q, True, remove_lo, top, interval, trim)
        add_hi = max(math.ceil(-math.log1p(-q) / interval), 1)
        pmf_add = _mixed_pmf(mus, weights, tail, q, False, bottom, add_hi, interval, trim)
        return pld_lib.PrivacyLossDistribution(pmf_remove, pmf_add)
    return pld_lib.PrivacyLossDistribution(_mixed_pmf(mus, weights, tail, q, True, bottom, top, interval, trim))


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def jl_privacy_loss_distribution(
    noise_multiplier: float,
    sample_rate: float,
    projections: float,
    steps: int = 1,
    *,
    value_discretization_interval: float | None = None,
    bins: int = DEFAULT_BINS,
):
    """dp-accounting ``PrivacyLossDistribution`` (pessimistic) of ``steps`` DP-SGD-JL steps (add/remove-one).

    Args:
        noise_multiplier: sigma > 0 = noise std / clip norm C on the summed gradient (finite).
        sample_rate: Poisson sampling probability q in (0, 1].
        projections: JL projections r (integer >= 1), or ``math.inf`` for exact norms (subsampled Gaussian).
        steps: number of steps, integer >= 1.
        value_discretization_interval: privacy-loss grid step Delta; ``None``: ``clip(q / 10, 1e-4, 1e-3)``.
        bins: number of sensitivity bins (geometric in Z; more is tighter and slower).

    Use ``.get_epsilon_for_delta(delta)`` / ``.get_delta_for_epsilon(eps)`` on the result.
    """
    sigma = _check_sigma(noise_multiplier)
    if math.isinf(sigma):
        raise ValueError("noise_multiplier must be finite for a privacy loss distribution (inf costs nothing)")
    q = _check_sample_rate(sample_rate, allow_zero=False)
    r = _check_projections(projections)
    n = _count(steps, "steps", 1)
    interval = _check_interval(value_discretization_interval, q)
    bins = _count(bins, "bins", 1)
    pld = _step_pld(sigma, q, r, interval, bins)
    return pld if n == 1 else pld.self_compose(n)


def jl_epsilon_of_runs(
    runs: Iterable[tuple[float, float, float, int]],
    delta: float,
    *,
    value_discretization_interval: float | None = None,
    bins: int = DEFAULT_BINS,
    mechanism: str = "pld",
) -> float:
    """Epsilon of the composition of DP-SGD-JL runs ``(noise_multiplier, sample_rate, projections, steps)``.

    Each run is ``steps`` steps with the same sigma, q and r (r = ``math.inf``: exact norms, a subsampled
    Gaussian); runs compose in sequence. Runs with sigma = inf, q = 0 or steps = 0 cost nothing. All runs share
    one grid step Delta (``None``: the default of the smallest sample rate). Add/remove-one adjacency; the result
    is an upper bound (see the module docstring).
    """
    check_jl_mechanism(mechanism)
    delta = _check_delta(delta)
    runs = [(s, q, r, n) for s, q, r, n in _check_runs(runs) if n > 0 and q > 0 and not math.isinf(s)]
    if not runs:
        return 0.0
    interval = _check_interval(value_discretization_interval, min(q for _, q, _, _ in runs))
    bins = _count(bins, "bins", 1)
    return _epsilon(tuple(runs), delta, interval, bins)


@functools.lru_cache(maxsize=256)
def _epsilon(runs: tuple, delta: float, interval: float, bins: int) -> float:
    merged: dict[tuple, int] = {}
    for s, q, r, n in runs:
        merged[(s, q, r)] = merged.get((s, q, r), 0) + n
    # Tail losses whose delta is below `trim` become infinity mass: at most 1e-3 * delta over all steps.
    trim = max(_TRIM_DELTA, 10.0 ** math.floor(math.log10(1e-3 * delta / sum(merged.values()))))
    total = None
    for (s, q, r), n in merged.items():
        pld = _step_pld(s, q, r, interval, bins, trim)
        pld = pld if n == 1 else pld.self_compose(n)
        total = pld if total is None else total.compose(pld)
    return float(total.get_epsilon_for_delta(delta))


def jl_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    projections: float,
    steps: int,
    delta: float,
    *,
    value_discretization_interval: float | None = None,
    bins: int = DEFAULT_BINS,
    mechanism: str = "pld",
) -> float:
    """Epsilon of ``steps`` DP-SGD-JL steps at ``delta`` (add/remove-one adjacency; an upper bound).

    Args:
        noise_multiplier: sigma = noise std / clip norm on the summed gradient, > 0 (``math.inf``: no cost).
        sample_rate: Poisson sampling probability q in [0, 1].
        projections: JL projections r, an integer >= 1, or ``math.inf`` for exact norms.
        steps: integer >= 0.
        delta: 0 < delta < 1.
        value_discretization_interval: privacy-loss grid step; ``None``: ``clip(q / 10, 1e-4, 1e-3)``.
        bins: number of sensitivity bins.
        mechanism: must be ``"pld"`` (``"rdp"`` is refused, see :func:`check_jl_mechanism`).
    """
    return jl_epsilon_of_runs(
        [(noise_multiplier, sample_rate, projections, steps)],
        delta,
        value_discretization_interval=value_discretization_interval,
        bins=bins,
        mechanism=mechanism,
    )
