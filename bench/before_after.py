"""DP-SGD step time of two source trees of fastdp, side by side in one run: ``bench_dpsgd.py`` (this tree's) run with
each tree first on ``PYTHONPATH``, alternating, ``--rounds`` times; medians of each workload's step time / non-private
step time per tree. For a change's cost, e.g. the float64 ghost norms of issue 14:

    git worktree add /tmp/before <commit> && cp fastdp/_C*.so /tmp/before/fastdp/
    python bench/before_after.py --before /tmp/before --after . --rounds 3

Both trees import the same compiled ``fastdp._C`` where the C++ did not change (copy it, as above); the ratios, not
the absolute times, are the comparable figures on a shared machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(tree: Path, workloads: list[str], repeats: int) -> dict[str, float]:
    """workload -> fastdp step time / non-private step time, from one run of bench_dpsgd.py against ``tree``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.csv"
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        command = [sys.executable, str(HERE / "bench_dpsgd.py"), "--providers", "nonprivate", "fastdp",
                   "--repeats", str(repeats), "--out", str(out), "--workloads", *workloads]  # fmt: skip
        subprocess.run(command, env=env, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        with open(out) as f:
            rows = list(csv.DictReader(f))
    return {r["workload"]: float(r["time_vs_nonprivate"]) for r in rows if r["provider"] == "fastdp"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the earlier fastdp")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="source tree of the later one (this one)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each tree")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per provider and run")
    parser.add_argument("--workloads", nargs="+",
                        default=["mlp-256", "mlp-4096", "cnn-256", "transformer-T64", "transformer-T512"])  # fmt: skip
    args = parser.parse_args(argv)
    ratios: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for k in range(args.rounds):
        for label, tree in (("before", args.before), ("after", args.after)) if k % 2 == 0 else (
                ("after", args.after), ("before", args.before)):  # fmt: skip
            for workload, ratio in run(tree, args.workloads, args.repeats).items():
                ratios[label].setdefault(workload, []).append(ratio)
            print(f"round {k + 1}/{args.rounds} {label} done", file=sys.stderr, flush=True)
    print("| workload | before (x non-private) | after (x non-private) | after / before |")
    print("|---|---|---|---|")
    for workload in args.workloads:
        b, a = statistics.median(ratios["before"][workload]), statistics.median(ratios["after"][workload])
        runs = ", ".join(f"{x:.2f}" for x in ratios["after"][workload])
        print(f"| {workload} | {b:.2f} | {a:.2f} (runs {runs}) | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
