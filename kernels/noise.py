"""Triton kernels of the fused per-tensor Gaussian noise (stream: ``fastdp/ref/noise.py``).

For element i of tensor t, with z the fastdp noise stream averaged over NUM_DRAWS draws:
    add noise:  g[i] <- g[i] + std_t * z
    fused step: p[i] <- p[i] - step * (g[i] + std_t * z)        (g is read only)
in fp32, rounded once to the tensor's dtype.

Two launch paths share the block body ``_noise_block``:
* ``_noise_list_kernel`` — one launch over a whole list: program b handles chunk b
  (CHUNK elements of tensor ``chunk_tensor[b]``), pointers loaded from int64 tables.
  The GPU path for lists.
* ``_noise_tensor_kernel`` — one launch per tensor: the path under ``TRITON_INTERPRET=1``
  (the list kernel also runs there on CPU tensors, and is tested so).

seed and offset are not specialised (an offset that changes every step must not recompile).

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores); nothing
measured on a GPU yet. Adding noise reads and writes each gradient: 8 bytes per float32 element, 8N / 3.0 TB/s (1.0
M parameters: 2.7 us). The fused noisy SGD step reads the gradient and the parameter and writes the parameter: 12
bytes, 12N / 3.0 TB/s (4.0 us per million). With 4 draws per value (every DP release) the Philox rounds and Box-
Muller transforms are about 200 integer and special-function instructions per element, which may make the kernel
compute-bound before it reaches the bandwidth floor. Target (issue 20): the fused step at >= 85 % of the measured
device-to-device copy bandwidth, >= 3x the eager loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from fastdp.kernels import INTERPRET, device_table

BLOCK = 1024  # elements per inner block (256 Philox groups of 4)
CHUNK = 16384  # elements per program of the list kernel
NUM_WARPS = 8  # 4 spill 8 B of stack in the list kernel with 4 draws or the fused update (sm_90)


@triton.jit
def _normal4(group, draw: tl.constexpr, seed, offset):
    """Four N(0, 1) vectors from one Philox4x32-10 call per group index (uint64 vector)."""
    offset = tl.cast(offset, tl.int64)  # an int argument may arrive as i32 or a constexpr
    c0 = (group & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((group >> 32) + (draw << 28)).to(tl.uint32)
    zeros = tl.zeros_like(c0)
    c2 = zeros + (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = zeros + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    # u in (0, 1]: the smallest value 2^-33 keeps the logarithm finite.
    u0 = r0.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    u1 = r1.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    u2 = r2.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    u3 = r3.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    rad0 = tl.sqrt_rn(-2.0 * tl.log(u0))  # correctly rounded, as in the CUDA and CPU kernels
    rad1 = tl.sqrt_rn(-2.0 * tl.log(u2))
    angle0 = 6.283185307179586 * u1
    angle1 = 6.283185307179586 * u3
    return rad0 * tl.cos(angle0), rad0 * tl.sin(angle0), rad1 * tl.cos(angle1), rad1 * tl.sin(angle1)


@triton.jit
def _noise_block(
    grad_ptr,  # tensor's gradient (read-write, or read only when FUSED)
    param_ptr,  # tensor's parameter (written when FUSED)
    begin,  # int64: first element of this block within the tensor
    numel,  # int64: elements in the tensor
    stream_start,  # int64: stream index of the tensor's element 0 (multiple of 4)
    std,  # fp32: noise std of this tensor
    seed,  # int64: Philox key
    offset,  # int64: Philox counter words 2-3 (one value per step)
    step,  # fp32: lr / scale (FUSED only)
    BLOCK: tl.constexpr,
    NUM_DRAWS: tl.constexpr,
    FUSED: tl.constexpr,
):
    """Noise (or the noisy SGD step) on elements [begin, begin + BLOCK) of one tensor."""
    GROUPS: tl.constexpr = BLOCK // 4
    group = ((tl.cast(stream_start, tl.int64) + begin) // 4 + tl.arange(0, GROUPS)).to(tl.uint64)
    n0, n1, n2, n3 = _normal4(group, 0, seed, offset)
    for draw in tl.static_range(1, NUM_DRAWS):
        m0, m1, m2, m3 = _normal4(group, draw, seed, offset)
        n0, n1, n2, n3 = n0 + m0, n1 + m1, n2 + m2, n3 + m3
    # Interleave so element 4q + j takes n_j of group q.
    z = tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), [BLOCK])
    tl.static_assert(NUM_DRAWS == 1 or NUM_DRAWS == 4, "NUM_DRAWS must be 1 or 4")
    if NUM_DRAWS == 4:
        z = z * 0.5  # sum of 4 draws / sqrt(4)
    idx = begin + tl.arange(0, BLOCK)
    mask = idx < numel
    g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    noisy = g + std * z
    if FUSED:
        p = tl.load(param_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(param_ptr + idx, (p - step * noisy).to(param_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(grad_ptr + idx, noisy.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset"])
def _noise_tensor_kernel(
    grad_ptr, param_ptr, numel, stream_start, std, seed, offset, step,
    BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """One tensor: program i handles elements [i * BLOCK, (i + 1) * BLOCK)."""
    begin = tl.program_id(0).to(tl.int64) * BLOCK
    _noise_block(grad_ptr, param_ptr, begin, numel, stream_start, std, seed, offset, step,
                 BLOCK, NUM_DRAWS, FUSED)  # fmt: skip


@triton.jit(do_not_specialize=["seed", "offset"])
def _noise_list_kernel(
    grad_ptrs,  # int64[T]: addresses of the gradients
    param_ptrs,  # int64[T]: addresses of the parameters (FUSED only)
    numels,  # int64[T]
    stream_starts,  # int64[T]
    first_chunks,  # int64[T]: index of each tensor's first chunk
    stds,  # fp32[T]
    chunk_tensor,  # int32[num_chunks]: tensor of each chunk
    seed, offset, step,
    DTYPE: tl.constexpr,  # element type of every tensor in the list
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """Every tensor of a list in one launch: program b handles chunk b."""
    chunk = tl.program_id(0).to(tl.int64)
    t = tl.load(chunk_tensor + chunk).to(tl.int64)
    numel = tl.load(numels + t)
    stream_start = tl.load(stream_starts + t)
    std = tl.load(stds + t)
    grad_ptr = tl.load(grad_ptrs + t).to(tl.pointer_type(DTYPE))
    param_ptr = grad_ptr
    if FUSED:
        param_ptr = tl.load(param_ptrs + t).to(tl.pointer_type(DTYPE))
    chunk_begin = (chunk - tl.load(first_chunks + t)) * CHUNK
    for i in tl.range(0, CHUNK, BLOCK):
        _noise_block(grad_ptr, param_ptr, chunk_begin + i, numel, stream_start, std, seed, offset,
                     step, BLOCK, NUM_DRAWS, FUSED)  # fmt: skip


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def noise_(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    stds: Sequence[float],
    starts: Sequence[int],
    seed: int,
    offset: int,
    num_draws: int,
    step: float,
) -> None:
    """Launch the noise kernels; same convention as ``fastdp.ref.noise.noise_``.

    Inputs: one device, one dtype, contiguous (checked by ``fastdp.ops.noise``).
    """
    fused = len(params) > 0
    work = [t for t in range(len(grads)) if grads[t].numel() > 0]
    if not work:
        return
    device = grads[0].device
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:  # Triton launches on the current device's stream
        launch = _launch_per_tensor if INTERPRET or len(work) == 1 else _launch_list
        launch([grads[t] for t in work], [params[t] for t in work] if fused else [], [float(stds[t]) for t in work],
               [starts[t] for t in work], seed, offset, num_draws, step)  # fmt: skip


def _launch_per_tensor(grads, params, stds, starts, seed, offset, num_draws, step) -> None:
    """One launch per tensor (the interpreter's path). Arguments as in ``noise_``, no empty tensors."""
    fused = len(params) > 0
    for t, grad in enumerate(grads):
        _noise_tensor_kernel[(triton.cdiv(grad.numel(), BLOCK),)](
            grad, params[t] if fused else grad, grad.numel(), starts[t], stds[t], seed, offset, float(step),
            BLOCK=BLOCK, NUM_DRAWS=num_draws, FUSED=fused, num_warps=NUM_WARPS,
        )  # fmt: skip


def _launch_list(grads, params, stds, starts, seed, offset, num_draws, step) -> None:
    """One launch over the whole list; per-tensor tables go to the device in two async copies."""
    fused = len(params) > 0
    device = grads[0].device
    chunks = [triton.cdiv(g.numel(), CHUNK) for g in grads]
    first = [0]
    for count in chunks[:-1]:
        first.append(first[-1] + count)
    table = device_table(
        [
            [g.data_ptr() for g in grads],
            [p.data_ptr() for p in params] if fused else [0] * len(grads),
            [g.numel() for g in grads],
            list(starts),
            first,
        ],
        torch.int64,
        device,
    )
    chunk_tensor = device_table(
        torch.repeat_interleave(torch.arange(len(grads), dtype=torch.int32), torch.tensor(chunks)), torch.int32, device
    )
    std_table = device_table(stds, torch.float32, device)
    _noise_list_kernel[(sum(chunks),)](
        table[0], table[1], table[2], table[3], table[4], std_table, chunk_tensor, seed, offset, float(step),
        DTYPE=_TL_DTYPES[grads[0].dtype], CHUNK=CHUNK, BLOCK=BLOCK, NUM_DRAWS=num_draws, FUSED=fused,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def hopper_compile_specs():
    """(kernel, signature, constexprs, launch options) of every kernel here, for the sm_90 compile check."""
    specs = []
    for dtype, ptr in (("fp32", "*fp32"), ("fp16", "*fp16"), ("bf16", "*bf16")):
        for fused in (False, True):
            for draws in (1, 4):
                flags = {"BLOCK": BLOCK, "NUM_DRAWS": draws, "FUSED": fused}
                specs.append(
                    (
                        _noise_tensor_kernel,
                        {"grad_ptr": ptr, "param_ptr": ptr, "numel": "i64", "stream_start": "i64",
                         "std": "fp32", "seed": "i64", "offset": "i64", "step": "fp32"},
                        flags,
                        {"num_warps": NUM_WARPS},
                    )
                )  # fmt: skip
                specs.append(
                    (
                        _noise_list_kernel,
                        {"grad_ptrs": "*i64", "param_ptrs": "*i64", "numels": "*i64", "stream_starts": "*i64",
                         "first_chunks": "*i64", "stds": "*fp32", "chunk_tensor": "*i32", "seed": "i64",
                         "offset": "i64", "step": "fp32"},
                        {"DTYPE": _TL_DTYPES[{"fp32": torch.float32, "fp16": torch.float16,
                                              "bf16": torch.bfloat16}[dtype]], "CHUNK": CHUNK, **flags},
                        {"num_warps": NUM_WARPS},
                    )
                )  # fmt: skip
    return specs
