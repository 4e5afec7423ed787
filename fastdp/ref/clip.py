"""Reference of per-example row clipping: scale each example (row of dim 0) into a norm ball.

Norms of a row x_b (one example, all entries of ``x[b]``):

* ``"l2"``: ``||x_b|| = sqrt(sum_i x_bi^2)`` over all of the example's entries (any shape [B, ...]);
* ``"l15"`` (conv tensors [B, C, ...], backpropagation clipping, Stevens et al. 2022):
  ``||x_b||_15 = sqrt(sum_c (sum_p |x_bcp|)^2)``, the L2 norm over channels c of the L1 norms over positions p.

Clip (``clip_rows``): ``y_b = s_b x_b`` with ``s_b = min(1, C / max(n_b, TINY))``, ``n_b`` the row's norm and C
the bound: rows with ``n_b <= C`` are unchanged, larger ones are scaled to norm C. A NaN anywhere in a row makes
its norm and its scale NaN, so the whole row comes out NaN (never a silent s = 1); an infinite norm gives s = 0.
Norms are accumulated in float32 (float64 for float64 inputs) and ``y`` is rounded once to the input dtype.

Backward of the clip (``clip_rows_backward``), the derivative of x -> s(x) x through the norm (what torch
autograd gives for ``clip_rows``), for the upstream gradient g_b of a row:

    dx_b = s_b g_b - a_b (s_b / n_b) (<g_b, x_b> / n_b) d_b,     d_b = dn_b/dx_b * n_b
         = x_b                          (l2)
         = (sum_p |x_bcp|) sign(x_bcp)   (l15, per entry c, p)

where ``a_b`` = 1 when the clip is active (``C / max(n_b, TINY) <= 1`` and ``n_b >= TINY``) and 0 otherwise (then
``dx_b = s_b g_b``, which is ``g_b`` unless C < TINY). At ``n_b = C`` exactly (not differentiable) the active
branch is used, as torch's ``clamp`` does. NaN rows give NaN gradients.
"""

from __future__ import annotations

import math

import torch

TINY = 1e-12
NORMS = ("l2", "l15")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (the kernels' fp32 math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_row(v: torch.Tensor, dim: int) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] to broadcast against a tensor of ``dim`` dimensions."""
    return v.reshape(-1, *([1] * (dim - 1)))


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, N]: each row flattened (N = 1 for a [B] tensor; B = 0 or N = 0 allowed)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def channel_l1(x: torch.Tensor) -> torch.Tensor:
    """[B, C]: the L1 norm over positions of each channel of a [B, C, ...] tensor (no upcast)."""
    return x.abs().reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:])).sum(2)


def row_norms(x: torch.Tensor, norm: str) -> torch.Tensor:
    """[B] norms of the rows of x (``"l2"`` or ``"l15"``), in float32 (float64 for float64 inputs).

    Differentiable (torch autograd), with gradient 0 at a zero row (``torch.linalg.vector_norm``).
    """
    xf = x.to(accumulation_dtype(x.dtype))
    if norm == "l15":
        return torch.linalg.vector_norm(channel_l1(xf), dim=1)
    return torch.linalg.vector_norm(_flat_rows(xf), dim=1)


def clip_scale(norms: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, active)`` of row norms: ``scale = min(1, bound / max(norm, TINY))`` (NaN stays NaN) and whether
    the scale depends on the norm (the clip is active; see the module docstring)."""
    ratio = bound / norms.clamp(min=TINY)  # clamp keeps NaN
    return ratio.clamp(max=1.0), (ratio <= 1.0) & (norms >= TINY)


def clip_rows(x: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """``y_b = min(1, bound / max(||x_b||, TINY)) x_b`` for every row b; differentiable with torch autograd
    (through the norm). Math in float32 (float64 for float64 inputs), result in the dtype of x."""
    xf = x.to(accumulation_dtype(x.dtype))
    scale, _ = clip_scale(row_norms(xf, norm), bound)
    return (xf * _per_row(scale, x.dim())).to(x.dtype)


def clip_rows_backward(grad: torch.Tensor, x: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """The gradient of ``clip_rows`` w.r.t. x for the upstream gradient ``grad`` (explicit formula of the module
    docstring; equals torch autograd of ``clip_rows``). Math in float32 (float64 for float64), result in x's dtype."""
    acc = accumulation_dtype(x.dtype)
    xf, gf = x.to(acc), grad.to(acc)
    norms = row_norms(xf, norm)
    scale, active = clip_scale(norms, bound)
    dot = _flat_rows(gf * xf).sum(1)
    coef = torch.where(active, (scale / norms) * (dot / norms), torch.zeros_like(norms))
    direction = xf if norm == "l2" else channel_l1(xf).reshape(*x.shape[:2], *([1] * (x.dim() - 2))) * xf.sign()
    dx = _per_row(scale, x.dim()) * gf - _per_row(coef, x.dim()) * direction
    return dx.to(x.dtype)


def clip_gradient_backward(grad: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """The backward of ``clip_gradient`` (identity forward): each example's upstream gradient clipped."""
    return clip_rows(grad, bound, norm)
