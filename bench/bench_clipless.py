"""Clipless DP training step vs the non-private step of the same Lipschitz network, growing batch.

The network is VGG5-small-like (papers/00 speed experiment): BoundedInput, four RKO convolutions (32, 32, 64, 64
channels) with GroupSort2 and L2-norm pooling, a LipschitzLinear head; CIFAR-10-shaped random data. Providers:
``nonprivate`` (forward, backward, SGD step), ``clipless`` (the same plus the bounds from the current weights,
per-layer noise and the projection Pi). Reports median step time and the ratio; results are appended to
bench/results/<device>-clipless.csv.

    python bench/bench_clipless.py --batches 256 1024
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import harness
import torch
from torch import nn

from fastdp.algorithms import Clipless
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, L2NormPool2d, LipschitzConv2d, LipschitzLinear


def vgg5_small(classes: int = 10) -> nn.Module:
    def conv(cin: int, cout: int, hw: int) -> list[nn.Module]:
        return [LipschitzConv2d(cin, cout, 3, input_hw=(hw, hw), padding=1), GroupSort2()]

    return nn.Sequential(
        BoundedInput(15.0), *conv(3, 32, 32), *conv(32, 32, 32), L2NormPool2d(2),
        *conv(32, 64, 16), *conv(64, 64, 16), L2NormPool2d(2), nn.Flatten(), LipschitzLinear(64 * 8 * 8, classes),
    )  # fmt: skip


def make_step(provider: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    if provider == "nonprivate":
        return harness.nonprivate_step(model, x, y, 0.01)
    variant = Clipless(2.0, sample_rate=x.shape[0] / 50_000, num_examples=50_000)
    return harness.variant_step(variant, model, x, y, 0.01)  # after_step: the projection


def build(provider: str, x: torch.Tensor, y: torch.Tensor):
    """The step closure of ``provider`` on a fresh, identically initialised model."""
    torch.manual_seed(0)
    return make_step(provider, vgg5_small().to(x.device), x, y)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: 256 1024 (CPU), up to 50000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches = args.batches or ([256, 1024] if device.type == "cpu" else [256, 1024, 4096, 16384, 50000])
    info = harness.run_info(device)
    device_name = info["device"]
    params = sum(p.numel() for p in vgg5_small().parameters())
    print(f"VGG5-small-like with {params} parameters")
    rows = []
    for b in batches:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(b, 3, 32, 32, generator=gen).to(device)
        y = torch.randint(0, 10, (b,), generator=gen).to(device)
        results = harness.compare({p: functools.partial(build, p, x, y) for p in ("nonprivate", "clipless")}, device,
                                  args.repeats, warmup=1)  # fmt: skip
        base = (results.get("nonprivate") or (None,))[0]
        for provider, result in results.items():
            if result is None:
                print(f"batch {b:6d} {provider:10s} out of memory", flush=True)
                continue
            med, p20, p80, peak = result
            ratio = med / base if base else float("nan")
            rows.append(dict(workload="vgg5-small", params=params, provider=provider, batch=b, median_ms=f"{med:.2f}",
                             p20_ms=f"{p20:.2f}", p80_ms=f"{p80:.2f}", time_vs_nonprivate=f"{ratio:.3f}",
                             peak_mem_mb=f"{peak:.0f}", **info))  # fmt: skip
            print(f"batch {b:6d} {provider:10s} {med:10.1f} ms ({p20:.1f}, {p80:.1f})  x{ratio:.2f}", flush=True)
    harness.write_rows(rows, args.out, f"{device_name}-clipless")
    return 0


if __name__ == "__main__":
    sys.exit(main())
