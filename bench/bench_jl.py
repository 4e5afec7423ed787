"""DP-SGD-JL step time and peak memory vs the number of projections r, beside non-private torch and fastdp DP-SGD.

papers/03 Table 2: time grows about linearly in r; Table 3 / acceptance check 7: the peak memory stays within a small
factor (<= 2x) of non-private training. One step = one forward and one backward through DP layers, the r projections
of each example's gradient from each layer's A and G (float64 GEMMs, ``fastdp.algorithms.jl``: each layer's tangents
drawn and projected a chunk at a time, the chunk from the memory budget), the re-weighted sum, noise, optimizer
step; same model and batch for every provider, timed side by side (``harness.compare``). Peak memory: on CPU the
live tensors' peak of one profiled step (``harness.live_peak_mb``), on CUDA ``max_memory_allocated``. Workloads:
``mlp`` (784-512-512-10 on MNIST-shaped rows) and ``cnn`` (``opacus_cnn``, the TF-Privacy tutorial CNN of papers/03
Table 3: 26,010 parameters, 1 x 28 x 28 images). Results go to bench/results/<device>-jl.csv.

    python bench/bench_jl.py
    python bench/bench_jl.py --projections 1 5 10 30 --batch 256 --repeats 7 --workloads mlp cnn
    python bench/bench_jl.py --memory-only --memory-budget 0.25     # peaks alone (no timing), a smaller budget
    python bench/bench_jl.py --memory-only --chunk 8                # every layer 8 tangents at a time
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

try:
    import harness
except ModuleNotFoundError:  # imported as bench.bench_jl (bench/reproduce)
    from bench import harness

from fastdp.algorithms import DPSGD, JL
from fastdp.algorithms.jl import DEFAULT_MEMORY_BUDGET

CLIP, SIGMA, LR, N = 1.0, 1.0, 0.01, 60_000


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn() -> nn.Module:
    from fastdp.train.models import build_model

    return build_model("opacus_cnn", (1, 28, 28), 10)


BIG_CNN_WIDTH = 3876  # two dense layers of this width: 17,149,298 parameters (papers/03's is 17,146,938)


def big_cnn() -> nn.Module:
    """papers/03 Table 3 (right): the tutorial CNN "augmented with dense layers" to 17,146,938 parameters; the paper
    does not give the layers. Ours: the same convolutions, then dense 512 -> 3876 -> 3876 -> 32 -> 10 (ReLU), 17,149,298
    parameters (0.01% more)."""
    w = BIG_CNN_WIDTH
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1), nn.Flatten(),
        nn.Linear(512, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 32), nn.ReLU(), nn.Linear(32, 10),
    )  # fmt: skip


WORKLOADS = {
    "mlp": ("mlp-784-512-512-10", mlp, (784,)),
    "cnn": ("opacus_cnn-26010", cnn, (1, 28, 28)),
    "big_cnn": ("cnn-17149298", big_cnn, (1, 28, 28)),
}


def vanilla_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float):
    """A closure running one DP-SGD step the way TF-Privacy's vanilla optimizer does (papers/03's DP-SGD-Vanilla):
    every per-example gradient materialised ([B, *p.shape], ``torch.func`` vmap), clipped to C, summed, noised (std
    sigma C), divided by the batch, an SGD update. For memory comparisons; fastdp's DP-SGD never forms them all."""
    from fastdp.algorithms.base import per_example_cross_entropy
    from fastdp.algorithms.dpsgd import per_example_gradients

    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=x.device).manual_seed(0)

    def step():
        grads = per_example_gradients(model, per_example_cross_entropy, x, y)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
        factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                total = torch.einsum("b,b...->...", factors, g)
                noise = torch.randn(total.shape, generator=gen, device=x.device)
                p -= lr * (total + SIGMA * CLIP * noise) / x.shape[0]

    return step


def batch_of(workload: str, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *WORKLOADS[workload][2], generator=gen).to(device)
    return x, torch.randint(0, 10, (batch,), generator=gen).to(device)


def make_step(provider: str, x: torch.Tensor, y: torch.Tensor, workload: str = "mlp", chunk: int | None = None,
              memory_budget: float = DEFAULT_MEMORY_BUDGET, build=None):  # fmt: skip
    """A closure running one step of ``provider`` ("nonprivate", "vanilla" (:func:`vanilla_step`), "dpsgd" or
    "jl-<r>") on the workload's model (``build``: another model builder)."""
    torch.manual_seed(0)
    model = (build or WORKLOADS[workload][1])().to(x.device)
    b = x.shape[0]
    if provider == "nonprivate":
        return harness.nonprivate_step(model, x, y, LR)
    if provider == "vanilla":
        return vanilla_step(model, x, y, LR)
    if provider == "dpsgd":
        variant = DPSGD(CLIP, SIGMA, sample_rate=b / N, num_examples=N)
    else:
        variant = JL(CLIP, SIGMA, sample_rate=b / N, num_examples=N, projections=int(provider[3:]), chunk=chunk,
                     memory_budget=memory_budget)  # fmt: skip
    return harness.variant_step(variant, model, x, y, LR)


def peak_mb(step, device: torch.device) -> float:
    """Peak memory of one call of ``step`` (after a warm-up call), MiB: live tensors on CPU, allocated on CUDA. Garbage
    is collected first: tensors of an earlier step freed by the cycle collector during the profiled call would count
    as live (torch.func's vmap leaves reference cycles)."""
    step()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return harness.live_peak_mb(step)


def largest_batch(workload: str, provider: str, cap_bytes: float, batches: tuple[int, int],
                  limit: int | None = None) -> dict:  # fmt: skip
    """papers/03 Table 3 on a machine without the paper's GPU: the largest batch whose step fits in ``cap_bytes``,
    from the step's peak memory (:func:`peak_mb`, CPU: live tensors) at two batch sizes. The peak is affine in the
    batch (parameters, buffers and one layer's tangents fixed; activations, per-example quantities per example), so
    ``B_max = (cap - intercept) / slope``, at most ``limit`` (the data set). Returns the two peaks (MiB), the MiB per
    example, the intercept and ``B_max``."""
    device = torch.device("cpu")
    peaks = []
    for b in batches:
        x, y = batch_of(workload, b, device)
        peaks.append(peak_mb(make_step(provider, x, y, workload), device))
    slope = (peaks[1] - peaks[0]) / (batches[1] - batches[0])
    intercept = peaks[0] - slope * batches[0]
    cap = cap_bytes / 2**20
    fits = math.inf if slope <= 0 else (cap - intercept) / slope
    largest = int(min(fits, limit if limit is not None else math.inf))
    return {"peaks_mb": tuple(peaks), "mb_per_example": slope, "intercept_mb": intercept, "largest_batch": largest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["mlp"])
    parser.add_argument(
        "--providers",
        nargs="+",
        default=["nonprivate", "dpsgd"],
        help="besides jl-<r> for --projections: nonprivate (always), dpsgd, vanilla",
    )
    parser.add_argument("--projections", nargs="+", type=int, default=[1, 5, 10, 30])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="JL: tangents every layer projects at once (default: from --memory-budget)",
    )
    parser.add_argument(
        "--memory-budget",
        type=float,
        default=DEFAULT_MEMORY_BUDGET,
        help="JL: multiple of the step's reference memory the tangents may take (default: %(default)s)",
    )
    parser.add_argument("--memory-only", action="store_true", help="peak memory only, no timing")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    info = harness.run_info(device)
    rows = []
    for workload in args.workloads:
        x, y = batch_of(workload, args.batch, device)
        providers = list(dict.fromkeys(["nonprivate", *args.providers])) + [f"jl-{r}" for r in args.projections]
        builders = {p: functools.partial(make_step, p, x, y, workload, args.chunk, args.memory_budget)
                    for p in providers}  # fmt: skip
        if args.memory_only:
            results = {p: (float("nan"),) * 3 + (peak_mb(build(), device),) for p, build in builders.items()}
        else:
            results = harness.compare(builders, device, args.repeats)
        base = results["nonprivate"]
        for provider, result in results.items():
            if result is None:
                print(f"{WORKLOADS[workload][0]} {provider:18s} out of memory", flush=True)
                continue
            med, p20, p80, peak = result
            ratio, mem_ratio = med / base[0], peak / base[3]
            if provider.startswith("jl"):  # the chunk setting in the name (the CSV keeps its columns)
                chunk = f"chunk{args.chunk}" if args.chunk else f"budget{args.memory_budget:g}"
                provider = f"{provider}/{chunk}"
            rows.append(dict(workload=WORKLOADS[workload][0], provider=provider, batch=args.batch,
                             median_ms=f"{med:.3f}", p20_ms=f"{p20:.3f}", p80_ms=f"{p80:.3f}",
                             time_vs_nonprivate=f"{ratio:.3f}", peak_mem_mb=f"{peak:.2f}",
                             mem_vs_nonprivate=f"{mem_ratio:.3f}", **info))  # fmt: skip
            print(f"{WORKLOADS[workload][0]:20s} {provider:18s} {med:10.2f} ms ({p20:.2f}, {p80:.2f})  x{ratio:6.2f} "
                  f"time  {peak:8.2f} MB  x{mem_ratio:5.2f} memory", flush=True)  # fmt: skip
    harness.write_rows(rows, args.out, f"{info['device']}-jl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
