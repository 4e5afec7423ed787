#!/usr/bin/env python3
"""Opacus' MNIST example, as an Opacus user writes it: SampleConvNet, SGD, ``make_private_with_epsilon``, a
DataLoader, the ordinary loop, test accuracy and ``privacy_engine.get_epsilon(delta)``.

Written for Opacus; ``bench/bench_opacus_accuracy.py`` and ``tests/test_opacus_scripts.py`` also run a copy whose
only change is the import line (``from fastdp import PrivacyEngine``). The loss comes from the criterion
``make_private_with_epsilon`` returns with ``grad_sample_mode="ghost"`` (Opacus' ghost clipping idiom): fastdp refuses
a plain batch mean under ``loss_reduction="mean"`` (its 1/n re-rounds every example's gradient when n changes:
``fastdp.engine.loss``).

Data (nothing is downloaded): MNIST's t10k images and labels (gzip'd IDX, ``--data-root``, default
``../shared/data/mnist`` from the working directory), split once (a fixed permutation) into 8,000 training and 2,000
test images. Without those files: scikit-learn's bundled 8x8 digits (1,797 images) upsampled to 28x28, split 80/20.

The last line printed is one JSON object: test accuracy, the epsilon ``get_epsilon`` reports, the step times (each
iteration of the training loop: batch, forward, backward, ``optimizer.step()``), the epoch time (the loop's steps),
the time of ``make_private_with_epsilon`` (calibration), of one ``get_epsilon`` call, and of the whole run from
``PrivacyEngine()`` to the last ``get_epsilon``.

    python bench/opacus_scripts/mnist_cnn.py --seed 0 --epochs 4 --epsilon 3
    python bench/opacus_scripts/mnist_cnn.py --smoke
"""

import argparse
import gzip
import json
import os
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

# Precomputed characteristics of the MNIST dataset
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        # x of shape [B, 1, 28, 28]
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        x = self.fc2(x)  # -> [B, 10]
        return x

    def name(self):
        return "SampleConvNet"


def read_idx(path):
    """A gzip'd IDX file (MNIST's format) as a numpy array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_data(data_root, n_test):
    """(train_x, train_y, test_x, test_y, name): images [N, 1, 28, 28] in [0, 1], labels int64."""
    images = os.path.join(data_root, "t10k-images-idx3-ubyte.gz")
    labels = os.path.join(data_root, "t10k-labels-idx1-ubyte.gz")
    if os.path.exists(images) and os.path.exists(labels):
        x = torch.from_numpy(read_idx(images).astype(np.float32) / 255.0).unsqueeze(1)
        y = torch.from_numpy(read_idx(labels).astype(np.int64))
        name = "mnist-t10k"
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
        x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
        y = torch.from_numpy(digits.target.astype(np.int64))
        name = "sklearn-digits"
        n_test = len(y) // 5
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))  # one fixed split for every seed
    x, y = x[order], y[order]
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test], name


def per_class(x, y, k):
    """The first ``k`` examples of each class."""
    keep = torch.cat([torch.nonzero(y == c).flatten()[:k] for c in range(10)]).sort().values
    return x[keep], y[keep]


def train(args, model, device, train_loader, optimizer, criterion, privacy_engine, epoch, step_times, accounting_times):
    model.train()
    losses = []
    start = time.perf_counter()
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        now = time.perf_counter()
        step_times.append(now - start)
        start = now

    t0 = time.perf_counter()
    epsilon = privacy_engine.get_epsilon(args.delta)
    accounting_times.append(time.perf_counter() - t0)
    print(f"Train Epoch: {epoch} \tLoss: {np.nanmean(losses):.6f} (ε = {epsilon:.2f}, δ = {args.delta})")


def test(model, device, test_loader):
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += criterion(output, target).item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)
    accuracy = correct / len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} "
          f"({100.0 * accuracy:.2f}%)\n")  # fmt: skip
    return accuracy, test_loss


def main():
    parser = argparse.ArgumentParser(
        description="Opacus MNIST Example (make_private_with_epsilon)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-b", "--batch-size", type=int, default=64, metavar="B", help="Batch size (expected)")
    parser.add_argument("--test-batch-size", type=int, default=1024, metavar="TB", help="Test batch size")
    parser.add_argument("-n", "--epochs", type=int, default=4, metavar="N", help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=0.5, metavar="LR", help="learning rate")
    parser.add_argument("--epsilon", type=float, default=3.0, metavar="E", help="Target epsilon")
    parser.add_argument("-c", "--max-per-sample-grad_norm", type=float, default=1.0, metavar="C",
                        help="Clip per-sample gradients to this norm")  # fmt: skip
    parser.add_argument("--delta", type=float, default=1e-5, metavar="D", help="Target delta")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the model's initialisation and torch's RNG")
    parser.add_argument("--max-per-class", type=int, default=None, help="Train on at most this many per class")
    parser.add_argument("--n-test", type=int, default=2000, help="Test images held out of MNIST's t10k")
    parser.add_argument("--smoke", action="store_true", help="A few seconds' run: 100 per class, 2 epochs, eps 8")
    parser.add_argument("--device", type=str, default="cpu", help="Device")
    parser.add_argument("--data-root", type=str, default="../shared/data/mnist", help="Where MNIST's t10k is")
    args = parser.parse_args()
    if args.smoke:
        args.max_per_class, args.epochs, args.epsilon, args.n_test = 100, 2, 8.0, 500
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")

    train_x, train_y, test_x, test_y, data_name = load_data(args.data_root, args.n_test)
    if args.max_per_class:
        train_x, train_y = per_class(train_x, train_y, args.max_per_class)
    train_x = (train_x - MNIST_MEAN) / MNIST_STD
    test_x = (test_x - MNIST_MEAN) / MNIST_STD
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size)
    test_loader = DataLoader(TensorDataset(test_x, test_y), batch_size=args.test_batch_size, shuffle=False)

    model = SampleConvNet().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)

    run_start = time.perf_counter()
    privacy_engine = PrivacyEngine()
    model, optimizer, criterion, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        criterion=nn.CrossEntropyLoss(),
        grad_sample_mode="ghost",
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_grad_norm=args.max_per_sample_grad_norm,
    )
    make_private_s = time.perf_counter() - run_start
    print(f"Using sigma={optimizer.noise_multiplier} and C={args.max_per_sample_grad_norm}")

    step_times, accounting_times = [], []
    for epoch in range(1, args.epochs + 1):
        train(
            args, model, device, train_loader, optimizer, criterion, privacy_engine, epoch, step_times, accounting_times
        )
    accuracy, test_loss = test(model, device, test_loader)
    epsilon = privacy_engine.get_epsilon(args.delta)
    run_s = time.perf_counter() - run_start

    result = {
        "script": "mnist_cnn",
        "engine": PrivacyEngine.__module__.split(".")[0],
        "data": data_name,
        "n_train": len(train_y),
        "n_test": len(test_y),
        "seed": args.seed,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "noise_multiplier": float(optimizer.noise_multiplier),
        "steps": len(step_times),
        "accuracy": accuracy,
        "test_loss": test_loss,
        "epsilon": epsilon,
        "median_step_s": statistics.median(step_times),
        "mean_step_s": statistics.mean(step_times),
        "epoch_s": sum(step_times) / args.epochs,
        "make_private_s": make_private_s,
        "get_epsilon_s": statistics.mean(accounting_times),
        "run_s": run_s,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
