"""Triton kernels of the per-example gradient norms (math: ``fastdp/ref/norms.py``).

Ghost norm of example b (a: [B, T, D], g: [B, T, P], contiguous):
    out[b] = sum_{t,s} (a_bt . a_bs) (g_bt . g_bs)
The [T, T] Gram matrices are never stored: they are made tile by tile with ``tl.dot``
(fp32 accumulation over D and P in chunks), multiplied elementwise and summed.
Symmetry: t-block i meets only s-blocks j >= i, off-diagonal tiles counted twice.
Load balance: program k of example b takes t-blocks k and n-1-k (n t-blocks), so every
program computes n + 1 tiles (n odd: the middle program computes its block once).
Each program writes one fp32 partial sum; the host adds the partials of an example
(a fixed order: deterministic, no atomics).

Short sequences and few examples (fewer than ``SPLIT_TARGET`` programs, e.g. 32 examples of
T <= 64: one program each) would leave most of the GPU idle, so the work splits further: program
(b, pair, slice) makes tile pair (t-block, s-block) of example b's Gram of a over one column slice
(or of g's), into an fp32 scratch of tiles (``_gram_slice_kernel``); program (b, pair) then sums
the slices of both Grams in slice order, multiplies them and sums the tile
(``_gram_slices_product_kernel``). Slices are at least ``SPLIT_MIN_COLS`` columns wide: the
scratch costs 8 BLOCK_T^2 bytes per slice, against 2 BLOCK_T SPLIT_MIN_COLS bytes (fp16) read.
The shape alone picks the split, so results do not depend on the GPU.

Clip factors: norms[i] = sqrt(sum_l sq[l, i]), factors[i] = min(1, C / (norms[i] + 1e-6)),
one launch, fp32, IEEE sqrt and division; NaN propagates.

Under ``TRITON_INTERPRET=1`` (no bf16 ``tl.dot`` in the interpreter) tiles are upcast to
fp32 before ``tl.dot``; on the GPU fp16/bf16 tiles go to the tensor cores as they are and
fp32 tiles use IEEE fp32 products (``input_precision="ieee"``: no TF32 rounding).

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores, bf16/fp16
tensor cores 989 TFLOP/s dense); nothing measured on a GPU yet. The ghost norm of one example costs T^2 (d + p)
multiply-adds, half of them with symmetric tiles, and reads A and G once, T (d + p) elements: for B 32, T 512, d = p
= 768 that is 6.4 G multiply-adds (12.9 GFLOP) against 100 MB of float32, so 0.19 ms on fp32 CUDA cores (float32
inputs) and 13 us on bf16 tensor cores (bf16/fp16 inputs: wgmma for 64-row tiles, mma.sync for 16 and 32, fp32
accumulation; the sm_90 compile check asserts it, ``hopper_ptx_present``), against 33 us of reading (50 MB in bf16:
17 us). bf16 and fp16 products are exact in fp32, so the tensor cores change only the order of the fp32 sums. The
clip factors read [L, B] once: bandwidth-bound and tiny. Target: >= 50 % of the fp32 floor for float32 inputs and of
the tensor-core floor (or of reading, whichever is longer) for bf16/fp16.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from fastdp.kernels import INTERPRET

BLOCK_T = 64  # rows of a Gram tile (t and s): tl.dot needs >= 16
BLOCK_K = 32  # chunk of D (and P) per tl.dot (64 spills with the three fp32 accumulators)
NUM_WARPS = 8  # with BLOCK_K 32: no register spills on sm_90 (4 warps, 64 x 64: 1128 B of stack, fp32)
CLIP_BLOCK = 1024  # examples per program of the clip-factor kernel
SPLIT_TARGET = 256  # programs to aim for: fewer (few examples, short sequences) split the column sums too
SPLIT_MIN_COLS = 256  # columns per slice at least (a slice's partial Gram tile costs 4 BLOCK_T^2 bytes twice)
CLIP_EPS = 1e-6


@triton.jit
def _gram_tile(
    x_ptr,  # this example's [T, K] rows (contiguous)
    rows_t,  # int64[BLOCK_T]: t indices of the tile
    rows_s,  # int64[BLOCK_T]: s indices of the tile
    T,  # rows of the example
    K,  # columns of x (D or P): the row stride
    k_lo,  # first column of the product
    k_hi,  # one past its last column (<= K)
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # cast tiles to fp32 before tl.dot (interpreter; fp32 inputs)
):
    """fp32 tile ``x[rows_t, k_lo:k_hi] @ x[rows_s, k_lo:k_hi]^T`` ([BLOCK_T, BLOCK_T]); rows >= T read as 0."""
    gram = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    mask_t = rows_t < T
    mask_s = rows_s < T
    for k in range(k_lo, k_hi, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        mask_k = cols < k_hi
        xt = tl.load(x_ptr + rows_t[:, None] * K + cols[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        xs = tl.load(x_ptr + rows_s[:, None] * K + cols[None, :], mask=mask_s[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            xs = xs.to(tl.float32)
        gram = tl.dot(xt, tl.trans(xs), gram, input_precision="ieee")
    return gram


@triton.jit
def _ghost_norm_sq_kernel(
    a_ptr,  # [B, T, D] layer inputs (fp32, fp16 or bf16), contiguous
    g_ptr,  # [B, T, P] output gradients (same dtype as a), contiguous
    partial_ptr,  # fp32 [B, NUM_PROGRAMS]: one partial sum per program
    T,  # sequence length
    D,  # input features
    P,  # output features
    NUM_T_BLOCKS,  # cdiv(T, BLOCK_T)
    NUM_PROGRAMS,  # programs per example: cdiv(NUM_T_BLOCKS, 2)
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Partial ghost norm of one example over t-blocks k and NUM_T_BLOCKS-1-k (program k)."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // NUM_PROGRAMS
    k = pid % NUM_PROGRAMS
    T = tl.cast(T, tl.int64)
    a_base = a_ptr + b * T * D
    g_base = g_ptr + b * T * P
    last = NUM_T_BLOCKS - 1 - k
    count = 2 - (last == k).to(tl.int64)  # the middle block of an odd count: once
    acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for i in range(0, count):
        tb = k + i * (last - k)
        t0 = tb * BLOCK_T
        rows_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        for s0 in range(t0, T, BLOCK_T):
            rows_s = s0 + tl.arange(0, BLOCK_T).to(tl.int64)
            gram_a = _gram_tile(a_base, rows_t, rows_s, T, D, 0, D, BLOCK_T, BLOCK_K, UPCAST)
            gram_g = _gram_tile(g_base, rows_t, rows_s, T, P, 0, P, BLOCK_T, BLOCK_K, UPCAST)
            weight = tl.where(s0 == t0, 1.0, 2.0)  # (t, s) and (s, t) off the diagonal
            acc += weight * (gram_a * gram_g)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _tile_pair(pair, NUM_T_BLOCKS):
    """(t-block, s-block), t <= s, of tile pair ``pair`` of the upper triangle, row by row."""
    tb = pair * 0
    rest = pair
    while rest >= NUM_T_BLOCKS - tb:
        rest -= NUM_T_BLOCKS - tb
        tb += 1
    return tb, tb + rest


@triton.jit
def _gram_slice_kernel(
    a_ptr,  # [B, T, D] layer inputs (fp32, fp16 or bf16), contiguous
    g_ptr,  # [B, T, P] output gradients (same dtype as a), contiguous
    scratch_ptr,  # fp32 [B, NUM_PAIRS, SLICES_A + SLICES_G, BLOCK_T, BLOCK_T] (written)
    T,
    D,
    P,
    NUM_T_BLOCKS,
    NUM_PAIRS,  # NUM_T_BLOCKS (NUM_T_BLOCKS + 1) / 2
    SLICES_A,  # column slices of a
    SLICES_G,  # column slices of g
    COLS_A,  # columns per slice of a (a multiple of BLOCK_K)
    COLS_G,  # columns per slice of g
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (b, pair, slice): the pair's Gram tile over one column slice of a (slice < SLICES_A) or of g."""
    pid = tl.program_id(0).to(tl.int64)
    slices = SLICES_A + SLICES_G
    piece = pid % slices
    pair = (pid // slices) % NUM_PAIRS
    b = pid // (slices * NUM_PAIRS)
    T = tl.cast(T, tl.int64)
    tb, sb = _tile_pair(pair, NUM_T_BLOCKS)
    rows_t = tb * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    rows_s = sb * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    if piece < SLICES_A:  # scalars only: one inlined product below (two would spill)
        x_ptr = a_ptr + b * T * D
        width = D
        k_lo = piece * COLS_A
        k_hi = tl.minimum(k_lo + COLS_A, D)
    else:
        x_ptr = g_ptr + b * T * P
        width = P
        k_lo = (piece - SLICES_A) * COLS_G
        k_hi = tl.minimum(k_lo + COLS_G, P)
    gram = _gram_tile(x_ptr, rows_t, rows_s, T, width, k_lo, k_hi, BLOCK_T, BLOCK_K, UPCAST)
    out = scratch_ptr + pid * (BLOCK_T * BLOCK_T)  # a scalar base: 32-bit offsets within the tile
    tl.store(out + tl.arange(0, BLOCK_T)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :], gram)


@triton.jit
def _gram_slices_product_kernel(
    scratch_ptr,  # fp32 [B, NUM_PAIRS, SLICES_A + SLICES_G, BLOCK_T, BLOCK_T] (``_gram_slice_kernel``)
    partial_ptr,  # fp32 [B, NUM_PAIRS] (written)
    NUM_T_BLOCKS,
    NUM_PAIRS,
    SLICES_A,
    SLICES_G,
    BLOCK_T: tl.constexpr,
):
    """Program (b, pair): the slices of each Gram tile summed in slice order, multiplied, summed (off-diagonal
    pairs twice)."""
    pid = tl.program_id(0).to(tl.int64)
    slices = SLICES_A + SLICES_G
    tile = tl.arange(0, BLOCK_T)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    base = scratch_ptr + pid * slices * BLOCK_T * BLOCK_T + tile
    gram_a = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for piece in range(0, SLICES_A):
        gram_a += tl.load(base + piece * BLOCK_T * BLOCK_T)
    gram_g = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for piece in range(SLICES_A, slices):
        gram_g += tl.load(base + piece * BLOCK_T * BLOCK_T)
    tb, sb = _tile_pair(pid % NUM_PAIRS, NUM_T_BLOCKS)
    weight = tl.where(tb == sb, 1.0, 2.0)  # (t, s) and (s, t) off the diagonal
    tl.store(partial_ptr + pid, weight * tl.sum(tl.sum(gram_a * gram_g, axis=1), axis=0))


@triton.jit
def _clip_factors_kernel(
    sq_ptr,  # fp32 [L, B]: per-layer squared norms, contiguous
    norms_ptr,  # fp32 [B]: out, sqrt(sum_l sq[l, i])
    factors_ptr,  # fp32 [B]: out, min(1, clip_norm / (norms + EPS))
    L,  # layers
    B,  # examples
    clip_norm,  # fp32: C > 0
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program i handles examples [i * BLOCK, (i + 1) * BLOCK), summing the L rows in order."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < B
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for layer in range(0, L):
        total += tl.load(sq_ptr + layer * tl.cast(B, tl.int64) + cols, mask=mask, other=0.0)
    norms = tl.sqrt_rn(total)
    factors = tl.div_rn(tl.zeros_like(norms) + clip_norm, norms + EPS)
    factors = tl.where(factors > 1.0, 1.0, factors)  # NaN > 1 is false: NaN stays NaN
    tl.store(norms_ptr + cols, norms, mask=mask)
    tl.store(factors_ptr + cols, factors, mask=mask)


def hopper_ptx_present() -> dict:
    """PTX the sm_90 compile check must find: fp16/bf16 tiles multiplied on the tensor cores (``wgmma`` or ``mma``
    with fp32 accumulation), never upcast to fp32 FMAs."""
    tensor_cores = r"(wgmma\.mma_async|mma\.sync)[.a-z0-9]*\.f32\.(bf16|f16)"
    return {name: [({"UPCAST": False}, tensor_cores)] for name in ("_ghost_norm_sq_kernel", "_gram_slice_kernel")}


def _device_guard(x: torch.Tensor):
    """Triton launches on the current device's stream: make x's device current."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _block_t(seq: int) -> int:
    """Tile rows: 64, or less for short sequences (>= 16 for tl.dot)."""
    return max(16, min(BLOCK_T, triton.next_power_of_2(seq)))


def _block_k(width: int) -> int:
    """Columns per tl.dot chunk: 64, or less for narrow layers (>= 16 for tl.dot)."""
    return max(16, min(BLOCK_K, triton.next_power_of_2(width)))


def _slices(width: int, pieces: int, block_k: int) -> tuple[int, int]:
    """(slices, columns per slice): at most ``pieces`` slices of ``width`` columns, each a multiple of block_k
    and at least SPLIT_MIN_COLS wide."""
    pieces = max(1, min(pieces, width // SPLIT_MIN_COLS))
    cols = triton.cdiv(triton.cdiv(width, pieces), block_k) * block_k
    return triton.cdiv(width, cols), cols


def ghost_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp32 [B] ghost norms of contiguous a [B, T, D], g [B, T, P] (checked by ``fastdp.ops.norms``)."""
    batch, seq, dim_a = a.shape
    dim_g = g.shape[2]
    if batch == 0 or seq == 0 or dim_a == 0 or dim_g == 0:
        return torch.zeros(batch, device=a.device, dtype=torch.float32)
    block_t = _block_t(seq)
    block_k = _block_k(max(dim_a, dim_g))
    num_t_blocks = triton.cdiv(seq, block_t)
    num_programs = triton.cdiv(num_t_blocks, 2)
    upcast = INTERPRET or a.dtype == torch.float32
    target = SPLIT_TARGET  # read at call time (tests change it)
    with _device_guard(a):
        if batch * num_programs >= target or max(dim_a, dim_g) < 2 * SPLIT_MIN_COLS:
            partial = torch.empty(batch, num_programs, device=a.device, dtype=torch.float32)
            _ghost_norm_sq_kernel[(batch * num_programs,)](
                a, g, partial, seq, dim_a, dim_g, num_t_blocks, num_programs,
                BLOCK_T=block_t, BLOCK_K=block_k, UPCAST=upcast, num_warps=NUM_WARPS,
            )  # fmt: skip
            return partial.sum(dim=1)
        # Short sequences, few examples: the Gram tiles' column sums split over programs as well (the shape
        # alone decides how: the result does not depend on the GPU).
        num_pairs = num_t_blocks * (num_t_blocks + 1) // 2
        pieces = triton.cdiv(target, batch * num_pairs)
        slices_a, cols_a = _slices(dim_a, triton.cdiv(pieces * dim_a, dim_a + dim_g), block_k)
        slices_g, cols_g = _slices(dim_g, triton.cdiv(pieces * dim_g, dim_a + dim_g), block_k)
        scratch = torch.empty(batch * num_pairs * (slices_a + slices_g) * block_t * block_t, device=a.device,
                              dtype=torch.float32)  # fmt: skip
        _gram_slice_kernel[(batch * num_pairs * (slices_a + slices_g),)](
            a, g, scratch, seq, dim_a, dim_g, num_t_blocks, num_pairs, slices_a, slices_g, cols_a, cols_g,
            BLOCK_T=block_t, BLOCK_K=block_k, UPCAST=upcast, num_warps=NUM_WARPS,
        )  # fmt: skip
        partial = torch.empty(batch, num_pairs, device=a.device, dtype=torch.float32)
        _gram_slices_product_kernel[(batch * num_pairs,)](
            scratch, partial, num_t_blocks, num_pairs, slices_a, slices_g, BLOCK_T=block_t, num_warps=NUM_WARPS
        )
    return partial.sum(dim=1)


def clip_factors(sq_norms: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms, factors), fp32 [B], of a contiguous fp32 [L, B] (checked by ``fastdp.ops.norms``)."""
    layers, batch = sq_norms.shape
    norms = torch.empty(batch, device=sq_norms.device, dtype=torch.float32)
    factors = torch.empty_like(norms)
    if batch == 0:
        return norms, factors
    with _device_guard(sq_norms):
        _clip_factors_kernel[(triton.cdiv(batch, CLIP_BLOCK),)](
            sq_norms, norms, factors, layers, batch, float(clip_norm), EPS=CLIP_EPS, BLOCK=CLIP_BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return norms, factors


def hopper_compile_specs():
    """(kernel, signature, constexprs) of every kernel here, for the sm_90 compile check."""
    specs = []
    tiles = [(block_t, block_k) for block_t in (16, 32, BLOCK_T) for block_k in (16, BLOCK_K)]  # _block_t, _block_k
    launch = {"num_warps": NUM_WARPS}
    for ptr in ("*fp32", "*fp16", "*bf16"):
        for block_t, block_k in tiles:
            flags = {"BLOCK_T": block_t, "BLOCK_K": block_k, "UPCAST": ptr == "*fp32"}
            specs.append(
                (_ghost_norm_sq_kernel,
                 {"a_ptr": ptr, "g_ptr": ptr, "partial_ptr": "*fp32", "T": "i32", "D": "i32", "P": "i32",
                  "NUM_T_BLOCKS": "i32", "NUM_PROGRAMS": "i32"}, flags, launch)
            )  # fmt: skip
            specs.append(
                (_gram_slice_kernel,
                 {"a_ptr": ptr, "g_ptr": ptr, "scratch_ptr": "*fp32", "T": "i32", "D": "i32", "P": "i32",
                  "NUM_T_BLOCKS": "i32", "NUM_PAIRS": "i32", "SLICES_A": "i32", "SLICES_G": "i32", "COLS_A": "i32",
                  "COLS_G": "i32"}, flags, launch)
            )  # fmt: skip
    for block_t in (16, 32, BLOCK_T):
        specs.append(
            (_gram_slices_product_kernel,
             {"scratch_ptr": "*fp32", "partial_ptr": "*fp32", "NUM_T_BLOCKS": "i32", "NUM_PAIRS": "i32",
              "SLICES_A": "i32", "SLICES_G": "i32"}, {"BLOCK_T": block_t}, launch)
        )  # fmt: skip
    specs.append(
        (
            _clip_factors_kernel,
            {"sq_ptr": "*fp32", "norms_ptr": "*fp32", "factors_ptr": "*fp32", "L": "i32", "B": "i32",
             "clip_norm": "fp32"},
            {"EPS": CLIP_EPS, "BLOCK": CLIP_BLOCK},
            {"num_warps": NUM_WARPS},
        )
    )  # fmt: skip
    return specs
