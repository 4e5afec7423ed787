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

__all__ = ["LIPSCHITZ_MODELS", "MODELS", "build_model"]

MODELS: dict[str, str] = {
    "linear": "logistic / softmax regression: flatten + one Linear layer",
    "mlp": "flatten + `depth` hidden Linear layers of width `hidden` with ReLU + a Linear classifier (any input shape)",
    "cnn": "two 3x3 conv layers (16, 32 channels, padding 1) each with ReLU and 2x2 max-pool + a Linear classifier; "
    "for image inputs (C, H, W) with H, W >= 4, e.g. (1, 28, 28) MNIST or (1, 8, 8) digits",
    "opacus_cnn": "the CNN of Opacus' MNIST example (conv 16x8x8/2, conv 32x4x4/2, 2 linear layers; 26K params); "
    "for (1, 28, 28) inputs",
    "backprop_cnn": "the bias-free CNN of the backprop-clipping repository's corrected MNIST experiment (Stevens et "
    "al. 2022, uvm-plaid/backpropagation-clipping 7f38fe6): conv 16x8x8/2 and 32x4x4/2 without padding or bias, each "
    "with ReLU and max-pool 2/1, linear 288-32-10 without bias (4 parameter tensors, 18,752 params); for (1, 28, 28)",
    "lipschitz_mlp": "for clipless training: BoundedInput(X_0), then `depth` LipschitzLinear (orthogonal, no bias) + "
    "GroupSort2 layers of width `hidden`, then a LipschitzLinear classifier (1-Lipschitz up to X_0)",
    "weightclip_mlp": "for weightclip training: BoundedInput(X_0), then `depth` LipschitzLinear (bias, spectral norm "
    "clipped to max_weight_norm) + ReLU layers of width `hidden`, then a clipped LipschitzLinear classifier",
    "weightclip_cnn": "for weightclip training on images (C, H, W) with H, W >= 4 (Barczewski and Ramon 2023's "
    "ConvNet pattern): BoundedInput(X_0), two blocks of a 3x3 WeightClipConv2d (16, 32 channels, padding 1, no bias, "
    "certified operator norm clipped to max_weight_norm), LipschitzGroupNorm (groups of 4 channels, alpha 1), ReLU and "
    "L2NormPool2d(2), then a clipped LipschitzLinear classifier with bias (`hidden` and `depth` unused)",
    "lipschitz_vgg": "for clipless training on images (C, H, W) with H, W >= 2^depth: BoundedInput(X_0), then `depth` "
    "blocks of a 3x3 RKO LipschitzConv2d (channels hidden / 2^(depth-1-i), even), ChannelGroupSort2 and "
    "L2NormPool2d(2) (lip-dp's MNIST ConvNet: 32, 64 channels for hidden 64), then a LipschitzLinear classifier on "
    "the flattened features",
    "lipschitz_mixer": "for clipless training on images (C, H, W): BoundedInput(X_0), p x p patches (the smallest p "
    ">= 2 dividing H and W into at most 64 tokens: 2 for 8x8 digits, 4 for 28x28 MNIST), a token-wise LipschitzLinear "
    "embedding to width `hidden`, `depth` mixer blocks (token mixing: LipschitzLinear over the tokens + GroupSort2; "
    "channel mixing: LipschitzLinear + GroupSort2 + LayerCentering; no skip connections, as lip-dp found them worse), "
    "then a LipschitzLinear classifier on the flattened tokens",
    "auto": "cnn for 3-D image input shapes (C, H, W), mlp otherwise",
}
# the models built from fastdp.nn.lipschitz / fastdp.nn.lipdp layers only: the clipless and weightclip variants need
# one (their bounds come from its layers' rules), and their certified robust accuracy can be reported
LIPSCHITZ_MODELS: tuple[str, ...] = ("lipschitz_mlp", "weightclip_mlp", "lipschitz_vgg", "lipschitz_mixer",
                                      "weightclip_cnn")  # fmt: skip
MIXER_MAX_TOKENS = 64

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
    if name in ("lipschitz_vgg", "lipschitz_mixer"):
        return _lipschitz_image_model(name, input_shape, num_classes, hidden, depth, input_bound)
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
    if name == "weightclip_cnn":
        return _weightclip_cnn(input_shape, num_classes, input_bound, max_weight_norm)
    if name == "opacus_cnn":
        if input_shape != (1, 28, 28):
            raise ValueError(f"opacus_cnn is built for (1, 28, 28) inputs (MNIST), got {input_shape}")
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, num_classes),
        )  # fmt: skip
    if name == "backprop_cnn":
        if input_shape != (1, 28, 28):
            raise ValueError(f"backprop_cnn is built for (1, 28, 28) inputs (MNIST), got {input_shape}")
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, bias=False), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2, bias=False), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Flatten(), nn.Linear(32 * 3 * 3, 32, bias=False), nn.ReLU(), nn.Linear(32, num_classes, bias=False),
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


def _lipschitz_image_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, hidden: int, depth: int, input_bound: float | None
) -> nn.Module:
    """``lipschitz_vgg`` or ``lipschitz_mixer`` (see :data:`MODELS`): GNP layers only (orthogonal dense layers, RKO
    convolutions, GroupSort, norm pooling), no bias, so every layer's constant is about 1 (RKO convolutions on small
    images: 1.09 on 8x8, 1.2 on 4x4) and the bounds stay tight."""
    from fastdp.nn.lipdp import ChannelGroupSort2, ToPatches
    from fastdp.nn.lipschitz import (
        BoundedInput,
        GroupSort2,
        L2NormPool2d,
        LayerCentering,
        LipschitzConv2d,
        LipschitzLinear,
        Transpose,
    )

    if len(input_shape) != 3:
        raise ValueError(f"{name} is for images (C, H, W), e.g. (1, 8, 8) digits or (1, 28, 28) MNIST; got input "
                         f"shape {input_shape}")  # fmt: skip
    c, h, w = input_shape
    bound = math.sqrt(c * h * w) if input_bound is None else input_bound  # standardised pixels: ~sqrt(d)
    if name == "lipschitz_vgg":
        if depth < 1 or hidden < 2 or h < 2**depth or w < 2**depth:
            raise ValueError(f"lipschitz_vgg needs depth >= 1, hidden >= 2 and images of at least 2^depth pixels a "
                             f"side, got {hidden=}, {depth=}, input shape {input_shape}")  # fmt: skip
        layers: list[nn.Module] = [BoundedInput(bound)]
        channels = c
        for i in range(depth):
            width = max(2, hidden // 2 ** (depth - 1 - i))
            width += width % 2  # ChannelGroupSort2 pairs channels
            layers += [LipschitzConv2d(channels, width, 3, (h, w), padding=1), ChannelGroupSort2(), L2NormPool2d(2)]
            channels, h, w = width, h // 2, w // 2
        return nn.Sequential(*layers, nn.Flatten(), LipschitzLinear(channels * h * w, num_classes))
    # lipschitz_mixer
    if depth < 1 or hidden < 2 or hidden % 2:
        raise ValueError(f"lipschitz_mixer needs depth >= 1 and an even hidden width >= 2, got {hidden=}, {depth=}")
    sizes = [p for p in range(2, min(h, w) + 1) if h % p == 0 and w % p == 0] or [1]  # patches of >= 2 pixels a side
    patch = next((p for p in sizes if (h // p) * (w // p) <= MIXER_MAX_TOKENS), None)
    if patch is None:
        raise ValueError(f"lipschitz_mixer: no patch size divides both sides of {h}x{w} images into at most "
                         f"{MIXER_MAX_TOKENS} tokens; crop or pad the images")  # fmt: skip
    tokens, features = (h // patch) * (w // patch), c * patch * patch
    layers = [BoundedInput(bound), ToPatches(patch), LipschitzLinear(features, hidden)]  # [B, tokens, hidden]
    for _ in range(depth):
        token_mixing = [Transpose(1, 2), LipschitzLinear(tokens, tokens), Transpose(1, 2), GroupSort2()]
        layers += [*token_mixing, LipschitzLinear(hidden, hidden), GroupSort2(), LayerCentering()]
    return nn.Sequential(*layers, nn.Flatten(), LipschitzLinear(tokens * hidden, num_classes))


def _weightclip_cnn(
    input_shape: tuple[int, ...], num_classes: int, input_bound: float | None, max_weight_norm: float
) -> nn.Module:
    """``weightclip_cnn`` (see :data:`MODELS`): every layer has a certified bound rule (``fastdp.nn.weightclip``,
    ``fastdp.nn.lipschitz``); the convolutions' and the classifier's constants are clipped to C =
    ``max_weight_norm``."""
    from fastdp.nn.lipschitz import BoundedInput, L2NormPool2d, LipschitzLinear
    from fastdp.nn.weightclip import LipschitzGroupNorm, WeightClipConv2d

    if len(input_shape) != 3 or input_shape[1] < 4 or input_shape[2] < 4:
        raise ValueError(f"weightclip_cnn is for images (C, H, W) with H, W >= 4, e.g. (1, 8, 8) digits or (1, 28, 28) "
                         f"MNIST; got input shape {input_shape}")  # fmt: skip
    c, h, w = input_shape
    bound = math.sqrt(c * h * w) if input_bound is None else input_bound  # standardised pixels: ~sqrt(d)
    layers: list[nn.Module] = [BoundedInput(bound)]
    for width in _CNN_CHANNELS:
        # no conv bias: the group norm right after removes each group's mean (a bias would survive only as differences
        # within a group), and its bound sqrt(H W) g would add a noisy tensor
        layers += [
            WeightClipConv2d(c, width, 3, (h, w), padding=1, bias=False, max_norm=max_weight_norm),
            LipschitzGroupNorm(width // 4, width, alpha=1.0, spatial_shape=(h, w)),
            nn.ReLU(),
            L2NormPool2d(2),
        ]
        c, h, w = width, h // 2, w // 2
    classifier = LipschitzLinear(c * h * w, num_classes, bias=True, projection="clip", max_norm=max_weight_norm)
    return nn.Sequential(*layers, nn.Flatten(), classifier)
