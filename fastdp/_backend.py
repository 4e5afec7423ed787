"""Backend dispatch: which implementation (torch, triton, cuda) runs each op family.

``FASTDP_BACKEND=auto|torch|triton|cuda`` (read at import) or ``fastdp.set_backend``
chooses. ``cuda`` names the compiled extension ``fastdp._C``: its CUDA kernels for
CUDA tensors and its ``csrc/cpu`` kernels for CPU tensors. ``auto`` picks, per device
kind, the fastest backend whose tests have passed on that kind (``VALIDATED``). A
requested backend that cannot run falls back to the ``auto`` choice with one warning.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from fastdp import _ext

BACKENDS = ("auto", "torch", "triton", "cuda")

# Backends whose tests have passed on each device kind, fastest first. A kernel is
# added here for a device kind only after `pytest` passed on such a device
# (record the run in bench/results/); an empty tuple means the torch reference.
VALIDATED: dict[str, dict[str, tuple[str, ...]]] = {
    # CPU: the csrc/cpu kernel passes tests/test_clip_ops.py and beats the torch reference, 1.1-3.3x forward and
    # 1.4-20x backward (bench/bench_clip.py, 2 threads). CUDA: no GPU test run recorded yet.
    "clip": {"cpu": ("cuda",), "cuda": ()},
    # CPU: the csrc/cpu kernel beats the torch reference (bench/bench_noise.py).
    # CUDA: no GPU test run recorded yet.
    "noise": {"cpu": ("cuda",), "cuda": ()},
    # CPU: the csrc/cpu kernels, 1.0x the torch reference at T=64 and 1.75-3.7x at T=512-1024
    # (bench/bench_norms.py, 2 threads, OpenMP build); the certified (float64) ghost norms 3-5x the reference's
    # batched float64 GEMMs (tests/test_norms.py::test_certified_kernel_*). CUDA: no GPU test run recorded yet.
    "norms": {"cpu": ("cuda",), "cuda": ()},
    # CPU: the torch reference, but for the carried certificates' Frobenius distance (csrc/cpu/spectral.cpp: one
    # pass, no float64 copies; tests/test_certified_bounds.py, 0.1 vs 2 ms for a 512 x 784 layer). CUDA: no GPU
    # test run recorded yet.
    "spectral": {"cpu": ("cuda",), "cuda": ()},
    # CPU: the torch reference (no csrc/cpu kernel; the Triton interpreter is a test vehicle).
    # CUDA: no GPU test run recorded yet.
    "orthogonal": {"cpu": (), "cuda": ()},
    # CPU: the csrc/cpu time loops of fastdp.nn's RNN/LSTM/GRU (one GEMM and one gate kernel per step) pass
    # tests/test_recurrence_ops.py and tests/test_recurrent.py and beat the torch loops (bench/results/cpu-rnn.md).
    # CUDA: none (the torch loops).
    "recurrence": {"cpu": ("cuda",), "cuda": ()},
}


def eager(tensors) -> bool:
    """True for plain tensors outside torch.compile: a fastdp op's entry point then runs its implementation
    directly. The dispatcher's Python wrappers of ``torch.ops.fastdp`` cost 20-80 us a call, as much as a small
    model's kernels; under tracing, fake or subclassed tensors the op is called, so graphs record it."""
    return not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in tensors)


def _parse(name: str) -> str:
    value = name.strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"fastdp: unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return value


_requested = _parse(os.environ.get("FASTDP_BACKEND", "auto") or "auto")
_warned: set[tuple[str, str, str]] = set()


def set_backend(name: str) -> str:
    """Choose the backend for every op family; returns the previous choice."""
    global _requested
    previous, _requested = _requested, _parse(name)
    return previous


def get_backend() -> str:
    """The requested backend (``auto`` unless set)."""
    return _requested


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(backend: str, device_type: str) -> tuple[bool, str]:
    """Whether ``backend`` can run on ``device_type`` here, and why not."""
    if backend == "torch":
        return True, "torch reference"
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install triton)"
        if device_type == "cpu" and not _triton_interpret():
            return False, "Triton runs on CPU tensors only with TRITON_INTERPRET=1"
        if device_type == "cuda" and _triton_interpret():
            return False, "TRITON_INTERPRET=1 is set: Triton kernels run in the CPU interpreter"
        if device_type not in ("cpu", "cuda"):
            return False, f"no Triton kernels for {device_type}"
        return True, "Triton kernels" + (" (interpreter)" if device_type == "cpu" else "")
    if backend == "cuda":
        if _ext._C is None:
            return False, f"fastdp._C is not built; {_ext.BUILD_HINT}"
        if device_type == "cpu":
            return True, "fastdp._C csrc/cpu kernels"
        if device_type == "cuda":
            if not _ext.has_cuda_kernels():
                return False, "fastdp._C was built without CUDA kernels (no CUDA torch or nvcc at build time)"
            return True, "fastdp._C CUDA kernels"
        return False, f"fastdp._C has no kernels for {device_type}"
    raise ValueError(f"fastdp: unknown backend {backend!r}")


def _auto(family: str, device_type: str) -> tuple[str, str]:
    for backend in VALIDATED[family].get(device_type, ()):
        ok, why = available(backend, device_type)
        if ok:
            return backend, f"auto: fastest backend validated on {device_type} ({why})"
    return "torch", f"auto: no fused {family} kernel validated on {device_type} and available; torch reference"


def resolve(family: str, device_type: str) -> tuple[str, str]:
    """(backend, reason) for ``family`` on ``device_type`` under the current choice; no warnings."""
    if _requested == "auto":
        return _auto(family, device_type)
    ok, why = available(_requested, device_type)
    if ok:
        return _requested, f"requested ({why})"
    backend, _ = _auto(family, device_type)
    return backend, f"requested {_requested!r} is unavailable ({why}); fell back to {backend!r}"


def select(family: str, device_type: str) -> str:
    """The backend to run now; a fallback or a slow default on a GPU is announced once."""
    backend, reason = resolve(family, device_type)
    slow_gpu_default = device_type == "cuda" and backend == "torch" and _requested in ("auto", "torch")
    fell_back = _requested not in ("auto", backend)
    key = (family, device_type, _requested)
    if (fell_back or (slow_gpu_default and _requested == "auto")) and key not in _warned:
        _warned.add(key)
        hint = " Set FASTDP_BACKEND=triton or cuda to opt in to an unvalidated kernel." if slow_gpu_default else ""
        warnings.warn(f"fastdp {family} on {device_type}: {reason}.{hint}", RuntimeWarning, stacklevel=3)
    return backend


def cpu_kernel(name: str, family: str, *tensors: torch.Tensor):
    """``fastdp._C``'s CPU kernel ``name`` where it runs these tensors (eager CPU tensors, ``family`` on the
    extension), else None."""
    kernel = getattr(_ext._C, name, None)
    if kernel is None or any(t.device.type != "cpu" for t in tensors) or not eager(tensors):
        return None
    return kernel if select(family, "cpu") == "cuda" else None


def backend_info() -> dict:
    """What each op family runs on for each device kind, and why."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "requested": _requested,
        "extension": "not built: " + str(_ext.LOAD_ERROR)
        if _ext._C is None
        else ("CPU + CUDA kernels" if _ext.has_cuda_kernels() else "CPU kernels"),
        "triton": triton_version,
        "triton_interpret": _triton_interpret(),
        "ops": {
            family: {
                device: dict(zip(("backend", "reason"), resolve(family, device), strict=True))
                for device in ("cpu", "cuda")
            }
            for family in VALIDATED
        },
    }
