"""Sensitivity fuzzer: random architectures x adversarial batches x variants x precisions, each example's leave-one-out
change of the noiseless release against the variant's claimed bound, or a clear refusal.

What it would have found (privacy review, holes 1-5): ghost norms that cancel at large magnitude (tokens ``s u + e``,
``-s u``; a checkerboard image into a conv with global pooling), batch statistics in eval mode, a layer applied twice
under backprop clipping, low-precision parameters, a layer called on a ``[T, B, d]`` view with T == B.

One case (:class:`FuzzCase`) is drawn by hypothesis: an architecture (:data:`ARCHITECTURES`), a variant, a precision
(``fp64``: the model in float64, the sharpest check; ``fp32``; ``bf16``: autocast of the forward, for the variants that
accept it; ``param-bf16``: the model cast with ``.bfloat16()``), an attack on one target example (:data:`ATTACKS`:
huge magnitude, positions or patches that cancel, an all-zero row, a non-finite entry, many copies of it in the
batch), the batch size and a seed. The case is run as a user would: one step of the variant on the batch D (which
converts the layers and records what the claim is read from), then the noiseless release (sigma = 0, the variant's
own code: :func:`fastdp.audit.claims.noiseless`) on D and on D without the target. The outcome is

* ``ok``: for every sensitivity group g of the variant's claim (:func:`fastdp.audit.claims.claim_of`),
  ``||u_g(D) - u_g(D - target)|| b <= Delta_g (1 + 1e-6) + rounding``, where rounding is 0 for float64 and
  ``2 u B Delta_g`` (u = 2^-24, B rows) in fp32 and bf16: every variant sums the batch in float64 with its rounding
  inside its bound (``fastdp.ops.summation``; DP-SGD and JL in their clip bound, the variants whose bound lives in the
  network in their noise, ``fastdp.nn.layers.SummedLayer``), and the noiseless release is only cast to float32
  (an fp32 sum over the batch, re-rounded by every example, had needed 8 u B Delta_g); DP-SGD-JL's bound is
  ``C max(Z, z_floor)`` (its clip factor comes from a norm estimate M, ``Z = ||g|| / M``; see ``_Auditor.jl_ratio`` in
  :mod:`fastdp.audit.sensitivity`);
* ``refused``: the variant raised ``ValueError`` (``UnsupportedLayerError`` included) or ``TypeError`` naming what
  is wrong, before releasing anything;
* ``stopped``: an fp32 release with a non-finite example is not finite; documented (docs/bad-inputs.md): the
  trainer stops the run and reports no epsilon;
* ``violation`` (the bound does not hold), ``crash`` (another exception: not a clear error) and ``must-refuse``
  (a case that has to be refused, e.g. low-precision parameters, was run) fail the fuzz.

``python -m fastdp.audit`` runs the full fuzz (:func:`run_fuzz`) into its report; ``tests/test_fuzz.py`` runs a fast
slice in ``make test``.
"""

from __future__ import annotations

import copy
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from torch import nn

from fastdp.algorithms import DPSGD, JL, BackpropClip, Batch, Clipless, Variant, WeightClip
from fastdp.algorithms.base import trainable_parameters
from fastdp.audit.claims import claim_of, noiseless
from fastdp.audit.sensitivity import _Auditor
from fastdp.audit.setups import AuditCase
from fastdp.nn.lipdp import ChannelGroupSort2, GlobalL2NormPool2d, GroupSort, MaxPool2d, lipschitz_loss
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, L2NormPool2d, LipschitzConv2d, LipschitzLinear, project_
from fastdp.nn.weightclip import LipschitzGroupNorm, LipschitzSigmoid, LipschitzTanh, ResidualSum, WeightClipConv2d
from fastdp.train.models import build_model

# through fastdp.PrivacyEngine, the user's own loop: front-door kind -> the variant behind it
FRONT_DOOR = {"front-door": "dpsgd", "front-door-jl": "jl", "front-door-backprop": "backprop",
              "front-door-clipless": "clipless", "front-door-weightclip": "weightclip"}  # fmt: skip
VARIANTS = ("dpsgd", "dpsgd-reference", "dpsgd-per-layer", "jl", "backprop", "clipless", "clipless-quantile",
            "weightclip", *FRONT_DOOR)  # fmt: skip
PRECISIONS = ("fp64", "fp32", "bf16", "param-bf16")
AUTOCAST = ("dpsgd", "dpsgd-per-layer", "front-door")  # the variants that train under bf16 autocast
STATUSES = ("ok", "refused", "stopped", "violation", "open", "crash", "must-refuse")
# Known holes, still open, that the fuzzer finds: (variant, precision, attack) -> what and where it is tracked. Their
# violations are reported as "open" (listed with their ratios in every report) instead of failing the run; a
# violation outside this list fails it. Each entry is a bug to fix, not an exemption to keep.
KNOWN_OPEN: dict[tuple[str, str, str], str] = {}
ATTACKS = ("ordinary", "huge", "cancel", "zero", "nonfinite", "copies")
ATTACK_DRAWS = (*ATTACKS, "cancel", "cancel", "huge")  # the attacks that found holes, drawn more often
CLASSES = 3
RELATIVE_SLACK = 1e-6
# every variant sums in float64 with the rounding folded into its bound (fastdp.ops.summation): what is left is the
# cast of the noiseless release to float32, at most u of each of the two releases, 2 u B Delta
CAST_UNITS = 2
FP32_UNIT = 2.0**-24
KEY = 20_261_123  # the reproducible privacy key of the fuzzer's variants (never released: noiseless)


# ----------------------------------------------------------------------------------------------------- architectures


class Tokenwise(nn.Module):
    """Linear on every position of a [B, T, d] sequence (optionally with LayerNorm), mean-pooled: positions that
    cancel at large magnitude cancel in the example's gradient too."""

    def __init__(self, d: int, hidden: int, norm: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden) if norm else nn.Identity()
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)).mean(1))


class ConvNet(nn.Module):
    """Conv2d (stride, dilation, groups, padding drawn) -> GroupNorm -> global average pool or flatten -> Linear."""

    def __init__(self, channels: int, size: int, out: int, kernel: int, stride: int, dilation: int, groups: int,
                 padding: int, pool: bool, norm: bool, relu: bool) -> None:  # fmt: skip
        super().__init__()
        self.conv = nn.Conv2d(channels, out, kernel, stride=stride, dilation=dilation, groups=groups, padding=padding)
        self.norm = nn.GroupNorm(groups, out) if norm else nn.Identity()
        side = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
        self.pool, self.relu = pool, relu
        self.head = nn.Linear(out if pool else out * side * side, CLASSES)

    def forward(self, x):
        h = self.norm(self.conv(x))
        h = torch.relu(h) if self.relu else h
        return self.head(h.mean((2, 3)) if self.pool else h.flatten(1))


class Residual(nn.Module):
    """Two residual blocks x + Linear(ReLU(LayerNorm(x))), then a head."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d)) for _ in range(2))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class TokenModel(nn.Module):
    """Embedding (padding index 0) + positional Embedding on [B, T] index, masked mean pool, optional attention."""

    def __init__(self, vocab: int, d: int, seq: int, attention: bool) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d, padding_idx=0), nn.Embedding(seq, d)
        self.qkv = nn.Linear(d, 3 * d) if attention else None
        self.head = nn.Linear(d, CLASSES)

    def forward(self, idx):
        keep = (idx != 0).unsqueeze(-1).to(self.head.weight.dtype)
        pos = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        x = self.tokens(idx) + self.positions(pos)
        if self.qkv is not None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(keep.transpose(1, 2) == 0, -1e9)
            x = x + torch.softmax(scores, dim=-1) @ v
        return self.head((x * keep).sum(1) / keep.sum(1).clamp_min(1))


class SequenceFirst(nn.Module):
    """A Linear called on a [T, B, d] view (T == B in the fuzz): per position in layout (hole 5)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(d, hidden), nn.Linear(hidden, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x.transpose(0, 1))).mean(0))


class Reused(nn.Module):
    """One Linear applied twice (a shared layer, hole 3)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(d, d), nn.Linear(d, CLASSES)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


class Tied(nn.Module):
    """Two Linear layers sharing one weight (tied weights)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, CLASSES)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.a(x))))


class TiedTokens(nn.Module):
    """A language model's sharing: token embeddings tied to the output layer, position embeddings looked up with one
    ``[1, T]`` index shared by the batch (as transformers models do); ``first=True`` reads the lookup back as
    ``pos[0]``, which routes every example's gradient through example 0's row once the index is expanded to the batch
    (must be refused)."""

    def __init__(self, vocab: int, d: int, seq: int, first: bool = False) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.tokens.weight
        self.first = first

    def forward(self, idx):
        pos = self.positions(torch.arange(idx.shape[1], device=idx.device).unsqueeze(0))
        h = torch.tanh(self.mix(self.tokens(idx) + (pos[0] if self.first else pos)))
        return self.out(h).mean(1)[:, :CLASSES]


class SharedIndex(nn.Module):
    """An Embedding looked up with an index shared by the batch whose length is the batch size (``arange(B)``, like
    a position index when T == B), its rows averaged into every example: rows that are not examples."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.pos, self.head = nn.Linear(d, 8), nn.Embedding(64, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        shared = self.pos(torch.arange(x.shape[0], device=x.device)).mean(0)
        return self.head(torch.tanh(self.lin(x) + shared))


class EvalBatchNorm(nn.Module):
    """BatchNorm1d without running statistics, in eval mode: batch statistics all the same (hole 2)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(d, d), nn.BatchNorm1d(d, track_running_stats=False), nn.Linear(d, 3)
        self.norm.eval()

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


@dataclass
class Architecture:
    """A model and what its inputs look like: ``kind`` is vector [B, d], sequence [B, T, d], image [B, C, H, W] or
    tokens [B, T] (int); ``shape`` the shape of one example; ``vocab`` for tokens."""

    model: nn.Module
    kind: str
    shape: tuple[int, ...]
    vocab: int = 0
    lipschitz: bool = False
    loss: str | None = None  # clipless / weightclip: the Lipschitz loss (fastdp.nn.lipdp.LOSSES); None: tau-ce
    classes: int = CLASSES  # the labels drawn: 0 .. classes - 1


def _lipschitz(draw: Callable) -> Architecture:
    d = 5
    torch.manual_seed(draw(st.integers(0, 2**16)))
    hidden = draw(st.sampled_from([4, 8]))
    model = nn.Sequential(BoundedInput(4.0), LipschitzLinear(d, hidden), GroupSort2(), LipschitzLinear(hidden, CLASSES))
    return Architecture(model, "vector", (d,), lipschitz=True)


def _weightclip_layers(draw: Callable) -> Architecture:
    """The layers of fastdp.nn.weightclip (Lip-DP-SGD) in one image model, their options drawn: C, conv biases, the
    group norm's alpha, the head's activation (sigmoid: an output bound that is not Lipschitz times input bound)."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    c, bias = draw(st.sampled_from([0.5, 1.0, 2.0])), draw(st.booleans())
    alpha = draw(st.sampled_from([0.25, 1.0, 4.0]))
    head = LipschitzSigmoid(12) if draw(st.booleans()) else LipschitzTanh(12)
    model = nn.Sequential(
        BoundedInput(4.0),
        WeightClipConv2d(2, 4, 3, (6, 6), padding=1, bias=bias, max_norm=c),
        LipschitzGroupNorm(2, 4, alpha=alpha, spatial_shape=(6, 6)),
        nn.ReLU(),
        ResidualSum(WeightClipConv2d(4, 4, 3, (6, 6), padding=1, max_norm=c), LipschitzTanh()),
        L2NormPool2d(2),
        WeightClipConv2d(4, 3, 3, (3, 3), stride=2, padding=1, bias=bias, max_norm=c),  # [3, 2, 2]
        nn.Flatten(),
        head,
        LipschitzLinear(12, CLASSES, bias=True, projection="clip", max_norm=c),
    )
    # on its constraint set, as after any training step: the front door's pair of releases is taken before and after
    # a step's projection, which would otherwise rescale the classifier (initial norm 1) where C < 1
    project_(model)
    return Architecture(model, "image", (2, 6, 6), lipschitz=True)


# the losses the lipdp architectures below draw (tau-bce takes one logit or two, not the fuzzer's 3 classes)
FUZZ_LOSSES = ("tau-ce", "kr", "hinge", "hkr", "cosine")


def _lipschitz_cnn(draw: Callable) -> Architecture:
    """fastdp.nn.lipdp's layers on 6x6 images: an RKO conv, channel GroupSort2 or GroupSort(2) over the channels,
    max or L2-norm pooling (stride = kernel), then global L2-norm pooling or a flatten, a LipschitzLinear head, and
    a drawn loss. The checkerboard and all-zero attacks meet the pooling's ties and its zero-norm gradient."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    channels = draw(st.sampled_from([2, 4]))
    sort = ChannelGroupSort2() if draw(st.booleans()) else GroupSort(2, dim=1)
    pool = MaxPool2d(2) if draw(st.booleans()) else L2NormPool2d(2)
    layers = [BoundedInput(4.0), LipschitzConv2d(1, channels, 3, (6, 6), padding=1), sort, pool]  # -> 3x3
    if draw(st.booleans()):
        layers += [GlobalL2NormPool2d(), LipschitzLinear(channels, CLASSES)]
    else:
        layers += [nn.Flatten(), LipschitzLinear(channels * 9, CLASSES)]
    return Architecture(nn.Sequential(*layers), "image", (1, 6, 6), lipschitz=True,
                        loss=draw(st.sampled_from(FUZZ_LOSSES)))  # fmt: skip


def _lipschitz_mixer(draw: Callable) -> Architecture:
    """The zoo's ``lipschitz_mixer`` on 4x4 images (4 tokens of 2x2 patches, width 4) with a drawn loss."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = build_model("lipschitz_mixer", (1, 4, 4), CLASSES, hidden=4, depth=1, input_bound=4.0)
    return Architecture(model, "image", (1, 4, 4), lipschitz=True, loss=draw(st.sampled_from(FUZZ_LOSSES)))


def _lipschitz_binary(draw: Callable) -> Architecture:
    """A two-logit Lipschitz MLP with the tau-BCE loss (which reads z = (z_1 - z_0) / sqrt(2)) on labels 0 and 1; the
    other variants train it with cross-entropy on its two classes."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = nn.Sequential(BoundedInput(4.0), LipschitzLinear(5, 8), GroupSort2(), LipschitzLinear(8, 2))
    return Architecture(model, "vector", (5,), lipschitz=True, loss="tau-bce", classes=2)


def architectures() -> dict[str, Callable]:
    """name -> draw-function building an :class:`Architecture` (the model seeded by the draw)."""

    def seeded(build):
        def make(draw):
            torch.manual_seed(draw(st.integers(0, 2**16)))
            return build(draw)

        return make

    def conv(draw):
        groups = draw(st.sampled_from([1, 2]))
        # 32 output channels: sizes where the norm takes the Gram path (fastdp.nn.layers._use_ghost), 4: the direct
        channels, out = 2 * groups, draw(st.sampled_from([4, 32])) * groups
        kernel, stride, dilation = (
            draw(st.sampled_from([1, 2, 3])),
            draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([1, 2])),
        )
        padding = draw(st.integers(0, 1))
        size = max(6, dilation * (kernel - 1) + 2)
        pool = draw(st.booleans())
        model = ConvNet(
            channels,
            size,
            out,
            kernel,
            stride,
            dilation,
            groups,
            padding,
            pool,
            norm=draw(st.booleans()),
            relu=draw(st.booleans()),
        )
        return Architecture(model, "image", (channels, size, size))

    def tokenwise(draw):
        # d 32 with 64 hidden units: the Gram (ghost) norm path; the small sizes: the per-example gradient path
        d, seq = draw(st.sampled_from([4, 8, 32])), draw(st.sampled_from([2, 3, 4]))
        hidden = draw(st.sampled_from([8, 16, 64]))
        return Architecture(Tokenwise(d, hidden, draw(st.booleans())), "sequence", (seq, d))

    def tokens(draw):
        # vocabulary 3 over 32 positions: the scatter path (64 V < T^2); the others: token matches
        vocab, seq = draw(st.sampled_from([3, 5, 50])), draw(st.sampled_from([3, 4, 6, 32]))
        return Architecture(TokenModel(vocab, 4, seq, draw(st.booleans())), "tokens", (seq,), vocab=vocab)

    def tied_tokens(draw):
        # vocabulary 3 over 32 positions: the direct path of the tied weight; the others: the Gram path
        vocab, seq = draw(st.sampled_from([3, 5, 50])), draw(st.sampled_from([3, 4, 6, 32]))
        return Architecture(TiedTokens(vocab, 4, seq), "tokens", (seq,), vocab=vocab)

    return {
        "mlp": seeded(
            lambda draw: Architecture(
                nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, CLASSES)),
                "vector",
                (5,),
            )
        ),  # fmt: skip
        "residual": seeded(lambda draw: Architecture(Residual(6), "vector", (6,))),
        "tokenwise": seeded(tokenwise),
        "conv": seeded(conv),
        "tokens": seeded(tokens),
        "sequence-first": seeded(lambda draw: Architecture(SequenceFirst(4, 8), "sequence", (0, 4))),  # T := B
        "reused": seeded(lambda draw: Architecture(Reused(5), "vector", (5,))),
        "tied": seeded(lambda draw: Architecture(Tied(5), "vector", (5,))),
        "shared-index": seeded(lambda draw: Architecture(SharedIndex(5), "vector", (5,))),
        "tied-tokens": seeded(tied_tokens),
        "shared-lookup-row0": seeded(lambda draw: Architecture(TiedTokens(5, 4, 4, first=True), "tokens", (4,), 5)),
        "batchnorm-eval": seeded(lambda draw: Architecture(EvalBatchNorm(5), "vector", (5,))),
        "lipschitz": _lipschitz,
        "weightclip-layers": _weightclip_layers,
        "lipschitz-cnn": _lipschitz_cnn,
        "lipschitz-mixer": _lipschitz_mixer,
        "lipschitz-binary": _lipschitz_binary,
    }


ARCHITECTURES = tuple(architectures())
# the clipless and weightclip variants' usual draws
LIPSCHITZ_ARCHITECTURES = ("lipschitz", "weightclip-layers", "lipschitz-cnn", "lipschitz-mixer", "lipschitz-binary")
# architecture -> the variants that must refuse it (no outcome but "refused" is correct): a layer on a [T, B, d] view
# with T == B, for the variants that norm, project or clip a layer's rows per example (the reference mode takes each
# example's loss, which the view does not mix: measured instead); batch statistics in eval mode, for every one.
# Low-precision parameters (precision "param-bf16") too, for every private variant.
MUST_REFUSE = {
    "sequence-first": ("dpsgd", "dpsgd-per-layer", "jl", "backprop", *FRONT_DOOR),
    # ghost clipping's rows of the shared-index Embedding are not examples (the other variants refuse the Embedding
    # or, the reference, take each example's own gradient)
    "shared-index": ("dpsgd", "dpsgd-per-layer", "jl", "front-door", "front-door-jl"),
    "shared-lookup-row0": ("dpsgd", "dpsgd-per-layer", "jl", "front-door", "front-door-jl"),
    "batchnorm-eval": VARIANTS,
}


# ----------------------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class FuzzCase:
    """One drawn case (see the module docstring); ``spec`` is the architecture's draw, for the report."""

    architecture: str
    variant: str
    precision: str
    attack: str
    rows: int
    scale: float
    seed: int


@dataclass
class Outcome:
    case: FuzzCase
    status: str  # ok | refused | stopped | violation | crash | must-refuse
    ratio: float = math.nan  # worst change / allowed bound over the groups (ok, violation)
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("violation", "crash", "must-refuse")


def _quantile_clipless(q: float, n: int, loss) -> Clipless:
    """Clipless with the logit-clip quantile, its clip value already at a quarter of the loss's constant (so the
    clip, not the constant, bounds each example)."""
    variant = Clipless(1.0, q, n, loss=loss, reproducible_seed=KEY, logit_clip_quantile=0.5)
    variant.logit_clip = torch.tensor(0.25 * float(variant.loss_fn.lipschitz), dtype=torch.float64)
    return variant


def _variant(name: str, expected_batch: float, num_examples: int, model: nn.Module, loss: str | None = None) -> Variant:
    q, n = expected_batch / num_examples, num_examples
    lipschitz = None if loss is None else lipschitz_loss(loss)  # clipless, weightclip: the architecture's loss
    layers = sum(1 for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False)))
    per_layer = [(0.5, 0.8, 0.6, 0.9, 0.7)[i % 5] for i in range(layers)]
    return {
        "dpsgd": lambda: DPSGD(1.0, 1.0, q, n, reproducible_seed=KEY),
        "dpsgd-reference": lambda: DPSGD(1.0, 1.0, q, n, reproducible_seed=KEY, mode="reference"),
        "dpsgd-per-layer": lambda: DPSGD(per_layer, 1.0, q, n, reproducible_seed=KEY),
        "jl": lambda: JL(1.0, 1.0, q, n, projections=4, reproducible_seed=KEY),
        "backprop": lambda: BackpropClip(1.0, 1.0, 1.0, q, n, reproducible_seed=KEY),
        "clipless": lambda: Clipless(1.0, q, n, loss=lipschitz, reproducible_seed=KEY),
        "clipless-quantile": lambda: _quantile_clipless(q, n, lipschitz),
        "weightclip": lambda: WeightClip(1.0, q, n, loss=lipschitz, reproducible_seed=KEY),
    }[name]()


def _inputs(arch: Architecture, rows: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if arch.kind == "tokens":
        return torch.randint(0, arch.vocab, (rows, *arch.shape), generator=gen)
    shape = (rows, *[rows if s == 0 else s for s in arch.shape])  # 0: a size equal to the batch (T == B)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _attack(arch: Architecture, x: torch.Tensor, attack: str, scale: float, gen: torch.Generator) -> torch.Tensor:
    """The target example's input (one row of ``x``'s shape, no batch dim)."""
    row = x[0].clone()
    if arch.kind == "tokens":
        if attack in ("huge", "cancel"):  # one token repeated at every position: its Gram terms all add up
            return torch.full_like(row, int(torch.randint(1, arch.vocab, (1,), generator=gen)))
        if attack == "zero":
            return torch.zeros_like(row)  # every position is padding
        return row
    if attack == "huge":
        return row * scale
    if attack == "zero":
        return torch.zeros_like(row)
    if attack == "nonfinite":
        row.view(-1)[0] = math.nan
        return row
    if attack == "cancel":
        if arch.kind == "sequence":  # positions s u + e and -s u, alternately
            u = torch.randn(row.shape[-1], generator=gen, dtype=torch.float64).to(row.dtype)
            signs = torch.tensor([(-1.0) ** t for t in range(row.shape[0])], dtype=row.dtype)
            return scale * signs[:, None] * u + (signs[:, None] > 0) * row
        if arch.kind == "image":  # a +-scale checkerboard over small noise
            h, w = row.shape[-2:]
            board = ((torch.arange(h)[:, None] + torch.arange(w)[None, :]) % 2 * 2 - 1).to(row.dtype)
            return scale * board + 1e-2 * row
        return row * scale
    return row  # ordinary, copies


def _batch(x: torch.Tensor, y: torch.Tensor) -> Batch:
    return Batch(x, y, torch.ones(x.shape[0], dtype=torch.bool))


class _Examples(torch.utils.data.Dataset):
    """N examples the front door's loader is built from (its size and batch size only: the fuzzer feeds batches)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        raise IndexError("the fuzzer feeds its own batches")


def _front_door_release(
    kind: str, model: nn.Module, batch: Batch, expected_batch: int, n: int, sigma: float, autocast: bool
) -> tuple[list[torch.Tensor], Variant, nn.Module]:
    """One step of ``kind`` (:data:`FRONT_DOOR`) as a user runs it: ``PrivacyEngine.make_private`` on a copy of
    ``model`` (reproducible key, SGD with lr 0 so ``p.grad`` is the release) with the criterion it returns
    (``grad_sample_mode="ghost"``: ``fastdp.engine.DPLoss``, the batch's mean cross-entropy, ``loss_reduction="mean"``,
    the default; under bf16 autocast too), forward, ``loss.backward()``, ``optimizer.step()``. Returns the released
    mean gradients, the engine's variant (the claim is read from it) and the converted copy."""
    from fastdp.engine import PrivacyEngine

    copied = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(_Examples(n), batch_size=expected_batch)
    variant = FRONT_DOOR[kind]
    engine = PrivacyEngine(accountant="pld" if variant == "jl" else "rdp")
    bounds = {"dpsgd": {"max_grad_norm": 1.0}, "jl": {"max_grad_norm": 1.0, "projections": 4},
              "backprop": {"input_clip": 1.0, "grad_clip": 1.0}}.get(variant, {})  # fmt: skip
    private, optimizer, criterion, _ = engine.make_private(
        module=copied, optimizer=torch.optim.SGD(copied.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=sigma, variant=variant, reproducible_seed=KEY, criterion=torch.nn.functional.cross_entropy,
        grad_sample_mode="ghost", **bounds,
    )  # fmt: skip
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = private(batch.x)
    criterion(out.float(), batch.y).backward()
    optimizer.step()
    grads = [p.grad.detach().double() for p in trainable_parameters(copied)]
    return grads, optimizer.variant, copied


def _release(variant: Variant, model: nn.Module, batch: Batch, step: int) -> list[torch.Tensor]:
    """The noiseless release of a copy of ``variant`` at ``step`` (each pair releases one step twice, on D and on D
    without the target: copies, so the reproducible key's one-release-per-step rule is kept by each)."""
    copy.deepcopy(noiseless(variant)).gradient(model, batch, step)
    return [p.grad.detach().double().clone() for p in trainable_parameters(model)]


def fuzz_case(case: FuzzCase, draw_architecture: Callable) -> Outcome:
    """Run one case (see the module docstring). ``draw_architecture`` builds the architecture (a hypothesis draw)."""
    gen = torch.Generator().manual_seed(case.seed)
    arch: Architecture = draw_architecture()
    dtype = {"fp64": torch.float64, "param-bf16": torch.bfloat16}.get(case.precision, torch.float32)
    model = arch.model.to(dtype)
    if FRONT_DOOR.get(case.variant, case.variant) == "weightclip" and case.architecture == "lipschitz":
        torch.manual_seed(case.seed)
        model = build_model("weightclip_mlp", arch.shape, CLASSES, hidden=8, input_bound=4.0).to(dtype)
    x = _inputs(arch, case.rows, gen, dtype)  # a model cast to bf16 gets bf16 data, as its user would give it
    y = torch.randint(0, arch.classes, (case.rows,), generator=gen)
    target = _attack(arch, x, case.attack, case.scale, gen)
    copies = 3 if case.attack == "copies" else 0
    if case.attack == "copies" and arch.kind != "tokens":
        target = target * case.scale
    position = int(torch.randint(0, case.rows - copies, (1,), generator=gen)) if case.rows > copies else 0
    x[position] = target
    for k in range(1, copies + 1):
        x[position + k] = target
        y[position + k] = y[position]
    keep = torch.arange(case.rows) != position
    with_target, without = _batch(x, y), _batch(x[keep], y[keep])
    must_refuse = case.precision == "param-bf16" or case.variant in MUST_REFUSE.get(case.architecture, ())
    step = 1
    try:
        if case.variant in FRONT_DOOR:  # the same batches through PrivacyEngine and the user's loop
            args = (case.rows // 2, 4 * case.rows)
            _front_door_release(case.variant, model, with_target, *args, 1.0, case.precision == "bf16")
            full, variant, model = _front_door_release(case.variant, model, with_target, *args, 0.0,
                                                       case.precision == "bf16")  # fmt: skip
            less, _, _ = _front_door_release(case.variant, model, without, *args, 0.0, case.precision == "bf16")
            claim, step = claim_of(variant, model), 0
        else:
            variant = _variant(case.variant, case.rows / 2, 4 * case.rows, model, arch.loss)
            if case.precision == "bf16":
                variant.set_precision("bf16")
            variant.gradient(model, with_target, 0)  # converts layers, records what the claim is read from
            claim = claim_of(variant, model)
            full = _release(variant, model, with_target, 1)
            less = _release(variant, model, without, 1)
    except (ValueError, TypeError) as error:
        return Outcome(case, "refused", detail=f"{type(error).__name__}: {error}"[:300])
    except Exception as error:  # noqa: BLE001 - anything else is not a clear error: reported as a crash
        return Outcome(case, "crash", detail="".join(traceback.format_exception_only(error)).strip()[:300])
    if must_refuse:
        return Outcome(case, "must-refuse", detail="ran a case that breaks the bound without a refusal")
    finite = all(bool(torch.isfinite(t).all()) for t in full + less)
    if not finite:
        stopped = case.precision in ("fp32", "fp64") and case.attack == "nonfinite"
        return Outcome(case, "stopped" if stopped else "violation", detail="the release is not finite")
    b = variant.expected_batch_size
    diff = [(a - c) * b for a, c in zip(full, less, strict=True)]
    rounding = 0.0 if dtype == torch.float64 else CAST_UNITS * FP32_UNIT * case.rows
    if isinstance(variant, JL):
        case_ = AuditCase(case.variant, variant, model, "")
        example = Batch(x[position : position + 1], y[position : position + 1], torch.ones(1, dtype=torch.bool))
        ratio = _Auditor(case_, claim).jl_ratio(example, diff, step) / (1 + RELATIVE_SLACK + rounding)
    else:
        slack = 1 + RELATIVE_SLACK + rounding
        ratio = max(math.sqrt(sum(float(diff[i].pow(2).sum()) for i in group)) / (delta * slack)
                    for group, delta in zip(claim.groups, claim.sensitivities, strict=True))  # fmt: skip
    known = (case.variant, case.precision, case.attack) in KNOWN_OPEN
    status = "ok" if ratio <= 1 else "open" if known else "violation"
    return Outcome(case, status, ratio)


# --------------------------------------------------------------------------------------------------------- drawing


@dataclass
class FuzzReport:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed]

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and not self.failures

    def counts(self) -> dict[tuple[str, str], dict[str, int]]:
        """(variant, precision) -> status -> count."""
        table: dict[tuple[str, str], dict[str, int]] = {}
        for o in self.outcomes:
            row = table.setdefault((o.case.variant, o.case.precision), {})
            row[o.status] = row.get(o.status, 0) + 1
        return table

    def worst_ratio(self) -> float:
        return max((o.ratio for o in self.outcomes if o.status in ("ok", "violation", "open")), default=math.nan)


@st.composite
def cases(draw, variants=VARIANTS, precisions=PRECISIONS, architectures_=ARCHITECTURES):
    """(FuzzCase, architecture draw) pairs."""
    builders = architectures()
    variant = draw(st.sampled_from(variants))
    lipschitz = FRONT_DOOR.get(variant, variant) in ("clipless", "clipless-quantile", "weightclip")
    usual = [a for a in architectures_ if (a in LIPSCHITZ_ARCHITECTURES) == lipschitz] or list(architectures_)
    name = draw(st.sampled_from(usual)) if draw(st.integers(0, 9)) else draw(st.sampled_from(architectures_))
    case = FuzzCase(
        architecture=name,
        variant=variant,
        # bf16 autocast only where a variant accepts it (the others' refusal is tested elsewhere, once)
        precision=draw(st.sampled_from([p for p in precisions if p != "bf16" or variant in AUTOCAST] or precisions)),
        attack=draw(st.sampled_from(ATTACK_DRAWS)),
        rows=draw(st.integers(4, 8)),
        scale=draw(st.sampled_from([1e3, 3e5, 1e7])),
        seed=draw(st.integers(0, 2**16)),
    )
    arch = builders[name](draw)
    return case, arch


def run_fuzz(
    examples: int, fuzz_seed: int = 0, architectures_=ARCHITECTURES, variants=VARIANTS, **strategy
) -> FuzzReport:
    """Draw ``examples`` cases (hypothesis, seeded by ``fuzz_seed``), the same number for each architecture and
    variant, and run each; never stops at a failure."""
    report = FuzzReport()
    strata = [(a, v) for a in architectures_ for v in variants]
    per_stratum = max(1, examples // len(strata))
    for name, variant in strata:

        @seed(fuzz_seed)
        @settings(max_examples=per_stratum, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(cases(architectures_=(name,), variants=(variant,), **strategy))
        def one(drawn):
            case, arch = drawn
            report.outcomes.append(fuzz_case(case, lambda: arch))

        one()
    return report


def format_report(report: FuzzReport) -> str:
    """Markdown: counts per variant and precision, the worst ratio, and every failure with its case."""
    lines = [
        f"{len(report.outcomes)} cases; worst leave-one-out change / bound over the cases run: "
        f"{report.worst_ratio():.6f}; known open: {sum(o.status == 'open' for o in report.outcomes)}; "
        f"failures: {len(report.failures)}",
        "",
        "| variant | precision | " + " | ".join(STATUSES) + " |",
        "|---|---|" + "---|" * len(STATUSES),
    ]
    for (variant, precision), row in sorted(report.counts().items()):
        cells = " | ".join(str(row.get(s, 0)) for s in STATUSES)
        lines.append(f"| {variant} | {precision} | {cells} |")
    opened = [o for o in report.outcomes if o.status == "open"]
    for key, what in KNOWN_OPEN.items():
        found = [o.ratio for o in opened if (o.case.variant, o.case.precision, o.case.attack) == key]
        if found:
            lines += ["", f"Known open ({', '.join(key)}): {len(found)} cases over the bound, worst {max(found):.6f}: "
                      f"{what}"]  # fmt: skip
    by_architecture: dict[tuple[str, str], int] = {}
    for o in report.failures:
        by_architecture[(o.case.architecture, o.status)] = by_architecture.get((o.case.architecture, o.status), 0) + 1
    if by_architecture:
        lines += ["", "Failures by architecture: " + ", ".join(f"{a} {s} x{n}" for (a, s), n in
                                                              sorted(by_architecture.items()))]  # fmt: skip
    worst = sorted((o for o in report.outcomes if o.status == "violation"), key=lambda o: -o.ratio)[:3]
    for o in worst + [o for o in report.failures if o.status != "violation"][:10]:
        lines.append(f"- **{o.status}** ratio {o.ratio:.4g}: {o.case} {o.detail}")
    return "\n".join(lines)


__all__ = ["ARCHITECTURES", "FuzzCase", "FuzzReport", "Outcome", "cases", "format_report", "fuzz_case", "run_fuzz"]
