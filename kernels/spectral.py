"""Triton kernel of the batched power iteration (math: ``fastdp/ref/spectral.py``).

For each matrix W_l [m_l, n_l] and unit right vector u_l, ``iters`` steps of

    v <- W u / ||W u||,    u <- W^T v / ||W^T v||,    sigma_hat = ||W^T v||   (last step)

in fp32 (tiles of W upcast on load; vectors kept in fp32).

No pointer tables (so the same path runs under ``TRITON_INTERPRET=1``): the host packs the matrices into one
flat buffer (one copy, 1/(2 iters) of the kernel's reads) and passes int64 offset tables. The vectors live in flat
fp32 buffers. Norms are carried as scale factors and applied on the next read, so each step reads W twice and
writes u and v once. Two paths, same math (fp32, masked [BLOCK_M, BLOCK_N] tiles), chosen per matrix:

* ``_power_iteration_kernel`` — matrices of at most ``SPLIT_MIN_NUMEL`` elements, ONE launch for all of them
  and every step: program l runs matrix l (block-wide barriers between the half-steps). Launch latency, not
  bandwidth, is what such matrices cost.
* ``_split_step_kernel`` + ``_split_finish_kernel`` — larger matrices use the whole GPU: each is cut into
  regions of ``[RM, RN]`` (multiples of the tile, chosen from the shape alone so that a matrix gets about
  ``TARGET_PROGRAMS`` regions: the result does not depend on the GPU), one program per region, all matrices
  in one launch per half-step (2 iters + 1 launches). A program multiplies its region (``v_part[j] = W[i, j]
  u[j]``, or ``u_part[i] = W[i, j]^T v[i]`` when transposed) into a partial buffer, then increments its
  row (column) region's arrival counter; the program that arrives last sums the partials in a fixed order
  (j = 0, 1, ...), writes the vector's block and the block's sum of squares, and resets the counter (the
  serial split-K reduction: deterministic, no second launch). The next launch sums the blocks' squares in a
  fixed order for the scale. Partials cost 1/RN + 1/RM of W's traffic.

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores); nothing
measured on a GPU yet. Each iteration reads W twice (W u and W^T v): 2 m n elements, so for a 4096 x 4096 float32
matrix 134 MB, 45 us per iteration at 3.0 TB/s. One program per matrix gets one SM's bandwidth, about 1/132 of
that: matrices above ``SPLIT_MIN_NUMEL`` elements take the split path (512 regions of 256 x 128 for 4096 x 4096,
two launches per iteration, about 3 us of launch latency each). Target: >= 2x a plain torch loop for n <= 1024
with no host synchronisation, then >= 50 % of the bandwidth floor for large matrices.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from fastdp.kernels import device_table

BLOCK_M = 32  # rows of a W tile
BLOCK_N = 128  # columns of a W tile
NUM_WARPS = 4
EPS = 1e-12  # normalize(x) = x / max(||x||, EPS), as the reference
SPLIT_MIN_NUMEL = 128 * 128  # larger matrices take the split path (read at call time: tests lower it)
TARGET_PROGRAMS = 512  # regions per matrix on the split path (about 4 per SM of an H100)
SPLIT_META = 12  # columns of the split path's per-matrix table (``_split_plan``)
FINISH_BLOCK = 1024  # vector elements per tile of ``_split_finish_kernel``


@triton.jit
def _power_iteration_kernel(
    w_ptr,  # flat buffer: matrix l row-major at w_offs[l] (fp32, fp16 or bf16)
    u_ptr,  # fp32 flat buffer: u_l at u_offs[l] (unit norm on entry; the new u on exit)
    v_ptr,  # fp32 flat buffer: v_l at v_offs[l] (written)
    sigma_ptr,  # fp32 [L]: sigma_hat_l (written)
    meta_ptr,  # int64 [5, L]: w_offs, u_offs, v_offs, rows m, columns n
    num_layers,  # L
    iters,  # power-iteration steps (>= 1)
    EPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program l: ``iters`` power-iteration steps on matrix l (module docstring)."""
    layer = tl.program_id(0).to(tl.int64)
    w_base = w_ptr + tl.load(meta_ptr + layer)
    u_base = u_ptr + tl.load(meta_ptr + num_layers + layer)
    v_base = v_ptr + tl.load(meta_ptr + 2 * num_layers + layer)
    m = tl.load(meta_ptr + 3 * num_layers + layer)
    n = tl.load(meta_ptr + 4 * num_layers + layer)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    scale_u = tl.cast(1.0, tl.float32)  # u_true = scale_u * stored u
    scale_v = tl.cast(1.0, tl.float32)  # v_true = scale_v * stored v
    sigma = tl.cast(0.0, tl.float32)
    for _ in range(iters):
        # v = W u (unnormalised), ||v||^2
        sum_sq = tl.cast(0.0, tl.float32)
        for r0 in range(0, m, BLOCK_M):
            r = r0 + rows
            mask_r = r < m
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in range(0, n, BLOCK_N):
                c = c0 + cols
                mask_c = c < n
                tile = tl.load(w_base + r[:, None] * n + c[None, :], mask=mask_r[:, None] & mask_c[None, :],
                               other=0.0).to(tl.float32)  # fmt: skip
                u = tl.load(u_base + c, mask=mask_c, other=0.0)
                acc += tl.sum(tile * u[None, :], axis=1)
            acc = acc * scale_u
            tl.store(v_base + r, acc, mask=mask_r)
            sum_sq += tl.sum(acc * acc)
        tl.debug_barrier()  # v visible to every thread of the program
        scale_v = tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(sum_sq), EPS))  # IEEE, as sqrtf and / in spectral.cu
        # u = W^T v (unnormalised), ||u||^2 = sigma_hat^2
        sum_sq = tl.cast(0.0, tl.float32)
        for c0 in range(0, n, BLOCK_N):
            c = c0 + cols
            mask_c = c < n
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r0 in range(0, m, BLOCK_M):
                r = r0 + rows
                mask_r = r < m
                tile = tl.load(w_base + r[:, None] * n + c[None, :], mask=mask_r[:, None] & mask_c[None, :],
                               other=0.0).to(tl.float32)  # fmt: skip
                v = tl.load(v_base + r, mask=mask_r, other=0.0)
                acc += tl.sum(tile * v[:, None], axis=0)
            acc = acc * scale_v
            tl.store(u_base + c, acc, mask=mask_c)
            sum_sq += tl.sum(acc * acc)
        tl.debug_barrier()  # u visible to every thread of the program
        sigma = tl.sqrt_rn(sum_sq)
        scale_u = tl.div_rn(1.0, tl.maximum(sigma, EPS))
    # Apply the last scales: unit u and v.
    for r0 in range(0, m, BLOCK_M):
        r = r0 + rows
        mask_r = r < m
        tl.store(v_base + r, tl.load(v_base + r, mask=mask_r, other=0.0) * scale_v, mask=mask_r)
    for c0 in range(0, n, BLOCK_N):
        c = c0 + cols
        mask_c = c < n
        tl.store(u_base + c, tl.load(u_base + c, mask=mask_c, other=0.0) * scale_u, mask=mask_c)
    tl.store(sigma_ptr + layer, sigma)


@triton.jit
def _sum_blocks(ptr, count, BLOCK: tl.constexpr):
    """sum(ptr[0:count]) in a fixed order (the same in every program)."""
    offs = tl.arange(0, BLOCK)
    total = tl.cast(0.0, tl.float32)
    for k0 in range(0, count, BLOCK):
        total += tl.sum(tl.load(ptr + k0 + offs, mask=k0 + offs < count, other=0.0))
    return total


@triton.jit
def _sum_partials(part, stride, count, out, lo, hi, BLOCK: tl.constexpr):
    """out[lo:hi] = sum over k = 0, 1, ..., count - 1 of part[k * stride + lo:hi] (in that order; the other programs'
    partials read past L1); returns the sum of squares of out[lo:hi]."""
    offs = tl.arange(0, BLOCK).to(tl.int64)
    sum_sq = tl.cast(0.0, tl.float32)
    for x0 in range(lo, hi, BLOCK):
        x = x0 + offs
        mask = x < hi
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, count):
            acc += tl.load(part + k * stride + x, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out + x, acc, mask=mask)
        sum_sq += tl.sum(acc * acc)
    return sum_sq


@triton.jit
def _split_step_kernel(
    w_ptr,  # flat buffer: matrix l row-major at meta[l, 0] (fp32, fp16 or bf16)
    u_ptr,  # fp32 flat: u_l at meta[l, 1] (unscaled; unit on the first step)
    v_ptr,  # fp32 flat: v_l at meta[l, 2] (unscaled)
    part_ptr,  # fp32 scratch: matrix l's partial products at meta[l, 9]
    sq_ptr,  # fp32: matrix l's block sums of squares at meta[l, 10]: u's n_j blocks, then v's n_i blocks
    count_ptr,  # int32, zero between launches: matrix l's arrival counters at meta[l, 11]: n_i rows, then n_j columns
    meta_ptr,  # int64 [L, SPLIT_META]: w, u, v offsets, m, n, RM, RN, n_i, n_j, part, sq, count offsets
    item_ptr,  # int32 [P, 3]: (matrix, row region i, column region j) of program p
    first,  # 1 on the first step (u is a unit vector: scale 1)
    META: tl.constexpr,  # SPLIT_META
    EPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSED: tl.constexpr,  # False: v = W (s_u u); True: u = W^T (s_v v)
):
    """Program p: the region's partial product, and the serial reduction when it arrives last (module
    docstring)."""
    p = tl.program_id(0).to(tl.int64)
    layer = tl.load(item_ptr + 3 * p).to(tl.int64)
    i = tl.load(item_ptr + 3 * p + 1).to(tl.int64)
    j = tl.load(item_ptr + 3 * p + 2).to(tl.int64)
    meta = meta_ptr + layer * META
    w_base = w_ptr + tl.load(meta)
    u_base = u_ptr + tl.load(meta + 1)
    v_base = v_ptr + tl.load(meta + 2)
    m = tl.load(meta + 3)
    n = tl.load(meta + 4)
    rm = tl.load(meta + 5)
    rn = tl.load(meta + 6)
    n_i = tl.load(meta + 7)
    n_j = tl.load(meta + 8)
    part = part_ptr + tl.load(meta + 9)
    sq_u = sq_ptr + tl.load(meta + 10)
    sq_v = sq_u + n_j
    counts = count_ptr + tl.load(meta + 11)
    r_lo = i * rm
    r_hi = tl.minimum(r_lo + rm, m)
    c_lo = j * rn
    c_hi = tl.minimum(c_lo + rn, n)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    if not TRANSPOSED:
        scale = tl.cast(1.0, tl.float32)
        if first == 0:  # IEEE, as the one-program kernel and spectral.cu
            scale = tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(_sum_blocks(sq_u, n_j, 128)), EPS))
        # v_part[j, rows of region i] = scale * W[region] u[columns of region j]
        for r0 in range(r_lo, r_hi, BLOCK_M):
            r = r0 + rows
            mask_r = r < r_hi
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in range(c_lo, c_hi, BLOCK_N):
                c = c0 + cols
                mask_c = c < c_hi
                tile = tl.load(w_base + r[:, None] * n + c[None, :], mask=mask_r[:, None] & mask_c[None, :],
                               other=0.0).to(tl.float32)  # fmt: skip
                u = tl.load(u_base + c, mask=mask_c, other=0.0)
                acc += tl.sum(tile * u[None, :], axis=1)
            tl.store(part + j * m + r, acc * scale, mask=mask_r)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(counts + i, 1, sem="acq_rel", scope="gpu")
        if arrived == n_j - 1:  # last of row region i: v[rows] = sum over j in order, and its sum of squares
            tl.store(sq_v + i, _sum_partials(part, m, n_j, v_base, r_lo, r_hi, BLOCK_M))
            tl.store(counts + i, 0)  # every program of the region has arrived: ready for the next launch
    else:
        scale = tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(_sum_blocks(sq_v, n_i, 128)), EPS))
        # u_part[i, columns of region j] = scale * W[region]^T v[rows of region i]
        for c0 in range(c_lo, c_hi, BLOCK_N):
            c = c0 + cols
            mask_c = c < c_hi
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r0 in range(r_lo, r_hi, BLOCK_M):
                r = r0 + rows
                mask_r = r < r_hi
                tile = tl.load(w_base + r[:, None] * n + c[None, :], mask=mask_r[:, None] & mask_c[None, :],
                               other=0.0).to(tl.float32)  # fmt: skip
                v = tl.load(v_base + r, mask=mask_r, other=0.0)
                acc += tl.sum(tile * v[:, None], axis=0)
            tl.store(part + i * n + c, acc * scale, mask=mask_c)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(counts + n_i + j, 1, sem="acq_rel", scope="gpu")
        if arrived == n_i - 1:  # last of column region j: u[columns] = sum over i in order
            tl.store(sq_u + j, _sum_partials(part, n, n_i, u_base, c_lo, c_hi, BLOCK_N))
            tl.store(counts + n_i + j, 0)


@triton.jit
def _split_finish_kernel(
    u_ptr,  # fp32 flat: u_l (unscaled) at meta[l, 1]; unit on exit
    v_ptr,  # fp32 flat: v_l (unscaled) at meta[l, 2]; unit on exit
    sq_ptr,  # fp32 block sums of squares (``_split_step_kernel``)
    sigma_ptr,  # fp32 [L]: sigma_hat_l (written)
    meta_ptr,  # int64 [L, SPLIT_META]
    META: tl.constexpr,  # SPLIT_META
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program l: sigma_l = ||u_l||, and u_l, v_l scaled to unit vectors."""
    layer = tl.program_id(0).to(tl.int64)
    meta = meta_ptr + layer * META
    u_base = u_ptr + tl.load(meta + 1)
    v_base = v_ptr + tl.load(meta + 2)
    m = tl.load(meta + 3)
    n = tl.load(meta + 4)
    n_i = tl.load(meta + 7)
    n_j = tl.load(meta + 8)
    sq_u = sq_ptr + tl.load(meta + 10)
    sigma = tl.sqrt_rn(_sum_blocks(sq_u, n_j, 128))
    scale_u = tl.div_rn(1.0, tl.maximum(sigma, EPS))
    scale_v = tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(_sum_blocks(sq_u + n_j, n_i, 128)), EPS))
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for k0 in range(0, n, BLOCK):
        mask = k0 + offs < n
        tl.store(u_base + k0 + offs, tl.load(u_base + k0 + offs, mask=mask, other=0.0) * scale_u, mask=mask)
    for k0 in range(0, m, BLOCK):
        mask = k0 + offs < m
        tl.store(v_base + k0 + offs, tl.load(v_base + k0 + offs, mask=mask, other=0.0) * scale_v, mask=mask)
    tl.store(sigma_ptr + layer, sigma)


def _regions(m: int, n: int) -> tuple[int, int]:
    """Region ``[RM, RN]`` of the split path for an m x n matrix: from the tile, doubled (the smaller side first,
    never past the matrix) until at most TARGET_PROGRAMS regions cover it. Depends on the shape only."""
    rm, rn = BLOCK_M, BLOCK_N
    while triton.cdiv(m, rm) * triton.cdiv(n, rn) > TARGET_PROGRAMS:
        if (rn < rm or rm >= m) and rn < n:
            rn *= 2
        else:
            rm *= 2
    return rm, rn


def _split_plan(shapes, w_offs, u_offs, v_offs):
    """The split path's per-matrix table ([L, SPLIT_META]), program items ([P, 3]) and scratch sizes
    (partials, sums of squares, counters)."""
    meta, items = [], []
    part = sq = count = 0
    for layer, ((m, n), w_off, u_off, v_off) in enumerate(zip(shapes, w_offs, u_offs, v_offs, strict=True)):
        rm, rn = _regions(m, n)
        n_i, n_j = triton.cdiv(m, rm), triton.cdiv(n, rn)
        meta.append([w_off, u_off, v_off, m, n, rm, rn, n_i, n_j, part, sq, count])
        assert len(meta[-1]) == SPLIT_META
        items.extend([layer, i, j] for i in range(n_i) for j in range(n_j))
        part += max(n_j * m, n_i * n)
        sq += n_i + n_j
        count += n_i + n_j
    return meta, items, (part, sq, count)


def power_iteration(
    weights: list[torch.Tensor], vectors: list[torch.Tensor], iters: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Every matrix of the list in at most 2 + 2 iters launches; same convention as ``fastdp.ref.power_iteration``.

    Inputs (checked by ``fastdp.ops.spectral``): non-empty 2-D matrices on one device,
    float32/float16/bfloat16 (mixed dtypes are packed as float32), vectors u_l [n_l].
    Returns fp32 ``(sigma [L], u list, v list)``.
    """
    device = weights[0].device
    split_min = SPLIT_MIN_NUMEL  # read at call time (tests lower it)
    small = [i for i, w in enumerate(weights) if w.numel() <= split_min]
    large = [i for i, w in enumerate(weights) if w.numel() > split_min]
    order = small + large  # packed in this order: the one-program matrices, then the split ones
    dtypes = {w.dtype for w in weights}
    pack_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    flat = torch.cat([weights[i].reshape(-1).to(pack_dtype) for i in order])
    ms = [weights[i].shape[0] for i in order]
    ns = [weights[i].shape[1] for i in order]
    w_offs, u_offs, v_offs = [0], [0], [0]
    for m, n in zip(ms, ns, strict=True):
        w_offs.append(w_offs[-1] + m * n)
        u_offs.append(u_offs[-1] + n)
        v_offs.append(v_offs[-1] + m)
    us = [vectors[i].to(device=device, dtype=torch.float32).reshape(-1) for i in order]
    u_buf = torch.cat([u / torch.linalg.vector_norm(u).clamp_min(EPS) for u in us])
    v_buf = torch.empty(sum(ms), dtype=torch.float32, device=device)
    sigma = torch.empty(len(weights), dtype=torch.float32, device=device)  # in packing order
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        if small:
            k = len(small)
            meta = device_table([w_offs[:k], u_offs[:k], v_offs[:k], ms[:k], ns[:k]], torch.int64, device)
            _power_iteration_kernel[(k,)](
                flat, u_buf, v_buf, sigma, meta, k, iters,
                EPS=EPS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
            )  # fmt: skip
        if large:
            k = len(small)
            table, items, (part_size, sq_size, count_size) = _split_plan(
                list(zip(ms[k:], ns[k:], strict=True)), w_offs[k:-1], u_offs[k:-1], v_offs[k:-1]
            )
            meta = device_table(table, torch.int64, device)
            item_t = device_table(items, torch.int32, device)
            part = torch.empty(part_size, dtype=torch.float32, device=device)
            sq = torch.empty(sq_size, dtype=torch.float32, device=device)
            counts = torch.zeros(count_size, dtype=torch.int32, device=device)
            for step in range(iters):
                for transposed in (False, True):
                    _split_step_kernel[(len(items),)](
                        flat, u_buf, v_buf, part, sq, counts, meta, item_t, int(step == 0),
                        META=SPLIT_META, EPS=EPS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, TRANSPOSED=transposed,
                        num_warps=NUM_WARPS,
                    )  # fmt: skip
            _split_finish_kernel[(len(large),)](
                u_buf, v_buf, sq, sigma[k:], meta, META=SPLIT_META, EPS=EPS, BLOCK=FINISH_BLOCK, num_warps=NUM_WARPS
            )
    u_split = torch.split(u_buf, ns)
    v_split = torch.split(v_buf, ms)
    position = {i: p for p, i in enumerate(order)}
    u_out = [u_split[position[i]].clone() for i in range(len(weights))]
    v_out = [v_split[position[i]].clone() for i in range(len(weights))]
    if order != sorted(order):  # sigma back in the list's order, without a host-to-device sync
        sigma = sigma.index_select(0, device_table([position[i] for i in range(len(weights))], torch.int64, device))
    return sigma, u_out, v_out


def hopper_ptx_absent() -> dict:
    """PTX the sm_90 compile check must not find: approximate square roots and divisions (the CUDA kernel's sqrtf
    and / are IEEE, and the two backends must agree on sigma)."""
    approximate = ("sqrt.approx", "div.full", "div.approx", "rcp.approx")
    return {name: approximate for name in ("_power_iteration_kernel", "_split_step_kernel", "_split_finish_kernel")}


def hopper_ptx_present() -> dict:
    """PTX the split kernel must contain: the arrival counter's acquire-release atomic at GPU scope, and the last
    program's loads of the other programs' partials past L1 (``ld.global.cg``)."""
    return {"_split_step_kernel": [({}, r"atom\.global\.gpu\.acq_rel\.add"), ({}, r"ld\.global\.cg")]}


def hopper_compile_specs():
    """(kernel, signature, constexprs, launch options) of every kernel here, for the sm_90 compile check."""
    flags = {"EPS": EPS, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}
    launch = {"num_warps": NUM_WARPS}
    one_program = [
        (_power_iteration_kernel,
         {"w_ptr": ptr, "u_ptr": "*fp32", "v_ptr": "*fp32", "sigma_ptr": "*fp32", "meta_ptr": "*i64",
          "num_layers": "i32", "iters": "i32"}, flags, launch)
        for ptr in ("*fp32", "*fp16", "*bf16")
    ]  # fmt: skip
    split = [
        (_split_step_kernel,
         {"w_ptr": ptr, "u_ptr": "*fp32", "v_ptr": "*fp32", "part_ptr": "*fp32", "sq_ptr": "*fp32",
          "count_ptr": "*i32", "meta_ptr": "*i64", "item_ptr": "*i32", "first": "i32"},
         {**flags, "META": SPLIT_META, "TRANSPOSED": transposed}, launch)
        for ptr in ("*fp32", "*fp16", "*bf16") for transposed in (False, True)
    ]  # fmt: skip
    finish = [
        (_split_finish_kernel,
         {"u_ptr": "*fp32", "v_ptr": "*fp32", "sq_ptr": "*fp32", "sigma_ptr": "*fp32", "meta_ptr": "*i64"},
         {"META": SPLIT_META, "EPS": EPS, "BLOCK": FINISH_BLOCK}, launch)
    ]  # fmt: skip
    return one_program + split + finish
