"""ResNet-18 with GroupNorm (ResNet-18-GN), the standard DP image model, written here because torchvision's PyPI
wheels are built against CUDA torch and do not import with the CPU wheel fastdp pins.

The layout is torchvision's ``resnet18`` (BasicBlock, [2, 2, 2, 2], widths 64-128-256-512, a 1x1 strided projection
on the shortcut where the shape changes) with every BatchNorm2d replaced by GroupNorm(32 groups, affine), as
``fastdp.nn.fix`` or ``opacus.validators.ModuleValidator.fix`` would; ``cifar=True`` uses the 3x3 stride-1 stem
without max-pooling that CIFAR-10 models use (32x32 inputs), otherwise torchvision's 7x7 stride-2 stem and max-pool.
Random initialisation (kaiming normal for convolutions, as torchvision; GroupNorm weight 1, bias 0).
"""

from __future__ import annotations

from torch import nn

GROUPS = 32


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(GROUPS, channels), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and ReLU, plus the shortcut (identity, or a 1x1 strided projection)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = _norm(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout))

    def forward(self, x):
        out = self.relu(self.gn1(self.conv1(x)))
        return self.relu(self.gn2(self.conv2(out)) + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18-GN mapping [B, 3, H, W] images to [B, classes] logits (module docstring)."""

    def __init__(self, classes: int = 10, cifar: bool = True) -> None:
        super().__init__()
        if cifar:
            stem = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), _norm(64), nn.ReLU()]
        else:
            stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), _norm(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        self.stem = nn.Sequential(*stem)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))
