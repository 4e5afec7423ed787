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


# ------------------------------------------------------------------ cheap certified bounds, carried across steps
# Three certificates that cost one float64 Gram product or less (the Gram iteration above costs ``iters`` of them).
# Each is assembled from exact error terms (Higham's gamma_n for sums and dot products in any order, one rounding per
# elementwise operation, and the subnormal spacing eta where a result may underflow) by a handful of float64
# operations, whose own rounding (each within 2**-53 relative) is covered by ``_inflate``.

_U64 = 2.0**-53
_ETA64 = 2.0**-1074  # the float64 subnormal spacing: the most an underflowing product or sum loses


def _gamma(n: int, u: float) -> float:
    return math.inf if n * u >= 0.5 else n * u / (1 - n * u)


def _unit(dtype: torch.dtype) -> tuple[float, float]:
    """(unit roundoff, subnormal spacing) of ``dtype``."""
    info = torch.finfo(dtype)
    return info.eps / 2, info.smallest_normal * info.eps


def _inflate(x: torch.Tensor) -> torch.Tensor:
    """x (float64, >= 0) times 1 + 2**-40, then the next float up: covers the float64 rounding of the fewer than
    2**10 operations that assembled x from exact error terms (each within 2**-53 relative, all monotone)."""
    y = x * (1.0 + 2.0**-40)
    return torch.nextafter(y, torch.full_like(y, math.inf))


def _sum_sq_up(x64: torch.Tensor) -> torch.Tensor:
    """An upper bound on the sum of squares of a float64 tensor: each square within 2**-53 relative (or eta where
    it underflows), the sum of N terms within gamma_N relative (any order)."""
    flat = x64.reshape(-1)
    return _sum_sq_bound(torch.dot(flat, flat), flat.numel())


def _sum_sq_bound(computed: torch.Tensor, n: int) -> torch.Tensor:
    """An upper bound on the exact sum of squares of n float64 values whose float64 sum of squares, in any order,
    is ``computed``."""
    return _inflate(computed * (1.0 + _gamma(n + 1, _U64)) + n * _ETA64)


def _orient(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(x, transposed): x is w or w^T, whichever has no more rows than columns (the smaller Gram side)."""
    return (w.T, True) if w.shape[0] > w.shape[1] else (w, False)


GRAM_BLOCK = 128  # rows per block of the symmetric Gram product: the blocks above the diagonal only, mirrored


def _symmetric_gram(x64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, e_a, ||a||_F, ||x||_F), the norms rounded up. a is the float64 Gram matrix x x^T, exactly symmetric (the
    blocks on and above the diagonal are computed, those below mirrored: (k + 1) / (2k) of the products for k
    blocks); e_a >= ||a - x x^T||_2 for the exact product: every entry is one dot product of length m, so
    |a - x x^T| <= gamma_m |x| |x|^T + 2 m eta entrywise, with ||(|x| |x|^T)||_2 = |||x|||_2^2 <= ||x||_F^2; a
    diagonal block's own product is symmetrised ((g + g^T) / 2, one more rounding of its entries)."""
    n, m = x64.shape
    blocks = x64.split(GRAM_BLOCK)
    a = torch.empty(n, n, dtype=torch.float64, device=x64.device)
    start = 0
    for i, rows in enumerate(blocks):
        end = start + rows.shape[0]
        g = rows @ rows.T
        a[start:end, start:end] = (g + g.T) * 0.5
        other = start + rows.shape[0]
        for cols in blocks[i + 1 :]:
            block = rows @ cols.T
            a[start:end, other : other + cols.shape[0]] = block
            a[other : other + cols.shape[0], start:end] = block.T
            other += cols.shape[0]
        start = end
    x_sq, a_norm = _sum_sq_up(x64), _inflate(_sum_sq_up(a).sqrt())
    e_a = _gamma(m, _U64) * x_sq + _U64 * a_norm + 2.0 * m * n * _ETA64
    return a, _inflate(e_a), a_norm, _inflate(x_sq.sqrt())


def frobenius_distance_up(a: torch.Tensor, b: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """A certified upper bound on ||a - b||_F for two tensors of one shape: float64 0-d, exactly 0 when a equals b
    entry for entry, +inf when either has a NaN or Inf. No host synchronisation.

    The float64 difference d is within 2**-53 relative of the exact one (exact for float32 inputs in one binade),
    its squared norm within gamma_{N+1} (plus eta per square that underflows): the bound covers both. ``sums``:
    float64 [2], (sum of d's squares in any order, max |d|), computed elsewhere (``fastdp._C.frobenius_distance_sq``
    on CPU); by default computed here."""
    n = a.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=a.device)
    if sums is None:
        d = a.detach().reshape(-1).to(torch.float64, copy=True)
        d.sub_(b.detach().reshape(-1))  # b cast to float64 on the fly (exact): one rounding, no second copy
        sums = torch.stack((torch.dot(d, d), d.abs().amax()))
    bound = _inflate(_sum_sq_bound(sums[0], n).sqrt() * (1.0 + _U64))
    finite = torch.isfinite(bound)
    bound = torch.where(sums[1] == 0, torch.zeros_like(bound), bound)
    return torch.where(finite, bound, torch.full_like(bound, math.inf))


# the certificate claims lambda_max <= (1 + margin) x the Lanczos estimate. Top eigenvalues of trained weights
# Gram matrices cluster (lambda_2 / lambda_1 of 0.97-0.998 on the 784-512-512-10 MLP), and 16 warm Lanczos steps
# then fall up to 2 % short: with 2**-9, 8 % of weightclip's checks failed there (each falling back on the looser
# carried bound, which shrinks the rescaled weights); with 2**-6 (0.8 % on the norm) 1 in 540, a cold start
# (24 steps with 2**-7 also reached 0, for 50 % more Lanczos time)
CHOLESKY_MARGIN = 2.0**-6
LANCZOS_STEPS = 16


def _lanczos_top(a: torch.Tensor, start: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(theta, y): the largest Ritz value of a on the Krylov space of ``steps`` Lanczos steps from ``start`` (unit),
    and its unit Ritz vector. The basis is reorthogonalised (twice) and the Ritz values are those of V a V^T itself,
    never above lambda_max(a) up to rounding: an estimate only, the Cholesky check certifies. A direction that
    vanishes (an invariant subspace was found) stays zero. No host synchronisation."""
    n = a.shape[0]
    steps = min(steps, n)
    basis = torch.zeros(steps, n, dtype=torch.float64, device=a.device)
    images = torch.zeros_like(basis)
    q = start
    for j in range(steps):
        basis[j] = q
        images[j] = a @ q
        w = images[j]
        for _ in range(2):
            w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        norm = torch.linalg.vector_norm(w)
        alive = norm > 1e-12 * torch.linalg.vector_norm(images[j]).clamp_min(1e-300)
        q = torch.where(alive, w / norm.clamp_min(1e-300), torch.zeros_like(w))
    h = basis @ images.T
    h = (h + h.T) * 0.5
    # the top eigenvector of the small h by repeated squaring (h^256 applied to a start): torch.linalg.eigh checks
    # its LAPACK status on the host, a synchronisation on CUDA
    power = h / torch.linalg.matrix_norm(h).clamp_min(1e-300)
    for _ in range(8):
        power = power @ power
        power = power / torch.linalg.matrix_norm(power).clamp_min(1e-300)
    z, _ = _normalize(power @ default_start(steps, torch.float64, a.device))
    y, _ = _normalize(z @ basis)
    return z @ (h @ z), y


def _scaled_gram(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(a, e_a, e, finite, underflow): the symmetric float64 Gram matrix of w's smaller side scaled by 2**-e (its
    largest entry in [0.5, 1)), its error bound, e, whether w is finite, and the bound on the scaling's underflow
    (in scaled units, on the norm)."""
    x, _ = _orient(w.detach())
    x64 = x.to(torch.float64)
    n, m = x64.shape
    top = x64.abs().amax()
    finite = torch.isfinite(top)
    e = torch.where(finite & (top > 0), _exponent(top), torch.zeros((), dtype=torch.int64, device=x.device))
    x64 = scale_pow2(torch.where(finite, x64, torch.zeros_like(x64)), -e)  # exact but where it underflows
    a, e_a, _, _ = _symmetric_gram(x64)
    return a, e_a, e, finite, math.sqrt(n * m) * _ETA64


def _cholesky_check(a: torch.Tensor, e_a: torch.Tensor, theta_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lam, ok): where the float64 Cholesky factorisation of h = theta_up I - a runs to completion (ok),
    lam >= lambda_max of the exact Gram matrix a stands for (a within e_a of it): L L^T = h + dh with
    |dh| <= gamma_{n+1} |L| |L|^T (Higham, Thm 10.3, any order of the inner products), so ||dh||_2 <= gamma_{n+1}
    ||L||_F^2, and h's diagonal is rounded once (e_h)."""
    n = a.shape[0]
    h = -a
    h.diagonal().add_(theta_up)
    factor, info = torch.linalg.cholesky_ex(h)
    e_h = _U64 * h.diagonal().abs().amax()
    e_chol = _gamma(n + 1, _U64) * _sum_sq_up(factor) + n * n * _ETA64
    lam = _inflate(theta_up + e_h + e_chol + e_a)
    return lam, (info == 0) & torch.isfinite(lam)


def certify_norm_at_most(w: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Whether a Cholesky check proves sigma_max(w) <= ``bound`` (a bool 0-d tensor; False where it cannot, e.g. a
    bound below the norm or above it by less than the check's own rounding, about (n + m) n 2**-51 relative, or a
    NaN anywhere): checks a certificate that came from outside, such as one in a loaded state dict."""
    a, e_a, e, finite, underflow = _scaled_gram(w)
    b = bound.to(device=a.device, dtype=torch.float64)
    scaled = scale_pow2(b, -e)  # the bound in the Gram's units (rounded to nearest where it leaves the normal range)
    root = (scaled - underflow).clamp_min(0) * (1.0 - 2.0**-50)  # below the bound's scaled value, whatever rounding
    target = root * root * (1.0 - 2.0**-50)
    # factorise just below the target: room for the check's own error terms (e_a, and about gamma_{n+1} n target for
    # the factorisation), so that any bound above the norm by more than that passes
    n = a.shape[0]
    room = (2.0**-40 + 4 * (e_a / target.clamp_min(1e-300) + _gamma(n + 2, _U64) * (n + 2))).clamp(max=2.0**-10)
    lam, ok = _cholesky_check(a, e_a, target * (1.0 - room))
    return ok & finite & (lam <= target) & torch.isfinite(b) & (b > 0)


def certified_norm_cholesky(
    w: torch.Tensor, vector: torch.Tensor | None = None, steps: int = LANCZOS_STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """A certified upper bound on sigma_max(w) from a warm Lanczos estimate and one Cholesky factorisation, for the
    cost of one float64 Gram product (the Gram iteration costs ``iters`` of them).

    With a = x x^T (x = w or w^T, the smaller side, scaled exactly by a power of two so that its largest entry is
    in [0.5, 1)) and theta the largest Ritz value of ``steps`` Lanczos steps on a (warm-started), the claim is
    lambda_max(a) <= theta' = theta (1 + 2**-6). It is checked by factorising h = theta' I - a: a floating-point
    Cholesky that runs to completion gives L L^T = h + dh with |dh| <= gamma_{n+1} |L| |L|^T (Higham, Thm 10.3,
    any order of the inner products), so ||dh||_2 <= gamma_{n+1} ||L||_F^2 and
    lambda_max(x x^T) <= theta' + gamma_{n+1} ||L||_F^2 + (the rounding of h's diagonal) + ||a - x x^T||_2.

    Returns ``(bound, vector)``: the bound (float64 0-d; +inf where the factorisation fails, i.e. the estimate was
    too low, or where w has a NaN or Inf: callers take the minimum with another certified bound) and the new
    unit vector (float64 [n]) to warm-start the next call. No host synchronisation."""
    a, e_a, e, finite_top, underflow = _scaled_gram(w)
    n = a.shape[0]
    cold = default_start(n, torch.float64, a.device)
    v = cold if vector is None or vector.shape != (n,) else vector.to(device=a.device, dtype=torch.float64)
    v = torch.where(torch.linalg.vector_norm(v) > 0.5, v, cold)  # an all-zero vector (a zero matrix's): cold start
    theta, v = _lanczos_top(a, v / torch.linalg.vector_norm(v), steps)
    theta = theta.clamp_min(0)
    theta_up = theta * (1.0 + CHOLESKY_MARGIN) + 2.0**-900  # > 0: a zero matrix still factorises
    lam, ok = _cholesky_check(a, e_a, theta_up)
    scaled = _inflate(lam.sqrt() * (1.0 + _U64) + underflow)
    bound = _inflate(scale_pow2_up(scaled, e))
    ok = ok & finite_top & torch.isfinite(bound)
    return torch.where(ok, bound, torch.full_like(bound, math.inf)), v
