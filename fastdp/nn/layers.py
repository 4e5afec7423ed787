"""Drop-in DP layers: torch modules that, inside a :class:`~fastdp.nn.ghost.GhostClipping` step, give per-example
gradient norms and clipped gradient sums from one backward (no per-example gradients are materialised where a
ghost norm is cheaper).

Each class subclasses its torch counterpart with no extra state, so outside a DP step it is that module, its
``state_dict`` is unchanged, and :func:`fastdp.nn.convert` turns a torch module into one in place. Per layer:

* ``per_example_sq_norms(saved, G, cache)`` -> [B]: sum over the layer's trainable parameters of ||grad_i||^2;
* ``clipped_grad_sums(saved, G, c, cache)`` -> one tensor per trainable parameter: sum_i c_i grad_i;
* ``per_example_projections(saved, G, tangents, cache)`` -> (P [B, r], err [B], allowance [B]): DP-SGD-JL's
  projections of each example's gradient onto r tangents, with rigorous bounds on their rounding and on that of
  the clipped sum (float64; per-example gradients formed in float64 a chunk of examples at a time).
* ``per_example_forms(saved, G)`` -> one :mod:`fastdp.nn.forms` form per trainable parameter: its per-example
  gradient kept factored, for a parameter other layer calls use too (tied weights, a layer called twice), whose norm
  needs the cross terms between the uses.

Where a per-example weight gradient is cheaper than the ghost norm it is formed once, kept in ``cache``
(a dict per layer call, or None), and its clipped sum is then a weighted sum instead of a second GEMM.

G is the gradient of the summed per-example losses w.r.t. the layer output (rows are per-example).
Norms accumulate in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from fastdp.nn.forms import Dense, Form, Outer, Rows
from fastdp.nn.ghost import active_context, summing_anywhere, summing_context
from fastdp.ops import (
    certified_conv_ghost_norm_sq,
    certified_ghost_norm_sq,
    certified_projections,
    certified_token_match_norm_sq,
    rounding_gamma,
    summation,
)

PROJECTION_CHUNK_ELEMENTS = 1 << 24  # float64 entries a JL projection forms at a time (128 MiB)


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _as_consumed(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, in the dtype a Linear/Conv consumes it in: under bf16/fp16 autocast such a layer casts its
    float32 input (e.g. the model's input) to the autocast dtype, and its output, hence G, has that dtype too. The
    saved A is then the A the layer multiplied, of G's dtype (as the ghost-norm op needs)."""
    x = x.detach()
    device = x.device.type
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def _rowsq(t: torch.Tensor) -> torch.Tensor:
    """Per-example sum of squares of a [B, ...] tensor, float64, rounded up (``fastdp.ops.summation.sq_norms_up``)."""
    return summation.sq_norms_up(t)


# The most memory a layer's per-example gradients may take when its norm is computed from them (the direct path);
# beyond it the Gram (ghost / token-match) path is used, whose work does not grow with the parameter's size.
DIRECT_MEMORY_BUDGET = 256 * 2**20


def _fits(*shape: int, itemsize: int) -> bool:
    """Whether a tensor of ``shape`` (per-example gradients) fits :data:`DIRECT_MEMORY_BUDGET`."""
    return math.prod(shape) * itemsize <= DIRECT_MEMORY_BUDGET


def _embedding_direct(batch: int, positions: int, vocabulary: int, dim: int, itemsize: int) -> bool:
    """An Embedding's per-example gradients [B, V, dim] formed for its norm (else the token-match Gram): see
    :class:`Embedding`."""
    return 64 * vocabulary < positions * positions and _fits(batch, vocabulary, dim, itemsize=itemsize)


def _use_ghost(positions: int, out_features: int, in_features: int) -> bool:
    """Ghost norm (T x T Gram products) when cheaper than the per-example gradient: T (d + p) < p d.

    The certified ghost norm costs T^2 (d + p) / 2 float64 multiply-adds per example on CPU (``fastdp._C``'s tiled
    kernel: the A and G Grams' upper triangles, and their inner product); the per-example gradient T p d in the
    layer's dtype, kept for the clipped sum (a GEMV over it). A float64 multiply-add costs about two fp32 ones,
    hence T (d + p) against p d (2026-11-24, 2 threads, DP-SGD steps interleaved: the attention classifier's
    128 x 128 ``out_proj`` at T 32, ghost against direct: 1.25x against 1.29x non-private, live peak 1.09x against
    1.25x; GPT-2 and BERT at T 128 unchanged). The per-example gradient is kept only where p d <= T (d + p): at most
    the size of the layer's own A and G."""
    return positions * (out_features + in_features) < out_features * in_features


def _mass(a: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """``sum_t |a_t| |g_t|`` per example (``|a_t| = 1`` when ``a`` is None, a bias), float64 [B, T, *] inputs, rounded
    up: it bounds the Frobenius norm of the absolute terms of the example's gradient ``sum_t a_t g_t^T``."""
    rows = torch.linalg.vector_norm(g, dim=2)
    if a is not None:
        rows = rows * torch.linalg.vector_norm(a, dim=2)
    terms = g.shape[2] + (0 if a is None else a.shape[2]) + g.shape[1] + 4
    return rows.sum(1) * (1 + rounding_gamma(terms, torch.float64))


def _projections(
    pieces_of, saved: tuple, grad_out: torch.Tensor, tangents: list[torch.Tensor], rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DP-SGD-JL's ``per_example_projections`` of a layer (every DP layer has one): ``(P [B, r], err [B],
    allowance [B])``, float64. ``P_ij = <grad_i, v_j>`` over the layer's trainable parameters (``tangents``: one
    [r, *p.shape] per ``dp_parameters()``), for ``grad_i`` the exact per-example gradient of the saved A and G;
    ``|P_ij - computed| <= err_i`` for every j; ``allowance_i`` bounds how far the layer's clipped sum moves from
    ``c_i grad_i`` per unit factor c_i, beyond its exact value.

    ``pieces_of(saved, G)`` gives one ``(per-example gradient [b, ...] float64, mass [b], positions)`` per trainable
    parameter (see ``fastdp.ops.certified_projections``), evaluated on ``rows`` examples at a time (default: as many
    as keep the float64 per-example gradients within :data:`PROJECTION_CHUNK_ELEMENTS`); never kept."""
    b, r = grad_out.shape[0], tangents[0].shape[0]
    if rows is None:
        rows = max(1, PROJECTION_CHUNK_ELEMENTS // max(1, sum(t[0].numel() for t in tangents)))
    flat = [t.reshape(r, -1) for t in tangents]
    p = torch.zeros(b, r, dtype=torch.float64, device=grad_out.device)
    err = torch.zeros(b, dtype=torch.float64, device=grad_out.device)
    allowance = torch.zeros_like(err)
    for start in range(0, b, rows):
        part = slice(start, start + rows)
        pieces = pieces_of(tuple(t[part] for t in saved), grad_out[part])
        for (per_example, mass, positions), v in zip(pieces, flat, strict=True):
            proj, e = certified_projections(per_example.reshape(per_example.shape[0], -1), v, mass, positions)
            p[part] += proj
            err[part] += e
            allowance[part] += summation.mass_allowance(mass)
    return p, err, allowance


def _sequence_weight_sq(a: torch.Tensor, g: torch.Tensor, cache: dict | None) -> torch.Tensor:
    """Squared norm to clip ||a_i^T g_i||_F by, for a [B, T, d], g [B, T, p]: a certified ghost norm (float64 Grams
    with a rounding bound, ``fastdp.ops.summation.clip_sq_up``), or the per-example gradient [B, p, d] (kept in
    ``cache["weight"]``; its norm is that of the very tensor summed) when that is smaller."""
    b, t, d = a.shape
    p = g.shape[2]
    if _use_ghost(t, p, d) or not _fits(b, p, d, itemsize=g.element_size()):
        return summation.clip_sq_up(*certified_ghost_norm_sq(a, g))
    per_example = torch.einsum("btp,btd->bpd", g, a)
    if cache is not None:
        cache["weight"] = per_example
    return _rowsq(per_example)


def _clipped_weight_sum(a: torch.Tensor, grad_out: torch.Tensor, factors: torch.Tensor | None) -> torch.Tensor:
    """``sum_i c_i g_i^T a_i`` [p, d], float64, for a [B, ..., d], G [B, ..., p]: float64 GEMMs over every
    example's positions in chunks (``fastdp.ops.summation.outer_sum``), the narrower of G and A scaled by c (no
    scaling where ``factors`` is None: every c_i = 1)."""
    positions = math.prod(a.shape[1:-1])
    rows_a, rows_g = a.reshape(-1, a.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    if factors is None:
        return summation.outer_sum(rows_g, rows_a)
    scale = factors.repeat_interleave(positions) if positions != 1 else factors
    if a.shape[-1] < grad_out.shape[-1]:
        return summation.outer_sum(rows_g, rows_a, right_scale=scale)
    return summation.outer_sum(rows_g, rows_a, left_scale=scale)


def _weighted_blocks(factors: torch.Tensor, blocks) -> torch.Tensor:
    """``summation.weighted_sum`` of per-example tensors kept as blocks of consecutive examples ([m, ...] each, in
    order)."""
    parts, start = [], 0
    for block in blocks:
        parts.append(summation.weighted_sum(factors[start : start + block.shape[0]], block))
        start += block.shape[0]
    return summation.add_all(parts)


def own_trainable(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s own trainable parameters in ``parameters(recurse=False)`` order, read from its parameter dict
    (called for every layer in every step: the generator machinery of ``parameters()`` costs more than the step's
    small kernels)."""
    params = [p for p in module._parameters.values() if p is not None and p.requires_grad]
    return params if len({id(p) for p in params}) == len(params) else list(dict.fromkeys(params))


class DPLayer:
    """Mixin for DP layers: trainable parameters in ``named_parameters(recurse=False)`` order."""

    def dp_parameters(self) -> list[nn.Parameter]:
        return own_trainable(self)

    def _trains(self) -> bool:
        """Whether the layer has a trainable parameter (no ``id()``s: torch.compile would guard on them)."""
        return any(p is not None and p.requires_grad for p in self._parameters.values())

    def _detached(self, name: str):
        p = getattr(self, name)
        return None if p is None else p.detach()


class Linear(nn.Linear, DPLayer):
    """``torch.nn.Linear``; inputs [B, d] or [B, ..., d] (sequence positions flattened into T)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self._trains():
            return super().forward(x)
        out = F.linear(x, self._detached("weight"), self._detached("bias"))
        return ctx.tap(self, (_as_consumed(x),), out)

    @staticmethod
    def _flat(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = math.prod(a.shape[1:-1])
        return a.reshape(a.shape[0], positions, a.shape[-1]), g.reshape(g.shape[0], positions, g.shape[-1])

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        (a,) = saved
        total = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
        a3, g3 = self._flat(a, grad_out)  # [B, T, d], [B, T, p]; T = 1 for 2-D inputs
        g_sq = None  # ||g_i||^2 when T = 1: the bias's squared norm and a factor of the weight's
        if self.bias is not None and self.bias.requires_grad:
            bias = g3[:, 0] if g3.shape[1] == 1 else g3.sum(1)  # per-example bias gradients [B, p]
            if cache is not None:
                cache["bias"] = bias
            g_sq = _rowsq(bias)
            total += g_sq
        if self.weight.requires_grad and g3.shape[1] == 1:  # |a|^2 |g|^2; 0 where g = 0, also for |a|^2 = inf
            g_sq = _rowsq(g3) if g_sq is None else g_sq
            total += torch.where(g_sq == 0, 0.0, _rowsq(a3) * g_sq)
        elif self.weight.requires_grad:
            total += _sequence_weight_sq(a3, g3, cache)
        return total

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One position per example (T = 1): ``P_ij = g_i^T V_j a_i`` as one GEMM ``G [B, p] @ V [p, r d]`` per chunk
        of examples, no [p, d] per-example gradient (forming those moves B p d floats: 10x slower for an MLP);
        ``err = gamma_{p + d + 2} max_j ||V_j|| |a_i| |g_i|``. Sequences: the per-example gradients
        (:func:`_projections`)."""
        (a,) = saved
        if math.prod(a.shape[1:-1]) != 1 or not self.weight.requires_grad:
            return _projections(self._per_example64, saved, grad_out, tangents)
        b, d, p = a.shape[0], a.shape[-1], grad_out.shape[-1]
        a2, g2 = a.reshape(b, d).to(torch.float64), grad_out.reshape(b, p).to(torch.float64)
        v = tangents[0].to(torch.float64)
        r = v.shape[0]
        flat = v.permute(1, 0, 2).reshape(p, r * d)
        proj = torch.empty(b, r, dtype=torch.float64, device=a.device)
        rows = max(1, PROJECTION_CHUNK_ELEMENTS // (r * d))
        for start in range(0, b, rows):
            part = slice(start, start + rows)
            proj[part] = (g2[part] @ flat).reshape(-1, r, d).mul_(a2[part].unsqueeze(1)).sum(2)
        mass = _mass(a2.unsqueeze(1), g2.unsqueeze(1))
        v_norm = float(torch.linalg.vector_norm(v.reshape(r, -1), dim=1).max()) * (
            1 + rounding_gamma(p * d + 2, torch.float64)
        )
        err = rounding_gamma(p + d + 2, torch.float64) * v_norm * mass
        allowance = summation.mass_allowance(mass)
        if self.bias is not None and self.bias.requires_grad:
            bias_mass = _mass(None, g2.unsqueeze(1))
            bias, bias_err = certified_projections(g2, tangents[1].reshape(r, -1), bias_mass, 1)
            proj, err, allowance = (
                proj + bias,
                err + bias_err,
                allowance + summation.mass_allowance(bias_mass),
            )
        return proj, err, allowance

    def _per_example64(self, saved, grad_out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        (a,) = saved
        a3, g3 = self._flat(a.to(torch.float64), grad_out.to(torch.float64))
        pieces = []
        if self.weight.requires_grad:
            pieces.append((torch.einsum("btp,btd->bpd", g3, a3), _mass(a3, g3), a3.shape[1]))
        if self.bias is not None and self.bias.requires_grad:
            pieces.append((g3.sum(1), _mass(None, g3), g3.shape[1]))
        return pieces

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """The weight's per-example gradient ``sum_t g_t a_t^T`` (G, A) and the bias's ``sum_t g_t``
        (``fastdp.nn.forms``: a parameter shared with other layer calls)."""
        (a,) = saved
        a3, g3 = self._flat(a, grad_out)
        forms: list[Form] = [Outer(g3, a3)] if self.weight.requires_grad else []
        if self.bias is not None and self.bias.requires_grad:
            forms.append(Dense(g3.sum(1)))
        return forms

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor | None, cache: dict | None = None
    ) -> list[torch.Tensor]:
        return linear_grad_sums(self.weight, self.bias, saved, grad_out, factors, cache)


def linear_grad_sums(
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    saved: tuple,
    grad_out: torch.Tensor,
    factors: torch.Tensor | None,
    cache: dict | None = None,
) -> list[torch.Tensor]:
    """``sum_i c_i grad_i`` (float64) of each trainable one of ``weight`` [p, d] and ``bias`` [p] of ``y = x W^T + b``
    from the saved input ``(a,)`` [B, ..., d] and G [B, ..., p] (``factors`` None: every c_i = 1); per-example
    gradients a norm formed in ``cache`` are summed instead of a second GEMM."""
    (a,) = saved
    sums = []
    if weight.requires_grad and cache and "weight" in cache:
        sums.append(summation.weighted_sum(factors, cache["weight"]))
    elif weight.requires_grad:
        sums.append(_clipped_weight_sum(a, grad_out, factors))
    if bias is not None and bias.requires_grad:
        bias_rows = (
            cache["bias"] if cache and "bias" in cache else Linear._flat(a, grad_out)[1].to(torch.float64).sum(1)
        )
        sums.append(summation.weighted_sum(factors, bias_rows))
    return sums


# Bytes of input, output gradient and weight gradient per convolution backward that forms per-example weight
# gradients (_ConvNd._per_example_weight_conv), in whole multiples of the thread count: 1-14 examples per call on
# ResNet-18-GN's layers (B 32, 32 x 32), the fastest of the chunk rules measured at 1 and 2 threads; oneDNN slows
# down 1.5-3x once a call's weight gradients pass a few MB, on an odd number of examples over 2 threads (up to
# 1.4x), and on single examples over many positions (bench/bench_conv.py).
CONV_BACKWARD_CHUNK_BYTES = 4 * 2**20
# Output positions from which a convolution backward with the batch folded into the groups forms per-example weight
# gradients faster than a batched GEMM over im2col patches (CPU, float32; 4x as many for a 1 x 1 kernel;
# bench/bench_conv.py).
CONV_BACKWARD_MIN_POSITIONS = 16


def _conv_backward_pays(x: torch.Tensor, positions: int, kernel: int) -> bool:
    """Whether a convolution's per-example weight gradients are formed by convolution backwards (oneDNN's grouped
    kernel) rather than by the batched GEMM over im2col patches: float32 on CPU and at least
    :data:`CONV_BACKWARD_MIN_POSITIONS` output positions (4x as many for a 1 x 1 kernel). Measured (2 cores, 1 and 2
    threads) 1.2-4x faster than im2col on 3 x 3 to 5 x 5 kernels over 16 to 1024 positions with 16 to 512 input
    channels (ResNet-18-GN's 64-channel layers 4.7x at 32 x 32; 1-D convolutions 1.5-2x), within 15 % either way on
    stems with 1-3 input channels; on 1 x 1 kernels as fast or up to 3.7x faster from 64 positions, up to 2x slower
    over 16. Other devices and dtypes keep the GEMM (float64 has no oneDNN kernel; nothing else was measured)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    return positions >= CONV_BACKWARD_MIN_POSITIONS * (1 if kernel > 1 else 4)


def _pixel_gram_pays(size, out_size, padding, kernel: int, channels: int) -> bool:
    """Whether a convolution's ghost norm is cheaper from the input pixels' Gram (``(H W)^2 C`` multiply-adds, the
    padded Gram's ``(H_p W_p)^2`` entries, K shifted additions of T^2) than from the patches' (``T^2 K C`` and an
    im2col copy of ``T K C``): at stride 1 about K times cheaper; at stride 2 the pixels are 4 T, and the patches
    win."""
    pixels, positions = math.prod(size), math.prod(out_size)
    padded = math.prod(n + 2 * p for n, p in zip(size, padding, strict=True))
    return pixels * pixels * channels + padded * padded + kernel * positions * positions < positions * kernel * (
        positions * channels + channels
    )


class _ConvNd(DPLayer):
    """Shared by Conv1d/Conv2d: per-example weight gradients (convolution backwards per block of examples, or a GEMM
    over the unfolded input, im2col) or certified Gram norms (of the input pixels at stride 1, else of the patches)."""

    _spatial: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self._trains():
            return super().forward(x)
        if self.padding_mode != "zeros":
            raise ValueError(
                f"fastdp.nn.{type(self).__name__}: padding_mode={self.padding_mode!r} is not supported in DP "
                "training; use padding_mode='zeros' (or pad the input with F.pad before the layer)"
            )
        out = self._conv_forward(x, self._detached("weight"), self._detached("bias"))
        return ctx.tap(self, (_as_consumed(x),), out)

    def _padding(self) -> tuple[int, ...]:
        if isinstance(self.padding, str):
            if self.padding == "valid":
                return (0,) * self._spatial
            raise ValueError(
                f"fastdp.nn.{type(self).__name__}: padding='same' is not supported; give the padding as integers"
            )
        return tuple(self.padding)

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        """[B * groups, L, k_h * k_w * C_in/g]: each example's input patches per group (L = output positions),
        gathered from a channels-last copy so each patch is read in runs of C_in/g contiguous values (several times
        faster than ``F.unfold`` on CPU). The features are ordered (k_h, k_w, c), not the weight's (c, k_h, k_w):
        a permutation shared by every row, which leaves the Gram matrices of the ghost norm unchanged."""
        if self._spatial == 1:
            x = x.unsqueeze(2)
            k, s, p, d = (1, *self.kernel_size), (1, *self.stride), (0, *self._padding()), (1, *self.dilation)
        else:
            k, s, p, d = self.kernel_size, self.stride, self._padding(), self.dilation
        if any(p):
            x = F.pad(x, (p[1], p[1], p[0], p[0]))
        b, c, h, w = x.shape
        rows, cols = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1, (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
        cg = c // self.groups
        x = x.permute(0, 2, 3, 1).contiguous()  # [B, H, W, C]
        view = x.as_strided(
            (b, self.groups, rows, cols, k[0], k[1], cg),
            (h * w * c, cg, w * c * s[0], c * s[1], w * c * d[0], c * d[1], 1),
        )
        return view.reshape(b * self.groups, rows * cols, k[0] * k[1] * cg)

    def _grouped(self, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [B * groups, L, k * C_in/g] input patches, g [B * groups, L, C_out/g]) per example and group."""
        b, groups = x.shape[0], self.groups
        a = self._patches(x)
        positions = a.shape[1]
        g = grad_out.reshape(b, groups, -1, positions).transpose(2, 3).reshape(b * groups, positions, -1)
        return a, g

    def _weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor, weight_shape, groups: int) -> torch.Tensor:
        """The weight gradient of the convolution of ``x`` with a weight of ``weight_shape`` (``groups``) at output
        gradient ``grad_out``: one ``convolution_backward``. Its weight argument is an uninitialised contiguous
        tensor of that shape (only its shape and layout are read): ``torch.nn.grad.conv2d_weight`` passes one
        element expanded to the shape, which oneDNN copied and then ran on a slow path (the 512-channel 4 x 4
        layers of ResNet-18-GN: 29 against 4.7 ms a call)."""
        weight = x.new_empty(weight_shape)
        return torch.ops.aten.convolution_backward(grad_out, x, weight, None, self.stride, self._padding(),
                                                   self.dilation, False, [0] * self._spatial, groups,
                                                   (False, True, False))[1]  # fmt: skip

    def _clipped_weight_sum(
        self, x: torch.Tensor, grad_out: torch.Tensor, factors: torch.Tensor | None
    ) -> torch.Tensor:
        """``sum_i c_i grad_i`` of the weight (every c_i = 1 where ``factors`` is None), float64: per group, float64
        GEMMs of G's rows and the input patches' (``fastdp.ops.summation.outer_sum``), the patches of a block of
        examples at a time (at most ``SUM_CHUNK_ROWS`` rows, or one example), the blocks added by
        ``CompensatedSum``."""
        b, groups, cg = x.shape[0], self.groups, self.weight.shape[1]
        if b == 0:
            return torch.zeros(self.weight.shape, dtype=torch.float64, device=x.device)
        positions = math.prod(grad_out.shape[2:])
        per = max(1, summation.SUM_CHUNK_ROWS // max(1, positions))
        totals = [summation.CompensatedSum() for _ in range(groups)]
        for start in range(0, b, per):
            a, g = self._grouped(x[start : start + per], grad_out[start : start + per])
            m = a.shape[0] // groups
            a, g = a.reshape(m, groups, positions, -1), g.reshape(m, groups, positions, -1)
            scale = None if factors is None else factors[start : start + per].repeat_interleave(positions)
            for j, total in enumerate(totals):
                total.add_(summation.outer_sum(g[:, j].reshape(-1, g.shape[-1]), a[:, j].reshape(-1, a.shape[-1]),
                                               left_scale=scale))  # fmt: skip
        weight = torch.stack([total.value() for total in totals])  # [groups, C_out/g, k * cg], features (k, c)
        return weight.reshape(self.out_channels, -1, cg).transpose(1, 2).reshape(self.weight.shape)

    def _per_example_weight(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """[B, *weight.shape] per-example weight gradients (:meth:`_per_example_weight_chunks`, joined)."""
        chunks = self._per_example_weight_chunks(x, grad_out)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _per_example_weight_chunks(self, x: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor]:
        """Per-example weight gradients, as [m, *weight.shape] blocks of consecutive examples. On CPU in float32
        (:func:`_conv_backward_pays`): convolution backwards with the batch folded into the groups, m examples per
        call (:meth:`_per_example_weight_conv`; the blocks are not joined: a copy of them all cost 12 % of their
        time on ResNet-18-GN). Otherwise one block: per example and group, G_i [C_out/g, L] times the input patches
        [L, k * C_in/g], one batched GEMM, then the patch features reordered from (k, c) to the weight's (c, k)."""
        if _conv_backward_pays(x, math.prod(grad_out.shape[2:]), math.prod(self.kernel_size)):
            return self._per_example_weight_conv(x, grad_out)
        b, cg = x.shape[0], self.weight.shape[1]
        a = self._patches(x)
        per_example = torch.bmm(grad_out.reshape(a.shape[0], -1, a.shape[1]), a)  # [B * groups, C_out/g, k * cg]
        per_example = per_example.reshape(b, self.out_channels, -1, cg).transpose(2, 3)
        return [per_example.reshape(b, *self.weight.shape)]

    def _per_example_weight_conv(self, x: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_per_example_weight_chunks` as convolution backwards (oneDNN on CPU) with the batch folded into the
        groups: examples [i, i + m) are one input of m * C_in channels and m * groups groups, whose weight gradient
        [m * C_out, C_in/g, *k] is the m examples' gradients in the weight's layout (no im2col copy, no reordering).
        m examples at a time: their x, G and weight gradients within :data:`CONV_BACKWARD_CHUNK_BYTES`, m a multiple of
        the thread count where it can be."""
        b = x.shape[0]
        size = (x[:1].numel() + grad_out[:1].numel() + self.weight.numel()) * x.element_size()
        rows, threads = max(1, CONV_BACKWARD_CHUNK_BYTES // max(1, size)), torch.get_num_threads()
        rows -= rows % threads if rows >= threads else 0  # oneDNN spreads a call's groups over the threads
        chunks = []
        for start in range(0, b, rows):
            xs, gs = x[start : start + rows], grad_out[start : start + rows]
            m = xs.shape[0]
            grad = self._weight_grad(xs.reshape(1, -1, *xs.shape[2:]), gs.reshape(1, -1, *gs.shape[2:]),
                                     (m * self.out_channels, *self.weight.shape[1:]), m * self.groups)  # fmt: skip
            chunks.append(grad.view(m, *self.weight.shape))
        return chunks

    def _ghost_bound(self, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Certified ``(bound, mass)`` [B * groups] of the per-example weight gradient, per example and group: from the
        input pixels' Gram where that is cheaper than the patches' (stride 1: K times fewer multiply-adds, no
        im2col; ``fastdp.ops.certified_conv_ghost_norm_sq``), else from the patches (``certified_ghost_norm_sq``)."""
        b, groups = x.shape[0], self.groups
        if self._spatial == 1:
            x, grad_out = x.unsqueeze(2), grad_out.unsqueeze(2)
            k, s, p, d = (1, *self.kernel_size), (1, *self.stride), (0, *self._padding()), (1, *self.dilation)
        else:
            k, s, p, d = self.kernel_size, self.stride, self._padding(), self.dilation
        if _pixel_gram_pays(x.shape[2:], grad_out.shape[2:], p, math.prod(k), x.shape[1] // groups):
            x, grad_out = x.reshape(b * groups, -1, *x.shape[2:]), grad_out.reshape(b * groups, -1, *grad_out.shape[2:])
            return certified_conv_ghost_norm_sq(x, grad_out, k, s, p, d)
        if self._spatial == 1:
            x, grad_out = x.squeeze(2), grad_out.squeeze(2)
        return certified_ghost_norm_sq(*self._grouped(x, grad_out))

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        (x,) = saved
        b = x.shape[0]
        total = torch.zeros(b, dtype=torch.float64, device=x.device)
        if self.weight.requires_grad and b:
            positions = math.prod(grad_out.shape[2:])
            fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
            if _use_ghost(positions, self.out_channels // self.groups, fan_in) or not _fits(
                b, self.out_channels, fan_in, itemsize=x.element_size()
            ):
                bound, mass = self._ghost_bound(x, grad_out)  # per example and group: the groups' blocks add
                total += summation.clip_sq_up(bound.reshape(b, self.groups).sum(1), mass.reshape(b, self.groups).sum(1))
            else:
                chunks = self._per_example_weight_chunks(x, grad_out)
                if cache is not None:
                    cache["weight"] = tuple(chunks)  # blocks of consecutive examples
                total += torch.cat([_rowsq(chunk) for chunk in chunks])
        if self.bias is not None and self.bias.requires_grad:
            bias = grad_out.flatten(2).sum(2)  # per-example bias gradients [B, C_out]
            if cache is not None:
                cache["bias"] = bias
            total += _rowsq(bias)
        return total

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """The per-example weight and bias gradients, formed (``fastdp.nn.forms``: a parameter shared with other
        layer calls)."""
        (x,) = saved
        forms: list[Form] = [Dense(self._per_example_weight(x, grad_out))] if self.weight.requires_grad else []
        if self.bias is not None and self.bias.requires_grad:
            forms.append(Dense(grad_out.flatten(2).sum(2)))
        return forms

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of the per-example weight gradients (patches x G, float64) and bias gradients
        (:func:`_projections`)."""
        return _projections(self._per_example64, saved, grad_out, tangents)

    def _per_example64(self, saved, grad_out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        (x,) = saved
        x, g = x.to(torch.float64), grad_out.to(torch.float64)
        b, positions = x.shape[0], math.prod(g.shape[2:])
        pieces = []
        if self.weight.requires_grad:
            a, grouped = self._grouped(x, g)
            mass = _mass(a, grouped).reshape(b, self.groups).sum(1) * (1 + rounding_gamma(self.groups, torch.float64))
            pieces.append((self._per_example_weight(x, g), mass, positions))
        if self.bias is not None and self.bias.requires_grad:
            pieces.append((g.flatten(2).sum(2), _mass(None, g.flatten(2).transpose(1, 2)), positions))
        return pieces

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        (x,) = saved
        sums = []
        if self.weight.requires_grad and cache and "weight" in cache:
            sums.append(_weighted_blocks(factors, cache["weight"]))
        elif self.weight.requires_grad:
            sums.append(self._clipped_weight_sum(x, grad_out, factors))
        if self.bias is not None and self.bias.requires_grad:
            bias = cache["bias"] if cache and "bias" in cache else grad_out.flatten(2).to(torch.float64).sum(2)
            sums.append(summation.weighted_sum(factors, bias))
        return sums


class Conv1d(_ConvNd, nn.Conv1d):
    """``torch.nn.Conv1d`` (padding_mode 'zeros', any stride/padding/dilation/groups)."""

    _spatial = 1


class Conv2d(_ConvNd, nn.Conv2d):
    """``torch.nn.Conv2d`` (padding_mode 'zeros', any stride/padding/dilation/groups)."""

    _spatial = 2


class ConvShape(_ConvNd):
    """A convolution's parameters and geometry without its torch module: what :class:`_ConvNd`'s sums read, for the
    convolutions of the variants whose bound lives in the network (fastdp's own classes, with integer geometry)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, stride, padding, dilation, groups: int = 1):
        n = self._spatial = weight.dim() - 2
        self.weight, self.bias, self.groups, self.out_channels = weight, bias, groups, weight.shape[0]
        self.kernel_size = tuple(weight.shape[2:])
        self.stride, self.dilation = (
            tuple(v) if isinstance(v, (tuple, list)) else (v,) * n for v in (stride, dilation)
        )
        self._input_pad: list[int] | None = None  # F.pad of the input where torch's "same" pads unevenly
        if padding == "valid":
            padding = 0
        elif padding == "same":  # torch's rule: d (k - 1) in all, the extra one at the end
            total = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size, strict=True)]
            padding = tuple(t // 2 for t in total)
            if any(t % 2 for t in total):
                self._input_pad = [v for t in reversed(total) for v in (t // 2, t - t // 2)]
                padding = 0
        self.padding = tuple(padding) if isinstance(padding, (tuple, list)) else (padding,) * n

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor | None, cache: dict | None = None
    ) -> list[torch.Tensor]:
        if self._input_pad is not None:
            saved = (F.pad(saved[0], self._input_pad),)
        return super().clipped_grad_sums(saved, grad_out, factors, cache)


class SummedLayer:
    """Mixin for the layers of the variants whose per-example bound lives in the network (clipless, weight clipping,
    backpropagation clipping; ``fastdp.nn.lipschitz``, ``fastdp.nn.weightclip``, ``fastdp.nn.backprop``): there the
    parameters' gradient summed over the batch *is* what is released, so that sum must have a bounded rounding. An
    ordinary backward sums it in the weight-gradient GEMM over the batch in float32, whose partial sums one example
    re-rounds (``fastdp.ops.summation``). Inside a summing :class:`~fastdp.nn.ghost.GhostClipping` (``sums=True``)
    such a layer runs on its detached parameters and records its input; its output's hook gives G, and
    :meth:`grad_sums` the gradient's batch sum in float64 chunks added by TwoSum (``fastdp.ops.summation``). Each
    example's terms there (``sum_t |a_t| |g_t|``) are within its certified per-example bound by the same
    Cauchy-Schwarz step as the bound rules, so the rounding adds at most ``sensitivity_slack`` of the bound.
    Elsewhere the plain layer. Each such layer defines ``grad_sums(saved, G)``: the batch's gradient of each of
    :meth:`dp_parameters` (float64) from its saved input and G."""

    def dp_parameters(self) -> list[nn.Parameter]:
        return own_trainable(self)

    def _summed_call(self, fn, x: torch.Tensor, *params: nn.Parameter | None) -> torch.Tensor:
        """``fn(x, *params)``; in a summing context, on the detached parameters, recorded (input ``x``).

        Under torch.compile the choice is guarded: :func:`~fastdp.nn.ghost.summing_anywhere` reads a module-level
        count, on which dynamo guards by value (plain: one graph, ``fullgraph`` works; summing: the recording call,
        never compiled, a graph break per layer). The thread-local context alone was not guarded: a model the user
        compiled outside the context and then called in the front door's ran some layers' plain forward, whose
        gradients reached the parameters outside the records (refused, ``bounded_gradient_sums``)."""
        if not summing_anywhere():
            return fn(x, *params)
        return self._recorded_call(fn, x, *params)

    @torch.compiler.disable
    def _recorded_call(self, fn, x: torch.Tensor, *params: nn.Parameter | None) -> torch.Tensor:
        ctx = summing_context()
        if ctx is None or not any(p is not None and p.requires_grad for p in params):
            return fn(x, *params)
        out = fn(x, *(None if p is None else p.detach() for p in params))
        return ctx.tap(self, (x.detach(),), out)


def _per_example_index(idx: torch.Tensor, batch: int | None) -> torch.Tensor:
    """An index shared by the batch's examples, as each example's own: ``[1, T]`` (or a ``[T]`` whose length is not
    the batch size), as a positional embedding is looked up with, expanded to ``[B, T]`` (a view).

    The lookup's output is then ``[B, T, dim]``: added to the ``[B, T, dim]`` token embeddings it gives what the
    broadcast of ``[1, T, dim]`` gave, and its gradient's rows are the examples' own, so the position table's
    per-example gradients are exact, not their sum over the batch. A model that used the shared lookup in another way
    (``pos[0]``: now example 0's row, through which every example's gradient would flow) is refused by the row probe,
    which watches the layers' output-gradient rows (``fastdp.nn.rows``). A ``[T]`` index as long as the batch is
    ambiguous and taken as the batch's (one id per example); where it is a shared index after all, the row probe
    refuses it: pass it as ``[1, T]``."""
    if batch is None or batch < 2 or idx.dim() == 0 or idx.shape[0] == batch:
        return idx
    if idx.shape[0] == 1 and idx.dim() > 1:
        return idx.expand(batch, *idx.shape[1:])
    if idx.dim() == 1:
        return idx.unsqueeze(0).expand(batch, idx.shape[0])
    return idx


class Embedding(nn.Embedding, DPLayer):
    """``torch.nn.Embedding`` (dense gradients; ``padding_idx`` rows get none).

    Per-example norm, whichever is cheaper: the ghost norm over token matches,
    sum_{t,s} [idx_t == idx_s] <G_t, G_s> (T^2 dim work, vocabulary-free), or the per-example gradient's rows
    scattered by token id (V dim memory per example, kept for the clipped sum) when 64 V < T^2 and the B V dim
    tensor fits :data:`DIRECT_MEMORY_BUDGET`: its zero fill, scatter and norm are passes over memory, about 50 times
    a Gram product's multiply-add per element on CPU (measured, 2 threads: B 32 T 128 V 1000 dim 128, scatter 6.7 ms
    against 1.9 ms; GPT-2's V 50257 at B 8 T 1024 dim 768, 603 against 176 ms and 1.2 GB against none; the rule it
    replaces, 8 V < T^2, chose the scatter in both).
    """

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self._trains():
            return super().forward(idx)
        if self.sparse or self.max_norm is not None:
            raise ValueError("fastdp.nn.Embedding: sparse=True and max_norm are not supported in DP training")
        idx = _per_example_index(idx, ctx.batch)
        out = F.embedding(idx, self._detached("weight"), self.padding_idx)
        return ctx.tap(self, (idx,), out)

    def _tokens(self, idx: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = idx.reshape(idx.shape[0], math.prod(idx.shape[1:]))
        g = grad_out.reshape(idx.shape[0], idx.shape[1], grad_out.shape[-1])
        if self.padding_idx is not None:
            g = g * (idx != self.padding_idx).unsqueeze(-1).to(g.dtype)
        return idx, g

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        (idx,) = saved
        if not self.weight.requires_grad:
            return torch.zeros(idx.shape[0], dtype=torch.float64, device=idx.device)
        idx, g = self._tokens(idx, grad_out)
        b, t, dim = g.shape
        if _embedding_direct(b, t, self.num_embeddings, dim, g.element_size()):
            rows = (torch.arange(b, device=idx.device).unsqueeze(1) * self.num_embeddings + idx).reshape(-1)
            per_example = g.new_zeros(b * self.num_embeddings, dim).index_add_(0, rows, g.reshape(-1, dim))
            per_example = per_example.reshape(b, self.num_embeddings, dim)
            if cache is not None:
                cache["weight"] = per_example
            return _rowsq(per_example)
        return summation.clip_sq_up(*certified_token_match_norm_sq(idx, g))  # float64, rounding bounded

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """The rows of G scattered by token id (``fastdp.nn.forms``: the weight shared with other layer calls, e.g. a
        tied output layer)."""
        (idx,) = saved
        return [Rows(*self._tokens(idx, grad_out), self.num_embeddings)] if self.weight.requires_grad else []

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``P_ij = sum_t <g_t, v_j[idx_t]>``: the tangents' rows gathered by token, no [V, dim] per-example
        gradient; ``err = gamma_{T + dim + 2} max_j ||v_j|| sum_t |g_t|`` (see ``DPLayer``)."""
        (idx,) = saved
        idx, g = self._tokens(idx, grad_out)
        b, t, dim = g.shape
        g = g.to(torch.float64)
        (v,) = (tangent.to(torch.float64) for tangent in tangents)
        r = v.shape[0]
        p = torch.empty(b, r, dtype=torch.float64, device=g.device)
        rows = max(1, PROJECTION_CHUNK_ELEMENTS // max(1, r * t * dim))
        for start in range(0, b, rows):
            part = slice(start, start + rows)
            gathered = v[:, idx[part].reshape(-1)]  # [r, rows * T, dim]
            products = (gathered * g[part].reshape(1, -1, dim)).sum(2)
            p[part] = products.reshape(r, -1, t).sum(2).t()
        mass = _mass(None, g)
        v_norm = float(torch.linalg.vector_norm(v.reshape(r, -1), dim=1).max()) * (
            1 + rounding_gamma(v[0].numel() + 2, torch.float64)
        )
        err = rounding_gamma(t + dim + 2, torch.float64) * v_norm * mass
        return p, err, summation.mass_allowance(mass)

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        (idx,) = saved
        if not self.weight.requires_grad:
            return []
        if cache and "weight" in cache:
            return [summation.weighted_sum(factors, cache["weight"])]
        idx, g = self._tokens(idx, grad_out)
        scale = factors.repeat_interleave(idx.shape[1])
        return [summation.index_sum(idx.reshape(-1), g.reshape(-1, g.shape[-1]), self.num_embeddings, scale)]


class _AffineNorm(DPLayer):
    """Shared by LayerNorm/GroupNorm: y = x_hat * w + b with x_hat the normalised input, by torch's fused kernel with
    the affine parameters detached (the module's own forward, whose backward then gives x's gradient only; as a
    separate multiply and add it cost four more passes over the activation, 15 ms of a 360 ms ResNet-18-GN step).
    The input x is saved (the normalisation's autograd node holds it anyway) and x_hat recomputed from it, in the
    accumulation dtype, when the per-example weight gradients are formed: saving x_hat would keep one more
    activation-sized tensor per layer through the forward and backward."""

    # Subclasses define _normalise(x, weight, bias) (torch's functional norm) and _reduce(t).

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self._trains():
            return super().forward(x)
        weight = None if self.weight is None else self._detached("weight")
        bias = None if self.bias is None else self._detached("bias")
        return ctx.tap(self, (x.detach(),), self._normalise(x, weight, bias))

    def _per_example(self, saved, grad_out: torch.Tensor) -> list[torch.Tensor]:
        """Per-example gradients [B, *param.shape] of the trainable affine parameters (they are small)."""
        (x,) = saved
        acc = _acc(grad_out)
        grad_out = grad_out.to(acc)
        grads = []
        if self.weight is not None and self.weight.requires_grad:
            with torch.autocast(x.device.type, enabled=False):
                x_hat = self._normalise(x.to(acc))
            grads.append(self._reduce(grad_out * x_hat))
        if self.bias is not None and self.bias.requires_grad:
            grads.append(self._reduce(grad_out))
        return grads

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        grads = self._per_example(saved, grad_out)
        if cache is not None:
            cache["affine"] = grads
        return sum((_rowsq(g) for g in grads), torch.zeros(grad_out.shape[0], dtype=torch.float64,
                                                             device=grad_out.device))  # fmt: skip

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """The per-example affine gradients, formed (``fastdp.nn.forms``)."""
        return [Dense(g) for g in self._per_example(saved, grad_out)]

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-example affine gradients (small) are the very tensors summed: kept in ``cache`` and projected as
        they are (positions 0, see ``DPLayer``)."""
        grads = self._per_example(saved, grad_out)
        if cache is not None:
            cache["affine"] = grads

        def pieces(_saved, _grad_out):
            return [(t.to(torch.float64), _mass(None, t.reshape(t.shape[0], 1, -1).to(torch.float64)), 0)
                    for t in grads]  # fmt: skip

        return _projections(pieces, saved, grad_out, tangents, max(1, grad_out.shape[0]))

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        grads = cache["affine"] if cache and "affine" in cache else self._per_example(saved, grad_out)
        return [summation.weighted_sum(factors, g) for g in grads]


class LayerNorm(_AffineNorm, nn.LayerNorm):
    """``torch.nn.LayerNorm`` with per-example norms of its affine parameters."""

    def _normalise(self, x: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over every dimension but the batch and the normalised ones."""
        keep = len(self.normalized_shape)
        return (
            t.flatten(0, t.dim() - keep - 1).reshape(t.shape[0], -1, *t.shape[t.dim() - keep :]).sum(1)
            if t.shape[0]
            else t.new_zeros(0, *t.shape[t.dim() - keep :])
        )


class GroupNorm(_AffineNorm, nn.GroupNorm):
    """``torch.nn.GroupNorm`` (the DP-compatible replacement of BatchNorm) with per-example affine norms."""

    def _normalise(self, x: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
        return F.group_norm(x, self.num_groups, weight, bias, self.eps)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(2).sum(2)


class TransposedLinear(DPLayer):
    """A Linear whose weight is stored transposed, ``[in, out]``: HuggingFace's ``transformers.pytorch_utils.Conv1D``
    (GPT-2's attention and MLP projections; ``y = x @ weight + bias`` over the last dimension). Mixed into the
    module's own class by :func:`fastdp.nn.convert` (transformers is never imported here). The per-example norms,
    clipped sums and JL projections are the DP :class:`Linear`'s, on the transposed view of the weight: its
    clipped sum is transposed back into the module's ``[in, out]`` layout, its tangents transposed into Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self._trains():
            return super().forward(x)
        out = F.linear(x, self._detached("weight").t(), self._detached("bias"))
        return ctx.tap(self, (_as_consumed(x),), out)

    _flat = staticmethod(Linear._flat)
    _per_example64 = Linear._per_example64
    per_example_sq_norms = Linear.per_example_sq_norms  # a squared norm is the same for a transposed matrix

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """Linear's forms with the weight's factors swapped: ``sum_t a_t g_t^T`` in the ``[in, out]`` layout."""
        forms = Linear.per_example_forms(self, saved, grad_out)
        if self.weight.requires_grad:
            forms[0] = Outer(forms[0].right, forms[0].left)
        return forms

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Linear's projections with the weight's tangents [r, in, out] seen as [r, out, in] (a view)."""
        if self.weight.requires_grad:
            tangents = [tangents[0].transpose(1, 2), *tangents[1:]]
        return Linear.per_example_projections(self, saved, grad_out, tangents, cache)

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        sums = Linear.clipped_grad_sums(self, saved, grad_out, factors, cache)
        if self.weight.requires_grad:
            sums[0] = sums[0].t().contiguous()  # [out, in] -> the weight's [in, out]
        return sums


# torch module type -> its DP layer; convert() swaps classes in place (no state is added).
DP_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Linear,
    nn.Conv1d: Conv1d,
    nn.Conv2d: Conv2d,
    nn.Embedding: Embedding,
    nn.LayerNorm: LayerNorm,
    nn.GroupNorm: GroupNorm,
}

# Classes recognised by where they are defined, never imported: (module, qualname) -> the DP mixin.
KNOWN_LAYERS: dict[tuple[str, str], type[DPLayer]] = {
    ("transformers.pytorch_utils", "Conv1D"): TransposedLinear,
}

# Methods a subclass may not override to be converted: they decide what the layer computes, which the DP layer's
# own forward (inside a DP step) and its per-example norms take to be the base layer's.
FORWARD_METHODS = ("forward", "_conv_forward", "__call__", "_call_impl")

_SUBCLASSES: dict[tuple[type, type], type] = {}


def attention_projections(model: nn.Module) -> set[int]:
    """``id``s of the output projections (``out_proj``) of ``model``'s ``nn.MultiheadAttention`` modules that are
    neither fastdp's DP attention nor converted to it by :func:`fastdp.nn.convert` (a subclass that overrides
    ``forward``): torch's attention reads their weights directly and never calls them, so ``convert`` leaves them as
    they are (refused where trainable)."""
    return {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)
            and not isinstance(m, DPLayer) and conversion(m)[0] is None}  # fmt: skip


def _supported_base(cls: type) -> tuple[type | None, type | None]:
    """(the supported layer class ``cls`` is or derives from, nearest first; its DP layer or mixin), or (None, None)."""
    for klass in cls.__mro__:
        if klass in DP_LAYERS:
            return klass, DP_LAYERS[klass]
        known = KNOWN_LAYERS.get((klass.__module__, klass.__qualname__))
        if known is not None:
            return klass, known
    return None, None


def conversion(module: nn.Module) -> tuple[type | None, str | None]:
    """(the class :func:`fastdp.nn.convert` gives ``module``, or None; why it cannot, where ``module`` is a layer
    of a supported kind that is not converted, else None).

    An exact supported torch type gets its DP layer. A strict subclass of one (``NonDynamicallyQuantizableLinear``,
    a user's subclass adding attributes or methods), or HF's ``Conv1D`` and its subclasses, gets a class derived
    from (the DP layer, its own class), made once per class: its own attributes and methods stay, ``isinstance``
    with its class stays true, parameters and ``state_dict`` are untouched. Refused: a subclass overriding one of
    :data:`FORWARD_METHODS` (its output need not be the base layer's), a lazy module not yet initialised, and a
    parametrized layer (``torch.nn.utils.parametrize``: its weight is computed from other parameters)."""
    if isinstance(module, DPLayer):
        return None, None
    cls = type(module)
    base, dp = _supported_base(cls)
    if base is None:
        return None, None
    hooked = [type(hook).__name__ for hook in module._forward_pre_hooks.values()
              if isinstance(hook, (WeightNorm, SpectralNorm))]  # fmt: skip
    if hooked:
        return None, (
            f"a {base.__name__} whose weight a {hooked[0]} hook computes before each forward (the old-style "
            f"torch.nn.utils.{'weight_norm' if hooked[0] == 'WeightNorm' else 'spectral_norm'}) from parameters the "
            f"{base.__name__}'s per-example norms do not cover; remove it (torch.nn.utils.remove_"
            f"{'weight_norm' if hooked[0] == 'WeightNorm' else 'spectral_norm'}) or train a plain {base.__name__}"
        )
    if base is cls and base in DP_LAYERS:
        return dp, None
    shown = f"{base.__module__}.{base.__qualname__}"
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return None, f"a lazy {base.__name__} not yet initialised: run one forward before fastdp.nn.convert"
    if torch.nn.utils.parametrize.is_parametrized(module):
        return None, (
            f"a parametrized {base.__name__} (torch.nn.utils.parametrize): its weight is computed from parameters "
            "of another module, which no per-example norm of the layer covers"
        )
    overridden = [name for klass in cls.__mro__[: cls.__mro__.index(base)] for name in FORWARD_METHODS
                  if name in vars(klass)]  # fmt: skip
    if overridden:
        return None, (
            f"a subclass of {shown} that overrides {', '.join(dict.fromkeys(overridden))}: its output need not be "
            f"the {base.__name__}'s, so the {base.__name__}'s per-example norms need not be its gradients'; compute "
            f"it with {base.__name__} layers it calls (or a plain {base.__name__})"
        )
    return _converted_class(dp, cls), None


def _converted_class(dp: type, cls: type) -> type:
    """The class derived from (``dp``, ``cls``), made once: named as ``cls`` (errors and ``repr`` show the user's
    class), pickled through :func:`_reduce_converted`."""
    made = _SUBCLASSES.get((dp, cls))
    if made is None:
        made = type(cls.__name__, (dp, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce_ex__": _reduce_converted,
            "_fastdp_origin": (dp, cls),
        })  # fmt: skip
        _SUBCLASSES[(dp, cls)] = made
    return made


def _reduce_converted(self: nn.Module, protocol: int):
    """Pickling (torch.save, copy.deepcopy) of a module of a class made by :func:`conversion`: the class is rebuilt
    from (the DP layer, the module's own class), both importable, then the state is set as for any module."""
    return _converted_instance, type(self)._fastdp_origin, self.__getstate__()


def _converted_instance(dp: type, cls: type) -> nn.Module:
    return object.__new__(_converted_class(dp, cls))
