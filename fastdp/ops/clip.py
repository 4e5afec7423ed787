"""Per-example row clipping: ``fastdp::clip_rows``, ``fastdp::clip_rows_backward`` and ``fastdp::clip_gradient``.

Math and units: ``fastdp.ref.clip``. A row is one example, ``x[b]`` (all of dim 0's slice). ``clip_rows(x, C, norm)``
returns ``y_b = min(1, C / max(n_b, 1e-12)) x_b`` with ``n_b`` the row's ``"l2"`` norm (all entries) or ``"l15"``
norm (conv tensors [B, C, ...]: ``sqrt(sum_c (sum_p |x_bcp|)^2)``): every row of y has norm <= C (up to the
rounding of the norm in fp32 and of y to its dtype) and rows already inside are returned unchanged, bit for bit.
A NaN in a row makes the whole output row NaN (never an unclipped pass-through).

Autograd:

* ``clip_rows``: the true derivative of x -> s(x) x *through the norm* (as torch autograd of the reference gives):
  ``dx_b = s_b g_b - [active_b] (s_b / n_b) (<g_b, x_b> / n_b) d_b`` with ``d_b = x_b`` (l2) or
  ``(sum_p |x_bcp|) sign(x_bcp)`` (l15); rows inside the ball pass g unchanged. Computed by the fused op
  ``fastdp::clip_rows_backward`` from g and the saved x (the norms are recomputed, not saved). Double backward
  raises a RuntimeError (under nested torch.func transforms the reference is used, see below).
* ``clip_gradient``: identity in the forward; its backward is ``clip_rows`` of the upstream gradient (each
  example's gradient w.r.t. this tensor clipped to norm <= C, the C2 clip of backpropagation clipping). The
  forward clone is the op's only cost in the forward pass (custom ops may not return an input).

torch.func: the ops have ``register_vmap`` rules (the batch dimension of vmap folds into the rows). Custom ops'
``register_autograd`` does not work under ``torch.func.grad`` in torch <= 2.13 (pytorch/pytorch#168393,
#170834: the generated autograd.Function has no ``setup_context``), so under functorch transforms the entry
points below route through an ``autograd.Function`` with ``setup_context`` that calls the same ops (fused kernels
under ``vmap(grad(...))``, per-example gradients); its backward is once-differentiable, so under nested
``grad``/``jvp`` transforms (higher-order derivatives) they use the differentiable torch reference instead.

Input checks: float32, float16, bfloat16 or float64 (float64 always runs the reference: the kernels are fp32);
``dim >= 1`` (l2) or ``dim >= 2`` (l15); ``bound`` finite and > 0; ``norm`` in ``("l2", "l15")``.
Norms accumulate in fp32; outputs have the input dtype. Any layout (non-contiguous inputs are copied).

Backends: ``fastdp._backend.select("clip", device)``: ``triton`` runs ``fastdp.kernels.clip``; ``cuda`` runs
``fastdp._C`` (csrc/cpu/clip.cpp on CPU tensors, csrc/cuda/clip.cu on CUDA tensors); ``torch`` the reference.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from fastdp import _backend, _ext
from fastdp.ref import clip as ref

__all__ = ["clip_gradient", "clip_rows"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _finite(x) -> bool:
    """math.isfinite, False for an int too large for a float (where math.isfinite raises OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


# ---------------------------------------------------------------------------------------------- checks


def _check_args(op: str, bound, norm) -> None:
    if not isinstance(norm, str) or norm not in ref.NORMS:
        raise ValueError(f"fastdp {op}: norm is {norm!r}; expected 'l2' (all entries of an example) or 'l15' "
                         "(conv tensors [B, C, ...]: L2 over channels of the L1 over positions)")  # fmt: skip
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        raise TypeError(f"fastdp {op}: bound must be a float, got {type(bound).__name__}")
    if not (_finite(bound) and bound > 0):
        raise ValueError(f"fastdp {op}: bound is {bound}; it must be finite and > 0")


def _check_tensor(op: str, name: str, x, norm: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fastdp {op}: {name} is a {type(x).__name__}, expected a torch.Tensor")
    if x.dtype not in _DTYPES:
        raise TypeError(f"fastdp {op}: {name} has dtype {x.dtype}; expected float32, float16, bfloat16 or float64")
    least = 2 if norm == "l15" else 1
    if x.dim() < least:
        layout = "[B, C, ...] (examples, channels, positions)" if norm == "l15" else "[B, ...] (examples first)"
        raise ValueError(f"fastdp {op}: {name} has shape {tuple(x.shape)}; the {norm} norm needs {layout}")


def _check(op: str, x, bound, norm) -> None:
    _check_args(op, bound, norm)
    _check_tensor(op, "x", x, norm)


def _check_backward(grad, x, bound, norm) -> None:
    _check("clip_rows_backward", x, bound, norm)
    _check_tensor("clip_rows_backward", "grad", grad, norm)
    if grad.shape != x.shape or grad.dtype != x.dtype or grad.device != x.device:
        raise ValueError(f"fastdp clip_rows_backward: grad is {tuple(grad.shape)} {grad.dtype} on {grad.device} but x "
                         f"is {tuple(x.shape)} {x.dtype} on {x.device}; they must match")  # fmt: skip


# ------------------------------------------------------------------------------------------- kernels


def _rows3(x: torch.Tensor, norm: str) -> tuple[torch.Tensor, bool]:
    """x as a contiguous [B, C, P] tensor for the kernels, and whether to use the l15 kernels (l15 with P = 1 is
    the l2 norm: sqrt(sum_c |x_c|^2))."""
    if norm == "l15":
        channels, positions = x.shape[1], math.prod(x.shape[2:])
    else:
        channels, positions = 1, math.prod(x.shape[1:])
    return x.reshape(x.shape[0], channels, positions).contiguous(), norm == "l15" and positions > 1


def _torch_forward(x3: torch.Tensor, bound: float, l15: bool) -> torch.Tensor:
    return ref.clip_rows(x3, bound, "l15" if l15 else "l2")


def _torch_backward(g3: torch.Tensor, x3: torch.Tensor, bound: float, l15: bool) -> torch.Tensor:
    return ref.clip_rows_backward(g3, x3, bound, "l15" if l15 else "l2")


def _kernels(x: torch.Tensor):
    """(forward, backward) launchers on [B, C, P] tensors for x's device, dtype and the selected backend."""
    backend = _backend.select("clip", x.device.type)
    if x.dtype == torch.float64:
        backend = "torch"  # the kernels compute in fp32
    if backend == "triton":
        from fastdp.kernels import clip as triton_clip

        return triton_clip.clip_rows, triton_clip.clip_rows_backward
    if backend == "cuda":
        return _ext._C.clip_rows, _ext._C.clip_rows_backward
    return _torch_forward, _torch_backward


# ------------------------------------------------------------------------------------------------ ops


@torch.library.custom_op("fastdp::clip_rows", mutates_args=())
def _clip_rows_op(x: torch.Tensor, bound: float, norm: str) -> torch.Tensor:
    _check("clip_rows", x, bound, norm)
    forward, _ = _kernels(x)
    x3, l15 = _rows3(x, norm)
    with torch.no_grad():
        return forward(x3, bound, l15).reshape(x.shape)


@_clip_rows_op.register_fake
def _(x, bound, norm):
    _check("clip_rows", x, bound, norm)
    return x.new_empty(x.shape)


@torch.library.custom_op("fastdp::clip_rows_backward", mutates_args=())
def _clip_rows_backward_op(grad: torch.Tensor, x: torch.Tensor, bound: float, norm: str) -> torch.Tensor:
    _check_backward(grad, x, bound, norm)
    _, backward = _kernels(x)
    x3, l15 = _rows3(x, norm)
    g3, _ = _rows3(grad, norm)
    with torch.no_grad():
        return backward(g3, x3, bound, l15).reshape(x.shape)


@_clip_rows_backward_op.register_fake
def _(grad, x, bound, norm):
    _check_backward(grad, x, bound, norm)
    return x.new_empty(x.shape)


@torch.library.custom_op("fastdp::clip_gradient", mutates_args=())
def _clip_gradient_op(x: torch.Tensor, bound: float, norm: str) -> torch.Tensor:
    _check("clip_gradient", x, bound, norm)
    return x.clone()


@_clip_gradient_op.register_fake
def _(x, bound, norm):
    _check("clip_gradient", x, bound, norm)
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------- autograd


def _save_x(ctx, inputs, output) -> None:
    x, bound, norm = inputs
    ctx.save_for_backward(x)
    ctx.bound, ctx.norm = bound, norm


def _clip_rows_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.fastdp.clip_rows_backward(grad.to(x.dtype), x, ctx.bound, ctx.norm), None, None


def _save_bound(ctx, inputs, output) -> None:
    ctx.bound, ctx.norm = inputs[1], inputs[2]


def _clip_gradient_grad(ctx, grad):
    return torch.ops.fastdp.clip_rows(grad, ctx.bound, ctx.norm), None, None


def _no_double_backward(ctx, grad):
    raise RuntimeError(
        "fastdp clip_rows: double backward (a derivative of the clip's gradient) is not implemented; use "
        "fastdp.ref.clip.clip_rows (torch autograd, any order) for higher-order derivatives"
    )


_clip_rows_op.register_autograd(_clip_rows_grad, setup_context=_save_x)
_clip_gradient_op.register_autograd(_clip_gradient_grad, setup_context=_save_bound)
_clip_rows_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------------------------- vmap


def _batch_first(x: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """x with its vmap dimension first ([V, B, ...]); an unbatched x is expanded."""
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def _clip_rows_vmap(info, in_dims, x, bound, norm):
    """The rows of every vmapped instance are rows too: fold the vmap dimension into dim 0."""
    if in_dims[0] is None:
        return torch.ops.fastdp.clip_rows(x, bound, norm), None
    x = x.movedim(in_dims[0], 0)
    return torch.ops.fastdp.clip_rows(x.flatten(0, 1), bound, norm).unflatten(0, x.shape[:2]), 0


def _clip_rows_backward_vmap(info, in_dims, grad, x, bound, norm):
    if in_dims[0] is None and in_dims[1] is None:
        return torch.ops.fastdp.clip_rows_backward(grad, x, bound, norm), None
    grad = _batch_first(grad, in_dims[0], info.batch_size)
    x = _batch_first(x, in_dims[1], info.batch_size)
    dx = torch.ops.fastdp.clip_rows_backward(grad.flatten(0, 1), x.flatten(0, 1), bound, norm)
    return dx.unflatten(0, x.shape[:2]), 0


def _clip_gradient_vmap(info, in_dims, x, bound, norm):
    return torch.ops.fastdp.clip_gradient(x, bound, norm), in_dims[0]


_clip_rows_op.register_vmap(_clip_rows_vmap)
_clip_rows_backward_op.register_vmap(_clip_rows_backward_vmap)
_clip_gradient_op.register_vmap(_clip_gradient_vmap)


# -------------------------------------------------------------------------------- torch.func transforms


class _ClipRowsFunction(torch.autograd.Function):
    """``fastdp::clip_rows`` with its backward, for functorch transforms (see the module docstring)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, bound, norm):
        return torch.ops.fastdp.clip_rows(x, bound, norm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_x(ctx, inputs, output)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _clip_rows_grad(ctx, grad)


class _ClipGradientFunction(torch.autograd.Function):
    """``fastdp::clip_gradient`` with its backward, for functorch transforms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, bound, norm):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_bound(ctx, inputs, output)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _clip_gradient_grad(ctx, grad)


class _ClipUpstreamReference(_ClipGradientFunction):
    """The same forward; the backward is the reference clip of the gradient (differentiable to any order)."""

    @staticmethod
    def backward(ctx, grad):
        return ref.clip_gradient_backward(grad, ctx.bound, ctx.norm), None, None


_FIRST_ORDER = (torch._C._functorch.TransformType.Vmap, torch._C._functorch.TransformType.Grad)


def _route() -> str:
    """``"op"`` outside functorch transforms (and when compiling), ``"function"`` under vmap and at most one grad
    level, ``"torch"`` under anything else (nested grad, jvp, functionalize: the differentiable reference)."""
    if torch.compiler.is_compiling():
        return "op"
    stack = torch._C._functorch.get_interpreter_stack()
    if not stack:
        return "op"
    keys = [interpreter.key() for interpreter in stack]
    grads = sum(key == torch._C._functorch.TransformType.Grad for key in keys)
    return "function" if grads <= 1 and all(key in _FIRST_ORDER for key in keys) else "torch"


# ------------------------------------------------------------------------------------------ entry points


def clip_rows(x: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """Scale each example (row of dim 0) to ``norm`` <= ``bound``: ``y_b = min(1, bound / max(n_b, 1e-12)) x_b``.

    Args:
        x: [B, ...] (``"l2"``: all entries of an example) or [B, C, ...] (``"l15"``: L2 over channels of the L1
            over positions); float32, float16, bfloat16 or float64; any layout.
        bound: the clip bound C, finite and > 0.
        norm: ``"l2"`` or ``"l15"``.

    Returns:
        A new contiguous tensor of x's shape and dtype; rows inside the ball are x's rows bit for bit, NaN rows
        are NaN. Differentiable: the gradient goes through the norm (module docstring).
    """
    _check("clip_rows", x, bound, norm)
    route = _route()
    if route == "op":
        return torch.ops.fastdp.clip_rows(x, float(bound), norm)
    if route == "function":
        return _ClipRowsFunction.apply(x, float(bound), norm)
    return ref.clip_rows(x, float(bound), norm)


def clip_gradient(x: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """Identity in the forward pass; in the backward pass each example's upstream gradient (the gradient w.r.t.
    this tensor, row b for example b) is clipped to ``norm`` <= ``bound`` with ``clip_rows``.

    Args as :func:`clip_rows`. Returns a copy of x (same shape, dtype and strides).
    """
    _check("clip_gradient", x, bound, norm)
    route = _route()
    if route == "op":
        return torch.ops.fastdp.clip_gradient(x, float(bound), norm)
    if route == "function":
        return _ClipGradientFunction.apply(x, float(bound), norm)
    return _ClipUpstreamReference.apply(x, float(bound), norm)
