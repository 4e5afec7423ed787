"""Triton kernel of the batched power iteration (math: ``fastdp/ref/spectral.py``).

For each matrix W_l [m_l, n_l] and unit right vector u_l, ``iters`` steps of

    v <- W u / ||W u||,    u <- W^T v / ||W^T v||,    sigma_hat = ||W^T v||   (last step)

in fp32 (tiles of W upcast on load; vectors kept in fp32).

One launch over the whole list, with no pointer tables (so the same path runs under
``TRITON_INTERPRET=1``): the host packs the matrices into one flat buffer (one copy,
1/(2 iters) of the kernel's reads) and passes int64 offset tables; program l handles
matrix l, looping over masked [BLOCK_M, BLOCK_N] tiles. The vectors live in flat fp32
buffers; a program writes its v (or u) in one pass and reads it in the next, with a
block-wide barrier in between. Norms are carried as scale factors and applied on the next
read, so each step reads W twice and writes u and v once.

Load balance: one program per matrix, so the largest matrix sets the time (fine for
the layer lists of Lipschitz networks; a matrix far larger than the others would want a
split over programs with a grid-wide reduction).

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores); nothing
measured on a GPU yet. Each iteration reads W twice (W u and W^T v): 2 m n elements, so for a 4096 x 4096 float32
matrix 134 MB, 45 us per iteration at 3.0 TB/s. One program per matrix (this kernel) gets one SM's bandwidth, about
1/132 of that: the whole-GPU split of issue 17 is owed. Target: >= 2x a plain torch loop for n <= 1024 with no host
synchronisation, then >= 50 % of the bandwidth floor for large matrices.
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


def power_iteration(
    weights: list[torch.Tensor], vectors: list[torch.Tensor], iters: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One launch over all matrices; same convention as ``fastdp.ref.power_iteration``.

    Inputs (checked by ``fastdp.ops.spectral``): non-empty 2-D matrices on one device,
    float32/float16/bfloat16 (mixed dtypes are packed as float32), vectors u_l [n_l].
    Returns fp32 ``(sigma [L], u list, v list)``.
    """
    device = weights[0].device
    dtypes = {w.dtype for w in weights}
    pack_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    flat = torch.cat([w.reshape(-1).to(pack_dtype) for w in weights])
    ms = [w.shape[0] for w in weights]
    ns = [w.shape[1] for w in weights]
    w_offs, u_offs, v_offs = [0], [0], [0]
    for m, n in zip(ms[:-1], ns[:-1], strict=True):
        w_offs.append(w_offs[-1] + m * n)
        u_offs.append(u_offs[-1] + n)
        v_offs.append(v_offs[-1] + m)
    meta = device_table([w_offs, u_offs, v_offs, ms, ns], torch.int64, device)
    us = [u.to(device=device, dtype=torch.float32).reshape(-1) for u in vectors]
    u_buf = torch.cat([u / torch.linalg.vector_norm(u).clamp_min(EPS) for u in us])
    v_buf = torch.empty(sum(ms), dtype=torch.float32, device=device)
    sigma = torch.empty(len(weights), dtype=torch.float32, device=device)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _power_iteration_kernel[(len(weights),)](
            flat, u_buf, v_buf, sigma, meta, len(weights), iters,
            EPS=EPS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        )  # fmt: skip
    u_out = [t.clone() for t in torch.split(u_buf, ns)]
    v_out = [t.clone() for t in torch.split(v_buf, ms)]
    return sigma, u_out, v_out


def hopper_ptx_absent() -> dict:
    """PTX the sm_90 compile check must not find: approximate square roots and divisions (the CUDA kernel's sqrtf
    and / are IEEE, and the two backends must agree on sigma)."""
    return {"_power_iteration_kernel": ("sqrt.approx", "div.full", "div.approx", "rcp.approx")}


def hopper_compile_specs():
    """(kernel, signature, constexprs) of every kernel here, for the sm_90 compile check."""
    flags = {"EPS": EPS, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}
    return [
        (
            _power_iteration_kernel,
            {
                "w_ptr": ptr,
                "u_ptr": "*fp32",
                "v_ptr": "*fp32",
                "sigma_ptr": "*fp32",
                "meta_ptr": "*i64",
                "num_layers": "i32",
                "iters": "i32",
            },
            flags,
            {"num_warps": NUM_WARPS},
        )  # fmt: skip
        for ptr in ("*fp32", "*fp16", "*bf16")
    ]
