"""Layers of Lip-DP-SGD (Barczewski and Ramon 2023) that fastdp lacked, with certified bound rules.

Every layer is a :class:`~fastdp.nn.lipschitz.LipschitzModule`: its rules (``propagate``, ``sensitivities``,
``backpropagate``; units and rounding as in :mod:`fastdp.nn.lipschitz`: per example, for the summed loss, L2 over all
of one example's coordinates, every bound rounded up) let :func:`fastdp.nn.lipschitz.lipschitz_bounds` bound the
per-example gradients of a network that contains it, so the ``weightclip`` (and ``clipless``) variants train it
without per-example clipping.

* :class:`WeightClipConv2d`: 2-D convolution (optional bias) whose kernel is rescaled, after each step, so that its
  certified operator-norm bound sqrt(m) ||M||_2 stays <= C (the paper's ClipWeights for convolutions, with the
  sqrt(h'w') factor of its eq. 5 that Algorithm 1 forgets: pitfall W3);
* :class:`LipschitzGroupNorm`: the paper's modified group norm (x - mu) / max(alpha, sigma) per group (eq. 2, Table 2),
  no affine parameters: 1/alpha-Lipschitz, ||y|| <= min(||x|| / alpha, sqrt(N));
* :class:`ResidualSum`: x + block(x), the paper's eq. 7 (Lipschitz 1 + l_block), not the halved ``Residual``;
* :class:`LipschitzSigmoid` (Lipschitz 1/4; sigmoid(0) = 1/2, so its output bound needs the feature count N) and
  :class:`LipschitzTanh` (Lipschitz 1, |tanh(t)| <= |t|).

Shapes the bounds depend on (the number of coordinates of one example, the conv's output positions) are given at
construction and checked by every forward: a bound that holds for one input shape is never used for another.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.nn.layers import ConvShape, SummedLayer
from fastdp.nn.lipschitz import (
    CERTIFY_ITERS,
    Bound,
    LipschitzModule,
    Residual,
    _backward_bounds,
    _certified,
    _forward_bounds,
    _minimum,
    add_up,
    conv_root_overlap,
    fraction_up,
    mul_up,
    norm_up,
    sqrt_up,
)
from fastdp.ops import certified_spectral_norm

__all__ = ["LipschitzGroupNorm", "LipschitzSigmoid", "LipschitzTanh", "ResidualSum", "WeightClipConv2d"]

CONV_PROJECTIONS = ("clip", "fixed")


def _features(x: torch.Tensor) -> int:
    """Coordinates of one example of a batch-first tensor."""
    return math.prod(x.shape[1:])


def _check_features(layer: str, x: torch.Tensor, features: int | None) -> None:
    if features is not None and (x.dim() < 2 or _features(x) != features):
        raise ValueError(
            f"{layer} was built for examples of {features} coordinates (its output-norm bound depends on it), got an "
            f"input of shape {tuple(x.shape)} (batch first); build it with features = the product of the non-batch "
            "dimensions of its input"
        )


# ------------------------------------------------------------------------------------------------- convolution


class WeightClipConv2d(LipschitzModule, SummedLayer):
    """y = conv2d(x, W) (+ b) with zero padding, its kernel kept at a certified operator-norm bound <= C by rescaling:
    Lip-DP-SGD's ClipWeights for convolutions (Barczewski and Ramon 2023, Algorithm 1 line 24 with eq. 5's factor).

    Notation: M the [C_out, C_in kh kw] kernel matrix, ||M||_2 its certified spectral norm (Gram iteration,
    ``fastdp.ops.certified_spectral_norm``), m the most (output position, kernel tap) pairs one input pixel can belong
    to (ceil(k / s)^2, or k^2 with dilation, as ``LipschitzConv2d``), P = H_out W_out the output positions,
    l = sqrt(m) ||M||_2.

    * Projection (after each step; post-processing): W <- W min(1, C / l) (``"clip"``: rescaled only when above C),
      or W <- W C / l (``"fixed"``: Fix-Lip-DP-SGD). The bias is not constrained (its norm enters the forward bound).
      After the projection l <= C up to the rounding of the product; the bounds never rely on that: they use the
      certified l of the weights as they are.
    * ||y|| <= l ||x|| + sqrt(P) ||b||: y_p = M patch_p, and sum_p ||patch_p||^2 <= m ||x||^2 (each input pixel is in
      at most m (position, tap) pairs; padding adds zeros); the bias is repeated at P positions.
    * ||dL/dx|| <= l g (the same operator, transposed).
    * per-example ||dL/dW||_F <= sqrt(m) ||x|| g: dL/dW = sum_p g_p patch_p^T, and ||sum_p g_p patch_p^T||_F <=
      (sum_p ||g_p||^2)^(1/2) (sum_p ||patch_p||^2)^(1/2) (Barczewski and Ramon 2023 eq. 6, Table 2);
      ||dL/db|| <= sqrt(P) g (dL/db_o = sum_p g_{o,p}, Cauchy-Schwarz): not g as for a dense bias.

    ``input_hw`` (H, W) of the input is required (P depends on it) and checked by the forward.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        input_hw: tuple[int, int],
        stride: int = 1,
        padding: int = 0,
        dilation: int = 1,
        bias: bool = False,
        projection: str = "clip",
        max_norm: float = 1.0,
    ) -> None:
        super().__init__()
        if projection not in CONV_PROJECTIONS:
            raise ValueError(
                f"WeightClipConv2d: unknown projection {projection!r}; choose one of {', '.join(CONV_PROJECTIONS)} "
                "(for orthogonal kernels use fastdp.nn.lipschitz.LipschitzConv2d)"
            )
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"WeightClipConv2d: max_norm C must be finite and > 0, got {max_norm}")
        if min(in_channels, out_channels, kernel_size, stride, dilation) < 1 or padding < 0:
            raise ValueError(
                "WeightClipConv2d: channels, kernel_size, stride and dilation must be >= 1 and padding >= 0, got "
                f"{in_channels=}, {out_channels=}, {kernel_size=}, {stride=}, {dilation=}, {padding=}"
            )
        self.input_hw = tuple(int(s) for s in input_hw)
        out_hw = tuple((s + 2 * padding - dilation * (kernel_size - 1) - 1) // stride + 1 for s in self.input_hw)
        if len(self.input_hw) != 2 or min(out_hw) < 1:
            raise ValueError(
                f"WeightClipConv2d: input_hw {input_hw} gives no output position for kernel {kernel_size}, stride "
                f"{stride}, padding {padding}, dilation {dilation}"
            )
        self.output_hw = out_hw
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.projection = projection
        self.max_norm = float(max_norm)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv2d's initialisation, then projected
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.project_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (3, 4) or tuple(x.shape[-2:]) != self.input_hw:
            raise ValueError(
                f"WeightClipConv2d was built for {self.input_hw[0]}x{self.input_hw[1]} inputs (its bias bound "
                f"depends on the output size), got shape {tuple(x.shape)}; build it with input_hw = (H, W) of its input"
            )
        return self._summed_call(self._conv, x, self.weight, self.bias)

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation)

    def grad_sums(self, saved: tuple, grad_out: torch.Tensor) -> list[torch.Tensor]:
        shape = ConvShape(self.weight, self.bias, self.stride, self.padding, self.dilation)
        return shape.clipped_grad_sums(saved, grad_out, None)

    def _root_overlap(self) -> int:
        return conv_root_overlap(self.kernel_size, self.stride, self.dilation)

    def _matrix_norm(self) -> torch.Tensor:
        matrix = self.weight.detach().reshape(self.weight.shape[0], -1)
        return certified_spectral_norm(matrix, iters=CERTIFY_ITERS).to(torch.float64)

    def lipschitz(self) -> torch.Tensor:
        """l = sqrt(m) ||M||_2 (float64 0-d, rounded up): a certified bound on the operator norm of x -> conv(x, W)."""
        return mul_up(float(self._root_overlap()), _certified(self, self._matrix_norm))

    def _root_positions(self) -> float:
        return sqrt_up(float(self.output_hw[0] * self.output_hw[1]))

    def propagate(self, x_bound: Bound) -> Bound:
        out = mul_up(self.lipschitz(), x_bound)
        if self.bias is None:
            return out
        return add_up(out, mul_up(self._root_positions(), norm_up(self.bias)))

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        out = {}
        if self.weight.requires_grad:
            out[self.weight] = mul_up(mul_up(float(self._root_overlap()), x_bound), g_bound)
        if self.bias is not None and self.bias.requires_grad:
            out[self.bias] = mul_up(self._root_positions(), g_bound)
        return out

    def backpropagate(self, g_bound: Bound) -> Bound:
        return mul_up(self.lipschitz(), g_bound)

    @torch.no_grad()
    def project_(self) -> None:
        norm = self.lipschitz()
        scale = self.max_norm / norm
        scale = torch.where(norm > 0, scale, torch.ones_like(scale))  # a zero kernel stays 0 (not 0 * inf = NaN)
        # "clip" rescales only when above C (a factor of exactly 1 otherwise); decided on the device, no host read
        factor = scale if self.projection == "fixed" else scale.clamp(max=1.0)
        self.weight.mul_(factor.to(self.weight.dtype))


# ------------------------------------------------------------------------------------------------- group norm


class LipschitzGroupNorm(LipschitzModule):
    """The modified group norm of Barczewski and Ramon 2023 (eq. 2, Table 2): per example and group g of
    n = (C / G) prod(spatial) coordinates, y_g = (x_g - mu_g) / max(alpha, sigma_g), sigma_g = ||x_g - mu_g|| / sqrt(n)
    (the biased standard deviation); no affine parameters, no batch statistics. Inputs [B, C, *spatial].

    Rules (alpha > 0 a constant, so none of this depends on the data):

    * Lipschitz 1/alpha: with c = x_g - mu_g (an orthogonal projection of x_g: 1-Lipschitz) and r = alpha sqrt(n),
      y_g = c / max(alpha, ||c|| / sqrt(n)) = (1 / alpha) * c r / max(r, ||c||) = (1 / alpha) P_r(c), P_r the
      projection onto the closed L2 ball of radius r (1-Lipschitz: projection onto a convex set). The groups are
      disjoint blocks of coordinates, so ||y - y'||^2 = sum_g ||y_g - y'_g||^2 <= ||x - x'||^2 / alpha^2. This is the
      paper's Table 2 constant, and it holds globally, although eq. 3 bounds the Jacobian ignoring d sigma / dx (the
      Jacobian is (1 / max(alpha, sigma)) times a projection, so eq. 3 is right too); backpropagate(g) = g / alpha.
    * Output norm: ||y_g|| = ||c|| / max(alpha, ||c|| / sqrt(n)) <= min(||x_g|| / alpha, sqrt(n)); summed over the
      groups, ||y|| <= min(||x|| / alpha, sqrt(N)), N = C prod(spatial) the coordinates of one example. The sqrt(N)
      cap needs ``spatial_shape`` (then checked by the forward); without it the bound is ||x|| / alpha (y(0) = 0, so
      Lipschitz times input bound is an output bound here, unlike for the sigmoid). The paper states no output bound.

    The paper's sigma has GroupNorm's kappa inside the root; max(alpha, .) with alpha > 0 already keeps the
    denominator away from 0, so there is none here. The paper searches alpha in [0.1, 1] / |group| (a small alpha
    multiplies every downstream bound by 1/alpha); alpha = 1 gives a 1-Lipschitz layer.

    Numerics: sigma_g is computed from c / max|c| (no square overflows or underflows) and is 0, with a zero gradient
    rather than NaN, for a constant group (then y_g = 0).
    """

    def __init__(
        self, num_groups: int, num_channels: int, alpha: float = 1.0, spatial_shape: tuple[int, ...] | None = None
    ) -> None:
        super().__init__()
        if num_groups < 1 or num_channels < 1 or num_channels % num_groups:
            raise ValueError(
                f"LipschitzGroupNorm: num_channels must be a positive multiple of num_groups >= 1, got {num_groups=}, "
                f"{num_channels=}"
            )
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"LipschitzGroupNorm: alpha must be finite and > 0 (the layer is 1/alpha-Lipschitz), "
                             f"got {alpha}")  # fmt: skip
        self.num_groups, self.num_channels, self.alpha = int(num_groups), int(num_channels), float(alpha)
        self.spatial_shape = None if spatial_shape is None else tuple(int(s) for s in spatial_shape)
        self.features = None if spatial_shape is None else self.num_channels * math.prod(self.spatial_shape)
        self.inverse_alpha = fraction_up(1 / Fraction(self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"LipschitzGroupNorm takes [B, {self.num_channels}, *spatial] inputs, got shape "
                             f"{tuple(x.shape)}")  # fmt: skip
        if self.spatial_shape is not None and tuple(x.shape[2:]) != self.spatial_shape:
            raise ValueError(
                f"LipschitzGroupNorm was built for spatial shape {self.spatial_shape} (its output-norm bound depends "
                f"on it), got an input of shape {tuple(x.shape)}"
            )
        acc = torch.promote_types(x.dtype, torch.float32)
        groups = x.to(acc).reshape(x.shape[0], self.num_groups, -1)
        c = groups - groups.mean(dim=-1, keepdim=True)
        top = c.detach().abs().amax(dim=-1, keepdim=True)
        scale = torch.where(top > 0, top, torch.ones_like(top))  # a constant: sigma = scale sigma(c / scale) for any
        q = (c / scale).square().mean(dim=-1, keepdim=True)  # in [1/n, 1] (the largest entry is +-1), or 0 if c = 0
        safe = torch.where(q > 0, q, torch.ones_like(q))  # no sqrt at 0 (its infinite derivative would give NaN)
        sigma = torch.where(q > 0, scale * safe.sqrt(), torch.zeros_like(q))
        y = c / sigma.clamp(min=self.alpha)
        return y.reshape(x.shape).to(x.dtype)

    def propagate(self, x_bound: Bound) -> Bound:
        out = mul_up(self.inverse_alpha, x_bound)
        return out if self.features is None else _minimum(out, sqrt_up(float(self.features)))

    def backpropagate(self, g_bound: Bound) -> Bound:
        return mul_up(self.inverse_alpha, g_bound)


# --------------------------------------------------------------------------------------------------- residual


class ResidualSum(Residual):
    """y = x + block(x), block a sequence of Lipschitz modules: the residual of Barczewski and Ramon 2023 eq. 7
    (after Gouk et al.), un-halved (``Residual`` is the 1-Lipschitz (x + block(x)) / 2).

    Rules, with X_block the block's forward bound from X and l_block its backward rules: ||y|| <= X + X_block
    (triangle inequality); the block's parameters see the output gradient g itself (dL/d block(x) = dL/dy);
    ||dL/dx|| = ||g + J_block^T g|| <= g + l_block(g), i.e. (1 + prod of the block's constants) g (eq. 7). The block's
    rules are applied to g itself (``ClipGradient``'s is not linear). A subclass of ``Residual`` so that
    ``fastdp.nn.validate`` walks its block too.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)

    def propagate(self, x_bound: Bound) -> Bound:
        return add_up(x_bound, _forward_bounds(self.block, x_bound)[-1])

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        return _backward_bounds(self.block, _forward_bounds(self.block, x_bound), g_bound)[0]

    def backpropagate(self, g_bound: Bound) -> Bound:
        # gradient rules do not depend on the input bound, so any forward bound serves to walk the block
        _, block_g = _backward_bounds(self.block, _forward_bounds(self.block, 1.0), g_bound)
        return add_up(g_bound, block_g)


# ------------------------------------------------------------------------------------------------ activations


class LipschitzSigmoid(LipschitzModule):
    """y = sigmoid(x) coordinate-wise, for examples of ``features`` coordinates (checked by the forward).

    Rules: sigmoid' = s (1 - s) <= 1/4, so the layer is 1/4-Lipschitz and backpropagate(g) = g / 4 (Barczewski and
    Ramon's Table 2 gives 1/2 and their text 1: valid, looser). sigmoid(0) = 1/2 != 0, so the output bound is not
    Lipschitz times input bound: each |sigmoid(t)| <= 1 gives ||y|| <= sqrt(N), and ||y|| <= ||y - sigmoid(0)|| +
    ||sigmoid(0) 1|| <= ||x|| / 4 + sqrt(N) / 2; the bound is the smaller of the two (N = ``features``).
    """

    def __init__(self, features: int) -> None:
        super().__init__()
        if features < 1:
            raise ValueError(f"LipschitzSigmoid: features (coordinates of one example) must be >= 1, got {features}")
        self.features = int(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_features("LipschitzSigmoid", x, self.features)
        return torch.sigmoid(x)

    def propagate(self, x_bound: Bound) -> Bound:
        root = sqrt_up(float(self.features))
        return _minimum(root, add_up(mul_up(0.25, x_bound), mul_up(0.5, root)))

    def backpropagate(self, g_bound: Bound) -> Bound:
        return mul_up(0.25, g_bound)


class LipschitzTanh(LipschitzModule):
    """y = tanh(x) coordinate-wise: tanh' = 1 - tanh^2 <= 1 (1-Lipschitz, backpropagate(g) = g) and tanh(0) = 0, so
    ||y|| <= ||x||; with ``features`` N (then checked by the forward) also ||y|| <= sqrt(N) (each |tanh| < 1)."""

    def __init__(self, features: int | None = None) -> None:
        super().__init__()
        if features is not None and features < 1:
            raise ValueError(f"LipschitzTanh: features (coordinates of one example) must be >= 1, got {features}")
        self.features = None if features is None else int(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_features("LipschitzTanh", x, self.features)
        return torch.tanh(x)

    def propagate(self, x_bound: Bound) -> Bound:
        return x_bound if self.features is None else _minimum(x_bound, sqrt_up(float(self.features)))
