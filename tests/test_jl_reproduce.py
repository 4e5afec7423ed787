"""papers/03 in the reproduction (bench/reproduce, section "jl"): the Fig. 4 cells' settings against the accountant
and the trainer, Fig. 3's single-step check, Table 3's extrapolation and the section's rendering. The real runs are
not part of the suite."""

import math
from pathlib import Path

import pytest

from bench import bench_jl
from bench.reproduce import jl_rows, report
from bench.reproduce.report import Summary
from bench.reproduce.runner import RELEVANT
from bench.reproduce.specs import JL_FIG4, build_plan, jl_fig4_epochs

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


@pytest.mark.parametrize("full", [False, True])
def test_fig4_cells_share_dp_sgds_sigma_and_target_each_jls_epsilon(full):
    epochs = jl_fig4_epochs(full)
    setting = jl_rows.fig4_setting(epochs, projections=(10, 20, 30))
    sigma, targets = JL_FIG4[epochs]
    assert setting["sigma"] == sigma
    assert setting["rows"][math.inf]["epsilon"] <= jl_rows.FIG4_DP_SGD_EPSILON  # DP-SGD within epsilon 3
    for r, target in targets.items():
        assert setting["rows"][r]["target"] == target, r
        assert setting["rows"][r]["epsilon"] < target and setting["rows"][r]["truncation"] < jl_rows.DELTA / 100
    cells = build_plan(full=full, sections=["jl"]).cells
    assert [c.method.key for c in cells] == ["dpsgd-cnn", "jl-10", "jl-20"] + (["jl-30"] if full else [])
    for c in cells:
        assert c.base["noise_multiplier"] == sigma and c.base["epochs"] == epochs and c.paper is not None
        assert c.base.get("projections") == (None if c.method.variant == "dpsgd" else int(c.method.key[3:]))
        assert c.config(c.grid[0], 0)["accountant"] == "pld"
    assert "jl" in RELEVANT and report.RELEVANT is RELEVANT


def test_the_paper_smallest_projections_are_refused_at_dp_sgds_sigma():
    rows = jl_rows.fig4_setting(jl_fig4_epochs(False), projections=(3, 5))["rows"]
    assert math.isinf(rows[3]["epsilon"]) and rows[3]["truncation"] > jl_rows.DELTA / 100
    assert rows[5]["truncation"] > jl_rows.DELTA / 100


@pytest.mark.skipif(not any(DATA.glob("t10k-images*")), reason="MNIST test split not in ../shared/data/mnist")
def test_fig4_steps_are_the_trainers():
    from fastdp.train.trainer import TrainConfig, Trainer

    cell = build_plan(sections=["jl"], methods=["jl-10"]).cells[0]
    config = cell.config(cell.grid[0], seed=0, data_dir=str(DATA.parent))
    trainer = Trainer(TrainConfig(**config, quiet=True, progress=False))
    q, steps = jl_rows.fig4_steps(cell.base["epochs"])
    assert trainer.sampler.sample_rate == pytest.approx(q) and trainer.total_steps == steps
    assert trainer.noise_multiplier == cell.base["noise_multiplier"]


def test_fig3_single_step_is_the_papers_check_rounded_up():
    """fastdp's PLD accountant is pessimistic: at or above the §2.3 values, within 1%."""
    rows = [r for r in jl_rows.fig3_rows() if r["table"] == "fig3-single-step"]
    assert len(rows) == 10
    for row in rows:
        assert row["paper"] * (1 - 1e-3) <= row["epsilon"] <= row["paper"] * 1.01, row


def test_largest_batch_extrapolates_the_affine_peak(monkeypatch):
    monkeypatch.setattr(bench_jl, "batch_of", lambda workload, b, device: (b, None))
    monkeypatch.setattr(bench_jl, "make_step", lambda provider, x, y, workload: x)
    monkeypatch.setattr(bench_jl, "peak_mb", lambda b, device: 100.0 + 0.5 * b)  # 100 MiB fixed, 0.5 MiB / example
    fit = bench_jl.largest_batch("cnn", "jl-10", 1100 * 2**20, (8, 16))
    assert fit["mb_per_example"] == pytest.approx(0.5) and fit["intercept_mb"] == pytest.approx(100.0)
    assert fit["largest_batch"] == 2000
    assert bench_jl.largest_batch("cnn", "jl-10", 1100 * 2**20, (8, 16), limit=600)["largest_batch"] == 600


def test_section_renders_the_three_tables(monkeypatch, tmp_path):
    fake = [{"table": "table3", "workload": w, "provider": p, "batches": (8, 16), "mb_per_example": 0.1 * (i + 1),
             "intercept_mb": 10.0, "uncapped": 1000 // (i + 1), "largest_batch": 1000 // (i + 1),
             "paper": jl_rows.PAPER_TABLE3.get((w, p), "")}
            for w in ("cnn", "big_cnn") for i, p in enumerate(jl_rows.TABLE3_PROVIDERS)]  # fmt: skip
    monkeypatch.setattr(jl_rows, "table3_rows", lambda full: fake)
    plan = build_plan(sections=["jl"])
    summaries = [Summary(c, "ok", {**c.base, **c.grid[0]}, (90.0, 92.0), 1.0, 2.0, c.epsilon * 0.99, 1.4, 160)
                 for c in plan.cells]  # fmt: skip
    lines = jl_rows.section_lines(summaries, False, tmp_path / "r_jl.csv", log=lambda message: None)
    text = "\n".join(lines)
    assert "| sigma | r | ours | paper (§2.3 check) | difference |" in text
    assert "| 1 | 10 | 12.1" in text and "E = 15 (T = 1465)" in text
    assert "| DP-SGD-JL(20) | 3.71 | 1e-05 | 91.0 ± 1.4 | +0.0 |" in text
    assert "| CNN + dense, 17,149,298 parameters | DP-SGD-JL(30) | 25,000 |" in text
    assert (tmp_path / "r_jl.csv").read_text().startswith("table,")
