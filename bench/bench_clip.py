"""Benchmark of per-example row clipping ``fastdp::clip_rows`` / ``fastdp::clip_rows_backward``: fused vs torch.

Ops: ``clip_rows`` (the forward clip of backpropagation clipping's inputs; also the whole backward of
``clip_gradient``) and ``clip_rows_backward`` (the gradient of the forward clip through the norm). Providers:
``torch-ref`` (the unfused torch reference, ``fastdp.ref.clip``: a norm kernel, small per-row ops and a scaling
pass), ``fastdp-triton`` (GPU only: the interpreter is a test vehicle), ``fastdp-cuda`` on GPU or ``fastdp-cpu``
(the csrc/cpu kernel) on CPU. Shapes: Linear inputs and logit gradients (l2), conv upstream gradients (l15), token
activations (long rows) and a few very long rows (the row-split path).

Reports the median time (p20, p80) and the achieved bandwidth against the bytes floor of the op,

    clip_rows:           read x once + write y once        = 2 * numel * itemsize
    clip_rows_backward:  read g and x once + write dx once = 3 * numel * itemsize

as a share of the copy bandwidth measured on the same tensor (``x.clone()``: the same bytes floor as clip_rows,
the same allocation of a fresh output, the same caches; 100% = as fast as a copy), on a GPU the share of the H100
floor (those bytes / 3.0 TB/s, ``kernels/clip.py``), and the speedup over the reference. The device's copy
bandwidth on a large buffer is printed too. Results are appended to
bench/results/<device>-clip.csv (long format).

    python bench/bench_clip.py                      # all providers that run here
    python bench/bench_clip.py --dtypes float32 bfloat16 --repeats 20 --out /tmp/clip.csv
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
from fastdp.ref import clip as ref

# (name, shape, norm)
SHAPES = [
    ("linear-in", (256, 4096), "l2"),
    ("logits-grad", (4096, 10), "l2"),
    ("conv-grad", (64, 64, 32, 32), "l15"),
    ("conv-grad", (128, 256, 8, 8), "l15"),
    ("tokens", (32, 128, 768), "l2"),
    ("few-long-rows", (2, 1 << 21), "l2"),
]
BOUND = 1.0


def copy_gbps(device: torch.device, measure) -> float:
    """Measured copy bandwidth in GB/s (read + write) on a 256 MiB (GPU) or 64 MiB (CPU) fp32 buffer, no allocation."""
    numel = (256 if device.type == "cuda" else 64) * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    med, _, _ = measure(lambda: dst.copy_(src))
    return 2 * numel * 4 / (med * 1e-3) / 1e9


def providers(device: torch.device) -> dict[str, str]:
    """Provider name -> fastdp backend, for the backends that can run here."""
    out = {"torch-ref": "torch"}
    for backend in ("triton", "cuda"):
        ok, _ = available(backend, device.type)
        if not ok or (backend == "triton" and device.type == "cpu"):
            continue  # the interpreter is a test vehicle, not a provider
        out["fastdp-triton" if backend == "triton" else f"fastdp-{device.type}"] = backend
    return out


def forward(x: torch.Tensor, norm: str, backend: str) -> torch.Tensor:
    if backend == "torch":  # the unfused reference itself, no op dispatch
        return ref.clip_rows(x, BOUND, norm)
    fastdp.set_backend(backend)
    return torch.ops.fastdp.clip_rows(x, BOUND, norm)


def backward(g: torch.Tensor, x: torch.Tensor, norm: str, backend: str) -> torch.Tensor:
    if backend == "torch":
        return ref.clip_rows_backward(g, x, BOUND, norm)
    fastdp.set_backend(backend)
    return torch.ops.fastdp.clip_rows_backward(g, x, BOUND, norm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per provider on CPU")
    parser.add_argument("--out", type=Path, default=None, help="CSV to append to (default bench/results/)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    measure = harness.timer(device, args.repeats)
    info = harness.run_info(device)
    peak = copy_gbps(device, measure)
    print(f"copy bandwidth {peak:.1f} GB/s (read + write)")
    rows = []
    previous = fastdp.get_backend()
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, shape, norm in SHAPES:
            gen = torch.Generator().manual_seed(0)
            x = (torch.randn(*shape, generator=gen) * 0.05).to(device=device, dtype=dtype)  # about half clipped
            g = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
            copy_ms, _, _ = measure(x.clone)
            copy = 2 * x.numel() * x.element_size() / (copy_ms * 1e-3) / 1e9  # GB/s of a same-size copy
            ops = (("clip_rows", forward, (x,), 2), ("clip_rows_backward", backward, (g, x), 3))
            for op, fn, tensors, passes in ops:
                bytes_floor = passes * x.numel() * x.element_size()
                ref_ms = None
                for provider, backend in providers(device).items():
                    med, p20, p80 = measure(functools.partial(fn, *tensors, norm, backend))
                    ref_ms = med if provider == "torch-ref" else ref_ms
                    gbps = bytes_floor / (med * 1e-3) / 1e9
                    row = dict(
                        op=op, provider=provider, shape=f"{name}:{'x'.join(map(str, shape))}:{norm}", dtype=dtype_name,
                        median_ms=f"{med:.4f}", p20_ms=f"{p20:.4f}", p80_ms=f"{p80:.4f}", gbps=f"{gbps:.1f}",
                        copy_gbps=f"{copy:.1f}", pct_copy=f"{100 * gbps / copy:.1f}", device_copy_gbps=f"{peak:.1f}",
                        speedup_vs_ref=f"{ref_ms / med:.2f}", **info,
                    )  # fmt: skip
                    rows.append(row)
                    print(
                        f"{op:19s} {row['shape']:34s} {dtype_name:9s} {provider:14s} {med:9.3f} ms ({p20:.3f}, "
                        f"{p80:.3f})  {gbps:7.1f} GB/s  {row['pct_copy']:>5s}% copy"
                        f"{harness.floor_share(device, bytes_floor / harness.H100_BYTES_PER_S, med)}"
                        f"  x{row['speedup_vs_ref']} vs ref",
                        flush=True,
                    )
    fastdp.set_backend(previous)
    harness.write_rows(rows, args.out, f"{info['device']}-clip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
