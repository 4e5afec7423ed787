"""Opacus scripts on Opacus and on fastdp: accuracy at the same (epsilon, delta), and time.

Each script of ``bench/opacus_scripts/`` is written for Opacus (``from opacus import PrivacyEngine``). For every seed
this runs it as written and, interleaved (the order alternates by seed), a copy whose only change is that line,
``from fastdp import PrivacyEngine`` (written to a temporary directory; checked to differ by exactly that line),
each in its own subprocess with the same arguments (seed, epsilon, delta, epochs). Every run prints one JSON line;
the rows go to ``bench/results/cpu-opacus-accuracy.csv`` and a summary to ``bench/results/cpu-opacus-accuracy.md``:
accuracy mean ± std over the seeds, the epsilon each library's ``get_epsilon`` reports, the noise multiplier each
calibrated, the median step time (a step: the loop's batch, forward, backward and ``optimizer.step()``), the epoch
time, the time of ``make_private_with_epsilon`` and of one ``get_epsilon``, the whole run, and Opacus' time over
fastdp's for each.

    python bench/bench_opacus_accuracy.py                  # 3 seeds, both scripts, eps 3, delta 1e-5
    python bench/bench_opacus_accuracy.py --seeds 5 --threads 2
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "bench" / "opacus_scripts"
RESULTS = ROOT / "bench" / "results"
OPACUS_IMPORT = "from opacus import PrivacyEngine"
FASTDP_IMPORT = "from fastdp import PrivacyEngine"
ENGINES = ("opacus", "fastdp")


def fastdp_copy(script: Path, directory: Path) -> Path:
    """``script`` with its import line, and nothing else, changed to fastdp's; written to ``directory``."""
    lines = script.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.rstrip("\n") == OPACUS_IMPORT]
    if len(hits) != 1:
        raise ValueError(f"{script} must contain the line {OPACUS_IMPORT!r} exactly once, found {len(hits)}")
    lines[hits[0]] = FASTDP_IMPORT + "\n"
    out = directory / script.name
    out.write_text("".join(lines))
    return out


def run_script(path: Path, args: list[str], threads: int, data_root: str | None) -> tuple[dict, float]:
    """Run one script in a subprocess from the repository root; its last stdout line (JSON) and the wall time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(path), *args]
    if data_root is not None and path.stem == "mnist_cnn":
        cmd += ["--data-root", data_root]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    return dict(date=datetime.date.today().isoformat(), cpu=cpu, cores=os.cpu_count(), python=platform.python_version(),
                torch=metadata.version("torch"), opacus=metadata.version("opacus"), fastdp_commit=commit)  # fmt: skip


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary(rows: list[dict], info: dict, command: str, settings: dict) -> str:
    """The markdown summary of ``rows`` (one per script, engine and seed)."""
    out = [
        "# Opacus scripts on Opacus and on fastdp (issue 15)",
        "",
        f"{info['date']}, {info['cpu']} ({info['cores']} cores, shared with other work; {settings['threads']} "
        f"thread(s) per run), Python {info['python']}, torch {info['torch']}, opacus {info['opacus']}, fastdp "
        f"{info['fastdp_commit']}. Command: `{command}`.",
        "",
        "Each script (`bench/opacus_scripts/`) is written for Opacus; the fastdp run is a copy whose only change is "
        f"`{OPACUS_IMPORT}` -> `{FASTDP_IMPORT}`. Same arguments for both (seed, target epsilon "
        f"{settings['epsilon']}, delta {settings['delta']}, epochs), runs interleaved, each in its own process. "
        "The scripts use Opacus' ghost-clipping idiom (the criterion passed to `make_private_with_epsilon` with "
        '`grad_sample_mode="ghost"`, the loop\'s loss from the criterion it returns; since 2026-11-25: fastdp refuses '
        'a plain batch mean under `loss_reduction="mean"`), so the Opacus runs are Opacus\' ghost clipping. '
        "Seeds fix the model's initialisation (the train/test split is the same for every seed); Opacus' sampling "
        "and noise come from torch's seeded generator, fastdp's from OS entropy. Both calibrate the noise with "
        "`make_private_with_epsilon` (Opacus: its PRV accountant, the default; fastdp: accountant 'prv' is computed "
        "by PLD, and its target includes the bound of its bounded-tail noise) for the sample rate each uses: "
        "Opacus' 1 / len(data_loader), fastdp's batch_size / N (larger when N is not a multiple of the batch size, "
        "so its σ is then a little larger). ε is what each library's `get_epsilon(delta)` reports after training.",
        "",
        "Times: *step* is the median over a run's steps of one loop iteration (Poisson batch, forward, backward, "
        "`optimizer.step()`), then the median over seeds; *epoch* the loop's time per epoch; *make_private* the "
        "`make_private_with_epsilon` call (noise calibration); *get_epsilon* one call; *run* from `PrivacyEngine()` "
        "to the last `get_epsilon` (training, per-epoch `get_epsilon`, test), *process* the whole subprocess "
        "(interpreter start and imports included). Speed: Opacus' time / fastdp's (above 1: fastdp faster).",
        "",
    ]
    for script in dict.fromkeys(r["script"] for r in rows):
        by = {e: [r for r in rows if r["script"] == script and r["engine"] == e] for e in ENGINES}
        first = by["opacus"][0]
        out += [
            f"## {script}",
            "",
            f"Data {first['data']} ({first['n_train']} training, {first['n_test']} test examples), {first['epochs']} "
            f"epochs, expected batch {first['batch_size']}, lr {first['lr']}, {first['steps']} steps, "
            f"{len(by['opacus'])} seeds ({', '.join(str(r['seed']) for r in by['opacus'])}).",
            "",
        ]
        metric = "perplexity" if "perplexity" in first else "test_loss"
        out += [
            f"| engine | accuracy (mean ± std) | per seed | {metric} | ε reported (max) | σ | step ms | epoch s "
            "| make_private s | get_epsilon s | run s | process s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        stats = {}
        for engine in ENGINES:
            rs = by[engine]
            acc, acc_sd = mean_std([r["accuracy"] for r in rs])
            med = {k: statistics.median(r[k] for r in rs) for k in ("median_step_s", "epoch_s", "make_private_s",
                                                                   "get_epsilon_s", "run_s", "process_s")}  # fmt: skip
            stats[engine] = (acc, acc_sd, med)
            per_seed = ", ".join(f"{r['accuracy']:.4f}" for r in rs)
            out.append(
                f"| {engine} | {acc:.4f} ± {acc_sd:.4f} | {per_seed} "
                f"| {statistics.mean(r[metric] for r in rs):.3f} | {max(r['epsilon'] for r in rs):.3f} "
                f"| {statistics.mean(r['noise_multiplier'] for r in rs):.4f} | {1000 * med['median_step_s']:.2f} "
                f"| {med['epoch_s']:.2f} | {med['make_private_s']:.2f} | {med['get_epsilon_s']:.3f} "
                f"| {med['run_s']:.1f} | {med['process_s']:.1f} |"
            )
        (oa, osd, om), (fa, fsd, fm) = stats["opacus"], stats["fastdp"]
        n = len(by["opacus"])
        se = ((osd**2 + fsd**2) / n) ** 0.5
        ratio = {k: om[k] / fm[k] for k in om}
        out += [
            "",
            f"Accuracy, fastdp - Opacus: {fa - oa:+.4f} (standard error of the difference {se:.4f}). "
            f"Speed (Opacus / fastdp): step {ratio['median_step_s']:.2f}x, epoch {ratio['epoch_s']:.2f}x, "
            f"make_private {ratio['make_private_s']:.2f}x, get_epsilon {ratio['get_epsilon_s']:.2f}x, "
            f"run {ratio['run_s']:.2f}x, process {ratio['process_s']:.2f}x.",
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", default=["mnist_cnn", "char_lm"], choices=["mnist_cnn", "char_lm"])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (at least 3 for the summary)")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--mnist-epochs", type=int, default=4)
    parser.add_argument("--lm-epochs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of each run (the machine is shared)")
    parser.add_argument("--data-root", default=None, help="MNIST t10k directory (default: the script's own)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu-opacus-accuracy.csv")
    args = parser.parse_args(argv)
    epochs = {"mnist_cnn": args.mnist_epochs, "char_lm": args.lm_epochs}
    info = machine()
    command = " ".join(["python bench/bench_opacus_accuracy.py", *(argv if argv is not None else sys.argv[1:])])
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for script in args.scripts:
            original = SCRIPTS / f"{script}.py"
            paths[script] = {"opacus": original, "fastdp": fastdp_copy(original, Path(tmp))}
        for seed in range(args.seeds):
            for script in args.scripts:
                order = ENGINES if seed % 2 == 0 else ENGINES[::-1]
                for engine in order:
                    script_args = ["--seed", str(seed), "--epsilon", str(args.epsilon), "--delta", str(args.delta),
                                   "--epochs", str(epochs[script])]  # fmt: skip
                    result, wall = run_script(paths[script][engine], script_args, args.threads, args.data_root)
                    if result["engine"] != engine:
                        raise RuntimeError(f"{paths[script][engine]} ran {result['engine']}, expected {engine}")
                    rows.append(dict(result, process_s=wall, threads_env=args.threads, **info))
                    print(f"seed {seed} {script:10s} {engine:7s} accuracy {result['accuracy']:.4f} "
                          f"eps {result['epsilon']:.3f} step {1000 * result['median_step_s']:.2f} ms "
                          f"run {result['run_s']:.1f} s process {wall:.1f} s", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    settings = dict(threads=args.threads, epsilon=args.epsilon, delta=args.delta)
    text = summary(rows, info, command, settings)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
