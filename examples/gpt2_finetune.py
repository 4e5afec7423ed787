"""GPT-2 causal language model fine-tuned with DP-SGD through fastdp's front door.

    python examples/gpt2_finetune.py                            # a small random-init GPT-2, trained from scratch
    python examples/gpt2_finetune.py --model-path ./my-gpt2     # local weights (from_pretrained; nothing downloaded)
    python examples/gpt2_finetune.py --smoke                    # a few steps (the test suite runs this)

What it shows: an unmodified ``GPT2LMHeadModel`` (tied input and output embeddings, Hugging Face's ``Conv1D``
layers, its own position ids) made private with ``make_private_with_epsilon``; and the loss a causal LM needs under
DP: each example's own mean next-token loss, then the mean over examples. The usual token-level loss (one mean over
every token of the batch, or ``model(labels=...).loss``) is not a sum of per-example losses: its divisor counts the
other examples' tokens. fastdp refuses the model's own loss, and cannot see a loss you write, so write it this way.

Data: generated here, not downloaded: sentences such as "alice bought three pears so alice has three pears ." whose
second half repeats the first (a model can learn to copy), of varying length (padded; padding is masked out of the
loss). They are tokenised with a word-level vocabulary built here, or with the tokenizer saved beside the weights
when ``--model-path`` has one.

Prints the noise multiplier, the test loss before training, per epoch the training loss and epsilon so far, and at
the end epsilon at delta, the test loss per token and its perplexity.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch
import transformers
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank"]
COUNTS = ["one", "two", "three", "four", "five", "six"]
FRUITS = ["apples", "pears", "plums", "figs", "limes"]
WORDS = ["<pad>", "<unk>", "bought", "found", "so", "now", "has", "had", "."] + NAMES + COUNTS + FRUITS


def sentences(n: int, rng: random.Random) -> list[str]:
    """``n`` sentences "<name> <verb> <count> <fruit> so <name> <has> <count> <fruit> .", some with a second
    clause: the second half of each clause repeats its first."""
    out = []
    for _ in range(n):
        clauses = []
        for _ in range(rng.choice((1, 1, 2))):
            name, count, fruit = rng.choice(NAMES), rng.choice(COUNTS), rng.choice(FRUITS)
            verb, has = rng.choice((("bought", "has"), ("found", "had")))
            clauses.append(f"{name} {verb} {count} {fruit} so {name} {has} {count} {fruit}")
        out.append(" now ".join(clauses) + " .")
    return out


def local_tokenizer(path: str):
    """The tokenizer saved beside the weights in ``path`` (``save_pretrained`` writes tokenizer_config.json), else
    None. (Asked for a folder without one, AutoTokenizer builds an empty tokenizer rather than failing.)"""
    if not (Path(path) / "tokenizer_config.json").is_file():
        return None
    return transformers.AutoTokenizer.from_pretrained(path)


def tokenize(texts: list[str], length: int, tokenizer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [n, length], right-padded; the tokenizer's when given, else the word vocabulary."""
    if tokenizer is not None:
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # GPT-2's tokenizer has no padding token
        encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        return encoded["input_ids"], encoded["attention_mask"]
    vocab = {w: i for i, w in enumerate(WORDS)}
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        tokens = [vocab.get(w, 1) for w in text.split()][:length]
        ids[row, : len(tokens)] = torch.tensor(tokens)
    return ids, (ids != 0).long()


def per_example_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each example's mean next-token cross entropy over its own real tokens: a vector [batch]."""
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    real = mask[:, 1:].to(per_token.dtype)
    return (per_token * real).sum(1) / real.sum(1).clamp(min=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="a local folder with weights (and optionally a tokenizer)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=512, help="EXPECTED batch size (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="the generated data and the initial weights")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a small data set")
    args = parser.parse_args()
    n_train, length = (256 if args.smoke else 10_000), 24  # training sentences, tokens per sentence
    if args.smoke:
        args.epochs, args.batch_size = 1, 64

    torch.manual_seed(args.seed)  # the initial weights (and dropout); the noise and the batches come from OS entropy
    texts = sentences(n_train + 500, random.Random(args.seed))
    if args.model_path:  # local files only: from_pretrained never downloads a local folder
        model = transformers.GPT2LMHeadModel.from_pretrained(args.model_path)
        tokenizer = local_tokenizer(args.model_path)
    else:  # a small GPT-2, random init, its config built directly (a larger init std than GPT-2's 0.02: the noise
        # drowns the tiny attention gradients of that init when training from scratch)
        config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=length, n_embd=32, n_layer=2, n_head=4,
                                         bos_token_id=0, eos_token_id=0, initializer_range=0.2)  # fmt: skip
        model, tokenizer = transformers.GPT2LMHeadModel(config), None
    ids, mask = tokenize(texts, length, tokenizer)
    train_set = TensorDataset(ids[:n_train], mask[:n_train])

    def test_loss() -> float:
        model.eval()
        with torch.no_grad():
            return per_example_loss(model(input_ids=ids[n_train:], attention_mask=mask[n_train:]).logits,
                                    ids[n_train:], mask[n_train:]).mean().item()  # fmt: skip

    before = test_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(train_set, batch_size=args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=1.0,
        criterion=per_example_loss, grad_sample_mode="ghost",
    )  # fmt: skip
    print(f"{n_train} training sentences, noise multiplier {optimizer.noise_multiplier:.3f}, {len(loader)} steps per "
          f"epoch; test loss before training {before:.3f}")  # fmt: skip

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for batch_ids, batch_mask in loader:
            optimizer.zero_grad()
            logits = model(input_ids=batch_ids, attention_mask=batch_mask).logits  # no labels=: our own loss
            loss = criterion(logits, batch_ids, batch_mask)  # the mean over the batch's examples (DPLoss)
            loss.backward()
            optimizer.step()  # clip each example's gradient to 1, add the noise once, Adam's step, account
            if len(batch_ids):
                losses.append(loss.item())
        print(f"epoch {epoch}: loss {sum(losses) / max(len(losses), 1):.4f}, "
              f"epsilon {engine.get_epsilon(args.delta):.2f}")  # fmt: skip

    after = test_loss()
    print(f"epsilon = {engine.get_epsilon(args.delta):.2f} at delta = {args.delta:g}; test loss = {after:.3f} per "
          f"token (perplexity {math.exp(after):.2f}; before training {before:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
