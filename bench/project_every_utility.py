"""What projecting less often costs in accuracy: clipless training of the 784-512-512-10 Lipschitz MLP on MNIST
(t10k, 8,000 training images) at batch 256 and epsilon 4, projecting after every k-th step (``--project-every``).

Between projections every bound is still certified, but a dense layer's is its last certificate plus
||W - W_certified||_F, loose for noisy updates (about sqrt(n m) / (sqrt(n) + sqrt(m)) times the spectral norm of a
noise-like update, 12 for 512 x 784), so the noise grows with the drift: small learning rates drift less. Each
setting is trained with several reproducible privacy seeds (the same seeds for every k) and reported as the mean
test accuracy with the training time. Results go to bench/results/<device>-project-every-utility.csv.

    python bench/project_every_utility.py --every 1 2 4 16 --lrs 0.001 0.003 --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import harness
import torch

from fastdp.train.trainer import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", nargs="+", type=int, default=[1, 2, 4, 16])
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.001, 0.003])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    info = harness.run_info(torch.device("cpu"))
    rows = []
    for lr in args.lrs:
        for k in args.every:
            runs = []
            for seed in args.seeds:
                config = TrainConfig(variant="clipless", model="lipschitz_mlp", hidden=512, dataset="mnist",
                                     batch_size=256, epochs=args.epochs, epsilon=4.0, optimizer="adam", lr=lr,
                                     input_bound=10.0, project_every=k, reproducible_privacy_seed=seed, quiet=True,
                                     progress=False)  # fmt: skip
                result = train(config)
                runs.append((result["test_accuracy"], result["train_seconds"]))
                rows.append(dict(lr=lr, project_every=k, seed=seed, epsilon=f"{result['epsilon']:.4f}",
                                 test_accuracy=result["test_accuracy"], train_seconds=f"{result['train_seconds']:.2f}",
                                 **info))  # fmt: skip
            accuracy = statistics.mean(a for a, _ in runs)
            seconds = statistics.median(s for _, s in runs)
            print(f"lr {lr:g} project every {k:3d}: accuracy {accuracy:.3f} "
                  f"({', '.join(f'{a:.3f}' for a, _ in runs)}), train {seconds:.1f} s", flush=True)  # fmt: skip
    harness.write_rows(rows, args.out, f"{info['device']}-project-every-utility")
    return 0


if __name__ == "__main__":
    sys.exit(main())
