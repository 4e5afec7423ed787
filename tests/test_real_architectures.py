"""Real architectures, unmodified: Hugging Face GPT-2 (tied embeddings, ``Conv1D``, the default attention, its own
position ids), BERT, RoBERTa and DistilBERT classifiers, and ResNet-18-GN. Per-example clipped sums equal
``torch.func``'s in float64 through ``fastdp.nn.convert`` and through the front door, and DP-SGD-JL trains each.
Random-init configurations (nothing is downloaded), dropout off where sums are compared (vmap and the batch draw
different masks)."""

from __future__ import annotations

import copy
import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.algorithms.base import Batch
from fastdp.algorithms.dpsgd import clipped_gradient_sum
from fastdp.nn import TransposedLinear
from fastdp.ops.summation import clip_bound
from tests.variants import assert_ghost_is_reference

transformers = pytest.importorskip("transformers")
VOCAB, T, B = 17, 6, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
             max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             num_labels=3)  # fmt: skip


class CausalLM(nn.Module):
    """GPT-2 as a user fine-tunes it: ``GPT2LMHeadModel`` as built (tied ``wte``/``lm_head``, ``Conv1D``, the default
    attention, position ids made inside), logits of every position; the loss is each example's next-token loss."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                         bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-example mean next-token cross entropy (the labels are the inputs, shifted)."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _class_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def _bench(module: str):
    """A module of bench/ (its models: ``bench_dpsgd.Classifier``, ``resnet.ResNet18GN``)."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(module)


def _build(arch: str) -> tuple[nn.Module, object]:
    """(model, per-example loss(output, target)) of ``arch``, random init."""
    if arch == "gpt2":
        return CausalLM(), _next_token_loss
    classifier = _bench("bench_dpsgd").Classifier
    if arch == "bert":
        return classifier(transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL))), _class_loss
    if arch == "roberta":
        config = transformers.RobertaConfig(**SMALL, pad_token_id=1)
        return classifier(transformers.RobertaForSequenceClassification(config)), _class_loss
    if arch == "distilbert":
        config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=8, n_layers=1, n_heads=2, hidden_dim=12,
                                               max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                               seq_classif_dropout=0.0, num_labels=3)  # fmt: skip
        return classifier(transformers.DistilBertForSequenceClassification(config)), _class_loss
    if arch == "mha":  # nn.MultiheadAttention as built (batch-first self-attention)
        return _bench("bench_dpsgd").AttentionClassifier(vocab=VOCAB, dim=8, heads=2, classes=3), _class_loss
    if arch == "lstm":  # nn.LSTM as built (oneDNN's fused kernel outside a DP step)
        return _bench("bench_dpsgd").LSTMClassifier(vocab=VOCAB, d=6, hidden=5, classes=3), _class_loss
    return _bench("resnet").ResNet18GN(classes=3), _class_loss


def _data(arch: str, b: int = B, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if arch == "resnet18gn":
        return torch.randn(b, 3, 8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen)
    ids = torch.randint(2, VOCAB, (b, T), generator=gen)
    return ids, ids if arch == "gpt2" else torch.randint(0, 3, (b,), generator=gen)


def _clipped_reference(arch: str, model: nn.Module, loss_fn, batch: Batch, clip: float) -> list[torch.Tensor]:
    """The clipped per-example gradients' sums of the unconverted model: torch.func's (``clipped_gradient_sum``), or
    for the LSTM, whose fused kernel torch.func cannot vmap, one example at a time by autograd."""
    if arch != "lstm":
        return clipped_gradient_sum(copy.deepcopy(model), loss_fn, batch, clip)[0]
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(loss_fn(model(batch.x[i : i + 1]), batch.y[i : i + 1]).sum(), params)
            for i in range(batch.x.shape[0])]  # fmt: skip
    grads = [torch.stack(g) for g in zip(*rows, strict=True)]
    factors = (clip / (sum(g.flatten(1).pow(2).sum(1) for g in grads).sqrt() + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any()  # some examples clipped
    return [torch.einsum("b,b...->...", factors, g) for g in grads]


ARCHS = ["gpt2", "bert", "roberta", "distilbert", "resnet18gn", "mha", "lstm"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*batching rule.*")  # torch.func over SDPA on CPU
        yield


@pytest.mark.parametrize("arch", ARCHS)
def test_clipped_sums_of_unmodified_models_equal_torch_func_in_float64(arch):
    torch.manual_seed(0)
    model, loss_fn = _build(arch)
    model = model.double()
    x, y = _data(arch)
    batch = Batch(x, y, torch.ones(x.shape[0], dtype=torch.bool))
    expected = _clipped_reference(arch, model, loss_fn, batch, 0.5)
    assert_ghost_is_reference(model, batch, 0.5, loss_fn, atol=1e-12, expected=expected)  # norms rounded up by gamma_n
    if arch == "gpt2":  # nothing was changed by hand: tied, Conv1D, SDPA
        lm = model.lm
        assert lm.lm_head.weight is lm.transformer.wte.weight and lm.config._attn_implementation == "sdpa"
        assert sum(isinstance(m, TransposedLinear) for m in model.modules()) == 8


def _front_door(model: nn.Module, x, y, loss_fn, variant: str = "dpsgd", sigma: float = 0.0):
    """(private model, optimizer, DP criterion of ``loss_fn``'s per-example losses, summed) from make_private."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
    extra = {"max_grad_norm": 0.5} if variant == "dpsgd" else {"max_grad_norm": 0.5, "projections": 4}
    private, optimizer, criterion, _ = PrivacyEngine(accountant="rdp" if variant == "dpsgd" else "pld").make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, variant=variant,
        loss_reduction="sum", reproducible_seed=1, criterion=loss_fn, grad_sample_mode="ghost", **extra,
    )  # fmt: skip
    return private, optimizer, criterion


@pytest.mark.parametrize("arch", ARCHS)
def test_the_front_door_releases_torch_funcs_clipped_sum_in_float64(arch):
    """No noise, summed loss, lr 1: the update is the clipped sum itself, computed from the user's own loop."""
    torch.manual_seed(0)
    model, loss_fn = _build(arch)
    model = model.double()
    x, y = _data(arch)
    clip = clip_bound(0.5, B)  # the front door clips at C' = C / (1 + s) (fastdp.ops.summation), N = B here
    expected = _clipped_reference(arch, model, loss_fn, Batch(x, y, torch.ones(B, dtype=torch.bool)), clip)
    private, optimizer, criterion = _front_door(model, x, y, loss_fn)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    criterion(private(x), y).backward()
    optimizer.step()
    for p, old, e in zip(model.parameters(), before, expected, strict=True):
        torch.testing.assert_close(old - p.detach(), e, rtol=1e-10, atol=1e-12)  # norms rounded up by gamma_n


@pytest.mark.parametrize("arch", ARCHS)
def test_jl_trains_every_architecture_through_the_front_door(arch):
    torch.manual_seed(0)
    model, loss_fn = _build(arch)
    x, y = _data(arch, b=6)
    x = x.float() if x.is_floating_point() else x
    private, optimizer, criterion = _front_door(model, x, y, loss_fn, variant="jl", sigma=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        optimizer.zero_grad()
        criterion(private(x), y).backward()
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(p.detach(), old) for p, old in zip(model.parameters(), before, strict=True))


def test_gpt2_with_dropout_trains_through_the_front_door():
    """Dropout on (training mode): each example's own mask; the row probe passes and steps release."""
    torch.manual_seed(0)
    model = CausalLM(dropout=0.1)
    x, y = _data("gpt2", b=8)
    private, optimizer, criterion = _front_door(model, x, y, _next_token_loss, sigma=1.0)
    for _ in range(2):
        optimizer.zero_grad()
        criterion(private(x), y).backward()
        optimizer.step()
    assert optimizer.steps_taken == 2
