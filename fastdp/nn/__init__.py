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
    "refuse_batch_statistics",
    "check_supported",
    "convert",
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


_MIXING = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.SyncBatchNorm)


def check_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` for modules one-backward clipping cannot handle: trainable modules that
    are not DP layers, batch-statistics layers in training mode (they mix examples, trainable or not), and a
    parameter shared by two DP layers (tied weights: its per-example gradient sums both uses).

    One walk over the modules (DP-SGD calls it every step: train/eval mode and ``requires_grad`` can change)."""
    bad, mixing = [], []
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        trainable = own_trainable(module)
        if not isinstance(module, DPLayer):
            if trainable:
                bad.append((name, module))
            if isinstance(module, _MIXING) and module.training:
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
            why + "these layers use batch statistics in training mode, so one example changes every example's "
            "gradient: " + ", ".join(layers) + ". Use GroupNorm or LayerNorm, or put them in eval mode with public "
            "statistics."
        )


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """'name (Type)' of every layer of ``model`` that normalises with batch statistics in training mode (BatchNorm,
    InstanceNorm): one example then changes every example's output, so no per-example bound holds, whether the
    layer trains or not."""
    return [f"{name or '<model>'} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, _MIXING) and m.training]  # fmt: skip


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
