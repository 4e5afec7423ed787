"""DP-SGD-JL step time vs the number of projections r, beside non-private torch and fastdp DP-SGD (exact norms).

papers/03 Table 2: time grows about linearly in r. One step = one forward and one backward through DP layers, the r
projections of each example's gradient from each layer's A and G (float64 GEMMs, ``fastdp.algorithms.jl``), the
re-weighted sum, noise, optimizer step; same model and batch for every provider, timed side by side
(``harness.compare``). Results go to bench/results/<device>-jl.csv.

    python bench/bench_jl.py
    python bench/bench_jl.py --projections 1 5 10 30 --batch 256 --repeats 7
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path

import harness
import torch
from torch import nn

from fastdp.algorithms import DPSGD, JL

CLIP, SIGMA, LR, N = 1.0, 1.0, 0.01, 60_000


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_step(provider: str, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    model = mlp().to(x.device)
    b = x.shape[0]
    if provider == "nonprivate":
        return harness.nonprivate_step(model, x, y, LR)
    if provider == "dpsgd":
        variant = DPSGD(CLIP, SIGMA, sample_rate=b / N, num_examples=N)
    else:
        variant = JL(CLIP, SIGMA, sample_rate=b / N, num_examples=N, projections=int(provider[3:]))
    return harness.variant_step(variant, model, x, y, LR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--projections", nargs="+", type=int, default=[1, 5, 10, 30])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    info = harness.run_info(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 784, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    providers = ["nonprivate", "dpsgd"] + [f"jl-{r}" for r in args.projections]
    results = harness.compare({p: functools.partial(make_step, p, x, y) for p in providers}, device, args.repeats)
    base = results["nonprivate"]
    rows = []
    for provider, result in results.items():
        if result is None:
            print(f"{provider:10s} out of memory", flush=True)
            continue
        med, p20, p80, peak = result
        ratio, mem_ratio = med / base[0], peak / base[3]
        rows.append(dict(workload="mlp-784-512-512-10", provider=provider, batch=args.batch, median_ms=f"{med:.3f}",
                         p20_ms=f"{p20:.3f}", p80_ms=f"{p80:.3f}", time_vs_nonprivate=f"{ratio:.3f}",
                         peak_mem_mb=f"{peak:.1f}", mem_vs_nonprivate=f"{mem_ratio:.3f}", **info))  # fmt: skip
        print(f"{provider:10s} {med:10.2f} ms ({p20:.2f}, {p80:.2f})  x{ratio:6.2f} time  {peak:8.1f} MB  "
              f"x{mem_ratio:5.2f} memory", flush=True)  # fmt: skip
    harness.write_rows(rows, args.out, f"{info['device']}-jl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
