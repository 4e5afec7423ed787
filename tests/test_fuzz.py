"""The sensitivity fuzzer's fast slice (the full fuzz runs in ``make audit``): random architectures x adversarial
batches x variants x precisions, each example's leave-one-out change of the noiseless release within its claimed
bound, or a clear refusal (fastdp.audit.fuzz)."""

from __future__ import annotations

import pytest

from fastdp.audit import fuzz


def test_the_fast_slice_finds_no_violation_crash_or_missing_refusal():
    report = fuzz.run_fuzz(420, fuzz_seed=1)
    assert report.passed, fuzz.format_report(report)
    statuses = {o.status for o in report.outcomes}
    assert {"ok", "refused"} <= statuses  # both kinds of outcome were exercised


@pytest.mark.parametrize("architecture", ["sequence-first", "batchnorm-eval", "shared-lookup-row0"])
def test_cases_that_break_the_bound_are_refused_by_every_private_variant(architecture):
    report = fuzz.run_fuzz(30, fuzz_seed=2, architectures_=(architecture,), precisions=("fp32", "fp64"))
    assert report.passed, fuzz.format_report(report)
    ran = [o for o in report.outcomes if o.case.variant in fuzz.MUST_REFUSE[architecture]]
    assert ran and all(o.status == "refused" for o in ran)


def test_low_precision_parameters_are_refused():
    report = fuzz.run_fuzz(20, fuzz_seed=3, precisions=("param-bf16",))
    assert report.outcomes and all(o.status == "refused" for o in report.outcomes)


def test_a_violation_is_reported_as_a_failure():
    """The harness itself: an outcome over the bound fails the report."""
    case = fuzz.FuzzCase("mlp", "dpsgd", "fp32", "huge", 4, 1e3, 0)
    report = fuzz.FuzzReport([fuzz.Outcome(case, "ok", 0.5), fuzz.Outcome(case, "violation", 1.3)])
    assert not report.passed and len(report.failures) == 1 and "violation" in fuzz.format_report(report)


def test_jl_in_fp32_with_cancelling_positions_is_within_its_bound():
    """The hole the fuzzer found in DP-SGD-JL (fp32, positions cancelling at large magnitude; 1.44 x its bound on
    6fdb990, listed as known open then) stays closed, and nothing is listed as known open."""
    report = fuzz.run_fuzz(60, fuzz_seed=0, architectures_=("tokenwise",), variants=("jl",), precisions=("fp32",))
    assert report.passed and not fuzz.KNOWN_OPEN
    assert not any(o.status == "open" for o in report.outcomes)
    assert any(o.case.attack == "cancel" and o.status == "ok" for o in report.outcomes)


def test_shared_parameters_are_measured_within_their_bound():
    """Tied weights, a layer called twice and a language model's tied embeddings with a [1, T] position index are no
    longer refused by DP-SGD and JL: their per-example gradients sum the uses (fastdp.nn.forms), and each example's
    leave-one-out change is within the bound, cancelling attacks included."""
    variants = ("dpsgd", "jl", "front-door", "front-door-jl")
    report = fuzz.run_fuzz(90, fuzz_seed=4, architectures_=("tied", "reused", "tied-tokens"), variants=variants,
                           precisions=("fp32", "fp64"))  # fmt: skip
    assert report.passed, fuzz.format_report(report)
    measured = {(o.case.architecture, o.case.variant) for o in report.outcomes if o.status == "ok"}
    assert {a for a, _ in measured} == {"tied", "reused", "tied-tokens"}
    assert {v for _, v in measured} >= {"dpsgd", "jl"}


def test_tau_bce_models_are_fuzzed_within_their_bound():
    """The one- and two-logit Lipschitz MLP with the tau-BCE loss (L = 1), through the variants and the front door."""
    report = fuzz.run_fuzz(24, fuzz_seed=3, architectures_=("lipschitz-binary",),
                           variants=("clipless", "weightclip", "front-door-clipless"))  # fmt: skip
    assert report.passed, fuzz.format_report(report)
    assert any(o.status == "ok" for o in report.outcomes)
