"""Lipschitz layers, losses and "backpropagation for bounds" (Béthune et al. 2024, Alg. 1) for clipless DP.

Every layer here has bound rules, evaluated on the current (already private) weights:

* ``propagate(x)``: bound on the output norm of one example given a bound ``x`` on its input norm;
* ``sensitivities(x, g)``: per-example gradient-norm bound of each trainable parameter, given the input bound
  ``x`` and a bound ``g`` on the per-example gradient w.r.t. the layer output;
* ``backpropagate(g)``: bound on the per-example gradient w.r.t. the layer input (``g`` times the layer's
  Lipschitz constant w.r.t. its input).

Units: bounds are per example, for the *summed* loss (DP-SGD's convention here: noise goes on the sum, which is
then divided by the expected batch size). Norms are L2 over all of one example's coordinates. Constants that
depend on weights are certified upper bounds (``fastdp.ops.certified_spectral_norm``), not power-iteration
estimates, which under-estimate. :func:`lipschitz_bounds` refuses models containing a module without rules.

Rounding: every bound is rounded *up*, never to nearest. Weight-dependent bounds are float64 0-d tensors and
constants Python floats (float64); each product, sum and square root of bounds (``mul_up``, ``add_up``,
``sqrt_up``) is followed by a step to the next float64 up unless it is exact, and a bound is converted to float32
only once, at the end, rounded up (``fastdp.ref.spectral.round_up``): a float32 bound is never below the exact
value of its rule. (A cast of sqrt(2) to float32, for instance, rounds it *down* to 1.41421354.)
"""

from __future__ import annotations

import math
import threading
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.nn.clip import CLIP_MARGIN, clip_gradient, clip_rows
from fastdp.nn.layers import FORWARD_METHODS, ConvShape, SummedLayer, linear_grad_sums
from fastdp.ops import (
    bjorck_orthonormalize,
    certified_bjorck_step,
    certified_norm_cholesky,
    certified_spectral_norm,
    certify_norm_at_most,
    frobenius_distance_up,
    rko_orthonormalize,
    summation,
)
from fastdp.ops.orthogonal import lipschitz_projection
from fastdp.ref import spectral as spectral_ref

__all__ = [
    "AddBias",
    "BoundedInput",
    "ClipGradient",
    "GroupSort2",
    "L2NormPool2d",
    "LayerCentering",
    "LipschitzConv2d",
    "LipschitzLinear",
    "OutputGradientBound",
    "LipschitzLoss",
    "MulticlassHKR",
    "MulticlassHinge",
    "MulticlassKR",
    "Residual",
    "TauCrossEntropy",
    "Transpose",
    "lipschitz_bounds",
    "project_",
]


CERTIFY_ITERS = 12


Bound = float | torch.Tensor  # a Python float, or a float64 0-d tensor where it depends on the weights (no host sync)


# ----------------------------------------------------------------------------- bound arithmetic, rounded up
# Bounds are >= 0. A float64 operation on exact operands rounds to nearest, within half an ulp of the exact result,
# so the next float up is >= it; the operations below take that step unless the result is known to be exact.
# Operands that are upper bounds give upper bounds (the operations are monotone). Python floats are checked for
# exactness with fractions; tensors (float64, no host read) step up unless an operand is 0.

_INF = math.inf


def _as64(x: Bound) -> Bound:
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def _step_up(result: torch.Tensor, exact: torch.Tensor | bool) -> torch.Tensor:
    """``result`` where ``exact``, else the next float up."""
    up = torch.nextafter(result, torch.full_like(result, _INF))
    if isinstance(exact, bool):
        return result if exact else up
    return torch.where(exact, result, up)


def _float_up(result: float, exact: Fraction) -> float:
    return math.nextafter(result, _INF) if Fraction(result) < exact else result


def fraction_up(exact: Fraction) -> float:
    """An upper bound on an exact rational: the nearest float64, or the next one up if that is below it."""
    return _float_up(float(exact), exact)


def conv_root_overlap(kernel_size: int, stride: int, dilation: int) -> int:
    """sqrt(m), exactly, for m the most patches of a square convolution one input pixel belongs to: ceil(k / s)^2, or
    k^2 with dilation (a square of an integer either way)."""
    return kernel_size if dilation != 1 else -(-kernel_size // stride)


def mul_up(a: Bound, b: Bound) -> Bound:
    """An upper bound on a * b (bounds >= 0): float64, rounded up."""
    a, b = _as64(a), _as64(b)
    r = a * b
    if isinstance(r, torch.Tensor):
        return _step_up(r, (a == 0) | (b == 0))
    return _float_up(r, Fraction(a) * Fraction(b)) if math.isfinite(r) else r


def add_up(a: Bound, b: Bound) -> Bound:
    """An upper bound on a + b (bounds >= 0): float64, rounded up."""
    a, b = _as64(a), _as64(b)
    r = a + b
    if isinstance(r, torch.Tensor):
        return _step_up(r, (a == 0) | (b == 0))
    return _float_up(r, Fraction(a) + Fraction(b)) if math.isfinite(r) else r


def sqrt_up(a: Bound) -> Bound:
    """An upper bound on sqrt(a) (a >= 0): float64, rounded up."""
    a = _as64(a)
    if isinstance(a, torch.Tensor):
        return _step_up(a.sqrt(), a == 0)
    r = math.sqrt(a)
    return math.nextafter(r, _INF) if math.isfinite(r) and Fraction(r) ** 2 < Fraction(a) else r


def sum_up(t: torch.Tensor) -> torch.Tensor:
    """An upper bound on the sum of a float64 tensor of n values >= 0: the float64 sum (relative error at most
    (n - 1) u / (1 - (n - 1) u), u = 2**-53, in any summation order) times 1 + (n + 1) 2**-52, rounded up."""
    n = t.numel()
    return _step_up(t.sum() * (1.0 + (n + 1) * 2.0**-52), t.numel() <= 1)


def norm_up(t: torch.Tensor) -> torch.Tensor:
    """A certified upper bound on the L2 norm of all of ``t``'s entries: a float64 0-d tensor, 0 for a zero tensor,
    +inf if ``t`` has a NaN or Inf; no host read. ``t`` is scaled by its largest magnitude (so that no square
    underflows or overflows), and the float64 rounding of the scaled sum of squares (at most (n + 4) u relative,
    u = 2**-53) is covered by a factor 1 + (n + 4) 2**-52."""
    t = t.detach().to(torch.float64).reshape(-1)
    top = t.abs().amax()
    finite_nonzero = torch.isfinite(top) & (top > 0)
    scale = torch.where(finite_nonzero, top, torch.ones_like(top))
    unit = torch.linalg.vector_norm(t / scale)  # the largest entry is 1: the norm is in [1, sqrt(n)]
    unit = _step_up(unit * (1.0 + (t.numel() + 4) * 2.0**-52), False)
    out = torch.where(finite_nonzero, _step_up(scale * unit, False), torch.zeros_like(top))
    return torch.where(torch.isfinite(top), out, torch.full_like(top, _INF))


def _minimum(a: Bound, b: Bound) -> Bound:
    """min(a, b) for bounds that may be 0-d tensors, without reading them on the host (exact: float64)."""
    a, b = _as64(a), _as64(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.minimum(a, b)
    if isinstance(a, torch.Tensor):
        return a.clamp(max=b)
    if isinstance(b, torch.Tensor):
        return b.clamp(max=a)
    return min(a, b)


SQRT2_UP = sqrt_up(2.0)  # the float64 just above sqrt(2), the logit-gradient bound of two losses below


_bounds_pass = threading.local()  # memo of certified norms during one lipschitz_bounds call


def _certified(module: nn.Module, compute) -> torch.Tensor:
    """``compute()`` (a certified norm of ``module``'s current weights), once per :func:`lipschitz_bounds` call:
    its forward and backward passes both need it, and the weights cannot change in between."""
    memo = getattr(_bounds_pass, "memo", None)
    if memo is None:
        return compute()
    if id(module) not in memo:
        memo[id(module)] = compute()
    return memo[id(module)]


class LipschitzModule(nn.Module):
    """A layer with bound rules; the default is a parameter-free 1-Lipschitz map with ``f(0) = 0``.

    Bounds are Python floats where they are constants and float64 0-d tensors (on the weights' device) where they
    depend on the weights, so computing them never synchronises with the device; rules combine them with
    ``mul_up`` / ``add_up`` (rounded up), never with ``*`` / ``+`` (rounded to nearest)."""

    def propagate(self, x_bound: Bound) -> Bound:
        return x_bound

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        return {}

    def backpropagate(self, g_bound: Bound) -> Bound:
        return g_bound

    def project_(self) -> None:
        """Projection Pi onto the constraint set (post-processing after an optimizer step)."""


class BoundedInput(LipschitzModule):
    """Projects each example onto the L2 ball of radius ``bound`` (all non-batch dimensions): ||x|| <= X_0."""

    def __init__(self, bound: float) -> None:
        super().__init__()
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"BoundedInput: bound X_0 must be finite and > 0, got {bound}")
        self.bound = float(bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clip_rows(x, self.bound * CLIP_MARGIN)  # a hair inside X_0, which the rules credit (CLIP_MARGIN)

    def propagate(self, x_bound: Bound) -> Bound:
        return _minimum(self.bound, x_bound)


PROJECTIONS = ("orthogonal", "clip", "fixed")
BJORCK_BUDGET = 2**24  # multiply-adds of the automatic Björck steps per projection of one LipschitzLinear


class LipschitzLinear(LipschitzModule, SummedLayer):
    """y = x W^T (+ b), with the spectral norm of W kept in check by the projection after each step:

    * ``"orthogonal"`` (clipless, GNP): ``bjorck_steps`` certified Björck steps towards singular values
      ``max_norm`` (``fastdp.ops.certified_bjorck_step``). Each step maps singular values s to roughly
      1 - 1.5 (1 - s)^2 near 1, so one step per training step keeps W orthogonal to the square of the step's
      change; large updates (a high learning rate on few, wide examples' noise) need more. None (the default):
      as many as fit in :data:`BJORCK_BUDGET` multiply-adds, between 1 and deel-lip's 15 — 15 for layers up to
      about 100 x 100, 1 from about 256 x 256 (a step costs one float64 and one float32 n^2 m product);
    * ``"clip"`` (Lip-DP-SGD, Barczewski and Ramon 2023): W <- W min(1, C / ||W||_2), i.e. rescaled only when
      above C = ``max_norm`` (the projection onto the spectral ball, a convex set);
    * ``"fixed"`` (Fix-Lip-DP-SGD): always rescaled to ||W||_2 = C.

    Inputs [B, d], or token-wise [B, ..., d] without bias. Rules (l = certified ||W||_2 of the current weights):
    ||y|| <= l ||x|| + ||b||; ||dL/dx|| <= l g; per-example ||dL/dW||_F <= g ||x|| (token-wise too:
    ||sum_t g_t x_t^T||_F <= ||g|| ||x||) and ||dL/db|| <= g — together g sqrt(||x||^2 + 1)
    (Barczewski and Ramon 2023, W8).

    The certified l is carried across steps (:meth:`lipschitz`): each projection certifies the weights it leaves
    (the Björck step's own certificate; the rescaling's from a Cholesky-checked Lanczos estimate), and the bound of
    the current weights is that certificate plus ||W - W_certified||_F, which is 0 unless something changed the
    weights since (then it is still an upper bound: ||W + D||_2 <= ||W||_2 + ||D||_F). Without a certificate that
    fits (first use, another dtype or device) l is the Gram-iteration bound. Both cost one float64 Gram product
    per step instead of the Gram iteration's 12.
    """

    # the certificate and the Lanczos warm start: written from the weights at the release and the projection, never
    # from the batch (fastdp.nn.validate.BufferWatch)
    dp_bookkeeping_buffers = ("_certified_norm", "_lanczos")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        projection: str = "orthogonal",
        max_norm: float = 1.0,
        bjorck_steps: int | None = None,
    ) -> None:
        super().__init__()
        if projection not in PROJECTIONS:
            raise ValueError(f"unknown projection {projection!r}; choose one of {', '.join(PROJECTIONS)}")
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be finite and > 0, got {max_norm}")
        if bjorck_steps is not None and (isinstance(bjorck_steps, bool) or not isinstance(bjorck_steps, int)
                                         or not 1 <= bjorck_steps <= 100):  # fmt: skip
            raise ValueError(f"bjorck_steps must be None (automatic) or an int in [1, 100], got {bjorck_steps!r}")
        n, m = sorted((in_features, out_features))
        self.bjorck_steps = bjorck_steps or max(1, min(15, BJORCK_BUDGET // max(1, n * n * m)))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.orthogonal_(self.weight, gain=max_norm if projection != "clip" else 1.0)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.projection = projection
        self.max_norm = float(max_norm)
        # (a copy of the weights, a certified float64 bound on their spectral norm): a plain attribute, not a buffer,
        # so that no dtype conversion can round the bound down or the copy differently from the weights
        self._certificate: tuple[torch.Tensor, torch.Tensor] | None = None
        # saved with the weights (resumed runs continue bit for bit), trusted on load only once a Cholesky check
        # proves the bound for the loaded weights (a tampered state dict cannot lower the noise); -1: none
        self.register_buffer("_certified_norm", torch.tensor(-1.0, dtype=torch.float64))
        # warm start of the Cholesky-checked estimate (clip, fixed); any vector is safe, the check certifies
        self.register_buffer("_lanczos", torch.zeros(min(in_features, out_features), dtype=torch.float64))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # the weights the saved bound certifies (those of the last projection): with them a resumed run carries the
        # same bound as the uninterrupted one when it resumes between projections (``project_every`` > 1)
        w = self.weight.detach()
        snapshot = self._certificate[0] if self._certificate is not None else w
        fits = snapshot.shape == w.shape and snapshot.dtype == w.dtype
        destination[prefix + "_certified_weight"] = (snapshot if fits else w).clone()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        state_dict.pop(prefix + "_u", None)  # the power-iteration vector of earlier checkpoints, now unused
        for name in ("_certified_norm", "_lanczos"):  # earlier checkpoints have no certificate: none, a cold start
            state_dict.setdefault(prefix + name, getattr(self, name).new_full(getattr(self, name).shape, -1.0))
        snapshot = state_dict.pop(prefix + "_certified_weight", None)  # earlier checkpoints: the weights themselves
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._certificate = None
        w = self.weight.detach()
        if not (isinstance(snapshot, torch.Tensor) and snapshot.shape == w.shape and snapshot.dtype == w.dtype):
            snapshot = w
        snapshot = snapshot.detach().to(w.device, copy=True)
        bound = self._certified_norm
        # whatever the file says, the bound is adopted only once proven for the snapshot; the release then reads
        # bound + ||W - snapshot||_F, an upper bound on ||W||_2 for any loaded W
        if bound.dtype == torch.float64 and bool(certify_norm_at_most(snapshot, bound)):
            self._certificate = (snapshot, bound.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None and x.dim() != 2:
            raise ValueError(f"LipschitzLinear with bias takes [B, d] inputs, got shape {tuple(x.shape)}")
        return self._summed_call(F.linear, x, self.weight, self.bias)

    def grad_sums(self, saved: tuple, grad_out: torch.Tensor) -> list[torch.Tensor]:
        return linear_grad_sums(self.weight, self.bias, saved, grad_out, None)

    def _certify(self, bound: torch.Tensor) -> None:
        """Record ``bound`` (float64, >= ||W||_2) as the certificate of the current weights."""
        self._certificate = (self.weight.detach().clone(), bound.to(torch.float64))
        if self._certified_norm.device == bound.device:
            self._certified_norm.copy_(bound)

    def _carried(self) -> torch.Tensor | None:
        """The certificate plus ||W - W_certified||_F (float64 0-d), or None where no certificate fits W."""
        if self._certificate is None:
            return None
        snapshot, bound = self._certificate
        w = self.weight.detach()
        if snapshot.shape != w.shape or snapshot.dtype != w.dtype or snapshot.device != w.device:
            return None
        return add_up(bound, frobenius_distance_up(w, snapshot))

    def _gram_bound(self) -> torch.Tensor:
        return certified_spectral_norm(self.weight.detach(), iters=CERTIFY_ITERS).to(torch.float64)

    def lipschitz(self) -> torch.Tensor:
        """Certified ||W||_2 of the current weights (float64 0-d tensor): the carried certificate (class docstring),
        else 12 Gram iterations (the bound exceeds sigma_max by at most a factor rank^(1/2^13), 1.0008 for rank 512),
        which then become the certificate."""

        def compute() -> torch.Tensor:
            carried = self._carried()
            if carried is not None:
                return carried
            bound = self._gram_bound()
            self._certify(bound)
            return bound

        return _certified(self, compute)

    def _bias_norm(self) -> Bound:
        return 0.0 if self.bias is None else norm_up(self.bias)

    def propagate(self, x_bound: Bound) -> Bound:
        return add_up(mul_up(self.lipschitz(), x_bound), self._bias_norm())

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        out = {self.weight: mul_up(g_bound, x_bound)} if self.weight.requires_grad else {}
        if self.bias is not None and self.bias.requires_grad:
            out[self.bias] = g_bound
        return out

    def backpropagate(self, g_bound: Bound) -> Bound:
        return mul_up(g_bound, self.lipschitz())

    @torch.no_grad()
    def project_(self) -> None:
        w = self.weight.detach()
        if self.projection == "orthogonal":
            c = self.max_norm
            # a certified step first (from any start into the ball), plain float32 steps, a certified one last
            # (its bound holds from any start): the certificate's arithmetic at most twice
            w, bound = certified_bjorck_step(w, c)
            if self.bjorck_steps > 2:
                (w,) = bjorck_orthonormalize([w / c], iters=self.bjorck_steps - 2)
                w = w * c
            if self.bjorck_steps > 1:
                w, bound = certified_bjorck_step(w, c)
            self.weight.copy_(w)
            self._certify(bound)
            return
        # a certified norm for one float64 Gram product: the Cholesky-checked estimate, else (it failed: +inf) the
        # carried certificate, or the Gram iteration where there is none (the first step)
        checked, vector = certified_norm_cholesky(w, self._lanczos)
        self._lanczos.copy_(vector)
        carried = self._carried()
        norm = torch.minimum(checked, carried if carried is not None else self._gram_bound())
        scale = self.max_norm / norm
        scale = torch.where(norm > 0, scale, torch.ones_like(scale))  # a zero matrix stays 0 (not 0 * inf = NaN)
        # "clip" rescales only when above C (a factor of exactly 1 otherwise); decided on the device, no sync
        factor = (scale if self.projection == "fixed" else scale.clamp(max=1.0)).to(w.dtype)
        self.weight.mul_(factor)
        # ||fl(f W)||_2 <= f ||W||_2 + ||E||_F, one rounding per entry: |E| <= u |f W| <= u / (1 - u) |fl(f W)|, or
        # eta where it underflows; the weights now hold fl(f W)
        f64 = factor.to(torch.float64)
        u, eta = spectral_ref._unit(w.dtype)
        rounding = add_up(mul_up(u / (1 - u) * (1 + 2.0**-50), norm_up(self.weight)), math.sqrt(w.numel()) * eta)
        self._certify(torch.where(factor == 1, norm, add_up(mul_up(f64, norm), rounding)))


class LipschitzConv2d(LipschitzModule, SummedLayer):
    """Bias-free 2-D convolution (zero padding) kept near 1-Lipschitz by reshaped kernel orthogonalisation (RKO):
    the [C_out, C_in kh kw] kernel matrix is orthonormalised and scaled by deel-lip's factor for ``input_hw``.

    Rules, with m = the most patches one input pixel can belong to (ceil(kh/sh) ceil(kw/sw), or kh kw with
    dilation) and ||M||_2 the certified spectral norm of the kernel matrix: ||y|| <= sqrt(m) ||M||_2 ||x|| (also
    the input-gradient factor), per-example ||dL/dW||_F <= sqrt(m) ||x|| g (Béthune et al. 2024
    Property 3; Barczewski and Ramon 2023 eq. 6). For 3x3, stride 1 this gives coef * 3 = 1.021 on 32x32, not
    the 1 that deel-lip assumes (pitfall P3 in docs/papers.md).
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
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.orthogonal_(self.weight.view(out_channels, -1))
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.input_hw = tuple(input_hw)
        with torch.no_grad():
            self.project_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._summed_call(self._conv, x, self.weight)

    def _conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, weight, None, self.stride, self.padding, self.dilation)

    def grad_sums(self, saved: tuple, grad_out: torch.Tensor) -> list[torch.Tensor]:
        shape = ConvShape(self.weight, None, self.stride, self.padding, self.dilation)
        return shape.clipped_grad_sums(saved, grad_out, None)

    def _root_overlap(self) -> int:
        return conv_root_overlap(self.kernel_size, self.stride, self.dilation)

    def _factor(self) -> torch.Tensor:
        matrix = self.weight.detach().reshape(self.weight.shape[0], -1)
        norm = _certified(self, lambda: certified_spectral_norm(matrix, iters=CERTIFY_ITERS))
        return mul_up(float(self._root_overlap()), norm)

    def propagate(self, x_bound: Bound) -> Bound:
        return mul_up(self._factor(), x_bound)

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        if not self.weight.requires_grad:
            return {}
        return {self.weight: mul_up(mul_up(float(self._root_overlap()), x_bound), g_bound)}

    def backpropagate(self, g_bound: Bound) -> Bound:
        return mul_up(self._factor(), g_bound)

    @torch.no_grad()
    def project_(self) -> None:
        self.weight.copy_(rko_orthonormalize(self.weight.detach(), self.input_hw, (self.stride, self.stride)))


def _l2_norm(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The L2 norm of ``x`` over ``dims`` (removed), accurate and 1-Lipschitz at every scale, with a finite gradient.

    The entries are divided by their largest magnitude m before squaring (||x|| = m ||x / m||,
    so no square underflows or overflows: float32 logits of 1e30 keep their norm, where ``vector_norm`` gives inf);
    the gradient is the unit direction x / ||x|| (norm 1 up to rounding), and 0 at x = 0: a subgradient of ||x||
    there (norm <= 1) where sqrt's infinite derivative gives NaN. Computed in float32 at least."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xs = x.to(acc)
    values = xs.detach()
    top = values.abs().amax(dim=dims, keepdim=True)
    scale = torch.where(top > 0, top, torch.ones_like(top))
    unit = values / scale  # its largest entry is +-1
    q = unit.square().sum(dim=dims, keepdim=True)  # >= 1, or 0 for an all-zero slice (NaN stays NaN)
    root = q.sqrt()
    norm = scale * root
    direction = torch.where(q == 0, 0.0, unit / root)  # d||x||/dx, and 0 at x = 0
    linear = (xs * direction).sum(dim=dims, keepdim=True)  # value 0 after the subtraction below, gradient direction
    return (norm + (linear - linear.detach())).squeeze(dims).to(x.dtype)


class L2NormPool2d(LipschitzModule):
    """L2 norm of each non-overlapping k x k window (stride = k): norm preserving up to dropped border pixels,
    1-Lipschitz (Béthune et al. 2024 ScaledL2NormPooling).

    Each window x is divided by its largest magnitude m before squaring (||x|| = m ||x / m||: no square underflows
    or overflows, so a tiny window keeps an accurate norm, not one off by up to 40 % where x**2 is subnormal in
    float32). The gradient is the unit direction x / ||x|| itself (norm 1 up to rounding, never an intermediate
    that underflows), and 0 at an all-zero window: a valid subgradient of ||x|| there (norm <= 1), where sqrt's
    infinite derivative made one black image's gradient NaN.
    """

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        if x.dim() < 3:
            raise ValueError(f"L2NormPool2d takes [B, C, H, W] or [C, H, W] inputs, got shape {tuple(x.shape)}")
        h, w = x.shape[-2] // k, x.shape[-1] // k
        if h == 0 or w == 0:
            raise ValueError(
                f"L2NormPool2d({k}): an input of {x.shape[-2]}x{x.shape[-1]} pixels is smaller than one {k}x{k} window"
            )
        return _l2_norm(x[..., : h * k, : w * k].reshape(*x.shape[:-2], h, k, w, k), (-3, -1))


class AddBias(LipschitzModule, SummedLayer):
    """y = x + b for [B, d] inputs, with ||b|| <= ``norm_max`` kept by projection onto the ball.

    Rules: ||y|| <= ||x|| + ||b|| (a certified norm of the current bias: <= norm_max after the projection, up to
    the rounding of its rescaling, which the constant norm_max would not cover); per-example ||dL/db|| <= g;
    ||dL/dx|| <= g.
    """

    def __init__(self, features: int, norm_max: float) -> None:
        super().__init__()
        if not (math.isfinite(norm_max) and norm_max >= 0):
            raise ValueError(f"AddBias: norm_max must be finite and >= 0, got {norm_max}")
        self.bias = nn.Parameter(torch.zeros(features))
        self.norm_max = float(norm_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"AddBias takes [B, d] inputs (one bias per example), got shape {tuple(x.shape)}")
        return self._summed_call(torch.add, x, self.bias)

    def grad_sums(self, saved: tuple, grad_out: torch.Tensor) -> list[torch.Tensor]:
        return [summation.weighted_sum(None, grad_out)] if self.bias.requires_grad else []

    def propagate(self, x_bound: Bound) -> Bound:
        return add_up(x_bound, norm_up(self.bias))

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        return {self.bias: g_bound} if self.bias.requires_grad else {}

    @torch.no_grad()
    def project_(self) -> None:
        norm = self.bias.norm()  # rescaled only when outside the ball; decided on the device, no sync
        self.bias.mul_(torch.where(norm > self.norm_max, self.norm_max / norm, 1.0))


class GroupSort2(LipschitzModule):
    """Pairs channel j with channel j + C/2 (last dimension) and outputs (min, max): norm preserving (GNP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"GroupSort2 needs an even number of features, got {x.shape[-1]}")
        a, b = x.chunk(2, dim=-1)
        return torch.cat([torch.minimum(a, b), torch.maximum(a, b)], dim=-1)


class Transpose(LipschitzModule):
    """Swaps two non-batch dimensions (e.g. tokens and channels in an MLP-Mixer): norm preserving."""

    def __init__(self, dim0: int, dim1: int) -> None:
        super().__init__()
        if 0 in (dim0, dim1):
            raise ValueError("Transpose must not move the batch dimension 0")
        self.dim0, self.dim1 = dim0, dim1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(self.dim0, self.dim1)


class LayerCentering(LipschitzModule):
    """x - mean(x) over the last dimension: singular values {0, 1, ..., 1}, so 1-Lipschitz and ||y|| <= ||x||."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=-1, keepdim=True)


class Residual(LipschitzModule):
    """1-Lipschitz merge ("1-lip-add"): y = (x + block(x)) / 2, block a sequence of Lipschitz modules.

    Rules: ||y|| <= (X + X_block) / 2; the block's parameters see the gradient bound g / 2; the input gradient
    bound is g (1 + l_block) / 2.
    """

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (x + self.block(x))

    def propagate(self, x_bound: Bound) -> Bound:
        return mul_up(0.5, add_up(x_bound, _forward_bounds(self.block, x_bound)[-1]))

    def sensitivities(self, x_bound: Bound, g_bound: Bound) -> dict[nn.Parameter, Bound]:
        return _backward_bounds(self.block, _forward_bounds(self.block, x_bound), mul_up(0.5, g_bound))[0]

    def backpropagate(self, g_bound: Bound) -> Bound:
        # dL/dx = g/2 + J_block^T (g/2): the block's rule is applied to g/2 itself (ClipGradient's is not linear);
        # gradient rules do not depend on the input bound, so any forward bound serves to walk the block.
        half = mul_up(0.5, g_bound)
        _, block_g = _backward_bounds(self.block, _forward_bounds(self.block, 1.0), half)
        return add_up(half, block_g)


class ClipGradient(LipschitzModule):
    """Identity forward; backward clips each example's gradient w.r.t. its input (the logits) to norm ``clip``.

    Rule: ||dL/dx|| <= min(g, clip) on the way back, so placed last it caps the loss constant L at ``clip``.
    """

    def __init__(self, clip: float) -> None:
        super().__init__()
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"ClipGradient: clip must be finite and > 0, got {clip}")
        self.clip = float(clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clip_gradient(x, self.clip * CLIP_MARGIN)  # a hair inside the clip the rule credits (CLIP_MARGIN)

    def backpropagate(self, g_bound: Bound) -> Bound:
        return _minimum(g_bound, self.clip)


# ----------------------------------------------------------------------------------------------------- losses


class LipschitzLoss(nn.Module):
    """A per-example loss (no reduction) with ``lipschitz``: a bound on ||d loss_i / d logits_i||_2."""

    lipschitz: float


class OutputGradientBound(LipschitzLoss):
    """A bound without a loss: the front door (``fastdp.engine``) clips each example's loss gradient w.r.t. the model
    output to ``lipschitz`` before backpropagating it, so the bound rules may credit any loss the user computes with
    it. Not callable as a loss (the user's loop computes its own)."""

    def __init__(self, lipschitz: float) -> None:
        super().__init__()
        if not (isinstance(lipschitz, (int, float)) and math.isfinite(lipschitz) and lipschitz > 0):
            raise ValueError(f"output_grad_bound must be finite and > 0, got {lipschitz!r}")
        self.lipschitz = float(lipschitz)

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise TypeError(
            "OutputGradientBound is a bound on the output gradient, not a loss: compute the loss in your own loop "
            "(through fastdp.PrivacyEngine), or train with a LipschitzLoss such as TauCrossEntropy"
        )


class TauCrossEntropy(LipschitzLoss):
    """CE(tau * logits, y) / tau (deel-lip's convention): its logit gradient softmax(tau z) - onehot(y) has norm
    <= sqrt(2), whatever tau."""

    lipschitz = SQRT2_UP

    def __init__(self, tau: float = 1.0) -> None:
        super().__init__()
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"TauCrossEntropy: tau must be finite and > 0, got {tau}")
        self.tau = float(tau)

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.tau * logits, y, reduction="none") / self.tau


class MulticlassKR(LipschitzLoss):
    """Kantorovich-Rubinstein, one vs all: -(z_y - mean_{j != y} z_j). Gradient: -1 at y, 1/(K-1) elsewhere,
    norm sqrt(1 + 1/(K-1)) <= sqrt(2) (the bound used)."""

    lipschitz = SQRT2_UP

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        k = logits.shape[1]
        true = logits.gather(1, y.unsqueeze(1)).squeeze(1)
        others = (logits.sum(1) - true) / (k - 1)
        return others - true


class MulticlassHKR(LipschitzLoss):
    """alpha * MulticlassHinge(margin) + MulticlassKR: Lipschitz alpha * 1 + sqrt(2) (the sum of the parts')."""

    def __init__(self, alpha: float = 10.0, margin: float = 1.0) -> None:
        super().__init__()
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"MulticlassHKR: alpha must be finite and >= 0, got {alpha}")
        self.alpha = float(alpha)
        self.hinge, self.kr = MulticlassHinge(margin), MulticlassKR()
        self.lipschitz = add_up(mul_up(self.alpha, self.hinge.lipschitz), self.kr.lipschitz)

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.alpha * self.hinge(logits, y) + self.kr(logits, y)


class MulticlassHinge(LipschitzLoss):
    """mean_j max(0, margin/2 - s_j z_j), s_j = +1 for the true class, -1 otherwise. Gradient entries are 0 or
    +-1/K, so its norm is <= 1/sqrt(K) <= 1 (the bound used: 1)."""

    lipschitz = 1.0

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.margin = float(margin)

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        true = torch.arange(logits.shape[1], device=logits.device) == y.unsqueeze(1)
        signs = 2.0 * true.to(logits.dtype) - 1.0
        return F.relu(self.margin / 2 - signs * logits).mean(1)


# ------------------------------------------------------------------------------------ backpropagation for bounds


_PARAMETER_FREE_OK = (nn.Flatten, nn.Identity, nn.ReLU)  # 1-Lipschitz, f(0) = 0, no parameters


def _layers(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, nn.Sequential):
        return list(model)
    return [model]


_RULES = (
    "fastdp.nn.lipschitz: BoundedInput, LipschitzLinear, LipschitzConv2d, AddBias, GroupSort2, L2NormPool2d, "
    "LayerCentering, Transpose, Residual, ClipGradient; plus Flatten, Identity, ReLU"
    "; fastdp.nn.lipdp: MaxPool2d, GlobalL2NormPool2d, GroupSort, ChannelGroupSort2, ToPatches"
    "; fastdp.nn.weightclip: WeightClipConv2d, LipschitzGroupNorm, ResidualSum, LipschitzSigmoid, LipschitzTanh"
)


_RULE_METHODS = ("propagate", "backpropagate")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _rule_problem(layer: nn.Module) -> str | None:
    """Why ``layer``'s bound rule does not cover what it computes, or None where it does. A rule is a class's: torch's
    Sequential, Flatten, Identity and ReLU, or a :class:`LipschitzModule`'s rule methods. It covers a subclass only
    if the subclass computes what its class does: a torch class's subclass overriding its forward does not (its
    output need not be the class's), nor does a subclass of a fastdp layer overriding its forward without rules of
    its own (``propagate`` and ``backpropagate``, and ``sensitivities`` with parameters: a user's own rule). A module
    hook (forward or backward, the module's or global) changes what the layer computes or backpropagates: refused."""
    hooks = [name for name in _HOOKS if getattr(layer, name, None)]
    hooks += [name for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                                "_global_backward_pre_hooks") if getattr(nn.modules.module, name, None)]  # fmt: skip
    if hooks:
        return f"has module hooks ({', '.join(hooks)}), which change what it computes beyond its bound rule"
    patched = [name for name in FORWARD_METHODS if name in vars(layer)]
    if patched:
        return (f"has {', '.join(patched)} set on the instance (a wrapper or a patch), which need not compute what "
                "its class's bound rule covers")  # fmt: skip
    cls = type(layer)
    torch_class = next((k for k in (nn.Sequential, *_PARAMETER_FREE_OK) if isinstance(layer, k)), None)
    if torch_class is not None:
        chain = cls.__mro__[: cls.__mro__.index(torch_class)]
        overridden = [name for klass in chain for name in FORWARD_METHODS if name in vars(klass)]
        if overridden:
            return (f"overrides {', '.join(dict.fromkeys(overridden))} of {torch_class.__name__}, whose bound rule "
                    "then need not hold for its output")  # fmt: skip
        return None
    if not isinstance(layer, LipschitzModule):
        return _NO_RULE
    own = [k for k in cls.__mro__ if issubclass(k, LipschitzModule) and not k.__module__.startswith("fastdp.")]
    forwards = [name for k in own for name in FORWARD_METHODS if name in vars(k)]
    needed = _RULE_METHODS + (("sensitivities",) if any(True for _ in layer.parameters(recurse=False)) else ())
    missing = [name for name in needed if not any(name in vars(k) for k in own)]
    base = next((k for k in cls.__mro__ if k.__module__.startswith("fastdp.")), LipschitzModule)
    if forwards and missing and base is not LipschitzModule:
        return (f"overrides {', '.join(dict.fromkeys(forwards))} of fastdp's {base.__name__} without bound rules of "
                f"its own ({', '.join(missing)}): {base.__name__}'s need not hold for its output")  # fmt: skip
    if own and missing and base is LipschitzModule:
        return (
            f"is a LipschitzModule without its own bound rules ({', '.join(missing)}): define them (the "
            "defaults are those of a parameter-free 1-Lipschitz map, which fastdp cannot check for your layer)"
        )
    return None


def _check(layer: nn.Module) -> None:
    problem = _rule_problem(layer)
    if problem is not None:
        raise ValueError(
            f"{type(layer).__name__} {problem}; clipless training needs every layer to have a bound rule that covers "
            f"it ({_RULES})"
        )


def _unsupported(model: nn.Module, path: str = "") -> list[tuple[str, str, str]]:
    """(path, type name, why) of every layer in the chain :func:`lipschitz_bounds` walks (nested Sequentials
    included) whose bound rule does not cover it (:func:`_rule_problem`), so one error can list them all."""
    problem = _rule_problem(model)
    found = [(path, type(model).__name__, problem)] if problem is not None else []
    if isinstance(model, nn.Sequential) and problem is None:
        for name, layer in model.named_children():
            found += _unsupported(layer, f"{path}.{name}" if path else name)
    return found


_NO_RULE = "has no Lipschitz bound rule"


def _listed(unsupported: list[tuple[str, str, str]]) -> str:
    """What :func:`_unsupported` found, for an error message: 'path (Type)' or 'path (Type): why'."""
    return ", ".join(f"{path or '<model>'} ({kind}){'' if why == _NO_RULE else ': ' + why}"
                     for path, kind, why in unsupported)  # fmt: skip


_UNBOUNDED = (
    "infinite gradient bound: the input norm is unbounded; start the model with BoundedInput(X_0) or give input_bound"
)


def _forward_bounds(model: nn.Module, x_bound: Bound) -> list[Bound]:
    """[X_0, X_1, ..., X_D]: input-norm bound of every layer, then the output bound.

    An infinite bound is a constant (a float) until a layer with weights meets it: refused there, on the host, so
    the tensor bounds after it are finite whenever the weights are (no device value is read)."""
    bounds = [x_bound]
    for layer in _layers(model):
        _check(layer)
        if isinstance(layer, nn.Sequential):
            bounds.append(_forward_bounds(layer, bounds[-1])[-1])
        elif isinstance(layer, LipschitzModule):
            if isinstance(bounds[-1], float) and math.isinf(bounds[-1]) and any(True for _ in layer.parameters()):
                raise ValueError(_UNBOUNDED)
            bounds.append(layer.propagate(bounds[-1]))
        else:
            bounds.append(bounds[-1])
    return bounds


def _backward_bounds(model: nn.Module, x_bounds: list[Bound], g_bound: Bound) -> tuple[dict, Bound]:
    """(parameter -> per-example gradient bound, gradient bound at the model input)."""
    sensitivities: dict[nn.Parameter, Bound] = {}

    def add(found: dict[nn.Parameter, Bound]) -> None:
        # A parameter used by several layers has the sum of its uses' gradients: bounds add up.
        for p, bound in found.items():
            sensitivities[p] = add_up(sensitivities[p], bound) if p in sensitivities else bound

    for layer, x_bound in reversed(list(zip(_layers(model), x_bounds[:-1], strict=True))):
        if isinstance(layer, nn.Sequential):
            inner, g_bound = _backward_bounds(layer, _forward_bounds(layer, x_bound), g_bound)
            add(inner)
        elif isinstance(layer, LipschitzModule):
            add(layer.sensitivities(x_bound, g_bound))
            g_bound = layer.backpropagate(g_bound)
    return sensitivities, g_bound


def check_rules(model: nn.Module) -> None:
    """Refuse, naming them all, the layers whose bound rule does not cover them (:func:`_rule_problem`)."""
    unsupported = _unsupported(model)
    if unsupported:
        raise ValueError(
            "these layers have no Lipschitz bound rule that covers them, so clipless/weightclip training cannot bound "
            f"their per-example gradients: {_listed(unsupported)}. Every layer needs one ({_RULES})"
        )


def lipschitz_bounds(
    model: nn.Module, loss: LipschitzLoss, input_bound: float = math.inf, output_gradient_bound: Bound | None = None
) -> dict[nn.Parameter, Bound]:
    """Per-example gradient-norm bound Delta_l of every trainable parameter (Algorithm 1 of Béthune et al. 2024, for the
    summed loss: no 1/b). ``input_bound`` is X_0 unless the model starts with :class:`BoundedInput`;
    ``output_gradient_bound`` C, where each example's loss gradient w.r.t. the model output is clipped to C, makes
    the start of the backward walk min(L, C) instead of the loss's constant L.

    Bounds that depend on the weights are float64 0-d tensors on their device (computed without a host
    synchronisation; each layer's certified norm once per call), the others floats; all are rounded up. Raises
    ValueError for a module without bound rules, a trainable parameter no rule covers, or an infinite bound (no
    finite input bound anywhere before a parametrised layer). Non-finite weights give non-finite tensor bounds
    (+inf where a certified norm meets them): checking them is the caller's (the trainer checks the parameters
    once per epoch).
    """
    check_rules(model)
    _bounds_pass.memo = {}
    try:
        start = loss.lipschitz if output_gradient_bound is None else _minimum(loss.lipschitz, output_gradient_bound)
        sensitivities, _ = _backward_bounds(model, _forward_bounds(model, float(input_bound)), start)
    finally:
        _bounds_pass.memo = None
    trainable = [p for p in model.parameters() if p.requires_grad]
    missing = [p for p in trainable if p not in sensitivities]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameters are not covered by a Lipschitz layer's bound rule")
    if any(isinstance(s, float) and not math.isfinite(s) for s in sensitivities.values()):
        raise ValueError(_UNBOUNDED)
    return sensitivities


def _batchable(module: nn.Module) -> bool:
    """Whether ``module.project_`` is the RKO projection that :func:`project_` can batch."""
    return isinstance(module, LipschitzConv2d) and type(module).project_ is LipschitzConv2d.project_


@torch.no_grad()
def _project_batched_(convs: list[LipschitzConv2d]) -> None:
    """``project_`` of these conv layers (on one device) with one Björck call over all their kernel matrices."""
    _, _, kernels = lipschitz_projection(
        [], [], [c.weight for c in convs], [c.input_hw for c in convs], [(c.stride, c.stride) for c in convs]
    )
    for c, k in zip(convs, kernels, strict=True):
        c.weight.copy_(k)


def project_(model: nn.Module) -> None:
    """Apply every layer's projection Pi (after an optimizer step; post-processing, free in privacy).

    The RKO projections of all ``LipschitzConv2d`` layers run together, one Björck call per device
    for the whole model (``fastdp.ops.orthogonal.lipschitz_projection``); the results are those of
    each layer's own ``project_``. Other layers (``LipschitzLinear``'s certified Björck step or
    rescaling among them), and all layers when the convs share a weight with another layer,
    project one by one.
    """
    modules = [m for m in model.modules() if isinstance(m, LipschitzModule) and m is not model]
    if isinstance(model, LipschitzModule):
        modules.append(model)
    batched = [m for m in modules if _batchable(m)]
    weight_ids = [id(m.weight) for m in batched]
    other_ids = {id(p) for m in modules if not _batchable(m) for p in m.parameters(recurse=False)}
    if len(set(weight_ids)) < len(weight_ids) or other_ids.intersection(weight_ids):
        batched = []  # a shared weight: sequential projections compose, keep their order
    batched_ids = {id(m) for m in batched}
    for module in modules:
        if id(module) not in batched_ids:
            module.project_()
    for device in dict.fromkeys(m.weight.device for m in batched):
        on_device = [m for m in batched if m.weight.device == device]
        _project_batched_(on_device)
