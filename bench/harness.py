"""The one benchmark harness: timing (do_bench on GPU, a wall-clock loop on CPU), device naming, CSV output."""

from __future__ import annotations

import csv
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def timer(device: torch.device, repeats: int, warmup: int = 1):
    """A function (fn -> (median, p20, p80) in ms): triton's do_bench on GPU, else ``warmup`` untimed
    calls then ``repeats`` timed ones."""

    def measure(fn) -> tuple[float, float, float]:
        if device.type == "cuda":
            import triton.testing

            med, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=200)
            return med, p20, p80
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        return statistics.median(times), q[1], q[7]

    return measure


def live_peak_mb(fn) -> float:
    """The largest total size, MiB, of the tensors alive at once during one call of ``fn`` (CPU): the counterpart of
    ``torch.cuda.max_memory_allocated`` for a CPU step. From torch.profiler's memory timeline (``profile_memory``):
    the tensors the call allocates plus those it touches that existed before (parameters, gradients, optimizer
    state, the batch). Unlike the process's peak resident set it does not count what the C allocator keeps after a
    free (glibc's arenas grow and rarely shrink: freed blocks, fragmentation), so providers are compared on what
    they allocate rather than on the allocator's history. The profiled call runs several times slower; time
    separately. NaN where the profiler's memory timeline (a private torch API) is missing."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline
    except ImportError:
        return float("nan")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max((sum(s) for s in sizes), default=0) / 2**20


def compare(builders: dict, device: torch.device, repeats: int, warmup: int = 2) -> dict:
    """Time providers side by side: ``builders`` maps a name to a function returning that provider's step closure.

    Returns name -> (median, p20, p80 in ms, peak MB), or None where the provider ran out of memory. On CPU every
    step is built first and the timed calls are interleaved (one call of each provider per round, the order
    rotating), so load drift on the machine falls on all providers alike and the ratios stay meaningful; the peak is
    :func:`live_peak_mb` of one more, profiled, call. On CUDA each provider is built and timed alone (do_bench) with
    its own peak-memory window (``torch.cuda.max_memory_allocated``).
    """
    results: dict = {}
    if device.type == "cuda":
        measure = timer(device, repeats, warmup)
        for name, build in builders.items():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            try:
                med, p20, p80 = measure(build())
            except torch.OutOfMemoryError:
                results[name] = None
                continue
            results[name] = (med, p20, p80, torch.cuda.max_memory_allocated(device) / 2**20)
        return results
    steps = {name: build() for name, build in builders.items()}
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) > 1 else ts * 9
        results[name] = (statistics.median(ts), q[1], q[7], live_peak_mb(steps[name]))
    return results


def chunks(x: torch.Tensor, y: torch.Tensor, micro_batch: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) as micro-batches of ``micro_batch`` rows (the last one shorter), or whole if None."""
    if micro_batch is None or micro_batch >= x.shape[0]:
        return [(x, y)]
    return list(zip(x.split(micro_batch), y.split(micro_batch), strict=True))


def nonprivate_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                    micro_batch: int | None = None):  # fmt: skip
    """A closure running one non-private SGD step (mean cross-entropy) of ``model`` on (x, y); with ``micro_batch``,
    gradients accumulated over micro-batches of that many rows (the same mean)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    pieces = chunks(x, y, micro_batch)

    def step():
        optimizer.zero_grad(set_to_none=True)
        for xc, yc in pieces:
            loss = torch.nn.functional.cross_entropy(model(xc), yc, reduction="sum" if len(pieces) > 1 else "mean")
            (loss / x.shape[0] if len(pieces) > 1 else loss).backward()
        optimizer.step()

    return step


def variant_step(variant, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                 micro_batch: int | None = None):  # fmt: skip
    """A closure running one private step of a fastdp variant on (x, y): gradient (clipping or bounds, noise keyed
    by a fresh step index), SGD update, then the variant's post-step hook (e.g. the Lipschitz projection). With
    ``micro_batch``, the batch is a logical batch processed as micro-batches (virtual batches, one release)."""
    from fastdp.algorithms import Batch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batches = [Batch(xc, yc, torch.ones(xc.shape[0], dtype=torch.bool, device=x.device))
               for xc, yc in chunks(x, y, micro_batch)]  # fmt: skip
    counter = iter(range(1 << 62))

    def step():
        variant.gradient(model, batches, next(counter))
        optimizer.step()
        variant.after_step(model)

    return step


# The H100 SXM floors the kernels' docstrings (kernels/*.py) are written against.
H100_BYTES_PER_S = 3.0e12  # HBM3 sustained (3.35 peak)
H100_TF32X3_FLOPS = 165e12  # dense TF32 tensor cores (495 TFLOP/s) over the three products of 3xTF32
H100_FP32_FLOPS = 67e12  # CUDA cores, no tensor cores
H100_BF16_FLOPS = 989e12  # dense bf16/fp16 tensor cores


def floor_share(device: torch.device, seconds_at_floor: float, median_ms: float) -> str:
    """The share of the H100 floor a run reached, for the printed line: '' off CUDA (no floor to compare with)."""
    if device.type != "cuda":
        return ""
    return f"  {100 * seconds_at_floor / (median_ms * 1e-3):5.1f}% of the H100 floor"


def run_info(device: torch.device) -> dict:
    """Columns every result row carries: device, threads, versions, date. Also printed as the run's header."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    info = dict(device=device_name(device), threads=torch.get_num_threads(), torch=torch.__version__,
                triton=triton_version, date=datetime.date.today().isoformat())  # fmt: skip
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    return info


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"


def write_rows(rows: list[dict], out: Path | None, default_name: str) -> None:
    """Append ``rows`` (long format) to ``out`` or ``bench/results/<default_name>.csv``."""
    if not rows:
        print("no rows to write")
        return
    out = out or RESULTS / f"{default_name.replace(' ', '_')}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {out}")
