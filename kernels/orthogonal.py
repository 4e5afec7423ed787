"""Triton kernels of Björck orthonormalisation (math: ``fastdp/ref/orthogonal.py``).

For each matrix X_l [m_l, n_l] with m_l >= n_l (a wide matrix is transposed on the host), ``iters`` steps of

    G = X^T X                                   [n, n], upper tiles, mirrored
    X <- (1 + beta) X - beta X G                the update fused into the X G product

Products on tensor cores with 3xTF32 (``tl.dot(..., input_precision="tf32x3")``: each fp32 operand split into a
TF32 high part and a TF32 low part, three mma.sync m16n8k8 TF32 products summed in fp32, the low x low one dropped):
about fp32 accuracy (relative error of a product ~2^-21 against fp32's 2^-24) at tensor-core speed. The precision
argument: Björck is a projection, not a bound. Nothing privacy-relevant trusts its output to be orthonormal: the
clipless variant certifies each layer's Lipschitz constant on the weights it actually has (``fastdp.nn.lipschitz``,
float64), and a product error of 2^-21 moves the iteration's fixed point by the same order, far below the 1e-3
margin of the spectral scaling before it. The CUDA backend (csrc/cuda/orthogonal.cu) also multiplies in 3xTF32
(WMMA), with other tiles and summation orders: the two backends agree to ~1e-5, not bitwise. The interpreter
multiplies in plain fp32.

Batched over the whole list with no pointer tables (so the same path runs under ``TRITON_INTERPRET=1``), as
``fastdp/kernels/spectral.py``: the host packs every matrix in fp32 into one flat buffer ``buf[2, total]``
(ping-pong halves: step k reads half k % 2 and writes half (k + 1) % 2, so X_iters ends in half iters % 2),
gives each its own fp32 Gram scratch in one flat ``gram[total_gram]``, and passes an int64 table
``meta[L, 4]`` of (offset of X_l in a half, offset of G_l, m_l, n_l). Two paths, same math and the same
fp32 tiles (``_gram_tile``, ``_update_tile``):

* ``_bjorck_fused_kernel`` — grid (L_small,): program l does every step of small matrix l
  (m n <= FUSED_MAX_NUMEL; Gram tiles then update tiles, block-wide barriers between phases). All small
  matrices in ONE launch, where launch latency dominates.
* ``_gram_kernel`` + ``_bjorck_update_kernel`` — per step, one launch each over all larger matrices, grid
  (max tiles, max tiles, L_large): program (i, j, l) makes tile (i, j) of matrix l and returns at once
  when the tile lies outside matrix l (the launch boundary is the grid-wide barrier between the phases).

A list costs at most 1 + 2 iters launches, whatever its length. Load balance: the largest matrix sets the
time of each launch (fine for the layer lists of Lipschitz networks). Tiles are upcast to fp32 on load (the
interpreter has no low-precision tl.dot).

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores, 3xTF32
about 160 TFLOP/s); nothing measured on a GPU yet. Each Björck iteration forms the Gram X^T X (m n^2 / 2 multiply-adds:
its upper tiles, each stored twice) and the update X (a I + b X^T X) (m n^2): about 3 m n^2 FLOP, so for 1024 x
1024 float32 3.2 GFLOP, 48 us on fp32 cores and 20 us with 3xTF32 tensor cores (this kernel). One program per
small matrix (the fused kernel) uses one SM. Target: >= 2x a plain torch loop for n <= 1024, no host synchronisation.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from fastdp.kernels import device_table

BLOCK = 32  # tile edge (rows and columns); tl.dot needs >= 16
NUM_WARPS = 4
FUSED_NUM_WARPS = 8  # the one-program kernel: at 4 warps it spills (256 B of stack with 3xTF32), at 8 none
FUSED_MAX_NUMEL = 128 * 128  # one-program path up to this many elements
META_COLUMNS = 4  # meta[l] = (offset of X_l in a half of buf, offset of G_l in gram, m_l, n_l)
MAX_GRID_YZ = 65535  # CUDA limit on grid axes 1 and 2


@triton.jit
def _gram_tile(
    x_ptr,  # X [m, n] fp32 row-major
    i0,  # first column of the tile's rows (G rows)
    j0,  # first column of the tile's columns (G columns)
    m,  # rows of X
    n,  # columns of X
    BLOCK: tl.constexpr,
):
    """fp32 tile ``G[i0:i0+BLOCK, j0:j0+BLOCK]`` of ``G = X^T X``; out-of-range entries are 0."""
    k = tl.arange(0, BLOCK).to(tl.int64)
    ci = i0 + tl.arange(0, BLOCK).to(tl.int64)
    cj = j0 + tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, m, BLOCK):
        r = k0 + k
        mask_r = r < m
        a = tl.load(x_ptr + r[:, None] * n + ci[None, :], mask=mask_r[:, None] & (ci < n)[None, :], other=0.0)
        b = tl.load(x_ptr + r[:, None] * n + cj[None, :], mask=mask_r[:, None] & (cj < n)[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision="tf32x3")
    return acc


@triton.jit
def _store_gram_tile(
    gram_ptr,  # G [n, n] fp32 (written)
    g,  # fp32 [BLOCK, BLOCK] tile
    i0,
    j0,
    n,
    BLOCK: tl.constexpr,
):
    """``G[i0:i0+BLOCK, j0:j0+BLOCK] = g`` (in-range entries only)."""
    ci = i0 + tl.arange(0, BLOCK).to(tl.int64)
    cj = j0 + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(gram_ptr + ci[:, None] * n + cj[None, :], g, mask=(ci < n)[:, None] & (cj < n)[None, :])


@triton.jit
def _update_tile(
    x_ptr,  # X [m, n] fp32 (read)
    y_ptr,  # Y [m, n] fp32 (written)
    gram_ptr,  # G [n, n] fp32 (read)
    r0,  # first row of the tile
    j0,  # first column of the tile
    m,
    n,
    beta,  # fp32 step size
    BLOCK: tl.constexpr,
):
    """``Y[r0:, j0:] = (1 + beta) X[r0:, j0:] - beta (X G)[r0:, j0:]`` on one BLOCK x BLOCK tile."""
    r = r0 + tl.arange(0, BLOCK).to(tl.int64)
    cj = j0 + tl.arange(0, BLOCK).to(tl.int64)
    kk = tl.arange(0, BLOCK).to(tl.int64)
    mask_r = r < m
    mask_j = cj < n
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, n, BLOCK):
        k = k0 + kk
        mask_k = k < n
        a = tl.load(x_ptr + r[:, None] * n + k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(gram_ptr + k[:, None] * n + cj[None, :], mask=mask_k[:, None] & mask_j[None, :], other=0.0)
        acc = tl.dot(a, g, acc, input_precision="tf32x3")
    mask = mask_r[:, None] & mask_j[None, :]
    x = tl.load(x_ptr + r[:, None] * n + cj[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + r[:, None] * n + cj[None, :], (1.0 + beta) * x - beta * acc, mask=mask)


@triton.jit
def _bjorck_fused_kernel(
    buf_ptr,  # fp32 [2, half]: X_l at meta[l, 0] in each half; X_0 in half 0, X_iters in half iters % 2
    half,  # elements in one half of buf
    gram_ptr,  # fp32 flat scratch: G_l [n_l, n_l] at meta[l, 1]
    meta_ptr,  # int64 [L_small, 4]: X offset, G offset, m, n (m >= n)
    iters,  # Björck steps
    beta,  # fp32 step size
    BLOCK: tl.constexpr,
):
    """Program l: every Björck step of small matrix l (module docstring)."""
    layer = tl.program_id(0).to(tl.int64)
    x_off = tl.load(meta_ptr + layer * 4)
    gram = gram_ptr + tl.load(meta_ptr + layer * 4 + 1)
    m = tl.load(meta_ptr + layer * 4 + 2)
    n = tl.load(meta_ptr + layer * 4 + 3)
    half64 = tl.cast(half, tl.int64)
    for step in range(iters):
        x_ptr = buf_ptr + (step % 2) * half64 + x_off
        y_ptr = buf_ptr + ((step + 1) % 2) * half64 + x_off
        for i0 in range(0, n, BLOCK):
            for j0 in range(i0, n, BLOCK):  # the upper triangle of tiles, mirrored: G is symmetric
                g = _gram_tile(x_ptr, i0, j0, m, n, BLOCK)
                _store_gram_tile(gram, g, i0, j0, n, BLOCK)
                if j0 != i0:
                    _store_gram_tile(gram, tl.trans(g), j0, i0, n, BLOCK)
        tl.debug_barrier()  # G visible to every thread
        for r0 in range(0, m, BLOCK):
            for j0 in range(0, n, BLOCK):
                _update_tile(x_ptr, y_ptr, gram, r0, j0, m, n, beta, BLOCK)
        tl.debug_barrier()  # the new X visible before the next step's Gram


@triton.jit
def _gram_kernel(
    x_ptr,  # fp32 flat half of buf read this step: X_l at meta[l, 0]
    gram_ptr,  # fp32 flat: G_l [n_l, n_l] at meta[l, 1] (written)
    meta_ptr,  # int64 [L_large, 4]: X offset, G offset, m, n (m >= n)
    BLOCK: tl.constexpr,
):
    """Program (i, j, l), i <= j: tiles (i, j) and (j, i) of ``G_l = X_l^T X_l`` (symmetric: one product, stored
    twice); nothing for i > j or a tile outside G_l."""
    layer = tl.program_id(2).to(tl.int64)
    n = tl.load(meta_ptr + layer * 4 + 3)
    i0 = tl.program_id(0).to(tl.int64) * BLOCK
    j0 = tl.program_id(1).to(tl.int64) * BLOCK
    if j0 < i0:
        return
    if j0 >= n:
        return
    x = x_ptr + tl.load(meta_ptr + layer * 4)
    gram = gram_ptr + tl.load(meta_ptr + layer * 4 + 1)
    m = tl.load(meta_ptr + layer * 4 + 2)
    g = _gram_tile(x, i0, j0, m, n, BLOCK)
    _store_gram_tile(gram, g, i0, j0, n, BLOCK)
    if j0 != i0:
        _store_gram_tile(gram, tl.trans(g), j0, i0, n, BLOCK)


@triton.jit
def _bjorck_update_kernel(
    x_ptr,  # fp32 flat half of buf read this step: X_l at meta[l, 0]
    y_ptr,  # fp32 flat other half (written): Y_l at meta[l, 0]
    gram_ptr,  # fp32 flat: G_l at meta[l, 1] (read)
    meta_ptr,  # int64 [L_large, 4]: X offset, G offset, m, n (m >= n)
    beta,  # fp32 step size
    BLOCK: tl.constexpr,
):
    """Program (r, j, l): tile (r, j) of ``Y_l = (1 + beta) X_l - beta X_l G_l``; nothing outside Y_l."""
    layer = tl.program_id(2).to(tl.int64)
    m = tl.load(meta_ptr + layer * 4 + 2)
    n = tl.load(meta_ptr + layer * 4 + 3)
    r0 = tl.program_id(0).to(tl.int64) * BLOCK
    j0 = tl.program_id(1).to(tl.int64) * BLOCK
    if r0 >= m:
        return
    if j0 >= n:
        return
    x_off = tl.load(meta_ptr + layer * 4)
    gram = gram_ptr + tl.load(meta_ptr + layer * 4 + 1)
    _update_tile(x_ptr + x_off, y_ptr + x_off, gram, r0, j0, m, n, beta, BLOCK)


def bjorck_orthonormalize(weights: list[torch.Tensor], iters: int, beta: float) -> list[torch.Tensor]:
    """``iters`` Björck steps on every matrix of a non-empty list, in at most 1 + 2 iters launches.

    Inputs (checked by ``fastdp.ops.orthogonal``): non-empty 2-D matrices on one device, float32, float16
    or bfloat16 (mixed allowed), any strides. Returns contiguous matrices of the inputs' shapes and dtypes.
    """
    device = weights[0].device
    xs = [w.T if w.shape[0] < w.shape[1] else w for w in weights]  # [m, n], m >= n
    fused_max = FUSED_MAX_NUMEL  # read at call time (tests lower it)
    small = [i for i, x in enumerate(xs) if x.numel() <= fused_max]
    large = [i for i, x in enumerate(xs) if x.numel() > fused_max]
    order = small + large  # meta rows: small matrices first, then the tiled ones
    row_tiles = max((triton.cdiv(xs[i].shape[0], BLOCK) for i in large), default=0)
    col_tiles = max((triton.cdiv(xs[i].shape[1], BLOCK) for i in large), default=0)
    if len(large) > MAX_GRID_YZ or col_tiles > MAX_GRID_YZ:
        raise ValueError(
            f"fastdp bjorck_orthonormalize: {len(large)} matrices with up to {col_tiles} column tiles exceed the "
            f"grid limit {MAX_GRID_YZ} (grid axes 1 and 2); split the list or use the torch backend"
        )
    meta, x_offs = [], {}
    half = gram_total = 0
    for i in order:
        m, n = xs[i].shape
        meta.append([half, gram_total, m, n])
        x_offs[i] = half
        half += m * n
        gram_total += n * n
    buf = torch.empty(2, half, dtype=torch.float32, device=device)
    gram = torch.empty(gram_total, dtype=torch.float32, device=device)
    for i, x in enumerate(xs):
        buf[0, x_offs[i] : x_offs[i] + x.numel()].view(x.shape).copy_(x)
    meta_t = device_table(meta, torch.int64, device)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        if small:
            _bjorck_fused_kernel[(len(small),)](
                buf, half, gram, meta_t, iters, float(beta), BLOCK=BLOCK, num_warps=FUSED_NUM_WARPS
            )
        if large:
            meta_large = meta_t[len(small) :]  # a contiguous view: rows of the tiled matrices
            for step in range(iters):
                x_buf, y_buf = buf[step % 2], buf[(step + 1) % 2]
                _gram_kernel[(col_tiles, col_tiles, len(large))](
                    x_buf, gram, meta_large, BLOCK=BLOCK, num_warps=NUM_WARPS
                )
                _bjorck_update_kernel[(row_tiles, col_tiles, len(large))](
                    x_buf, y_buf, gram, meta_large, float(beta), BLOCK=BLOCK, num_warps=NUM_WARPS
                )
    final = buf[iters % 2]
    out = []
    for i, (w, x) in enumerate(zip(weights, xs, strict=True)):
        result = final[x_offs[i] : x_offs[i] + x.numel()].view(x.shape)
        result = result.T if w.shape[0] < w.shape[1] else result  # a wide matrix was transposed
        out.append(torch.empty(w.shape, dtype=w.dtype, device=device).copy_(result))  # not a view of buf
    return out


def hopper_compile_specs():
    """(kernel, signature, constexprs, launch options) of every kernel here, for the sm_90 compile check."""
    flags, launch = {"BLOCK": BLOCK}, {"num_warps": NUM_WARPS}
    return [
        (_bjorck_fused_kernel,
         {"buf_ptr": "*fp32", "half": "i64", "gram_ptr": "*fp32", "meta_ptr": "*i64", "iters": "i32",
          "beta": "fp32"}, flags, {"num_warps": FUSED_NUM_WARPS}),
        (_gram_kernel, {"x_ptr": "*fp32", "gram_ptr": "*fp32", "meta_ptr": "*i64"}, flags, launch),
        (_bjorck_update_kernel,
         {"x_ptr": "*fp32", "y_ptr": "*fp32", "gram_ptr": "*fp32", "meta_ptr": "*i64", "beta": "fp32"}, flags,
         launch),
    ]  # fmt: skip


def hopper_ptx_present() -> dict:
    """PTX every variant must contain: the products on tensor cores (TF32 mma.sync, or wgmma)."""
    tensor_cores = r"(mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32|wgmma\.mma_async\S*tf32)"
    return {name: [({}, tensor_cores)] for name in ("_bjorck_fused_kernel", "_gram_kernel", "_bjorck_update_kernel")}
