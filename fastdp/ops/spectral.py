"""Spectral norms for Lipschitz DP training: ``fastdp::power_iteration`` and friends.

Math and units: ``fastdp.ref.spectral``. ``power_iteration`` runs a FIXED number of steps
(no data-dependent stopping) on a list of matrices and returns estimates that are never
above the true spectral norms; ``certified_spectral_norm(s)`` returns bounds that are never
below them (Gram iteration, float64); ``conv_operator_norm`` estimates the operator norm of
a 2-D convolution on a given input shape (power iteration with the transposed convolution).

These ops take data, not graph nodes: no autograd formula, inputs are detached (the
constraint they serve is a projection applied after the optimiser step).

Input checks: every matrix is 2-D, non-empty, floating point; lists are non-empty; iteration
counts are in [1, 2**31) (Gram iterations: [1, 1023]); values (weights and warm-start vectors) are
finite (meta tensors carry no values: shape-only calls skip this check). The finiteness check costs
one device synchronisation per call; set ``fastdp.ops.spectral.CHECK_FINITE = False`` to skip it
(non-finite weights then give NaN estimates, and certified bounds +inf, never NaN). An all-zero
warm-start vector (what a zero matrix returns) means a cold start.

Backends: ``fastdp._backend.select("spectral", device)``; ``triton`` runs
``fastdp.kernels.spectral`` (small matrices: one launch over all of them, a program each; larger ones:
split over the whole GPU, two launches per step; at most 2 iters + 2 launches per call); ``cuda`` runs
``fastdp._C.power_iteration_cuda`` (csrc/cuda/spectral.cu, the same two paths) on
CUDA tensors and the reference on CPU tensors (no csrc/cpu kernel); float64 always runs
the reference. ``frobenius_distance_up`` on CPU tensors under ``cuda`` takes its sums from
``fastdp._C.frobenius_distance_sq`` (csrc/cpu/spectral.cpp: one pass, no float64 copies), its
rounding bound from the reference.
``certified_spectral_norm(s)`` and ``conv_operator_norm`` are torch only.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from fastdp import _backend, _ext
from fastdp.ref import spectral as ref

__all__ = [
    "certified_norm_cholesky",
    "certify_norm_at_most",
    "certified_spectral_norm",
    "certified_spectral_norms",
    "conv_operator_norm",
    "deferred_finite_checks",
    "frobenius_distance_up",
    "power_iteration",
]

CHECK_FINITE = True
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


MAX_ITERS = 2**31 - 1  # the CUDA kernels count steps in 32-bit ints
MAX_GRAM_ITERS = 1023  # the certified bound weighs step k by 2**-k: 2.0**1024 overflows a float64


def _check_iters(op: str, name: str, iters, most: int = MAX_ITERS) -> None:
    if isinstance(iters, bool) or not isinstance(iters, int):
        raise TypeError(f"fastdp {op}: {name} must be an int, got {type(iters).__name__}")
    if iters < 1:
        raise ValueError(f"fastdp {op}: {name} is {iters}; it must be >= 1 (a fixed number of steps)")
    if iters > most:
        raise ValueError(f"fastdp {op}: {name} is {iters}; it must be <= {most}")


def _check_matrix(op: str, name: str, w) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"fastdp {op}: {name} is a {type(w).__name__}, expected a torch.Tensor")
    if w.dim() != 2:
        raise ValueError(
            f"fastdp {op}: {name} has shape {tuple(w.shape)}; expected a 2-D matrix "
            "(reshape conv kernels to [C_out, C_in*kh*kw], or use conv_operator_norm)"
        )
    if w.numel() == 0:
        raise ValueError(f"fastdp {op}: {name} has shape {tuple(w.shape)}; expected a non-empty matrix")
    if w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fastdp {op}: {name} has dtype {w.dtype}; expected float32, float16, bfloat16 or float64")


def _check_matrices(op: str, weights) -> None:
    if isinstance(weights, torch.Tensor) or not isinstance(weights, (list, tuple)):
        raise TypeError(f"fastdp {op}: weights must be a list of 2-D tensors, got {type(weights).__name__}")
    if len(weights) == 0:
        raise ValueError(f"fastdp {op}: weights is an empty list; pass at least one 2-D matrix")
    for i, w in enumerate(weights):
        _check_matrix(op, f"weights[{i}]", w)
    device = weights[0].device
    for i, w in enumerate(weights):
        if w.device != device:
            raise ValueError(f"fastdp {op}: weights[{i}] is on {w.device} but weights[0] on {device}; use one device")


_deferred = threading.local()


@contextlib.contextmanager
def deferred_finite_checks():
    """Skip the per-call finiteness check (one host synchronisation each) inside this block, e.g. in a training
    step that must not synchronise; the caller then owns the check (the trainer checks the parameters once per
    epoch: non-finite weights give non-finite bounds, noise and parameters, never a silent finite result)."""
    previous = getattr(_deferred, "on", False)
    _deferred.on = True
    try:
        yield
    finally:
        _deferred.on = previous


def _check_finite(op: str, tensors: list[torch.Tensor], what: str, *more: tuple[str, list[torch.Tensor]]) -> None:
    """Refuse NaN/Inf in ``tensors`` (named ``what``) and in each further (name, tensors) group, with one host
    synchronisation for all of them. Meta tensors have no values to check (shape-only calls run on them)."""
    if not CHECK_FINITE or getattr(_deferred, "on", False):
        return
    groups = [(what, tensors), *more]
    index = [(name, i, t) for name, group in groups for i, t in enumerate(group) if t.device.type != "meta"]
    if not index:
        return
    finite = torch.stack([torch.isfinite(t).all().to(index[0][2].device) for _, _, t in index])
    if not bool(finite.all()):
        flags = finite.tolist()
        for name, _ in groups:
            bad = [i for (n, i, _), ok in zip(index, flags, strict=True) if n == name and not ok]
            if bad:
                raise ValueError(f"fastdp {op}: {name} {bad} contain NaN or Inf; power iteration needs finite values")


def _check_vectors(op: str, weights, vectors) -> None:
    if isinstance(vectors, torch.Tensor) or not isinstance(vectors, (list, tuple)):
        raise TypeError(f"fastdp {op}: vectors must be a list of 1-D tensors or None, got {type(vectors).__name__}")
    if len(vectors) != len(weights):
        raise ValueError(f"fastdp {op}: {len(vectors)} vectors for {len(weights)} weights; pass one per matrix")
    for i, (w, u) in enumerate(zip(weights, vectors, strict=True)):
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"fastdp {op}: vectors[{i}] is a {type(u).__name__}, expected a torch.Tensor")
        if u.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"fastdp {op}: vectors[{i}] has dtype {u.dtype}; expected a real floating-point vector (float32, "
                "float16, bfloat16 or float64: the u returned by the previous call)"
            )
        if u.numel() != w.shape[1]:
            raise ValueError(
                f"fastdp {op}: vectors[{i}] has {u.numel()} elements but weights[{i}] has {w.shape[1]} "
                "columns; pass the right vector u [n] returned by the previous call"
            )
        if u.device != w.device:
            raise ValueError(f"fastdp {op}: vectors[{i}] is on {u.device} but weights[{i}] on {w.device}")


def _warm_start(u: torch.Tensor) -> torch.Tensor:
    """u, or the cold start ``ref.default_start`` where u is all zeros: power iteration returns zero vectors for a
    zero matrix, and a zero start has no direction (the estimate would stay 0 whatever the matrix becomes, and a
    projection dividing by it would blow up). Decided on the device: no host synchronisation."""
    cold = ref.default_start(u.numel(), u.dtype, u.device).reshape(u.shape)
    return torch.where((u != 0).any(), u, cold)


def _out_dtype(weights) -> torch.dtype:
    return torch.float64 if any(w.dtype == torch.float64 for w in weights) else torch.float32


@torch.library.custom_op("fastdp::power_iteration", mutates_args=())
def _power_iteration_op(
    weights: list[torch.Tensor], vectors: list[torch.Tensor], iters: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    backend = _backend.select("spectral", weights[0].device.type)
    kernel_ok = all(w.dtype in _KERNEL_DTYPES for w in weights)
    with torch.no_grad():
        if backend == "triton" and kernel_ok:
            from fastdp.kernels import spectral as triton_spectral

            return triton_spectral.power_iteration(list(weights), list(vectors), iters)
        if backend == "cuda" and kernel_ok and weights[0].device.type == "cuda" and _ext.has_cuda_kernels():
            device = weights[0].device
            return _ext._C.power_iteration_cuda(
                [w.contiguous() for w in weights],
                [u.to(device=device, dtype=torch.float32).reshape(-1).contiguous() for u in vectors],
                iters,
            )
        return ref.power_iteration(list(weights), list(vectors), iters)


@_power_iteration_op.register_fake
def _(weights, vectors, iters):
    acc = _out_dtype(weights)
    sigma = weights[0].new_empty(len(weights), dtype=acc)
    us = [w.new_empty(w.shape[1], dtype=ref.accumulation_dtype(w.dtype)) for w in weights]
    vs = [w.new_empty(w.shape[0], dtype=ref.accumulation_dtype(w.dtype)) for w in weights]
    return sigma, us, vs


def power_iteration(
    weights: list[torch.Tensor], vectors: list[torch.Tensor] | None = None, iters: int = 10
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``iters`` power-iteration steps on each matrix W_l [m_l, n_l] (shapes may differ).

    One step: ``v = normalize(W u)``, ``u = normalize(W^T v)``; the estimate is
    ``sigma_hat_l = v^T W_l u = ||W_l^T v||`` with the final vectors. It never exceeds the
    true spectral norm (up to rounding) and converges to it from below. A fixed step
    count: no data-dependent stopping and no host synchronisation in the iteration.

    Args:
        weights: non-empty list of 2-D matrices (float32, float16, bfloat16 or float64, one device).
        vectors: warm-start right vectors u_l [n_l] (any scale; normalised first), e.g. the
            ``u`` list of the previous call; None starts from ``fastdp.ref.spectral.default_start``
            (normalised ones plus a small deterministic perturbation), and so does an all-zero vector.
        iters: number of steps, >= 1.

    Returns:
        ``(sigma_hat [L], u list [n_l], v list [m_l])``: float32 (float64 for float64 weights);
        u and v are unit vectors (zero for a zero matrix, with sigma_hat 0).
    """
    op = "power_iteration"
    _check_matrices(op, weights)
    _check_iters(op, "iters", iters)
    weights = [w.detach() for w in weights]
    if vectors is None:
        _check_finite(op, weights, "weights")
        vectors = [ref.default_start(w.shape[1], ref.accumulation_dtype(w.dtype), w.device) for w in weights]
    else:
        _check_vectors(op, weights, vectors)
        _check_finite(op, weights, "weights", ("vectors", list(vectors)))
        vectors = [_warm_start(u.detach().reshape(-1)) for u in vectors]
    return torch.ops.fastdp.power_iteration(weights, vectors, iters)


def certified_spectral_norm(w: torch.Tensor, iters: int = 6) -> torch.Tensor:
    """A certified upper bound on sigma_max(w) (Gram iteration, Delattre et al. 2023).

    ``iters`` Gram iterations in float64 on the smaller Gram side; the bound decreases to
    sigma_max as ``iters`` grows (within a factor rank^(1/2^(iters+1)): 1.6% for rank 64 at
    iters = 6) and is never below it: float64 rounding is covered by a 1e-9 relative slack
    and the result is rounded up to the output dtype. W is first scaled by an exact power of
    two (its largest entry into [0.5, 1)), so the bound holds for every finite matrix, however
    small or large its entries (a zero matrix gives 0; a bound that overflows the output dtype
    is +inf). O(min(m, n)^3) per iteration.

    Args:
        w: non-empty 2-D matrix (float32, float16, bfloat16 or float64), finite.
        iters: Gram iterations, >= 1.

    Returns:
        0-d tensor, float32 (float64 for float64 inputs), on w's device.
    """
    op = "certified_spectral_norm"
    _check_matrix(op, "w", w)
    _check_iters(op, "iters", iters, MAX_GRAM_ITERS)
    _check_finite(op, [w], "w")
    with torch.no_grad():
        return ref.certified_spectral_norm(w.detach(), iters)


def certified_spectral_norms(weights: list[torch.Tensor], iters: int = 6) -> torch.Tensor:
    """``certified_spectral_norm`` of each matrix of a non-empty list: [L], float32 (float64 if any is float64)."""
    op = "certified_spectral_norms"
    _check_matrices(op, weights)
    _check_iters(op, "iters", iters, MAX_GRAM_ITERS)
    _check_finite(op, list(weights), "weights")
    with torch.no_grad():
        return ref.certified_spectral_norms([w.detach() for w in weights], iters)


def certified_norm_cholesky(
    w: torch.Tensor, vector: torch.Tensor | None = None, steps: int = ref.LANCZOS_STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """A certified upper bound on sigma_max(w) for about one float64 Gram product: a warm Lanczos estimate
    checked by a Cholesky factorisation (``fastdp.ref.spectral.certified_norm_cholesky``).

    The bound is +inf when the check fails (the estimate was more than 2**-6 too low, e.g. a cold start on a matrix
    whose top singular values are close) or w has a NaN or Inf: take the minimum with another certified bound
    (``fastdp.nn.lipschitz`` carries one across training steps). Never below sigma_max(w).

    Args:
        w: non-empty 2-D matrix (float32, float16, bfloat16 or float64).
        vector: the vector this op returned for the previous weights (warm start), or None (cold start).
        steps: Lanczos steps before the check, >= 1.

    Returns:
        ``(bound, vector)``: float64 0-d bound on w's device, float64 unit vector [min(w.shape)].
    """
    op = "certified_norm_cholesky"
    _check_matrix(op, "w", w)
    _check_iters(op, "steps", steps)
    with torch.no_grad():
        return ref.certified_norm_cholesky(w.detach(), vector, steps)


def certify_norm_at_most(w: torch.Tensor, bound: torch.Tensor | float) -> torch.Tensor:
    """Whether a float64 Cholesky check proves sigma_max(w) <= ``bound`` (bool 0-d tensor on w's device; False when
    it cannot: a bound below the norm, or above it by less than the check's own rounding (about (n + m) n 2**-51
    relative); NaN or Inf anywhere). For certificates that come from outside, e.g. a loaded state dict
    (``fastdp.nn.lipschitz.LipschitzLinear``)."""
    _check_matrix("certify_norm_at_most", "w", w)
    bound = torch.as_tensor(bound, dtype=torch.float64, device=w.device)
    with torch.no_grad():
        return ref.certify_norm_at_most(w.detach(), bound)


def frobenius_distance_up(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A certified upper bound on ||a - b||_F (float64 0-d; exactly 0 for equal tensors, +inf for NaN/Inf), e.g. to
    carry a certified spectral-norm bound across a change of the weights: ||w + d||_2 <= ||w||_2 + ||d||_F."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise TypeError("fastdp frobenius_distance_up: a and b must be tensors")
    if a.shape != b.shape:
        raise ValueError(f"fastdp frobenius_distance_up: shapes differ, {tuple(a.shape)} and {tuple(b.shape)}")
    with torch.no_grad():
        a, b = a.detach(), b.detach()
        kernel = _backend.cpu_kernel("frobenius_distance_sq", "spectral", a, b) if a.dtype == b.dtype else None
        return ref.frobenius_distance_up(a, b, None if kernel is None else kernel(a, b))


def _pair(op: str, name: str, value) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    elif isinstance(value, (tuple, list)):
        pair = tuple(value)
    else:
        pair = ()
    if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
        raise ValueError(f"fastdp {op}: {name} is {value!r}; expected an int or a pair of ints")
    return pair


def conv_operator_norm(
    weight: torch.Tensor,
    input_shape: tuple[int, ...],
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    iters: int = 50,
    vector: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Power-iteration estimate of the operator norm of ``x -> conv2d(x, weight, ...)``.

    The map acts on one example of shape ``input_shape = (C_in, H, W)`` (zero padding as
    given); its adjoint is the transposed convolution that restores that shape. The estimate
    ``||A^T v||`` never exceeds the true norm and converges to it from below.

    Args:
        weight: conv kernel [C_out, C_in / groups, kh, kw], finite.
        input_shape: (C_in, H, W) of one example.
        stride, padding, dilation: ints or pairs, as in ``torch.nn.functional.conv2d``
            (numeric padding only).
        groups: as in conv2d.
        iters: power-iteration steps, >= 1.
        vector: warm start of shape ``input_shape`` (any scale), e.g. the vector returned by
            the previous call; None: ``fastdp.ref.spectral.default_start``.

    Returns:
        ``(sigma_hat, x)``: 0-d estimate and the unit right vector of shape ``input_shape``,
        float32 (float64 for float64 weights).
    """
    op = "conv_operator_norm"
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"fastdp {op}: weight is a {type(weight).__name__}, expected a torch.Tensor (a conv2d kernel)")
    if weight.dim() != 4 or weight.numel() == 0:
        raise ValueError(
            f"fastdp {op}: weight is {tuple(weight.shape)}; expected a non-empty conv2d kernel [C_out, C_in/groups, "
            "kh, kw]"
        )
    if weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fastdp {op}: weight has dtype {weight.dtype}; expected a floating dtype")
    if not (
        isinstance(input_shape, (tuple, list, torch.Size))
        and len(input_shape) == 3
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in input_shape)
    ):
        raise ValueError(f"fastdp {op}: input_shape is {input_shape!r}; expected (C_in, H, W) of one example (ints)")
    input_shape = tuple(input_shape)
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"fastdp {op}: groups must be an int, got {type(groups).__name__}")
    if groups < 1 or weight.shape[0] % groups:
        raise ValueError(
            f"fastdp {op}: groups is {groups}; expected an int >= 1 that divides C_out = {weight.shape[0]}"
        )
    if input_shape[0] != weight.shape[1] * groups:
        raise ValueError(
            f"fastdp {op}: input_shape has {input_shape[0]} channels but the kernel expects "
            f"{weight.shape[1] * groups} (weight.shape[1] * groups)"
        )
    stride, padding, dilation = (_pair(op, n, v) for n, v in (("stride", stride), ("padding", padding),
                                                               ("dilation", dilation)))  # fmt: skip
    for name, pair, least in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if min(pair) < least:
            raise ValueError(f"fastdp {op}: {name} is {pair}; expected ints >= {least}")
    out_hw = ref.conv_output_shape(input_shape, weight.shape, stride, padding, dilation)
    if min(out_hw) < 1:
        raise ValueError(
            f"fastdp {op}: input_shape {input_shape} gives an empty output {out_hw} with kernel "
            f"{tuple(weight.shape[2:])}, stride {stride}, padding {padding} and dilation {dilation}; use a larger "
            "input or more padding"
        )
    _check_iters(op, "iters", iters)
    _check_finite(op, [weight], "weight")
    if vector is not None:
        if not isinstance(vector, torch.Tensor) or vector.numel() != input_shape[0] * input_shape[1] * input_shape[2]:
            raise ValueError(f"fastdp {op}: vector must be a tensor of shape {input_shape} (the previous vector)")
        if vector.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"fastdp {op}: vector has dtype {vector.dtype}; expected a real floating-point tensor")
        if vector.device != weight.device:
            raise ValueError(f"fastdp {op}: vector is on {vector.device} but weight on {weight.device}; use one device")
        _check_finite(op, [vector], "vector")
        vector = _warm_start(vector.detach())
    with torch.no_grad():
        return ref.conv_operator_norm(weight.detach(), input_shape, stride, padding, dilation, groups, iters, vector)
