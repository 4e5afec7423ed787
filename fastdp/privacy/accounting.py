"""Privacy accounting for DP-SGD-style training: a thin fastdp API over Google's ``dp-accounting``.

What is accounted
    Each recorded step is one **Poisson-subsampled Gaussian mechanism**: every example joins the batch
    independently with probability ``sample_rate`` (q), the released quantity is a **sum** of per-example
    contributions with L2 sensitivity Delta, and Gaussian noise of std ``noise_multiplier * Delta`` (sigma * Delta)
    is added to that sum. The noise multiplier is dimensionless: noise std divided by sensitivity, both in the
    same units (sum units; dividing both by the expected batch size B for a mean gradient does not change sigma).

Adjacency
    **Add/remove-one** (``dp_accounting``'s default ``NeighboringRelation.ADD_OR_REMOVE_ONE``): neighbouring
    datasets differ by the presence of one example, and Delta is the add/remove sensitivity (the clip norm C in
    standard DP-SGD). For replace-one adjacency the sensitivity of a sum doubles: pass ``noise_multiplier / 2``.

Mechanisms
    ``"rdp"``: Renyi DP of the sampled Gaussian (Mironov et al. 2019), ``dp_accounting.rdp.RdpAccountant``.
    ``"pld"``: privacy loss distributions (tighter), ``dp_accounting.pld.PLDAccountant``.
    All privacy math comes from ``dp-accounting``; this module only validates, records and composes events.

Per-layer noise
    :func:`effective_noise_multiplier` / :func:`per_layer_noise_multiplier` turn per-tensor noise
    (Béthune et al. 2024 §1.7) into the single multiplier to pass to :meth:`PrivacyAccountant.step`.

Bounded noise
    fastdp's Gaussian noise is a sum of 4 Box-Muller draws with bounded radius, so its support is bounded too; an
    output of the run with one example can then be impossible without it. :func:`truncation_delta` bounds the
    probability of such outputs over a run (a delta to add to the accountant's); the trainer refuses a run where it
    exceeds delta / 100 and reports epsilon at delta minus it (``docs/privacy-randomness.md``).

zCDP and GDP helpers
    :func:`zcdp_rho`, :func:`zcdp_to_epsilon`, :func:`gdp_mu` and :func:`gdp_to_epsilon` reproduce the accountants of
    the backprop-clipping paper (Stevens et al. 2022) and its repository, **for reporting and comparison only**.
    They are not used to claim fastdp's guarantee (zCDP there has no subsampling amplification; the GDP CLT is an
    asymptotic approximation, not an upper bound).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MECHANISMS",
    "PrivacyAccountant",
    "check_delta_for_data",
    "effective_noise_multiplier",
    "gdp_mu",
    "gdp_to_epsilon",
    "get_noise_multiplier",
    "per_layer_noise_multiplier",
    "solve_noise_multiplier",
    "truncation_delta",
    "zcdp_rho",
    "zcdp_to_epsilon",
]

MECHANISMS = ("rdp", "pld")
_STATE_VERSION = 1
_CACHE_SIZE = 64


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------------------------


def _real(value: Any, name: str) -> float:
    """``value`` as a float; ``ValueError`` for non-numbers, booleans and NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a real number, got NaN")
    return value


def _count(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; ``ValueError`` for floats, booleans and smaller values."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}"
        ) from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def _check_noise_multiplier(noise_multiplier: Any) -> float:
    sigma = _real(noise_multiplier, "noise_multiplier")
    if sigma < 0:
        raise ValueError(
            f"noise_multiplier must be >= 0 (noise std / add-remove sensitivity; math.inf for noise only), got {sigma}"
        )
    return sigma


def _check_sample_rate(sample_rate: Any, allow_zero: bool = True) -> float:
    q = _real(sample_rate, "sample_rate")
    low_ok = q >= 0 if allow_zero else q > 0
    if not (low_ok and q <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(
            f"sample_rate must be in {interval} (Poisson sampling probability, expected batch size / dataset size), "
            f"got {q}"
        )
    return q


def _check_delta(delta: Any) -> float:
    d = _real(delta, "delta")
    if not 0 < d < 1:
        raise ValueError(f"delta must satisfy 0 < delta < 1 (typically well below 1/dataset size), got {d}")
    return d


def _check_mechanism(mechanism: Any) -> str:
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown accountant mechanism {mechanism!r}; choose one of {MECHANISMS}")
    return mechanism


def _jl():
    """``fastdp.privacy.jl`` (imported here: it builds on this module's validation helpers)."""
    from fastdp.privacy import jl

    return jl


def _check_projections(projections: Any) -> float:
    return _jl()._check_projections(projections)


# ----------------------------------------------------------------------------------------------------------------
# dp-accounting bridge
# ----------------------------------------------------------------------------------------------------------------


def _dp_accounting():
    """Import ``dp_accounting`` lazily so that ``import fastdp`` works without it."""
    try:
        import dp_accounting
        import dp_accounting.pld
        import dp_accounting.rdp
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fastdp.privacy.accounting needs Google's dp-accounting package: pip install dp-accounting"
        ) from err
    return dp_accounting


def _is_costly(sigma: float, q: float, n: int) -> bool:
    """Whether a run spends privacy: finite noise, a non-empty sampling probability and at least one step."""
    return n > 0 and q > 0 and not math.isinf(sigma)


PLD_INTERVAL = 1e-4  # dp_accounting's PLDAccountant default value discretization: every reported epsilon uses it
COARSE_PLD_INTERVAL = 1e-3  # calibration's search only (get_noise_multiplier): 10x faster, also pessimistic


@functools.lru_cache(maxsize=32)
def _sampled_gaussian_pld(sigma: float, q: float, interval: float = PLD_INTERVAL):
    """The PLD of one Poisson-subsampled Gaussian step, as ``dp_accounting.pld.PLDAccountant`` builds it (add/remove,
    pessimistic discretization of the privacy loss with ``interval``), cached: building it is most of an epsilon's
    cost (``get_epsilon`` every epoch)."""
    pld = _dp_accounting().pld.privacy_loss_distribution
    return pld.from_gaussian_mechanism(standard_deviation=sigma, value_discretization_interval=interval,
                                       sampling_prob=q)  # fmt: skip


def _epsilon(
    runs: Sequence[tuple[float, float, int, float]], delta: float, mechanism: str, interval: float = PLD_INTERVAL
) -> float:
    """Epsilon of the composition of ``runs`` ``(sigma, q, n, r)`` at ``delta``, from a fresh dp-accounting
    accountant; r is the JL projections of the run's norm estimates (``math.inf``: a Gaussian mechanism).

    Runs that cost nothing (sigma = inf, q = 0 or n = 0) are left out; a run with sigma = 0 and q > 0 releases
    an un-noised sum, so epsilon is infinite.
    """
    costly = [(s, q, n, r) for s, q, n, r in runs if _is_costly(s, q, n)]
    if not costly:
        return 0.0
    if any(s == 0 for s, _, _, _ in costly):
        return math.inf
    if any(math.isfinite(r) for *_, r in costly):
        return _jl().jl_epsilon_of_runs([(s, q, r, n) for s, q, n, r in costly], delta, mechanism=mechanism)
    dpa = _dp_accounting()
    if mechanism == "pld":  # what dp_accounting's PLDAccountant composes, with each run's one-step PLD cached
        pld = functools.reduce(lambda a, b: a.compose(b), [_sampled_gaussian_pld(s, q, interval).self_compose(n)
                                                           for s, q, n, _ in costly])  # fmt: skip
        return float(pld.get_epsilon_for_delta(delta))
    event = dpa.dp_event.ComposedDpEvent(
        [
            dpa.dp_event.SelfComposedDpEvent(
                dpa.dp_event.PoissonSampledDpEvent(q, dpa.dp_event.GaussianDpEvent(s)),
                n,
            )
            for s, q, n, _ in costly
        ]
    )
    if mechanism == "rdp":
        accountant = dpa.rdp.RdpAccountant()
    else:
        accountant = dpa.pld.PLDAccountant()
    # dp-accounting's RDP warns (absl) for every order whose series does not converge at small sigma and
    # large q, and drops that order: the minimum over fewer orders is an epsilon at least as large, so the
    # result stays an upper bound. The warnings would flood calibration logs; keep errors only.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))
    finally:
        absl_logger.setLevel(level)


# ----------------------------------------------------------------------------------------------------------------
# Accountant
# ----------------------------------------------------------------------------------------------------------------


class PrivacyAccountant:
    """Records Poisson-subsampled Gaussian steps and reports (epsilon, delta)-DP under add/remove-one adjacency.

    One step releases ``sum_{i in batch} g_i + N(0, (sigma * Delta)^2 I)`` where each example joins the batch
    independently with probability q and ``||g_i||_2 <= Delta`` (add/remove sensitivity of the sum). The history
    is kept as run-length entries ``(sigma, q, n)``; consecutive steps with equal (sigma, q) are merged.

    Args:
        mechanism: ``"rdp"`` (Renyi DP, ``dp_accounting.rdp.RdpAccountant``) or ``"pld"`` (privacy loss
            distributions, ``dp_accounting.pld.PLDAccountant``; tighter, slower).
    """

    def __init__(self, mechanism: str = "rdp") -> None:
        self._mechanism = _check_mechanism(mechanism)
        self._history: list[tuple[float, float, int, float]] = []  # (sigma, q, n, r)
        self._cache: dict[tuple, float] = {}

    @property
    def mechanism(self) -> str:
        """``"rdp"`` or ``"pld"``, fixed at construction."""
        return self._mechanism

    def __repr__(self) -> str:
        return f"PrivacyAccountant(mechanism={self.mechanism!r}, steps={self.steps}, runs={len(self._history)})"

    def step(
        self, noise_multiplier: float, sample_rate: float, num_steps: int = 1, projections: float = math.inf
    ) -> None:
        """Record ``num_steps`` Poisson-subsampled Gaussian steps (or DP-SGD-JL steps, given ``projections``).

        Args:
            noise_multiplier: sigma = noise std / add-remove L2 sensitivity of the noised sum (dimensionless),
                ``>= 0``; ``math.inf`` records noise-only steps with no privacy cost; ``0`` with ``q > 0`` means
                no privacy at all (``get_epsilon`` then returns ``math.inf``).
            sample_rate: Poisson sampling probability q in [0, 1] (expected batch size / dataset size).
            num_steps: number of steps, an integer >= 0 (0 records nothing).
            projections: JL projections r behind the steps' clip factors (DP-SGD-JL, Bu et al. 2021): the step is then
                dominated by a Gaussian mechanism whose sensitivity (chi2_r / r)^(-1/2) C is random
                (``fastdp.privacy.jl``); only the ``"pld"`` mechanism can account it. ``math.inf``: exact norms.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _count(num_steps, "num_steps", 0)
        r = _check_projections(projections)
        if math.isfinite(r):
            _jl().check_jl_mechanism(self.mechanism)
        self._append(sigma, q, n, r)

    def _append(self, sigma: float, q: float, n: int, r: float = math.inf) -> None:
        if n == 0:
            return
        last = self._history[-1] if self._history else None
        if last is not None and (last[0], last[1], last[3]) == (sigma, q, r):
            self._history[-1] = (sigma, q, last[2] + n, r)
        else:
            self._history.append((sigma, q, n, r))

    @property
    def steps(self) -> int:
        """Total number of steps recorded (all runs, including noise-only ones)."""
        return sum(run[2] for run in self._history)

    @property
    def history(self) -> list[tuple]:
        """A copy of the recorded runs, oldest first: ``(noise_multiplier, sample_rate, num_steps)``, with a fourth
        entry ``projections`` for DP-SGD-JL runs."""
        return [run[:3] if math.isinf(run[3]) else run for run in self._history]

    def get_epsilon(self, delta: float) -> float:
        """Epsilon such that all recorded steps together are (epsilon, delta)-DP under add/remove-one adjacency.

        Builds one ``ComposedDpEvent`` of ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)),
        n)`` runs and asks a fresh dp-accounting accountant of this accountant's mechanism. Returns 0.0 when no
        step has a privacy cost and ``math.inf`` when a step has sigma = 0 and q > 0. Results are cached.

        Args:
            delta: the delta of (epsilon, delta)-DP, 0 < delta < 1.
        """
        delta = _check_delta(delta)
        key = (len(self._history), self._history[-1] if self._history else None, delta)
        if key not in self._cache:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = _epsilon(self._history, delta, self.mechanism)
        return self._cache[key]

    def state_dict(self) -> dict:
        """JSON-serialisable state: ``{"mechanism": str, "history": [[sigma, q, n], ...], "version": 1}``.

        ``sigma = math.inf`` is written by Python's ``json`` module as ``Infinity`` and read back as ``inf``.
        """
        return {
            "mechanism": self.mechanism,
            "history": [list(run) for run in self.history],
            "version": _STATE_VERSION,
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with the one in ``state`` (from :meth:`state_dict`, possibly via JSON).

        Raises ``ValueError`` (leaving this accountant unchanged) when the state is not a dict with the keys
        ``mechanism``, ``history`` and ``version``, has another version or mechanism, or holds an invalid entry.
        """
        if not isinstance(state, dict):
            raise ValueError(f"accountant state must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("mechanism", "history", "version") if k not in state]
        if missing:
            raise ValueError(f"corrupt accountant state: missing key(s) {missing}; expected the dict from state_dict()")
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"unsupported accountant state version {state['version']!r}; this fastdp reads version {_STATE_VERSION}"
            )
        if state["mechanism"] != self.mechanism:
            raise ValueError(
                f"accountant state was written by a {state['mechanism']!r} accountant, but this accountant uses "
                f"{self.mechanism!r}; create PrivacyAccountant({state['mechanism']!r}) to load it"
            )
        history = state["history"]
        if not isinstance(history, (list, tuple)):
            raise ValueError(f"corrupt accountant state: history must be a list, got {type(history).__name__}")
        runs = []
        for i, entry in enumerate(history):
            if not isinstance(entry, (list, tuple)) or len(entry) not in (3, 4):
                raise ValueError(
                    f"corrupt accountant state: history[{i}] = {entry!r}, expected [noise_multiplier, sample_rate, "
                    "num_steps] or, for DP-SGD-JL, [noise_multiplier, sample_rate, num_steps, projections]"
                )
            try:
                runs.append(
                    (
                        _check_noise_multiplier(entry[0]),
                        _check_sample_rate(entry[1]),
                        _count(entry[2], "num_steps", 0),
                        _check_projections(entry[3]) if len(entry) == 4 else math.inf,
                    )
                )
            except ValueError as err:
                raise ValueError(f"corrupt accountant state: history[{i}] = {entry!r}: {err}") from None
            if math.isfinite(runs[-1][3]) and self.mechanism == "rdp":
                raise ValueError(f"corrupt accountant state: history[{i}] = {entry!r} is a DP-SGD-JL run in an 'rdp' "
                                 "accountant (RDP cannot account it)")  # fmt: skip
        self._history = []
        self._cache = {}
        for run in runs:
            self._append(*run)


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------


def check_delta_for_data(delta: float, num_examples: int, allow_large: bool, how_to_allow: str, data: str = "") -> None:
    """Refuse ``delta >= 1/N`` for N training examples unless ``allow_large``: publishing one example chosen at random,
    verbatim, is (0, 1/N)-DP, so such a delta permits releasing an example outright. ``how_to_allow`` names the
    caller's switch; ``data`` (e.g. " of breast_cancer") names the data set in the message."""
    n = num_examples
    if delta >= 1 / n and not allow_large:
        raise ValueError(
            f"delta={delta:g} is >= 1/N = 1/{n} = {1 / n:.3g} for the {n} training examples{data}: publishing one "
            "training example chosen at random, verbatim, is (0, 1/N)-DP, so a delta this large permits releasing an "
            f"example outright. Use a delta well below 1/N (e.g. 1e-5, or 1/(10 N) = {0.1 / n:.3g}), or pass "
            f"{how_to_allow} if you know why you need it (e.g. to compare with a paper that used delta = 1/N)"
        )


def get_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    max_noise_multiplier: float = 1e4,
    projections: float = math.inf,
) -> float:
    """Smallest-ish noise multiplier sigma such that ``steps`` Poisson-subsampled Gaussian steps (DP-SGD-JL steps
    with ``projections`` r, given a finite r) are (target_epsilon, delta)-DP under add/remove-one adjacency.

    Bisection on sigma (epsilon decreases with sigma). The result satisfies
    ``(1 - epsilon_tolerance) * target_epsilon <= epsilon(sigma) <= target_epsilon``; if epsilon(sigma) jumps
    over that window (it can for the discretised PLD), the smallest sigma found with ``epsilon <= target`` is
    returned.

    Args:
        target_epsilon: epsilon budget, finite and > 0.
        delta: 0 < delta < 1.
        sample_rate: Poisson sampling probability q in (0, 1].
        steps: number of steps, integer >= 1.
        accountant: ``"rdp"`` or ``"pld"``.
        epsilon_tolerance: relative slack below the target, in (0, 1).
        max_noise_multiplier: largest sigma tried; ``ValueError`` if even it does not reach the target.
        projections: JL projections r of DP-SGD-JL (``"pld"`` only); ``math.inf``: exact norms.

    Returns:
        sigma = noise std / add-remove sensitivity of the noised sum.
    """
    eps_target = _real(target_epsilon, "target_epsilon")
    if not (eps_target > 0 and math.isfinite(eps_target)):
        raise ValueError(f"target_epsilon must be finite and > 0, got {eps_target}")
    delta = _check_delta(delta)
    q = _check_sample_rate(sample_rate, allow_zero=False)
    steps = _count(steps, "steps", 1)
    accountant = _check_mechanism(accountant)
    r = _check_projections(projections)
    if math.isfinite(r):
        _jl().check_jl_mechanism(accountant)
    tol = _real(epsilon_tolerance, "epsilon_tolerance")
    if not 0 < tol < 1:
        raise ValueError(f"epsilon_tolerance must be in (0, 1) (relative slack below the target), got {tol}")
    sigma_max = _real(max_noise_multiplier, "max_noise_multiplier")
    if not (sigma_max > 0 and math.isfinite(sigma_max)):
        raise ValueError(f"max_noise_multiplier must be finite and > 0, got {sigma_max}")

    def epsilon(sigma: float) -> float:
        return _epsilon([(sigma, q, steps, r)], delta, accountant)

    def unreachable(eps_at_max: float) -> ValueError:
        return ValueError(
            f"unreachable: target_epsilon={eps_target} with delta={delta}, sample_rate={q}, steps={steps} "
            f"({accountant}) needs a noise multiplier above max_noise_multiplier={sigma_max} "
            f"(which gives epsilon={eps_at_max:.4g}); use fewer steps, a smaller sample rate, or a larger epsilon"
        )

    if accountant == "pld" and not math.isfinite(r):
        # search with a coarser (also pessimistic) discretization, then check the result with the reported one:
        # within the target there (the usual case: coarser is more pessimistic), it is returned
        def coarse(sigma: float) -> float:
            return _epsilon([(sigma, q, steps, r)], delta, accountant, COARSE_PLD_INTERVAL)

        sigma = solve_noise_multiplier(coarse, eps_target, (1 - tol) * eps_target, sigma_max=sigma_max,
                                       unreachable=unreachable)  # fmt: skip
        if epsilon(sigma) <= eps_target:
            return sigma
    return solve_noise_multiplier(epsilon, eps_target, (1 - tol) * eps_target, sigma_max=sigma_max,
                                  unreachable=unreachable)  # fmt: skip


def solve_noise_multiplier(
    epsilon,
    target: float,
    low_enough: float,
    base: float = 0.0,
    sigma_max: float = 1e4,
    unreachable=None,
) -> float:
    """The smallest-ish sigma with ``low_enough <= epsilon(sigma) <= target``, for ``epsilon`` decreasing in sigma
    from infinity (sigma -> 0) to ``base < low_enough`` (sigma -> infinity; 0 for steps alone, the epsilon of fixed
    releases composed with them otherwise). If epsilon jumps over the window, the smallest sigma found within the
    target is returned. ``unreachable(epsilon at sigma_max)`` makes the error raised when even ``sigma_max`` does not
    reach the target. The one calibration loop of fastdp (:func:`get_noise_multiplier`, the trainer)."""
    aim = 0.5 * (low_enough + target)  # middle of the accepted window, in log space close enough

    def gap(eps: float) -> float | None:
        """log((eps - base) / (aim - base)): the root-finding residual, None where it is not finite."""
        return math.log((eps - base) / (aim - base)) if base < eps < math.inf else None

    # Bracket [lo, hi] with eps(lo) > target >= eps(hi), doubling from sigma = 1 (lo = 0 means eps = inf).
    lo, gap_lo = 0.0, None
    sigma = min(1.0, sigma_max)
    while True:
        e = epsilon(sigma)
        if e <= target:
            hi, eps_hi, gap_hi = sigma, e, gap(e)
            break
        if sigma >= sigma_max:
            if unreachable is None:
                raise ValueError(f"unreachable: epsilon {target:.4g} needs a noise multiplier above {sigma_max:g} "
                                 f"(which gives {e:.4g})")  # fmt: skip
            raise unreachable(e)
        lo, gap_lo = sigma, gap(e)
        sigma = min(2 * sigma, sigma_max)
    if eps_hi >= low_enough:
        return hi

    # Shrink the bracket: Illinois regula falsi on log(eps - base) against log(sigma) (close to a power law in
    # sigma), falling back to bisection where a residual is not finite. Stop once eps(hi) is in the window.
    kept = 0  # +1: hi was kept on the last step, -1: lo was kept
    bisect = False  # after a step that did not halve the bracket, bisect once so the bracket always shrinks
    for _ in range(200):
        width = hi - lo
        if width <= 1e-7 * hi:
            break  # epsilon jumps across [low_enough, target]: keep the smallest sigma found within budget
        if not bisect and lo > 0 and gap_lo is not None and gap_hi is not None and gap_lo > gap_hi:
            x_lo, x_hi = math.log(lo), math.log(hi)
            mid = math.exp(x_hi - gap_hi * (x_hi - x_lo) / (gap_hi - gap_lo))
            margin = 1e-3 * (hi - lo)
            mid = min(max(mid, lo + margin), hi - margin)
        else:
            mid = 0.5 * (lo + hi)
        e = epsilon(mid)
        if e <= target:
            hi, eps_hi, gap_hi = mid, e, gap(e)
            if e >= low_enough:
                break
            if kept == -1 and gap_lo is not None:
                gap_lo /= 2  # Illinois: lo kept twice in a row
            kept = -1
        else:
            lo, gap_lo = mid, gap(e)
            if kept == 1 and gap_hi is not None:
                gap_hi /= 2  # Illinois: hi kept twice in a row
            kept = 1
        bisect = not bisect and hi - lo > 0.5 * width
    return hi


# ----------------------------------------------------------------------------------------------------------------
# Per-layer noise
# ----------------------------------------------------------------------------------------------------------------


def effective_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
    """Single noise multiplier equivalent to per-layer Gaussian noise released together (Béthune et al. 2024 §1.7).

    Layer l releases a sum with add/remove L2 sensitivity Delta_l plus noise ``N(0, (sigma_l * Delta_l)^2 I)``.
    Whitening each layer by its noise std turns the joint release into one isotropic Gaussian mechanism with
    noise std 1 and sensitivity ``sqrt(sum_l Delta_l^2 / (sigma_l Delta_l)^2) = sqrt(sum_l sigma_l^-2)``, i.e. a
    Gaussian with multiplier ``(sum_l sigma_l^-2)^-1/2`` (exactly; D equal sigmas give sigma / sqrt(D)). All
    layers must use the same Poisson-sampled batch; then pass the result to :meth:`PrivacyAccountant.step`.

    Args:
        noise_multipliers: sigma_l > 0 per layer (dimensionless); ``math.inf`` (no data-dependent release)
            contributes nothing.

    Returns:
        The effective multiplier; ``math.inf`` if every entry is infinite.
    """
    sigmas = list(noise_multipliers)
    if not sigmas:
        raise ValueError("noise_multipliers is empty; expected one noise multiplier per noised tensor")
    precision = 0.0
    for i, value in enumerate(sigmas):
        sigma = _real(value, f"noise_multipliers[{i}]")
        if sigma <= 0:
            raise ValueError(
                f"noise_multipliers[{i}] must be > 0 (noise std / sensitivity of that tensor), got {sigma}; "
                "a tensor released without noise has no privacy"
            )
        precision += sigma**-2  # inf ** -2 == 0.0
    return math.inf if precision == 0 else precision**-0.5


def per_layer_noise_multiplier(sensitivities: Sequence[float], stds: Sequence[float]) -> float:
    """Effective noise multiplier from per-layer sensitivities and the noise stds actually added.

    Layer l has add/remove L2 sensitivity Delta_l and noise std s_l, both in the same units (e.g. both on the
    summed gradient, or both divided by the expected batch size); sigma_l = s_l / Delta_l and the result is
    ``(sum_l sigma_l^-2)^-1/2 = (sum_l Delta_l^2 / s_l^2)^-1/2`` (see :func:`effective_noise_multiplier`).
    A layer with s_l = 0 is released exactly, so the result is 0.0 (no privacy).

    Args:
        sensitivities: Delta_l > 0, finite.
        stds: s_l >= 0 (``math.inf`` allowed), same length as ``sensitivities``.
    """
    deltas = list(sensitivities)
    noise = list(stds)
    if len(deltas) != len(noise):
        raise ValueError(
            f"sensitivities has {len(deltas)} entries but stds has {len(noise)}; expected one of each per tensor"
        )
    if not deltas:
        raise ValueError("sensitivities and stds are empty; expected one entry per noised tensor")
    sigmas = []
    for i, (d, s) in enumerate(zip(deltas, noise, strict=True)):
        d = _real(d, f"sensitivities[{i}]")
        s = _real(s, f"stds[{i}]")
        if not (d > 0 and math.isfinite(d)):
            raise ValueError(f"sensitivities[{i}] must be finite and > 0 (add/remove L2 sensitivity), got {d}")
        if s < 0:
            raise ValueError(f"stds[{i}] must be >= 0 (noise standard deviation), got {s}")
        sigmas.append(s / d)
    if any(sigma == 0 for sigma in sigmas):
        return 0.0
    return effective_noise_multiplier(sigmas)


# ----------------------------------------------------------------------------------------------------------------
# Bounded noise: the probability of outputs that are impossible without an example
# ----------------------------------------------------------------------------------------------------------------

# One Box-Muller pair has radius sqrt(-2 ln u) with u >= 2**-33: at most sqrt(2 * 33 * ln 2) = 6.7637; 6.77 covers the
# rounding of fp32 logarithms. The released value is (n1 + n2 + n3 + n4) / 2 (fastdp.privacy.rng.NOISE_DRAWS), so a
# pair of released coordinates has radius <= 4 R / 2 = 2 R (in units of the noise std).
BOX_MULLER_RADIUS = 6.77
NOISE_SUPPORT_RADIUS = 2 * BOX_MULLER_RADIUS
# Each of the 4 draws is a 2-D standard normal conditioned on radius <= R, a set of probability Z = 1 - 2**-33; its
# density is at most the Gaussian's divided by Z, so the 4-draw sum's density is at most the Gaussian's / Z**4.
_TRUNCATED_MASS = (1 - 2.0**-33) ** 4
_JL_BINS = 2000


def _truncation_beta(shift: float, pairs: int) -> float:
    """Per-step bound for a whitened shift ``shift`` (= ||Delta|| / noise std) over ``pairs`` coordinate pairs."""
    two_r = NOISE_SUPPORT_RADIUS
    if not shift < two_r - 1:
        return 1.0
    small = pairs * math.exp(-((two_r - 1) ** 2) / 2)  # pairs shifted by at most 1
    large = shift**2 * math.exp(-((two_r - shift) ** 2) / 2)  # fewer than shift**2 pairs shifted by more than 1
    return min(1.0, (small + large) / _TRUNCATED_MASS)


@functools.lru_cache(maxsize=64)
def _truncation_beta_jl(sigma: float, r: float, pairs: int) -> float:
    """Per-step bound for DP-SGD-JL: the shift is max(1, Z) / sigma with Z = (chi2_r / r)^(-1/2) (the clip factor's
    overshoot, Bu et al. 2021), random per step. Z is rounded up to the top of geometric bins between 1 and
    (2R - 1) sigma (the bound grows with the shift), and Z above that counts as an impossible output (bound 1)."""
    from scipy import stats

    z_top = (NOISE_SUPPORT_RADIUS - 1) * sigma
    if z_top <= 1:
        return 1.0
    chi2 = stats.chi2(r)
    edges = np.geomspace(1.0, z_top, _JL_BINS + 1)
    above = chi2.cdf(r / edges**2)  # P(Z > z): accurate where small (the heavy upper tail of Z)
    beta = float(chi2.sf(r)) * _truncation_beta(1 / sigma, pairs)  # P(Z <= 1): shift <= 1 / sigma
    for mass, z in zip(-np.diff(above), edges[1:], strict=True):
        beta += float(mass) * _truncation_beta(z / sigma, pairs)
    return min(1.0, beta + float(above[-1]))


def truncation_delta(noise_multiplier: float, steps: int, num_coordinates: int, projections: float = math.inf) -> float:
    """Upper bound on the probability that a run with fastdp's bounded (4-draw) noise gives an output that is
    impossible without one of its examples: a delta to add to the accountant's (``docs/privacy-randomness.md``).

    Per step, with whitened shift D = 1 / sigma (the example moves the noiseless sum by at most sensitivity / noise
    std; per-layer noise: sigma is the effective multiplier the accountant records) and R = 6.77 (one Box-Muller
    pair's radius, fp32 rounding included), each pair of released coordinates has radius <= 2R = 13.54, and an output
    is impossible without the example only if some pair p, shifted by delta_p (sum delta_p^2 <= D^2), has noise radius
    above 2R - delta_p. The 4-draw sum's density is at most the Gaussian's / Z^4 (Z = 1 - 2^-33), whose pair radius
    exceeds t with probability exp(-t^2 / 2). At most ``num_coordinates`` pairs have delta_p <= 1, fewer than D^2 have
    delta_p > 1 (each delta_p <= D), so

        beta = [d exp(-(2R - 1)^2 / 2) + D^2 exp(-(2R - D)^2 / 2)] / Z^4     (D < 2R - 1; else 1)

    and ``steps`` steps give at most ``steps * beta`` (a union over the steps, no subsampling factor). DP-SGD-JL
    (finite ``projections`` r): D = max(1, Z) / sigma with Z = (chi2_r / r)^(-1/2) random per step; beta is its
    expectation with Z rounded up into geometric bins and Z > (2R - 1) sigma counted as 1.

    Args:
        noise_multiplier: sigma >= 0 (0: the bound is 1; ``math.inf``: 0).
        steps: number of released steps, an integer >= 0.
        num_coordinates: d, the number of noised coordinates per release (trainable parameters), >= 1.
        projections: JL projections r, or ``math.inf`` for exact norms.

    Returns:
        min(1, steps * beta).
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    steps = _count(steps, "steps", 0)
    pairs = _count(num_coordinates, "num_coordinates", 1)
    r = _check_projections(projections)
    if steps == 0 or math.isinf(sigma):
        return 0.0
    if sigma == 0:
        return 1.0
    beta = _truncation_beta(1 / sigma, pairs) if math.isinf(r) else _truncation_beta_jl(sigma, r, pairs)
    return min(1.0, steps * beta)


# ----------------------------------------------------------------------------------------------------------------
# zCDP and GDP (reporting / comparison with Stevens et al. 2022 only)
# ----------------------------------------------------------------------------------------------------------------


def zcdp_rho(noise_multiplier: float, steps: int) -> float:
    """rho of ``steps`` Gaussian mechanisms in zero-concentrated DP: ``rho = steps / (2 sigma^2)``.

    This is the **paper's** accountant in Stevens et al. 2022 (Bun & Steinke Prop. 1.3; Theorem 1): a Gaussian with
    add/remove sensitivity Delta and noise std sigma * Delta is 1/(2 sigma^2)-zCDP, and zCDP composes additively.
    **No subsampling amplification**: the paper uses disjoint batches and parallel composition, so its
    ``steps`` is epochs x noised tensors (E * N), not the number of batches. For reporting only.

    Args:
        noise_multiplier: sigma >= 0 (inf gives 0; 0 with steps > 0 gives inf).
        steps: number of composed Gaussian mechanisms, integer >= 0.
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    steps = _count(steps, "steps", 0)
    if steps == 0 or math.isinf(sigma):
        return 0.0
    if sigma == 0:
        return math.inf
    return steps / (2 * sigma**2)


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """(epsilon, delta)-DP implied by rho-zCDP: ``epsilon = rho + 2 sqrt(rho log(1/delta))``.

    The conversion used by the backprop-clipping **paper** (Stevens et al. 2022 Prop. 1; Bun & Steinke Prop. 1.3) and
    its original repository's ``zcdp_eps``. For reporting only.

    Args:
        rho: zCDP parameter >= 0.
        delta: 0 < delta < 1.
    """
    rho = _real(rho, "rho")
    if rho < 0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    delta = _check_delta(delta)
    if math.isinf(rho):
        return math.inf
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def gdp_mu(noise_multiplier: float, sample_rate: float, steps: int) -> float:
    """mu of Poisson-subsampled Gaussian DP-SGD by the central limit theorem of f-DP (Bu et al. 2020, Dong et al.).

    ``mu = q sqrt(steps (exp(sigma^-2) - 1))``. This is the **corrected repository's** accountant in Stevens et al. 2022
    (commit 9c99855, adapted from Opacus), where ``steps`` counts batches x epochs x noised parameter tensors.
    An asymptotic approximation, not an upper bound: for reporting only.

    Args:
        noise_multiplier: sigma >= 0 (inf gives 0; 0 with q, steps > 0 gives inf).
        sample_rate: Poisson sampling probability q in [0, 1].
        steps: number of steps, integer >= 0.
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sample_rate(sample_rate)
    steps = _count(steps, "steps", 0)
    if steps == 0 or q == 0 or math.isinf(sigma):
        return 0.0
    if sigma == 0:
        return math.inf
    try:
        growth = math.expm1(sigma**-2)
    except OverflowError:
        return math.inf
    return q * math.sqrt(steps * growth)


def gdp_to_epsilon(mu: float, delta: float) -> float:
    """Epsilon of mu-GDP at ``delta``: the root of ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.

    mu-GDP (Dong, Roth & Su) is (eps, delta(eps))-DP for every eps >= 0 with the delta(eps) above, which
    decreases in eps; this solves it by Brent's method, as the corrected Stevens et al. 2022 repository does.
    Returns 0.0 when ``delta >= delta(0) = 2 Phi(mu/2) - 1``. For reporting only.

    Args:
        mu: GDP parameter >= 0.
        delta: 0 < delta < 1.
    """
    mu = _real(mu, "mu")
    if mu < 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    delta = _check_delta(delta)
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    from scipy.optimize import brentq
    from scipy.special import log_ndtr

    def excess(eps: float) -> float:
        # e^eps Phi(x) evaluated as exp(eps + log Phi(x)) so that neither factor overflows or underflows.
        return math.exp(log_ndtr(-eps / mu + mu / 2)) - math.exp(eps + log_ndtr(-eps / mu - mu / 2)) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = max(1.0, mu * mu)
    while excess(hi) > 0:
        hi *= 2
        if hi > 1e6:
            return math.inf  # pragma: no cover - needs mu of order 1e3
    return float(brentq(excess, 0.0, hi, xtol=1e-12, rtol=1e-12))
