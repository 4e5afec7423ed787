"""Speed and memory of DP training, library against library, each library in its own process.

Providers, on the same model, batch and DP settings (clip C = 1, noise multiplier 1, SGD lr 0.01, random data of the
workload's shape, seeds fixed): ``nonprivate`` (torch), ``opacus-hooks`` and ``opacus-ghost`` (Opacus), the fastdp
variants that apply to the workload — ``fastdp-dpsgd`` (DP-SGD through the variant API, ``DPSGD.gradient``),
``fastdp-frontdoor`` (the same DP-SGD through ``fastdp.PrivacyEngine``: ``make_private`` once, then the user's
ordinary loop, forward, the criterion make_private returns (mean cross-entropy), ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()``; the same expected batch size, hence the same noise std, as
fastdp-dpsgd; every workload fastdp-dpsgd runs), ``fastdp-jl`` (r = --jl-projections), ``fastdp-backprop`` (models of
Linear/Conv2d layers only), ``fastdp-clipless`` and ``fastdp-weightclip`` (on the Lipschitz twin of the model: the same
shapes with Lipschitz layers; weightclip needs clip-projected LipschitzLinear layers, so MLPs only) — and ``tf-privacy``
(its VectorizedDPKerasSGDOptimizer with one microbatch per example, in the venv that ``make bench-tf`` creates; skipped
with a message when that venv is absent). One step = forward, backward, the provider's clipping or bounds, noise,
optimizer update (and the projection of the Lipschitz variants). bench/bench_frontdoor.py times the front door against
the variant API interleaved in one process (paired rounds), for its overhead alone.

Each (provider, workload) runs in a fresh subprocess (``compare.py --worker JOB``; ``compare_tf.py`` for
tf-privacy), so import side effects, allocator caches and peak-memory counters never leak from one library into
another. The price: providers are timed one after the other, not interleaved, so on a shared machine the ratios
carry the load drift between processes (the provider order rotates from workload to workload). ``--rounds N``
repeats every fixed-batch job N times, alternating the providers (the order rotated each round), and reports the
round with the median time (all rounds' medians in ``round_ms``): the drift then reaches every provider alike.

Workloads: bench_dpsgd.py's (imported from it: MLP 784-512-512-10 at batch 256 and 4096, Opacus' MNIST CNN, a token
transformer with T = 64 and 512, ResNet-18-GN at B 32, and real architectures unmodified: transformers GPT-2 2 x 128
(vocabulary 1000, tied head over every position) at B 32 T 128, the same frozen with LoRA r = 8, BERT 2 x 128 at B
32 T 128, an nn.MultiheadAttention and an nn.LSTM classifier at B 64 T 32), and the lip-dp speed experiment
(papers/00 §4.2): VGG5-like CNNs on CIFAR-10-shaped inputs with about 130K, 510K and 2M parameters (``lipcnn-*``),
the batch doubled from --start-batch up to --max-batch. On CUDA the growth stops at the first out-of-memory error
(the largest batch before OOM is reported). On CPU it stops before the next batch would exceed --memory-budget-mb of
peak RSS growth (extrapolated linearly in the batch) or --max-step-s per step: a CPU run reports the largest batch
within that budget, not an OOM point, and says so; a worker whose resident set passes --memory-cap-mb is killed (a
guard for the machine; its row says so). DP-SGD-type providers and tf-privacy run the plain CNN (nn.Conv2d, no bias,
GroupSort2, L2-norm pooling), clipless its Lipschitz twin (RKO convolutions, BoundedInput).

Reported per row: median ms/step (p20, p80) — triton's do_bench on CUDA, a wall-clock loop after warm-up on CPU —,
the ratio to non-private at the same workload and batch, peak memory — CUDA: torch.cuda.max_memory_allocated
(tf-privacy: TensorFlow's peak of the GPU allocator); CPU: ``cpu-peak-rss-delta``, the subprocess's peak resident
set (resource.getrusage ru_maxrss) after the last timed step minus its resident set after two warm-up steps of the
same provider at batch 2 whose model was then freed (so shared-library code pages, thread pools and allocator arenas
are not counted; the model, batch, optimizer state and the step's workspace are) —, on CPU also ``peak_live_mb``,
the largest total size of tensors alive at once during one more (profiled) step (``harness.live_peak_mb``: the CPU
counterpart of CUDA's max_memory_allocated, without the C allocator's retained arenas that the resident set
carries), with its ratio ``live_vs_nonprivate`` —, and for the growth workloads
the largest batch each provider reached and what stopped it. Providers that do not apply (``n/a``) or could not run
here (``skipped``: library missing, or per-example gradients over the CPU memory budget) get a row saying so, with
no numbers. Results go to bench/results/<device>-compare.csv (rewritten each run, long format, versions and date on
every row) and the plots (time vs batch size, memory vs batch size) to <device>-compare-time.png / -memory.png when
matplotlib is importable, otherwise their data to <device>-compare-plot.csv.

    python bench/compare.py                 # default settings: about 10 minutes on 2 CPU cores
    python bench/compare.py --full          # batches up to 50,000 (OOM on GPU), larger CPU caps, more repeats
    python bench/compare.py --workloads mlp-256 lipcnn-130k --providers nonprivate fastdp-dpsgd --out /tmp/c.csv
    python bench/compare.py --micro-batch 256 --max-batch 16384   # virtual batches (below)

Virtual batches (``--micro-batch M``): every workload grows its *logical* batch from --start-batch (default M) to
--max-batch, each step processing it as micro-batches of M rows — non-private torch by gradient accumulation, fastdp
by summed clipped sums and one noise release, Opacus by its skip-step protocol (what BatchMemoryManager drives), the
front door by ``fastdp.engine.BatchMemoryManager`` over the logical batch (the same protocol: every physical step but
the last skipped, its clipped sums kept; one release) —
so peak memory should stay flat while the time grows with the batch; rows carry ``micro_batch`` and
``examples_per_s``, and go to <device>-compare-virtual.csv (tf-privacy: n/a, compare_tf.py has no virtual batches).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT_TAG = "@@compare-result "  # a worker prints one such line (JSON) per measured batch
DEFAULT_TF_PYTHON = REPO / ".venv" / "tf-privacy" / "bin" / "python"  # made by `make bench-tf`

PROVIDERS = {  # provider -> library
    "nonprivate": "torch",
    "opacus-hooks": "opacus",
    "opacus-ghost": "opacus",
    "fastdp-dpsgd": "fastdp",
    "fastdp-frontdoor": "fastdp",
    "fastdp-jl": "fastdp",
    "fastdp-backprop": "fastdp",
    "fastdp-clipless": "fastdp",
    "fastdp-weightclip": "fastdp",
    "tf-privacy": "tensorflow-privacy",
}
LIP_SIZES = {"lipcnn-130k": (36, 72), "lipcnn-510k": (80, 160), "lipcnn-2m": (168, 336)}  # VGG5 widths (c1, c2)
LIP_EXAMPLES, MNIST_EXAMPLES = 50_000, 60_000  # data set sizes behind the sample rates (CIFAR-10, MNIST)
INPUT_CLIP = 10.0  # backprop clipping's C1 (the gradient clip C2 is the clip norm C)
PAPER_MAX_BATCH = 50_000
PER_EXAMPLE = ("opacus-hooks", "tf-privacy")  # providers that hold B per-example gradients of every parameter

COLUMNS = [
    "workload", "params", "provider", "library", "library_version", "batch", "status", "median_ms", "p20_ms",
    "p80_ms", "time_vs_nonprivate", "peak_mem_mb", "mem_kind", "mem_vs_nonprivate", "peak_live_mb",
    "live_vs_nonprivate", "largest_batch", "stopped_by",
    "repeats", "rounds", "round_ms", "micro_batch", "examples_per_s", "note", "device", "threads", "torch", "python",
    "date",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------ workloads


def vgg5(c1: int, c2: int, lipschitz: bool, classes: int = 10):
    """VGG5-like CNN of the lip-dp speed experiment on [B, 3, 32, 32] inputs: conv c1, conv c1, pool, conv c2,
    conv c2, pool, dense; 3x3 convolutions without bias, GroupSort2 activations, L2-norm pooling. ``lipschitz``:
    BoundedInput(15) and RKO LipschitzConv2d / LipschitzLinear (clipless); else nn.Conv2d / nn.Linear (DP-SGD)."""
    from torch import nn

    from fastdp.nn.lipschitz import BoundedInput, GroupSort2, L2NormPool2d, LipschitzConv2d, LipschitzLinear

    def conv(cin: int, cout: int, hw: int) -> list:
        layer = (LipschitzConv2d(cin, cout, 3, input_hw=(hw, hw), padding=1) if lipschitz
                 else nn.Conv2d(cin, cout, 3, padding=1, bias=False))  # fmt: skip
        return [layer, GroupSort2()]

    head = LipschitzLinear(c2 * 8 * 8, classes) if lipschitz else nn.Linear(c2 * 8 * 8, classes, bias=False)
    return nn.Sequential(
        *([BoundedInput(15.0)] if lipschitz else []), *conv(3, c1, 32), *conv(c1, c1, 32), L2NormPool2d(2),
        *conv(c1, c2, 16), *conv(c2, c2, 16), L2NormPool2d(2), nn.Flatten(), head,
    )  # fmt: skip


def vgg5_params(c1: int, c2: int) -> int:
    return 9 * (3 * c1 + c1 * c1 + c1 * c2 + c2 * c2) + c2 * 64 * 10


def fixed_workloads() -> dict:
    """bench_dpsgd's workloads: name -> (model factory, input factory(batch, generator), batch size)."""
    import bench_dpsgd

    return bench_dpsgd.workloads()


def all_workloads() -> list[str]:
    return list(fixed_workloads()) + list(LIP_SIZES)


def tf_arch(workload: str) -> dict | None:
    """The Keras description of a workload's (plain) model for compare_tf.py; None if it has none."""
    if workload in LIP_SIZES:
        c1, c2 = LIP_SIZES[workload]
        return {"kind": "vgg5", "c1": c1, "c2": c2}
    if workload.startswith("mlp-"):
        return {"kind": "mlp", "inputs": 784, "hidden": 512, "depth": 2}
    if workload.startswith("cnn-"):
        return {"kind": "opacus_cnn"}
    if workload.startswith("transformer-T"):
        return {"kind": "transformer", "seq": int(workload.removeprefix("transformer-T")), "vocab": 1000, "d": 128}
    return None


def lipschitz_twin(workload: str, provider: str):
    """Factory of the Lipschitz version of the workload's model that ``provider`` trains, or None if it has none."""
    from fastdp.train.models import build_model

    if workload in LIP_SIZES and provider == "fastdp-clipless":
        return functools.partial(vgg5, *LIP_SIZES[workload], lipschitz=True)
    if workload.startswith("mlp-") and provider == "fastdp-clipless":
        return lambda: build_model("lipschitz_mlp", (784,), 10, hidden=512, depth=2)
    if workload.startswith("mlp-") and provider == "fastdp-weightclip":
        return lambda: build_model("weightclip_mlp", (784,), 10, hidden=512, depth=2, max_weight_norm=1.0)
    return None


def not_applicable(provider: str, workload: str) -> str | None:
    """Why ``provider`` does not apply to ``workload`` (None if it does)."""
    if provider in ("fastdp-clipless", "fastdp-weightclip"):
        if lipschitz_twin(workload, provider) is None:
            if provider == "fastdp-clipless":
                return "needs a Lipschitz model; this workload has no Lipschitz twin"
            return "needs clip-projected LipschitzLinear layers (MLPs only; fastdp has no clip-projected convolution)"
        return None
    if provider == "fastdp-backprop":
        from torch import nn

        factory = (functools.partial(vgg5, *LIP_SIZES[workload], lipschitz=False) if workload in LIP_SIZES
                   else fixed_workloads()[workload][0])  # fmt: skip
        model = factory()
        bad = sorted({type(m).__name__ for m in model.modules() if not isinstance(m, (nn.Linear, nn.Conv2d))
                      and any(True for _ in m.parameters(recurse=False))})  # fmt: skip
        return f"backprop clipping takes Linear/Conv2d layers only, the model has {', '.join(bad)}" if bad else None
    if provider == "tf-privacy" and tf_arch(workload) is None:
        return "no Keras version of this model in compare_tf.py"
    return None


def virtual_not_applicable(provider: str) -> str | None:
    """Why ``provider`` has no virtual-batch run (None if it has one)."""
    return "compare_tf.py has no virtual batches" if provider == "tf-privacy" else None


# ------------------------------------------------------------------------------------------------ worker side


WARM_BATCH = 2  # CPU memory baseline: the resident set after steps at this batch, their model freed


def maxrss_mb() -> float:
    """Peak resident set of this process so far, MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def rss_mb() -> float:
    """Resident set of this process now, MiB (/proc/self/statm; the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return maxrss_mb()


def warm_baseline(build) -> float:
    """The CPU memory baseline: run two steps of a tiny instance (``build()`` -> step closure), free it, and return
    the resident set. Code pages of the kernels the step runs, thread pools and allocator arenas are then in the
    baseline, so the peak RSS delta measured against it counts the model, batch, optimizer state and workspace."""
    step = build()
    step()
    step()
    del step
    gc.collect()
    return rss_mb()


class SizedData:
    """A map-style data set of ``n`` examples that only the private loader's sample rate reads: the front door's
    step trains on the workload's fixed batch (as every provider), so the loader make_private returns is not
    iterated."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        raise IndexError("compare.py's front-door step never draws from its loader")


def frontdoor_step(model, x, y, num_examples: int, micro_batch: int | None = None,
                   noise_multiplier: float | None = None, lr: float | None = None,
                   reproducible_seed: int | None = None):  # fmt: skip
    """A closure running one DP-SGD step of ``model`` on (x, y) through fastdp's front door, as a user writes it:
    ``PrivacyEngine.make_private`` once (here, with ``criterion`` and ``grad_sample_mode="ghost"``, as for Opacus'
    ghost clipping), then forward, the criterion it returns (mean cross-entropy: ``fastdp.engine.DPLoss``),
    ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``. Clip norm, noise multiplier and lr are
    bench_dpsgd's unless given; the loader's batch size is the batch, so the expected batch size (what the noisy sum
    is divided by) and the noise std are the variant API's (fastdp-dpsgd). With ``micro_batch``, (x, y) is one logical
    batch walked by ``fastdp.engine.BatchMemoryManager`` in physical batches of that many rows (every step but the last
    skipped, its clipped sums kept; one release), as an Opacus script does. ``reproducible_seed``: for tests only (NOT
    FOR RELEASE); the benchmark's noise is keyed by OS entropy, as the variant API's."""
    import bench_dpsgd
    import torch
    from torch.utils.data import DataLoader

    from fastdp import PrivacyEngine
    from fastdp.engine import BatchMemoryManager

    sigma = bench_dpsgd.SIGMA if noise_multiplier is None else noise_multiplier
    optimizer = torch.optim.SGD(model.parameters(), lr=bench_dpsgd.LR if lr is None else lr)
    loader = DataLoader(SizedData(num_examples), batch_size=x.shape[0])
    private, optimizer, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=bench_dpsgd.CLIP,
        reproducible_seed=reproducible_seed, criterion=torch.nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    logical = [(x, y)]  # one logical batch per step (a Poisson loader would give a new one each time)

    def train(batches) -> None:
        for xb, yb in batches:
            loss = criterion(private(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def step():
        if micro_batch is None or micro_batch >= x.shape[0]:
            train(logical)
            return
        with BatchMemoryManager(data_loader=logical, max_physical_batch_size=micro_batch,
                                optimizer=optimizer) as batches:  # fmt: skip
            train(batches)

    step.optimizer = optimizer  # for tests: steps_taken, the accountant
    return step


def build_step(job: dict, batch: int):
    """(step closure, trainable parameter count) of ``job``'s provider and workload at ``batch``."""
    import bench_dpsgd
    import harness
    import torch

    from fastdp.algorithms import JL, BackpropClip, Clipless, WeightClip

    provider, workload, device = job["provider"], job["workload"], torch.device(job["device"])
    gen = torch.Generator().manual_seed(0)
    if workload in LIP_SIZES:
        factory = lipschitz_twin(workload, provider) or functools.partial(vgg5, *LIP_SIZES[workload], lipschitz=False)
        x, n = torch.randn(batch, 3, 32, 32, generator=gen), LIP_EXAMPLES
    else:
        factory, inputs, _ = fixed_workloads()[workload]
        factory = lipschitz_twin(workload, provider) or factory
        x, n = inputs(batch, gen), MNIST_EXAMPLES
    y = torch.randint(0, 10, (batch,), generator=gen)
    x, y = x.to(device), y.to(device)
    torch.manual_seed(0)
    model = factory().to(device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    micro = job.get("micro_batch")
    if provider in ("nonprivate", "opacus-hooks", "opacus-ghost", "fastdp-dpsgd"):
        name = "fastdp" if provider == "fastdp-dpsgd" else provider
        return bench_dpsgd.make_step(name, model, x, y, micro), params
    if provider == "fastdp-frontdoor":
        return frontdoor_step(model, x, y, n, micro), params
    q, clip, sigma = batch / n, bench_dpsgd.CLIP, bench_dpsgd.SIGMA
    variant = {
        "fastdp-jl": lambda: JL(clip, sigma, q, n, projections=job["jl_projections"]),
        "fastdp-backprop": lambda: BackpropClip(INPUT_CLIP, clip, sigma, q, n),
        "fastdp-clipless": lambda: Clipless(sigma, q, n),
        "fastdp-weightclip": lambda: WeightClip(sigma, q, n),
    }[provider]()
    return harness.variant_step(variant, model, x, y, bench_dpsgd.LR, micro), params


def _is_oom(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def next_stop(job: dict, batch: int, nxt: int | None, median_ms: float, peak_mb: float) -> str:
    """Why the growth stops after ``batch`` (empty if it goes on to ``nxt``); the CPU caps extrapolate linearly."""
    if nxt is None:
        return f"max batch {batch}" if job["growth"] else ""
    if job["memory_budget_mb"] and peak_mb * nxt / batch > job["memory_budget_mb"]:
        need = peak_mb * nxt / batch
        return f"memory budget {job['memory_budget_mb']:.0f} MB (next batch {nxt} would need ~{need:.0f} MB)"
    if job["max_step_ms"] and median_ms * nxt / batch > job["max_step_ms"]:
        need = median_ms * nxt / batch / 1e3
        return f"step-time cap {job['max_step_ms'] / 1e3:g} s (next batch {nxt} would take ~{need:.1f} s)"
    return ""


def emit(result: dict) -> None:
    print(RESULT_TAG + json.dumps(result), flush=True)


def worker(job: dict) -> int:
    """Run one (provider, workload) job in this process: every batch of ``job["batches"]`` in turn, fresh model,
    until one runs out of memory or a cap is hit; one result line per batch."""
    import warnings

    warnings.filterwarnings("ignore")
    import harness
    import torch

    device = torch.device(job["device"])
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    if job["provider"].startswith("opacus"):
        import opacus

        version = opacus.__version__
    elif job["provider"].startswith("fastdp"):
        import fastdp

        version = fastdp.__version__
    else:
        version = torch.__version__
    base = 0.0 if device.type == "cuda" else warm_baseline(lambda: build_step(job, WARM_BATCH)[0])
    batches = job["batches"]
    for i, batch in enumerate(batches):
        nxt = batches[i + 1] if i + 1 < len(batches) else None
        mem_kind = "cuda-max-allocated" if device.type == "cuda" else "cpu-peak-rss-delta"
        result = dict(provider=job["provider"], workload=job["workload"], batch=batch, library_version=version,
                      pid=os.getpid(), mem_kind=mem_kind)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step = None
        try:
            step, result["params"] = build_step(job, batch)
            med, p20, p80 = harness.timer(device, job["repeats"], job["warmup"])(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as err:  # an OOM ends the growth; anything else propagates (the parent reports it)
            if not _is_oom(err):
                raise
            step = None
            emit(dict(result, status="oom", stopped_by=f"out of memory at batch {batch}", note=str(err)[:200]))
            return 0
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else maxrss_mb() - base
        if device.type == "cpu":
            result["peak_live_mb"] = harness.live_peak_mb(step)  # after the RSS reading: the profiler allocates
        over = device.type == "cpu" and job["memory_budget_mb"] and peak > job["memory_budget_mb"]
        stop = "" if over else next_stop(job, batch, nxt, med, peak)
        if over:
            stop = f"memory budget {job['memory_budget_mb']:.0f} MB exceeded at batch {batch}"
        emit(dict(result, status="over-budget" if over else "ok", median_ms=med, p20_ms=p20, p80_ms=p80,
                  peak_mem_mb=peak, stopped_by=stop))  # fmt: skip
        del step
        gc.collect()
        if stop:
            return 0
    return 0


# ------------------------------------------------------------------------------------------------ parent side


def process_rss_mb(pid: int) -> float:
    """Resident set of process ``pid`` now, MiB (0 where /proc is missing or the process is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def run_job(job: dict, python: str, script: Path, timeout: float, memory_cap_mb: float = 0) -> tuple[list[dict], str]:
    """Run ``job`` in a subprocess; (its result rows, an error text: empty if it exited cleanly). The subprocess is
    killed after ``timeout`` seconds or, with ``memory_cap_mb``, as soon as its resident set exceeds that (polled
    every 0.1 s: a guard for the machine, not a measurement)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore")
    cmd = [python, str(script), "--worker", json.dumps(job)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO)
        deadline, why = time.monotonic() + timeout, ""
        while proc.poll() is None:
            if time.monotonic() > deadline:
                why = f"timed out after {timeout:.0f} s"
            elif memory_cap_mb and process_rss_mb(proc.pid) > memory_cap_mb:
                why = f"killed by compare.py: resident set over the {memory_cap_mb:.0f} MB cap (--memory-cap-mb)"
            if why:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        rows, stderr = _parse(out.read()), err.read()
    if why or proc.returncode == 0:
        return rows, why
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return rows, f"killed (signal {-proc.returncode}; out of memory?)" if proc.returncode < 0 else tail


def _parse(stdout: str) -> list[dict]:
    return [json.loads(line[len(RESULT_TAG) :]) for line in stdout.splitlines() if line.startswith(RESULT_TAG)]


def growth_batches(start: int, stop: int) -> list[int]:
    """start, 2 start, 4 start, ... while <= stop, then stop itself (the paper's 50,000) if not reached exactly."""
    out = []
    b = start
    while b <= stop:
        out.append(b)
        b *= 2
    if not out or out[-1] != stop:
        out.append(stop)
    return out


def settings(args: argparse.Namespace, device_type: str) -> dict:
    """Defaults that depend on --full and the device (explicit options win)."""
    cpu = device_type == "cpu"
    full = args.full
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return dict(
        repeats=pick(args.repeats, (10 if full else 5) if cpu else 100),
        warmup=pick(args.warmup, 2),
        growth_repeats=pick(args.growth_repeats, (5 if full else 3) if cpu else 100),
        start_batch=pick(args.start_batch, 32),
        max_batch=pick(args.max_batch, PAPER_MAX_BATCH if (full or not cpu) else 4096),
        memory_budget_mb=pick(args.memory_budget_mb, (8192 if full else 2048) if cpu else 0),
        max_step_s=pick(args.max_step_s, (20.0 if full else 1.5) if cpu else 30.0),
        timeout_s=pick(args.job_timeout_s, 3600 if full else 1200),
        memory_cap_mb=pick(args.memory_cap_mb, (16384 if full else 8192) if cpu else 0),
    )


def _rotated(providers: list[str], k: int) -> list[str]:
    """``providers`` starting at index ``k`` (mod their number): each workload, and each round, starts elsewhere."""
    k %= len(providers)
    return providers[k:] + providers[:k]


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (provider, batch) of a workload run in several rounds (``--rounds``): of the rounds that ran
    ("ok"), the one with the median step time (the lower of the two middle ones for an even count), with every
    round's median in ``round_ms``; a provider that never ran keeps its first row (skipped, n/a, error)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["provider"], r["batch"]), []).append(r)
    merged = []
    for group in groups.values():
        ok = [r for r in group if r.get("status") == "ok"]
        if not ok:
            merged.append(group[0])
            continue
        middle = sorted(ok, key=lambda r: r["median_ms"])[(len(ok) - 1) // 2]
        merged.append(dict(middle, rounds=len(ok), round_ms=";".join(f"{r['median_ms']:.2f}" for r in ok)))
    return merged


def add_ratios(rows: list[dict]) -> None:
    """time/memory ratios to nonprivate at the same (workload, batch); largest batch per (workload, provider)."""
    base = {(r["workload"], r["batch"]): r for r in rows if r["provider"] == "nonprivate" and r["status"] == "ok"}
    for r in rows:
        b = base.get((r["workload"], r["batch"]))
        ok = r["status"] in ("ok", "over-budget")
        r["time_vs_nonprivate"] = r["median_ms"] / b["median_ms"] if b and ok else float("nan")
        r["mem_vs_nonprivate"] = r["peak_mem_mb"] / b["peak_mem_mb"] if b and ok and b["peak_mem_mb"] else float("nan")
        live, live_base = r.get("peak_live_mb"), b.get("peak_live_mb") if b else None
        r["live_vs_nonprivate"] = live / live_base if ok and live and live_base else float("nan")
    for _, group in itertools.groupby(rows, key=lambda r: (r["workload"], r["provider"])):
        group = list(group)
        within = [r["batch"] for r in group if r["status"] == "ok"]
        stopped = next((r["stopped_by"] for r in reversed(group) if r.get("stopped_by")), "")
        for r in group:
            r["largest_batch"] = max(within) if within and r.get("growth") else ""
            r["stopped_by"] = stopped if r.get("growth") else r.get("stopped_by", "")


def fmt(value, spec: str) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return "nan" if value != value else format(value, spec)
    return str(value)


def write_csv(rows: list[dict], path: Path) -> None:
    """Write (not append) the run's rows in long format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            ratio = ("time", "mem_vs", "live_vs")
            writer.writerow({k: fmt(r.get(k, ""), ".3f" if k.endswith("_ms") or k.startswith(ratio) else ".1f")
                             for k in COLUMNS})  # fmt: skip
    print(f"wrote {len(rows)} rows to {path}")


def plot(rows: list[dict], stem: Path) -> list[Path]:
    """Time and memory vs batch size of the growth workloads: PNGs if matplotlib is importable, else the plot data
    as CSV. Returns the files written."""
    growth = [r for r in rows if r.get("growth") and r["status"] in ("ok", "over-budget", "oom")]
    if not growth:
        return []
    stem.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = stem.with_name(stem.name + "-plot.csv")
        keys = ["workload", "params", "provider", "batch", "status", "median_ms", "peak_mem_mb", "mem_kind"]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({k: fmt(r.get(k, ""), ".3f") for k in keys} for r in growth)
        print(f"matplotlib is not importable in this venv: no PNG plots; their data is in {path}")
        return [path]
    workloads = list(dict.fromkeys(r["workload"] for r in growth))
    mem_kind = growth[0]["mem_kind"]
    written = []
    for key, label, suffix in (("median_ms", "ms / step (median)", "time"),
                               ("peak_mem_mb", f"peak memory, MiB ({mem_kind})", "memory")):  # fmt: skip
        fig, axes = plt.subplots(1, len(workloads), figsize=(max(7, 5 * len(workloads)), 4.5), squeeze=False)
        for ax, workload in zip(axes[0], workloads, strict=True):
            here = [r for r in growth if r["workload"] == workload]
            for provider in dict.fromkeys(r["provider"] for r in here):
                pts = [r for r in here if r["provider"] == provider and r["status"] != "oom"]
                if pts:
                    line = ax.plot([r["batch"] for r in pts], [r[key] for r in pts], marker="o", label=provider)[0]
                    if any(r["status"] == "oom" for r in here if r["provider"] == provider):
                        ax.plot(pts[-1]["batch"], pts[-1][key], marker="X", markersize=12, color=line.get_color())
            params = here[0].get("params", "")
            ax.set_xscale("log", base=2)
            ax.set(yscale="log", xlabel="batch size", ylabel=label, title=f"{workload} ({params} params)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize="small")
        fig.suptitle(
            f"{growth[0]['device']}, {growth[0]['date']}; X: out of memory at the next batch", fontsize="medium"
        )
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{suffix}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
        print(f"wrote {path}")
    return written


def versions_line(tf_python: Path | None) -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    try:
        parts.append(f"opacus {importlib.metadata.version('opacus')}")
    except importlib.metadata.PackageNotFoundError:
        parts.append("opacus not installed")
    parts.append(f"tf-privacy venv {tf_python}" if tf_python else "tf-privacy venv absent")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument(
        "--full", action="store_true", help="long run: batches up to 50,000, CPU caps 8 GB / 20 s per step"
    )
    parser.add_argument("--workloads", nargs="+", default=None, help=f"default: all; choices: "
                        f"{', '.join(all_workloads())}")  # fmt: skip
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--batch", type=int, default=None, help="override the batch of bench_dpsgd's workloads")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per fixed-batch job (CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before timing (CPU)")
    parser.add_argument("--rounds", type=int, default=1, help="fixed-batch workloads: run every provider this many "
                        "times, alternating (each round a fresh process per provider, the order rotated), and report "
                        "the round with the median time: the machine's drift between processes then affects every "
                        "provider alike")  # fmt: skip
    parser.add_argument("--growth-repeats", type=int, default=None, help="timed steps per batch in growth jobs (CPU)")
    parser.add_argument("--start-batch", type=int, default=None, help="first batch of the growth workloads (32)")
    parser.add_argument("--max-batch", type=int, default=None, help="last batch (CPU 4096; GPU, --full 50000)")
    parser.add_argument(
        "--memory-budget-mb",
        type=float,
        default=None,
        help="CPU: stop growing before peak RSS growth exceeds this (2048; --full 8192; 0: none)",
    )
    parser.add_argument(
        "--max-step-s",
        type=float,
        default=None,
        help="stop growing before a step takes longer (CPU 1.5 s, --full 20 s; GPU 30 s; 0: none)",
    )
    parser.add_argument(
        "--memory-cap-mb",
        type=float,
        default=None,
        help="CPU: kill a worker whose resident set exceeds this (8192; --full 16384; 0: none)",
    )
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="virtual batches: grow every workload's logical batch, processed as micro-batches of "
                             "this many rows (CSV <device>-compare-virtual.csv)")  # fmt: skip
    parser.add_argument("--jl-projections", type=int, default=5, help="r of fastdp-jl")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per worker (default: the library's)")
    parser.add_argument("--job-timeout-s", type=float, default=None, help="kill a job after this long (1200 s)")
    parser.add_argument(
        "--tf-python",
        type=Path,
        default=Path(os.environ.get("FASTDP_TF_PYTHON", DEFAULT_TF_PYTHON)),
        help="python of the tf-privacy venv (make bench-tf; $FASTDP_TF_PYTHON)",
    )
    parser.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/<device>-compare.csv)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch must be >= 1, got {args.micro_batch}")

    import harness
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    conf = settings(args, device.type)
    workloads = args.workloads or all_workloads()
    unknown = [w for w in workloads if w not in all_workloads()]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(all_workloads())}")
    tf_python = args.tf_python if args.tf_python.exists() else None
    threads = args.threads or torch.get_num_threads()
    info = dict(device=harness.device_name(device), threads=threads, torch=torch.__version__,
                python=platform.python_version(), date=datetime.date.today().isoformat())  # fmt: skip
    print(", ".join(f"{k} {v}" for k, v in info.items()) + "; " + versions_line(tf_python), flush=True)
    providers = list(args.providers)
    unavailable = {}  # provider -> why it cannot run at all here
    if tf_python is None:
        unavailable["tf-privacy"] = f"no tf-privacy venv at {args.tf_python} (create it with `make bench-tf`)"
    if importlib.util.find_spec("opacus") is None:  # the workers import it, not this process
        unavailable.update(
            dict.fromkeys(("opacus-hooks", "opacus-ghost"), "opacus is not installed (pip install opacus)")
        )
    for provider in dict.fromkeys(p for p in providers if p in unavailable):
        print(f"{provider} skipped: {unavailable[provider]}")
    if device.type == "cpu":
        print(f"CPU run: the lip-dp growth stops before peak RSS growth would exceed {conf['memory_budget_mb']:.0f} MB "
              f"or a step {conf['max_step_s']:g} s (batches {conf['start_batch']}..{conf['max_batch']}); it reports "
              "the largest batch within that budget, not an out-of-memory point", flush=True)  # fmt: skip
    start = time.perf_counter()
    rows: list[dict] = []
    for index, workload in enumerate(workloads):
        growth = workload in LIP_SIZES or args.micro_batch is not None
        if workload in LIP_SIZES:
            params = vgg5_params(*LIP_SIZES[workload])
        else:
            factory, _, default_batch = fixed_workloads()[workload]
            params = sum(p.numel() for p in factory().parameters() if p.requires_grad)
        if args.micro_batch is not None:  # logical batches from the micro-batch up
            batches = growth_batches(args.start_batch or args.micro_batch, conf["max_batch"])
        elif growth:
            batches = growth_batches(conf["start_batch"], conf["max_batch"])
        else:
            batches = [args.batch or default_batch]
        rounds = 1 if growth else args.rounds
        first_row = len(rows)
        for provider in (p for k in range(rounds) for p in _rotated(providers, index + k)):
            base = dict(info, workload=workload, provider=provider, library=PROVIDERS[provider], params=params,
                        batch=batches[0], growth=growth)  # fmt: skip
            status, reason = ("skipped", unavailable[provider]) if provider in unavailable else ("n/a", None)
            reason = reason or not_applicable(provider, workload)
            if args.micro_batch is not None:
                reason = reason or virtual_not_applicable(provider)
                base["micro_batch"] = args.micro_batch
            need_mb = (args.micro_batch or batches[0]) * params * 4 / 2**20  # per-example gradients, float32
            if (
                not reason
                and provider in PER_EXAMPLE
                and device.type == "cpu"
                and 0 < conf["memory_budget_mb"] < need_mb
            ):
                status, reason = "skipped", (f"its per-example gradients would take {need_mb / 1024:.1f} GiB, over the "
                                             f"{conf['memory_budget_mb']:.0f} MB CPU memory budget")  # fmt: skip
            if reason:
                print(f"{workload:17s} {provider:17s} {status}: {reason}", flush=True)
                rows.append(dict(base, status=status, note=reason))
                continue
            job = dict(provider=provider, workload=workload, batches=batches, device=str(device), growth=growth,
                       repeats=conf["growth_repeats" if growth else "repeats"], warmup=conf["warmup"],
                       jl_projections=args.jl_projections, threads=args.threads, micro_batch=args.micro_batch,
                       max_step_ms=conf["max_step_s"] * 1e3 if growth else 0,
                       memory_budget_mb=conf["memory_budget_mb"] if growth and device.type == "cpu" else 0)  # fmt: skip
            if provider == "tf-privacy":
                job["arch"] = tf_arch(workload)
                script, python = HERE / "compare_tf.py", str(tf_python)
            else:
                script, python = Path(__file__).resolve(), sys.executable
            results, error = run_job(job, python, script, conf["timeout_s"], conf["memory_cap_mb"])
            for r in results:
                r.update(info, library=PROVIDERS[provider], growth=growth, repeats=job["repeats"])
                r.setdefault("params", params)
                r.setdefault("stopped_by", "")
                r["micro_batch"] = args.micro_batch or ""
                if r.get("median_ms"):
                    r["examples_per_s"] = r["batch"] / r["median_ms"] * 1e3
                rows.append(r)
                print(line(r), flush=True)
            if error:
                print(f"{workload:17s} {provider:17s} failed: {error}", flush=True)
                failed = batches[len(results)] if len(results) < len(batches) else batches[-1]
                status = "killed" if error.startswith("killed") else "error"
                rows.append(
                    dict(base, batch=failed, status=status, note=error[:300], stopped_by=f"{status} at {failed}")
                )
        if rounds > 1:
            rows[first_row:] = merge_rounds(rows[first_row:])
    for r in rows:
        r.setdefault("median_ms", float("nan"))
        r.setdefault("peak_mem_mb", float("nan"))
    add_ratios(rows)
    summary(rows)
    suffix = "-compare-virtual.csv" if args.micro_batch is not None else "-compare.csv"
    out = args.out or harness.RESULTS / f"{info['device'].replace(' ', '_')}{suffix}"
    write_csv(rows, out)
    plot(rows, out.with_suffix(""))
    print(f"compare.py took {(time.perf_counter() - start) / 60:.1f} min")
    return 0


def line(r: dict) -> str:
    if r["status"] == "oom":
        return f"{r['workload']:17s} {r['provider']:17s} b={r['batch']:<6d} out of memory"
    text = (f"{r['workload']:17s} {r['provider']:17s} b={r['batch']:<6d} {r['median_ms']:10.2f} ms "
            f"({r['p20_ms']:.2f}, {r['p80_ms']:.2f})  {r['peak_mem_mb']:9.1f} MB {r['mem_kind']}")  # fmt: skip
    if r.get("peak_live_mb") is not None:
        text += f", {r['peak_live_mb']:.1f} MB live"
    return text + (f"  [{r['status']}]" if r["status"] != "ok" else "") + (f"  stop: {r['stopped_by']}"
                                                                          if r.get("stopped_by") else "")  # fmt: skip


def summary(rows: list[dict]) -> None:
    """Per workload: the fixed-batch results with ratios, or per provider the largest batch and its step time."""
    print("\nsummary (ratios to nonprivate at the same workload and batch)")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        here = [r for r in rows if r["workload"] == workload]
        print(f"\n{workload} ({here[0].get('params') or '?'} params)")
        for provider in dict.fromkeys(r["provider"] for r in here):
            mine = [r for r in here if r["provider"] == provider]
            done = [r for r in mine if r["status"] in ("ok", "over-budget")]
            if not done:
                print(f"  {provider:17s} {mine[-1]['status']}: {mine[-1].get('note') or mine[-1].get('stopped_by')}")
                continue
            top = ([r for r in done if r["status"] == "ok"] or done)[-1]
            text = (f"  {provider:17s} b={top['batch']:<6d} {fmt(top['median_ms'], '9.2f')} ms  "
                    f"x{fmt(top['time_vs_nonprivate'], '5.2f')} time  {fmt(top['peak_mem_mb'], '8.1f')} MB  "
                    f"x{fmt(top['mem_vs_nonprivate'], '5.2f')} memory")  # fmt: skip
            if top.get("peak_live_mb") is not None:
                text += f"  {fmt(top['peak_live_mb'], '8.1f')} MB live  x{fmt(top['live_vs_nonprivate'], '5.2f')}"
            if top.get("growth"):
                text += f"  largest batch {top['largest_batch'] or '-'}, stopped by: {top.get('stopped_by') or '-'}"
            print(text + (f"  [{top['status']}]" if top["status"] != "ok" else ""))


if __name__ == "__main__":
    sys.exit(main())
