"""An image classifier trained with DP-SGD through fastdp's Opacus-compatible front door.

    python examples/image_classifier.py                   # MNIST (../shared/data/mnist) or scikit-learn's digits
    python examples/image_classifier.py --epsilon 1 --epochs 5
    python examples/image_classifier.py --smoke           # a few steps on a small slice (the test suite runs this)

What it shows: an ordinary PyTorch model, optimizer and DataLoader; ``PrivacyEngine.make_private_with_epsilon``
calibrates the noise so the whole run is (epsilon, delta)-DP and returns the private model, optimizer and a
Poisson-sampled loader; the training loop is unchanged; ``engine.get_epsilon(delta)`` reports what was spent.

Data (nothing is downloaded): MNIST's t10k images (its 10,000 test images; the training images are not available
offline) when ``../shared/data/mnist`` holds them, which fastdp's loader splits 8,000 / 2,000 (seeded, stratified);
else scikit-learn's bundled 8x8 digits (1,437 / 360). ``$FASTDP_DATA_DIR`` names another data folder. Pixels are
scaled to [0, 1] by a public constant (/255, /16): a scaling fitted on the training images would itself leak them.

Prints one line per epoch (mean loss, epsilon so far) and, at the end, epsilon at delta and the test accuracy.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.train.data import default_data_dir, load_raw


def load_images(smoke: bool, seed: int):
    """(train set, test images, test labels, name): MNIST when its files are present, else digits."""
    data_dir = default_data_dir()  # $FASTDP_DATA_DIR, else ../shared/data beside the repository if it exists
    mnist = data_dir is not None and (data_dir / "mnist" / "t10k-images-idx3-ubyte.gz").is_file()
    name = "mnist" if mnist else "digits"
    raw = load_raw(name, data_dir, seed=seed)  # seeded stratified split; images [N, 1, H, W] already in [0, 1]
    x_train, y_train = torch.tensor(raw.x_train, dtype=torch.float32), torch.tensor(raw.y_train)
    x_test, y_test = torch.tensor(raw.x_test, dtype=torch.float32), torch.tensor(raw.y_test)
    if smoke:  # a small slice, so the run takes seconds
        x_train, y_train, x_test, y_test = x_train[:600], y_train[:600], x_test[:300], y_test[:300]
    return TensorDataset(x_train, y_train), x_test, y_test, name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of the whole run")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="C: each example's gradient is clipped to C")
    parser.add_argument("--seed", type=int, default=0, help="the data split and the initial weights")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a small slice")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.batch_size = 1, 64

    torch.manual_seed(args.seed)  # the initial weights; the noise and the batches come from OS entropy
    train_set, x_test, y_test, name = load_images(args.smoke, args.seed)
    _, height, width = train_set.tensors[0].shape[1:]
    # Any model of standard layers works, as long as no layer mixes the examples of a batch (no BatchNorm).
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (height // 4) * (width // 4), 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    loader = DataLoader(train_set, batch_size=args.batch_size)

    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader,
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",  # Opacus' ghost clipping idiom: the loss, wrapped
    )  # fmt: skip
    print(f"{name}: {len(train_set)} training images, noise multiplier {optimizer.noise_multiplier:.3f}, "
          f"{len(loader)} steps per epoch")  # fmt: skip

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for x, y in loader:  # Poisson batches: each example joins with probability batch_size / N (may be empty)
            optimizer.zero_grad()
            loss = criterion(model(x), y)  # the mean over the batch's examples (loss_reduction="mean", the default)
            loss.backward()  # records each layer's input and output gradient: per-example norms, no per-example grads
            optimizer.step()  # clips each example to C, adds the noise once, steps SGD, records the step's privacy
            if len(y):
                losses.append(loss.item())
        mean_loss = sum(losses) / max(len(losses), 1)
        print(f"epoch {epoch}: loss {mean_loss:.4f}, epsilon {engine.get_epsilon(args.delta):.2f}")

    model.eval()  # evaluation forwards run the plain model
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"epsilon = {engine.get_epsilon(args.delta):.2f} at delta = {args.delta:g}; test accuracy = {accuracy:.4f}")


if __name__ == "__main__":
    main()
