"""More of lip-dp (Béthune et al. 2024, the ``deel.lipdp`` package): layers, losses, and certified robustness.

Layers (``LipschitzModule`` subclasses with the bound rules of :mod:`fastdp.nn.lipschitz`): all are parameter-free,
1-Lipschitz in L2 and map 0 to 0, so their rules are the default ones: ``propagate(X) = X`` (``||f(x)|| =
||f(x) - f(0)|| <= ||x||``), ``backpropagate(g) = g`` (every Jacobian, where it exists, and every gradient autograd
returns at a kink, has spectral norm <= 1), no sensitivities (no parameters):

* :class:`MaxPool2d`: max over non-overlapping k x k windows (stride = k);
* :class:`GlobalL2NormPool2d`: per channel, the L2 norm over H, W (norm preserving; gradient 0, not NaN, at 0);
* :class:`GroupSort`: sorts groups of n consecutive features (norm preserving: a permutation of each example);
* :class:`ChannelGroupSort2`: ``GroupSort2`` along the channel dimension 1 of [B, C, ...] (norm preserving);
* :class:`ToPatches`: [B, C, H, W] -> [B, tokens, C p p], non-overlapping p x p patches (a permutation).

Losses (``LipschitzLoss``: per-example losses whose ``lipschitz`` bounds each example's gradient w.r.t. its logits,
rounded up): :class:`TauBinaryCrossEntropy` (L = 1) and :class:`KCosineSimilarity` (L = 1 / (K max(1, K))); with
those of :mod:`fastdp.nn.lipschitz`, :data:`LOSSES` names them all for ``--loss`` (:func:`lipschitz_loss`).

Certified robustness: :func:`lipschitz_constant` (the model's certified L2 Lipschitz constant, from the bound rules)
and :func:`certified_mask` / :func:`certified_accuracy` (an example certified at radius r: correctly classified with
margin > sqrt(2) L r).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.nn.lipschitz import (
    SQRT2_UP,
    Bound,
    ClipGradient,
    LipschitzLoss,
    LipschitzModule,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    TauCrossEntropy,
    _backward_bounds,
    _bounds_pass,
    _forward_bounds,
    _l2_norm,
    _listed,
    _unsupported,
    fraction_up,
    mul_up,
)

__all__ = [
    "LOSSES",
    "ChannelGroupSort2",
    "GlobalL2NormPool2d",
    "GroupSort",
    "KCosineSimilarity",
    "MaxPool2d",
    "TauBinaryCrossEntropy",
    "ToPatches",
    "certified_accuracy",
    "certified_mask",
    "lipschitz_constant",
    "lipschitz_loss",
    "loss_from_config",
]


def _batch_dim_refused(layer: str, dim: int, ndim: int) -> int:
    """``dim`` resolved against ``ndim`` dimensions; ValueError if it is the batch dimension 0."""
    resolved = dim % ndim if -ndim <= dim < ndim else None
    if resolved is None:
        raise ValueError(f"{layer}: dimension {dim} does not exist in an input of {ndim} dimensions")
    if resolved == 0:
        raise ValueError(f"{layer}: dimension {dim} is the batch dimension 0, which would mix examples; give a "
                         "feature dimension (e.g. -1, or 1 for the channels of [B, C, H, W])")  # fmt: skip
    return resolved


# ------------------------------------------------------------------------------------------------------------ layers


class MaxPool2d(LipschitzModule):
    """Max over non-overlapping ``kernel_size`` x ``kernel_size`` windows (stride = kernel; border rows and columns
    that fill no window are dropped), of [B, C, H, W] or [C, H, W] inputs (lip-dp's ``DP_MaxPool2D``).

    Rules (the defaults): 1-Lipschitz, since |max a - max b| <= max |a - b| <= ||a - b|| on each window and the
    windows are disjoint, so the squares add up to at most ||x - x'||^2; f(0) = 0, so ||y|| <= ||x||. The gradient
    (torch's, ties included: all of a window's gradient goes to one of its maxima) has norm ||g||. Overlapping
    windows (stride < kernel) are not offered: a pixel in m windows would make the constant sqrt(m)."""

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"MaxPool2d: kernel_size must be an integer >= 1, got {kernel_size!r}")
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        if x.dim() not in (3, 4):
            raise ValueError(f"MaxPool2d takes [B, C, H, W] or [C, H, W] inputs, got shape {tuple(x.shape)}")
        if x.shape[-2] < k or x.shape[-1] < k:
            raise ValueError(
                f"MaxPool2d({k}): an input of {x.shape[-2]}x{x.shape[-1]} pixels is smaller than one {k}x{k} window"
            )
        return F.max_pool2d(x, k, stride=k)


class GlobalL2NormPool2d(LipschitzModule):
    """Per channel, the L2 norm over all pixels: [B, C, H, W] -> [B, C] ([C, H, W] -> [C]); lip-dp's
    ``DP_ScaledGlobalL2NormPooling2D`` without its epsilon (sqrt(sum x^2 + eps) maps 0 to sqrt(eps), not 0).

    Rules (the defaults): norm preserving (sum_c ||x_c||^2 = ||x||^2) and 1-Lipschitz (| ||a|| - ||b|| | <= ||a - b||
    per channel). The gradient is x_c / ||x_c|| times g_c (norm ||g||), and 0 at an all-zero channel (a valid
    subgradient; no NaN for a black image); accurate for tiny and huge inputs (see ``_l2_norm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (3, 4):
            raise ValueError(f"GlobalL2NormPool2d takes [B, C, H, W] or [C, H, W] inputs, got shape {tuple(x.shape)}")
        return _l2_norm(x, (-2, -1))


class GroupSort(LipschitzModule):
    """Sorts each group of ``group_size`` consecutive features of dimension ``dim`` in ascending order (deel-lip's
    ``GroupSort(n)``; n = 2 pairs features 2j and 2j + 1, unlike :class:`~fastdp.nn.lipschitz.GroupSort2`, which pairs
    j with j + C/2; n = the whole dimension is a full sort).

    Rules (the defaults): each example's output is a permutation of its input, so ||y|| = ||x||; sorting is
    1-Lipschitz in L2 (rearrangement inequality: ||sort a - sort b|| <= ||a - b||); the gradient is a permutation of g
    (at ties too: torch routes it along the sort's own permutation). ``dim`` must not be the batch dimension 0."""

    def __init__(self, group_size: int, dim: int = -1) -> None:
        super().__init__()
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"GroupSort: group_size must be an integer >= 1, got {group_size!r}")
        self.group_size, self.dim = group_size, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = _batch_dim_refused("GroupSort", self.dim, x.dim())
        n, size = self.group_size, x.shape[dim]
        if size % n:
            raise ValueError(f"GroupSort({n}): dimension {self.dim} has {size} features, not a multiple of {n}")
        if n == 1:
            return x
        moved = x.movedim(dim, -1)
        groups = moved.unflatten(-1, (size // n, n))
        return groups.sort(dim=-1).values.flatten(-2).movedim(-1, dim)


class ChannelGroupSort2(LipschitzModule):
    """GroupSort2 along the channel dimension 1 of [B, C, ...] inputs (images [B, C, H, W]): at every pixel, channel
    j is paired with channel j + C/2 and the pair becomes (min, max), lip-dp's ``DP_GroupSort(2)`` on images
    (the existing :class:`~fastdp.nn.lipschitz.GroupSort2` acts on the last dimension, the width of an image).

    Rules (the defaults): norm preserving (each pair is permuted), 1-Lipschitz (sorting pairs), f(0) = 0. At a tie
    torch gives each of the pair half of g_min + g_max: the gradient (g_min + g_max) / 2 (1, 1), of norm
    |g_min + g_max| / sqrt(2) <= ||(g_min, g_max)||."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"ChannelGroupSort2 takes [B, C, ...] inputs, got shape {tuple(x.shape)}")
        if x.shape[1] % 2:
            raise ValueError(f"ChannelGroupSort2 needs an even number of channels (dimension 1), got {x.shape[1]}")
        a, b = x.chunk(2, dim=1)
        return torch.cat([torch.minimum(a, b), torch.maximum(a, b)], dim=1)


class ToPatches(LipschitzModule):
    """[B, C, H, W] -> [B, (H/p)(W/p), C p p]: non-overlapping p x p patches as tokens (an MLP-Mixer's input; the
    patch embedding is a token-wise ``LipschitzLinear`` after it). H and W must be multiples of p.

    Rules (the defaults): a fixed permutation of each example's coordinates: norm preserving, 1-Lipschitz."""

    def __init__(self, patch_size: int) -> None:
        super().__init__()
        if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1:
            raise ValueError(f"ToPatches: patch_size must be an integer >= 1, got {patch_size!r}")
        self.patch_size = patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        if x.dim() != 4 or x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"ToPatches({p}) takes [B, C, H, W] inputs with H and W multiples of {p}, got shape "
                             f"{tuple(x.shape)}")  # fmt: skip
        b, c, h, w = x.shape
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # [B, H/p, W/p, C, p, p]
        return patches.reshape(b, (h // p) * (w // p), c * p * p)


# ------------------------------------------------------------------------------------------------------------ losses


def _half_sqrt2_down() -> float:
    """The largest float32 c with 2 c^2 <= 1 (exactly representable in float32 and float64, so a model in either
    dtype multiplies by the same c, and ||(-c, c)|| = c sqrt(2) <= 1 exactly)."""
    c = float(torch.tensor(math.sqrt(0.5), dtype=torch.float32))
    while 2 * Fraction(c) ** 2 > 1:
        c = float(torch.nextafter(torch.tensor(c, dtype=torch.float32), torch.tensor(0.0)))
    return c


_HALF_SQRT2 = _half_sqrt2_down()


class TauBinaryCrossEntropy(LipschitzLoss):
    """BCE(tau z, y) / tau on one logit z per example (deel-lip's ``TauBinaryCrossentropy``, lip-dp's ``DP_TauBCE``).

    Logits: [B] or [B, 1] (z itself), or the [B, 2] logits of a two-class model, read as z = c (z_1 - z_0) with c =
    1/sqrt(2) rounded down (``_HALF_SQRT2``). Labels: class 1 is positive; y is clamped to [0, 1], so 0/1 labels are
    kept and -1/+1 labels (deel-lip's) read as 0/1.

    Bound: d/dz [log(1 + e^(tau z)) - y tau z] / tau = sigmoid(tau z) - y, in [-1, 1] for y in [0, 1], whatever tau;
    on two logits the gradient is (sigmoid(tau z) - y) c (-1, 1), of norm <= c sqrt(2) <= 1. So L = 1 (exact). On two
    logits this equals CE(tau' z) / tau' / sqrt(2) with tau' = tau c (TauCrossEntropy rescaled: the same
    classifier, with the bound 1 of its own scale instead of sqrt(2))."""

    lipschitz = 1.0

    def __init__(self, tau: float = 1.0) -> None:
        super().__init__()
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"TauBinaryCrossEntropy: tau must be finite and > 0, got {tau!r}")
        self.tau = float(tau)

    @staticmethod
    def logit(logits: torch.Tensor) -> torch.Tensor:
        """The one logit z per example ([B]) of [B], [B, 1] or [B, 2] logits (see the class docstring)."""
        if logits.dim() == 1:
            return logits
        if logits.dim() == 2 and logits.shape[1] == 1:
            return logits[:, 0]
        if logits.dim() == 2 and logits.shape[1] == 2:
            return (logits[:, 1] - logits[:, 0]) * _HALF_SQRT2
        raise ValueError(
            f"TauBinaryCrossEntropy takes one logit per example ([B] or [B, 1]) or the [B, 2] logits of a binary "
            f"task, got shape {tuple(logits.shape)}; for more classes use tau-ce (TauCrossEntropy)"
        )

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.logit(logits)
        target = y.to(z.dtype).clamp(0.0, 1.0)
        return F.binary_cross_entropy_with_logits(self.tau * z, target, reduction="none") / self.tau


class KCosineSimilarity(LipschitzLoss):
    """lip-dp's ``DP_KCosineSimilarity(K)``: minus the cosine similarity of the logits z and the one-hot label e_y,
    each normalised as ``tf.linalg.l2_normalize(v, epsilon=K**2)`` normalises, v / max(||v||, K):

        loss = -z_y / (max(1, K) max(||z||, K))

    Bound (derived): for ||z|| < K the gradient is -e_y / (K max(1, K)), of norm 1 / (K max(1, K)); for ||z|| > K it
    is -(e_y - (z_y / ||z||^2) z) / (max(1, K) ||z||), of norm sqrt(1 - z_y^2 / ||z||^2) / (max(1, K) ||z||) <
    1 / (K max(1, K)); at ||z|| = K autograd takes the second form. So L = 1 / (K max(1, K)), rounded up. lip-dp's
    ``get_L`` returns 1 / K^2: the same for K >= 1, and K^-1 times too large for K < 1 (K = 0.1: noise 10x what the
    loss needs). ||z|| is computed scaled by its largest entry (no overflow of float32 squares) with gradient 0 at
    z = 0 (``_l2_norm``); the paper's range is K in [0.01, 1]."""

    def __init__(self, k: float = 1.0) -> None:
        super().__init__()
        if not (isinstance(k, (int, float)) and math.isfinite(k) and k > 0):
            raise ValueError(f"KCosineSimilarity: K must be finite and > 0, got {k!r}")
        self.k = float(k)
        self.lipschitz = fraction_up(1 / (Fraction(self.k) * max(Fraction(1), Fraction(self.k))))

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"KCosineSimilarity takes [B, classes] logits, got shape {tuple(logits.shape)}")
        norm = _l2_norm(logits, (1,)).clamp(min=self.k)
        true = logits.gather(1, y.unsqueeze(1)).squeeze(1)
        return -true / (max(1.0, self.k) * norm)


# name -> (description, builder from the settings); the builders validate their settings
LOSSES: dict[str, str] = {
    "tau-ce": "CE(tau z, y) / tau (TauCrossEntropy, --tau): L = sqrt(2)",
    "tau-bce": "BCE(tau z, y) / tau on one logit, binary tasks (TauBinaryCrossEntropy, --tau): L = 1",
    "kr": "multiclass Kantorovich-Rubinstein, one vs all (MulticlassKR): L = sqrt(2)",
    "hinge": "multiclass hinge with --margin (MulticlassHinge): L = 1",
    "hkr": "alpha hinge + KR (MulticlassHKR, --hkr-alpha, --margin): L = alpha + sqrt(2)",
    "cosine": "K-cosine similarity (KCosineSimilarity, --cosine-k K): L = 1 / (K max(1, K))",
}


def lipschitz_loss(
    name: str, *, tau: float = 1.0, margin: float = 1.0, alpha: float = 10.0, cosine_k: float = 1.0
) -> LipschitzLoss:
    """The loss ``name`` of :data:`LOSSES` with its settings (the others are ignored). ValueError for an unknown name
    or an invalid setting."""
    if name == "tau-ce":
        return TauCrossEntropy(tau)
    if name == "tau-bce":
        return TauBinaryCrossEntropy(tau)
    if name == "kr":
        return MulticlassKR()
    if name in ("hinge", "hkr"):
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
            raise ValueError(f"{name}: the margin must be finite and > 0, got {margin!r}")
        return MulticlassHinge(margin) if name == "hinge" else MulticlassHKR(alpha, margin)
    if name == "cosine":
        return KCosineSimilarity(cosine_k)
    raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")


def loss_from_config(config) -> LipschitzLoss:
    """The clipless / weightclip loss of a training configuration: ``config.loss`` (default ``"tau-ce"``) with
    ``tau``, ``margin``, ``hkr_alpha`` and ``cosine_k`` (defaults 1, 1, 10, 1 where the configuration lacks them)."""
    return lipschitz_loss(
        getattr(config, "loss", "tau-ce"),
        tau=getattr(config, "tau", 1.0),
        margin=getattr(config, "margin", 1.0),
        alpha=getattr(config, "hkr_alpha", 10.0),
        cosine_k=getattr(config, "cosine_k", 1.0),
    )


# ------------------------------------------------------------------------------------------- certified robustness


def lipschitz_constant(model: nn.Module) -> Bound:
    """A certified upper bound on the L2 Lipschitz constant of ``model`` (all of one example's input -> its logits),
    from the same bound rules that give the clipless sensitivities: backpropagation for bounds with a unit gradient
    at the output (``_backward_bounds`` with g = 1), i.e. the rounded-up product of the layers' certified constants
    (Residual: (1 + l_block) / 2). A float64 0-d tensor where it depends on the weights (no host read), else a float.

    Every rule ``backpropagate(g)`` used here is g times a Lipschitz constant of the layer's forward, except
    ClipGradient's (its forward is the identity; min(g, clip) clips the backward pass only): a model containing one
    is refused. ValueError also for a layer without bound rules (the same message as ``lipschitz_bounds``)."""
    unsupported = _unsupported(model)
    if unsupported:
        raise ValueError(f"these layers have no Lipschitz bound rule that covers them, so the model has no certified "
                         f"Lipschitz constant: {_listed(unsupported)}")  # fmt: skip
    if any(isinstance(m, ClipGradient) for m in model.modules()):
        raise ValueError(
            "the model contains ClipGradient, whose backward rule min(g, clip) is not a Lipschitz constant of its "
            "forward (the identity); certify the model without it (e.g. the same layers in a Sequential without "
            "the ClipGradient: it does not change the logits)"
        )
    _bounds_pass.memo = {}  # each layer's certified norm once, for the forward and the backward walk
    try:
        _, constant = _backward_bounds(model, _forward_bounds(model, 1.0), 1.0)
    finally:
        _bounds_pass.memo = None
    return constant


def certified_mask(logits: torch.Tensor, y: torch.Tensor, lipschitz: Bound, radius: float) -> torch.Tensor:
    """Which examples are certified robust at L2 radius ``radius``: correctly classified, with margin (top logit
    minus runner-up) > sqrt(2) L r, for a model whose logits are L-Lipschitz (L2 -> L2) in its input.

    Why sqrt(2): a perturbation d with ||d|| <= r moves the logits by some u with ||u|| <= L r; the margin between
    the true class a and any class b changes by u_b - u_a, and |u_b - u_a| <= sqrt(2) sqrt(u_a^2 + u_b^2) <= sqrt(2)
    ||u|| <= sqrt(2) L r (Cauchy-Schwarz with (1, -1); tight when u = L r (e_b - e_a) / sqrt(2)). So a margin above
    sqrt(2) L r keeps a the unique top class for every such d (Béthune et al. 2024 §4: radius margin / (L sqrt(2));
    Tsuzuku et al. 2018). The threshold is rounded up (``mul_up``); margins are taken in float64 from the logits as
    computed, i.e. the certificate is for the network in exact arithmetic (its float32 rounding, about 1e-7 of the
    logits' size, is not covered). Ties for the top logit are never certified (margin 0). Returns a bool [B]."""
    if not (isinstance(radius, (int, float)) and math.isfinite(radius) and radius >= 0):
        raise ValueError(f"the certification radius must be finite and >= 0, got {radius!r}")
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"certification needs [B, classes >= 2] logits, got shape {tuple(logits.shape)}")
    z = logits.detach().to(torch.float64)
    top = z.topk(2, dim=1)
    threshold = mul_up(mul_up(SQRT2_UP, lipschitz), float(radius))
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.to(z.device)
    margin = top.values[:, 0] - top.values[:, 1]
    return (top.indices[:, 0] == y.to(z.device)) & (margin > threshold)


def certified_accuracy(logits: torch.Tensor, y: torch.Tensor, lipschitz: Bound, radius: float) -> float:
    """The fraction of examples :func:`certified_mask` certifies at ``radius`` (0 for no examples)."""
    mask = certified_mask(logits, y, lipschitz, radius)
    return float(mask.double().mean()) if mask.numel() else 0.0
