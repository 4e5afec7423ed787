"""Benchmark of the Lipschitz constraints: Björck orthonormalisation and power iteration.

Cases: square matrices n in {64, 256, 1024} (and 4096 on GPU), one matrix per call, and two
model-sized lists, each passed to ONE fastdp call (as ``fastdp.nn.lipschitz.project_`` does
after every step): a 10-layer list of 512 x 512 matrices and a 24-layer list of 64 x 64 ones
(launch-bound: the Triton path runs all of them in one fused launch, the CUDA path in 2 launches
per step). Ops: ``bjorck`` (15 steps, beta 0.5) and ``power_iteration`` (10 steps, warm start).
Providers:

* ``torch-loop`` — the baseline as deel-torchlip writes it: a Python loop of ``torch.mm``
  per layer and per step (written inline below, no fastdp code);
* ``fastdp-ref`` — fastdp's torch reference (the CPU default);
* ``fastdp-triton`` — the Triton kernels (GPU only: the interpreter is a test vehicle);
* ``fastdp-cuda`` — the csrc/cuda kernels (GPU with fastdp._C built with CUDA).

Reports the median time (p20, p80) in ms, the speedup over the baseline and, on a GPU, the share of the H100
floor (Björck: 3 n^3 FLOP a step, half the Gram and the update, at the 3xTF32 tensor-core rate; power iteration:
W read twice a step from HBM). Results are
appended to bench/results/<device>-lipschitz.csv unless ``--out`` is given.

    python bench/bench_lipschitz.py
    python bench/bench_lipschitz.py --out /tmp/lipschitz.csv --repeats 3
    python bench/bench_lipschitz.py --cases 10x512x512 24x64x64 --ops bjorck
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

import fastdp
import fastdp._ext
from fastdp._backend import available
from fastdp.ops import bjorck_orthonormalize, power_iteration

BJORCK_ITERS = 15
POWER_ITERS = 10


def torch_loop_bjorck(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """deel-torchlip style: per layer, per step, two torch.mm."""
    out = []
    for w in weights:
        for _ in range(BJORCK_ITERS):
            if w.shape[0] >= w.shape[1]:
                w = 1.5 * w - 0.5 * torch.mm(w, torch.mm(w.t(), w))
            else:
                w = 1.5 * w - 0.5 * torch.mm(torch.mm(w, w.t()), w)
        out.append(w)
    return out


def torch_loop_power_iteration(weights: list[torch.Tensor], vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """deel-torchlip style: per layer, per step, two matrix-vector products and normalisations."""
    sigmas = []
    for w, u in zip(weights, vectors, strict=True):
        for _ in range(POWER_ITERS):
            v = F.normalize(torch.mv(w, u), dim=0)
            u = F.normalize(torch.mv(w.t(), v), dim=0)
        sigmas.append(torch.dot(v, torch.mv(w, u)))
    return sigmas


def providers(device: torch.device) -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch-loop": None, "fastdp-ref": "torch"}
    ok, _ = available("triton", device.type)
    if ok and device.type == "cuda":
        out["fastdp-triton"] = "triton"
    if device.type == "cuda" and fastdp._ext.has_cuda_kernels():
        out["fastdp-cuda"] = "cuda"
    return out


def cases(device: torch.device) -> list[tuple[str, int, int]]:
    """(label, layers, n)."""
    sizes = [64, 256, 1024] + ([4096] if device.type == "cuda" else [])
    return [(f"{n}x{n}", 1, n) for n in sizes] + [("10x512x512", 10, 512), ("24x64x64", 24, 64)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per provider on CPU")
    parser.add_argument("--ops", nargs="+", default=["bjorck", "power_iteration"])
    parser.add_argument("--cases", nargs="+", default=None, help="case labels to run (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="CSV to append to (default bench/results/)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    measure = harness.timer(device, args.repeats)
    info = harness.run_info(device)
    device_name = info["device"]
    rows = []
    previous = fastdp.get_backend()
    for op in args.ops:
        for label, layers, n in cases(device):
            if args.cases is not None and label not in args.cases:
                continue
            gen = torch.Generator().manual_seed(0)
            weights = [(torch.randn(n, n, generator=gen) / (2 * n**0.5)).to(device) for _ in range(layers)]
            vectors = [F.normalize(torch.randn(n, generator=gen), dim=0).to(device) for _ in range(layers)]
            base_ms = None
            for provider, backend in providers(device).items():
                if backend is not None:
                    fastdp.set_backend(backend)
                if op == "bjorck":
                    fn = (
                        functools.partial(torch_loop_bjorck, weights)
                        if backend is None
                        else functools.partial(bjorck_orthonormalize, weights, BJORCK_ITERS)  # one call, whole list
                    )
                    flops = layers * BJORCK_ITERS * 4 * n**3
                    floor_s = layers * BJORCK_ITERS * 3 * n**3 / harness.H100_TF32X3_FLOPS  # half the Gram, 3xTF32
                else:
                    fn = (
                        functools.partial(torch_loop_power_iteration, weights, vectors)
                        if backend is None
                        else functools.partial(power_iteration, weights, vectors, POWER_ITERS)
                    )
                    flops = layers * POWER_ITERS * 4 * n**2
                    floor_s = layers * POWER_ITERS * 2 * n**2 * 4 / harness.H100_BYTES_PER_S  # W read twice a step
                med, p20, p80 = measure(fn)
                base_ms = med if backend is None else base_ms
                row = dict(
                    op=op, provider=provider, shape=label, dtype="float32", median_ms=f"{med:.4f}",
                    p20_ms=f"{p20:.4f}", p80_ms=f"{p80:.4f}", gflops=f"{flops / (med * 1e-3) / 1e9:.1f}",
                    speedup_vs_torch_loop=f"{base_ms / med:.2f}", **info,
                )  # fmt: skip
                rows.append(row)
                print(
                    f"{op:16s} {label:12s} {provider:14s} {med:10.3f} ms ({p20:.3f}, {p80:.3f})  "
                    f"{row['gflops']:>8s} GFLOP/s{harness.floor_share(device, floor_s, med)}  "
                    f"x{row['speedup_vs_torch_loop']} vs torch-loop",
                    flush=True,
                )
    fastdp.set_backend(previous)
    harness.write_rows(rows, args.out, f"{device_name}-lipschitz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
