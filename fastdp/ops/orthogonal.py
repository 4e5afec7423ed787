"""Orthonormalisation for Lipschitz DP training: ``fastdp::bjorck_orthonormalize``, the projection, RKO.

Math: ``fastdp.ref.orthogonal``. ``bjorck_orthonormalize`` runs a FIXED number of Björck
steps ``W <- (1 + beta) W - beta W W^T W`` (with the smaller Gram matrix) on each matrix of
a list; its inputs must have spectral norm <= 1 (divide by a spectral-norm estimate first:
``spectral_normalize_and_orthonormalize`` does, with power iteration, as deel-lip's
``SpectralConstraint``). ``rko_orthonormalize`` is deel-lip's reshaped kernel
orthogonalisation of a conv kernel with its ``_compute_conv_lip_factor`` rescaling.

No autograd (data in, data out; inputs detached): these are projections applied after the
optimiser step. Input checks as in ``fastdp.ops.spectral`` (2-D, non-empty, finite,
iteration counts >= 1); the finiteness check costs one device synchronisation per call
(``fastdp.ops.spectral.CHECK_FINITE = False`` skips it).

Backends: ``fastdp._backend.select("orthogonal", device)``; ``triton`` runs
``fastdp.kernels.orthogonal`` (one fused program per matrix, per-matrix launches); ``cuda``
runs ``fastdp._C.bjorck_cuda`` (csrc/cuda/orthogonal.cu: Gram then fused update, two
launches per step and matrix) on CUDA tensors and the reference on CPU tensors (no
csrc/cpu kernel); float64 always runs the reference.
"""

from __future__ import annotations

import math

import torch

from fastdp import _backend, _ext
from fastdp.ops import spectral as spectral_ops
from fastdp.ref import orthogonal as ref

__all__ = [
    "bjorck_orthonormalize",
    "conv_lip_factor",
    "rko_orthonormalize",
    "spectral_normalize_and_orthonormalize",
]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_beta(op: str, beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"fastdp {op}: beta must be a float, got {type(beta).__name__}")
    if not (math.isfinite(beta) and 0 < beta <= 1):
        raise ValueError(f"fastdp {op}: beta is {beta}; expected 0 < beta <= 1 (deel-lip uses 0.5)")


@torch.library.custom_op("fastdp::bjorck_orthonormalize", mutates_args=())
def _bjorck_op(weights: list[torch.Tensor], iters: int, beta: float) -> list[torch.Tensor]:
    backend = _backend.select("orthogonal", weights[0].device.type)
    with torch.no_grad():
        if backend == "triton":
            from fastdp.kernels import orthogonal as triton_orthogonal

            return [
                triton_orthogonal.bjorck_orthonormalize(w, iters, beta)
                if w.dtype in _KERNEL_DTYPES
                else ref.bjorck_orthonormalize([w], iters, beta)[0]
                for w in weights
            ]
        if backend == "cuda" and weights[0].device.type == "cuda" and _ext.has_cuda_kernels():
            return [
                _ext._C.bjorck_cuda(w.contiguous(), iters, beta)
                if w.dtype in _KERNEL_DTYPES
                else ref.bjorck_orthonormalize([w], iters, beta)[0]
                for w in weights
            ]
        return ref.bjorck_orthonormalize(list(weights), iters, beta)


@_bjorck_op.register_fake
def _(weights, iters, beta):
    return [torch.empty_like(w, memory_format=torch.contiguous_format) for w in weights]


def bjorck_orthonormalize(weights: list[torch.Tensor], iters: int = 15, beta: float = 0.5) -> list[torch.Tensor]:
    """``iters`` Björck steps on each matrix: ``W <- (1 + beta) W - beta W W^T W``.

    The product uses the smaller Gram matrix: ``W (W^T W)`` when rows >= cols, else
    ``(W W^T) W``. Each singular value follows ``s -> (1 + beta) s - beta s^3``, which tends
    to 1 for s in (0, sqrt(3)) when beta = 0.5: pass matrices with spectral norm <= 1 (e.g.
    divided by ``power_iteration``'s estimate times 1 + 1e-3, or by
    ``certified_spectral_norm``). The result has orthonormal columns (tall) or rows (wide).
    Computed in float32 (float64 for float64 inputs), returned in the input dtype.

    Args:
        weights: non-empty list of 2-D matrices (any shapes; float32, float16, bfloat16, float64).
        iters: number of steps, >= 1 (deel-lip: at most 15).
        beta: step size in (0, 1] (deel-lip: 0.5).

    Returns:
        list of matrices of the same shapes and dtypes (contiguous).
    """
    op = "bjorck_orthonormalize"
    spectral_ops._check_matrices(op, weights)
    spectral_ops._check_iters(op, "iters", iters)
    _check_beta(op, beta)
    spectral_ops._check_finite(op, list(weights), "weights")
    return torch.ops.fastdp.bjorck_orthonormalize([w.detach() for w in weights], iters, float(beta))


def spectral_normalize_and_orthonormalize(
    weights: list[torch.Tensor],
    vectors: list[torch.Tensor] | None = None,
    power_iters: int = 10,
    bjorck_iters: int = 15,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The deel-lip projection Pi of each matrix: ``bjorck(W / (sigma_hat (1 + 1e-3)))``.

    sigma_hat is ``power_iteration(weights, vectors, power_iters)``'s estimate (warm-started
    by ``vectors``: pass the returned vectors back next step, as the lip-dp paper advises).

    Returns:
        ``(projected weights (shapes and dtypes of the inputs), new right vectors u_l [n_l])``.
    """
    op = "spectral_normalize_and_orthonormalize"
    spectral_ops._check_matrices(op, weights)
    spectral_ops._check_iters(op, "power_iters", power_iters)
    spectral_ops._check_iters(op, "bjorck_iters", bjorck_iters)
    sigma, us, _ = spectral_ops.power_iteration(weights, vectors, power_iters)
    denom = (sigma * (1.0 + ref.PROJECTION_EPS)).clamp_min(1e-30)
    scaled = [(w.detach().to(denom.dtype) / denom[i]).to(w.dtype) for i, w in enumerate(weights)]
    return bjorck_orthonormalize(scaled, bjorck_iters), us


def conv_lip_factor(kernel_size, input_hw, stride=(1, 1)) -> float:
    """deel-lip's ``_compute_conv_lip_factor``: the RKO rescaling of a conv kernel.

    stride 1: ``sqrt(H W / ((kh H - a (a + 1)) (kw W - b (b + 1))))`` with a = (kh - 1)/2,
    b = (kw - 1)/2; stride > 1: ``sqrt(1 / (ceil(kh / sh) ceil(kw / sw)))``.
    ``kernel_size``, ``input_hw`` = (H, W) and ``stride`` are ints or pairs of positive ints.
    """
    op = "conv_lip_factor"
    pairs = [spectral_ops._pair(op, n, v) for n, v in (("kernel_size", kernel_size), ("input_hw", input_hw),
                                                          ("stride", stride))]  # fmt: skip
    for name, pair in zip(("kernel_size", "input_hw", "stride"), pairs, strict=True):
        if min(pair) < 1:
            raise ValueError(f"fastdp {op}: {name} is {pair}; expected positive ints")
    return ref.conv_lip_factor(*pairs)


def rko_orthonormalize(
    conv_weight: torch.Tensor, input_hw: tuple[int, int], stride=(1, 1), iters: int = 15
) -> torch.Tensor:
    """Reshaped kernel orthogonalisation (RKO) of a conv kernel [C_out, C_in, kh, kw].

    M = kernel reshaped to [C_out, C_in kh kw], divided by ``certified_spectral_norm(M)``
    (so ||M|| <= 1), ``iters`` Björck steps (orthonormal rows if C_out <= C_in kh kw, else
    orthonormal columns), reshaped back and multiplied by ``conv_lip_factor((kh, kw),
    input_hw, stride)``. Returns a tensor of the kernel's shape and dtype.
    """
    op = "rko_orthonormalize"
    if not isinstance(conv_weight, torch.Tensor) or conv_weight.dim() != 4 or conv_weight.numel() == 0:
        shape = tuple(conv_weight.shape) if isinstance(conv_weight, torch.Tensor) else type(conv_weight).__name__
        raise ValueError(f"fastdp {op}: conv_weight is {shape}; expected a non-empty kernel [C_out, C_in, kh, kw]")
    spectral_ops._check_iters(op, "iters", iters)
    coef = conv_lip_factor(tuple(conv_weight.shape[2:]), input_hw, stride)
    c_out = conv_weight.shape[0]
    matrix = conv_weight.detach().reshape(c_out, -1)
    bound = spectral_ops.certified_spectral_norm(matrix)  # checks dtype and finiteness
    scaled = (matrix.to(bound.dtype) / bound.clamp_min(1e-30)).to(conv_weight.dtype)
    ortho = bjorck_orthonormalize([scaled], iters)[0]
    return (ortho.to(bound.dtype) * coef).to(conv_weight.dtype).reshape(conv_weight.shape)
