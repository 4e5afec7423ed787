"""bench/compare.py's machinery on a tiny workload: providers in their own subprocesses, the CSV it writes, the
growth caps and the plot fallback. The benchmark itself (``make bench``) is not run here."""

from __future__ import annotations

import csv
import importlib
import math
import os
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def compare(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("compare")


def test_two_providers_in_subprocesses_write_the_csv(compare, monkeypatch, tmp_path, capsys):
    calls = []
    real_run_job = compare.run_job

    def spy(job, python, script, timeout, memory_cap_mb=0):
        rows, error = real_run_job(job, python, script, timeout, memory_cap_mb)
        calls.append((job, rows, error))
        return rows, error

    monkeypatch.setattr(compare, "run_job", spy)
    out = tmp_path / "cpu-compare.csv"
    argv = ["--device", "cpu", "--workloads", "mlp-256", "--providers", "nonprivate", "fastdp-dpsgd",
            "fastdp-frontdoor", "tf-privacy", "--batch", "8", "--repeats", "2", "--warmup", "1", "--out", str(out),
            "--tf-python", str(tmp_path / "no-venv")]  # fmt: skip
    assert compare.main(argv) == 0
    printed = capsys.readouterr().out
    assert "tf-privacy skipped: no tf-privacy venv" in printed, printed

    assert [job["provider"] for job, _, _ in calls] == ["nonprivate", "fastdp-dpsgd", "fastdp-frontdoor"]
    assert all(error == "" for _, _, error in calls), [error for _, _, error in calls]
    pids = [rows[0]["pid"] for _, rows, _ in calls]
    assert len(set(pids)) == 3 and os.getpid() not in pids, f"each provider must run in its own process: {pids}"

    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == compare.COLUMNS
    assert [(r["workload"], r["provider"], r["library"], r["batch"], r["status"]) for r in rows] == [
        ("mlp-256", "nonprivate", "torch", "8", "ok"),
        ("mlp-256", "fastdp-dpsgd", "fastdp", "8", "ok"),
        ("mlp-256", "fastdp-frontdoor", "fastdp", "8", "ok"),
        ("mlp-256", "tf-privacy", "tensorflow-privacy", "8", "skipped"),  # marked as not run, never filled in
    ]
    assert rows[3]["median_ms"] == "nan" and "make bench-tf" in rows[3]["note"], rows[3]
    rows = rows[:3]
    for r in rows:
        med, p20, p80 = float(r["median_ms"]), float(r["p20_ms"]), float(r["p80_ms"])
        assert 0 < p20 <= med <= p80, r
        assert r["mem_kind"] == "cpu-peak-rss-delta" and math.isfinite(float(r["peak_mem_mb"])), r
        assert float(r["peak_live_mb"]) > 0 and math.isfinite(float(r["live_vs_nonprivate"])), r
        assert r["params"] == "669706" and r["device"] and r["torch"] and r["date"], r
        assert r["largest_batch"] == "" and r["repeats"] == "2", r
    base = rows[0]
    assert float(base["time_vs_nonprivate"]) == 1.0 and float(base["live_vs_nonprivate"]) == 1.0
    for dp in rows[1:]:
        ratio = float(dp["median_ms"]) / float(base["median_ms"])
        assert float(dp["time_vs_nonprivate"]) == pytest.approx(ratio, rel=2e-3, abs=1e-3)  # written with .3f


SEED = 7
DERIVED = (SEED * 0x9E3779B97F4A7C15 + 1) % 2**63  # the noise key PrivacyEngine derives from reproducible_seed


@pytest.mark.parametrize("workload", ["mlp-256", "cnn-256", "transformer-T64"])
def test_the_front_door_provider_releases_the_variant_apis_update(compare, workload):
    """fastdp-frontdoor's step (make_private, then forward, criterion, loss.backward(), step(), zero_grad()) releases
    the same update as fastdp-dpsgd's (the variant API) for the same batch and noise key: the same clipping and the
    same noise std (sigma C over the same expected batch size), with the benchmark's clip, sigma and lr; also when the
    batch is walked in physical batches by BatchMemoryManager (one release for the logical batch)."""
    import bench_dpsgd
    import harness
    import torch

    from fastdp.algorithms import DPSGD

    factory, inputs, _ = compare.fixed_workloads()[workload]
    gen = torch.Generator().manual_seed(0)
    b, n = 6, compare.MNIST_EXAMPLES
    x, y = inputs(b, gen), torch.randint(0, 10, (b,), generator=gen)

    def params_after(build):
        torch.manual_seed(0)
        model = factory()
        step = build(model)
        step()
        return step, [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    start = [p.detach().clone() for p in factory().parameters()]
    variant = DPSGD(bench_dpsgd.CLIP, bench_dpsgd.SIGMA, b / n, n, reproducible_seed=DERIVED)
    _, reference = params_after(lambda m: harness.variant_step(variant, m, x, y, bench_dpsgd.LR))
    for micro in (None, 4):
        step, got = params_after(lambda m, micro=micro: compare.frontdoor_step(m, x, y, n, micro,
                                                                               reproducible_seed=SEED))  # fmt: skip
        assert step.optimizer.steps_taken == 1 and step.optimizer.accountant.steps == 1, micro
        for p0, p, q in zip(start, got, reference, strict=True):
            assert not torch.equal(p, p0)  # every parameter moved (noise on every coordinate)
            # the updates agree to 1e-4 relative, beyond the rounding of p0 - lr g (the front door's SGD step is fused
            # into the release, the variant API's is torch's: a few ulps of p apart)
            update, want = (p0 - p) / bench_dpsgd.LR, (p0 - q) / bench_dpsgd.LR
            rounding = 4 * torch.finfo(torch.float32).eps * p0.abs() / bench_dpsgd.LR
            assert ((update - want).abs() <= 1e-5 + 1e-4 * want.abs() + rounding).all(), micro


def test_the_front_door_provider_trains(compare):
    """Without noise, the front-door step on a fixed batch lowers its loss (the released update is a descent step)."""
    import torch

    factory, inputs, _ = compare.fixed_workloads()["mlp-256"]
    gen = torch.Generator().manual_seed(0)
    x, y = inputs(32, gen), torch.randint(0, 10, (32,), generator=gen)
    torch.manual_seed(0)
    model = factory()

    def loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x), y).item()

    before = loss()
    step = compare.frontdoor_step(model, x, y, compare.MNIST_EXAMPLES, micro_batch=8, noise_multiplier=0.0, lr=0.5)
    for _ in range(10):
        step()
    assert step.optimizer.steps_taken == 10 and loss() < 0.7 * before, (before, loss())


def test_virtual_batches_grow_the_logical_batch(compare, tmp_path):
    """--micro-batch: logical batches from the micro-batch up, each step in micro-batches; rows say so."""
    out = tmp_path / "cpu-virtual.csv"
    argv = ["--device", "cpu", "--workloads", "mlp-256", "--providers", "nonprivate", "fastdp-dpsgd", "tf-privacy",
            "--micro-batch", "4", "--max-batch", "8", "--growth-repeats", "2", "--warmup", "1", "--out", str(out),
            "--tf-python", str(tmp_path / "no-venv")]  # fmt: skip
    assert compare.main(argv) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    ran = [(r["provider"], r["batch"], r["micro_batch"]) for r in rows if r["status"] == "ok"]
    assert ran == [("nonprivate", "4", "4"), ("nonprivate", "8", "4"), ("fastdp-dpsgd", "4", "4"),
                   ("fastdp-dpsgd", "8", "4")]  # fmt: skip
    for r in rows:
        if r["status"] == "ok":
            assert float(r["examples_per_s"]) == pytest.approx(int(r["batch"]) / float(r["median_ms"]) * 1e3, rel=1e-2)
    assert [r["status"] for r in rows if r["provider"] == "tf-privacy"] in (["n/a"], ["skipped"])


def test_a_worker_over_the_memory_cap_is_killed(compare, tmp_path):
    script = tmp_path / "hog.py"
    script.write_text(
        "import sys, time\n"
        f"print({compare.RESULT_TAG!r} + '{{\"batch\": 1}}', flush=True)\n"
        "hog = bytearray(400 * 2**20)  # zero pages become resident when written\n"
        "hog[:: 4096] = b'x' * len(hog[:: 4096])\n"
        "time.sleep(20)\n"
    )
    start = time.monotonic()
    rows, error = compare.run_job({}, sys.executable, script, timeout=60, memory_cap_mb=150)
    assert error.startswith("killed by compare.py: resident set over the 150 MB cap"), error
    assert rows == [{"batch": 1}] and time.monotonic() - start < 15  # results before the kill are kept


def test_growth_batches_and_caps(compare):
    assert compare.growth_batches(32, 50_000)[:3] == [32, 64, 128]
    assert compare.growth_batches(32, 50_000)[-2:] == [32_768, 50_000]
    assert compare.growth_batches(32, 256) == [32, 64, 128, 256]
    job = dict(growth=True, memory_budget_mb=1000.0, max_step_ms=1500.0)
    assert compare.next_stop(job, 64, 128, median_ms=100.0, peak_mb=400.0) == ""
    assert compare.next_stop(job, 64, 128, median_ms=100.0, peak_mb=600.0).startswith("memory budget 1000 MB")
    assert compare.next_stop(job, 64, 128, median_ms=800.0, peak_mb=100.0).startswith("step-time cap 1.5 s")
    assert compare.next_stop(job, 256, None, median_ms=1.0, peak_mb=1.0) == "max batch 256"
    gpu = dict(growth=True, memory_budget_mb=0, max_step_ms=0)  # GPU: no caps, the growth ends at OOM
    assert compare.next_stop(gpu, 64, 128, median_ms=1e9, peak_mb=1e9) == ""


def test_ratios_largest_batch_and_plot_data(compare, tmp_path):
    def row(provider, batch, med, mem, status="ok", stop=""):
        return dict(workload="lipcnn-130k", params=128700, provider=provider, batch=batch, median_ms=med,
                    peak_mem_mb=mem, status=status, stopped_by=stop, growth=True, mem_kind="cpu-peak-rss-delta",
                    device="cpu-test", date="2026-01-01")  # fmt: skip

    rows = [row("nonprivate", 32, 10.0, 100.0), row("nonprivate", 64, 20.0, 200.0, stop="max batch 64"),
            row("opacus-hooks", 32, 40.0, 400.0),
            row("opacus-hooks", 64, math.nan, math.nan, "oom", "out of memory")]  # fmt: skip
    compare.add_ratios(rows)
    assert [r["time_vs_nonprivate"] for r in rows[:3]] == [1.0, 1.0, 4.0]
    assert rows[2]["mem_vs_nonprivate"] == 4.0 and math.isnan(rows[3]["time_vs_nonprivate"])
    assert [r["largest_batch"] for r in rows] == [64, 64, 32, 32]
    assert rows[2]["stopped_by"] == "out of memory"
    written = compare.plot(rows, tmp_path / "cpu-test-compare")
    assert written and all(p.exists() for p in written)
    if written[0].suffix == ".csv":  # no matplotlib in this venv: the plot data instead of PNGs
        with written[0].open() as f:
            assert [(r["provider"], r["batch"], r["status"]) for r in csv.DictReader(f)] == [
                ("nonprivate", "32", "ok"), ("nonprivate", "64", "ok"), ("opacus-hooks", "32", "ok"),
                ("opacus-hooks", "64", "oom"),
            ]  # fmt: skip
    else:
        assert sorted(p.name for p in written) == ["cpu-test-compare-memory.png", "cpu-test-compare-time.png"]


def test_live_peak_counts_the_tensors_alive_at_once(compare):
    """harness.live_peak_mb: two 8 MiB tensors alive together, then a third after one is freed: the peak is 16 MiB
    (plus the step's small temporaries), not the 24 MiB allocated in all."""
    import harness
    import torch

    def step():
        a = torch.ones(2**21)  # 8 MiB of float32
        b = a + 1
        del a
        c = b * 2
        return c.sum()

    assert 16 <= harness.live_peak_mb(step) < 17


def test_rounds_alternate_the_providers_and_report_the_median_round(compare, monkeypatch, tmp_path):
    """``--rounds 3``: each provider runs three times, each in its own process, the order rotated per round; the CSV
    has one row per provider, the round with the median time, and every round's median in ``round_ms``."""
    calls = []
    real_run_job = compare.run_job

    def spy(job, python, script, timeout, memory_cap_mb=0):
        rows, error = real_run_job(job, python, script, timeout, memory_cap_mb)
        calls.append((job["provider"], rows[0]["pid"], rows[0]["median_ms"]))
        return rows, error

    monkeypatch.setattr(compare, "run_job", spy)
    out = tmp_path / "cpu-compare.csv"
    argv = ["--device", "cpu", "--workloads", "mlp-256", "--providers", "nonprivate", "fastdp-dpsgd", "--batch", "8",
            "--repeats", "2", "--warmup", "1", "--rounds", "3", "--out", str(out)]  # fmt: skip
    assert compare.main(argv) == 0
    assert [p for p, _, _ in calls] == ["nonprivate", "fastdp-dpsgd", "fastdp-dpsgd", "nonprivate"] + [
        "nonprivate",
        "fastdp-dpsgd",
    ]
    assert len({pid for _, pid, _ in calls}) == 6
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["provider"], r["rounds"]) for r in rows] == [("nonprivate", "3"), ("fastdp-dpsgd", "3")]
    for r in rows:
        times = sorted(ms for p, _, ms in calls if p == r["provider"])
        assert [float(t) for t in r["round_ms"].split(";")] == pytest.approx(
            [ms for p, _, ms in calls if p == r["provider"]], abs=0.006
        )
        assert float(r["median_ms"]) == pytest.approx(times[1], abs=6e-4)  # written with .3f
    with pytest.raises(SystemExit):
        compare.main(["--rounds", "0"])
