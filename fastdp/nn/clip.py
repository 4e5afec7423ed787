"""Per-example clipping used by several variants: scale each example (row of dim 0) into a norm ball, in the
forward pass (inputs) or in the backward pass (upstream gradients)."""

from __future__ import annotations

import torch

__all__ = ["clip_gradient", "clip_rows"]


def _row_norms(x: torch.Tensor, norm: str) -> torch.Tensor:
    if norm == "l15":  # [B, C, ...]: L2 over channels of the L1 over positions
        return x.abs().flatten(2).sum(2).pow(2).sum(1).sqrt()
    return x.reshape(x.shape[0], -1).norm(dim=1)


def clip_rows(x: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """Scale each example (row of dim 0) to ``norm`` <= ``bound``; rows already inside are unchanged."""
    scale = (bound / _row_norms(x, norm).clamp(min=1e-12)).clamp(max=1.0)
    return x * scale.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


class _ClipUpstream(torch.autograd.Function):
    """Identity forward; the backward clips each example's gradient to ``bound`` in ``norm``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, bound: float, norm: str) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.bound, ctx.norm = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return clip_rows(grad, ctx.bound, ctx.norm), None, None


def clip_gradient(x: torch.Tensor, bound: float, norm: str = "l2") -> torch.Tensor:
    """Identity in the forward pass; in the backward pass each example's gradient is clipped to ``bound``."""
    return _ClipUpstream.apply(x, bound, norm)
