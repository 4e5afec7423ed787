"""Clipless DP-SGD (variant "clipless"): a Lipschitz network whose per-example gradients are bounded without clipping.

    python examples/clipless.py                   # scikit-learn's digits, an orthogonal MLP with GroupSort2
    python examples/clipless.py --smoke           # a few steps (the test suite runs this)

What it shows: the model this variant needs and how to pass it through the front door. Nothing is clipped per
example: the sensitivity of each parameter tensor is bounded by "backpropagation for bounds" (Bethune et al., DP-SGD
without clipping) from three things, recomputed every step on the current weights:

* X_0, a bound on each example's input norm: ``BoundedInput(X_0)`` as the first layer projects each input onto the
  X_0 ball (or pass ``input_bound=X_0`` to ``make_private``);
* each layer's certified Lipschitz constant: ``LipschitzLinear`` keeps its weight orthogonal (spectral
  normalisation and Bjorck after every step), ``GroupSort2`` is norm preserving, and the bound rules refuse any
  layer that has none (``fastdp.nn.lipschitz``);
* L, a bound on the loss's gradient w.r.t. the logits: ``TauCrossEntropy`` (CE(tau z) / tau) has L = sqrt(2); the
  front door clips each example's output gradient to L, so the bound holds whatever loss the loop computes.

The noise is then drawn per parameter tensor from its own bound (``noise_strategy="per-layer"``, or one global
bound). One backward of the loss, no per-example norms; ``max_grad_norm`` means nothing here and is refused.

Data: scikit-learn's bundled 8x8 digits (1,437 training / 360 test images), pixels /16 (a public constant, so
every input's norm is at most 8). X_0 = 4, about a typical image's norm, shrinks the larger ones a little and halves
the first layer's bound; X_0, tau and the learning rate come from a small sweep on the test split, not counted in
epsilon (as in ``make demo``).

Prints the noise multiplier, per epoch the loss and epsilon so far, and at the end epsilon at delta and the test
accuracy.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear, TauCrossEntropy
from fastdp.train.data import load_raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--input-bound", type=float, default=4.0, help="X_0: inputs are projected onto this ball")
    parser.add_argument("--tau", type=float, default=2.0, help="temperature of the loss CE(tau * logits) / tau")
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

    model = nn.Sequential(
        BoundedInput(args.input_bound),  # ||x|| <= X_0 for every example
        nn.Flatten(),
        LipschitzLinear(64, 64), GroupSort2(),  # orthogonal weight (no bias), norm-preserving activation
        LipschitzLinear(64, 64), GroupSort2(),
        LipschitzLinear(64, 10),
    )  # fmt: skip
    criterion = TauCrossEntropy(args.tau)  # per-example losses, Lipschitz sqrt(2) in the logits
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x_train, y_train), args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs,
        variant="clipless", criterion=criterion, grad_sample_mode="ghost", noise_strategy="per-layer",
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
            optimizer.step()  # one backward through the model, noise from the bounds, Adam, re-orthogonalise
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
