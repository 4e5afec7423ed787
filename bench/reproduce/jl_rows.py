"""papers/03 (DP-SGD-JL, Bu et al.) in the reproduction: the rows that are computed rather than trained.

* Fig. 3, epsilon against the number r of JL projections, from fastdp's JL accountant (``fastdp.privacy.jl``, the
  PLD of Theorem B.7's mixture, Poisson-subsampled, add/remove): the single-step values papers/03 §2.3 lists as an
  accountant check, and the curve at the paper's Fig. 3 settings (Table 2's IMDb run).
* The settings of the Fig. 4 cells (``specs._jl_cells``): DP-SGD's noise multiplier at epsilon 3 and what each JL(r)
  spends at it.
* Table 3, the largest batch before out-of-memory: measured on CPU as the step's peak of live tensors at two batch
  sizes (``bench/bench_jl.py``: ``largest_batch``), extrapolated to a stated memory cap.

:func:`section_lines` renders the section (with the trained Fig. 4 rows) and writes these numbers to a CSV.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

INF = math.inf
DELTA = 1e-5

# papers/03 §2.3 "[check]": single-step epsilon at delta 1e-5, no subsampling, by numerical integration of the
# Theorem B.7 mixture (the distilled paper's own computation, not read off a figure).
PAPER_SINGLE_STEP = {
    1.0: {5: 78.41, 10: 12.08, 30: 5.585, 100: 4.676, INF: 4.377},
    2.0: {5: 20.61, 10: 4.302, 30: 2.425, 100: 2.104, INF: 1.993},
}
# Fig. 3 "Privacy curves ... training the LSTM model on IMDb", delta 1e-5: Table 2's run (sigma 0.6, B 256, 25,000
# examples, 15 epochs). The figure is an image: no number is printed.
IMDB_SIGMA, IMDB_BATCH, IMDB_N, IMDB_EPOCHS = 0.6, 256, 25_000, 15
IMDB_PARAMETERS = 598_274
FIG3_PROJECTIONS = (1, 5, 10, 30, INF)  # Table 2's JL dimensions and DP-SGD
FIG3_PROJECTIONS_FULL = (1, 2, 3, 5, 10, 20, 30, 100, INF)
FIG3_EPOCHS = (1, 5, 15)
FIG3_EPOCHS_FULL = (1, 2, 5, 10, 15)

# Fig. 4: MNIST, the TF-Privacy tutorial CNN (fastdp's opacus_cnn, 26,010 parameters), DP-SGD and DP-SGD-JL(r) with
# the same hyperparameters. papers/03 prints no epsilon, sigma or batch for it; ours: expected batch 512 on our
# 8,000 training images (q = 0.064, 16 steps an epoch), DP-SGD's sigma at epsilon 3 (delta 1e-5, PLD), every JL(r)
# at that sigma and its own epsilon. Keys: epochs.
FIG4_TRAIN, FIG4_BATCH, FIG4_DP_SGD_EPSILON = 8000, 512, 3.0
FIG4_PROJECTIONS = (10, 20)
FIG4_PROJECTIONS_FULL = (10, 20, 30)
FIG4_REFUSED = (3, 5)  # JL(3), JL(5) of the paper's figure: see fig4_setting


def fig4_steps(epochs: int) -> tuple[float, int]:
    """(q, T) of the Fig. 4 runs: the trainer's Poisson rate B / N and ceil(N / B) steps an epoch."""
    q = FIG4_BATCH / FIG4_TRAIN
    return q, epochs * math.ceil(FIG4_TRAIN / FIG4_BATCH)


def _round_up(x: float, digits: int = 3) -> float:
    scale = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return round(math.ceil(x / scale) * scale, 10)


def fig4_setting(epochs: int, projections=FIG4_PROJECTIONS_FULL + FIG4_REFUSED) -> dict:
    """The noise multiplier (DP-SGD's at epsilon 3, rounded up to 3 decimals: epsilon <= 3) and, per r (``INF``:
    DP-SGD), the epsilon at it (JL accountant, delta 1e-5), the cell's target (1% above, rounded up to 3 digits: the
    trainer, given sigma and a target, stops early only beyond it) and fastdp's truncation bound (its noise is
    bounded: a run whose bound exceeds delta / 100 is refused, ``fastdp.privacy.accounting.truncation_delta``)."""
    from fastdp.privacy.accounting import get_noise_multiplier, truncation_delta
    from fastdp.privacy.jl import jl_epsilon

    q, steps = fig4_steps(epochs)
    sigma = math.ceil(get_noise_multiplier(FIG4_DP_SGD_EPSILON, DELTA, q, steps, accountant="pld") * 1000) / 1000
    rows = {}
    for r in (*projections, INF):
        eps = jl_epsilon(sigma, q, r, steps, DELTA)
        target = FIG4_DP_SGD_EPSILON if math.isinf(r) else (_round_up(1.01 * eps) if math.isfinite(eps) else INF)
        rows[r] = {"epsilon": eps, "target": target, "truncation": truncation_delta(sigma, steps, 26_010, r)}
    return {"sigma": sigma, "q": q, "steps": steps, "rows": rows}


# Table 3: largest batch without out-of-memory, MNIST (60,000 training images), one Tesla P100 16 GB, TF-Privacy.
# Keys: (workload of bench_jl, provider of bench_jl).
PAPER_TABLE3 = {
    ("cnn", "nonprivate"): 60_000,
    ("cnn", "vanilla"): 512,
    ("cnn", "jl-10"): 60_000,
    ("cnn", "jl-30"): 60_000,
    ("big_cnn", "nonprivate"): 52_000,
    ("big_cnn", "vanilla"): 100,
    ("big_cnn", "jl-10"): 28_000,
    ("big_cnn", "jl-30"): 25_000,
}
TABLE3_CAP_BYTES = 16 * 2**30  # the paper's P100: 16 GB
TABLE3_LIMIT = 60_000  # the data set: no larger batch exists
TABLE3_PROVIDERS = ("nonprivate", "vanilla", "dpsgd", "jl-10", "jl-30")
# (batch sizes measured, providers measured) per workload. The small CNN is measured where JL's budget is relative
# (0.5 x R above the 4 MiB floor: batch >= 262), so its peak is affine in the batch; the big one's budget is set by its
# parameters. Default mode leaves out the big model's JL(30) (two minutes on 2 cores; its layers project one tangent
# at a time for any r, as JL(10)'s).
TABLE3_PLAN = {"cnn": ((512, 1024), TABLE3_PROVIDERS), "big_cnn": ((8, 16), TABLE3_PROVIDERS[:-1])}
TABLE3_PLAN_FULL = {"cnn": ((1024, 2048), TABLE3_PROVIDERS), "big_cnn": ((16, 32), TABLE3_PROVIDERS)}
_LABELS = {"nonprivate": "non-private SGD", "vanilla": "DP-SGD, per-example gradients (vanilla)",
           "dpsgd": "DP-SGD (fastdp, ghost norms)", "jl-10": "DP-SGD-JL(10)", "jl-30": "DP-SGD-JL(30)"}  # fmt: skip
_MODELS = {"cnn": "CNN, 26,010 parameters (opacus_cnn)", "big_cnn": "CNN + dense, 17,149,298 parameters"}


def _r(r: float) -> str:
    return "∞ (DP-SGD)" if math.isinf(r) else f"{r:g}"


def _eps(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.4g}"


def fig3_rows(full: bool = False) -> list[dict]:
    """Fig. 3's numbers: the single-step check and the IMDb curve (epsilon after each of ``FIG3_EPOCHS``)."""
    from fastdp.privacy.accounting import truncation_delta
    from fastdp.privacy.jl import jl_epsilon

    rows = []
    for sigma, values in PAPER_SINGLE_STEP.items():
        for r, paper_value in values.items():
            rows.append({"table": "fig3-single-step", "sigma": sigma, "q": 1.0, "steps": 1, "epochs": "", "r": r,
                         "epsilon": jl_epsilon(sigma, 1.0, r, 1, DELTA), "paper": paper_value,
                         "truncation": ""})  # fmt: skip
    q = IMDB_BATCH / IMDB_N
    for epochs in FIG3_EPOCHS_FULL if full else FIG3_EPOCHS:
        steps = round(epochs * IMDB_N / IMDB_BATCH)  # E = B T / N
        for r in FIG3_PROJECTIONS_FULL if full else FIG3_PROJECTIONS:
            rows.append({"table": "fig3-imdb", "sigma": IMDB_SIGMA, "q": q, "steps": steps, "epochs": epochs, "r": r,
                         "epsilon": jl_epsilon(IMDB_SIGMA, q, r, steps, DELTA), "paper": "",
                         "truncation": truncation_delta(IMDB_SIGMA, steps, IMDB_PARAMETERS, r)})  # fmt: skip
    return rows


def table3_rows(full: bool = False) -> list[dict]:
    """Table 3 on this machine: per workload and provider, the peak at two batches, the MiB per example, the fixed
    MiB, and the largest batch under ``TABLE3_CAP_BYTES`` (at most the data set's 60,000)."""
    from bench import bench_jl

    rows = []
    for workload, (batches, providers) in (TABLE3_PLAN_FULL if full else TABLE3_PLAN).items():
        for provider in TABLE3_PROVIDERS:
            if provider not in providers:
                rows.append({"table": "table3", "workload": workload, "provider": provider, "batches": batches,
                             "paper": PAPER_TABLE3.get((workload, provider), ""), "skipped": "--full"})  # fmt: skip
                continue
            fit = bench_jl.largest_batch(workload, provider, TABLE3_CAP_BYTES, batches)
            rows.append({"table": "table3", "workload": workload, "provider": provider, "batches": batches,
                         "mb_per_example": fit["mb_per_example"], "intercept_mb": fit["intercept_mb"],
                         "uncapped": fit["largest_batch"], "largest_batch": min(fit["largest_batch"], TABLE3_LIMIT),
                         "paper": PAPER_TABLE3.get((workload, provider), "")})  # fmt: skip
    return rows


def _fig3_lines(rows: list[dict], full: bool) -> list[str]:
    lines = [
        "**Fig. 3: epsilon against r** (fastdp's JL accountant: the PLD of Theorem B.7's mixture of Gaussian "
        "mechanisms over Z = (chi2_r / r)^-1/2, Poisson-subsampled, add/remove-one, delta = 1e-5; r = ∞ is DP-SGD's "
        "subsampled Gaussian). First the single step without subsampling that papers/03 §2.3 lists as an "
        "accountant check (its numbers come from numerical integration of the same mixture, not from the figure):",
        "",
        "| sigma | r | ours | paper (§2.3 check) | difference |",
        "|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["table"] == "fig3-single-step"):
        diff = row["epsilon"] - row["paper"]
        lines.append(f"| {row['sigma']:g} | {_r(row['r'])} | {row['epsilon']:.4g} | {row['paper']:g} | "
                     f"{diff:+.3g} ({100 * diff / row['paper']:+.2f}%) |")  # fmt: skip
    curve = [r for r in rows if r["table"] == "fig3-imdb"]
    epochs = list(dict.fromkeys(r["epochs"] for r in curve))
    steps = {r["epochs"]: r["steps"] for r in curve}
    lines += [
        "",
        f"Then the curve at Fig. 3's settings, Table 2's IMDb run: sigma = {IMDB_SIGMA}, expected batch "
        f"{IMDB_BATCH} of {IMDB_N:,} (q = {IMDB_BATCH / IMDB_N:.5f}), epsilon after E epochs (T = E N / B steps). "
        "The figure is an image (no number is printed); the paper says epsilon falls with r to DP-SGD's, and that "
        "DP-Adam-JL(30) has 'similar privacy guarantees as' DP-Adam-Vanilla. In brackets: epsilon over DP-SGD's; † "
        f"marks runs fastdp refuses (the bounded noise's truncation bound over {IMDB_PARAMETERS:,} parameters "
        "exceeds delta / 100, `truncation_delta`).",
        "",
        "| r | " + " | ".join(f"E = {e} (T = {steps[e]})" for e in epochs) + " |",
        "|---|" + "---|" * len(epochs),
    ]
    dpsgd = {r["epochs"]: r["epsilon"] for r in curve if math.isinf(r["r"])}
    for r in dict.fromkeys(row["r"] for row in curve):
        cells = []
        for e in epochs:
            row = next(x for x in curve if x["r"] == r and x["epochs"] == e)
            ratio = "" if math.isinf(r) or math.isinf(row["epsilon"]) else f" ({row['epsilon'] / dpsgd[e]:.2f}x)"
            cells.append(_eps(row["epsilon"]) + ratio + (" †" if row["truncation"] > DELTA / 100 else ""))
        lines.append(f"| {_r(r)} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _fig4_lines(summaries: list, full: bool) -> list[str]:
    from bench.reproduce.specs import jl_fig4_epochs

    epochs = jl_fig4_epochs(full)
    setting = fig4_setting(epochs)
    sigma = setting["sigma"]
    dpsgd = next((s for s in summaries if s.cell.method.variant == "dpsgd" and s.status == "ok"), None)
    lines = [
        f"**Fig. 4: MNIST test accuracy, DP-SGD-JL(r) beside DP-SGD with the same hyperparameters** (the figure's "
        "protocol; it is an image of 25-run curves, with no epsilon, sigma or accuracy printed: 'DP-SGD-JL(3) is "
        "already very close to DP-SGD-Vanilla and DP-SGD-JL(20) is almost indistinguishable'). Ours: the tutorial "
        f"CNN (`opacus_cnn`, 26,010 parameters) on MNIST's test split (8,000 train / 2,000 test, pixels in [0, 1], "
        f"no standardisation), SGD, C = 1, expected batch {FIG4_BATCH}, {epochs} epochs ({setting['steps']} steps), "
        f"noise multiplier sigma = {sigma} for every row: DP-SGD's at epsilon {FIG4_DP_SGD_EPSILON:g} (delta 1e-5, "
        "PLD). Each JL(r) then spends its own epsilon (JL accountant), the 'epsilon' column (the run's target: "
        "'spent' is what it used). The learning rate is tuned per row as elsewhere (*Sweeps*); 'vs DP-SGD' is the "
        "difference from the DP-SGD row, in points.",
        "",
        "| method | epsilon | delta | ours | vs DP-SGD | paper | spent eps | time/run (s) | chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    paper_text = "≈ DP-SGD (image)"
    for s in summaries:
        c = s.cell
        ours = f"{s.mean:.1f} ± {s.std:.1f}" if s.status == "ok" else " ".join(s.status.split()).replace("|", "/")
        versus = "–"
        if s.status == "ok" and dpsgd is not None and s is not dpsgd:
            versus = f"{s.mean - dpsgd.mean:+.1f}"
        spent = "–" if math.isnan(s.epsilon_spent) else f"{s.epsilon_spent:.3f}"
        times = "–" if s.status != "ok" else f"{s.train_seconds:.1f} / {s.wall_seconds:.1f}"
        chosen = "–" if s.point is None else f"lr {s.point['lr']:g}, {s.point['epochs']} epochs"
        lines.append(f"| {c.method.label} | {c.epsilon:g} | {c.delta:.3g} | {ours} | {versus} | {paper_text} | "
                     f"{spent} | {times} | {chosen} |")  # fmt: skip
    lines += [
        "",
        f"At sigma = {sigma} and these {setting['steps']} steps the JL accountant gives: "
        + "; ".join(
            f"JL({r:g}) epsilon {_eps(v['epsilon'])}" + (" (refused†)" if v["truncation"] > DELTA / 100 else "")
            for r, v in sorted(setting["rows"].items())
            if math.isfinite(r)
        )
        + f"; DP-SGD {setting['rows'][INF]['epsilon']:.4g}. † fastdp refuses to train JL(3) and JL(5) here: its "
        "noise is bounded (4-draw sums), and with Z's heavy tail the probability of an output impossible without one "
        f"example is bounded only by {setting['rows'][3]['truncation']:.2g} and "
        f"{setting['rows'][5]['truncation']:.2g} (above delta / 100); at delta = 1e-5 JL(3) has no finite epsilon "
        "at all. The paper's small-r curves are thus accuracy without a usable guarantee, which is how it proposes "
        "to use them (hyperparameter search).",
        "",
    ]
    return lines


def _table3_lines(rows: list[dict]) -> list[str]:
    cap = TABLE3_CAP_BYTES / 2**30
    lines = [
        f"**Table 3: largest batch without running out of memory** (MNIST, 60,000 training images; paper: one Tesla "
        "P100 16 GB, TF-Privacy). No GPU here: each step's peak of live tensors on CPU (torch.profiler's memory "
        "timeline, `bench/harness.py: live_peak_mb`: parameters, optimizer and autograd state, activations, "
        "per-example quantities, tangents) is measured at two batch sizes; the peak is affine in the batch, so "
        f"the largest batch under a {cap:g} GiB cap is (cap - fixed) / per-example, at most 60,000. The GPU run "
        "(allocator peaks, fragmentation, cuDNN workspaces) is owed. 'vanilla' forms every per-example gradient "
        "(torch.func vmap, as TF-Privacy's DP-SGD-Vanilla); fastdp's DP-SGD clips with ghost norms and is shown "
        "too. The 17,146,938-parameter model's dense layers are not given in the paper: ours adds dense "
        "512-3876-3876-32 (17,149,298 parameters).",
        "",
        "| model | method | paper | ours (<= 60,000) | ours, no data-set limit | MiB / example | fixed MiB | "
        "per example vs non-private | batches measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        base = next(r for r in group if r["provider"] == "nonprivate")
        for r in group:
            paper_value = f"{r['paper']:,}" if r["paper"] != "" else "–"
            if r.get("skipped"):
                lines.append(f"| {_MODELS[workload]} | {_LABELS[r['provider']]} | {paper_value} | not measured "
                             f"(default mode; {r['skipped']}) | | | | | |")  # fmt: skip
                continue
            lines.append(f"| {_MODELS[workload]} | {_LABELS[r['provider']]} | {paper_value} | "
                         f"{r['largest_batch']:,} | {r['uncapped']:,} | {r['mb_per_example']:.4f} | "
                         f"{r['intercept_mb']:.1f} | {r['mb_per_example'] / base['mb_per_example']:.2f}x | "
                         f"{r['batches'][0]}, {r['batches'][1]} |")  # fmt: skip
    lines.append("")
    return lines


def write_csv(path: Path, rows: list[dict]) -> None:
    """The computed rows, long format (one table per row's ``table`` column)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def section_lines(summaries: list, full: bool, csv_path: Path | None = None, log=print) -> list[str]:
    """The papers/03 section of reproduction.md: Fig. 3 (computed), Fig. 4 (``summaries``, the trained cells) and
    Table 3 (measured), with the computed numbers written to ``csv_path``."""
    start = time.perf_counter()
    fig3 = fig3_rows(full)
    table3 = table3_rows(full)
    log(f"reproduce: papers/03 Fig. 3 and Table 3 computed in {time.perf_counter() - start:.0f}s")
    if csv_path is not None:
        write_csv(csv_path, fig3 + table3)
    lines = _fig3_lines(fig3, full) + _fig4_lines(summaries, full) + _table3_lines(table3)
    if csv_path is not None:
        lines += [f"Computed numbers: `{csv_path.name}` (beside this file).", ""]
    return lines
