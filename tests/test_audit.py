"""The empirical privacy audit (fastdp.audit), reduced form: noise and sensitivity audits of every variant, the
membership-inference audit of DP-SGD, and the audits catching deliberately broken variants.

Thresholds. Every noise and JL statistic is rejected at level 1e-9 (``DEFAULT_ALPHA``: KS and chi-square tests
with exact null laws), and the membership test uses a lower bound that holds with probability >= 1 - 1e-7. This
file evaluates fewer than 500 statistics at 1e-9, one at 1e-7 and a separation check at > 6 standard errors, so a
correct implementation fails it with probability < 1e-6 (union bound) for any seed; the seeds are fixed, so the
outcome is deterministic. Each "passes" test has a twin that shows the
same check failing on a broken variant, so none of them holds vacuously.
"""

import math

import pytest
import torch

from fastdp.algorithms import DPSGD
from fastdp.algorithms.dpsgd import clipped_gradient_sum
from fastdp.audit import (
    BROKEN,
    CASES,
    DEFAULT_ALPHA,
    best_threshold,
    build_case,
    check_standard_normal,
    clopper_pearson,
    epsilon_lower_bound,
    membership_audit,
    noise_audit,
    sensitivity_audit,
)
from fastdp.audit.report import Settings, render, run_case
from fastdp.audit.setups import AuditCase

PRIVATE = [name for name in CASES if name != "nonprivate"]
MIA_CONFIDENCE = 1 - 1e-7
# reached by the worst canary where the bound is attained exactly (clipping) or nearly (backprop: C1 C2 needs the
# upstream gradient at its clip too); the audit would be powerless if its canaries stayed far below the bound
REACH = {"dpsgd": 0.999, "dpsgd-reference": 0.999, "dpsgd-per-layer": 0.999, "backprop": 0.85, "clipless": 0.5,
         "clipless-global": 0.5, "weightclip": 0.5, "jl": 0.999}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The audit's steps are tiny: one torch thread is much faster than two contending ones."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------- statistics


def test_clopper_pearson_matches_closed_forms():
    n, a = 20, 0.025
    assert clopper_pearson(0, n, a) == (0.0, pytest.approx(1 - a ** (1 / n), rel=1e-9))
    assert clopper_pearson(n, n, a) == (pytest.approx(a ** (1 / n), rel=1e-9), 1.0)
    lo, hi = clopper_pearson(7, n, a)
    assert lo < 7 / n < hi
    with pytest.raises(ValueError, match="successes"):
        clopper_pearson(21, 20, a)


def test_epsilon_lower_bound():
    # perfect separation over n runs: bounded by the Clopper-Pearson limits, log((1 - p) / p), p = 1 - a^(1/n)
    n, conf = 1000, 0.95
    p = 1 - ((1 - conf) / 2) ** (1 / n)
    assert epsilon_lower_bound(n, n, 0, n, 0.0, conf) == pytest.approx(math.log((1 - p) / p), rel=1e-9)
    assert epsilon_lower_bound(500, n, 500, n, 1e-5, conf) == 0.0  # a coin flip proves nothing
    assert epsilon_lower_bound(900, n, 100, n, 1e-5, conf) < math.log(9)  # below the point estimate
    members, others = [2.0 + k / 100 for k in range(100)], [k / 100 for k in range(101)]
    assert best_threshold(members, others, 1e-5, conf) == pytest.approx(1.5)


def test_standard_normal_check_accepts_normals_and_rejects_a_wrong_scale():
    z = torch.randn(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).numpy()
    assert check_standard_normal(z).passed
    wrong = check_standard_normal(1.05 * z)
    assert not wrong.passed and wrong.std_ratio > wrong.std_hi


# --------------------------------------------------------------------------------------------------- noise audit


@pytest.mark.parametrize("name", PRIVATE)
def test_noise_audit_passes(name):
    audit = noise_audit(build_case(name, seed=3), steps=100)
    notes = "; ".join(audit.claim_notes)
    assert audit.claim_ok, f"{name}: claimed stds/sensitivities differ from the expected ones: {notes}"
    assert audit.sigma_ok, f"{name}: claim composes to {audit.composed_sigma}, accountant {audit.accountant_sigma}"
    for t in audit.tensors:
        c = t.check
        assert c.passed, (
            f"{name} {t.name}: KS p = {c.ks_pvalue:.3g}, std ratio {c.std_ratio:.4f} not in "
            f"[{c.std_lo:.4f}, {c.std_hi:.4f}] (alpha {DEFAULT_ALPHA})"
        )
    assert audit.passed


def test_noise_audit_of_a_nonprivate_variant_sees_an_exactly_zero_update():
    audit = noise_audit(build_case("nonprivate"), steps=5)
    assert not audit.private and audit.zero_update and audit.passed


def test_noise_audit_flags_noise_divided_by_b_twice():
    """The backprop-clipping paper's bug: every tensor's noise is b = 16 times smaller than claimed."""
    case = build_case(BROKEN, seed=3)
    b = case.variant.expected_batch_size
    audit = noise_audit(case, steps=100)
    assert not audit.passed and not audit.samples_ok
    for t in audit.tensors:
        assert not t.check.passed and t.check.std_ratio == pytest.approx(1 / b, rel=0.1), t
    assert audit.claim_ok and audit.sigma_ok  # the claim itself is the correct variant's: the release is wrong


class HalvedClaim(DPSGD):
    """Test-only: states half the std it adds, and adds it, while the accountant is told sigma: the samples match
    the claim, but the claim is not sigma C."""

    def _noise_stds(self, model, params):
        return [s / 2 for s in super()._noise_stds(model, params)]


def test_noise_audit_compares_the_claim_with_an_independent_derivation():
    base = build_case("dpsgd", seed=3)
    case = AuditCase("halved", HalvedClaim(1.0, 1.0, 0.25, 64, reproducible_seed=3), base.model, "halved std")
    audit = noise_audit(case, steps=20)
    assert audit.samples_ok  # released what it states...
    assert not audit.claim_ok and not audit.sigma_ok and not audit.passed  # ...but not what it accounts
    assert audit.composed_sigma == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------- sensitivity audit


@pytest.mark.parametrize("name", PRIVATE)
def test_sensitivity_audit_passes(name):
    audit = sensitivity_audit(build_case(name, seed=3, dtype=torch.float64), search=8, jl_steps=50)
    worst = audit.worst
    assert audit.max_ratio <= 1 + audit.tolerance, f"{name}: {worst.scenario} moved the update by {worst.ratios}"
    assert audit.max_ratio >= REACH[name], f"{name}: the canaries reach only {audit.max_ratio:.3f} of the bound"
    if name == "jl":
        assert audit.jl.passed, f"JL norm estimates: KS p = {audit.jl.ks_pvalue:.3g} against chi2_r"
        assert audit.max_ratio_to_c > 1  # the random sensitivity does exceed C: why JL has its own accountant
    assert audit.passed


def test_sensitivity_audit_of_a_nonprivate_variant_reports_no_bound():
    audit = sensitivity_audit(build_case("nonprivate", dtype=torch.float64), search=4)
    assert audit.passed is None and math.isnan(audit.max_ratio) and audit.worst.change > 0


class LooseClip(DPSGD):
    """Test-only: claims (and accounts) C but clips to 4 C."""

    def clipped_sum(self, model, batch, step):
        return clipped_gradient_sum(model, self.loss_fn, batch, 4 * self.clip_norm, 1 / self.expected_batch_size)


def test_sensitivity_audit_flags_a_clip_looser_than_claimed():
    base = build_case("dpsgd", seed=3, dtype=torch.float64)
    case = AuditCase(
        "loose", LooseClip(1.0, 1.0, 0.25, 64, reproducible_seed=3, mode="reference"), base.model, "loose clip"
    )
    audit = sensitivity_audit(case, search=4)
    assert not audit.passed and audit.max_ratio == pytest.approx(4, rel=1e-4)


# ------------------------------------------------------------------------------------------ membership inference


def test_membership_lower_bound_stays_below_dpsgd_epsilon():
    audit = membership_audit("dpsgd", 2.0, examples=16, select=250, runs=1000, confidence=MIA_CONFIDENCE, seed=1)
    assert audit.accountant_epsilon == pytest.approx(1.993, abs=0.01)
    # the test can fail: the bound could reach this far above the claim with these many runs
    best = epsilon_lower_bound(audit.runs, audit.runs, 0, audit.runs, audit.delta, MIA_CONFIDENCE)
    assert best > 2 * audit.accountant_epsilon
    assert audit.passed, f"empirical epsilon {audit.epsilon_lower_bound:.3f} > claim {audit.accountant_epsilon:.3f}"
    # the statistic's in/out means differ by at most 1/sigma of its std; 1000 runs measure that to +-0.05 (one
    # standard error), so a correct implementation stays below this with probability 1 - 1e-10
    assert audit.separation <= audit.max_separation + 6.5 * audit.separation_stderr


def test_membership_audit_catches_noise_divided_by_b_twice():
    audit = membership_audit(BROKEN, 2.0, examples=16, select=250, runs=1000, confidence=MIA_CONFIDENCE, seed=1)
    assert not audit.passed, "the broken variant's empirical epsilon should exceed its claim"
    assert audit.epsilon_lower_bound > 1.5 * audit.accountant_epsilon
    assert audit.separation > 4 * audit.max_separation


# ------------------------------------------------------------------------------------------------------- report


def test_report_names_every_audit_and_the_broken_variants_result():
    settings = Settings(noise_steps=10, search=2, jl_steps=0, select=50, runs=100)
    results = [run_case("dpsgd", settings, 0), run_case(BROKEN, settings, 1)]
    assert results[0].ok and results[0].verdict == "pass"
    assert results[1].ok and results[1].verdict.startswith("caught by the noise audit")
    text = render(results, settings, 1.0, "python -m fastdp.audit")
    for heading in ("## Noise audit", "## Sensitivity audit", "## Membership inference"):
        assert heading in text
    assert f"| `{BROKEN}` |" in text and "caught by the noise audit" in text
