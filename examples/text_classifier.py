"""A Hugging Face transformers text classifier (BERT) trained with DP-SGD through fastdp's front door.

    python examples/text_classifier.py                          # a small random-init BERT, trained from scratch
    python examples/text_classifier.py --model-path ./my-bert   # local weights (from_pretrained; nothing downloaded)
    python examples/text_classifier.py --smoke                  # a few steps (the test suite runs this)

What it shows: an unmodified ``BertForSequenceClassification`` goes through ``make_private_with_epsilon`` as any
model does (its Linear, Embedding and LayerNorm layers become fastdp's DP layers in place; dropout stays on: each
example draws its own mask); keyword inputs (``input_ids``, ``attention_mask``) pass through the private model. The
loss is computed from the logits: do not pass ``labels=`` to the model, whose own loss fastdp refuses (it cannot
tell whether that loss is a sum of per-example losses; docs/front-door.md).

Data: generated here, not downloaded: short "movie reviews" made of filler words and a few sentiment words, labelled
by whether positive or negative words are in the majority. They are tokenised with a word-level vocabulary built
here, or with the tokenizer saved beside the weights when ``--model-path`` has one. ``--model-path`` takes any folder
``AutoModelForSequenceClassification.from_pretrained`` reads (BERT, RoBERTa and DistilBERT are tested with fastdp).

Prints the noise multiplier, then per epoch the mean training loss and epsilon so far, and at the end epsilon at
delta and the test accuracy.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine

POSITIVE = ["great", "good", "wonderful", "fun", "brilliant", "moving", "funny", "superb"]
NEGATIVE = ["bad", "boring", "awful", "dull", "weak", "tedious", "silly", "poor"]
FILLER = ["the", "movie", "film", "plot", "was", "and", "acting", "very", "really", "quite", "ending", "story", "but"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # BERT's special tokens, [PAD] = 0
VOCAB = SPECIALS + POSITIVE + NEGATIVE + FILLER  # the word-level vocabulary, id = position


def reviews(n: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """``n`` sentences of 6-20 words: filler plus 1 or 3 sentiment words; label 1 when most of them are positive."""
    texts, labels = [], []
    for _ in range(n):
        sentiment = [rng.choice(POSITIVE + NEGATIVE) for _ in range(rng.choice((1, 3)))]
        words = sentiment + [rng.choice(FILLER) for _ in range(rng.randint(5, 17))]
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(int(sum(w in POSITIVE for w in sentiment) * 2 > len(sentiment)))
    return texts, labels


def local_tokenizer(path: str):
    """The tokenizer saved beside the weights in ``path`` (``save_pretrained`` writes tokenizer_config.json), else
    None. (Asked for a folder without one, AutoTokenizer builds an empty tokenizer rather than failing.)"""
    if not (Path(path) / "tokenizer_config.json").is_file():
        return None
    return transformers.AutoTokenizer.from_pretrained(path)


def tokenize(texts: list[str], length: int, tokenizer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [n, length], padded: the tokenizer's when given, else the word vocabulary's
    ([CLS] words [SEP], padded with 0)."""
    if tokenizer is not None:
        encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        return encoded["input_ids"], encoded["attention_mask"]
    vocab = {w: i for i, w in enumerate(VOCAB)}
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        tokens = [vocab["[CLS]"], *(vocab.get(w, vocab["[UNK]"]) for w in text.split()), vocab["[SEP]"]][:length]
        ids[row, : len(tokens)] = torch.tensor(tokens)
    return ids, (ids != 0).long()


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
    n_train, length = (256 if args.smoke else 10_000), 24  # training reviews, tokens per review
    if args.smoke:
        args.epochs, args.batch_size = 1, 64

    torch.manual_seed(args.seed)  # the initial weights (and dropout); the noise and the batches come from OS entropy
    rng = random.Random(args.seed)
    texts, labels = reviews(n_train + 500, rng)
    if args.model_path:  # local files only: from_pretrained never downloads a local folder
        model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model_path, num_labels=2)
        tokenizer = local_tokenizer(args.model_path)
    else:  # a small BERT, random init, its config built directly. BERT's usual init (std 0.02) gives attention
        # gradients so small (1e-7 here) that the noise drowns them: trained from scratch under DP, a larger one learns.
        config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=length,
                                         num_labels=2, initializer_range=0.2)  # fmt: skip
        model, tokenizer = transformers.BertForSequenceClassification(config), None
    ids, mask = tokenize(texts, length, tokenizer)
    y = torch.tensor(labels)
    train_set = TensorDataset(ids[:n_train], mask[:n_train], y[:n_train])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(train_set, batch_size=args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    print(f"{n_train} training reviews, noise multiplier {optimizer.noise_multiplier:.3f}, {len(loader)} steps/epoch")

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for batch_ids, batch_mask, batch_y in loader:
            optimizer.zero_grad()
            logits = model(input_ids=batch_ids, attention_mask=batch_mask).logits
            loss = criterion(logits, batch_y)  # the mean over the batch's examples (fastdp.engine.DPLoss)
            loss.backward()
            optimizer.step()  # clip each example's gradient to 1, add the noise once, Adam's step, account
            if len(batch_y):
                losses.append(loss.item())
        print(f"epoch {epoch}: loss {sum(losses) / max(len(losses), 1):.4f}, "
              f"epsilon {engine.get_epsilon(args.delta):.2f}")  # fmt: skip

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids[n_train:], attention_mask=mask[n_train:]).logits
    accuracy = (logits.argmax(1) == y[n_train:]).float().mean().item()
    print(f"epsilon = {engine.get_epsilon(args.delta):.2f} at delta = {args.delta:g}; test accuracy = {accuracy:.4f}")


if __name__ == "__main__":
    main()
