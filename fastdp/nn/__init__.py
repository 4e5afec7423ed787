"""Drop-in DP layers and :func:`convert`, which makes an existing model use them."""

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
    own_trainable,
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
    "UnsupportedLayerError",
    "active_context",
    "batch_statistics_layers",
    "check_supported",
    "convert",
    "mixes_examples",
    "refuse_batch_statistics",
]

_ALTERNATIVES = {
    "BatchNorm": "GroupNorm (or LayerNorm): batch statistics mix examples, so per-example gradients do not exist",
    "InstanceNorm": "GroupNorm with num_groups = channels and affine=True",
    "RNN": "a Transformer-style block of Linear/LayerNorm/Embedding layers",
    "LSTM": "a Transformer-style block of Linear/LayerNorm/Embedding layers",
    "GRU": "a Transformer-style block of Linear/LayerNorm/Embedding layers",
    "MultiheadAttention": "attention written with fastdp.nn.Linear projections",
}


class UnsupportedLayerError(ValueError):
    """A model has trainable parameters in modules fastdp cannot clip per example."""


def mixes_examples(module: nn.Module) -> bool:
    """Whether ``module`` makes one example's output, or the model it leaves, depend on the other examples of the
    batch (every variant refuses such a module, trainable or not, in either mode):

    * a BatchNorm (any ``_BatchNorm``, SyncBatchNorm included) in training mode, or in eval mode without running
      statistics (``track_running_stats=False`` or a running_mean/running_var of None): torch then normalises with
      the batch's statistics in eval mode too;
    * an InstanceNorm in training mode with ``track_running_stats=True``: each example is normalised alone, but the
      batch's statistics are averaged into the running statistics (unnoised, released with the model, used in eval
      mode).

    InstanceNorm otherwise normalises each example with its own statistics (or public running ones), in both modes:
    it mixes nothing and is not refused here (a trainable one still needs a DP layer or a rule, per variant)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        running = module.track_running_stats and module.running_mean is not None and module.running_var is not None
        return module.training or not running
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.training and module.track_running_stats
    return False


def check_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` for modules one-backward clipping cannot handle: trainable modules that
    are not DP layers, layers that mix examples (:func:`mixes_examples`, trainable or not), and a
    parameter shared by two DP layers (tied weights: its per-example gradient sums both uses).

    One walk over the modules (DP-SGD calls it every step: train/eval mode and ``requires_grad`` can change)."""
    bad, mixing = [], []
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        trainable = own_trainable(module)
        if not isinstance(module, DPLayer):
            if trainable:
                bad.append((name, module))
            if mixes_examples(module):
                mixing.append(f"{name or '<model>'} ({type(module).__name__})")
            continue
        for p in trainable:
            if id(p) in owners:
                raise UnsupportedLayerError(
                    f"a parameter is shared by {owners[id(p)]} and {name} (tied weights); one-backward clipping "
                    "needs each parameter in one layer: use DPSGD(mode='reference')"
                )
            owners[id(p)] = name or "<model>"
    if bad:
        lines = []
        for name, module in bad:
            kind = type(module).__name__
            hint = next((text for key, text in _ALTERNATIVES.items() if key in kind), None)
            lines.append(f"  {name or '<model>'} ({kind})" + (f": use {hint}" if hint else ""))
        supported = ", ".join(sorted(t.__name__ for t in DP_LAYERS))
        raise UnsupportedLayerError(
            "these modules have trainable parameters that DP-SGD's one-backward clipping cannot handle:\n"
            + "\n".join(lines)
            + f"\nSupported layers: {supported} (torch modules are converted by fastdp.nn.convert). Freeze the "
            "others (requires_grad=False), replace them, or use DPSGD(mode='reference') for arbitrary modules."
        )
    refuse_batch_statistics(mixing)


def refuse_batch_statistics(layers: list[str], why: str = "") -> None:
    """Raise :class:`UnsupportedLayerError` naming ``layers`` (from :func:`batch_statistics_layers`) if any;
    ``why`` opens the message with what the caller needs that they break."""
    if layers:
        raise UnsupportedLayerError(
            why + "these layers use batch statistics in training mode, or in eval mode without running statistics "
            "(BatchNorm with track_running_stats=False), so one example changes the other examples' outputs and "
            "gradients (InstanceNorm with track_running_stats=True in training mode: the running statistics it "
            "writes into the model): " + ", ".join(layers) + ". Use GroupNorm or LayerNorm, or put them in eval mode "
            "with running statistics (track_running_stats=True) estimated from public data."
        )


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """'name (Type)' of every layer of ``model`` that mixes examples (:func:`mixes_examples`: BatchNorm in training
    mode or without running statistics, InstanceNorm updating running statistics): one example then changes the
    others' outputs (or the model), so no per-example bound holds, whether the layer trains or not. The one list
    every variant refuses (DP-SGD ghost and reference, backprop clipping, JL; clipless/weightclip have no Lipschitz
    rule for these layers)."""
    return [f"{name or '<model>'} ({type(m).__name__})" for name, m in model.named_modules() if mixes_examples(m)]


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
