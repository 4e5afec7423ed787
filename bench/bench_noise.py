"""Benchmark of the fused per-tensor noise: eager torch, torch._foreach, fastdp backends, side by side.

Parameter lists shaped like ResNet-18 (62 tensors, 11.7M parameters) and a 125M-parameter
GPT-2-small-like transformer (148 tensors). Two ops: ``noise`` (g += s * N(0, 1) per tensor)
and ``noise+update`` (p -= lr * (g + s * N(0, 1)) / scale). Reports the median time
(p20, p80), achieved GB/s (bytes each op must move: noise reads and writes g; the fused
step reads g and p and writes p), the share of the device's measured copy bandwidth,
and the ratio to the eager loop. Results are appended to bench/results/<device>-noise.csv.

Then the release of a DP step with the user's optimizer (float32): ``release+sgd-momentum`` and
``release+adam``, ``unfused`` (``fastdp.ops.release_``: noise and division, then torch.optim's own
step) against ``fused`` (the optimizer's update in the release's pass, ``fastdp.engine.fused``), with
the bytes the fused pass must move (24 and 32 per parameter) and, on a GPU, the share of the H100
floor (those bytes / 3.0 TB/s) beside the share of the measured copy bandwidth.

    python bench/bench_noise.py                 # all providers that run here
    python bench/bench_noise.py --models resnet18 --repeats 5
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
from fastdp.engine.fused import TorchOptimizerStep
from fastdp.ops import add_noise_, noisy_sgd_step_, release_

LR, SCALE, STD = 0.1, 256.0, 1.0
RELEASES = {  # op -> (torch optimizer, bytes per float32 parameter of the fused pass)
    "release+sgd-momentum": (lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9), 24),
    "release+adam": (lambda params: torch.optim.Adam(params, lr=1e-3), 32),
}


def resnet18_shapes() -> list[tuple[int, ...]]:
    """The 62 parameter tensors of torchvision's resnet18 (11,689,512 parameters)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            shapes += [(out_ch, in_ch if block == 0 else out_ch, 3, 3), (out_ch,), (out_ch,)]
            shapes += [(out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (stride != 1 or in_ch != out_ch):
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
        in_ch = out_ch
    return shapes + [(1000, 512), (1000,)]


def transformer125m_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small: 12 layers, d=768, vocabulary 50257, context 1024 (124.4M parameters)."""
    d = 768
    shapes: list[tuple[int, ...]] = [(50257, d), (1024, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


MODELS = {"resnet18": resnet18_shapes, "transformer125m": transformer125m_shapes}


def copy_bandwidth(device: torch.device, measure) -> float:
    """Measured device copy bandwidth in GB/s (read + write of a 1 GiB / 256 MiB buffer)."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 26)
    src = torch.empty(numel, device=device).normal_()
    dst = torch.empty_like(src)
    med, _, _ = measure(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (med * 1e-3) / 1e9


def providers(device: torch.device, model: str):
    """name -> (noise fn, fused fn) for the providers that can run here."""

    def eager_noise(params, grads):
        for g in grads:
            g.add_(torch.randn_like(g) * STD)

    def eager_step(params, grads):
        for p, g in zip(params, grads, strict=True):
            p.add_(g + torch.randn_like(g) * STD, alpha=-LR / SCALE)

    def foreach_noise(params, grads):
        noise = [torch.randn_like(g) for g in grads]
        torch._foreach_mul_(noise, [STD] * len(noise))
        torch._foreach_add_(grads, noise)

    def foreach_step(params, grads):
        noise = [torch.randn_like(g) for g in grads]
        torch._foreach_mul_(noise, [STD] * len(noise))
        torch._foreach_add_(noise, grads)
        torch._foreach_add_(params, noise, alpha=-LR / SCALE)

    out = {"eager": (eager_noise, eager_step), "foreach": (foreach_noise, foreach_step)}
    counter = iter(range(1 << 62))
    for backend in ("torch", "triton", "cuda"):
        ok, _ = available(backend, device.type)
        if not ok or (backend == "triton" and device.type == "cpu"):
            continue  # the interpreter is a test vehicle, not a provider
        if backend == "torch" and (device.type == "cpu" and model != "resnet18"):
            continue  # the int64 Philox reference: seconds per call on 124M CPU elements

        def noise(params, grads, backend=backend):
            fastdp.set_backend(backend)
            add_noise_(grads, STD, seed=1, offset=next(counter))

        def step(params, grads, backend=backend):
            fastdp.set_backend(backend)
            noisy_sgd_step_(params, grads, STD, lr=LR, scale=SCALE, seed=1, offset=next(counter))

        name = {
            "torch": "fastdp-ref",
            "triton": "fastdp-triton",
            "cuda": f"fastdp-{'cuda' if device.type == 'cuda' else 'cpu'}",
        }
        out[name[backend]] = (noise, step)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per provider on CPU")
    parser.add_argument(
        "--out", type=Path, default=None, help="CSV to append to (default bench/results/<device>-noise.csv)"
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    measure = harness.timer(device, args.repeats)
    info = harness.run_info(device)
    device_name = info["device"]
    copy_gbps = copy_bandwidth(device, measure)
    print(f"measured copy bandwidth {copy_gbps:.1f} GB/s")
    rows = []
    previous = fastdp.get_backend()
    for model in args.models:
        shapes = MODELS[model]()
        numel = sum(torch.Size(s).numel() for s in shapes)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            params = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
            grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
            element = params[0].element_size()
            for op, bytes_per_element in (("noise", 2 * element), ("noise+update", 3 * element)):
                eager_ms = None
                for provider, fns in providers(device, model).items():
                    fn = fns[0] if op == "noise" else fns[1]
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    med, p20, p80 = measure(functools.partial(fn, params, grads))
                    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
                    eager_ms = med if provider == "eager" else eager_ms
                    gbps = numel * bytes_per_element / (med * 1e-3) / 1e9
                    row = dict(
                        op=op, provider=provider, shape=f"{model}:{len(shapes)}x{numel}", dtype=dtype_name,
                        median_ms=f"{med:.4f}", p20_ms=f"{p20:.4f}", p80_ms=f"{p80:.4f}", gbps=f"{gbps:.1f}",
                        pct_copy_bw=f"{100 * gbps / copy_gbps:.1f}", speedup_vs_eager=f"{eager_ms / med:.2f}",
                        peak_mem_mb=f"{peak:.0f}", **info,
                    )  # fmt: skip
                    rows.append(row)
                    print(
                        f"{model:16s} {dtype_name:9s} {op:13s} {provider:14s} {med:10.3f} ms "
                        f"({p20:.3f}, {p80:.3f})  {gbps:7.1f} GB/s  {row['pct_copy_bw']:>5s}% copy  "
                        f"x{row['speedup_vs_eager']} vs eager",
                        flush=True,
                    )
        rows += release_rows(model, shapes, device, measure, copy_gbps, info)
    fastdp.set_backend(previous)
    harness.write_rows(rows, args.out, f"{device_name}-noise")
    return 0


def release_rows(model: str, shapes, device: torch.device, measure, copy_gbps: float, info: dict) -> list[dict]:
    """The release with the user's optimizer, unfused against fused, for each kernel backend that runs here."""
    rows = []
    numel = sum(torch.Size(s).numel() for s in shapes)
    counter = iter(range(1 << 62))
    backends = [b for b in ("cuda", "triton") if available(b, device.type)[0]]
    backends = [b for b in backends if not (b == "triton" and device.type == "cpu")]  # the interpreter: tests only
    for op, (make, bytes_per_element) in RELEASES.items():
        for backend in backends:
            fastdp.set_backend(backend)
            params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
            sums = [torch.randn(s, device=device) for s in shapes]
            optimizer = make(params)

            def unfused(params=params, sums=sums, optimizer=optimizer):
                release_(sums, [STD] * len(sums), SCALE, 1, next(counter), 4)
                for p, g in zip(params, sums, strict=True):
                    p.grad = g
                optimizer.step()

            def fused(params=params, sums=sums, optimizer=optimizer):
                updates = TorchOptimizerStep(optimizer).updates(params, sums)
                release_(sums, [STD] * len(sums), SCALE, 1, next(counter), 4, updates)
                for p, g in zip(params, sums, strict=True):
                    p.grad = g

            base_ms = None
            for provider, fn in (("unfused", unfused), ("fused", fused)):
                med, p20, p80 = measure(fn)
                base_ms = med if provider == "unfused" else base_ms
                gbps = numel * bytes_per_element / (med * 1e-3) / 1e9
                row = dict(
                    op=op, provider=f"fastdp-{backend if device.type == 'cuda' else 'cpu'}-{provider}",
                    shape=f"{model}:{len(shapes)}x{numel}", dtype="float32", median_ms=f"{med:.4f}",
                    p20_ms=f"{p20:.4f}", p80_ms=f"{p80:.4f}", gbps=f"{gbps:.1f}",
                    pct_copy_bw=f"{100 * gbps / copy_gbps:.1f}", speedup_vs_eager=f"{base_ms / med:.2f}",
                    peak_mem_mb="nan", **info,
                )  # fmt: skip
                rows.append(row)
                share = harness.floor_share(device, numel * bytes_per_element / harness.H100_BYTES_PER_S, med)
                print(
                    f"{model:16s} float32   {op:21s} {row['provider']:22s} {med:10.3f} ms ({p20:.3f}, {p80:.3f})  "
                    f"{gbps:7.1f} GB/s  {row['pct_copy_bw']:>5s}% copy{share}  x{row['speedup_vs_eager']} vs unfused",
                    flush=True,
                )
            del params, sums, optimizer
    return rows


if __name__ == "__main__":
    sys.exit(main())
