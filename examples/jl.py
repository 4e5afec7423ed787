"""DP-SGD-JL (variant "jl"): DP-SGD whose per-example norms are estimated from r random projections.

    python examples/jl.py                         # scikit-learn's digits, an MLP, r = 10 projections
    python examples/jl.py --projections 4 --smoke # a few steps (the test suite runs --smoke)

What it shows: the front door's ``variant="jl"`` with ``projections=r`` on an ordinary model (any model DP-SGD
takes: Linear, Conv, Embedding, norms, attention, RNNs). Each step draws r random directions shared by the batch;
each example's gradient norm is estimated from its r projections (Bu et al., 2021), and its gradient is scaled to at
most ``max_grad_norm`` by that estimate. An estimate can fall short of the true norm, so a step is not a Gaussian
mechanism of sensitivity C: the accountant accounts a random, revealed sensitivity, which only the PLD accountant
can do: ``PrivacyEngine(accountant="pld")`` (RDP is refused). For the same epsilon it therefore needs more noise than
DP-SGD, the more so the fewer the projections: the script prints both noise multipliers.

Data: scikit-learn's bundled 8x8 digits (1,437 training / 360 test images), pixels /16 (a public constant).

Prints the noise multipliers, per epoch the loss and epsilon so far, and at the end epsilon at delta and the test
accuracy.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.privacy.accounting import get_noise_multiplier
from fastdp.train.data import load_raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="C: the clip applied to each estimated norm")
    parser.add_argument("--projections", type=int, default=10, help="r: JL projections per step")
    parser.add_argument("--seed", type=int, default=0, help="the data split and the initial weights")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a small slice")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.batch_size = 1, 64

    torch.manual_seed(args.seed)  # the initial weights; the noise, batches and projections come from OS entropy
    raw = load_raw("digits", seed=args.seed)  # images [N, 1, 8, 8] in [0, 1], seeded stratified split
    x_train, y_train = torch.tensor(raw.x_train, dtype=torch.float32), torch.tensor(raw.y_train)
    x_test, y_test = torch.tensor(raw.x_test, dtype=torch.float32), torch.tensor(raw.y_test)
    if args.smoke:
        x_train, y_train = x_train[:256], y_train[:256]

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="pld")  # JL's privacy loss has no useful RDP bound
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x_train, y_train), args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
        variant="jl", projections=args.projections, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    # for comparison only: the noise DP-SGD (exact norms) would need for the same target, from the same accountant
    exact = get_noise_multiplier(args.epsilon, args.delta, loader.sample_rate, args.epochs * len(loader), "pld")
    print(f"{len(x_train)} training images, {len(loader)} steps per epoch; noise multiplier "
          f"{optimizer.noise_multiplier:.3f} with r = {args.projections} (DP-SGD: {exact:.3f})")  # fmt: skip

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()  # records each layer's input and output gradient, as DP-SGD
            optimizer.step()  # r projections per example -> norm estimates -> scaled sum, noise once, SGD, account
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
