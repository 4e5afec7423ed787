"""pytest-benchmark micro-benchmarks of every public fastdp op, on the current backend (``FASTDP_BACKEND``).

Not part of ``make test`` (pytest's testpaths is tests/); run them with

    pytest bench/ --benchmark-only                       # CUDA if available, else CPU
    FASTDP_BACKEND=torch pytest bench/ --benchmark-only --benchmark-columns=median,iqr,ops

Each case records the bytes the op must move (``extra_info["bytes"]``) or its FLOPs, and, after the run, the
achieved GB/s or GFLOP/s at the median. Inputs are made outside the timed function; on CUDA the timed function
synchronises so the time is the kernel's, not the launch's. The file is skipped when pytest-benchmark is missing
(``pip install pytest-benchmark``, in the ``dev`` extra).
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed (pip install pytest-benchmark)")

import torch  # noqa: E402

from fastdp.ops import (  # noqa: E402
    add_noise_,
    bjorck_orthonormalize,
    certified_spectral_norms,
    clip_factors,
    clip_gradient,
    clip_rows,
    ghost_norm_sq,
    noisy_sgd_step_,
    power_iteration,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32 = 4


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)


def run(benchmark, fn, *, bytes_moved: float = 0.0, flops: float = 0.0):
    """Benchmark ``fn`` (synchronised on CUDA) and record the achieved rate at the median."""

    def timed():
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    benchmark.extra_info.update(device=str(DEVICE), bytes=bytes_moved, flops=flops)
    result = benchmark(timed)
    stats = getattr(benchmark, "stats", None)
    median = getattr(getattr(stats, "stats", None), "median", None)
    if median:
        if bytes_moved:
            benchmark.extra_info["GB/s"] = round(bytes_moved / median / 1e9, 2)
        if flops:
            benchmark.extra_info["GFLOP/s"] = round(flops / median / 1e9, 2)
    return result


def tensor_list(count: int, rows: int, cols: int) -> list[torch.Tensor]:
    return [randn(rows, cols) for _ in range(count)]


# ------------------------------------------------------------------------------------------------ noise


@pytest.mark.parametrize("count,rows,cols", [(10, 512, 512), (62, 64, 64)], ids=["10x512x512", "62x64x64"])
def test_add_noise_(benchmark, count, rows, cols):
    grads = tensor_list(count, rows, cols)
    numel = sum(g.numel() for g in grads)
    counter = iter(range(1 << 62))
    run(benchmark, lambda: add_noise_(grads, 1.0, seed=0, offset=next(counter)), bytes_moved=2 * F32 * numel)


@pytest.mark.parametrize("count,rows,cols", [(10, 512, 512), (62, 64, 64)], ids=["10x512x512", "62x64x64"])
def test_noisy_sgd_step_(benchmark, count, rows, cols):
    params, grads = tensor_list(count, rows, cols), tensor_list(count, rows, cols)
    numel = sum(g.numel() for g in grads)
    counter = iter(range(1 << 62))
    run(benchmark, lambda: noisy_sgd_step_(params, grads, 1.0, lr=0.1, scale=256.0, seed=0, offset=next(counter)),
        bytes_moved=3 * F32 * numel)  # fmt: skip


# ------------------------------------------------------------------------------------------------ norms


@pytest.mark.parametrize("batch,tokens,d_in,d_out", [(256, 1, 784, 512), (64, 64, 128, 384)],
                         ids=["linear-256x784x512", "tokens-64x64x128x384"])  # fmt: skip
def test_ghost_norm_sq(benchmark, batch, tokens, d_in, d_out):
    a, g = randn(batch, tokens, d_in), randn(batch, tokens, d_out)
    # T = 1: two row norms; T > 1: two [T, T] Gram matrices per example and their inner product
    flops = 2 * batch * (d_in + d_out) if tokens == 1 else 2 * batch * tokens * tokens * (d_in + d_out)
    run(benchmark, lambda: ghost_norm_sq(a, g), bytes_moved=F32 * (a.numel() + g.numel()), flops=flops)


@pytest.mark.parametrize("layers,batch", [(8, 4096), (64, 256)], ids=["8x4096", "64x256"])
def test_clip_factors(benchmark, layers, batch):
    sq = randn(layers, batch).abs()
    run(benchmark, lambda: clip_factors(sq, 1.0), bytes_moved=F32 * (sq.numel() + 2 * batch))


# ------------------------------------------------------------------------------------------------ clip


@pytest.mark.parametrize("shape,norm", [((4096, 784), "l2"), ((256, 32, 16, 16), "l15")],
                         ids=["l2-4096x784", "l15-256x32x16x16"])  # fmt: skip
def test_clip_rows(benchmark, shape, norm):
    x = randn(*shape)
    run(benchmark, lambda: clip_rows(x, 1.0, norm), bytes_moved=2 * F32 * x.numel())


@pytest.mark.parametrize("shape,norm", [((4096, 784), "l2"), ((256, 32, 16, 16), "l15")],
                         ids=["l2-4096x784", "l15-256x32x16x16"])  # fmt: skip
def test_clip_gradient(benchmark, shape, norm):
    """Forward (a copy) and backward (the row clip of the upstream gradient) together."""
    x, grad = randn(*shape).requires_grad_(), randn(*shape)

    def forward_backward():
        (g,) = torch.autograd.grad(clip_gradient(x, 1.0, norm), x, grad)
        return g

    run(benchmark, forward_backward, bytes_moved=4 * F32 * x.numel())


# ------------------------------------------------------------------------------------------------ spectral


def _gemm_flops(weights: list[torch.Tensor], iters: int, per_iter: int) -> float:
    return float(sum(per_iter * 2 * w.shape[0] * w.shape[1] for w in weights) * iters)


@pytest.mark.parametrize("count,n", [(10, 512), (24, 64)], ids=["10x512x512", "24x64x64"])
def test_power_iteration(benchmark, count, n):
    weights = tensor_list(count, n, n)
    _, u, _ = power_iteration(weights, iters=1)
    run(benchmark, lambda: power_iteration(weights, u, iters=10), flops=_gemm_flops(weights, 10, 2))


@pytest.mark.parametrize("count,n", [(10, 512), (24, 64)], ids=["10x512x512", "24x64x64"])
def test_certified_spectral_norms(benchmark, count, n):
    weights = tensor_list(count, n, n)
    # one Gram matrix W^T W, then each iteration squares an n x n matrix
    flops = sum(2 * w.shape[0] * w.shape[1] ** 2 + 6 * 2 * w.shape[1] ** 3 for w in weights)
    run(benchmark, lambda: certified_spectral_norms(weights, iters=6), flops=float(flops))


@pytest.mark.parametrize("count,n", [(4, 256), (24, 64)], ids=["4x256x256", "24x64x64"])
def test_bjorck_orthonormalize(benchmark, count, n):
    weights = [w / (torch.linalg.matrix_norm(w, 2) * 1.001) for w in tensor_list(count, n, n)]
    # one step: W^T W and W (W^T W), 2 n^3 multiply-adds each
    run(benchmark, lambda: bjorck_orthonormalize(weights, iters=15), flops=float(count * 15 * 2 * 2 * n**3))
