"""Shared fixtures: device/backend matrix, tolerances. Triton runs in its interpreter without a GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel is defined (fastdp.kernels is imported lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fastdp  # noqa: E402
from fastdp._backend import available  # noqa: E402

# Kernel result vs the float64 reference: fp32 math, one rounding to the dtype.
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=2e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}

DEVICE_BACKENDS = [
    pytest.param(
        (device, backend),
        id=f"{device}-{backend}",
        marks=[pytest.mark.cuda] if device == "cuda" else ([pytest.mark.interpret] if backend == "triton" else []),
    )
    for device in ("cpu", "cuda")
    for backend in ("torch", "cuda", "triton")
]


@pytest.fixture(params=DEVICE_BACKENDS)
def device_backend(request):
    """(device, backend) with that backend selected; skipped where it cannot run."""
    device, backend = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ok, why = available(backend, device)
    if not ok:
        if os.environ.get("FASTDP_REQUIRE_EXT") == "1" and backend == "cuda" and device == "cpu":
            pytest.fail(f"fastdp._C must be built for this run: {why}")
        pytest.skip(why)
    previous = fastdp.set_backend(backend)
    yield device, backend
    fastdp.set_backend(previous)


@pytest.fixture
def restore_backend():
    previous = fastdp.get_backend()
    yield
    fastdp.set_backend(previous)


@pytest.fixture
def noise_draws(monkeypatch):
    """Every noise kernel call's (seed, offset, num_draws), for the add-noise kernels and the release's."""
    from fastdp.ops import noise as noise_module

    draws = []
    real = noise_module._kernel

    def chosen(backend, op="noise_"):
        run = real(backend, op)

        def recorded(*args):  # noise_: (..., seed, offset, num_draws, step); release_: (..., update, hyper) after
            draws.append(tuple(args[-5:-2] if op == "release_" else args[-4:-1]))
            return run(*args)

        return recorded

    monkeypatch.setattr(noise_module, "_kernel", chosen)
    return draws
