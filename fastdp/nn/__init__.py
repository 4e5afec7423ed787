"""Drop-in DP layers and :func:`convert`, which makes an existing model use them; :func:`validate` and :func:`fix`
(and the refusals every variant shares) live in :mod:`fastdp.nn.validate`."""

from __future__ import annotations

from torch import nn

from fastdp.nn.ghost import GhostClipping, active_context
from fastdp.nn.layers import (
    DP_LAYERS,
    Conv1d,
    Conv2d,
    DPLayer,
    Embedding,
    GroupNorm,
    LayerNorm,
    Linear,
)
from fastdp.nn.validate import (
    Problem,
    UnsupportedLayerError,
    batch_statistics_layers,
    check_parameter_dtypes,
    check_supported,
    fix,
    is_valid,
    mixes_examples,
    refuse_batch_statistics,
    validate,
)

__all__ = [
    "Conv1d",
    "Conv2d",
    "DPLayer",
    "Embedding",
    "GhostClipping",
    "GroupNorm",
    "LayerNorm",
    "Linear",
    "Problem",
    "UnsupportedLayerError",
    "active_context",
    "batch_statistics_layers",
    "check_parameter_dtypes",
    "check_supported",
    "convert",
    "fix",
    "is_valid",
    "mixes_examples",
    "refuse_batch_statistics",
    "validate",
]


def convert(model: nn.Module) -> nn.Module:
    """Turn every supported torch layer of ``model`` into its fastdp DP layer, in place, and check the rest.

    Parameters, buffers and hooks stay as they are (the class is swapped, nothing is copied), so an optimizer
    built before the call keeps working. Raises :class:`UnsupportedLayerError` for trainable modules that have
    no DP layer. Returns ``model``.
    """
    for module in model.modules():
        dp_class = DP_LAYERS.get(type(module))
        if dp_class is not None:
            module.__class__ = dp_class
    check_supported(model)
    return model
