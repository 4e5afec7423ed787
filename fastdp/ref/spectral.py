"""Reference of the spectral family: power iteration, certified spectral norms, conv operator norms.

Power iteration (fixed step count, no data-dependent stopping). For a matrix W [m, n]
and a right vector u [n], one step is

    v <- normalize(W u),    u <- normalize(W^T v),      normalize(x) = x / max(||x||_2, 1e-12)

and the estimate after the last step is ``sigma_hat = v^T W u = ||W^T v||_2`` (with the
new u). It is a Rayleigh-type quotient: ``sigma_hat <= sigma_max(W)`` always (up to
rounding), and it increases to sigma_max(W) as the steps go (the error after k steps
shrinks like (sigma_2 / sigma_1)^(2k)). Without a warm start u is the deterministic
``default_start(n)``: ones plus a small index-dependent perturbation, normalised (never
orthogonal to an all-positive singular vector, and not to the usual degenerate cases).

Certified upper bound (Gram iteration, Delattre et al. 2023, "Efficient bound of
Lipschitz constant for convolutional layers by Gram iteration"). With G_0 = W (or W^T,
so that the Gram matrices take the smaller side) and

    r_k = ||G_k||_F,    G_{k+1} = (G_k / r_k)^T (G_k / r_k),

sigma_1(G_{k+1}) = sigma_1(G_k)^2 / r_k^2, hence for any t

    sigma_max(W) = prod_{k<t} r_k^(1/2^k) * sigma_1(G_t)^(1/2^t)
                <= prod_{k<t} r_k^(1/2^k) * ||G_t||_F^(1/2^t)    (the bound),

which decreases to sigma_max(W) as t grows (``||G_t||_F^(1/2^t) <= rank^(1/2^(t+1)) sigma_1``).
Computed in float64 on W scaled exactly by a power of two, 2**-e with max|W| = f 2**e, f in [0.5, 1)
(so that no Frobenius norm or Gram power underflows or overflows, whatever W's magnitude: unscaled,
matrices with entries below ~1e-161 gave 0 and above ~1e154 NaN); the rescaling by r_k keeps every
entry <= 1 after that. The bound of the scaled matrix is multiplied by (1 + 1e-9) to cover float64
rounding, scaled back by 2**e (rounded up where that leaves the normal range) and rounded *up* to
the output dtype. A zero matrix gives 0; a matrix with a NaN or Inf gives +inf (the ops refuse them
first unless their finiteness check is deferred): never NaN, never below sigma_max.

Conv operator norm. Power iteration on the linear map A: x -> conv2d(x, weight, ...)
from R^(C_in x H x W) with its adjoint A^T = conv2d_input (the transposed convolution
with the output padding that restores the input shape); same estimate ||A^T v||.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NORMALIZE_EPS = 1e-12
CERTIFY_SLACK = 1e-9  # relative slack over the float64 Gram-iteration bound (rounding)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (the kernels' fp32 math and output dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_start(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The cold-start right vector [n]: ``normalize(1 + 0.1 * cos(1.618... * j))``, deterministic."""
    j = torch.arange(n, dtype=torch.float64, device=device)
    u = 1.0 + 0.1 * torch.cos(j * ((1 + math.sqrt(5)) / 2))
    return (u / u.norm()).to(dtype)


def _normalize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norm = torch.linalg.vector_norm(x)
    return x / norm.clamp_min(NORMALIZE_EPS), norm


def power_iteration(
    weights: list[torch.Tensor], vectors: list[torch.Tensor] | None = None, iters: int = 10
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``iters`` power-iteration steps on each W_l [m_l, n_l] from u_l [n_l] (``default_start`` if None).

    Returns ``(sigma_hat [L], u list [n_l], v list [m_l])`` in float32 (float64 for float64
    weights), computed in that dtype; ``sigma_hat_l = v_l^T W_l u_l`` with the returned vectors.
    """
    sigmas, us, vs = [], [], []
    for i, w in enumerate(weights):
        acc = accumulation_dtype(w.dtype)
        w = w.to(acc)
        m, n = w.shape
        if vectors is None:
            u = default_start(n, acc, w.device)
        else:
            u, _ = _normalize(vectors[i].to(device=w.device, dtype=acc).reshape(n))
        v = torch.zeros(m, dtype=acc, device=w.device)
        sigma = torch.zeros((), dtype=acc, device=w.device)
        for _ in range(iters):
            v, _ = _normalize(w @ u)
            u, sigma = _normalize(w.T @ v)  # sigma = ||W^T v|| = v^T W u_new
        sigmas.append(sigma)
        us.append(u)
        vs.append(v)
    if not sigmas:
        return torch.zeros(0), us, vs
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in sigmas) else torch.float32
    return torch.stack([s.to(dtype) for s in sigmas]), us, vs


def round_up(bound64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bound64`` (float64) in ``dtype``, rounded towards +inf (a cast rounds to nearest): never below it."""
    out = bound64.to(dtype)
    return torch.where(out.double() < bound64, torch.nextafter(out, torch.full_like(out, math.inf)), out)


_round_up = round_up


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0**k in float64, exactly, for integer tensors k in [-1022, 1023] (built from the bits: no pow rounding)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _exponent(m: torch.Tensor) -> torch.Tensor:
    """e with m = f 2**e, f in [0.5, 1), for a finite float64 m > 0 (int64; 0 for m = 0): m 2**-e is in [0.5, 1)."""
    return torch.frexp(m).exponent.to(torch.int64)


def scale_pow2(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2**e (float64, e an integer tensor in [-2100, 2100]) in two exact power-of-two factors: exact unless the
    result leaves the normal range (then one rounding to nearest, or inf/0)."""
    half = torch.div(e, 2, rounding_mode="floor")
    return x * _pow2(half) * _pow2(e - half)


def scale_pow2_up(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2**e for x >= 0 (float64), rounded up: where the result is subnormal it may have been rounded down, which
    scaling it back up (exact there) shows."""
    out = scale_pow2(x, e)
    low = scale_pow2(out, -e) < x
    return torch.where(low, torch.nextafter(out, torch.full_like(out, math.inf)), out)


def _gram_bound_unit(g: torch.Tensor, iters: int) -> torch.Tensor:
    """The Gram-iteration bound (module docstring) of a float64 matrix whose largest entry is in [0.5, 1) or 0,
    with the (1 + CERTIFY_SLACK) rounding slack; 0 for a zero matrix."""
    if g.shape[0] < g.shape[1]:
        g = g.T  # G_1 = g^T g is then the smaller Gram matrix
    log_bound = torch.zeros((), dtype=torch.float64, device=g.device)
    for k in range(iters):
        r = torch.linalg.matrix_norm(g)
        r_safe = torch.where(r > 0, r, torch.ones_like(r))  # zero matrix: the bound ends at 0
        log_bound = log_bound + torch.log(r_safe) / 2.0**k
        g = g / r_safe
        g = g.T @ g
    log_bound = log_bound + torch.log(torch.linalg.matrix_norm(g)) / 2.0**iters
    return torch.exp(log_bound) * (1.0 + CERTIFY_SLACK)


def certified_spectral_norm(w: torch.Tensor, iters: int = 6) -> torch.Tensor:
    """Upper bound on sigma_max(w) by ``iters`` Gram iterations (module docstring), float64 inside.

    Returns a 0-d tensor, float32 (float64 for float64 inputs), never below sigma_max(w)
    beyond float64 rounding of the iteration (covered by a 1e-9 relative slack), for every
    finite w however small or large its entries (w is scaled by a power of two first); 0 for a
    zero matrix, +inf for a matrix with a NaN or Inf (never NaN). No host synchronisation.
    """
    out_dtype = accumulation_dtype(w.dtype)
    g = w.to(torch.float64)
    top = g.abs().amax()
    finite = torch.isfinite(top)
    e = torch.where(finite & (top > 0), _exponent(top), torch.zeros((), dtype=torch.int64, device=g.device))
    unit = _gram_bound_unit(scale_pow2(g, -e), iters)  # largest entry in [0.5, 1): exact scaling
    bound = scale_pow2_up(unit, e)
    bound = torch.where(finite, bound, torch.full_like(bound, math.inf))  # NaN/Inf weights: +inf, never NaN
    return round_up(bound, out_dtype)


def certified_spectral_norms(weights: list[torch.Tensor], iters: int = 6) -> torch.Tensor:
    """``certified_spectral_norm`` of each matrix, stacked [L] (float64 if any input is float64)."""
    bounds = [certified_spectral_norm(w, iters) for w in weights]
    if not bounds:
        return torch.zeros(0)
    dtype = torch.float64 if any(b.dtype == torch.float64 for b in bounds) else torch.float32
    return torch.stack([b.to(dtype) for b in bounds])


def conv_output_shape(input_shape, weight_shape, stride, padding, dilation) -> tuple[int, int]:
    """Spatial output size (H_out, W_out) of conv2d."""
    return tuple(
        (input_shape[1 + d] + 2 * padding[d] - dilation[d] * (weight_shape[2 + d] - 1) - 1) // stride[d] + 1
        for d in range(2)
    )


def conv_operator_norm(
    weight: torch.Tensor,
    input_shape: tuple[int, int, int],
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int] = (0, 0),
    dilation: tuple[int, int] = (1, 1),
    groups: int = 1,
    iters: int = 50,
    vector: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Power iteration on x -> conv2d(x, weight) over inputs of shape ``input_shape`` (C_in, H, W).

    Pairs already normalised (two ints each). Returns ``(sigma_hat, x)``: a 0-d estimate
    ``||A^T v|| <= ||A||_2`` and the unit right vector [C_in, H, W] (the next warm start), in
    float32 (float64 for float64 weights). ``vector`` None starts from ``default_start``.
    """
    acc = accumulation_dtype(weight.dtype)
    w = weight.to(acc)
    size = (1, *input_shape)
    if vector is None:
        x = default_start(math.prod(input_shape), acc, w.device).reshape(size)
    else:
        x, _ = _normalize(vector.to(device=w.device, dtype=acc).reshape(size))
    sigma = torch.zeros((), dtype=acc, device=w.device)
    for _ in range(iters):
        y, _ = _normalize(F.conv2d(x, w, None, stride, padding, dilation, groups))
        x, sigma = _normalize(torch.nn.grad.conv2d_input(size, w, y, stride, padding, dilation, groups))
    return sigma, x.reshape(input_shape)
