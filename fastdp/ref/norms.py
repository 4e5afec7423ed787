"""Reference of the per-example gradient norms: ghost norms of Linear layers and clip factors.

Ghost norm (Goodfellow 2015; Li et al. 2022 for sequences). A Linear layer's weight
gradient for example i is ``a_i^T g_i`` (a_i: [T, d] layer inputs, g_i: [T, p] gradients
of the loss with respect to the layer outputs, summed over the T positions), so

    ||a_i^T g_i||_F^2 = sum_{t,s} (a_it . a_is) (g_it . g_is) = <A_i, G_i>_F

with the Gram matrices ``A_i = a_i a_i^T`` and ``G_i = g_i g_i^T`` ([T, T]): the norm is
computed without forming the [d, p] per-example gradient. Units: squared L2 norm of
the gradient of example i's loss (a sum over positions, no mean), one value per example.

Clip factors (DP-SGD, Abadi et al. 2016). With ``sq_norms[l, i]`` the squared norm of
example i's gradient in layer l, the whole-model norm is ``n_i = sqrt(sum_l sq_norms[l, i])``
and the factor that clips example i's gradient to L2 norm <= C is
``min(1, C / (n_i + 1e-6))`` (the 1e-6 keeps C / n finite; Opacus uses the same).
"""

from __future__ import annotations

import math

import torch

CLIP_EPS = 1e-6
GRAM_CHUNK_ELEMENTS = 1 << 22  # Gram entries per pass of ghost_norm_sq (two 16 MiB fp32 buffers)
# float64 elements of the inputs' copies per pass of the certified Grams (2 MiB): a layer's A and G in float64 are
# 2-4x their own size, and copying the whole batch at once was the largest tensor of a DP-SGD step on an attention
# classifier (6 MiB of G's copy against a 10.9 MiB non-private step; docs/memory.md)
COPY_CHUNK_ELEMENTS = 1 << 18


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (the kernels' fp32 math and output dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``out[i] = ||a_i^T g_i||_F^2`` via the [T, T] Gram matrices, materialised for a chunk of examples at a time
    (batched GEMMs: on CPU the fastest way for short sequences, see ``fastdp.ops.norms``).

    a: [B, T, d], g: [B, T, p]; returns float32 [B] (float64 for float64 inputs), computed
    in that dtype after one exact upcast of the inputs.
    """
    acc = accumulation_dtype(a.dtype)
    seq = a.shape[1]
    chunk = max(1, GRAM_CHUNK_ELEMENTS // max(1, seq * seq))  # examples per pass: bounded Gram memory
    out = torch.empty(a.shape[0], dtype=acc, device=a.device)
    for start in range(0, a.shape[0], chunk):
        ac, gc = a[start : start + chunk].to(acc), g[start : start + chunk].to(acc)
        gram_a = torch.bmm(ac, ac.transpose(1, 2))
        out[start : start + chunk] = gram_a.mul_(torch.bmm(gc, gc.transpose(1, 2))).sum(dim=(1, 2))
    return out


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-(mantissa bits): the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def _gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u) (Higham): a rigorous bound on the relative error of n roundings."""
    if n * u >= 0.5:
        return math.inf
    return n * u / (1 - n * u)


def rounding_gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n of ``dtype``'s unit roundoff: a sum or dot product of n terms computed in ``dtype`` (any order) is
    within ``gamma_n * sum |terms|`` of the exact value (Higham, Thm 3.1)."""
    return _gamma(n, unit_roundoff(dtype))


def _certified_pass(gram: int, copy: int) -> int:
    """Examples per pass of a certified (float64) Gram: ``gram`` Gram entries and ``copy`` float64 input elements per
    example, within :data:`GRAM_CHUNK_ELEMENTS` and :data:`COPY_CHUNK_ELEMENTS` (at least one example)."""
    return max(1, min(GRAM_CHUNK_ELEMENTS // max(1, gram), COPY_CHUNK_ELEMENTS // max(1, copy)))


def certified_ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, mass)``, both float64 [B]: ``bound[i] >= ||a_i^T g_i||_F^2`` for the exact per-example gradient of
    the values given, whatever the rounding, and ``mass[i] >= sum_t ||a_it|| ||g_it||`` (which bounds the norm too,
    and how large the terms are that a sum of this example's contribution rounds).

    The Gram products cancel: an example whose positions cancel at large magnitude (tokens ``3e5 u + e`` and
    ``-3e5 u``) has ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` tiny against its terms, and fp32 Grams make it tiny,
    negative or NaN. Here the Grams are float64 (fp32, fp16 and bf16 products are exact in float64), and the
    rounding that remains is bounded rigorously: every Gram entry is a dot product of length d (or p) with error
    <= gamma_d |a_t| |a_s| (Cauchy-Schwarz), and the sum of the T^2 products adds gamma_{T^2}; all of it is <=
    gamma_{d + p + T^2 + 2} M^2 with ``M = sum_t |a_t| |g_t|``, which is added to the clamped Gram value.
    """
    acc = torch.float64
    b, seq, d = a.shape
    p = g.shape[2]
    chunk = _certified_pass(seq * seq, seq * (d + p))
    out = torch.empty(b, dtype=acc, device=a.device)
    mass = torch.empty(b, dtype=acc, device=a.device)
    for start in range(0, b, chunk):
        ac, gc = a[start : start + chunk].to(acc), g[start : start + chunk].to(acc)
        gram_a = torch.bmm(ac, ac.transpose(1, 2))
        out[start : start + chunk] = gram_a.mul_(torch.bmm(gc, gc.transpose(1, 2))).sum(dim=(1, 2))
        rows = torch.linalg.vector_norm(ac, dim=2) * torch.linalg.vector_norm(gc, dim=2)
        mass[start : start + chunk] = rows.sum(1)
        del ac, gc, gram_a, rows  # before the next pass's copies
    return certify_ghost(out, mass, d, p, seq)


def _gram64(rows: torch.Tensor) -> torch.Tensor:
    """Float64 Grams [m, T, T] of rows [m, T, k]: a float64 copy and a batched GEMM."""
    rows = rows.to(torch.float64)
    return torch.bmm(rows, rows.transpose(1, 2))


def certify_ghost(dot: torch.Tensor, mass: torch.Tensor, d: int, p: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`certified_ghost_norm_sq`'s ``(bound, mass)`` from its float64 Gram products ``dot`` (``sum_{t,s}
    (a_t . a_s)(g_t . g_s)`` as computed) and ``mass`` (``sum_t |a_t| |g_t|`` as computed) of [B, T, d] and
    [B, T, p] inputs: the mass rounded up by its own rounding, the clamped products plus their rounding bound. The
    bounds hold for any order of the dot products' and the sums' additions (``fastdp._C``'s kernel tiles them)."""
    u = unit_roundoff(torch.float64)
    mass = mass * (1 + _gamma(max(d, p) + seq + 4, u))  # the mass's own rounding, upward
    return dot.clamp_min(0) + _gamma(d + p + seq * seq + 2, u) * mass * mass, mass


def certified_conv_ghost_norm_sq(
    x: torch.Tensor,
    g: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    gram=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`certified_ghost_norm_sq` of a 2-D convolution's per-example weight gradient from the Gram of the input
    pixels, without unfolding the input: ``(bound, mass)``, float64 [N], ``bound[i] >= ||sum_t g_it a_it^T||_F^2``
    (the exact per-example gradient of the values given) and ``mass[i] >= sum_t |a_it| |g_it|``, where ``a_it`` is
    example i's input patch at output position t (the zero-padded ``x`` [N, C, H, W] read at stride, dilation and
    kernel offsets) and ``g_it`` its output gradient (``g`` [N, p, H_out, W_out]). One group: fold groups into N.

    The patch Gram is a sum of K = k_h k_w shifted copies of the pixel Gram: ``a_t . a_s = sum_k x_{u_k(t)} .
    x_{u_k(s)}`` (u_k(t): the padded pixel that kernel offset k reads at position t; padding pixels are zero, so their
    Gram entries are exact zeros). The pixel Gram costs (H W)^2 C multiply-adds against the patch Gram's T^2 K C:
    K times fewer at stride 1. Rounding, in float64: a pixel Gram entry is a dot product of length C, within gamma_C
    |x_u| |x_v|; adding the K shifted entries adds gamma_K of their absolute sum; so a patch Gram entry is within
    gamma_{C + K} sum_k |x_{u_k(t)}| |x_{u_k(s)}| <= gamma_{C + K} |a_t| |a_s| (Cauchy-Schwarz): the error model of
    :func:`certified_ghost_norm_sq` with d = C + K, whose bound ``gamma_{d + p + T^2 + 2} M^2`` is added here the
    same way. ``|a_t|`` and ``|g_t|`` are the square roots of the Grams' diagonals (relative error <=
    gamma_{C + K} / 2 + u, gamma_p / 2 + u); the mass is rounded up by ``1 + gamma_{C + K + p + T + 4}``, which covers
    them, the products and the sum over T.

    ``gram(rows)`` gives the float64 Grams [m, T, T] of rows [m, T, k] (any layout; any order of the dot products'
    additions keeps the bound): by default float64 copies and a batched GEMM, on CPU ``fastdp._C.certified_gram``
    (``fastdp.ops.certified_conv_ghost_norm_sq``)."""
    acc = torch.float64
    n, c, h, w = x.shape
    p, seq = g.shape[1], g.shape[2] * g.shape[3]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel_size, stride, padding, dilation
    hp, wp = h + 2 * ph, w + 2 * pw
    d = c + kh * kw
    u = unit_roundoff(acc)
    chunk = _certified_pass(max((hp * wp) ** 2, seq * seq), c * h * w + p * seq)
    out = torch.empty(n, dtype=acc, device=x.device)
    mass = torch.empty(n, dtype=acc, device=x.device)
    gram = gram or _gram64
    for start in range(0, n, chunk):
        xc = x[start : start + chunk].reshape(-1, c, h * w)
        m = xc.shape[0]
        pixels = gram(xc.transpose(1, 2)).view(m, h, w, h, w)
        pixels = torch.nn.functional.pad(pixels, (pw, pw, ph, ph, pw, pw, ph, ph))  # [m, hp, wp, hp, wp]
        s = pixels.stride()
        gram_a = None
        for i in range(kh):
            for j in range(kw):
                shifted = pixels.as_strided(
                    (m, g.shape[2], g.shape[3], g.shape[2], g.shape[3]),
                    (s[0], sh * s[1], sw * s[2], sh * s[3], sw * s[4]),
                    pixels.storage_offset() + dh * i * (s[1] + s[3]) + dw * j * (s[2] + s[4]),
                )
                gram_a = shifted.clone() if gram_a is None else gram_a.add_(shifted)
        gram_a = gram_a.view(m, seq, seq)
        gram_g = gram(g[start : start + chunk].reshape(m, p, seq).transpose(1, 2))
        rows = gram_a.diagonal(dim1=1, dim2=2).sqrt() * gram_g.diagonal(dim1=1, dim2=2).sqrt()
        mass[start : start + chunk] = rows.sum(1)
        out[start : start + chunk] = gram_a.mul_(gram_g).sum(dim=(1, 2))
        del xc, pixels, shifted, gram_a, gram_g, rows  # before the next pass's Grams
    mass = mass * (1 + _gamma(d + p + seq + 4, u))
    return out.clamp_min(0) + _gamma(d + p + seq * seq + 2, u) * mass * mass, mass


def certified_projections(
    per_example: torch.Tensor, tangents: torch.Tensor, mass: torch.Tensor, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, err)``, float64: ``P [B, r]`` the projections ``<grad_i, v_j>`` of per-example gradients onto tangents
    (DP-SGD-JL's norm estimates) and ``err [B]`` with ``|P_ij - <grad_i, v_j>| <= err_i`` for every j, ``grad_i`` the
    exact per-example gradient of the layer's A and G.

    ``per_example`` [B, n] was computed in float64 from A and G (fp32, fp16 and bf16 products are exact there), each
    entry a sum of ``positions`` products; ``mass[i] >= sum_t |a_it| |g_it|`` bounds the Frobenius norm of the
    entries' absolute terms. With ``positions = 0`` the tensor is the exact gradient itself (a per-example tensor
    that is summed as it is) and ``mass[i] >= ||per_example_i||``. Entry rounding (gamma_positions) and the length-n
    dot product (gamma_n) give ``err_i = gamma_{positions + n + 2} max_j ||v_j|| mass_i`` (Cauchy-Schwarz).
    ``tangents`` [r, n]."""
    acc = torch.float64
    n = per_example.shape[1]
    v = tangents.to(acc)
    p = per_example.to(acc) @ v.t()
    v_norm = float(torch.linalg.vector_norm(v, dim=1).max()) * (1 + _gamma(n + 2, unit_roundoff(acc)))
    return p, rounding_gamma(positions + n + 2, acc) * v_norm * mass.to(acc)


def certified_token_match_norm_sq(idx: torch.Tensor, g: torch.Tensor, gram=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`certified_ghost_norm_sq` for an embedding: ``(bound, mass)``, float64 [B], with ``bound[i] >=
    sum_{t,s} [idx_t == idx_s] (g_t . g_s)`` (the squared norm of the per-example gradient, rows scattered by token)
    and ``mass[i] >= sum_t |g_t|``: the Gram of one-hot inputs (|a_t| = 1), the same rigorous rounding bound; |g_t|
    from the Gram's diagonal (relative error <= gamma_dim / 2 + u, within the mass's rounding allowance).
    idx: [B, T] token ids, g: [B, T, dim] (padding rows zeroed); ``gram`` as for
    :func:`certified_conv_ghost_norm_sq`."""
    acc = torch.float64
    dim, seq = g.shape[2], g.shape[1]
    u = unit_roundoff(acc)
    gram_g = (gram or _gram64)(g)
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(acc)  # [B, T, T]
    exact = (same * gram_g).sum((1, 2))
    mass = gram_g.diagonal(dim1=1, dim2=2).sqrt().sum(1) * (1 + _gamma(dim + seq + 4, u))
    return exact.clamp_min(0) + _gamma(dim + seq * seq + 2, u) * mass * mass, mass


def per_example_grad_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``||a_i^T g_i||_F^2`` from the explicitly formed per-example gradients [B, d, p] (the definition)."""
    acc = accumulation_dtype(a.dtype)
    grads = torch.einsum("btd,btp->bdp", a.to(acc), g.to(acc))
    return grads.pow(2).sum(dim=(1, 2))


def clip_factors(sq_norms: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, factors)`` for ``sq_norms`` [L, B]: ``norms = sqrt(sum_l sq_norms[l])``,
    ``factors = min(1, clip_norm / (norms + 1e-6))``; NaN propagates to both.

    Computed in the dtype of ``sq_norms`` (float32 or float64).
    """
    norms = sq_norms.sum(dim=0).sqrt()
    factors = (clip_norm / (norms + CLIP_EPS)).clamp(max=1.0)  # clamp keeps NaN (torch.minimum would too)
    return norms, factors
