"""Drop-in DP layers and :func:`convert`, which makes an existing model use them; :func:`validate` and :func:`fix`
(and the refusals every variant shares) live in :mod:`fastdp.nn.validate`."""

from __future__ import annotations

from torch import nn

from fastdp.nn.attention import MultiheadAttention  # registers it in DP_LAYERS
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
    TransposedLinear,
    attention_projections,
    conversion,
)
from fastdp.nn.lipdp import (  # lip-dp's layers and losses (the max pooling: fastdp.nn.lipdp.MaxPool2d, not torch's)
    ChannelGroupSort2,
    GlobalL2NormPool2d,
    GroupSort,
    KCosineSimilarity,
    TauBinaryCrossEntropy,
    ToPatches,
)
from fastdp.nn.recurrent import GRU, LSTM, RNN  # registers them in DP_LAYERS
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
from fastdp.nn.weightclip import LipschitzGroupNorm, LipschitzSigmoid, LipschitzTanh, ResidualSum, WeightClipConv2d

__all__ = [
    "DP_LAYERS",
    "ChannelGroupSort2",
    "Conv1d",
    "Conv2d",
    "DPLayer",
    "Embedding",
    "GRU",
    "GhostClipping",
    "GlobalL2NormPool2d",
    "GroupSort",
    "GroupNorm",
    "KCosineSimilarity",
    "LSTM",
    "LayerNorm",
    "Linear",
    "LipschitzGroupNorm",
    "LipschitzSigmoid",
    "LipschitzTanh",
    "MultiheadAttention",
    "Problem",
    "RNN",
    "ResidualSum",
    "TauBinaryCrossEntropy",
    "ToPatches",
    "TransposedLinear",
    "UnsupportedLayerError",
    "WeightClipConv2d",
    "active_context",
    "batch_statistics_layers",
    "check_parameter_dtypes",
    "check_supported",
    "conversion",
    "convert",
    "fix",
    "is_valid",
    "mixes_examples",
    "refuse_batch_statistics",
    "validate",
]


def convert(model: nn.Module) -> nn.Module:
    """Turn every supported layer of ``model`` into its fastdp DP layer, in place, and check the rest.

    Supported: the torch layers of :data:`~fastdp.nn.layers.DP_LAYERS` (``nn.MultiheadAttention`` included:
    :class:`~fastdp.nn.attention.MultiheadAttention`, whose ``out_proj`` becomes a DP Linear it calls), their
    subclasses that do not override ``forward`` (e.g. ``NonDynamicallyQuantizableLinear``, a user's ``nn.Linear``
    subclass with methods of its own: they keep their class, ``isinstance`` included; not the ``out_proj`` of an
    attention left unconverted, which torch's attention never calls) and HuggingFace's
    ``transformers.pytorch_utils.Conv1D``
    (:class:`~fastdp.nn.layers.TransposedLinear`); see :func:`~fastdp.nn.layers.conversion` and ``docs/convert.md``.
    Parameters, buffers and hooks stay as they are (the class is swapped, nothing is copied), so an optimizer
    built before the call and the ``state_dict`` are unchanged. Raises one :class:`UnsupportedLayerError` naming
    every module one-backward clipping cannot handle (:func:`check_supported`: trainable modules that are not DP
    layers, with the reason where a subclass is refused; layers that mix examples; Embeddings with
    ``max_norm``). Returns ``model``.
    """
    unconverted = attention_projections(model)  # never called by torch's attention: its weights are read directly
    for module in model.modules():
        dp_class, _ = conversion(module) if id(module) not in unconverted else (None, None)
        if dp_class is not None:
            module.__class__ = dp_class
    check_supported(model)
    return model
