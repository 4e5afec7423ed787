"""Small variants and models shared by the step-level tests (virtual batches, torch.compile, data-parallel)."""

from __future__ import annotations

from torch import nn

from fastdp.algorithms import DPSGD, JL, BackpropClip, Clipless, NonPrivate, WeightClip
from fastdp.train.models import build_model

VARIANT_NAMES = ("dpsgd", "dpsgd-reference", "dpsgd-per-layer", "jl", "clipless", "weightclip", "backprop",
                 "nonprivate")  # fmt: skip


def make_variant(name: str, expected_batch: float, num_examples: int, reproducible_seed: int | None = 7):
    """Variant ``name`` (C = 1, sigma = 1) at sample rate expected_batch / num_examples, its privacy draws keyed by
    the reproducible seed 7 (NOT FOR RELEASE; the tests compare runs bitwise), or from OS entropy with
    ``reproducible_seed=None`` (the default of the library)."""
    q, n, key = expected_batch / num_examples, num_examples, reproducible_seed
    return {
        "dpsgd": lambda: DPSGD(1.0, 1.0, q, n, reproducible_seed=key),
        "dpsgd-reference": lambda: DPSGD(1.0, 1.0, q, n, reproducible_seed=key, mode="reference"),
        "dpsgd-per-layer": lambda: DPSGD([0.5, 0.7, 0.9], 1.0, q, n, reproducible_seed=key),
        "jl": lambda: JL(1.0, 1.0, q, n, projections=3, reproducible_seed=key),
        "clipless": lambda: Clipless(1.0, q, n, reproducible_seed=key),
        "weightclip": lambda: WeightClip(1.0, q, n, reproducible_seed=key),
        "backprop": lambda: BackpropClip(1.0, 1.0, 1.0, q, n, reproducible_seed=key),
        "nonprivate": NonPrivate,
    }[name]()


def small_model(name: str, features: int, classes: int, hidden: int = 16) -> nn.Module:
    """The model variant ``name`` trains (seeded): a Lipschitz MLP for clipless/weightclip, else three Linear layers
    (the per-layer DP-SGD variant has one clip norm for each)."""
    import torch

    torch.manual_seed(0)
    if name in ("clipless", "weightclip"):
        kind = "lipschitz_mlp" if name == "clipless" else "weightclip_mlp"
        return build_model(kind, (features,), classes, hidden=hidden, input_bound=4.0)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, classes))  # fmt: skip
