"""``python -m bench.reproduce``: run the reproduction plan and write its files (see :mod:`bench.reproduce`)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.reproduce import report
from bench.reproduce.runner import execute
from bench.reproduce.specs import METHODS, SECTIONS, build_plan

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reproduce",
        description="Reproduce papers/00 Table 7 (lip-dp), papers/01 Table 1 (weight clipping) and papers/02's "
        "corrected MNIST results (backprop clipping) with fastdp, beside the published numbers.",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="larger, paper-protocol sweeps (paper batch sizes, more epochs and epsilons), 5 evaluation and 3 tuning "
        "seeds; hours on 2 cores (default: small sweeps, 3 + 2 seeds)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="runs at a time, each in its own process with one torch thread (default: %(default)s)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the files go (default: bench/results)")
    parser.add_argument("--name", default="reproduction", help="file name stem (default: %(default)s)")
    parser.add_argument("--data-dir", default=None,
                        help="the shared/data folder (adbench/, uci/, mnist/); default: $FASTDP_DATA_DIR or "
                             "../shared/data beside the repository")  # fmt: skip
    g = parser.add_argument_group("subsets (for quick checks; the default runs everything)")
    g.add_argument("--sections", nargs="+", choices=list(SECTIONS), help="only these paper sections")
    g.add_argument("--methods", nargs="+", choices=list(METHODS), help="only these methods")
    g.add_argument("--datasets", nargs="+", help="only these data sets")
    g.add_argument("--epsilons", nargs="+", type=float, help="only these target epsilons")
    g.add_argument("--seeds", type=int, default=None, help="evaluation seeds per cell (default: 3, --full 5)")
    g.add_argument("--tune-seeds", type=int, default=None, help="tuning seeds per grid point (default: 2, --full 3)")
    g.add_argument("--max-points", type=int, default=None, help="keep only the first N grid points of each cell")
    g.add_argument("--epochs", type=int, default=None, help="override every run's epochs (machinery checks only)")
    g.add_argument("--quiet", action="store_true", help="no line per finished run")
    return parser


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()  # fmt: skip
        # the run's own output files (bench/results/) are rewritten while it runs: they do not make the code dirty
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"]
        dirty = subprocess.run(status, cwd=ROOT, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    return f"commit {head}" + (" with uncommitted changes" if dirty else "")


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.jobs < 1:
        print("reproduce: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        plan = build_plan(full=args.full, sections=args.sections, methods=args.methods, datasets=args.datasets,
                          epsilons=args.epsilons, seeds=args.seeds, tune_seeds=args.tune_seeds,
                          max_points=args.max_points, epochs=args.epochs)  # fmt: skip
    except ValueError as exc:
        print(f"reproduce: {exc}", file=sys.stderr)
        return 2
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"{args.name}{suffix}" for k, suffix in
             (("md", ".md"), ("runs", "_runs.csv"), ("plot_csv", "_plot.csv"), ("png", ".png"))}  # fmt: skip
    n_runs = sum(len(c.grid) for c in plan.cells) * len(plan.tune_seeds) + len(plan.cells) * len(plan.eval_seeds)
    print(f"reproduce: {len(plan.cells)} cells, {n_runs} runs, {args.jobs} at a time "
          f"({'--full' if plan.full else 'default'} mode)", flush=True)  # fmt: skip
    rows: list[dict] = []

    def on_row(row: dict) -> None:  # keep the raw CSV current, so an interrupted run leaves what it did
        rows.append(row)
        report.write_runs_csv(paths["runs"], rows)

    start = time.perf_counter()
    log = (lambda message: None) if args.quiet else (lambda message: print(message, flush=True))
    _, chosen = execute(plan, jobs=args.jobs, data_dir=args.data_dir, on_row=on_row, log=log)
    minutes = (time.perf_counter() - start) / 60
    summaries = report.summarise(plan, rows, chosen)
    report.write_runs_csv(paths["runs"], rows)
    report.write_plot_csv(paths["plot_csv"], summaries)
    plot_missing = report.plot_png(paths["png"], summaries)
    import torch

    meta = {
        "command": ("`make reproduce` (" if os.environ.get("MAKELEVEL") else "")
        + "`"
        + " ".join(["python -m bench.reproduce", *(sys.argv[1:] if argv is None else argv)])
        + "`"
        + (")" if os.environ.get("MAKELEVEL") else ""),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "mode": "--full mode" if plan.full else "default mode",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU used",
        "jobs": args.jobs,
        "runs": len(rows),
        "wall_minutes": minutes,
        "commit": _commit(),
        "torch": torch.__version__,
        "runs_csv": _shown(paths["runs"]),
        "plot_csv": _shown(paths["plot_csv"]),
        "plot_png": _shown(paths["png"]),
        "plot_missing": plot_missing,
    }  # fmt: skip
    report.write_markdown(paths["md"], plan, summaries, meta)
    print(f"reproduce: {len(rows)} runs in {minutes:.1f} min; wrote {_shown(paths['md'])}, {meta['runs_csv']}, "
          f"{meta['plot_csv']}" + ("" if plot_missing else f", {meta['plot_png']}"))  # fmt: skip
    if plot_missing:
        print(f"reproduce: no PNG plot ({plot_missing}); the plot data is in {meta['plot_csv']}")
    failed = [s for s in summaries if s.status != "ok"]
    for s in failed:
        print(f"reproduce: {s.cell.key}: {s.status}", file=sys.stderr)
    return 1 if failed else 0
