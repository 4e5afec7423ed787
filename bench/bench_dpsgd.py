"""DP-SGD step time and memory: non-private torch vs Opacus (hooks, ghost) vs fastdp, side by side in one run.

One training step = forward, backward, clipping, noise, optimizer update, on the same model and batch
(random data of the workload's shape; seeds fixed). Reports the median step time (p20, p80), the ratio to
non-private, and on CUDA the peak memory and its ratio. Results are appended to bench/results/<device>-dpsgd.csv.

    python bench/bench_dpsgd.py                          # every workload
    python bench/bench_dpsgd.py --workloads mlp-256 cnn-256 --repeats 10
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path

import harness
import torch
from resnet import ResNet18GN
from torch import nn

from fastdp.algorithms import DPSGD
from fastdp.train.models import build_model

CLIP, SIGMA, LR = 1.0, 1.0, 0.01


class TokenTransformer(nn.Module):
    """Token-wise transformer block: embeddings, pre-norm attention (Linear projections) + MLP, mean-pooled head."""

    def __init__(self, vocab: int = 1000, d: int = 128, seq: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device).repeat(idx.shape[0], 1))
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1) @ v)
        x = x + self.fc2(torch.relu(self.fc1(self.norm2(x))))
        return self.head(x.mean(1))


class LastTokenLM(nn.Module):
    """A transformers causal LM, unmodified (its LM head over every position, tied to the token embedding; its own
    position ids and attention), read as a classifier: the first ``classes`` logits of the last position."""

    def __init__(self, lm: nn.Module, classes: int = 10) -> None:
        super().__init__()
        self.lm, self.classes = lm, classes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits[:, -1, : self.classes]


class Classifier(nn.Module):
    """A transformers sequence classifier's logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def gpt2(seq: int, lora_rank: int = 0) -> nn.Module:
    """GPT-2 2 x 128 (4 heads), vocabulary 1000, random init; with ``lora_rank`` frozen, with peft LoRA adapters on
    the attention and projection Conv1D layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=seq, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    lm = GPT2LMHeadModel(config)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = get_peft_model(lm, LoraConfig(r=lora_rank, target_modules=["c_attn", "c_proj"]))
    return LastTokenLM(lm)


def bert(seq: int) -> nn.Module:
    """BERT 2 x 128 (4 heads, MLP 512), vocabulary 1000, 10 classes, random init."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=seq, num_labels=10)  # fmt: skip
    return Classifier(BertForSequenceClassification(config))


class AttentionClassifier(nn.Module):
    """Token Embedding -> nn.MultiheadAttention (batch-first self-attention) -> mean over positions -> Linear."""

    def __init__(self, vocab: int = 1000, dim: int = 128, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))


class LSTMClassifier(nn.Module):
    """Token embeddings (64), one ``nn.LSTM`` (hidden 128, batch first), its last hidden state into a Linear head."""

    def __init__(self, vocab: int = 1000, d: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.tokens(idx))[0][:, -1])


def workloads() -> dict:
    """name -> (model factory, input factory(batch, generator), batch size)."""

    def images(shape):
        return lambda b, gen: torch.randn(b, *shape, generator=gen)

    def tokens(seq):
        return lambda b, gen: torch.randint(0, 1000, (b, seq), generator=gen)

    mlp = lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),  # noqa: E731
                                nn.Linear(512, 10))  # fmt: skip
    return {
        "mlp-256": (mlp, images((784,)), 256),
        "mlp-4096": (mlp, images((784,)), 4096),
        "cnn-256": (lambda: build_model("opacus_cnn", (1, 28, 28), 10), images((1, 28, 28)), 256),
        "transformer-T64": (lambda: TokenTransformer(seq=64), tokens(64), 64),
        "transformer-T512": (lambda: TokenTransformer(seq=512), tokens(512), 64),
        "resnet18gn-32": (ResNet18GN, images((3, 32, 32)), 32),  # CIFAR-10-shaped, 11.2M parameters
        "gpt2-T128": (lambda: gpt2(128), tokens(128), 32),
        "gpt2-lora-T128": (lambda: gpt2(128, lora_rank=8), tokens(128), 32),
        "bert-T128": (lambda: bert(128), tokens(128), 32),
        "mha-T32": (AttentionClassifier, tokens(32), 64),
        "lstm-T32": (LSTMClassifier, tokens(32), 64),
    }


def make_step(provider: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int | None = None):
    """A closure running one full training step of ``provider`` on (x, y); with ``micro_batch``, (x, y) is a logical
    batch processed as micro-batches of that many rows (Opacus: its skip-step protocol, as BatchMemoryManager)."""
    b = x.shape[0]
    pieces = harness.chunks(x, y, micro_batch)
    if provider == "nonprivate":
        return harness.nonprivate_step(model, x, y, LR, micro_batch)
    if provider == "fastdp":
        variant = DPSGD(CLIP, SIGMA, sample_rate=b / 60_000, num_examples=60_000)
        return harness.variant_step(variant, model, x, y, LR, micro_batch)
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.validators import ModuleValidator

    if not ModuleValidator.is_valid(model):  # nn.MultiheadAttention, nn.LSTM: Opacus' DP layers swapped in
        model = ModuleValidator.fix(model)

    if provider == "opacus-hooks":
        module = GradSampleModule(model)
        optimizer = DPOptimizer(torch.optim.SGD(module.parameters(), lr=LR), noise_multiplier=SIGMA,
                                max_grad_norm=CLIP, expected_batch_size=b)  # fmt: skip
        criterion = nn.CrossEntropyLoss()

        def step():
            for i, (xc, yc) in enumerate(pieces):  # zero_grad after a skipped step keeps the accumulated sum
                optimizer.zero_grad(set_to_none=True)
                optimizer.signal_skip_step(do_skip=i + 1 < len(pieces))
                criterion(module(xc), yc).backward()
                optimizer.step()

        return step
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    module = GradSampleModuleFastGradientClipping(model, max_grad_norm=CLIP, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(module.parameters(), lr=LR), noise_multiplier=SIGMA,
                                                max_grad_norm=CLIP, expected_batch_size=b)  # fmt: skip
    criterion = DPLossFastGradientClipping(module, optimizer, nn.CrossEntropyLoss(), "mean")

    def step():
        for i, (xc, yc) in enumerate(pieces):  # zero_grad after a skipped step keeps the accumulated sum
            optimizer.zero_grad(set_to_none=True)
            optimizer.signal_skip_step(do_skip=i + 1 < len(pieces))
            criterion(module(xc), yc).backward()
            optimizer.step()

    return step


PROVIDERS = ("nonprivate", "opacus-hooks", "opacus-ghost", "fastdp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", nargs="+", default=list(workloads()), choices=list(workloads()))
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per provider on CPU (interleaved)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    info = harness.run_info(device)
    device_name = info["device"]
    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = ""
        args.providers = [p for p in args.providers if not p.startswith("opacus")]
        print("opacus is not installed (pip install opacus): Opacus providers skipped", file=sys.stderr)
    print(f"opacus {opacus_version}")
    rows = []
    for name in args.workloads:
        factory, inputs, b = workloads()[name]
        gen = torch.Generator().manual_seed(0)
        x, y = inputs(b, gen).to(device), torch.randint(0, 10, (b,), generator=gen).to(device)
        builders = {}
        for provider in args.providers:
            torch.manual_seed(0)
            model = factory().to(device)
            per_sample_gb = b * sum(p.numel() for p in model.parameters()) * 4 / 2**30
            if provider == "opacus-hooks" and device.type == "cpu" and per_sample_gb > 4:
                print(f"{name:18s} {provider:13s} skipped: per-sample gradients would take {per_sample_gb:.1f} GiB "
                      "of this machine's memory", flush=True)  # fmt: skip
                continue
            builders[provider] = functools.partial(make_step, provider, model, x, y)
        results = harness.compare(builders, device, args.repeats, warmup=2)
        base_ms, base_mem = (results.get("nonprivate") or (None,) * 4)[0::3]
        for provider, result in results.items():
            if result is None:
                print(f"{name:18s} {provider:13s} out of memory", flush=True)
                continue
            med, p20, p80, peak = result
            ratio = med / base_ms if base_ms else float("nan")
            mem_ratio = peak / base_mem if base_mem else float("nan")
            rows.append(dict(workload=name, provider=provider, batch=b, median_ms=f"{med:.3f}", p20_ms=f"{p20:.3f}",
                             p80_ms=f"{p80:.3f}", time_vs_nonprivate=f"{ratio:.3f}", peak_mem_mb=f"{peak:.1f}",
                             mem_vs_nonprivate=f"{mem_ratio:.3f}", opacus=opacus_version, **info))  # fmt: skip
            print(f"{name:18s} {provider:13s} {med:10.2f} ms ({p20:.2f}, {p80:.2f})  x{ratio:5.2f} time  "
                  f"{peak:8.1f} MB  x{mem_ratio:5.2f} memory", flush=True)  # fmt: skip
    harness.write_rows(rows, args.out, f"{device_name}-dpsgd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
