"""fastdp.privacy.accounting: acceptance numbers, agreement with dp-accounting, calibration, state, helpers."""

import json
import math
from itertools import pairwise

import pytest

dp_accounting = pytest.importorskip("dp_accounting")
scipy_stats = pytest.importorskip("scipy.stats")

from dp_accounting import dp_event, rdp  # noqa: E402
from scipy.optimize import brentq  # noqa: E402

from fastdp.privacy.accounting import (  # noqa: E402
    MECHANISMS,
    PrivacyAccountant,
    effective_noise_multiplier,
    gdp_mu,
    gdp_to_epsilon,
    get_noise_multiplier,
    per_layer_noise_multiplier,
    zcdp_rho,
    zcdp_to_epsilon,
)

# Abadi et al. MNIST setting: sigma=1.1, B=256 of N=60000, 60 epochs, delta=1e-5.
MNIST_Q = 256 / 60000
MNIST_STEPS = 14063
MNIST_EPS = {"rdp": 2.5967, "pld": 2.382}
DELTA = 1e-5


def reference_epsilon(runs, delta, mechanism="rdp"):
    """Epsilon straight from dp-accounting for a list of (sigma, q, n) runs."""
    event = dp_event.ComposedDpEvent(
        [
            dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), n)
            for s, q, n in runs
        ]
    )
    acc = rdp.RdpAccountant() if mechanism == "rdp" else dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


# ----------------------------------------------------------------------------------------------------------------
# Acceptance numbers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_mnist_epsilon_one_call(mechanism):
    acc = PrivacyAccountant(mechanism)
    acc.step(1.1, MNIST_Q, MNIST_STEPS)
    eps = acc.get_epsilon(DELTA)
    assert eps == pytest.approx(MNIST_EPS[mechanism], abs=0.01), f"{mechanism}: {eps}"
    assert acc.steps == MNIST_STEPS
    assert acc.history == [(1.1, MNIST_Q, MNIST_STEPS)]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_mnist_epsilon_many_calls_equal_one_call(mechanism):
    one = PrivacyAccountant(mechanism)
    one.step(1.1, MNIST_Q, MNIST_STEPS)
    many = PrivacyAccountant(mechanism)
    for _ in range(MNIST_STEPS // 1000):
        many.step(1.1, MNIST_Q, 1000)
    for _ in range(MNIST_STEPS % 1000):
        many.step(1.1, MNIST_Q)
    many.step(1.1, MNIST_Q, 0)
    assert many.steps == MNIST_STEPS
    assert many.history == one.history, "equal consecutive (sigma, q) must merge into one run"
    assert many.get_epsilon(DELTA) == one.get_epsilon(DELTA)


# ----------------------------------------------------------------------------------------------------------------
# Heterogeneous steps and special values
# ----------------------------------------------------------------------------------------------------------------

HETERO_RUNS = [(1.0, 0.01, 300), (2.0, 0.01, 200), (1.0, 0.02, 100), (1.0, 0.01, 50)]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_heterogeneous_steps_match_dp_accounting(mechanism):
    acc = PrivacyAccountant(mechanism)
    for s, q, n in HETERO_RUNS:
        acc.step(s, q, n)
    assert acc.history == HETERO_RUNS
    assert acc.steps == sum(n for _, _, n in HETERO_RUNS)
    assert acc.get_epsilon(DELTA) == pytest.approx(reference_epsilon(HETERO_RUNS, DELTA, mechanism), rel=1e-9)


def test_epsilon_grows_with_steps_and_is_cached():
    acc = PrivacyAccountant("rdp")
    eps = []
    for _ in range(4):
        acc.step(1.0, 0.01, 100)
        eps.append(acc.get_epsilon(DELTA))
    assert all(a < b for a, b in pairwise(eps)), eps
    assert acc.get_epsilon(DELTA) == eps[-1]
    assert acc.get_epsilon(1e-3) < eps[-1], "epsilon must decrease as delta grows"
    acc.step(2.0, 0.01, 10)
    assert acc.get_epsilon(DELTA) > eps[-1], "cache must not return a stale value after a new run"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_no_costly_steps_give_zero(mechanism):
    acc = PrivacyAccountant(mechanism)
    assert acc.get_epsilon(DELTA) == 0.0
    acc.step(math.inf, 0.5, 10)  # noise only
    acc.step(1.0, 0.0, 10)  # nobody sampled
    acc.step(1.0, 0.5, 0)  # nothing recorded
    assert acc.steps == 20
    assert acc.get_epsilon(DELTA) == 0.0
    acc.step(1.0, 0.01, 100)
    assert acc.get_epsilon(DELTA) == pytest.approx(reference_epsilon([(1.0, 0.01, 100)], DELTA, mechanism), rel=1e-9)


def test_zero_noise_means_no_privacy():
    acc = PrivacyAccountant()
    acc.step(1.0, 0.01, 10)
    acc.step(0.0, 0.01, 1)
    assert acc.get_epsilon(DELTA) == math.inf
    free = PrivacyAccountant()
    free.step(0.0, 0.0, 5)  # sigma = 0 but no one sampled: free
    assert free.get_epsilon(DELTA) == 0.0


def test_history_is_a_copy():
    acc = PrivacyAccountant()
    acc.step(1.0, 0.1, 3)
    acc.history.append((9.0, 0.1, 1))
    assert acc.history == [(1.0, 0.1, 3)]


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------------------------


def test_unknown_mechanism_lists_choices():
    with pytest.raises(ValueError, match=r"prv.*'rdp'.*'pld'"):
        PrivacyAccountant("prv")


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1.0, 0.1, 1), "noise_multiplier must be >= 0"),
        ((math.nan, 0.1, 1), "noise_multiplier must be a real number"),
        (("1.0", 0.1, 1), "noise_multiplier must be a real number"),
        ((1.0, -0.1, 1), r"sample_rate must be in \[0, 1\]"),
        ((1.0, 1.5, 1), r"sample_rate must be in \[0, 1\]"),
        ((1.0, math.nan, 1), "sample_rate must be a real number"),
        ((1.0, 0.1, -1), "num_steps must be an integer >= 0"),
        ((1.0, 0.1, 2.0), "num_steps must be an integer >= 0"),
        ((1.0, 0.1, True), "num_steps must be an integer >= 0"),
    ],
)
def test_step_rejects_bad_inputs(args, match):
    acc = PrivacyAccountant()
    with pytest.raises(ValueError, match=match):
        acc.step(*args)
    assert acc.history == []


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan])
def test_get_epsilon_rejects_bad_delta(delta):
    acc = PrivacyAccountant()
    acc.step(1.0, 0.1, 1)
    with pytest.raises(ValueError, match="delta"):
        acc.get_epsilon(delta)


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, q, steps",
    [(1.0, MNIST_Q, MNIST_STEPS), (3.0, 0.01, 1000), (8.0, 0.1, 100), (0.5, 1.0, 1), (50.0, 0.5, 10)],
)
def test_calibration_rdp(target, q, steps):
    sigma = get_noise_multiplier(target, DELTA, q, steps)
    eps = reference_epsilon([(sigma, q, steps)], DELTA, "rdp")
    assert 0.99 * target <= eps <= target, f"sigma={sigma} gives eps={eps} for target {target}"


def test_calibration_rdp_mnist_setting_matches_acceptance_sigma():
    sigma = get_noise_multiplier(MNIST_EPS["rdp"], DELTA, MNIST_Q, MNIST_STEPS, epsilon_tolerance=1e-4)
    assert sigma == pytest.approx(1.1, rel=1e-3)


def test_calibration_pld():
    target, q, steps = 2.0, 0.01, 500
    sigma = get_noise_multiplier(target, DELTA, q, steps, accountant="pld")
    eps = reference_epsilon([(sigma, q, steps)], DELTA, "pld")
    assert 0.99 * target <= eps <= target, f"sigma={sigma} gives eps={eps}"
    assert sigma < get_noise_multiplier(target, DELTA, q, steps, accountant="rdp"), "PLD is tighter than RDP"


def test_calibration_small_max_noise_multiplier():
    sigma = get_noise_multiplier(20.0, DELTA, 0.1, 10, max_noise_multiplier=0.9)
    eps = reference_epsilon([(sigma, 0.1, 10)], DELTA)
    assert sigma <= 0.9 and 0.99 * 20.0 <= eps <= 20.0


def test_calibration_when_epsilon_jumps(monkeypatch):
    """If epsilon(sigma) jumps over the accepted window, return the smallest sigma found within budget."""
    import fastdp.privacy.accounting as accounting

    def step_epsilon(runs, delta, mechanism):
        ((sigma, *_),) = runs
        return 10.0 if sigma < 3.0 else 1.0

    monkeypatch.setattr(accounting, "_epsilon", step_epsilon)
    sigma = get_noise_multiplier(5.0, DELTA, 0.1, 10)
    assert 3.0 <= sigma <= 3.0 * (1 + 1e-6)


def test_calibration_unreachable_target_raises():
    with pytest.raises(ValueError, match="unreachable.*fewer steps, a smaller sample rate, or a larger epsilon"):
        get_noise_multiplier(0.01, DELTA, 1.0, 10_000, max_noise_multiplier=10.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target_epsilon=0.0), "target_epsilon"),
        (dict(target_epsilon=-1.0), "target_epsilon"),
        (dict(target_epsilon=math.inf), "target_epsilon"),
        (dict(target_epsilon=math.nan), "target_epsilon"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(sample_rate=0.0), r"sample_rate must be in \(0, 1\]"),
        (dict(sample_rate=1.01), r"sample_rate must be in \(0, 1\]"),
        (dict(steps=0), "steps must be an integer >= 1"),
        (dict(steps=10.5), "steps must be an integer >= 1"),
        (dict(accountant="gdp"), "choose one of"),
        (dict(epsilon_tolerance=0.0), "epsilon_tolerance"),
        (dict(max_noise_multiplier=-1.0), "max_noise_multiplier"),
    ],
)
def test_calibration_rejects_bad_inputs(kwargs, match):
    args = dict(target_epsilon=1.0, delta=DELTA, sample_rate=0.01, steps=100) | kwargs
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(**args)


# ----------------------------------------------------------------------------------------------------------------
# Per-layer noise
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 4, 10])
def test_equal_per_layer_noise_is_sigma_over_sqrt_d(num_layers):
    sigma = 2.0
    eff = effective_noise_multiplier([sigma] * num_layers)
    assert eff == pytest.approx(sigma / math.sqrt(num_layers), rel=1e-14)

    composed = rdp.RdpAccountant()
    composed.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(sigma)] * num_layers))
    expected = composed.get_epsilon(DELTA)

    single = rdp.RdpAccountant()
    single.compose(dp_event.GaussianDpEvent(eff))
    assert single.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-10)

    acc = PrivacyAccountant("rdp")
    acc.step(eff, 1.0)  # q = 1: no subsampling
    assert acc.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-10)


def test_unequal_per_layer_noise_matches_composition():
    sigmas = [0.7, 1.5, 3.0]
    eff = effective_noise_multiplier(sigmas)
    assert eff == pytest.approx(sum(s**-2 for s in sigmas) ** -0.5, rel=1e-14)
    composed = rdp.RdpAccountant()
    composed.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(s) for s in sigmas]))
    single = rdp.RdpAccountant()
    single.compose(dp_event.GaussianDpEvent(eff))
    assert single.get_epsilon(DELTA) == pytest.approx(composed.get_epsilon(DELTA), rel=1e-10)


def test_effective_noise_multiplier_infinite_entries():
    assert effective_noise_multiplier([2.0, math.inf, math.inf]) == pytest.approx(2.0, rel=1e-15)
    assert effective_noise_multiplier([math.inf]) == math.inf


@pytest.mark.parametrize("bad, match", [([], "empty"), ([1.0, 0.0], "must be > 0"), ([-1.0], "must be > 0")])
def test_effective_noise_multiplier_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        effective_noise_multiplier(bad)


def test_per_layer_noise_multiplier_agrees_with_effective():
    sensitivities = [0.5, 2.0, 1e-3, 4.0]
    sigmas = [1.0, 0.8, 3.0, math.inf]
    stds = [s * d for s, d in zip(sigmas, sensitivities, strict=True)]
    assert per_layer_noise_multiplier(sensitivities, stds) == pytest.approx(
        effective_noise_multiplier(sigmas), rel=1e-12
    )
    # Global strategy: one std sigma * sqrt(sum Delta^2) on every layer is at least as private as sigma.
    global_std = 1.2 * math.sqrt(sum(d * d for d in sensitivities))
    assert per_layer_noise_multiplier(sensitivities, [global_std] * 4) >= 1.2
    assert per_layer_noise_multiplier([1.0, 2.0], [1.0, 0.0]) == 0.0


@pytest.mark.parametrize(
    "sens, stds, match",
    [
        ([1.0, 2.0], [1.0], "2 entries but stds has 1"),
        ([], [], "empty"),
        ([0.0], [1.0], "sensitivities"),
        ([-1.0], [1.0], "sensitivities"),
        ([math.inf], [1.0], "sensitivities"),
        ([1.0], [-0.1], "stds"),
    ],
)
def test_per_layer_noise_multiplier_rejects(sens, stds, match):
    with pytest.raises(ValueError, match=match):
        per_layer_noise_multiplier(sens, stds)


# ----------------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_state_dict_round_trip_and_resume(mechanism):
    runs = [(1.0, 0.01, 200), (math.inf, 0.01, 5), (1.5, 0.02, 100)]
    more = [(1.5, 0.02, 50), (0.9, 0.01, 30)]

    original = PrivacyAccountant(mechanism)
    for run in runs:
        original.step(*run)
    state = json.loads(json.dumps(original.state_dict()))
    assert state["version"] == 1 and state["mechanism"] == mechanism
    assert state["history"] == [list(r) for r in runs]

    restored = PrivacyAccountant(mechanism)
    restored.step(5.0, 0.5, 1)  # replaced by the load
    restored.load_state_dict(state)
    assert restored.history == original.history
    assert restored.get_epsilon(DELTA) == original.get_epsilon(DELTA)

    uninterrupted = PrivacyAccountant(mechanism)
    for run in runs + more:
        uninterrupted.step(*run)
    for run in more:
        restored.step(*run)
    assert restored.history == uninterrupted.history
    assert restored.steps == uninterrupted.steps
    assert restored.get_epsilon(DELTA) == uninterrupted.get_epsilon(DELTA)


def _good_state():
    acc = PrivacyAccountant("rdp")
    acc.step(1.0, 0.01, 10)
    return acc.state_dict()


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda s: s | {"mechanism": "pld"}, "'pld' accountant.*uses 'rdp'"),
        (lambda s: s | {"history": [[1.0, 0.01, -3]]}, r"history\[0\].*num_steps must be an integer >= 0"),
        (lambda s: s | {"history": [[-1.0, 0.01, 3]]}, r"history\[0\].*noise_multiplier"),
        (lambda s: s | {"history": [[1.0, 2.0, 3]]}, r"history\[0\].*sample_rate"),
        (lambda s: s | {"history": [[1.0, 0.01]]}, r"history\[0\].*expected \[noise_multiplier"),
        (lambda s: s | {"history": "oops"}, "history must be a list"),
        (lambda s: s | {"version": 2}, "version"),
        (lambda s: {k: v for k, v in s.items() if k != "history"}, r"missing key\(s\) \['history'\]"),
        (lambda s: {k: v for k, v in s.items() if k != "mechanism"}, "missing key"),
        (lambda s: [s], "must be a dict"),
    ],
)
def test_load_state_dict_rejects_corrupt_state(corrupt, match):
    acc = PrivacyAccountant("rdp")
    acc.step(2.0, 0.1, 7)
    with pytest.raises(ValueError, match=match):
        acc.load_state_dict(corrupt(_good_state()))
    assert acc.history == [(2.0, 0.1, 7)], "a failed load must leave the accountant unchanged"


# ----------------------------------------------------------------------------------------------------------------
# zCDP and GDP (reporting helpers)
# ----------------------------------------------------------------------------------------------------------------


def test_zcdp_known_values():
    assert zcdp_rho(2.0, 10) == pytest.approx(10 / 8)
    assert zcdp_rho(math.inf, 10) == 0.0
    assert zcdp_rho(0.0, 1) == math.inf
    assert zcdp_rho(1.0, 0) == 0.0
    # papers/02 §5 check 7: rho = 0.01 at delta = 1e-5 gives 0.68861.
    assert zcdp_to_epsilon(0.01, 1e-5) == pytest.approx(0.01 + 2 * math.sqrt(0.01 * math.log(1e5)), rel=1e-14)
    assert zcdp_to_epsilon(0.01, 1e-5) == pytest.approx(0.68861, abs=1e-5)
    assert zcdp_to_epsilon(0.0, 1e-5) == 0.0


def test_zcdp_monotone():
    rhos = [zcdp_rho(s, 100) for s in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in pairwise(rhos))
    eps = [zcdp_to_epsilon(r, 1e-5) for r in (0.001, 0.01, 0.1, 1.0)]
    assert all(a < b for a, b in pairwise(eps))
    assert zcdp_to_epsilon(0.1, 1e-3) < zcdp_to_epsilon(0.1, 1e-6)


def test_gdp_mu_formula():
    sigma, q, steps = 1.1, MNIST_Q, MNIST_STEPS
    assert gdp_mu(sigma, q, steps) == pytest.approx(q * math.sqrt(steps * (math.exp(sigma**-2) - 1)), rel=1e-14)
    assert gdp_mu(math.inf, q, steps) == 0.0
    assert gdp_mu(0.0, q, steps) == math.inf
    assert gdp_mu(1e-3, q, steps) == math.inf  # exp(1e6) overflows
    assert gdp_mu(1.0, 0.0, steps) == 0.0


def _gdp_delta(eps, mu):
    norm = scipy_stats.norm
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def test_gdp_to_epsilon_matches_scipy():
    eps = gdp_to_epsilon(1.0, 1e-5)
    independent = brentq(lambda e: _gdp_delta(e, 1.0) - 1e-5, 0.0, 50.0, xtol=1e-14)
    assert eps == pytest.approx(independent, rel=1e-9)
    assert eps == pytest.approx(4.3772, abs=1e-4)
    for mu, delta in [(0.3, 1e-5), (2.5, 1e-6), (0.5, 1e-2)]:
        assert _gdp_delta(gdp_to_epsilon(mu, delta), mu) == pytest.approx(delta, rel=1e-6)


def test_gdp_to_epsilon_edges_and_monotone():
    assert gdp_to_epsilon(0.0, 1e-5) == 0.0
    assert gdp_to_epsilon(math.inf, 1e-5) == math.inf
    assert gdp_to_epsilon(0.01, 0.5) == 0.0  # delta >= delta(0) = 2 Phi(mu / 2) - 1
    eps = [gdp_to_epsilon(mu, 1e-5) for mu in (0.1, 0.5, 1.0, 2.0, 5.0)]
    assert all(a < b for a, b in pairwise(eps)), eps
    assert gdp_to_epsilon(1.0, 1e-3) < gdp_to_epsilon(1.0, 1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: zcdp_rho(-1.0, 1), "noise_multiplier"),
        (lambda: zcdp_rho(1.0, -1), "steps"),
        (lambda: zcdp_to_epsilon(-0.1, 1e-5), "rho"),
        (lambda: zcdp_to_epsilon(0.1, 0.0), "delta"),
        (lambda: gdp_mu(1.0, 1.5, 10), "sample_rate"),
        (lambda: gdp_to_epsilon(-1.0, 1e-5), "mu"),
        (lambda: gdp_to_epsilon(1.0, 1.0), "delta"),
    ],
)
def test_reporting_helpers_reject_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
