"""Backpropagation clipping (Stevens et al. 2022, with the published noise-scale bug fixed).

Every trainable layer clips each example's *input* to norm C1 in the forward pass and each example's *upstream
gradient* (w.r.t. the layer output) to C2 in the backward pass. Then, per example:

* Linear, y = x W^T + b: ||dL/dW||_F = ||g x^T||_F <= ||g|| ||x|| <= C1 C2 (token-wise inputs too:
  ||sum_t g_t x_t^T||_F <= ||g|| ||x||), ||dL/db|| <= sqrt(T) ||g|| for T positions (1 for [B, d] inputs);
* Conv2d with the l15 norm of the upstream gradient, ||g||_15 = sqrt(sum_c (sum_pq |g_cpq|)^2): the kernel
  gradient of output channel c is a sum of shifted copies of x weighted by g_c, so its norm is <= sum_pq |g_cpq|
  ||x||, hence ||dL/dK||_F <= ||g||_15 ||x|| <= C1 C2, and ||dL/db|| <= ||g||_15 <= C2.

No per-example gradient is formed: one backward of the summed loss, in which each layer sums its parameters'
gradient over the batch in float64 chunks (``fastdp.nn.layers.SummedLayer``; the rounding of a float32 sum over the
batch is not bounded by C1 C2).

Each bound is for one use of the layer: a layer called k times in one forward (``lin(lin(x))``), or a parameter
shared by two layers (tied weights), gets the sum of k clipped terms, up to k C1 C2. Both are refused
(:func:`refuse_reused_layers` after each step's forward, :func:`check_backprop_supported`; both live in
:mod:`fastdp.nn.validate` with the other refusals and are re-exported here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.nn.clip import CLIP_MARGIN, clip_gradient, clip_rows
from fastdp.nn.layers import ConvShape, SummedLayer, linear_grad_sums
from fastdp.nn.validate import check_backprop_supported, refuse_reused_layers  # the refusals, shared (re-exported)

__all__ = ["BackpropClipConv2d", "BackpropClipLinear", "check_backprop_supported", "convert_backprop",
           "parameter_sensitivities", "refuse_reused_layers", "reset_calls"]  # fmt: skip


class _BackpropClip:
    """Mixin: input clip C1, upstream-gradient clip C2, and the per-example sensitivity of each parameter."""

    input_clip: float
    grad_clip: float
    calls: int = 0  # forward calls since the last reset_calls (BackpropClip: those of one step's forward)

    def _clipped_call(self, x: torch.Tensor, norm: str) -> torch.Tensor:
        self.calls += 1  # both clips a hair inside the bounds the sensitivities credit (CLIP_MARGIN)
        y = self._summed_call(self._layer, clip_rows(x, self.input_clip * CLIP_MARGIN), self.weight, self.bias)
        return clip_gradient(y, self.grad_clip * CLIP_MARGIN, norm)


class BackpropClipLinear(_BackpropClip, SummedLayer, nn.Linear):
    """``nn.Linear`` with backpropagation clipping; bias sensitivity counts the positions of token-wise inputs."""

    positions: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.positions = max(self.positions, math.prod(x.shape[1:-1]))
        return self._clipped_call(x, "l2")

    def sensitivities(self) -> dict[nn.Parameter, float]:
        out = {self.weight: self.input_clip * self.grad_clip}
        if self.bias is not None:
            out[self.bias] = math.sqrt(self.positions) * self.grad_clip
        return out

    def _layer(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def grad_sums(self, saved: tuple, grad_out: torch.Tensor) -> list[torch.Tensor]:
        return linear_grad_sums(self.weight, self.bias, saved, grad_out, None)


class BackpropClipConv2d(_BackpropClip, SummedLayer, nn.Conv2d):
    """``nn.Conv2d`` (zero padding) with backpropagation clipping; upstream gradients clipped in the l15 norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros":
            raise ValueError("BackpropClipConv2d supports padding_mode='zeros' only")
        return self._clipped_call(x, "l15")

    def sensitivities(self) -> dict[nn.Parameter, float]:
        out = {self.weight: self.input_clip * self.grad_clip}
        if self.bias is not None:
            out[self.bias] = self.grad_clip
        return out

    def _layer(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._conv_forward(x, weight, bias)

    def grad_sums(self, saved: tuple, grad_out: torch.Tensor) -> list[torch.Tensor]:
        shape = ConvShape(self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return shape.clipped_grad_sums(saved, grad_out, None)


_SWAP = {nn.Linear: BackpropClipLinear, nn.Conv2d: BackpropClipConv2d}


def convert_backprop(model: nn.Module, input_clip: float, grad_clip: float) -> nn.Module:
    """Make every Linear/Conv2d of ``model`` clip its inputs to ``input_clip`` and its upstream gradients to
    ``grad_clip`` (in place; parameters kept). Raises :class:`fastdp.nn.UnsupportedLayerError` (a ValueError) naming
    trainable modules of other types and batch-statistics layers (:func:`check_backprop_supported`)."""
    for name, value in (("input clip C1", input_clip), ("gradient clip C2", grad_clip)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"backprop clipping: {name} must be finite and > 0, got {value}")
    for module in model.modules():
        cls = _SWAP.get(type(module))
        if cls is not None:
            module.__class__ = cls
        if isinstance(module, _BackpropClip):
            module.input_clip, module.grad_clip = float(input_clip), float(grad_clip)
    check_backprop_supported(model)
    return model


def reset_calls(model: nn.Module) -> None:
    """Zero the call count of every backprop-clip layer of ``model`` (before a step's forward)."""
    for m in model.modules():
        if isinstance(m, _BackpropClip):
            m.calls = 0


def parameter_sensitivities(model: nn.Module) -> dict[nn.Parameter, float]:
    """Per-example gradient-norm bound of every trainable parameter of a converted model."""
    out: dict[nn.Parameter, float] = {}
    for module in model.modules():
        if isinstance(module, _BackpropClip):
            out.update({p: s for p, s in module.sensitivities().items() if p.requires_grad})
    return out
