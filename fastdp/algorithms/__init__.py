"""Training variants, one file each: how each bounds the sensitivity of its gradient."""

from fastdp.algorithms.backprop import BackpropClip
from fastdp.algorithms.base import Batch, Variant, per_example_cross_entropy
from fastdp.algorithms.clipless import Clipless, WeightClip
from fastdp.algorithms.dpsgd import DPSGD
from fastdp.algorithms.jl import JL
from fastdp.algorithms.nonprivate import NonPrivate

VARIANTS: dict[str, type[Variant]] = {
    cls.name: cls for cls in (DPSGD, JL, Clipless, WeightClip, BackpropClip, NonPrivate)
}

__all__ = [
    "BackpropClip",
    "DPSGD",
    "JL",
    "VARIANTS",
    "Batch",
    "Clipless",
    "NonPrivate",
    "Variant",
    "WeightClip",
    "per_example_cross_entropy",
]
