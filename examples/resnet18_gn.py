"""ResNet-18 with GroupNorm (ResNet-18-GN), the standard DP image model, trained with DP-SGD through the front door.

    python examples/resnet18_gn.py                # scikit-learn's digits, 11.2M parameters, under a minute on 2 cores
    python examples/resnet18_gn.py --smoke        # a few steps (the test suite runs this)

What it shows: a large convolutional network through ``make_private_with_epsilon``, starting from the model as it
is usually written, with BatchNorm. BatchNorm mixes the examples of a batch (its statistics are the batch's), which
breaks every per-example bound, so ``make_private`` refuses it; ``fastdp.nn.fix(model)`` replaces every BatchNorm by
``GroupNorm(32, C)`` in place (Opacus' ``ModuleValidator.fix``), which normalises each example on its own. The
network is torchvision's ``resnet18`` layout (BasicBlocks [2, 2, 2, 2], widths 64-512, 11.2M parameters) with the
CIFAR stem, written out here because torchvision's wheels do not import with the CPU torch fastdp pins (with
torchvision: ``fastdp.nn.fix(torchvision.models.resnet18(num_classes=10))``); ``bench/resnet.py`` holds the same
network with GroupNorm written in. Each convolution's per-example gradient norm comes from its input and output
gradient in one backward: no per-example gradient of the 11.2M parameters is formed.

Data: scikit-learn's bundled 8x8 digits (1,437 training / 360 test images), pixels /16 (a public constant), the one
channel repeated to the three the network takes (8x8 keeps the run short on a CPU; the network is CIFAR's).

Prints the noise multiplier, per epoch the training loss and epsilon so far, and at the end epsilon at delta and the
test accuracy.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastdp.nn
from fastdp import PrivacyEngine
from fastdp.train.data import load_raw


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU, plus the shortcut (identity, or a strided 1x1 projection)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(classes: int) -> nn.Sequential:
    """ResNet-18 with BatchNorm (torchvision's layout and initialisation, CIFAR's 3x3 stem without max-pooling)."""
    layers, cin = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0, help="the data split and the initial weights")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a small slice")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.batch_size = 1, 32

    torch.manual_seed(args.seed)  # the initial weights; the noise and the batches come from OS entropy
    raw = load_raw("digits", seed=args.seed)  # images [N, 1, 8, 8] in [0, 1], seeded stratified split

    def rgb(x):
        return torch.tensor(x, dtype=torch.float32).expand(-1, 3, -1, -1).contiguous()

    x_train, y_train, x_test, y_test = rgb(raw.x_train), torch.tensor(raw.y_train), rgb(raw.x_test), raw.y_test
    if args.smoke:
        x_train, y_train = x_train[:128], y_train[:128]
    model = fastdp.nn.fix(resnet18(classes=10))  # every BatchNorm2d -> GroupNorm(32, C), its affine parameters kept
    assert fastdp.nn.validate(model) == []  # what make_private would refuse: nothing now (before fix: 20 BatchNorms)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x_train, y_train), args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    print(f"ResNet-18-GN, {parameters / 1e6:.1f}M parameters; {len(x_train)} training images, noise multiplier "
          f"{optimizer.noise_multiplier:.3f}, {len(loader)} steps per epoch")  # fmt: skip

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            if len(y):
                losses.append(loss.item())
        print(f"epoch {epoch}: loss {sum(losses) / max(len(losses), 1):.4f}, "
              f"epsilon {engine.get_epsilon(args.delta):.2f}")  # fmt: skip

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1).numpy() == y_test).mean()
    print(f"epsilon = {engine.get_epsilon(args.delta):.2f} at delta = {args.delta:g}; test accuracy = {accuracy:.4f}")


if __name__ == "__main__":
    main()
