"""The certified-bound fuzzer (fastdp.audit.bounds) in a slice: every certificate against the float64 SVD, on each
matrix family in both dtypes and during projected clipless and weightclip training with tampered weights."""

import math

import pytest
import torch

from fastdp.audit.bounds import FAMILIES, BoundReport, draw_matrix, format_bound_report, run_bound_fuzz, sigma_max


def test_bound_fuzz_slice_passes_on_every_family_and_both_variants():
    report = run_bound_fuzz(examples=2 * len(FAMILIES), seed=1, training_runs=2, steps=4)
    text = format_bound_report(report)
    assert report.passed, text
    assert {"bjorck", "cholesky", "gram", "training"} <= {o.check for o in report.outcomes}, text
    assert any("weightclip" in o.case for o in report.outcomes) and any("clipless" in o.case for o in report.outcomes)


def test_the_fuzzer_reports_a_bound_below_sigma_max():
    """A bound that does not hold is a failure, not a pass: the fuzzer can fail."""
    report = BoundReport()
    report.add("gram", "planted", 0.999, 1.0)
    report.add("gram", "fine", 1.0, 1.0)
    assert not report.passed and len(report.failures) == 1
    assert "violation" in format_bound_report(report)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_draws_finite_matrices_of_its_kind(family):
    gen = torch.Generator().manual_seed(0)
    w = draw_matrix(family, gen, torch.float64)
    assert w.dim() == 2 and torch.isfinite(w).all()
    s = sigma_max(w)
    if family == "zero":
        assert s == 0
    elif family == "huge":
        assert s > 1e29
    elif family == "tiny":
        assert 0 < s < 1e-28
    else:
        assert 0 < s < math.inf
