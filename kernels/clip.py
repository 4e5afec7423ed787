"""Triton kernels of per-example row clipping (math: ``fastdp/ref/clip.py``).

A row (one example) is a contiguous [C, P] block of x [B, C, P]: ``"l2"`` takes the norm over all C * P entries,
``"l15"`` the L2 norm over channels of the L1 norms over positions. The launchers see a row as ``UNITS`` units of
``UNIT_LEN`` contiguous elements (l2: elements, UNIT_LEN = 1; l15: channels, UNIT_LEN = P), so that a chunk of
units is a contiguous range of elements and an l15 channel is never split between programs.

Forward ``y_b = s_b x_b``, ``s_b = min(1, C / max(n_b, TINY))``; backward, for the upstream gradient g,
``dx_b = s_b g_b - [active] (s_b / n_b) (<g_b, x_b> / n_b) d_b`` with ``d_b = x_b`` (l2) or
``(sum_p |x_bcp|) sign(x_bcp)`` (l15). fp32 math (loads upcast, IEEE sqrt and division), one rounding to the
output dtype; NaN propagates (``ratio > 1`` is false for NaN, so a NaN row keeps a NaN scale).

Three modes, chosen by the launcher from the row size and the row count:

* ``MODE_ONE_BLOCK`` (rows up to ``ONE_BLOCK_MAX`` elements, padded to powers of two): one program per row holds
  the row (and its gradient) in registers: one read of x, one write of y, no intermediate in memory.
* ``MODE_ROW`` (larger rows, many of them): one program per row loops over the row twice (norm, then scale);
  the second read mostly hits L2.
* ``MODE_SPLIT`` (larger rows, fewer than ``SPLIT_ROWS_PER_SM`` per SM): a row is split into chunks of about
  ``CHUNK`` elements; ``_clip_rows_partial_kernel`` writes one fp32 partial (norm^2, and <g, x> for the
  backward) per chunk, then each chunk's program adds its row's partials in a fixed order (deterministic, no
  atomics) and scales its chunk. The partials ([B, chunks] floats) are the only intermediate.

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores); nothing
measured on a GPU yet. Clipping rows reads each row for its norm and again to scale it, and writes it: 12 bytes per
float32 element (6 for bf16) with rows re-read from HBM, 8 bytes where a row stays on chip between the passes (the
two-pass design owed): 12N / 3.0 TB/s now, 8N / 3.0 TB/s as the target. The backward reads g and x and writes dx: 12
bytes per float32 element at best. Target: >= 80 % of the floor.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

ONE_BLOCK_MAX = 8192  # elements (padded tile) of a row one program keeps in registers
BLOCK = 1024  # elements per loop step of MODE_ROW / MODE_SPLIT
CHUNK = 16384  # elements per program of MODE_SPLIT (about; whole l15 channels)
SPLIT_ROWS_PER_SM = 4  # MODE_SPLIT when there are fewer rows than this many per SM
INTERPRET_SMS = 1  # "SMs" of the CPU interpreter
TINY = 1e-12
MODE_ONE_BLOCK, MODE_ROW, MODE_SPLIT = 0, 1, 2


@triton.jit
def _clip_scale(norm_sq, bound, TINY: tl.constexpr):
    """(norm, scale, active) of a row from its squared norm: scale = min(1, bound / max(norm, TINY)), NaN kept."""
    norm = tl.sqrt_rn(norm_sq)
    clamped = tl.where(norm < TINY, TINY, norm)  # NaN < TINY is false: NaN stays NaN
    ratio = tl.div_rn(tl.zeros_like(clamped) + bound, clamped)
    scale = tl.where(ratio > 1.0, 1.0, ratio)  # NaN > 1 is false: NaN stays NaN
    active = (ratio <= 1.0) & (norm >= TINY)
    return norm, scale, active


@triton.jit
def _range_sums(
    x_row,  # pointer to the row's first element
    g_row,  # pointer to the row of the upstream gradient (read only if WITH_DOT)
    lo,  # first unit of the range
    hi,  # one past the last unit
    UNIT_LEN,  # elements per unit (1 for l2, P for l15)
    L15: tl.constexpr,
    WITH_DOT: tl.constexpr,  # also compute <g, x> over the range
    BLOCK_C: tl.constexpr,  # l15: channels per tile
    BLOCK_P: tl.constexpr,  # l15: positions per tile; l2: BLOCK_C * BLOCK_P elements per step
):
    """(norm^2 contribution, <g, x>) of units [lo, hi): sum x^2 (l2) or sum_c (sum_p |x_cp|)^2 (l15), fp32."""
    if L15:
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        dot = tl.zeros([BLOCK_C, BLOCK_P], dtype=tl.float32)
        for c0 in range(lo, hi, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
            l1 = tl.zeros([BLOCK_C], dtype=tl.float32)
            for p0 in range(0, UNIT_LEN, BLOCK_P):
                ps = p0 + tl.arange(0, BLOCK_P)
                mask = (cs < hi)[:, None] & (ps < UNIT_LEN)[None, :]
                offs = cs[:, None] * UNIT_LEN + ps[None, :]
                v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                l1 += tl.sum(tl.abs(v), axis=1)
                if WITH_DOT:
                    dot += tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32) * v
            acc += l1 * l1
        norm_sq = tl.sum(acc, axis=0)
        dot_sum = tl.sum(tl.sum(dot, axis=1), axis=0)
    else:
        acc = tl.zeros([BLOCK_C * BLOCK_P], dtype=tl.float32)
        dot = tl.zeros([BLOCK_C * BLOCK_P], dtype=tl.float32)
        for i in range(lo, hi, BLOCK_C * BLOCK_P):
            offs = i + tl.arange(0, BLOCK_C * BLOCK_P).to(tl.int64)
            mask = offs < hi
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            acc += v * v
            if WITH_DOT:
                dot += tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32) * v
        norm_sq = tl.sum(acc, axis=0)
        dot_sum = tl.sum(dot, axis=0)
    return norm_sq, dot_sum


@triton.jit
def _row_totals(
    x_row,
    g_row,
    partial_ptr,  # fp32 [B * NUM_CHUNKS * STRIDE] partials of MODE_SPLIT
    row,  # int64 row index
    UNITS,  # units per row
    UNIT_LEN,
    NUM_CHUNKS,
    MODE: tl.constexpr,
    L15: tl.constexpr,
    WITH_DOT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,  # power of two >= NUM_CHUNKS
):
    """(norm^2, <g, x>) of a whole row: summed here (MODE_ROW) or from its chunks' partials in order (MODE_SPLIT)."""
    if MODE == 1:
        norm_sq, dot = _range_sums(x_row, g_row, 0, UNITS, UNIT_LEN, L15, WITH_DOT, BLOCK_C, BLOCK_P)
    else:
        ks = tl.arange(0, CHUNKS_BLOCK)
        mask = ks < NUM_CHUNKS
        if WITH_DOT:  # partials [B * NUM_CHUNKS, 2]
            base = partial_ptr + row * NUM_CHUNKS * 2
            norm_sq = tl.sum(tl.load(base + 2 * ks, mask=mask, other=0.0), axis=0)
            dot = tl.sum(tl.load(base + 2 * ks + 1, mask=mask, other=0.0), axis=0)
        else:  # partials [B * NUM_CHUNKS]
            norm_sq = tl.sum(tl.load(partial_ptr + row * NUM_CHUNKS + ks, mask=mask, other=0.0), axis=0)
            dot = norm_sq * 0.0
    return norm_sq, dot


@triton.jit
def _clip_rows_partial_kernel(
    x_ptr,  # [B, UNITS * UNIT_LEN] input (fp32, fp16 or bf16), contiguous
    g_ptr,  # same shape and dtype: upstream gradient (read only if WITH_DOT)
    partial_ptr,  # fp32 [B * NUM_CHUNKS, 2 if WITH_DOT else 1]: out
    UNITS,  # units per row
    UNIT_LEN,  # elements per unit
    UNITS_PER_CHUNK,  # units per program
    NUM_CHUNKS,  # programs per row
    L15: tl.constexpr,
    WITH_DOT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """MODE_SPLIT, first launch: program (row, chunk) writes its chunk's norm^2 contribution (and <g, x>)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NUM_CHUNKS
    lo = (pid % NUM_CHUNKS) * UNITS_PER_CHUNK
    hi = tl.minimum(lo + UNITS_PER_CHUNK, UNITS)
    row_len = tl.cast(UNITS, tl.int64) * UNIT_LEN
    norm_sq, dot = _range_sums(
        x_ptr + row * row_len, g_ptr + row * row_len, lo, hi, UNIT_LEN, L15, WITH_DOT, BLOCK_C, BLOCK_P
    )
    if WITH_DOT:
        tl.store(partial_ptr + 2 * pid, norm_sq)
        tl.store(partial_ptr + 2 * pid + 1, dot)
    else:
        tl.store(partial_ptr + pid, norm_sq)


@triton.jit
def _clip_rows_kernel(
    x_ptr,  # [B, UNITS * UNIT_LEN] input (fp32, fp16 or bf16), contiguous
    y_ptr,  # same shape and dtype: out, the clipped rows
    partial_ptr,  # fp32 [B * NUM_CHUNKS] partials (MODE_SPLIT only)
    UNITS,  # units per row
    UNIT_LEN,  # elements per unit
    UNITS_PER_CHUNK,  # units per program (UNITS unless MODE_SPLIT)
    NUM_CHUNKS,  # programs per row (1 unless MODE_SPLIT)
    bound,  # fp32 clip bound C > 0
    MODE: tl.constexpr,  # MODE_ONE_BLOCK, MODE_ROW or MODE_SPLIT
    L15: tl.constexpr,  # l15 norm (else l2)
    BLOCK_C: tl.constexpr,  # MODE_ONE_BLOCK: the whole row's tile is [BLOCK_C, BLOCK_P]; else the loop tile
    BLOCK_P: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,  # power of two >= NUM_CHUNKS (MODE_SPLIT)
    TINY: tl.constexpr,
):
    """y = min(1, bound / max(||x_row||, TINY)) x_row for program (row, chunk)'s units."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NUM_CHUNKS
    row_len = tl.cast(UNITS, tl.int64) * UNIT_LEN
    x_row = x_ptr + row * row_len
    y_row = y_ptr + row * row_len
    if MODE == 0:
        if L15:
            cs = tl.arange(0, BLOCK_C)
            ps = tl.arange(0, BLOCK_P)
            mask = (cs < UNITS)[:, None] & (ps < UNIT_LEN)[None, :]
            offs = cs[:, None] * UNIT_LEN + ps[None, :]
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            l1 = tl.sum(tl.abs(v), axis=1)
            _, scale, _ = _clip_scale(tl.sum(l1 * l1, axis=0), bound, TINY)
        else:
            offs = tl.arange(0, BLOCK_C * BLOCK_P)
            mask = offs < UNITS
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            _, scale, _ = _clip_scale(tl.sum(v * v, axis=0), bound, TINY)
        tl.store(y_row + offs, (v * scale).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        norm_sq, _ = _row_totals(
            x_row, x_row, partial_ptr, row, UNITS, UNIT_LEN, NUM_CHUNKS, MODE, L15, False, BLOCK_C, BLOCK_P,
            CHUNKS_BLOCK,
        )  # fmt: skip
        _, scale, _ = _clip_scale(norm_sq, bound, TINY)
        lo = (pid % NUM_CHUNKS) * UNITS_PER_CHUNK * UNIT_LEN  # a chunk is a contiguous range of elements
        hi = tl.minimum(lo + UNITS_PER_CHUNK * UNIT_LEN, row_len)
        for i in range(lo, hi, BLOCK_C * BLOCK_P):
            offs = i + tl.arange(0, BLOCK_C * BLOCK_P).to(tl.int64)
            mask = offs < hi
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, (v * scale).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clip_rows_backward_kernel(
    g_ptr,  # [B, UNITS * UNIT_LEN] upstream gradient (dtype of x), contiguous
    x_ptr,  # [B, UNITS * UNIT_LEN] the clip's input (fp32, fp16 or bf16), contiguous
    dx_ptr,  # same shape and dtype as x: out, the gradient w.r.t. x
    partial_ptr,  # fp32 [B * NUM_CHUNKS, 2] partials (norm^2, <g, x>) (MODE_SPLIT only)
    UNITS,
    UNIT_LEN,
    UNITS_PER_CHUNK,
    NUM_CHUNKS,
    bound,  # fp32 clip bound C > 0
    MODE: tl.constexpr,
    L15: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
    TINY: tl.constexpr,
):
    """dx = s g - [active] (s / n) (<g, x> / n) d for program (row, chunk)'s units (d = x, or l1_c sign(x))."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // NUM_CHUNKS
    row_len = tl.cast(UNITS, tl.int64) * UNIT_LEN
    x_row = x_ptr + row * row_len
    g_row = g_ptr + row * row_len
    dx_row = dx_ptr + row * row_len
    if MODE == 0:
        if L15:
            cs = tl.arange(0, BLOCK_C)
            ps = tl.arange(0, BLOCK_P)
            mask = (cs < UNITS)[:, None] & (ps < UNIT_LEN)[None, :]
            offs = cs[:, None] * UNIT_LEN + ps[None, :]
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
            l1 = tl.sum(tl.abs(v), axis=1)
            norm, scale, active = _clip_scale(tl.sum(l1 * l1, axis=0), bound, TINY)
            sign = tl.where(v > 0, 1.0, tl.where(v < 0, -1.0, 0.0))
            direction = l1[:, None] * sign
            dot = tl.sum(tl.sum(g * v, axis=1), axis=0)
        else:
            offs = tl.arange(0, BLOCK_C * BLOCK_P)
            mask = offs < UNITS
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
            norm, scale, active = _clip_scale(tl.sum(v * v, axis=0), bound, TINY)
            direction = v
            dot = tl.sum(g * v, axis=0)
        coef = tl.where(active, tl.div_rn(scale, norm) * tl.div_rn(dot, norm), 0.0)
        tl.store(dx_row + offs, (scale * g - coef * direction).to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        norm_sq, dot = _row_totals(
            x_row, g_row, partial_ptr, row, UNITS, UNIT_LEN, NUM_CHUNKS, MODE, L15, True, BLOCK_C, BLOCK_P,
            CHUNKS_BLOCK,
        )  # fmt: skip
        norm, scale, active = _clip_scale(norm_sq, bound, TINY)
        coef = tl.where(active, tl.div_rn(scale, norm) * tl.div_rn(dot, norm), 0.0)
        lo = (pid % NUM_CHUNKS) * UNITS_PER_CHUNK
        hi = tl.minimum(lo + UNITS_PER_CHUNK, UNITS)
        if L15:
            for c0 in range(lo, hi, BLOCK_C):  # per channel block: its L1 norms, then its gradient
                cs = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
                l1 = tl.zeros([BLOCK_C], dtype=tl.float32)
                for p0 in range(0, UNIT_LEN, BLOCK_P):
                    ps = p0 + tl.arange(0, BLOCK_P)
                    mask = (cs < hi)[:, None] & (ps < UNIT_LEN)[None, :]
                    v = tl.load(x_row + cs[:, None] * UNIT_LEN + ps[None, :], mask=mask, other=0.0).to(tl.float32)
                    l1 += tl.sum(tl.abs(v), axis=1)
                for p0 in range(0, UNIT_LEN, BLOCK_P):
                    ps = p0 + tl.arange(0, BLOCK_P)
                    mask = (cs < hi)[:, None] & (ps < UNIT_LEN)[None, :]
                    offs = cs[:, None] * UNIT_LEN + ps[None, :]
                    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                    g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
                    sign = tl.where(v > 0, 1.0, tl.where(v < 0, -1.0, 0.0))
                    dx = scale * g - coef * (l1[:, None] * sign)
                    tl.store(dx_row + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            for i in range(lo, hi, BLOCK_C * BLOCK_P):
                offs = i + tl.arange(0, BLOCK_C * BLOCK_P).to(tl.int64)
                mask = offs < hi
                v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_row + offs, (scale * g - coef * v).to(dx_ptr.dtype.element_ty), mask=mask)


def _device_guard(x: torch.Tensor):
    """Triton launches on the current device's stream: make x's device current."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRET_SMS


def plan(shape: tuple[int, int, int], l15: bool, device: torch.device, one_block_max: int | None = None,
         chunk: int | None = None, split_rows: int | None = None) -> dict:  # fmt: skip
    """Launch plan for a [B, C, P] tensor: mode, tile, units and chunks (see the module docstring).

    ``one_block_max``, ``chunk`` and ``split_rows`` override ``ONE_BLOCK_MAX``, ``CHUNK`` and the SM-based row
    threshold (tests use them to reach every mode with small tensors).
    """
    rows, channels, positions = shape
    one_block_max = ONE_BLOCK_MAX if one_block_max is None else one_block_max
    chunk = CHUNK if chunk is None else chunk
    split_rows = SPLIT_ROWS_PER_SM * _num_sms(device) if split_rows is None else split_rows
    units, unit_len = (channels, positions) if l15 else (channels * positions, 1)
    if l15:
        tile = (triton.next_power_of_2(channels), triton.next_power_of_2(positions))
    else:
        tile = (1, triton.next_power_of_2(units))
    if tile[0] * tile[1] <= one_block_max:
        return dict(mode=MODE_ONE_BLOCK, tile=tile, units=units, unit_len=unit_len, units_per_chunk=units, chunks=1)
    if l15:
        block_p = min(triton.next_power_of_2(positions), BLOCK)
        tile = (max(1, BLOCK // block_p), block_p)
        step = tile[0]  # units (channels) per loop step
    else:
        tile = (1, BLOCK)
        step = BLOCK
    units_per_chunk = max(step, chunk // unit_len // step * step)
    chunks = triton.cdiv(units, units_per_chunk)
    if chunks == 1 or rows >= split_rows:
        return dict(mode=MODE_ROW, tile=tile, units=units, unit_len=unit_len, units_per_chunk=units, chunks=1)
    return dict(mode=MODE_SPLIT, tile=tile, units=units, unit_len=unit_len, units_per_chunk=units_per_chunk,
                chunks=chunks)  # fmt: skip


def _num_warps(p: dict) -> int:
    elements = p["tile"][0] * p["tile"][1]
    return min(8, max(1, elements // 512)) if p["mode"] == MODE_ONE_BLOCK else 4


def _launch(kernel, partial_kernel, tensors, out, bound, l15, with_dot, p):
    """Partials (MODE_SPLIT), then the main kernel over rows (or row chunks)."""
    rows = out.shape[0]
    grid = (rows * p["chunks"],)
    partial = torch.empty(rows * p["chunks"] * (2 if with_dot else 1), device=out.device, dtype=torch.float32)
    block_c, block_p = p["tile"]
    geometry = (p["units"], p["unit_len"], p["units_per_chunk"], p["chunks"])
    with _device_guard(out):
        if p["mode"] == MODE_SPLIT:
            g, x = tensors if with_dot else (tensors[0], tensors[0])
            partial_kernel[grid](x, g, partial, *geometry, L15=l15, WITH_DOT=with_dot, BLOCK_C=block_c,
                                 BLOCK_P=block_p, num_warps=4)  # fmt: skip
        kernel[grid](
            *tensors, out, partial, *geometry, float(bound), MODE=p["mode"], L15=l15, BLOCK_C=block_c,
            BLOCK_P=block_p, CHUNKS_BLOCK=triton.next_power_of_2(p["chunks"]), TINY=TINY, num_warps=_num_warps(p),
        )  # fmt: skip
    return out


def clip_rows(x: torch.Tensor, bound: float, l15: bool, **plan_overrides) -> torch.Tensor:
    """Clipped rows of a contiguous [B, C, P] tensor (fp32, fp16 or bf16; checked by ``fastdp.ops.clip``)."""
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    p = plan(tuple(x.shape), l15, x.device, **plan_overrides)
    return _launch(_clip_rows_kernel, _clip_rows_partial_kernel, (x,), y, bound, l15, False, p)


def clip_rows_backward(grad: torch.Tensor, x: torch.Tensor, bound: float, l15: bool, **plan_overrides) -> torch.Tensor:
    """Gradient w.r.t. x of ``clip_rows`` for the upstream ``grad``; both contiguous [B, C, P], one dtype."""
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx
    p = plan(tuple(x.shape), l15, x.device, **plan_overrides)
    return _launch(_clip_rows_backward_kernel, _clip_rows_partial_kernel, (grad, x), dx, bound, l15, True, p)


def hopper_compile_specs():
    """(kernel, signature, constexprs) of every kernel here, for the sm_90 compile check."""
    geometry = {"UNITS": "i32", "UNIT_LEN": "i32", "UNITS_PER_CHUNK": "i32", "NUM_CHUNKS": "i32"}
    specs = []
    for ptr in ("*fp32", "*fp16", "*bf16"):
        for l15 in (False, True):
            loop_tile = (64, 16) if l15 else (1, BLOCK)
            one_tile = (64, 128) if l15 else (1, ONE_BLOCK_MAX)
            for with_dot in (False, True):
                specs.append(
                    (
                        _clip_rows_partial_kernel,
                        {"x_ptr": ptr, "g_ptr": ptr, "partial_ptr": "*fp32", **geometry},
                        {"L15": l15, "WITH_DOT": with_dot, "BLOCK_C": loop_tile[0], "BLOCK_P": loop_tile[1]},
                    )
                )
            for mode, tile in ((MODE_ONE_BLOCK, one_tile), (MODE_ROW, loop_tile), (MODE_SPLIT, loop_tile)):
                constexprs = {"MODE": mode, "L15": l15, "BLOCK_C": tile[0], "BLOCK_P": tile[1], "CHUNKS_BLOCK": 64,
                              "TINY": TINY}  # fmt: skip
                launch = {"num_warps": _num_warps(dict(mode=mode, tile=tile))}  # as _launch passes it
                specs.append(
                    (
                        _clip_rows_kernel,
                        {"x_ptr": ptr, "y_ptr": ptr, "partial_ptr": "*fp32", **geometry, "bound": "fp32"},
                        constexprs,
                        launch,
                    )
                )
                specs.append(
                    (
                        _clip_rows_backward_kernel,
                        {"g_ptr": ptr, "x_ptr": ptr, "dx_ptr": ptr, "partial_ptr": "*fp32", **geometry,
                         "bound": "fp32"},
                        constexprs,
                        launch,
                    )
                )  # fmt: skip
    return specs
