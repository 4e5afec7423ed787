#!/usr/bin/env python3
"""A character language model trained with Opacus, as an Opacus user writes it: a Dataset of dict examples
(``{"input_ids", "labels"}``), a DataLoader whose collate_fn pads (labels -100 on padding), ``model(input_ids=...)``,
a cross-entropy with ``ignore_index=-100`` averaged over each example's own tokens and then over the batch's examples,
``make_private_with_epsilon``, the ordinary loop and ``privacy_engine.get_epsilon(delta)``.

Written for Opacus; ``bench/bench_opacus_accuracy.py`` and ``tests/test_opacus_scripts.py`` also run a copy whose
only change is the import line (``from fastdp import PrivacyEngine``). The loss comes from the criterion
``make_private_with_epsilon`` returns with ``grad_sample_mode="ghost"`` (Opacus' ghost clipping idiom): fastdp refuses
a plain batch mean under ``loss_reduction="mean"`` (its 1/n re-rounds every example's gradient when n changes:
``fastdp.engine.loss``).

The loss: Opacus' (and fastdp's) ``loss_reduction="mean"`` takes the loss to be the mean over the batch's examples of
each example's own loss. ``nn.CrossEntropyLoss(ignore_index=-100)`` on the flattened [B * T] tokens is not that (its
divisor counts every example's tokens), so each example's tokens are averaged first (``example_losses``).

Text (nothing is downloaded): the docstrings of the Python standard library's top-level modules (``*.py`` in
``sysconfig.get_paths()["stdlib"]``, in name order; every module, class and function docstring, split into
paragraphs, whitespace collapsed, printable ASCII only), the first ``--corpus-chars`` characters. Each paragraph is
cut into examples of at most ``--max-length`` + 1 characters (so examples have different lengths and batches are
padded); a fixed permutation holds out ``--test-fraction`` of them. The task is next-character prediction; the metric
is the held-out per-character accuracy (and perplexity).

The last line printed is one JSON object: test accuracy and perplexity, the epsilon ``get_epsilon`` reports, the step
times (each iteration of the training loop: batch, forward, backward, ``optimizer.step()``), the epoch time (the
loop's steps), the time of ``make_private_with_epsilon`` (calibration), of one ``get_epsilon`` call, and of the whole
run from ``PrivacyEngine()`` to the last ``get_epsilon``.

    python bench/opacus_scripts/char_lm.py --seed 0 --epochs 8 --epsilon 3
    python bench/opacus_scripts/char_lm.py --smoke
"""

import argparse
import ast
import json
import math
import os
import statistics
import sysconfig
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from opacus import PrivacyEngine
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

PAD, UNK = 0, 1
VOCAB_SIZE = 2 + 95  # padding, unknown, printable ASCII (32 to 126)


def encode(text):
    return [ord(c) - 30 if 32 <= ord(c) <= 126 else UNK for c in text]


def stdlib_paragraphs(max_chars):
    """Docstring paragraphs of the standard library's top-level modules, in file name order, up to ``max_chars``."""
    root = sysconfig.get_paths()["stdlib"]
    paragraphs, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for paragraph in (ast.get_docstring(node) or "").split("\n\n"):
                paragraph = " ".join(paragraph.split())
                if len(paragraph) < 16:
                    continue
                paragraphs.append(paragraph)
                total += len(paragraph)
                if total >= max_chars:
                    return paragraphs
    return paragraphs


class CharDataset(Dataset):
    """Examples ``{"input_ids": x[:-1], "labels": x[1:]}`` of the characters ``x`` of a piece of text."""

    def __init__(self, texts):
        self.examples = [torch.tensor(encode(t), dtype=torch.long) for t in texts]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ids = self.examples[i]
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def collate(examples):
    """Pad to the batch's longest example: input_ids with PAD, labels with -100 (ignored by the loss)."""
    return {
        "input_ids": pad_sequence([e["input_ids"] for e in examples], batch_first=True, padding_value=PAD),
        "labels": pad_sequence([e["labels"] for e in examples], batch_first=True, padding_value=-100),
    }


class CharLM(nn.Module):
    """Embedding, a causal convolution over the last ``context`` characters, an MLP, the next character's logits."""

    def __init__(self, vocab_size=VOCAB_SIZE, embed_dim=32, context=8, hidden=128):
        super().__init__()
        self.context = context
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.conv = nn.Conv1d(embed_dim, hidden, context)
        self.fc = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids):
        x = self.embedding(input_ids).transpose(1, 2)  # [B, E, T]
        x = F.pad(x, (self.context - 1, 0))  # causal: position t sees t - context + 1 .. t
        x = F.relu(self.conv(x)).transpose(1, 2)  # [B, T, H]
        x = F.relu(self.fc(x))
        return self.lm_head(x)  # [B, T, V]


def example_losses(logits, labels):
    """Each example's mean cross-entropy over its own (non-padding) tokens: [B]."""
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def train(args, model, device, train_loader, optimizer, criterion, privacy_engine, epoch, step_times, accounting_times):
    model.train()
    losses = []
    start = time.perf_counter()
    for batch in train_loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        optimizer.zero_grad()
        logits = model(input_ids=batch["input_ids"])
        loss = criterion(logits, batch["labels"])  # the mean of example_losses over the batch's examples
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
    """Per-character accuracy and perplexity over the held-out examples' tokens."""
    model.eval()
    total_loss, correct, tokens = 0.0, 0, 0
    with torch.no_grad():
        for batch in test_loader:
            input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            logits = model(input_ids=input_ids)
            total_loss += F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum").item()
            mask = labels != -100
            correct += (logits.argmax(-1).eq(labels) & mask).sum().item()
            tokens += mask.sum().item()
    accuracy, perplexity = correct / tokens, math.exp(total_loss / tokens)
    print(f"\nTest set: {tokens} characters, accuracy {100.0 * accuracy:.2f}%, perplexity {perplexity:.2f}\n")
    return accuracy, perplexity


def main():
    parser = argparse.ArgumentParser(
        description="Opacus character language model (make_private_with_epsilon, dict batches)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-b", "--batch-size", type=int, default=256, metavar="B", help="Batch size (expected)")
    parser.add_argument("--test-batch-size", type=int, default=512, metavar="TB", help="Test batch size")
    parser.add_argument("-n", "--epochs", type=int, default=8, metavar="N", help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=2.0, metavar="LR", help="learning rate")
    parser.add_argument("--epsilon", type=float, default=3.0, metavar="E", help="Target epsilon")
    parser.add_argument("-c", "--max-per-sample-grad_norm", type=float, default=1.0, metavar="C",
                        help="Clip per-sample gradients to this norm")  # fmt: skip
    parser.add_argument("--delta", type=float, default=1e-5, metavar="D", help="Target delta")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the model's initialisation and torch's RNG")
    parser.add_argument("--corpus-chars", type=int, default=400_000, help="Characters of docstring text to use")
    parser.add_argument("--max-length", type=int, default=64, help="Longest example (characters to predict)")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="Examples held out for the test")
    parser.add_argument(
        "--smoke", action="store_true", help="A few seconds' run: 40,000 characters, batch 64, 1 epoch, eps 8"
    )
    parser.add_argument("--device", type=str, default="cpu", help="Device")
    args = parser.parse_args()
    if args.smoke:
        args.corpus_chars, args.batch_size, args.epochs, args.epsilon = 40_000, 64, 1, 8.0
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")

    pieces = []
    for paragraph in stdlib_paragraphs(args.corpus_chars):
        pieces += [paragraph[i : i + args.max_length + 1] for i in range(0, len(paragraph), args.max_length)]
    pieces = [p for p in pieces if len(p) >= 2]
    order = np.random.default_rng(0).permutation(len(pieces))  # one fixed split for every seed
    n_test = int(len(pieces) * args.test_fraction)
    train_dataset = CharDataset([pieces[i] for i in order[n_test:]])
    test_dataset = CharDataset([pieces[i] for i in order[:n_test]])
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, collate_fn=collate)
    test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, collate_fn=collate, shuffle=False)

    model = CharLM().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)

    run_start = time.perf_counter()
    privacy_engine = PrivacyEngine()
    model, optimizer, criterion, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        criterion=example_losses,
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
    accuracy, perplexity = test(model, device, test_loader)
    epsilon = privacy_engine.get_epsilon(args.delta)
    run_s = time.perf_counter() - run_start

    most_common = torch.cat([e[1:] for e in train_dataset.examples]).bincount().argmax()
    test_labels = torch.cat([e[1:] for e in test_dataset.examples])
    result = {
        "script": "char_lm",
        "engine": PrivacyEngine.__module__.split(".")[0],
        "data": f"stdlib-docstrings-{args.corpus_chars}",
        "n_train": len(train_dataset),
        "n_test": len(test_dataset),
        "seed": args.seed,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "noise_multiplier": float(optimizer.noise_multiplier),
        "steps": len(step_times),
        "accuracy": accuracy,
        "perplexity": perplexity,
        "chance": 1.0 / VOCAB_SIZE,
        "majority_baseline": test_labels.eq(most_common).float().mean().item(),  # always the commonest character
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
