"""A small model zoo for DP training: every model returns logits [batch, num_classes] and is DP-SGD compatible.

DP-SGD needs per-example gradients, so no layer may mix examples of a batch: no BatchNorm (its statistics couple the
examples) and no dropout (its random mask breaks ``torch.func.vmap(torch.func.grad(...))`` over a batch). Every model
here is built from Linear, Conv2d, ReLU, MaxPool2d and Flatten only, so per-example gradients via vmap work.
Binary tasks use 2 logits with cross-entropy, like multiclass ones.
"""

from __future__ import annotations

import math
import numbers

from torch import nn

__all__ = ["MODELS", "build_model"]

MODELS: dict[str, str] = {
    "linear": "logistic / softmax regression: flatten + one Linear layer",
    "mlp": "flatten + `depth` hidden Linear layers of width `hidden` with ReLU + a Linear classifier (any input shape)",
    "cnn": "two 3x3 conv layers (16, 32 channels, padding 1) each with ReLU and 2x2 max-pool + a Linear classifier; "
    "for image inputs (C, H, W) with H, W >= 4, e.g. (1, 28, 28) MNIST or (1, 8, 8) digits",
    "opacus_cnn": "the CNN of Opacus' MNIST example (conv 16x8x8/2, conv 32x4x4/2, 2 linear layers; 26K params); "
    "for (1, 28, 28) inputs",
    "lipschitz_mlp": "for clipless training: BoundedInput(X_0), then `depth` LipschitzLinear (orthogonal, no bias) + "
    "GroupSort2 layers of width `hidden`, then a LipschitzLinear classifier (1-Lipschitz up to X_0)",
    "weightclip_mlp": "for weightclip training: BoundedInput(X_0), then `depth` LipschitzLinear (bias, spectral norm "
    "clipped to max_weight_norm) + ReLU layers of width `hidden`, then a clipped LipschitzLinear classifier",
    "auto": "cnn for 3-D image input shapes (C, H, W), mlp otherwise",
}

_CNN_CHANNELS = (16, 32)


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    hidden: int = 64,
    depth: int = 2,
    input_bound: float | None = None,
    max_weight_norm: float = 1.0,
) -> nn.Module:
    """Build model ``name`` (see :data:`MODELS`) mapping inputs [batch, *input_shape] to logits [batch, num_classes].

    ``hidden`` and ``depth`` set the width and number of hidden layers of ``mlp``; the other models ignore them.
    Parameters use PyTorch's default initialisation: seed with ``torch.manual_seed`` for reproducibility.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    if not input_shape or not all(isinstance(s, numbers.Integral) and s > 0 for s in input_shape):
        raise ValueError(
            f"input_shape must be a non-empty tuple of positive ints, e.g. (d,) or (1, H, W); got {input_shape}"
        )
    input_shape = tuple(int(s) for s in input_shape)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 (binary tasks use 2 logits), got {num_classes}")
    if name == "auto":
        name = "cnn" if len(input_shape) == 3 else "mlp"
    in_features = 1
    for s in input_shape:
        in_features *= s
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))
    if name == "lipschitz_mlp":
        from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear

        if hidden < 2 or hidden % 2 or depth < 1:
            raise ValueError(f"lipschitz_mlp needs an even hidden width >= 2 and depth >= 1, got {hidden=}, {depth=}")
        bound = math.sqrt(in_features) if input_bound is None else input_bound  # standardised features: ~sqrt(d)
        layers: list[nn.Module] = [BoundedInput(bound), nn.Flatten()]
        for i in range(depth):
            layers += [LipschitzLinear(in_features if i == 0 else hidden, hidden), GroupSort2()]
        return nn.Sequential(*layers, LipschitzLinear(hidden, num_classes))
    if name == "weightclip_mlp":
        from fastdp.nn.lipschitz import BoundedInput, LipschitzLinear

        if hidden < 1 or depth < 1:
            raise ValueError(f"weightclip_mlp needs hidden >= 1 and depth >= 1, got {hidden=}, {depth=}")
        bound = math.sqrt(in_features) if input_bound is None else input_bound

        def clipped(n_in: int, n_out: int) -> nn.Module:
            return LipschitzLinear(n_in, n_out, bias=True, projection="clip", max_norm=max_weight_norm)

        layers = [BoundedInput(bound), nn.Flatten()]
        for i in range(depth):
            layers += [clipped(in_features if i == 0 else hidden, hidden), nn.ReLU()]
        return nn.Sequential(*layers, clipped(hidden, num_classes))
    if name == "opacus_cnn":
        if input_shape != (1, 28, 28):
            raise ValueError(f"opacus_cnn is built for (1, 28, 28) inputs (MNIST), got {input_shape}")
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, num_classes),
        )  # fmt: skip
    if name == "mlp":
        if hidden < 1 or depth < 1:
            raise ValueError(f"mlp needs hidden >= 1 and depth >= 1 (use 'linear' for none), got {hidden=}, {depth=}")
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else hidden, hidden), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(hidden, num_classes))
    # cnn
    if len(input_shape) != 3 or input_shape[1] < 4 or input_shape[2] < 4:
        raise ValueError(
            "cnn supports image input shapes (C, H, W) with H, W >= 4, e.g. (1, 28, 28) or (1, 8, 8); "
            f"got {input_shape}. Use 'mlp' or 'linear' (or 'auto') for tabular inputs."
        )
    c, h, w = input_shape
    c1, c2 = _CNN_CHANNELS
    return nn.Sequential(
        nn.Conv2d(c, c1, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # H -> H // 2
        nn.Conv2d(c1, c2, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # -> H // 4
        nn.Flatten(),
        nn.Linear(c2 * (h // 4) * (w // 4), num_classes),
    )
