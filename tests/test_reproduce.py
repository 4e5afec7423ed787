"""The paper-reproduction pipeline (bench/reproduce, `make reproduce`) on tiny configurations: the plan, the
selection, the fixed-norm projection switch, and the files one run writes. The real runs are not part of the suite."""

import csv
import math
import sys

import pytest
import torch

from bench.reproduce import paper
from bench.reproduce.cli import main
from bench.reproduce.runner import COLUMNS, select_point, use_projection
from bench.reproduce.specs import BACKPROP_PAPER_POINT, build_plan
from fastdp.train.models import build_model


def test_default_plan_covers_the_three_tables():
    plan = build_plan()
    keys = {(c.section, c.method.key, c.dataset) for c in plan.cells}
    for dataset in ("yeast", "magic", "shuttle", "campaign"):
        assert {("lipdp", "dpsgd", dataset), ("lipdp", "clipless", dataset)} <= keys
    for dataset in ("breast_cancer", "german_credit", "nursery", "adult", "default_credit", "dropout"):
        assert {("weightclip", m, dataset) for m in ("dpsgd", "dpsgd-per-layer", "weightclip", "fixed")} <= keys
    for key in ("backprop-cnn", "backprop-linear"):
        assert sorted(c.epsilon for c in plan.cells if c.method.key == key) == [0.1, 0.2, 1.0, 3.0]
    repo = [c for c in plan.cells if c.method.key == "backprop-cnn-repo"]
    assert sorted(c.epsilon for c in repo) == [0.1, 0.2, 1.0, 3.0, 3.18, 23.5]
    assert all(c.grid == (BACKPROP_PAPER_POINT,) and c.method.model == "backprop_cnn" for c in repo)
    assert [c.paper.value for c in repo if c.epsilon > 3] == [95.0, 96.0]  # the repository's '1' and '3' settings
    assert len(plan.eval_seeds) >= 3 and not set(plan.eval_seeds) & set(plan.tune_seeds)
    for c in plan.cells:
        assert c.grid and c.paper is not None, c.key
        if c.section == "lipdp":
            assert c.epsilon == 1.0 and c.delta == paper.LIPDP_DELTA[c.dataset] and c.metric == "test_auroc"
        if c.section == "weightclip":
            assert c.epsilon == paper.WEIGHTCLIP_EPSILON[c.dataset]
            assert c.delta == pytest.approx(1 / paper.WEIGHTCLIP_N[c.dataset])
    backprop = next(c for c in plan.cells if c.method.key == "backprop-cnn")
    assert backprop.grid[0]["clip_norm"] == pytest.approx(256e-7)  # the authors' corrected configuration first
    full = build_plan(full=True)
    assert len(full.eval_seeds) >= 5 and sum(len(c.grid) for c in full.cells) > sum(len(c.grid) for c in plan.cells)


def test_select_point_skips_failed_and_takes_the_first_of_ties():
    cell = build_plan(sections=["weightclip"], datasets=["nursery"], methods=["dpsgd"], max_points=3).cells[0]
    rows = [
        {"point": 0, "value": 0.8},
        {"point": 0, "value": 0.9},
        {"point": 1, "value": 0.95},
        {"point": 1, "value": math.nan},  # a failed seed puts the point out
        {"point": 2, "value": 0.85},
        {"point": 2, "value": 0.85},
    ]
    assert select_point(cell, rows) == 0
    assert select_point(cell, [{"point": 1, "value": math.nan}]) is None


def test_use_projection_fixed_sets_every_spectral_norm_to_c():
    torch.manual_seed(0)
    model = build_model("weightclip_mlp", (10,), 3, hidden=8, max_weight_norm=2.5)
    use_projection(model, "fixed")
    layers = [m for m in model.modules() if hasattr(m, "projection")]
    assert len(layers) == 3 and all(m.projection == "fixed" for m in layers)
    for m in layers:
        torch.testing.assert_close(torch.linalg.matrix_norm(m.weight.detach(), 2), torch.tensor(2.5), rtol=2e-3, atol=0)
    with pytest.raises(ValueError, match="LipschitzLinear"):
        use_projection(build_model("mlp", (10,), 3), "fixed")


def test_tiny_reproduction_writes_table_and_csvs(tmp_path):
    argv = ["--sections", "weightclip", "--datasets", "breast_cancer", "--methods", "dpsgd", "fixed", "--seeds", "1",
            "--tune-seeds", "1", "--max-points", "2", "--epochs", "1", "--jobs", "1", "--out-dir", str(tmp_path),
            "--name", "r", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    with open(tmp_path / "r_runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert tuple(runs[0]) == COLUMNS
    assert len(runs) == 2 * 2 + 2  # 2 methods x (2 grid points x 1 tuning seed + 1 evaluation seed)
    assert {r["phase"] for r in runs} == {"tune", "eval"} and {r["status"] for r in runs} == {"ok"}
    for r in runs:
        assert r["epochs"] == "1" and float(r["epsilon_spent"]) <= 1.672 and 0 <= float(r["value"]) <= 1
    assert {r["projection"] for r in runs if r["method"] == "fixed"} == {"fixed"}
    with open(tmp_path / "r_plot.csv") as f:
        plot = list(csv.DictReader(f))
    assert [(p["method"], p["paper"]) for p in plot] == [("dpsgd", "77.3"), ("fixed", "70.0")]
    evals = {r["method"]: 100 * float(r["value"]) for r in runs if r["phase"] == "eval"}
    for p in plot:
        assert float(p["ours_mean"]) == pytest.approx(evals[p["method"]], abs=1e-3)
    text = (tmp_path / "r.md").read_text()
    assert "privacy cost of this tuning is not accounted" in text
    assert "| method | data set | epsilon | delta | ours | paper | difference |" in text
    row = next(line for line in text.splitlines() if line.startswith("| DP-SGD | breast_cancer | 1.672 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == "77.3" and float(cells[6]) == pytest.approx(evals["dpsgd"] - 77.3, abs=0.051)
    assert "fixed norm (Fix-Lip-DP-SGD) | breast_cancer" in text and "8,000 train / 2,000 test" not in text
    assert "matplotlib" in text or (tmp_path / "r.png").exists()


def test_failed_runs_are_marked_not_filled_in(tmp_path):
    argv = ["--sections", "weightclip", "--datasets", "german_credit", "--methods", "dpsgd", "--seeds", "1",
            "--tune-seeds", "1", "--max-points", "1", "--epochs", "1", "--jobs", "1", "--out-dir", str(tmp_path),
            "--name", "r", "--quiet", "--data-dir", str(tmp_path / "no-data")]  # fmt: skip
    assert main(argv) == 1
    text = (tmp_path / "r.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| DP-SGD | german_credit |"))
    assert "no result: every tuning run failed (FileNotFoundError" in row and "73.5" in row
    with open(tmp_path / "r_plot.csv") as f:
        assert next(csv.DictReader(f))["ours_mean"] == ""


def test_plot_png_draws_with_matplotlib_when_present(tmp_path, monkeypatch):
    """matplotlib is not in the CI venv: check the drawing code's flow against a stand-in that records calls."""
    from unittest import mock

    from bench.reproduce import report

    pyplot = mock.MagicMock()
    ax = mock.MagicMock()
    pyplot.subplots.return_value = (mock.MagicMock(), [[ax]])
    fake = mock.MagicMock(pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    cells = build_plan(sections=["backprop"], methods=["backprop-linear"]).cells
    summaries = [report.Summary(c, "ok", values=(50.0, 52.0)) for c in cells]
    assert report.plot_png(tmp_path / "p.png", summaries) is None
    pyplot.subplots.assert_called_once()
    eps, means = ax.errorbar.call_args.args[:2]
    assert list(eps) == [0.1, 0.2, 1.0, 3.0] and list(means) == [51.0] * 4
    assert ax.plot.call_args.args[1] == (79.0, 87.0, 95.0, 96.0)  # the paper's values beside ours
    pyplot.subplots.return_value[0].savefig.assert_called_once_with(tmp_path / "p.png", dpi=120)


def test_markdown_orders_per_layer_beside_dpsgd_and_prints_the_backprop_note(tmp_path):
    """The per-layer baseline's row follows the flat DP-SGD row of its data set, its settings say C_l per layer; the
    backprop section ends with the computed note on the repository's epsilons (tests/test_reproduce_backprop.py)."""
    from bench.reproduce import report

    plan = build_plan(sections=["weightclip", "backprop"], datasets=["breast_cancer", "mnist"],
                      methods=["dpsgd", "dpsgd-per-layer", "fixed", "backprop-cnn-repo"])  # fmt: skip
    summaries = [report.Summary(c, "ok", {**c.base, **c.grid[0]}, values=(50.0,), train_seconds=1.0,
                                wall_seconds=2.0, epsilon_spent=c.epsilon, noise_multiplier=1.0, steps=10.0)
                 for c in plan.cells]  # fmt: skip
    meta = {"command": "`x`", "date": "d", "mode": "default mode", "machine": "m", "jobs": 1, "runs": 1,
            "wall_minutes": 0.1, "commit": "c", "torch": "t", "runs_csv": "r.csv", "plot_csv": "p.csv",
            "plot_png": "p.png", "plot_missing": "no matplotlib"}  # fmt: skip
    report.write_markdown(tmp_path / "r.md", plan, summaries, meta)
    lines = (tmp_path / "r.md").read_text().splitlines()
    rows = [line.split(" | ")[0].lstrip("| ") for line in lines if line.split(" | ")[1:2] == ["breast_cancer"]]
    assert rows == ["DP-SGD", "DP-SGD, per-layer clipping", "fixed norm (Fix-Lip-DP-SGD)"]
    per_layer = next(line for line in lines if line.startswith("| DP-SGD, per-layer clipping | breast_cancer |"))
    assert "C_l 1 on each of 3 layers" in per_layer and "| 77.3 |" in per_layer
    repo = [line for line in lines if line.startswith("| backprop clipping, bias-free CNN (repo) |")]
    assert [r.split(" | ")[2] for r in repo] == ["0.1", "0.2", "1", "3", "3.18", "23.5"]
    assert "the repository's 'epsilon = 1' setting, jointly accounted" in repo[4] and "| ~95.0 |" in repo[4]
    text = "\n".join(lines)
    note = text.index("'epsilon = 1' is epsilon = 3.19")
    assert text.index("## Backpropagation clipping") < note < text.index("## Sweeps")
