"""The front door's overhead: a DP-SGD step through ``fastdp.PrivacyEngine`` (``make_private``, then the user's
forward, criterion, ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``) beside the same step through
the variant API (``DPSGD.gradient``) and non-private torch, in one process.

Same model (bench_dpsgd's workloads, the ones bench/compare.py runs), batch, clip norm, noise multiplier (hence the
same noise std: the front door's loader has the batch as its batch size) and SGD learning rate for every provider.
The front-door step is compare.py's (``compare.frontdoor_step``), the variant-API step harness.variant_step, so the
two benchmarks time the same code. Both fastdp paths run one forward and one backward through the same DP layers,
the same per-example norms, clipped sums and noise; what the front door adds is its own bookkeeping.

Timing, made for a shared machine: every provider's step is built and warmed up first, then ``--repeats`` rounds,
each calling every provider once in an order that rotates from round to round (interleaved: load drift falls on all
providers alike). Per provider: median ms/step (p20, p80). The overhead is measured on *paired* rounds: the ratio
front-door / variant-API of the same round, reported as its median, p20-p80 spread, a bootstrap 95% interval of the
median ratio (resampling rounds), and the share of rounds in which the front door was the slower. An overhead is
beyond noise when that interval excludes 1. Results are appended to bench/results/<device>-frontdoor.csv (or --out).

    python bench/bench_frontdoor.py                                   # mlp-256, cnn-256, transformer-T64; 21 rounds
    python bench/bench_frontdoor.py --workloads mlp-256 --batch 1024 --repeats 31
    python bench/bench_frontdoor.py --micro-batch 64                  # virtual batches: BatchMemoryManager
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import bench_dpsgd
import compare
import harness
import torch

from fastdp.algorithms import DPSGD

N = 60_000  # examples behind the sample rate (both fastdp paths: expected batch size = the batch)
PROVIDERS = ("nonprivate", "variant-api", "front-door")
DEFAULT_WORKLOADS = ("mlp-256", "cnn-256", "transformer-T64")


def make_step(provider: str, factory, x: torch.Tensor, y: torch.Tensor, micro_batch: int | None):
    """One provider's step closure on a fresh model (the same initial weights for every provider)."""
    torch.manual_seed(0)
    model = factory().to(x.device)
    if provider == "nonprivate":
        return harness.nonprivate_step(model, x, y, bench_dpsgd.LR, micro_batch)
    if provider == "variant-api":
        variant = DPSGD(bench_dpsgd.CLIP, bench_dpsgd.SIGMA, sample_rate=x.shape[0] / N, num_examples=N)
        return harness.variant_step(variant, model, x, y, bench_dpsgd.LR, micro_batch)
    return compare.frontdoor_step(model, x, y, N, micro_batch)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (linear interpolation between order statistics)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def paired_rounds(steps: dict, repeats: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """ms per call of each step: ``warmup`` untimed calls each, then ``repeats`` rounds of one call of every step,
    the order rotating by one each round (a garbage collection between rounds, untimed; on CUDA each call is
    synchronised before and after)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        gc.collect()
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            start = time.perf_counter()
            steps[name]()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def ratio_summary(num: list[float], den: list[float], resamples: int = 2000) -> dict:
    """Paired per-round ratios num/den: median, p20, p80, bootstrap 95% interval of the median, share above 1."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return dict(median=statistics.median(ratios), p20=quantile(ratios, 0.2), p80=quantile(ratios, 0.8),
                ci_lo=quantile(medians, 0.025), ci_hi=quantile(medians, 0.975),
                slower=sum(r > 1 for r in ratios) / len(ratios))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                        choices=list(bench_dpsgd.workloads()))  # fmt: skip
    parser.add_argument("--batch", type=int, default=None, help="override the workloads' batch sizes")
    parser.add_argument("--micro-batch", type=int, default=None, help="virtual batches of this many rows")
    parser.add_argument("--repeats", type=int, default=21, help="paired rounds (at least 15)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 15:
        parser.error(f"--repeats must be at least 15 for a paired median with a spread, got {args.repeats}")
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = harness.run_info(device)
    command = "python bench/bench_frontdoor.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for name in args.workloads:
        factory, inputs, default_batch = bench_dpsgd.workloads()[name]
        b = args.batch or default_batch
        gen = torch.Generator().manual_seed(0)
        x, y = inputs(b, gen).to(device), torch.randint(0, 10, (b,), generator=gen).to(device)
        steps = {p: make_step(p, factory, x, y, args.micro_batch) for p in PROVIDERS}
        times = paired_rounds(steps, args.repeats, args.warmup, device)
        del steps
        base = statistics.median(times["nonprivate"])
        pair = ratio_summary(times["front-door"], times["variant-api"])
        for provider, ts in times.items():
            med = statistics.median(ts)
            row = dict(workload=name, provider=provider, batch=b, micro_batch=args.micro_batch or "",
                       median_ms=f"{med:.3f}", p20_ms=f"{quantile(ts, 0.2):.3f}", p80_ms=f"{quantile(ts, 0.8):.3f}",
                       time_vs_nonprivate=f"{med / base:.3f}", frontdoor_vs_variant_median="",
                       frontdoor_vs_variant_p20="", frontdoor_vs_variant_p80="", frontdoor_vs_variant_ci95="",
                       frontdoor_slower_rounds="", repeats=args.repeats, **info, command=command)  # fmt: skip
            if provider == "front-door":
                row.update(frontdoor_vs_variant_median=f"{pair['median']:.3f}",
                           frontdoor_vs_variant_p20=f"{pair['p20']:.3f}", frontdoor_vs_variant_p80=f"{pair['p80']:.3f}",
                           frontdoor_vs_variant_ci95=f"{pair['ci_lo']:.3f}-{pair['ci_hi']:.3f}",
                           frontdoor_slower_rounds=f"{pair['slower']:.2f}")  # fmt: skip
            rows.append(row)
            print(f"{name:16s} b={b:<5d} {provider:12s} {med:9.2f} ms ({quantile(ts, 0.2):.2f}, "
                  f"{quantile(ts, 0.8):.2f})  x{med / base:5.2f} non-private", flush=True)  # fmt: skip
        print(f"{name:16s} front-door / variant-api, paired over {args.repeats} rounds: median {pair['median']:.3f} "
              f"(p20 {pair['p20']:.3f}, p80 {pair['p80']:.3f}; 95% interval of the median {pair['ci_lo']:.3f}-"
              f"{pair['ci_hi']:.3f}); front door slower in {pair['slower']:.0%} of rounds", flush=True)  # fmt: skip
    harness.write_rows(rows, args.out, f"{info['device']}-frontdoor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
