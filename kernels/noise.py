"""Triton kernels of the fused per-tensor Gaussian noise (stream: ``fastdp/ref/noise.py``).

For element i of tensor t, with z the fastdp noise stream averaged over NUM_DRAWS draws:
    add noise:  g[i] <- g[i] + std_t * z
    fused step: p[i] <- p[i] - step * (g[i] + std_t * z)        (g is read only)
in fp32, rounded once to the tensor's dtype.

The release kinds (``release_``; reference ``fastdp.ref.noise.release_``, per-element math
``release_element`` of ``csrc/include/fastdp/noise.h``, followed here operation for operation in
fp32 with IEEE division and square root), on float32 tensors:
    2 release:       g[i] <- (g[i] + std_t * z) / scale                 (the released mean)
    3 release + SGD: 2, then torch.optim.SGD's update of p[i] from g[i]  (momentum buffer: state 0,
                     its gradient weight 1 - dampening per tensor)
    4 release + Adam: 2, then torch.optim.Adam's / AdamW's update          (exp_avg, exp_avg_sq,
                     max_exp_avg_sq: states 0, 1, 2)
The optimizer's flags (maximize, nesterov, amsgrad, momentum != 0, weight_decay != 0) are constexpr
specialisations, so unused state pointers and loads vanish; its values are runtime fp32 arguments.

All kinds draw z with ``_noise_z`` (one noise implementation). Two launch paths each:
* ``_noise_list_kernel`` / ``_release_list_kernel`` — one launch over a whole list: program b
  handles chunk b (CHUNK elements of tensor ``chunk_tensor[b]``), pointers loaded from int64
  tables. The GPU path for lists. Full blocks of a chunk load and store unmasked, its tail masked;
  with ALIGNED (the host found every pointer 16-byte aligned) the offsets and pointers carry
  ``tl.multiple_of`` hints, so full blocks move 128-bit vectors.
* ``_noise_tensor_kernel`` / ``_release_tensor_kernel`` — one launch per tensor: the path under
  ``TRITON_INTERPRET=1`` and for a single tensor (the list kernels also run in the interpreter on
  CPU tensors, and are tested so).

seed and offset are not specialised (an offset that changes every step must not recompile).

Floors on an H100 (H100 SXM, HBM3 at 3.0 TB/s sustained (3.35 peak), fp32 67 TFLOP/s without tensor cores); nothing
measured on a GPU yet. Adding noise reads and writes each gradient: 8 bytes per float32 element, 8N / 3.0 TB/s (1.0
M parameters: 2.7 us). The fused noisy SGD step reads the gradient and the parameter and writes the parameter: 12
bytes, 12N / 3.0 TB/s (4.0 us per million). The release kinds read and write every tensor they touch, per float32
element: release 8 B (2.7 us per million), release + SGD without momentum 16 B (5.3 us), with momentum 24 B (8.0 us),
release + Adam/AdamW 32 B (10.7 us), with amsgrad 40 B (13.3 us). With 4 draws per value (every DP release) the
Philox rounds and Box-Muller transforms are about 200 integer and special-function instructions per element, which
may make the kernels compute-bound before they reach the bandwidth floor (most for the 8 B kinds). Target (issue 20):
the fused step and the release kinds at >= 85 % of the measured device-to-device copy bandwidth, >= 3x the eager loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from fastdp.kernels import INTERPRET, device_table

from fastdp.ref.noise import HYPER_FIELDS, RELEASE, RELEASE_ADAM, RELEASE_SGD

BLOCK = 1024  # elements per inner block (256 Philox groups of 4)
RELEASE_BLOCK = 1024  # the release kinds' block (no spills at 8 warps, tests/hopper_compile.py)
CHUNK = 16384  # elements per program of the list kernels
NUM_WARPS = 8  # 4 spill 8 B of stack in the list kernel with 4 draws or the fused update (sm_90)
ALIGNMENT = 16  # bytes: every pointer of a list launch aligned so -> ALIGNED (128-bit vector loads and stores)


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
def _noise_z(begin, stream_start, seed, offset, BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr):
    """The noise z (fp32, N(0, 1)) of a tensor's elements [begin, begin + BLOCK): stream elements from
    ``stream_start + begin`` (both multiples of 4), averaged over NUM_DRAWS draws. Every kind draws here."""
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
    return z


@triton.jit
def _offsets(begin, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Element indices [begin, begin + BLOCK); with ALIGNED the hints that make them 128-bit vectorisable (begin is a
    multiple of BLOCK on every path that passes ALIGNED)."""
    idx = begin + tl.arange(0, BLOCK)
    if ALIGNED:
        idx = tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
    return idx


@triton.jit
def _load(ptr, idx, numel, MASKED: tl.constexpr):
    """fp32 values of ptr[idx]; masked to idx < numel (0 past the end) or, for a full block, unmasked."""
    if MASKED:
        x = tl.load(ptr + idx, mask=idx < numel, other=0.0)
    else:
        x = tl.load(ptr + idx)
    return x.to(tl.float32)


@triton.jit
def _store(ptr, idx, numel, value, MASKED: tl.constexpr):
    """ptr[idx] <- value rounded to ptr's dtype; masked to idx < numel, or unmasked for a full block."""
    if MASKED:
        tl.store(ptr + idx, value.to(ptr.dtype.element_ty), mask=idx < numel)
    else:
        tl.store(ptr + idx, value.to(ptr.dtype.element_ty))


@triton.jit
def _pointer(table, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor t's address from an int64 table as a DTYPE pointer; with ALIGNED the hint that it is 16-byte aligned
    (the host checked it). The hint is set here, on the op that makes the pointer (a hint on a helper's argument is
    lost)."""
    ptr = tl.load(table + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


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
    MASKED: tl.constexpr,  # False only for a full block (begin + BLOCK <= numel)
    ALIGNED: tl.constexpr,  # pointers 16-byte aligned and begin a multiple of BLOCK
):
    """Noise (or the noisy SGD step) on elements [begin, begin + BLOCK) of one tensor."""
    z = _noise_z(begin, stream_start, seed, offset, BLOCK, NUM_DRAWS)
    idx = _offsets(begin, BLOCK, ALIGNED)
    noisy = _load(grad_ptr, idx, numel, MASKED) + std * z
    if FUSED:
        p = _load(param_ptr, idx, numel, MASKED)
        _store(param_ptr, idx, numel, p - step * noisy, MASKED)
    else:
        _store(grad_ptr, idx, numel, noisy, MASKED)


@triton.jit(do_not_specialize=["seed", "offset"])
def _noise_tensor_kernel(
    grad_ptr, param_ptr, numel, stream_start, std, seed, offset, step,
    BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """One tensor: program i handles elements [i * BLOCK, (i + 1) * BLOCK)."""
    begin = tl.program_id(0).to(tl.int64) * BLOCK
    _noise_block(grad_ptr, param_ptr, begin, numel, stream_start, std, seed, offset, step,
                 BLOCK, NUM_DRAWS, FUSED, True, False)  # fmt: skip


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
    ALIGNED: tl.constexpr,  # every pointer of the list 16-byte aligned (host-checked)
):  # fmt: skip
    """Every tensor of a list in one launch: program b handles chunk b (full blocks unmasked, then the tail)."""
    chunk = tl.program_id(0).to(tl.int64)
    t = tl.load(chunk_tensor + chunk).to(tl.int64)
    numel = tl.load(numels + t)
    stream_start = tl.load(stream_starts + t)
    std = tl.load(stds + t)
    grad_ptr = _pointer(grad_ptrs, t, DTYPE, ALIGNED)
    param_ptr = grad_ptr
    if FUSED:
        param_ptr = _pointer(param_ptrs, t, DTYPE, ALIGNED)
    chunk_begin = (chunk - tl.load(first_chunks + t)) * CHUNK
    size = tl.minimum(numel - chunk_begin, CHUNK)  # elements of this chunk
    if ALIGNED:  # full blocks unmasked (128-bit vectors), then the masked tail
        full = size // BLOCK * BLOCK
        for i in tl.range(0, full, BLOCK):
            _noise_block(grad_ptr, param_ptr, chunk_begin + i, numel, stream_start, std, seed, offset,
                         step, BLOCK, NUM_DRAWS, FUSED, False, True)  # fmt: skip
        if full < size:
            _noise_block(grad_ptr, param_ptr, chunk_begin + full, numel, stream_start, std, seed, offset,
                         step, BLOCK, NUM_DRAWS, FUSED, True, True)  # fmt: skip
    else:  # scalar accesses anyway: every block masked, one copy of the block (with the unmasked/tail split, ptxas
        # kept 8 B of stack at 4 draws: the local array of libdevice's sin/cos slow-path range reduction)
        for i in tl.range(0, size, BLOCK):
            _noise_block(grad_ptr, param_ptr, chunk_begin + i, numel, stream_start, std, seed, offset,
                         step, BLOCK, NUM_DRAWS, FUSED, True, False)  # fmt: skip


@triton.jit
def _release_block(
    grad_ptr, param_ptr, s0_ptr, s1_ptr, s2_ptr,  # one tensor's float32 buffers (unused ones: any pointer)
    begin, numel, stream_start, std, grad_weight, seed, offset,  # as in _noise_block; grad_weight: SGD momentum's
    scale, lr, weight_decay, decay, momentum, beta1_weight, beta2, beta2_weight, eps, step_size, bc2_sqrt,  # fp32
    BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr,
    UPDATE: tl.constexpr,  # 2 release, 3 + SGD, 4 + Adam/AdamW
    MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,  # weight_decay != 0
    MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,  # SGD: momentum != 0, nesterov
    AMSGRAD: tl.constexpr,  # Adam
    MASKED: tl.constexpr, ALIGNED: tl.constexpr,  # as in _noise_block
):  # fmt: skip
    """The release kinds on elements [begin, begin + BLOCK) of one tensor: ``release_element`` of
    ``csrc/include/fastdp/noise.h`` in its fp32 order of operations (IEEE division and square root)."""
    z = _noise_z(begin, stream_start, seed, offset, BLOCK, NUM_DRAWS)
    idx = _offsets(begin, BLOCK, ALIGNED)
    noisy = _load(grad_ptr, idx, numel, MASKED) + std * z
    g = tl.div_rn(noisy, tl.zeros_like(noisy) + scale)
    _store(grad_ptr, idx, numel, g, MASKED)
    if UPDATE != 2:
        p = _load(param_ptr, idx, numel, MASKED)
        d = g
        if MAXIMIZE:
            d = -g
        if WEIGHT_DECAY:
            d = d + weight_decay * p
        if UPDATE == 3:
            if MOMENTUM:
                s0 = momentum * _load(s0_ptr, idx, numel, MASKED) + grad_weight * d
                _store(s0_ptr, idx, numel, s0, MASKED)
                if NESTEROV:
                    d = d + momentum * s0
                else:
                    d = s0
            p = p - lr * d
        else:
            p = p * decay
            s0 = _load(s0_ptr, idx, numel, MASKED)
            s0 = s0 + beta1_weight * (d - s0)
            s1 = _load(s1_ptr, idx, numel, MASKED) * beta2 + beta2_weight * d * d
            _store(s0_ptr, idx, numel, s0, MASKED)
            _store(s1_ptr, idx, numel, s1, MASKED)
            second = s1
            if AMSGRAD:
                s2 = _load(s2_ptr, idx, numel, MASKED)
                s2 = tl.where(s2 > s1, s2, s1)
                _store(s2_ptr, idx, numel, s2, MASKED)
                second = s2
            denom = tl.div_rn(tl.sqrt_rn(second), tl.zeros_like(second) + bc2_sqrt) + eps
            p = p - step_size * tl.div_rn(s0, denom)
        _store(param_ptr, idx, numel, p, MASKED)


@triton.jit(do_not_specialize=["seed", "offset"])
def _release_tensor_kernel(
    grad_ptr, param_ptr, s0_ptr, s1_ptr, s2_ptr, numel, stream_start, std, grad_weight, seed, offset,
    scale, lr, weight_decay, decay, momentum, beta1_weight, beta2, beta2_weight, eps, step_size, bc2_sqrt,
    BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr, UPDATE: tl.constexpr, MAXIMIZE: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, AMSGRAD: tl.constexpr,
):  # fmt: skip
    """One tensor: program i handles elements [i * BLOCK, (i + 1) * BLOCK)."""
    begin = tl.program_id(0).to(tl.int64) * BLOCK
    _release_block(grad_ptr, param_ptr, s0_ptr, s1_ptr, s2_ptr, begin, numel, stream_start, std, grad_weight, seed,
                   offset, scale, lr, weight_decay, decay, momentum, beta1_weight, beta2, beta2_weight, eps, step_size,
                   bc2_sqrt, BLOCK, NUM_DRAWS, UPDATE, MAXIMIZE, WEIGHT_DECAY, MOMENTUM, NESTEROV, AMSGRAD,
                   True, False)  # fmt: skip


@triton.jit(do_not_specialize=["seed", "offset"])
def _release_list_kernel(
    grad_ptrs, param_ptrs, s0_ptrs, s1_ptrs, s2_ptrs,  # int64[T]: addresses (unused ones: zeros, never loaded)
    numels, stream_starts, first_chunks,  # int64[T], as in _noise_list_kernel
    stds, grad_weights,  # fp32[T]
    chunk_tensor,  # int32[num_chunks]: tensor of each chunk
    seed, offset,
    scale, lr, weight_decay, decay, momentum, beta1_weight, beta2, beta2_weight, eps, step_size, bc2_sqrt,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr, UPDATE: tl.constexpr,
    MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
    AMSGRAD: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Every (float32) tensor of a list in one launch: program b handles chunk b (full blocks unmasked, then the
    tail); pointer tables of the states an UPDATE and its flags do not use are never read."""
    chunk = tl.program_id(0).to(tl.int64)
    t = tl.load(chunk_tensor + chunk).to(tl.int64)
    numel = tl.load(numels + t)
    stream_start = tl.load(stream_starts + t)
    std = tl.load(stds + t)
    grad_weight = 1.0
    grad_ptr = _pointer(grad_ptrs, t, tl.float32, ALIGNED)
    param_ptr = grad_ptr
    s0_ptr = grad_ptr
    s1_ptr = grad_ptr
    s2_ptr = grad_ptr
    if UPDATE != 2:
        param_ptr = _pointer(param_ptrs, t, tl.float32, ALIGNED)
    if (UPDATE == 3 and MOMENTUM) or UPDATE == 4:
        s0_ptr = _pointer(s0_ptrs, t, tl.float32, ALIGNED)
    if UPDATE == 3 and MOMENTUM:
        grad_weight = tl.load(grad_weights + t)
    if UPDATE == 4:
        s1_ptr = _pointer(s1_ptrs, t, tl.float32, ALIGNED)
    if UPDATE == 4 and AMSGRAD:
        s2_ptr = _pointer(s2_ptrs, t, tl.float32, ALIGNED)
    chunk_begin = (chunk - tl.load(first_chunks + t)) * CHUNK
    size = tl.minimum(numel - chunk_begin, CHUNK)  # elements of this chunk
    if ALIGNED:  # full blocks unmasked (128-bit vectors), then the masked tail
        full = size // BLOCK * BLOCK
        for i in tl.range(0, full, BLOCK):
            _release_block(grad_ptr, param_ptr, s0_ptr, s1_ptr, s2_ptr, chunk_begin + i, numel, stream_start, std,
                           grad_weight, seed, offset, scale, lr, weight_decay, decay, momentum, beta1_weight, beta2,
                           beta2_weight, eps, step_size, bc2_sqrt, BLOCK, NUM_DRAWS, UPDATE, MAXIMIZE, WEIGHT_DECAY,
                           MOMENTUM, NESTEROV, AMSGRAD, False, True)  # fmt: skip
        if full < size:
            _release_block(grad_ptr, param_ptr, s0_ptr, s1_ptr, s2_ptr, chunk_begin + full, numel, stream_start,
                           std, grad_weight, seed, offset, scale, lr, weight_decay, decay, momentum, beta1_weight,
                           beta2, beta2_weight, eps, step_size, bc2_sqrt, BLOCK, NUM_DRAWS, UPDATE, MAXIMIZE,
                           WEIGHT_DECAY, MOMENTUM, NESTEROV, AMSGRAD, True, True)  # fmt: skip
    else:  # scalar accesses anyway: every block masked, one copy of the block (with the unmasked/tail split, ptxas
        # kept 8 B of stack at 4 draws: the local array of libdevice's sin/cos slow-path range reduction)
        for i in tl.range(0, size, BLOCK):
            _release_block(grad_ptr, param_ptr, s0_ptr, s1_ptr, s2_ptr, chunk_begin + i, numel, stream_start, std,
                           grad_weight, seed, offset, scale, lr, weight_decay, decay, momentum, beta1_weight, beta2,
                           beta2_weight, eps, step_size, bc2_sqrt, BLOCK, NUM_DRAWS, UPDATE, MAXIMIZE, WEIGHT_DECAY,
                           MOMENTUM, NESTEROV, AMSGRAD, True, False)  # fmt: skip


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _aligned_all(tensors) -> bool:
    """Every tensor's data 16-byte aligned (ALIGNED of the list kernels)."""
    return all(x.data_ptr() % ALIGNMENT == 0 for x in tensors)


def _chunk_tables(grads, device):
    """(number of chunks, each tensor's first chunk, the int32 chunk -> tensor table on the device)."""
    chunks = [triton.cdiv(g.numel(), CHUNK) for g in grads]
    first = [0]
    for count in chunks[:-1]:
        first.append(first[-1] + count)
    chunk_tensor = device_table(
        torch.repeat_interleave(torch.arange(len(grads), dtype=torch.int32), torch.tensor(chunks)), torch.int32, device
    )
    return sum(chunks), first, chunk_tensor


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
    """One launch over the whole list; per-tensor tables go to the device in async copies."""
    fused = len(params) > 0
    device = grads[0].device
    num_chunks, first, chunk_tensor = _chunk_tables(grads, device)
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
    std_table = device_table(stds, torch.float32, device)
    _noise_list_kernel[(num_chunks,)](
        table[0], table[1], table[2], table[3], table[4], std_table, chunk_tensor, seed, offset, float(step),
        DTYPE=_TL_DTYPES[grads[0].dtype], CHUNK=CHUNK, BLOCK=BLOCK, NUM_DRAWS=num_draws, FUSED=fused,
        ALIGNED=_aligned_all([*grads, *params]), num_warps=NUM_WARPS,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ the release kinds

_VALUE_FIELDS = HYPER_FIELDS[:11]  # the runtime fp32 arguments, in the kernels' order
assert _VALUE_FIELDS == ("scale", "lr", "weight_decay", "decay", "momentum", "beta1_weight", "beta2", "beta2_weight",
                         "eps", "step_size", "bc2_sqrt")  # fmt: skip


def _release_flags(update: int, h: dict) -> dict:
    """The constexpr flags of an update (those it does not read are False: one compiled variant per behaviour).
    Zero tests are on the fp32 values, as ``release_element``'s ``!= 0.0f``."""
    nonzero = {name: bool(np.float32(h[name]) != 0) for name in ("weight_decay", "momentum")}
    sgd, adam = update == RELEASE_SGD, update == RELEASE_ADAM
    return {
        "UPDATE": update,
        "MAXIMIZE": update != RELEASE and bool(h["maximize"]),
        "WEIGHT_DECAY": update != RELEASE and nonzero["weight_decay"],
        "MOMENTUM": sgd and nonzero["momentum"],
        "NESTEROV": sgd and nonzero["momentum"] and bool(h["nesterov"]),
        "AMSGRAD": adam and bool(h["amsgrad"]),
    }


def release_(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    stds: Sequence[float],
    starts: Sequence[int],
    grad_weights: Sequence[float],
    seed: int,
    offset: int,
    num_draws: int,
    update: int,
    hyper: Sequence[float],
) -> None:
    """Launch the release kernels; same convention as ``fastdp.ref.noise.release_`` (and ``fastdp._C.release_``).

    Inputs: float32, contiguous, one device (checked by ``fastdp.ops.noise``); ``states`` three lists, each empty or
    one tensor per grad; ``hyper`` the values of ``HYPER_FIELDS``.
    """
    if update not in (RELEASE, RELEASE_SGD, RELEASE_ADAM):
        raise ValueError(f"fastdp release: update must be {RELEASE}, {RELEASE_SGD} or {RELEASE_ADAM}, got {update}")
    if num_draws not in (1, 4):
        raise ValueError(f"fastdp release: num_draws must be 1 or 4, got {num_draws}")
    h = dict(zip(HYPER_FIELDS, hyper, strict=True))
    flags = _release_flags(update, h)
    needed = [flags["MOMENTUM"] or update == RELEASE_ADAM, update == RELEASE_ADAM, flags["AMSGRAD"]]
    if update != RELEASE and len(params) != len(grads):
        raise ValueError(f"fastdp release: update {update} needs one param per grad")
    if len(states) != 3 or any(need and len(s) != len(grads) for need, s in zip(needed, states, strict=True)):
        raise ValueError(f"fastdp release: update {update} with these flags needs one tensor per grad in states "
                         f"{[k for k, need in enumerate(needed) if need]} (three state lists in all)")  # fmt: skip
    work = [t for t in range(len(grads)) if grads[t].numel() > 0]
    if not work:
        return
    for t in work:
        if grads[t].dtype != torch.float32:
            raise TypeError(f"fastdp release: the Triton kernels take float32 tensors, grads[{t}] is {grads[t].dtype}")

    def sub(tensors, used=True):
        return [tensors[t] for t in work] if used else []

    device = grads[0].device
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:  # Triton launches on the current device's stream
        launch = _launch_release_per_tensor if INTERPRET or len(work) == 1 else _launch_release_list
        launch(sub(grads), sub(params, update != RELEASE),
               [sub(s, need) for s, need in zip(states, needed, strict=True)], [float(stds[t]) for t in work],
               [starts[t] for t in work],
               [float(grad_weights[t]) if flags["MOMENTUM"] else 1.0 for t in work], seed, offset,
               [float(h[name]) for name in _VALUE_FIELDS], dict(flags, NUM_DRAWS=num_draws))  # fmt: skip


def _launch_release_per_tensor(grads, params, states, stds, starts, grad_weights, seed, offset, values, flags) -> None:
    """One launch per tensor (the interpreter's path). ``states``: three lists, empty where the flags use none;
    ``values``: the hyperparameters of ``_VALUE_FIELDS``; ``flags``: NUM_DRAWS and ``_release_flags``."""
    for t, grad in enumerate(grads):
        p, s0, s1, s2 = (x[t] if x else grad for x in (params, *states))
        _release_tensor_kernel[(triton.cdiv(grad.numel(), RELEASE_BLOCK),)](
            grad, p, s0, s1, s2, grad.numel(), starts[t], stds[t], grad_weights[t], seed, offset, *values,
            BLOCK=RELEASE_BLOCK, **flags, num_warps=NUM_WARPS,
        )  # fmt: skip


def _launch_release_list(grads, params, states, stds, starts, grad_weights, seed, offset, values, flags) -> None:
    """One launch over the whole list (arguments as in ``_launch_release_per_tensor``); per-tensor tables go to the
    device in async copies."""
    device = grads[0].device
    num_chunks, first, chunk_tensor = _chunk_tables(grads, device)
    zeros = [0] * len(grads)
    table = device_table(
        [*([x.data_ptr() for x in tensors] if tensors else zeros for tensors in (grads, params, *states)),
         [g.numel() for g in grads], list(starts), first],
        torch.int64,
        device,
    )  # fmt: skip
    floats = device_table([stds, grad_weights], torch.float32, device)
    _release_list_kernel[(num_chunks,)](
        table[0], table[1], table[2], table[3], table[4], table[5], table[6], table[7], floats[0], floats[1],
        chunk_tensor, seed, offset, *values, CHUNK=CHUNK, BLOCK=RELEASE_BLOCK, **flags,
        ALIGNED=_aligned_all([*grads, *params, *(x for s in states for x in s)]), num_warps=NUM_WARPS,
    )  # fmt: skip


def _release_flag_sets() -> list[dict]:
    """Every flag combination ``_release_flags`` can produce: 1 for release, 12 for SGD, 8 for Adam."""
    sets = [_release_flags(RELEASE, dict.fromkeys(HYPER_FIELDS, 0.0))]
    for maximize in (False, True):
        for weight_decay in (0.0, 0.01):
            for momentum, nesterov in ((0.0, False), (0.9, False), (0.9, True)):
                h = dict(dict.fromkeys(HYPER_FIELDS, 0.0), maximize=maximize, weight_decay=weight_decay,
                         momentum=momentum, nesterov=nesterov)  # fmt: skip
                sets.append(_release_flags(RELEASE_SGD, h))
            for amsgrad in (False, True):
                h = dict(dict.fromkeys(HYPER_FIELDS, 0.0), maximize=maximize, weight_decay=weight_decay,
                         amsgrad=amsgrad)  # fmt: skip
                sets.append(_release_flags(RELEASE_ADAM, h))
    return sets


def hopper_compile_specs():
    """(kernel, signature, constexprs, launch options) of every kernel configuration the launchers can choose, for the
    sm_90 compile check."""
    specs = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
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
                for aligned in (False, True):
                    specs.append(
                        (
                            _noise_list_kernel,
                            {"grad_ptrs": "*i64", "param_ptrs": "*i64", "numels": "*i64", "stream_starts": "*i64",
                             "first_chunks": "*i64", "stds": "*fp32", "chunk_tensor": "*i32", "seed": "i64",
                             "offset": "i64", "step": "fp32"},
                            {"DTYPE": _TL_DTYPES[dtype], "CHUNK": CHUNK, **flags, "ALIGNED": aligned},
                            {"num_warps": NUM_WARPS},
                        )
                    )  # fmt: skip
    values = dict.fromkeys(_VALUE_FIELDS, "fp32")
    tensor_signature = {**dict.fromkeys(("grad_ptr", "param_ptr", "s0_ptr", "s1_ptr", "s2_ptr"), "*fp32"),
                        "numel": "i64", "stream_start": "i64", "std": "fp32", "grad_weight": "fp32", "seed": "i64",
                        "offset": "i64", **values}  # fmt: skip
    list_signature = {**dict.fromkeys(("grad_ptrs", "param_ptrs", "s0_ptrs", "s1_ptrs", "s2_ptrs", "numels",
                                       "stream_starts", "first_chunks"), "*i64"),
                      "stds": "*fp32", "grad_weights": "*fp32", "chunk_tensor": "*i32", "seed": "i64",
                      "offset": "i64", **values}  # fmt: skip
    for flags in _release_flag_sets():
        for draws in (1, 4):
            common = {"BLOCK": RELEASE_BLOCK, "NUM_DRAWS": draws, **flags}
            specs.append((_release_tensor_kernel, tensor_signature, common, {"num_warps": NUM_WARPS}))
            for aligned in (False, True):
                specs.append(
                    (_release_list_kernel, list_signature, {"CHUNK": CHUNK, **common, "ALIGNED": aligned},
                     {"num_warps": NUM_WARPS})
                )  # fmt: skip
    return specs


def hopper_ptx_absent() -> dict:
    """PTX the sm_90 compile check must not find in the release kernels: approximate divisions and square roots
    (``release_element`` divides and takes sqrtf in IEEE fp32)."""
    approximate = ("sqrt.approx", "div.full", "div.approx", "rcp.approx")
    return {"_release_tensor_kernel": approximate, "_release_list_kernel": approximate}


def hopper_ptx_present() -> dict:
    """PTX the sm_90 compile check must find, per kernel: (constexprs the variant has, regex). The list kernels with
    ALIGNED on float32 move full blocks as 128-bit vectors."""
    vector_load = r"ld\.global(\.[a-z0-9]+)*\.v4\.(b32|f32)"
    vector_store = r"st\.global(\.[a-z0-9]+)*\.v4\.(b32|f32)"
    return {
        "_noise_list_kernel": [({"ALIGNED": True, "DTYPE": tl.float32}, vector_load),
                               ({"ALIGNED": True, "DTYPE": tl.float32}, vector_store)],
        "_release_list_kernel": [({"ALIGNED": True}, vector_load), ({"ALIGNED": True}, vector_store)],
    }  # fmt: skip
