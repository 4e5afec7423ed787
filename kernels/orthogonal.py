"""Triton kernels of Björck orthonormalisation (math: ``fastdp/ref/orthogonal.py``).

For X [m, n] with m >= n (a wide matrix is transposed on the host), ``iters`` steps of

    G = X^T X                                   [n, n], fp32 tl.dot (IEEE, no TF32)
    X <- (1 + beta) X - beta X G                the update fused into the X G product

Two paths, same math, ping-pong fp32 buffers ``buf[2, m, n]`` (step k reads buf[k % 2] and
writes buf[(k + 1) % 2]) and an fp32 Gram buffer:
* ``_bjorck_fused_kernel`` — one program does every step of one matrix (Gram tiles then
  update tiles, block-wide barriers between phases): one launch per matrix, for small
  matrices (m n <= FUSED_MAX_NUMEL), where launch latency dominates.
* ``_gram_kernel`` + ``_bjorck_update_kernel`` — tiled over many programs, two launches per
  step (the launch boundary is the grid-wide barrier): larger matrices.
Both run under ``TRITON_INTERPRET=1`` (tiles upcast to fp32: no low-precision tl.dot there).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 32  # tile edge (rows and columns); tl.dot needs >= 16
NUM_WARPS = 4
FUSED_MAX_NUMEL = 128 * 128  # one-program path up to this many elements


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
        acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
    return acc


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
        acc = tl.dot(a, g, acc, input_precision="ieee")
    mask = mask_r[:, None] & mask_j[None, :]
    x = tl.load(x_ptr + r[:, None] * n + cj[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + r[:, None] * n + cj[None, :], (1.0 + beta) * x - beta * acc, mask=mask)


@triton.jit
def _bjorck_fused_kernel(
    buf_ptr,  # fp32 [2, m, n]: X_0 in buf[0]; X_iters ends in buf[iters % 2]
    gram_ptr,  # fp32 [n, n] scratch
    m,  # rows (m >= n)
    n,  # columns
    iters,  # Björck steps
    beta,  # fp32 step size
    BLOCK: tl.constexpr,
):
    """One program: every Björck step of one matrix (module docstring)."""
    mn = tl.cast(m, tl.int64) * n
    for step in range(iters):
        x_ptr = buf_ptr + (step % 2) * mn
        y_ptr = buf_ptr + ((step + 1) % 2) * mn
        for i0 in range(0, n, BLOCK):
            for j0 in range(0, n, BLOCK):
                g = _gram_tile(x_ptr, i0, j0, m, n, BLOCK)
                ci = i0 + tl.arange(0, BLOCK).to(tl.int64)
                cj = j0 + tl.arange(0, BLOCK).to(tl.int64)
                tl.store(gram_ptr + ci[:, None] * n + cj[None, :], g, mask=(ci < n)[:, None] & (cj < n)[None, :])
        tl.debug_barrier()  # G visible to every thread
        for r0 in range(0, m, BLOCK):
            for j0 in range(0, n, BLOCK):
                _update_tile(x_ptr, y_ptr, gram_ptr, r0, j0, m, n, beta, BLOCK)
        tl.debug_barrier()  # the new X visible before the next step's Gram


@triton.jit
def _gram_kernel(
    x_ptr,  # X [m, n] fp32 (read)
    gram_ptr,  # G [n, n] fp32 (written)
    m,
    n,
    BLOCK: tl.constexpr,
):
    """Program (i, j): tile (i, j) of ``G = X^T X``."""
    i0 = tl.program_id(0).to(tl.int64) * BLOCK
    j0 = tl.program_id(1).to(tl.int64) * BLOCK
    g = _gram_tile(x_ptr, i0, j0, m, n, BLOCK)
    ci = i0 + tl.arange(0, BLOCK).to(tl.int64)
    cj = j0 + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(gram_ptr + ci[:, None] * n + cj[None, :], g, mask=(ci < n)[:, None] & (cj < n)[None, :])


@triton.jit
def _bjorck_update_kernel(
    x_ptr,  # X [m, n] fp32 (read)
    y_ptr,  # Y [m, n] fp32 (written)
    gram_ptr,  # G [n, n] fp32 (read)
    m,
    n,
    beta,  # fp32 step size
    BLOCK: tl.constexpr,
):
    """Program (r, j): tile (r, j) of ``Y = (1 + beta) X - beta X G``."""
    r0 = tl.program_id(0).to(tl.int64) * BLOCK
    j0 = tl.program_id(1).to(tl.int64) * BLOCK
    _update_tile(x_ptr, y_ptr, gram_ptr, r0, j0, m, n, beta, BLOCK)


def bjorck_orthonormalize(w: torch.Tensor, iters: int, beta: float) -> torch.Tensor:
    """``iters`` Björck steps on one 2-D matrix (float32/float16/bfloat16, non-empty, checked by
    ``fastdp.ops.orthogonal``); returns a contiguous matrix of w's shape and dtype."""
    wide = w.shape[0] < w.shape[1]
    x = w.T if wide else w
    m, n = x.shape
    buf = torch.empty(2, m, n, dtype=torch.float32, device=w.device)
    buf[0].copy_(x)
    gram = torch.empty(n, n, dtype=torch.float32, device=w.device)
    guard = torch.cuda.device(w.device) if w.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        if m * n <= FUSED_MAX_NUMEL:
            _bjorck_fused_kernel[(1,)](buf, gram, m, n, iters, float(beta), BLOCK=BLOCK, num_warps=NUM_WARPS)
        else:
            tiles_n = triton.cdiv(n, BLOCK)
            for step in range(iters):
                x_buf, y_buf = buf[step % 2], buf[(step + 1) % 2]
                _gram_kernel[(tiles_n, tiles_n)](x_buf, gram, m, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
                _bjorck_update_kernel[(triton.cdiv(m, BLOCK), tiles_n)](
                    x_buf, y_buf, gram, m, n, float(beta), BLOCK=BLOCK, num_warps=NUM_WARPS
                )
    out = buf[iters % 2]
    out = out.T if wide else out
    return torch.empty(w.shape, dtype=w.dtype, device=w.device).copy_(out)  # not a view of buf


def hopper_compile_specs():
    """(kernel, signature, constexprs) of every kernel here, for the sm_90 compile check."""
    flags = {"BLOCK": BLOCK}
    return [
        (_bjorck_fused_kernel,
         {"buf_ptr": "*fp32", "gram_ptr": "*fp32", "m": "i32", "n": "i32", "iters": "i32", "beta": "fp32"}, flags),
        (_gram_kernel, {"x_ptr": "*fp32", "gram_ptr": "*fp32", "m": "i32", "n": "i32"}, flags),
        (_bjorck_update_kernel,
         {"x_ptr": "*fp32", "y_ptr": "*fp32", "gram_ptr": "*fp32", "m": "i32", "n": "i32", "beta": "fp32"}, flags),
    ]  # fmt: skip
