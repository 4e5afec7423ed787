"""Reference of the orthogonal family: Björck orthonormalisation, the deel-lip projection, RKO.

Björck (Björck & Bowie 1971; deel-lip ``bjorck_normalization``, beta = 0.5). A fixed
number of steps of

    W <- (1 + beta) W - beta W (W^T W)        rows >= cols (the [n, n] Gram matrix)
    W <- (1 + beta) W - beta (W W^T) W        rows <  cols (the [m, m] Gram matrix)

Per singular value the step is s -> (1 + beta) s - beta s^3, which for beta = 0.5 converges
(quadratically near 1) to 1 for s in (0, sqrt(3)): the input must have spectral norm <= 1
(the caller divides by a spectral-norm estimate first; ``spectral_normalize_and_orthonormalize``
does). The result has orthonormal columns (tall) or rows (wide); singular vectors are kept.

Projection (deel-lip ``SpectralConstraint``, paper 00 section 1.11):
    Pi(W) = bjorck(W / (sigma_hat (1 + 1e-3)))     sigma_hat: power iteration, warm-started.

RKO (reshaped kernel orthogonalisation, Li et al. 2019; deel-lip
``reshaped_kernel_orthogonalization``): a conv kernel [C_out, C_in, kh, kw] is reshaped to
M = [C_out, C_in kh kw], divided by a certified upper bound on ||M||_2 (Gram iteration,
``fastdp.ref.spectral.certified_spectral_norm``: ||M|| <= 1 guaranteed), orthonormalised by
Björck, reshaped back and multiplied by deel-lip's ``_compute_conv_lip_factor``:

    stride 1:  sqrt(H W / ((kh H - a (a + 1)) (kw W - b (b + 1)))),  a = (kh - 1)/2, b = (kw - 1)/2
    stride > 1: sqrt(1 / (ceil(kh / sh) ceil(kw / sw)))

(a, b are real halves as in deel-lip; for odd kernels they are integers). For 3x3 on 32x32,
coef * sqrt(kh kw) = 1.02128 (paper 00 section 1.9).
"""

from __future__ import annotations

import math

import torch

from fastdp.ref import spectral

PROJECTION_EPS = 1e-3


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def bjorck_orthonormalize(weights: list[torch.Tensor], iters: int = 15, beta: float = 0.5) -> list[torch.Tensor]:
    """``iters`` Björck steps on each matrix, in float32 (float64 for float64); outputs in the input dtype."""
    out = []
    for w in weights:
        x = w.to(accumulation_dtype(w.dtype))
        tall = x.shape[0] >= x.shape[1]
        for _ in range(iters):
            product = x @ (x.T @ x) if tall else (x @ x.T) @ x
            x = (1.0 + beta) * x - beta * product
        out.append(x.to(w.dtype))
    return out


def spectral_normalize_and_orthonormalize(
    weights: list[torch.Tensor],
    vectors: list[torch.Tensor] | None = None,
    power_iters: int = 10,
    bjorck_iters: int = 15,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The projection Pi of each W: ``bjorck(W / (sigma_hat (1 + 1e-3)))``; returns (projected, new u)."""
    sigma, us, _ = spectral.power_iteration(weights, vectors, power_iters)
    scaled = [
        (w.to(sigma.dtype) / (sigma[i] * (1.0 + PROJECTION_EPS)).clamp_min(1e-30)).to(w.dtype)
        for i, w in enumerate(weights)
    ]
    return bjorck_orthonormalize(scaled, bjorck_iters), us


def conv_lip_factor(kernel_size: tuple[int, int], input_hw: tuple[int, int], stride: tuple[int, int]) -> float:
    """deel-lip's ``_compute_conv_lip_factor`` (module docstring)."""
    kh, kw = kernel_size
    h, w = input_hw
    sh, sw = stride
    if sh * sw == 1:
        a, b = (kh - 1) / 2, (kw - 1) / 2
        return math.sqrt((h * w) / ((kh * h - a * (a + 1)) * (kw * w - b * (b + 1))))
    return math.sqrt(1.0 / (math.ceil(kh / sh) * math.ceil(kw / sw)))


def rko_orthonormalize(
    conv_weight: torch.Tensor, input_hw: tuple[int, int], stride: tuple[int, int] = (1, 1), iters: int = 15
) -> torch.Tensor:
    """RKO of a kernel [C_out, C_in, kh, kw] (module docstring); same shape and dtype."""
    c_out, c_in, kh, kw = conv_weight.shape
    matrix = conv_weight.reshape(c_out, c_in * kh * kw).to(accumulation_dtype(conv_weight.dtype))
    bound = spectral.certified_spectral_norm(matrix).to(matrix.dtype)
    matrix = matrix / bound.clamp_min(1e-30)
    ortho = bjorck_orthonormalize([matrix], iters)[0]
    coef = conv_lip_factor((kh, kw), input_hw, stride)
    return (ortho * coef).reshape(conv_weight.shape).to(conv_weight.dtype)
