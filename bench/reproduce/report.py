"""Turns the runs into the files in bench/results/: the raw runs (CSV), the table (markdown: ours, paper, difference,
time per run, settings), the plot data (CSV) and, where matplotlib is installed, the plot (PNG).

Every number in the table comes from the evaluation runs of this invocation; a cell whose runs failed or did not run
is marked as such, never filled in.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.reproduce import backprop_accounting, jl_rows
from bench.reproduce.runner import COLUMNS, RELEVANT
from bench.reproduce.specs import METHODS, SECTIONS, Cell, Plan

PLOT_COLUMNS = ("section", "method", "dataset", "epsilon", "metric", "ours_mean", "ours_std", "n_seeds", "paper")


@dataclass
class Summary:
    """One table row: a cell's evaluation runs at its chosen grid point. Metric values in percent."""

    cell: Cell
    status: str  # "ok", or why there is no number
    point: dict | None = None
    values: tuple[float, ...] = ()
    train_seconds: float = math.nan
    wall_seconds: float = math.nan
    epsilon_spent: float = math.nan
    noise_multiplier: float = math.nan
    steps: float = math.nan

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else (0.0 if self.values else math.nan)

    @property
    def difference(self) -> float:
        return self.mean - self.cell.paper.value if self.cell.paper is not None and self.values else math.nan


def summarise(plan: Plan, rows: list[dict], chosen: dict[int, int | None]) -> list[Summary]:
    summaries = []
    for i, cell in enumerate(plan.cells):
        tune = [r for r in rows if _belongs(r, cell) and r["phase"] == "tune"]
        if i not in chosen:
            summaries.append(Summary(cell, "not run"))
            continue
        if chosen[i] is None:
            errors = sorted({r["error"] for r in tune if r["error"]})
            summaries.append(Summary(cell, "no result: every tuning run failed (" + "; ".join(errors)[:300] + ")"))
            continue
        point = {**cell.base, **cell.grid[chosen[i]]}
        runs = [r for r in rows if _belongs(r, cell) and r["phase"] == "eval"]
        failed = [r for r in runs if r["status"] != "ok" or not math.isfinite(r["value"])]
        if not runs or failed:
            why = "; ".join(sorted({r["error"] or "metric not finite" for r in failed}))[:300] or "no evaluation run"
            summaries.append(Summary(cell, f"no result: {len(failed)} of {len(runs)} evaluation runs failed ({why})",
                                     point))  # fmt: skip
            continue
        summaries.append(
            Summary(
                cell,
                "ok",
                point,
                values=tuple(100.0 * r["value"] for r in runs),
                train_seconds=statistics.fmean(r["train_seconds"] for r in runs),
                wall_seconds=statistics.fmean(r["wall_seconds"] for r in runs),
                epsilon_spent=max(r["epsilon_spent"] for r in runs),
                noise_multiplier=statistics.fmean(r["noise_multiplier"] for r in runs),
                steps=statistics.fmean(r["steps"] for r in runs),
            )
        )
    return summaries


def _belongs(row: dict, cell: Cell) -> bool:
    return (row["section"], row["method"], row["dataset"]) == (cell.section, cell.method.key, cell.dataset) and abs(
        row["epsilon"] - cell.epsilon
    ) < 1e-12


# --------------------------------------------------------------------------------------------------- CSV files


def write_runs_csv(path: Path, rows: list[dict]) -> None:
    """Every run, tuning and evaluation, one row each (long format; metric values as fractions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k, "")) for k in COLUMNS})


def write_plot_csv(path: Path, summaries: list[Summary]) -> None:
    """The plot's data: metric (percent) against epsilon per section, method and data set, with the paper's value."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(PLOT_COLUMNS)
        for s in summaries:
            c = s.cell
            writer.writerow([c.section, c.method.key, c.dataset, c.epsilon, c.metric, _csv_value(s.mean),
                             _csv_value(s.std), len(s.values), "" if c.paper is None else c.paper.value])  # fmt: skip


def _csv_value(value) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else str(value)


def plot_png(path: Path, summaries: list[Summary]) -> str | None:
    """Metric against epsilon, one panel per section, one line per method (and data set); the papers' values as
    open markers. Returns None when drawn, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this environment"
    sections = [s for s in SECTIONS if any(x.cell.section == s for x in summaries)]
    fig, axes = plt.subplots(1, len(sections), figsize=(5.5 * len(sections), 4.2), squeeze=False)
    for ax, section in zip(axes[0], sections, strict=True):
        series: dict[tuple[str, str], list[Summary]] = {}
        for s in summaries:
            if s.cell.section == section:
                series.setdefault((s.cell.method.label, s.cell.dataset), []).append(s)
        for (label, dataset), points in series.items():
            points.sort(key=lambda s: s.cell.epsilon)
            eps = [s.cell.epsilon for s in points]
            line = ax.errorbar(eps, [s.mean for s in points], yerr=[s.std for s in points], marker="o", capsize=3,
                               label=f"{label}, {dataset}")  # fmt: skip
            paper = [(s.cell.epsilon, s.cell.paper.value) for s in points if s.cell.paper is not None]
            if paper:
                color = line.lines[0].get_color()
                ax.plot(*zip(*paper, strict=True), linestyle="none", marker="s", fillstyle="none", color=color)
        ax.set_xscale("log")
        ax.set_xlabel("epsilon")
        ax.set_ylabel("test AUROC (%)" if section == "lipdp" else "test accuracy (%)")
        ax.set_title(SECTIONS[section].split(":")[0] + " (open squares: paper)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------------- markdown


def _pct(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.1f}"


def _num(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def settings_text(cell: Cell, point: dict | None) -> str:
    if point is None:
        return "–"
    names = {"epochs": "epochs", "batch_size": "batch", "lr": "lr", "optimizer": "", "hidden": "width",
             "clip_norm": "C", "max_weight_norm": "C_w", "tau": "tau", "input_clip": "C1"}  # fmt: skip
    if cell.method.variant == "backprop":
        names["clip_norm"] = "C2"
    if cell.method.per_layer:
        names["clip_norm"] = "C_l"
    parts = [cell.method.model + (f" ({cell.method.projection})" if cell.method.projection else "")]
    for key in RELEVANT[cell.method.variant]:
        if key in point:
            parts.append(f"{names[key]} {_num(point[key])}".strip())
            if key == "clip_norm" and cell.method.per_layer:
                parts[-1] += f" on each of {cell.method.per_layer} layers"
    return ", ".join(parts)


def _table_order(rows: list[Summary]) -> list[Summary]:
    """A section's rows by data set (in plan order), then method (in :data:`METHODS` order), then plan order."""
    datasets = list(dict.fromkeys(s.cell.dataset for s in rows))
    methods = list(METHODS)
    return sorted(rows, key=lambda s: (datasets.index(s.cell.dataset), methods.index(s.cell.method.key)))


def grid_text(cells: list[Cell]) -> str:
    """The axes a group of cells sweeps, with their values (a single-valued axis is listed as fixed)."""
    parts = []
    for key in RELEVANT[cells[0].method.variant]:
        values = sorted({p.get(key, c.base.get(key)) for c in cells for p in c.grid} - {None}, key=str)
        if not values:
            continue
        text = ", ".join(_num(v) for v in sorted(values, key=lambda v: (isinstance(v, str), v)))
        parts.append(f"{key} {{{text}}}" if len(values) > 1 else f"{key} {text}")
    return "; ".join(parts)


def write_markdown(path: Path, plan: Plan, summaries: list[Summary], meta: dict) -> None:
    lines = [
        "# Reproducing the papers' tables",
        "",
        f"Generated by {meta['command']} on {meta['date']} ({meta['mode']}): {meta['machine']}, "
        f"{meta['jobs']} run(s) at a time with one torch thread each; {meta['runs']} training runs in "
        f"{meta['wall_minutes']:.1f} min wall-clock. fastdp {meta['commit']}, torch {meta['torch']}.",
        "",
        "**Protocol.** Each row is one method on one data set at one epsilon. Every point of a small hyperparameter "
        f"grid (listed under *Sweeps*) is trained on the tuning seeds {_seeds(plan.tune_seeds)}; the point with the "
        f"best mean metric is then trained on the evaluation seeds {_seeds(plan.eval_seeds)}, and the table shows "
        "their mean ± sample std. A seed fixes the stratified 80/20 train/test split, the initialisation, the "
        "Poisson batches and the noise, so tuning and evaluation see different splits. **Like the papers, the privacy "
        "cost of this tuning is not accounted**: each epsilon is that of one training run (RDP accountant, Poisson "
        "sampling, add/remove-one adjacency, noise calibrated so that the run ends at or below the target; the "
        "'spent' column is the largest epsilon of the evaluation runs). Metrics are on the test split after the last "
        "epoch (no early stopping), in percent; differences are ours minus the paper's, in percentage points. "
        "*time/run* is the training loop alone (steps, noise, projections) / the whole run (data loading, noise "
        "calibration, per-epoch evaluation and accounting), seconds, one CPU thread; the papers' times are on their "
        "GPUs.",
        "",
    ]
    for section, title in SECTIONS.items():
        rows = _table_order([s for s in summaries if s.cell.section == section])
        if not rows:
            continue
        lines += [f"## {title}", ""]
        if section == "jl":  # papers/03: its own tables (Fig. 3 and Table 3 computed, Fig. 4 trained)
            lines += jl_rows.section_lines(rows, plan.full, path.with_name(f"{path.stem}_jl.csv"))
            continue
        lines += _section_intro(section)
        header = ["method", "data set", "epsilon", "delta", "ours", "paper", "difference", "spent eps", "time/run (s)"]
        if section == "lipdp":
            header.append("paper time (s)")
        header.append("chosen settings")
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for s in rows:
            c = s.cell
            paper = "–" if c.paper is None else ("~" if c.paper.approx else "") + f"{c.paper.value:.1f}"
            ours = (
                f"{_pct(s.mean)} ± {_pct(s.std)}" if s.status == "ok" else " ".join(s.status.split()).replace("|", "/")
            )
            diff = "–" if math.isnan(s.difference) else f"{s.difference:+.1f}"
            spent = "–" if math.isnan(s.epsilon_spent) else f"{s.epsilon_spent:.3f}"
            times = "–" if s.status != "ok" else f"{s.train_seconds:.1f} / {s.wall_seconds:.1f}"
            cells = [c.method.label, c.dataset, f"{c.epsilon:g}", f"{c.delta:.3g}", ours, paper, diff, spent, times]
            if section == "lipdp":
                seconds = None if c.paper is None else c.paper.seconds
                cells.append("–" if seconds is None else f"{seconds:g}")
            cells.append(settings_text(c, s.point) + (f" ({c.note})" if c.note else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if section == "backprop":
            lines += backprop_accounting.note_lines()
    lines += [
        "## Sweeps",
        "",
        "| section | method | data sets | epsilons | grid | points |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[Cell]] = {}
    for c in plan.cells:
        groups.setdefault((c.section, c.method.key, grid_text([c]), len(c.grid)), []).append(c)
    for (section, method, grid, points), cells in groups.items():
        datasets = ", ".join(dict.fromkeys(c.dataset for c in cells))
        epsilons = ", ".join(dict.fromkeys(f"{c.epsilon:g}" for c in cells))
        lines.append(f"| {section} | {method} | {datasets} | {epsilons} | {grid} | {points} |")
    lines += [
        "",
        "Not listed: TrainConfig defaults (RDP accountant, Poisson sampling, `mlp`/`lipschitz_mlp`/`weightclip_mlp` "
        "with 2 hidden layers, per-layer noise for the Lipschitz variants, input bound X_0 = sqrt(features)).",
        "",
        "## Files",
        "",
        f"- `{meta['runs_csv']}`: every run (tuning and evaluation), settings and results (metrics as fractions).",
        f"- `{meta['plot_csv']}`: the plot's data (metric in percent against epsilon, with the paper's value).",
    ]
    if meta["plot_missing"] is None:
        lines.append(f"- `{meta['plot_png']}`: metric against epsilon per method (open squares: the papers).")
    else:
        lines.append(f"- No PNG plot: {meta['plot_missing']}; the plot's data is in the CSV above.")
    lines += ["", "## What is missing or differs from the papers", ""]
    problems = [s for s in summaries if s.status != "ok"]
    for s in problems:
        lines.append(f"- {s.cell.key}: {s.status}.")
    lines += [f"- {text}" for text in STANDING_NOTES]
    path.write_text("\n".join(lines) + "\n")


def _seeds(seeds: tuple[int, ...]) -> str:
    return "{" + ", ".join(str(s) for s in seeds) + "}"


def _section_intro(section: str) -> list[str]:
    text = {
        "lipdp": "ADBench sets from `../shared/data/adbench` (y = 1 anomaly), stratified 80/20 split, features "
        "standardised on the training split. DP-SGD: `mlp` (2 hidden ReLU layers), per-example clipping C = 1. "
        "clipless: `lipschitz_mlp` (orthogonal LipschitzLinear + GroupSort2, no bias, input bound sqrt(d)), tau "
        "cross-entropy, per-layer noise. The paper reports the *best validation* AUROC of a Bayesian sweep "
        "(Opacus for DP-SGD).",
        "weightclip": "breast cancer (scikit-learn); German credit, nursery, Adult (adult.data + adult.test, "
        "'?' kept as a category), default of credit card clients and students' dropout (its three UCI classes) from "
        "`../shared/data/uci`, categorical attributes one-hot. delta = 1/n with n the whole data set (569, 1000, "
        "12960, 48842, 30000, 4424), as in the table. DP-SGD: `mlp`, one clip C for the whole gradient. DP-SGD, "
        "per-layer clipping: the paper's baseline (its Alg. 2), each of the mlp's 3 layers clipped to its own C_l = "
        "C, layer l's sum noised with std sigma sqrt(3) C_l: noise calibrated to the release's L2 sensitivity "
        "sqrt(sum_l C_l^2), accounted as one Gaussian of multiplier sigma (the paper adds sigma C per layer and "
        "accounts sigma, which under-counts: papers/01 §2). weightclip: `weightclip_mlp` (LipschitzLinear "
        "with bias, spectral norm rescaled only when above C_w, ReLU) with papers/01's defects W1-W8 fixed. "
        "fixed norm: the same network with every layer rescaled to spectral norm C_w after each step (and before "
        "the first). The paper's MLPs have one hidden layer (140-2,120 parameters); ours have two of width 32. Adult, "
        "default credit and dropout sweep a smaller grid at one batch size and epoch count per set (*Sweeps*).",
        "backprop": "MNIST **test split only** (`../shared/data/mnist/t10k-*`; the 60,000 training images are not "
        "available offline), split 8,000 train / 2,000 test (seeded, stratified) by fastdp's `mnist` loader; the "
        "paper trains on 60,000 images, so at equal epsilon each of our examples must carry 7.5x the weight and "
        "the accuracies are not expected to match. `opacus_cnn` is the architecture of the authors' original "
        "commit (conv 16x8x8/2 pad 3, max-pool 2/1, conv 32x4x4/2, max-pool 2/1, linear 512-32-10; with biases, "
        "which backprop clipping bounds by C2); the first grid point is the authors' corrected configuration "
        "(batch 256, 5 epochs, Adam 0.01, C1 = 3, C2 = 1e-7 x 256 per example). `backprop_cnn` is the repository's "
        "later bias-free model (7f38fe6: conv 16x8x8/2 and 32x4x4/2 without padding, max-pool 2/1, linear 288-32-10, "
        "no bias: 4 parameter tensors) at that configuration alone. The linear model is a further "
        "row for context. Paper values are the corrected repository's '~x%' comments (delta = 1e-5); the paper's "
        "Table 1 (98.7% at epsilon 0.07) added noise b times too small and is not a target.",
    }[section]
    return [text, ""]


STANDING_NOTES = (
    "MNIST: only the 10,000-image test split is available offline; the backprop rows train on 8,000 of those "
    "images and test on the other 2,000, against a paper that trained on 60,000.",
    "lip-dp Table 7 sets not in `../shared/data`: ALOI, celeba, census, donors, skin (not run).",
    "papers/01 Table 1 set not run: Android (no data).",
    "Dropout: UCI's target has three classes (Dropout, Enrolled, Graduate) and papers/01 does not say how it used "
    "them. Its 81.9% (Lip-DP-SGD) is above what non-private logistic regression reaches on the three classes (about "
    "77% on our splits, seeds 0-1) and below dropout-vs-rest (about 88%), so the paper likely trained a binary "
    "target; our rows use the three classes and are not directly comparable with it.",
    "The papers tuned with Bayesian optimisation over wider ranges (papers/00 Table 8, papers/01 Table 3) and "
    "report the best point; ours is a small grid chosen on separate tuning seeds, so differences of a few points "
    "are within what the tuning alone can explain. `--full` runs larger grids (paper batch sizes for lip-dp, more "
    "epochs) with 5 evaluation seeds.",
    "Times: the papers' runtimes are on GPUs with their own epoch counts; ours are one CPU thread per run at the "
    "chosen settings, so only the ratio between methods within a row pair means something.",
)
