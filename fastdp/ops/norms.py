"""Per-example gradient norms: ``fastdp::ghost_norm_sq`` and ``fastdp::clip_factors``.

Units (math: ``fastdp.ref.norms``). ``ghost_norm_sq(a, g)[i]`` is the squared L2 norm of
example i's weight gradient of a Linear layer, ``||a_i^T g_i||_F^2``, where a holds the
layer's inputs [B, T, d] and g the gradients of the *per-example* losses (summed, not
averaged, over the batch) with respect to its outputs [B, T, p]; T is the sequence length
(T = 1 for a plain batch). The bias gradient's squared norm, ``||sum_t g_it||^2``, is
not included. ``clip_factors(sq_norms, C)`` adds the per-layer squared norms [L, B],
takes the square root (whole-model per-example norms) and returns the factors
``min(1, C / (norm + 1e-6))`` that scale each example's gradient to norm <= C.

These ops take data, not graph nodes: they have no autograd formula and the entry points
below detach their inputs (the results never require grad).

Backends: ``fastdp._backend.select("norms", device)``. float64 inputs always run the
reference (the kernels compute in fp32), and so do CPU ghost norms of sequences up to
``CPU_GEMM_MAX_SEQ`` positions (batched GEMMs are faster there than the tiled kernel).
"""

from __future__ import annotations

import math

import torch

from fastdp import _backend, _ext
from fastdp.ref import norms as ref

__all__ = [
    "certified_conv_ghost_norm_sq",
    "certified_ghost_norm_sq",
    "certified_projections",
    "certified_token_match_norm_sq",
    "clip_factors",
    "ghost_norm_sq",
    "rounding_gamma",
]

_GHOST_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CLIP_DTYPES = (torch.float32, torch.float64)
# On CPU the tiled csrc kernel (symmetric tiles, no [T, T] buffers) wins from T = 128 up; below, one tile is the
# whole Gram and MKL's batched GEMM (the reference, chunked over examples) is faster (bench/bench_norms.py).
CPU_GEMM_MAX_SEQ = 64


def _finite(x) -> bool:
    """math.isfinite, False for an int too large for a float (where math.isfinite raises OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _check_ghost(a: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse what the kernels cannot do, saying what to do instead."""
    for name, x in (("a", a), ("g", g)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fastdp ghost_norm_sq: {name} is a {type(x).__name__}, expected a torch.Tensor")
        if x.dim() != 3:
            raise ValueError(
                f"fastdp ghost_norm_sq: {name} has shape {tuple(x.shape)}; expected [B, T, features] "
                "(use x.unsqueeze(1) for inputs without a sequence dimension)"
            )
        if x.dtype not in _GHOST_DTYPES:
            raise TypeError(
                f"fastdp ghost_norm_sq: {name} has dtype {x.dtype}; expected float32, float16, bfloat16 or float64"
            )
    if a.shape[:2] != g.shape[:2]:
        raise ValueError(
            f"fastdp ghost_norm_sq: a is {tuple(a.shape)} and g is {tuple(g.shape)}; their batch and sequence "
            "sizes (dims 0 and 1) must match"
        )
    if a.dtype != g.dtype:
        raise TypeError(f"fastdp ghost_norm_sq: a is {a.dtype} but g is {g.dtype}; cast both to one dtype")
    if a.device != g.device:
        raise ValueError(f"fastdp ghost_norm_sq: a is on {a.device} but g is on {g.device}; move both to one device")


def _check_clip(sq_norms: torch.Tensor, clip_norm: float) -> None:
    if not isinstance(sq_norms, torch.Tensor):
        raise TypeError(f"fastdp clip_factors: sq_norms is a {type(sq_norms).__name__}, expected a torch.Tensor")
    if sq_norms.dim() != 2:
        raise ValueError(
            f"fastdp clip_factors: sq_norms has shape {tuple(sq_norms.shape)}; expected [L, B] (squared norms "
            "per layer and example; use sq_norms.unsqueeze(0) for a single layer)"
        )
    if sq_norms.dtype not in _CLIP_DTYPES:
        raise TypeError(f"fastdp clip_factors: sq_norms has dtype {sq_norms.dtype}; expected float32 or float64")
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
        raise TypeError(f"fastdp clip_factors: clip_norm must be a float, got {type(clip_norm).__name__}")
    if not (_finite(clip_norm) and clip_norm > 0):
        raise ValueError(f"fastdp clip_factors: clip_norm is {clip_norm}; it must be finite and > 0")


def _ghost_kernel(backend: str):
    if backend == "triton":
        from fastdp.kernels import norms as triton_norms

        return triton_norms.ghost_norm_sq
    if backend == "cuda":
        return _ext._C.ghost_norm_sq
    return ref.ghost_norm_sq


def _clip_kernel(backend: str):
    if backend == "triton":
        from fastdp.kernels import norms as triton_norms

        return triton_norms.clip_factors
    if backend == "cuda":
        return _ext._C.clip_factors
    return ref.clip_factors


def _ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    _check_ghost(a, g)
    backend = _backend.select("norms", a.device.type)
    if a.dtype not in _KERNEL_DTYPES or (a.device.type == "cpu" and a.shape[1] <= CPU_GEMM_MAX_SEQ):
        backend = "torch"  # float64; or short sequences on CPU, where batched GEMMs beat the tiled kernel
    run = _ghost_kernel(backend)
    with torch.no_grad():
        return run(a.contiguous(), g.contiguous())


_ghost_norm_sq_op = torch.library.custom_op("fastdp::ghost_norm_sq", _ghost_norm_sq, mutates_args=())


@_ghost_norm_sq_op.register_fake
def _(a, g):
    _check_ghost(a, g)
    return a.new_empty(a.shape[0], dtype=ref.accumulation_dtype(a.dtype))


def _clip_factors(sq_norms: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_clip(sq_norms, clip_norm)
    backend = _backend.select("norms", sq_norms.device.type)
    run = _clip_kernel(backend if sq_norms.dtype == torch.float32 else "torch")  # float64: the reference
    with torch.no_grad():
        return run(sq_norms.contiguous(), float(clip_norm))


_clip_factors_op = torch.library.custom_op("fastdp::clip_factors", _clip_factors, mutates_args=())


@_clip_factors_op.register_fake
def _(sq_norms, clip_norm):
    _check_clip(sq_norms, clip_norm)
    return sq_norms.new_empty(sq_norms.shape[1]), sq_norms.new_empty(sq_norms.shape[1])


def ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example squared weight-gradient norms of a Linear layer: ``out[i] = ||a_i^T g_i||_F^2``.

    Computed as ``sum_{t,s} (a_it . a_is)(g_it . g_is)`` without forming the [d, p]
    per-example gradients (nor, on the GPU paths, the [T, T] Gram matrices).

    Args:
        a: layer inputs [B, T, d] (float32, float16, bfloat16 or float64; any layout).
        g: gradients of the per-example losses w.r.t. the layer outputs [B, T, p], same
            dtype and device as ``a``.

    Returns:
        [B] squared norms, float32 (float64 for float64 inputs), with fp32 accumulation.
        Inputs are detached: the result never requires grad.
    """
    if _backend.eager((a, g)):
        return _ghost_norm_sq(a.detach(), g.detach())
    _check_ghost(a, g)
    return torch.ops.fastdp.ghost_norm_sq(a.detach(), g.detach())


def certified_ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rigorous upper bounds on the per-example squared weight-gradient norms of a Linear layer, for clipping.

    :func:`ghost_norm_sq` is a fast fp32 value that can be far too small, negative or NaN for an example whose
    positions cancel at large magnitude (Gram products lose everything to rounding). What sets a clip factor must
    bound the norm of the contribution actually summed, whatever the rounding; this returns ``(bound, mass)``,
    float64 [B]: ``bound[i] >= ||a_i^T g_i||_F^2`` (float64 Grams plus a rigorous bound on their rounding) and
    ``mass[i] >= sum_t ||a_it|| ||g_it||`` (the size of the terms a sum of the example's contribution rounds). The
    reference's math (``fastdp.ref.norms.certified_ghost_norm_sq``) on every device; on CPU its float64 Grams run
    in ``fastdp._C``'s tiled kernel (no float64 copy of the batch, the upper triangle only; within
    :data:`CERTIFIED_PACK_BYTES` per thread), the rounding bound added by the reference. Arguments as
    :func:`ghost_norm_sq`; detached.
    """
    _check_ghost(a, g)
    with torch.no_grad():
        a, g = a.detach(), g.detach()
        kernel = _certified_kernel(a, g)
        if kernel is None:
            return ref.certified_ghost_norm_sq(a, g)
        dot, mass = kernel(a, g)
        return ref.certify_ghost(dot, mass, a.shape[2], g.shape[2], a.shape[1])


# The most memory one thread's packed example may take in the certified CPU kernel (float64 panels of its T x
# (d + p) values); larger examples run the reference, whose float64 copies are chunked.
CERTIFIED_PACK_BYTES = 64 * 2**20


def _panels_fit(rows: int, columns: int) -> bool:
    """Whether one example's float64 panels (``rows`` rounded up to 16) fit :data:`CERTIFIED_PACK_BYTES`."""
    return -(-rows // 16) * 16 * columns * 8 <= CERTIFIED_PACK_BYTES


def _certified_kernel(a: torch.Tensor, g: torch.Tensor):
    """``fastdp._C.certified_ghost_norm_sq`` where it runs these inputs (:func:`fastdp._backend.cpu_kernel`, an
    example's panels within :data:`CERTIFIED_PACK_BYTES`), else None."""
    kernel = _backend.cpu_kernel("certified_ghost_norm_sq", "norms", a, g)
    return kernel if kernel is not None and _panels_fit(a.shape[1], a.shape[2] + g.shape[2]) else None


def certified_conv_ghost_norm_sq(
    x: torch.Tensor,
    g: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`certified_ghost_norm_sq` of a convolution's per-example weight gradient from the Gram of its input
    pixels (no im2col; K times fewer multiply-adds than the patch Gram at stride 1): ``(bound, mass)``, float64 [N],
    for ``x`` [N, C, H, W] (unpadded input, one group per row) and ``g`` [N, p, H_out, W_out]. The reference's math
    (``fastdp.ref.norms.certified_conv_ghost_norm_sq``) on every device; on CPU its pixel and output-gradient Grams
    come from ``fastdp._C``'s tiled float64 kernel (no float64 copies, upper triangles mirrored); detached."""
    with torch.no_grad():
        x, g = x.detach(), g.detach()
        gram = _backend.cpu_kernel("certified_gram", "norms", x, g)
        fit = _panels_fit(x.shape[2] * x.shape[3], x.shape[1]) and _panels_fit(g.shape[2] * g.shape[3], g.shape[1])
        return ref.certified_conv_ghost_norm_sq(x, g, kernel_size, stride, padding, dilation, gram if fit else None)


def certified_projections(
    per_example: torch.Tensor, tangents: torch.Tensor, mass: torch.Tensor, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Projections of per-example gradients onto JL tangents with a rigorous bound on their rounding: see
    ``fastdp.ref.norms.certified_projections`` (the torch reference on every device); detached."""
    with torch.no_grad():
        return ref.certified_projections(per_example.detach(), tangents.detach(), mass.detach(), positions)


rounding_gamma = ref.rounding_gamma


def certified_token_match_norm_sq(idx: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`certified_ghost_norm_sq` for an embedding's per-example gradient (rows of ``g`` [B, T, dim] scattered by
    the token ids ``idx`` [B, T]): ``(bound, mass)``, float64 [B] (``fastdp.ref.norms.certified_token_match_norm_sq``;
    on CPU its Gram from ``fastdp._C.certified_gram``); detached."""
    with torch.no_grad():
        g = g.detach()
        gram = _backend.cpu_kernel("certified_gram", "norms", g)
        fit = _panels_fit(g.shape[1], g.shape[2])
        return ref.certified_token_match_norm_sq(idx.detach(), g, gram if fit else None)


def clip_factors(sq_norms: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-model per-example norms and DP-SGD clip factors, in one fused launch.

    Args:
        sq_norms: [L, B] squared gradient norms of L layers (or parameter groups) for B
            examples, float32 or float64.
        clip_norm: the clip bound C, finite and > 0.

    Returns:
        ``(norms, factors)``, both [B] in the dtype of ``sq_norms``:
        ``norms[i] = sqrt(sum_l sq_norms[l, i])`` and ``factors[i] = min(1, C / (norms[i] + 1e-6))``.
        A NaN anywhere in column i makes ``norms[i]`` and ``factors[i]`` NaN (never a silent 1).
    """
    if _backend.eager((sq_norms,)):
        return _clip_factors(sq_norms.detach(), clip_norm)
    _check_clip(sq_norms, clip_norm)
    return torch.ops.fastdp.clip_factors(sq_norms.detach(), float(clip_norm))
