"""Orthonormalisation for Lipschitz DP training: ``fastdp::bjorck_orthonormalize``, the projection, RKO.

Math: ``fastdp.ref.orthogonal``. ``bjorck_orthonormalize`` runs a FIXED number of Björck
steps ``W <- (1 + beta) W - beta W W^T W`` (with the smaller Gram matrix) on each matrix of
a list; its inputs must have spectral norm <= 1 (divide by a spectral-norm estimate first:
``spectral_normalize_and_orthonormalize`` does, with power iteration, as deel-lip's
``SpectralConstraint``). ``rko_orthonormalize`` is deel-lip's reshaped kernel
orthogonalisation of a conv kernel with its ``_compute_conv_lip_factor`` rescaling.

No autograd (data in, data out; inputs detached): these are projections applied after the
optimiser step. Input checks as in ``fastdp.ops.spectral`` (2-D, non-empty, finite,
iteration counts >= 1); the finiteness check costs one device synchronisation per call
(``fastdp.ops.spectral.CHECK_FINITE = False`` skips it).

Backends: ``fastdp._backend.select("orthogonal", device)``. Both kernel backends take the
whole list at once (float32/float16/bfloat16 matrices; float64 ones always run the reference):
``triton`` runs ``fastdp.kernels.orthogonal`` — one launch of a fused kernel over all small
matrices (one program per matrix, every step) plus, per step, one batched Gram launch and one
batched update launch over all larger ones: at most 1 + 2 iters launches per call, whatever
the list's length; ``cuda`` runs ``fastdp._C.bjorck_cuda`` (csrc/cuda/orthogonal.cu: per
step one Gram launch and one fused-update launch over all matrices, 2 iters launches) on CUDA
tensors and the reference on CPU tensors (no csrc/cpu kernel).

``lipschitz_projection`` applies the deel-lip projection to a model's dense matrices and RKO
to its conv kernels with a single Björck call over all of them (``fastdp.nn.lipschitz.project_``
uses it after each optimiser step).
"""

from __future__ import annotations

import math

import torch

from fastdp import _backend, _ext
from fastdp._precision import exact_fp32
from fastdp.ops import spectral as spectral_ops
from fastdp.ref import orthogonal as ref

__all__ = [
    "bjorck_orthonormalize",
    "conv_lip_factor",
    "lipschitz_projection",
    "rko_orthonormalize",
    "spectral_normalize_and_orthonormalize",
]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _finite(x) -> bool:
    """math.isfinite, False for an int too large for a float (where math.isfinite raises OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _check_beta(op: str, beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"fastdp {op}: beta must be a float, got {type(beta).__name__}")
    if not (_finite(beta) and 0 < beta <= 1):
        raise ValueError(f"fastdp {op}: beta is {beta}; expected 0 < beta <= 1 (deel-lip uses 0.5)")


@torch.library.custom_op("fastdp::bjorck_orthonormalize", mutates_args=())
def _bjorck_op(weights: list[torch.Tensor], iters: int, beta: float) -> list[torch.Tensor]:
    device = weights[0].device
    backend = _backend.select("orthogonal", device.type)
    with torch.no_grad():
        if backend == "triton":
            from fastdp.kernels import orthogonal as triton_orthogonal

            kernel = triton_orthogonal.bjorck_orthonormalize
        elif backend == "cuda" and device.type == "cuda" and _ext.has_cuda_kernels():

            def kernel(ws, iters, beta):
                return _ext._C.bjorck_cuda([w.contiguous() for w in ws], iters, beta)

        else:
            # Contiguous inputs: the reference keeps a view's strides, the op returns contiguous matrices (fake kernel).
            return ref.bjorck_orthonormalize([w.contiguous() for w in weights], iters, beta)
        # One batched kernel call over every kernel-dtype matrix; float64 ones run the reference.
        batched = [i for i, w in enumerate(weights) if w.dtype in _KERNEL_DTYPES]
        out: list[torch.Tensor | None] = [None] * len(weights)
        if batched:
            for i, o in zip(batched, kernel([weights[i] for i in batched], iters, beta), strict=True):
                out[i] = o
        rest = [i for i, w in enumerate(weights) if w.dtype not in _KERNEL_DTYPES]
        if rest:
            rest_out = ref.bjorck_orthonormalize([weights[i].contiguous() for i in rest], iters, beta)
            for i, o in zip(rest, rest_out, strict=True):
                out[i] = o
        return out


@_bjorck_op.register_fake
def _(weights, iters, beta):
    return [torch.empty_like(w, memory_format=torch.contiguous_format) for w in weights]


def bjorck_orthonormalize(weights: list[torch.Tensor], iters: int = 15, beta: float = 0.5) -> list[torch.Tensor]:
    """``iters`` Björck steps on each matrix: ``W <- (1 + beta) W - beta W W^T W``.

    The product uses the smaller Gram matrix: ``W (W^T W)`` when rows >= cols, else
    ``(W W^T) W``. Each singular value follows ``s -> (1 + beta) s - beta s^3``, which tends
    to 1 for s in (0, sqrt(3)) when beta = 0.5: pass matrices with spectral norm <= 1 (e.g.
    divided by ``power_iteration``'s estimate times 1 + 1e-3, or by
    ``certified_spectral_norm``). The result has orthonormal columns (tall) or rows (wide).
    Computed in float32 (float64 for float64 inputs), returned in the input dtype.

    Args:
        weights: non-empty list of 2-D matrices (any shapes; float32, float16, bfloat16, float64).
        iters: number of steps, >= 1 (deel-lip: at most 15).
        beta: step size in (0, 1] (deel-lip: 0.5).

    Returns:
        list of matrices of the same shapes and dtypes (contiguous).
    """
    op = "bjorck_orthonormalize"
    spectral_ops._check_matrices(op, weights)
    spectral_ops._check_iters(op, "iters", iters)
    _check_beta(op, beta)
    spectral_ops._check_finite(op, list(weights), "weights")
    return torch.ops.fastdp.bjorck_orthonormalize([w.detach() for w in weights], iters, float(beta))


def certified_bjorck_step(w: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One Björck step towards singular values ``scale`` that certifies its result: ``(w_new, bound)`` with
    ``||w_new||_2 <= bound`` (float64 0-d, about ``scale`` (1 + 1e-3) in float32), from ANY finite start.

    The step ``w <- s (1.5 I - 0.5 s^2 w w^T / scale^2) w`` (s a power of two <= 1 that keeps the start inside the
    polynomial's range) never leaves the spectral ball of radius ``scale`` in exact arithmetic, and near an
    orthogonal matrix it converges quadratically; the bound adds the rounding of the float64 Gram matrix and of the
    float32 product (``fastdp.ref.orthogonal.certified_bjorck_step``). One step per training step keeps a
    Lipschitz layer orthogonal (its updates are small) for one float64 and one float32 product: the Gram iteration
    and a 15-step Björck cost about 40. The products run in IEEE float32 whatever the TF32 settings.

    Args:
        w: non-empty 2-D matrix, float32 or float64, finite (NaN/Inf give a +inf bound).
        scale: the target singular value (> 0, finite).

    Returns:
        ``(w_new, bound)``: w_new in w's shape and dtype; bound float64 0-d on w's device.
    """
    op = "certified_bjorck_step"
    spectral_ops._check_matrix(op, "w", w)
    if w.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"fastdp {op}: w has dtype {w.dtype}; the certificate needs float32 or float64 products (keep Lipschitz "
            "layers' weights in float32 and use autocast for the rest)"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (_finite(scale) and scale > 0):
        raise ValueError(f"fastdp {op}: scale is {scale!r}; expected a finite number > 0")
    with torch.no_grad(), exact_fp32():
        return ref.certified_bjorck_step(w.detach(), float(scale))


def _spectral_scale(
    weights: list[torch.Tensor], vectors: list[torch.Tensor] | None, power_iters: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``W_l / (sigma_hat_l (1 + 1e-3))`` in W_l's dtype, and the new right vectors u_l.

    One power-iteration call for the float64 matrices and one for the others, so that each
    matrix gets what it would get alone (a float64 matrix in the list does not move the rest
    to the reference path and float64 scaling).
    """
    if vectors is not None:
        spectral_ops._check_vectors("spectral_normalize_and_orthonormalize", weights, vectors)
    scaled: list[torch.Tensor | None] = [None] * len(weights)
    us: list[torch.Tensor | None] = [None] * len(weights)
    for wide_precision in (False, True):
        idx = [i for i, w in enumerate(weights) if (w.dtype == torch.float64) == wide_precision]
        if not idx:
            continue
        group_vectors = None if vectors is None else [vectors[i] for i in idx]
        sigma, group_us, _ = spectral_ops.power_iteration([weights[i] for i in idx], group_vectors, power_iters)
        denom = (sigma * (1.0 + ref.PROJECTION_EPS)).clamp_min(1e-30)
        for k, i in enumerate(idx):
            w = weights[i]
            scaled[i] = (w.detach().to(denom.dtype) / denom[k]).to(w.dtype)
            us[i] = group_us[k]
    return scaled, us


def spectral_normalize_and_orthonormalize(
    weights: list[torch.Tensor],
    vectors: list[torch.Tensor] | None = None,
    power_iters: int = 10,
    bjorck_iters: int = 15,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The deel-lip projection Pi of each matrix: ``bjorck(W / (sigma_hat (1 + 1e-3)))``.

    sigma_hat is ``power_iteration(weights, vectors, power_iters)``'s estimate (warm-started
    by ``vectors``: pass the returned vectors back next step, as the lip-dp paper advises).
    One power-iteration call and one (batched) Björck call for the whole list (float64
    matrices: one more of each); each matrix's result is what it would be alone.

    Returns:
        ``(projected weights (shapes and dtypes of the inputs), new right vectors u_l [n_l])``.
    """
    op = "spectral_normalize_and_orthonormalize"
    spectral_ops._check_matrices(op, weights)
    spectral_ops._check_iters(op, "power_iters", power_iters)
    spectral_ops._check_iters(op, "bjorck_iters", bjorck_iters)
    scaled, us = _spectral_scale(list(weights), vectors, power_iters)
    return bjorck_orthonormalize(scaled, bjorck_iters), us


def conv_lip_factor(kernel_size, input_hw, stride=(1, 1)) -> float:
    """deel-lip's ``_compute_conv_lip_factor``: the RKO rescaling of a conv kernel.

    stride 1: ``sqrt(H W / ((kh H - a (a + 1)) (kw W - b (b + 1))))`` with a = (kh - 1)/2,
    b = (kw - 1)/2; stride > 1: ``sqrt(1 / (ceil(kh / sh) ceil(kw / sw)))``.
    ``kernel_size``, ``input_hw`` = (H, W) and ``stride`` are ints or pairs of positive ints.
    The stride-1 formula counts the kernel taps that fall inside the input, and is exact only for
    H >= (kh - 1) / 2 and W >= (kw - 1) / 2: smaller inputs are refused (ValueError).
    """
    op = "conv_lip_factor"
    pairs = [spectral_ops._pair(op, n, v) for n, v in (("kernel_size", kernel_size), ("input_hw", input_hw),
                                                          ("stride", stride))]  # fmt: skip
    for name, pair in zip(("kernel_size", "input_hw", "stride"), pairs, strict=True):
        if min(pair) < 1:
            raise ValueError(f"fastdp {op}: {name} is {pair}; expected positive ints")
    (kh, kw), (h, w), (sh, sw) = pairs
    if sh * sw == 1 and (2 * h < kh - 1 or 2 * w < kw - 1):
        # The stride-1 formula counts the kernel taps inside the input; it is exact only for H >= (kh - 1) / 2.
        raise ValueError(
            f"fastdp {op}: input_hw {pairs[1]} is smaller than half the kernel {pairs[0]}; deel-lip's stride-1 "
            "factor needs H >= (kh - 1) / 2 and W >= (kw - 1) / 2"
        )
    return ref.conv_lip_factor(*pairs)


def _check_conv_kernel(op: str, name: str, conv_weight) -> None:
    if not isinstance(conv_weight, torch.Tensor):
        raise TypeError(f"fastdp {op}: {name} is a {type(conv_weight).__name__}, expected a torch.Tensor")
    if conv_weight.dim() != 4 or conv_weight.numel() == 0:
        shape = tuple(conv_weight.shape)
        raise ValueError(f"fastdp {op}: {name} is {shape}; expected a non-empty kernel [C_out, C_in, kh, kw]")
    if conv_weight.dtype not in spectral_ops._FLOAT_DTYPES:
        raise TypeError(
            f"fastdp {op}: {name} has dtype {conv_weight.dtype}; expected float32, float16, bfloat16 or float64"
        )


def _rko_scale(
    conv_weights: list[torch.Tensor], input_hws: list, strides: list
) -> tuple[list[torch.Tensor], list[tuple[float, torch.dtype]]]:
    """Kernel matrices M = K.reshape(C_out, -1) / certified ||M||_2 (in K's dtype), and (coef, bound dtype)."""
    coefs = [conv_lip_factor(tuple(k.shape[2:]), hw, st) for k, hw, st in zip(conv_weights, input_hws, strides,
                                                                               strict=True)]  # fmt: skip
    matrices = [k.detach().reshape(k.shape[0], -1) for k in conv_weights]
    with spectral_ops.deferred_finite_checks():  # the callers checked the kernels, naming them
        bounds = spectral_ops.certified_spectral_norms(matrices)
    scaled, finish = [], []
    for matrix, k, coef, b in zip(matrices, conv_weights, coefs, bounds, strict=True):
        bound = b.to(ref.accumulation_dtype(k.dtype))  # exact: each bound is computed in this dtype
        scaled.append((matrix.to(bound.dtype) / bound.clamp_min(1e-30)).to(k.dtype))
        finish.append((coef, bound.dtype))
    return scaled, finish


def _rko_finish(ortho: torch.Tensor, coef: float, bound_dtype: torch.dtype, conv_weight: torch.Tensor) -> torch.Tensor:
    return (ortho.to(bound_dtype) * coef).to(conv_weight.dtype).reshape(conv_weight.shape)


def rko_orthonormalize(
    conv_weight: torch.Tensor, input_hw: tuple[int, int], stride=(1, 1), iters: int = 15
) -> torch.Tensor:
    """Reshaped kernel orthogonalisation (RKO) of a conv kernel [C_out, C_in, kh, kw].

    M = kernel reshaped to [C_out, C_in kh kw], divided by ``certified_spectral_norm(M)``
    (so ||M|| <= 1), ``iters`` Björck steps (orthonormal rows if C_out <= C_in kh kw, else
    orthonormal columns), reshaped back and multiplied by ``conv_lip_factor((kh, kw),
    input_hw, stride)``. Returns a tensor of the kernel's shape and dtype. For many kernels
    at once (one Björck call), use ``lipschitz_projection``.
    """
    op = "rko_orthonormalize"
    _check_conv_kernel(op, "conv_weight", conv_weight)
    spectral_ops._check_iters(op, "iters", iters)
    spectral_ops._check_finite(op, [conv_weight], "conv_weight")
    (scaled,), ((coef, bound_dtype),) = _rko_scale([conv_weight], [input_hw], [stride])
    ortho = bjorck_orthonormalize([scaled], iters)[0]
    return _rko_finish(ortho, coef, bound_dtype, conv_weight)


def lipschitz_projection(
    dense_weights: list[torch.Tensor],
    dense_vectors: list[torch.Tensor] | None = None,
    conv_weights: list[torch.Tensor] | None = None,
    conv_input_hws: list | None = None,
    conv_strides: list | None = None,
    power_iters: int = 10,
    iters: int = 15,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The projections of a whole Lipschitz network with ONE Björck call over all its matrices.

    Dense matrices get ``spectral_normalize_and_orthonormalize(dense_weights, dense_vectors,
    power_iters, iters)``; conv kernels get ``rko_orthonormalize(k, input_hw, stride, iters)``.
    The results are those of these per-matrix calls (Björck treats each matrix on its own);
    only the launches are shared: one power-iteration call, one certified-norm call, one
    batched Björck call (plus one of each for float64 matrices). All tensors on one device.

    Args:
        dense_weights: 2-D matrices (may be empty).
        dense_vectors: warm-start right vectors u_l [n_l] (None: cold start).
        conv_weights: conv kernels [C_out, C_in, kh, kw] (None: none).
        conv_input_hws, conv_strides: per kernel, (H, W) of its input and its stride (ints or pairs).
        power_iters, iters: power-iteration and Björck steps, >= 1.

    Returns:
        ``(projected dense matrices, new right vectors u_l, projected conv kernels)``, shapes and
        dtypes of the inputs.
    """
    op = "lipschitz_projection"
    lists = {"dense_weights": dense_weights, "conv_weights": conv_weights, "conv_input_hws": conv_input_hws,
             "conv_strides": conv_strides}  # fmt: skip
    for name, value in lists.items():
        if (value is not None or name == "dense_weights") and not isinstance(value, (list, tuple)):
            raise TypeError(f"fastdp {op}: {name} must be a list, got {type(value).__name__}")
    dense_weights = list(dense_weights)
    conv_weights = list(conv_weights or [])
    conv_input_hws = list(conv_input_hws or [])
    conv_strides = list(conv_strides or [])
    if not (len(conv_weights) == len(conv_input_hws) == len(conv_strides)):
        raise ValueError(
            f"fastdp {op}: {len(conv_weights)} conv kernels, {len(conv_input_hws)} input sizes and "
            f"{len(conv_strides)} strides; pass one input size and one stride per kernel"
        )
    spectral_ops._check_iters(op, "power_iters", power_iters)
    spectral_ops._check_iters(op, "iters", iters)
    for i, k in enumerate(conv_weights):
        _check_conv_kernel(op, f"conv_weights[{i}]", k)
    if dense_weights:
        spectral_ops._check_matrices(op, dense_weights)
    if dense_vectors is not None:
        spectral_ops._check_vectors(op, dense_weights, dense_vectors)
    devices = list(dict.fromkeys(str(t.device) for t in dense_weights + conv_weights))
    if len(devices) > 1:
        raise ValueError(f"fastdp {op}: the weights are on {', '.join(devices)}; put them all on one device")
    # One finiteness check (one synchronisation) naming the list at fault; the inner calls skip theirs.
    spectral_ops._check_finite(op, dense_weights, "dense_weights", ("dense_vectors", list(dense_vectors or [])),
                               ("conv_weights", conv_weights))  # fmt: skip
    with spectral_ops.deferred_finite_checks():
        if dense_weights:
            dense_scaled, us = _spectral_scale(dense_weights, dense_vectors, power_iters)
        else:
            dense_scaled, us = [], []
        conv_scaled, finish = _rko_scale(conv_weights, conv_input_hws, conv_strides) if conv_weights else ([], [])
        matrices = dense_scaled + conv_scaled
        ortho = bjorck_orthonormalize(matrices, iters) if matrices else []
    dense_out = ortho[: len(dense_scaled)]
    conv_out = [
        _rko_finish(o, coef, bound_dtype, k)
        for o, (coef, bound_dtype), k in zip(ortho[len(dense_scaled) :], finish, conv_weights, strict=True)
    ]
    return dense_out, us, conv_out
