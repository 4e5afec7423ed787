"""Your own CSV file, trained privately from the command line: ``fastdp train --data FILE.csv --target COLUMN``.

    python examples/csv_classifier.py             # writes a CSV to a temporary folder, then runs fastdp train on it
    python examples/csv_classifier.py --smoke     # 2 epochs (the test suite runs this)

What it shows: the conventions of a data file (fastdp/train/data.py, ``load_file``): a header row of column names,
one row per example, every column but ``--target`` a numeric feature (no missing values; encode categorical
features yourself), labels as integers 0..K-1 or as strings (mapped to classes in sorted order, and said so). The
CLI makes a seeded stratified 80/20 train/test split, standardises the features with the Gaussian mechanism (paid
for in epsilon and included in the reported epsilon: ``--standardize dp``, the default of private runs), calibrates
the noise to ``--epsilon`` and trains DP-SGD on Poisson-sampled batches through the same front door as a user's loop.

The CSV here is scikit-learn's bundled breast cancer table (569 rows, 30 features, labels "malignant"/"benign"),
written the way any spreadsheet export is. For your file, run the printed command with your path and label column.

Prints the command, the CLI's per-epoch log, and its result line: one JSON object with epsilon, delta and the test
accuracy and AUROC.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from sklearn.datasets import load_breast_cancer


def write_csv(path: Path) -> None:
    """A header row, then one row per example; the label column holds class names."""
    bunch = load_breast_cancer()
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*bunch.feature_names, "diagnosis"])
        for features, label in zip(bunch.data, bunch.target, strict=True):
            writer.writerow([*(f"{v:.6g}" for v in features), bunch.target_names[label]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0, help="the train/test split and the initial weights")
    parser.add_argument("--smoke", action="store_true", help="2 epochs")
    args = parser.parse_args()
    epochs = 2 if args.smoke else args.epochs

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "breast_cancer.csv"
        write_csv(data)
        command = [
            "fastdp", "train", "--data", str(data), "--target", "diagnosis",
            "--variant", "dpsgd", "--epsilon", str(args.epsilon), "--delta", "1e-5",
            "--epochs", str(epochs), "--batch-size", "64", "--lr", "0.1", "--clip-norm", "1",
            "--seed", str(args.seed),
        ]  # fmt: skip
        print("$ " + shlex.join(command), flush=True)
        # `fastdp` is the console script of `python -m fastdp.train.cli`; run the module with this interpreter, so
        # the example works whether or not the virtual environment's bin/ is on PATH.
        result = subprocess.run([sys.executable, "-m", "fastdp.train.cli", *command[1:]], check=False)
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
