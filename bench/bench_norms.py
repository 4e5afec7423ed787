"""Benchmark of the ghost norm ``fastdp::ghost_norm_sq``: torch reference vs fastdp backends, side by side.

Shapes of Linear layers on sequences: B=64, T in {64, 512}, d=p=128, and a GPT-2-small-like
B=32, T=1024, d=p=768. Providers: ``fastdp-ref`` (the torch reference: bmm Gram matrices,
[B, T, T] in memory), ``fastdp-triton`` (GPU only: the interpreter is a test vehicle),
``fastdp-cuda`` on GPU or ``fastdp-cpu`` (the csrc/cpu kernel) on CPU. Reports the median
time (p20, p80), achieved GFLOP/s with the ghost-norm count

    flops = 2 B T^2 (d + p) + 2 B T^2      (two Gram matrices, their elementwise product and sum)

(the kernels use symmetry and do about half of it: the figure is the rate of the naive
algorithm they replace), the share of the device's measured matmul rate in that dtype,
on a GPU the share of the H100 floor of ``kernels/norms.py`` (half the products at the dtype's
rate, or reading A and G, whichever is longer), and the speedup over the reference. Results are appended to
bench/results/<device>-norms.csv (long format).

    python bench/bench_norms.py                       # all providers that run here
    python bench/bench_norms.py --dtypes float32 bfloat16 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import harness
import torch

import fastdp
from fastdp._backend import available
from fastdp.ops import ghost_norm_sq

SHAPES = [(64, 64, 128, 128), (64, 512, 128, 128), (32, 1024, 768, 768)]  # (B, T, d, p)


def matmul_gflops(device: torch.device, dtype: torch.dtype, measure) -> float:
    """Measured square-matmul rate in GFLOP/s (n = 8192 on GPU, 1024 on CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    x = torch.randn(n, n, device=device).to(dtype)
    y = torch.randn(n, n, device=device).to(dtype)
    med, _, _ = measure(lambda: torch.mm(x, y))
    return 2 * n**3 / (med * 1e-3) / 1e9


def providers(device: torch.device) -> dict[str, str]:
    """Provider name -> fastdp backend, for the backends that can run here."""
    out = {}
    for backend in ("torch", "triton", "cuda"):
        ok, _ = available(backend, device.type)
        if not ok or (backend == "triton" and device.type == "cpu"):
            continue  # the interpreter is a test vehicle, not a provider
        name = {"torch": "fastdp-ref", "triton": "fastdp-triton", "cuda": f"fastdp-{device.type}"}[backend]
        out[name] = backend
    return out


def run(a: torch.Tensor, g: torch.Tensor, backend: str) -> torch.Tensor:
    fastdp.set_backend(backend)
    return ghost_norm_sq(a, g)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per provider on CPU")
    parser.add_argument("--out", type=Path, default=None, help="CSV to append to (default bench/results/)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    measure = harness.timer(device, args.repeats)
    info = harness.run_info(device)
    device_name = info["device"]
    rows = []
    previous = fastdp.get_backend()
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        peak = matmul_gflops(device, dtype, measure)
        print(f"{dtype_name}: matmul {peak:.0f} GFLOP/s")
        for batch, seq, dim_a, dim_g in SHAPES:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(batch, seq, dim_a, generator=gen).to(device=device, dtype=dtype)
            g = torch.randn(batch, seq, dim_g, generator=gen).to(device=device, dtype=dtype)
            flops = 2 * batch * seq * seq * (dim_a + dim_g) + 2 * batch * seq * seq
            # H100 floor (kernels/norms.py): half the products (symmetric tiles) at the dtype's rate, or reading
            rate = harness.H100_FP32_FLOPS if dtype == torch.float32 else harness.H100_BF16_FLOPS
            read_s = batch * seq * (dim_a + dim_g) * a.element_size() / harness.H100_BYTES_PER_S
            floor_s = max(batch * seq * seq * (dim_a + dim_g) / rate, read_s)
            ref_ms = None
            for provider, backend in providers(device).items():
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                med, p20, p80 = measure(functools.partial(run, a, g, backend))
                peak_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
                ref_ms = med if provider == "fastdp-ref" else ref_ms
                gflops = flops / (med * 1e-3) / 1e9
                row = dict(
                    op="ghost_norm_sq", provider=provider, shape=f"B{batch}xT{seq}xd{dim_a}xp{dim_g}",
                    dtype=dtype_name, median_ms=f"{med:.4f}", p20_ms=f"{p20:.4f}", p80_ms=f"{p80:.4f}",
                    gflops=f"{gflops:.1f}", pct_matmul=f"{100 * gflops / peak:.1f}",
                    speedup_vs_ref=f"{ref_ms / med:.2f}", peak_mem_mb=f"{peak_mb:.0f}", **info,
                )  # fmt: skip
                rows.append(row)
                print(
                    f"{row['shape']:22s} {dtype_name:9s} {provider:14s} {med:10.3f} ms ({p20:.3f}, {p80:.3f})  "
                    f"{gflops:8.1f} GFLOP/s  {row['pct_matmul']:>5s}% matmul{harness.floor_share(device, floor_s, med)}"
                    f"  x{row['speedup_vs_ref']} vs ref",
                    flush=True,
                )
    fastdp.set_backend(previous)
    harness.write_rows(rows, args.out, f"{device_name}-norms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
