"""The variants the audit runs, on small seeded models and synthetic data, and the deliberately broken variant.

Every case is a (variant, model) pair built from the same knobs: noise multiplier sigma (the accountant's),
data-set size N and sample rate q (expected batch b = qN), noise seed, dtype. Clip bounds are fixed per case.
Models are MLPs on FEATURES inputs and CLASSES classes: three Linear layers (ReLU, Tanh) for the clipping
variants, the zoo's ``lipschitz_mlp`` / ``weightclip_mlp`` (input bound X_0 = 4) for the Lipschitz ones.

:class:`DoubleDividedBackpropClip` reproduces the backprop-clipping paper's published bug (Stevens et al. 2022: the
sensitivity divided by the batch size b, and the sum divided by b again, so the noise is b times too small while
the accountant is told the full sigma). It exists to show that the audits catch it; never train with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fastdp.algorithms import DPSGD, JL, BackpropClip, Batch, Clipless, NonPrivate, Variant, WeightClip
from fastdp.algorithms.base import release_noisy_mean, trainable_parameters
from fastdp.nn.backprop import parameter_sensitivities
from fastdp.train.models import build_model

FEATURES, CLASSES, HIDDEN = 10, 4, 16
INPUT_BOUND = 4.0  # X_0 of the Lipschitz models
PER_LAYER_CLIPS = (0.5, 0.7, 0.9)
JL_PROJECTIONS = 10

# name -> what the case is (one line, for reports)
CASES: dict[str, str] = {
    "dpsgd": "DP-SGD, ghost clipping, C = 1",
    "dpsgd-reference": "DP-SGD, torch.func per-example gradients, C = 1",
    "dpsgd-per-layer": f"DP-SGD, per-layer clipping C_l = {', '.join(f'{c:g}' for c in PER_LAYER_CLIPS)}",
    "jl": f"DP-SGD-JL, C = 1, r = {JL_PROJECTIONS} projections",
    "clipless": f"clipless (lipschitz_mlp, X_0 = {INPUT_BOUND:g}), per-layer noise",
    "clipless-global": f"clipless (lipschitz_mlp, X_0 = {INPUT_BOUND:g}), global noise",
    "weightclip": f"weight clipping (weightclip_mlp, X_0 = {INPUT_BOUND:g}, ||W|| <= 1)",
    "backprop": "backprop clipping, C1 = C2 = 1",
    "nonprivate": "non-private (no claim: shows what the attacks find without noise)",
}
BROKEN = "backprop-double-divided"
BROKEN_DESCRIPTION = "backprop clipping with the paper's bug (noise divided by b twice) - deliberately broken"


class DoubleDividedBackpropClip(BackpropClip):
    """Backprop clipping with the published noise-scale bug (Stevens et al. 2022): the noise std on the sum is
    sigma sqrt(N) Delta_l / b instead of sigma sqrt(N) Delta_l, and the noisy sum is then divided by b = qN as
    usual, so the noise on the mean is b times smaller than the (unchanged) accounting event claims.
    Deliberately broken, for the audit's self-test only."""

    name = "backprop-double-divided"

    def release(self, model: nn.Module, sums: list[torch.Tensor], step: int) -> None:
        params = trainable_parameters(model)
        sensitivities = parameter_sensitivities(model)
        self.tensors = len(params)
        scale = self.noise_multiplier * math.sqrt(len(params))
        b = self.expected_batch_size
        stds = [scale * sensitivities[p] / b for p in params]  # the bug: sensitivity divided by b
        release_noisy_mean(params, sums, stds, b, self.keys, step)


@dataclass
class AuditCase:
    """A variant and the model it is audited on; ``broken`` marks the deliberately broken variant."""

    name: str
    variant: Variant
    model: nn.Module
    description: str
    broken: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def build_case(
    name: str,
    noise_multiplier: float = 1.0,
    num_examples: int = 64,
    sample_rate: float = 0.25,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> AuditCase:
    """The audit case ``name`` (a key of :data:`CASES`, or :data:`BROKEN`); the model and the variant's privacy draws
    are seeded by ``seed`` (a reproducible key, NOT FOR RELEASE: the audit recomputes JL's tangents and repeats runs
    with fresh step indices)."""
    if name not in CASES and name != BROKEN:
        raise ValueError(f"unknown audit case {name!r}; choose one of {', '.join([*CASES, BROKEN])}")
    sigma, q, n = noise_multiplier, sample_rate, num_examples
    torch.manual_seed(seed)
    if name in ("clipless", "clipless-global"):
        model = build_model("lipschitz_mlp", (FEATURES,), CLASSES, hidden=HIDDEN, input_bound=INPUT_BOUND)
        strategy = "global" if name == "clipless-global" else "per-layer"
        variant: Variant = Clipless(sigma, q, n, strategy=strategy, reproducible_seed=seed)
    elif name == "weightclip":
        model = build_model("weightclip_mlp", (FEATURES,), CLASSES, hidden=HIDDEN, input_bound=INPUT_BOUND)
        variant = WeightClip(sigma, q, n, reproducible_seed=seed)
    else:
        model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                              nn.Linear(HIDDEN, CLASSES))  # fmt: skip
        variant = {
            "dpsgd": lambda: DPSGD(1.0, sigma, q, n, reproducible_seed=seed),
            "dpsgd-reference": lambda: DPSGD(1.0, sigma, q, n, reproducible_seed=seed, mode="reference"),
            "dpsgd-per-layer": lambda: DPSGD(list(PER_LAYER_CLIPS), sigma, q, n, reproducible_seed=seed),
            "jl": lambda: JL(1.0, sigma, q, n, projections=JL_PROJECTIONS, reproducible_seed=seed),
            "backprop": lambda: BackpropClip(1.0, 1.0, sigma, q, n, reproducible_seed=seed),
            BROKEN: lambda: DoubleDividedBackpropClip(1.0, 1.0, sigma, q, n, reproducible_seed=seed),
            "nonprivate": NonPrivate,
        }[name]()
    model = model.to(dtype)
    return AuditCase(name, variant, model, CASES.get(name, BROKEN_DESCRIPTION), broken=name == BROKEN)


def synthetic_batch(rows: int, dtype: torch.dtype, seed: int, features: int = FEATURES, classes: int = CLASSES):
    """``rows`` real examples: x ~ N(0, I) in ``features`` dimensions, labels uniform over ``classes``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, classes, (rows,), generator=gen)
    return Batch(x, y, torch.ones(rows, dtype=torch.bool))


def padding_batch(rows: int, dtype: torch.dtype, seed: int, features: int = FEATURES) -> Batch:
    """``rows`` padding rows (mask False, random contents): every variant must give them a zero contribution, so
    a step on this batch releases noise only."""
    real = synthetic_batch(rows, dtype, seed, features)
    return Batch(real.x, real.y, torch.zeros(rows, dtype=torch.bool))


def concat(*batches: Batch) -> Batch:
    """The rows of ``batches``, in order."""
    return Batch(torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches]),
                 torch.cat([b.mask for b in batches]))  # fmt: skip
