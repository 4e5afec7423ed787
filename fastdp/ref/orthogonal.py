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


def certified_bjorck_step(w: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One Björck step towards singular values ``scale``, with a certified bound on the result's spectral norm.

    With x = w (or w^T: the smaller Gram side, x [n, m], n <= m), a = x x^T and kappa = 0.5 / scale^2, the step is

        y = s q x,    q = 1.5 I - kappa s^2 a,    s = 2**-k (k >= 0, the least with s^2 lambda_max(a) <= 2 / kappa)

    and in exact arithmetic ||y||_2^2 = lambda_max(q (s^2 a) q) = max_i p(lambda_i), p(t) = t (1.5 - kappa t)^2
    (q is a polynomial of s^2 a), and p(t) <= 0.5 / kappa = scale^2 for every t <= 2 / kappa: one step never leaves
    the spectral ball of radius ``scale``, from any start, and near it converges quadratically to singular values
    ``scale``. The certificate adds the rounding: the Gram matrix is float64 (its error e_a, ``_symmetric_gram``),
    q's float64 entries are exactly 1.5 I - kappa A' for a symmetric A' within e_v of s^2 x x^T, so
    ||s q x||_2^2 <= 0.5 / kappa + ||q||_2^2 e_v with ||q||_2 <= 1.5 + kappa e_v; q is cast to w's dtype (F,
    ||F||_2 <= u ||q||_F) and the product y = q x is formed in w's dtype (E, ||E||_F <= gamma_n |||q|||_2 ||x||_F
    with |||q|||_2 <= q's largest absolute column sum, q being symmetric). The caller runs it with IEEE float32
    products (``fastdp._precision.exact_fp32``): TF32 or bf16 products would void the gamma_n bound.

    Returns ``(w_new, bound)``: w_new in w's shape and dtype, bound a float64 0-d tensor >= ||w_new||_2 (about
    ``scale`` (1 + 1e-3) for float32 512 x 512, +inf where w has a NaN or Inf or its Gram matrix overflows). Costs
    one float64 and one w-dtype product of n^2 m multiply-adds; no host synchronisation.
    """
    u, eta = spectral._unit(w.dtype)
    x, transposed = spectral._orient(w.detach())
    n, m = x.shape
    x64 = x.to(torch.float64)
    a, e_a, a_norm, x_norm_f = spectral._symmetric_gram(x64)
    # >= lambda_max(a): the largest absolute row sum (a reduction, no n x n temporary), within gamma_n in any order
    beta = spectral._inflate(torch.linalg.vector_norm(a, 1, dim=1).amax() * (1.0 + spectral._gamma(n, spectral._U64)))
    kappa = 0.5 / scale**2
    limit = math.nextafter(2.0 / kappa, 0.0)  # <= 2 / kappa: p(t) <= 0.5 / kappa below it
    half_over_kappa = math.nextafter(0.5 / kappa, math.inf)
    ratio = (beta + e_a) / (0.75 * limit)  # least k with s^2 lambda_max <= 3 scale^2 (s sqrt(lambda) <= sqrt(3) scale:
    # Björck's range of convergence), from a float log2 with room to spare
    k = torch.ceil(0.5 * torch.log2(ratio.clamp_min(1e-300))).clamp(0, 500).to(torch.int64)
    s = spectral._pow2(-k)
    s2 = s * s
    q = a * s2  # exact: a power of two, no float64 underflow at these scales
    q.mul_(-kappa)  # -(kappa s^2 a), rounded once (negation is exact); in place: no more n x n temporaries
    q.diagonal().add_(1.5)
    # q = 1.5 I - kappa A' exactly for A' = (1.5 I - q) / kappa: off the diagonal A' is kappa * av rounded once
    # (over kappa), on it also the rounding of 1.5 - t; entries that underflow lose at most eta / kappa
    e_v = s2 * e_a + spectral._U64 * (s2 * a_norm + q.diagonal().abs().amax() * math.sqrt(n) / kappa)
    e_v = spectral._inflate(e_v + n * n * spectral._ETA64 / kappa + n * spectral._ETA64)
    ok = s2 * beta + e_v <= limit  # lambda_max(A') <= 2 / kappa, where p is bounded by 0.5 / kappa
    q_norm = 1.5 + kappa * e_v
    exact_part = (half_over_kappa + q_norm * q_norm * e_v).sqrt() * (1.0 + spectral._U64)
    m0 = q.mul_(s)  # exact (s a power of two >= 2**-500); q is not needed any more
    mq = m0.to(w.dtype)  # entrywise rounding F: |F| <= u |m0| + eta
    # m0 is symmetric: |||m0|||_2 <= its largest absolute column sum, and ||m0||_F <= sqrt(n) times it
    column = torch.linalg.vector_norm(m0, 1, dim=0).amax()
    column = spectral._inflate(column * (1.0 + spectral._gamma(n, spectral._U64)))
    cast = (u * math.sqrt(n) * column + n * eta) if w.dtype != torch.float64 else torch.zeros_like(e_v)
    x_norm = (beta + e_a).sqrt() * (1.0 + spectral._U64)  # >= ||x||_2
    y = mq @ x.to(w.dtype)
    # |E| <= gamma_n |mq| |x| (+ eta per operation), |||mq|||_2 <= column (1 + u) + n eta
    mq_norm = column * (1.0 + u) + n * eta
    product = spectral._gamma(n, u) * mq_norm * x_norm_f + math.sqrt(n * m) * 2 * n * eta
    bound = spectral._inflate(exact_part + cast * x_norm + product)
    ok = ok & torch.isfinite(bound)  # a finite bound covers y, so y is finite too
    bound = torch.where(ok, bound, torch.full_like(bound, math.inf))
    return (y.T if transposed else y).contiguous(), bound
