"""Each row of a batch must be one example (privacy review, hole 5): a layer called on a [T, B, d] view passed the
"first dimension == batch size" check when T == B, and ghost mode then clipped per position (1.45-2.7 C measured);
a model that mixes examples passes any shape check. The row probe (fastdp.nn.rows) decides by experiment."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastdp.algorithms import Batch
from fastdp.nn import UnsupportedLayerError
from fastdp.nn import rows as rows_module
from tests.variants import make_variant, small_model

PRIVATE = ("dpsgd", "dpsgd-reference", "dpsgd-per-layer", "jl", "clipless", "weightclip", "backprop")


class SequenceFirst(nn.Module):
    """Linear applied on a [T, B, d] view, pooled over positions: per example in value, per position in layout."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(d, 16), nn.Linear(16, 3)
        self.head.requires_grad_(False)

    def forward(self, x):
        return self.head(self.lin(x.transpose(0, 1)).mean(0))


class Centred(nn.Module):
    """``model(x - x.mean(0))``: every example's output depends on the whole batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x - x.mean(0, keepdim=True))


def step(variant, model, x, y, index=0):
    variant.gradient(model, Batch(x, y, torch.ones(x.shape[0], dtype=torch.bool)), index)


@pytest.mark.parametrize("name", ["dpsgd", "jl", "backprop"])
def test_a_sequence_first_layer_with_as_many_positions_as_examples_is_refused(name):
    torch.manual_seed(3)
    x, y = torch.randn(4, 4, 8) * 3, torch.randint(0, 3, (4,))  # T == B == 4
    with pytest.raises(UnsupportedLayerError, match=r"lin \(.*input of shape \(4, 4, 8\)"):
        step(make_variant(name, 2.0, 8), SequenceFirst(), x, y)


@pytest.mark.parametrize("name", PRIVATE)
def test_a_model_that_mixes_examples_is_refused_by_every_private_variant(name):
    torch.manual_seed(0)
    model = Centred(small_model(name.split("-")[0], 6, 3))
    x, y = torch.rand(8, 6), torch.randint(0, 3, (8,))
    # clipless/weightclip may name the wrapper first: it has no Lipschitz bound rule (a refusal all the same)
    lipschitz = name in ("clipless", "weightclip")
    expected = "per-example losses|no Lipschitz bound rule" if lipschitz else "per-example losses"
    with pytest.raises(ValueError, match=expected):
        step(make_variant(name, 4.0, 64), model, x, y)


def test_the_non_private_baseline_is_not_probed(monkeypatch):
    calls = []
    monkeypatch.setattr(rows_module, "probe_rows", lambda *a: calls.append(a))
    model = Centred(small_model("nonprivate", 6, 3))
    step(make_variant("nonprivate", 4.0, 64), model, torch.rand(8, 6), torch.randint(0, 3, (8,)))
    assert calls == []


def test_batch_first_models_pass_and_are_probed_once_per_shape_signature(monkeypatch):
    probes = []
    real = rows_module.probe_rows
    monkeypatch.setattr(rows_module, "probe_rows", lambda *a: probes.append(a[2].shape) or real(*a))
    variant, model = make_variant("dpsgd", 4.0, 64), small_model("dpsgd", 6, 3)
    for index, batch in enumerate((8, 5, 9, 8, 5, 16)):  # 16 = the hidden size: a size seen inside the model
        step(variant, model, torch.rand(batch, 6), torch.randint(0, 3, (batch,)), index)
    assert [s[0] for s in probes] == [8, 16]
    model.eval()  # another mode: probed again
    step(variant, model, torch.rand(8, 6), torch.randint(0, 3, (8,)), 6)
    assert len(probes) == 3


def test_identical_examples_are_probed_on_random_inputs():
    variant, model = make_variant("dpsgd", 4.0, 64), Centred(small_model("dpsgd", 6, 3))
    same = torch.rand(1, 6).expand(4, 6).clone()  # four identical examples: nothing to compare in the batch itself
    with pytest.raises(UnsupportedLayerError, match="per-example losses"):
        step(variant, model, same, torch.zeros(4, dtype=torch.long))


class CentredTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(5, 4), nn.Linear(4, 3)

    def forward(self, idx):
        x = self.embedding(idx)
        return self.head((x - x.mean(0, keepdim=True)).mean(1))


def test_an_inconclusive_batch_is_probed_again():
    variant, model = make_variant("dpsgd", 4.0, 64), CentredTokens()
    zeros = torch.zeros(4, 3, dtype=torch.long)  # only token 0, in every example: no experiment can tell
    step(variant, model, zeros, torch.zeros(4, dtype=torch.long))
    with pytest.raises(UnsupportedLayerError, match="per-example losses"):
        step(variant, model, torch.randint(0, 5, (4, 3)), torch.zeros(4, dtype=torch.long), 1)


class SharedPositions(nn.Module):
    """Token embeddings plus position embeddings looked up with one [T] index shared by the batch (broadcast): with
    T == B the position layer's rows pass every shape check but are positions, and each row of its output gradient
    sums every example's."""

    def __init__(self, vocab: int = 20, positions: int = 6, d: int = 8, cls: bool = False) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(vocab, d), nn.Embedding(positions, d), nn.Linear(d, 3)
        self.positions, self.cls = positions, cls

    def forward(self, x):
        if self.cls:  # a per-example constant index, batch-first: [B, T], every row its example's own (valid)
            index = torch.arange(self.positions).expand(x.shape[0], self.positions)
        else:
            index = torch.arange(self.positions)
        return self.head((self.tok(x) + self.pos(index)).mean(1))


@pytest.mark.parametrize("name", ["dpsgd", "dpsgd-per-layer", "jl"])
def test_a_position_index_shared_by_as_many_examples_as_positions_is_refused(name):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (6, 6), generator=gen), torch.randint(0, 3, (6,), generator=gen)
    variant = make_variant(name, 3, 60)
    with pytest.raises(UnsupportedLayerError, match=r"pos \(Embedding\), output gradient"):
        variant.gradient(SharedPositions(), Batch(x, y, torch.ones(6, dtype=torch.bool)), 0)
    variant = make_variant(name, 3, 60)  # the same index expanded to [B, T]: rows are examples, it trains
    variant.gradient(SharedPositions(cls=True), Batch(x, y, torch.ones(6, dtype=torch.bool)), 0)


def test_the_front_door_refuses_a_shared_position_index_too():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (60, 6), generator=gen), torch.randint(0, 3, (60,), generator=gen)
    _front_door_step_is_refused(SharedPositions(), x, y, r"pos \(Embedding\), output gradient")


def _front_door_step_is_refused(model: nn.Module, x, y, match: str) -> None:
    """A front-door step on the first 6 examples (Opacus' ghost-clipping form) is refused, nothing accounted."""
    from torch.utils.data import DataLoader, TensorDataset

    from fastdp import PrivacyEngine

    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=1.0, max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    optimizer.zero_grad()
    criterion(model(x[:6]), y[:6]).backward()
    with pytest.raises(UnsupportedLayerError, match=match):
        optimizer.step()
    assert engine.accountant.steps == 0


class BroadcastPositions(nn.Module):
    """Position embeddings looked up with an index shared by the batch, as transformers models do: ``[1, T]``
    (``shape="row"``), ``[T]`` (``"flat"``), or ``[1, T]`` read back as ``pos[0]`` (``"first"``): once the lookup is
    expanded to the batch, row 0 is example 0's, and every example's gradient would flow through it."""

    def __init__(self, shape: str, vocab: int = 20, positions: int = 6, d: int = 8) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(vocab, d), nn.Embedding(positions, d), nn.Linear(d, 3)
        self.positions, self.shape = positions, shape

    def forward(self, x):
        index = torch.arange(x.shape[1])
        if self.shape == "flat":
            return self.head((self.tok(x) + self.pos(index)).mean(1))
        pos = self.pos(index.unsqueeze(0))
        return self.head((self.tok(x) + (pos[0] if self.shape == "first" else pos)).mean(1))


@pytest.mark.parametrize("shape", ["row", "flat"])
def test_a_position_index_shared_by_the_batch_gives_exact_per_example_sums(shape):
    """The shared index is expanded to the batch inside the Embedding: the position table's per-example gradients are
    each example's own (float64, against torch.func), with the [T] index too when T is not the batch size."""
    from fastdp.algorithms.base import per_example_cross_entropy
    from fastdp.algorithms.dpsgd import clipped_gradient_sum, ghost_clipped_gradient_sum
    from fastdp.nn import convert

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (5, 4), generator=gen), torch.randint(0, 3, (5,), generator=gen)
    batch = Batch(x, y, torch.ones(5, dtype=torch.bool))
    torch.manual_seed(0)
    model = BroadcastPositions(shape).double()
    expected, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.3)
    sums, _ = ghost_clipped_gradient_sum(convert(model), per_example_cross_entropy, batch, 0.3)
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-14)
    make_variant("dpsgd", 3, 60).gradient(model, batch, 0)  # the row probe accepts it


@pytest.mark.parametrize("name", ["dpsgd", "jl"])
def test_a_shared_lookup_read_back_through_one_row_is_refused(name):
    """``pos[0]`` of the expanded lookup: perturbing example 0 changes only row 0 (its own), so the probe also
    replaces the last example, whose gradient then shows up in row 0."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (5, 6), generator=gen), torch.randint(0, 3, (5,), generator=gen)
    with pytest.raises(UnsupportedLayerError, match=r"pos \(Embedding\), output gradient"):
        make_variant(name, 3, 60).gradient(BroadcastPositions("first"), Batch(x, y, torch.ones(5, dtype=torch.bool)), 0)


class BatchScaled(nn.Module):
    """The model's output divided by its batch size (``h / h.shape[0]``): under Poisson sampling that size is one
    example's presence, so removing example j rescales every other example's gradient. Before the removal experiment
    the probe passed it (no replacement changes the size): DP-SGD through the front door, example 0 against 999
    opposite ones each just under the clip, moved the release by 1.99 C."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x) / x.shape[0]


class _GradientOverBatch(torch.autograd.Function):
    """The identity, whose backward divides by the batch size: a dependence on the size in the backward alone."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / grad.shape[0]


class BackwardScaled(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(d, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(_GradientOverBatch.apply(torch.tanh(self.lin(x))))


@pytest.mark.parametrize("name", PRIVATE)
def test_a_model_that_reads_its_batch_size_is_refused_by_every_private_variant(name):
    torch.manual_seed(0)
    model = BatchScaled(small_model(name.split("-")[0], 6, 3))
    x, y = torch.rand(8, 6), torch.randint(0, 3, (8,))
    lipschitz = name in ("clipless", "weightclip")  # the wrapper has no Lipschitz bound rule: refused all the same
    expected = "removing the batch's last examples|no Lipschitz bound rule" if lipschitz else "removing the batch's"
    with pytest.raises(ValueError, match=expected):
        step(make_variant(name, 4.0, 64), model, x, y)


@pytest.mark.parametrize("name", ["dpsgd", "jl"])
def test_a_backward_that_reads_the_batch_size_is_refused(name):
    """The forward is each example's own; the backward divides by the batch size: the output gradients G show it."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError, match=r"removing the batch's last examples.*lin \(Linear\), output "):
        step(make_variant(name, 4.0, 64), BackwardScaled(), torch.rand(8, 6), torch.randint(0, 3, (8,)))


def test_the_removal_experiment_keeps_a_size_not_seen_inside_the_model(monkeypatch):
    """A shared [T] position index with T = B / 2 would pass for the examples' rows on B / 2 examples: the experiment
    keeps fewer examples instead (the first size from B / 2 down not seen inside the model), and the model passes."""
    kept = []
    real = rows_module._first_rows
    monkeypatch.setattr(rows_module, "_first_rows", lambda run, k: kept.append(k) or real(run, k))
    model = BroadcastPositions("flat", positions=5)
    x, y = torch.randint(0, 20, (10, 5)), torch.randint(0, 3, (10,))  # T = 5 = B / 2; d = 8, 3 classes
    step(make_variant("dpsgd", 4.0, 64), model, x, y)
    assert kept == [4]


def test_the_front_door_refuses_a_model_that_reads_its_batch_size():
    torch.manual_seed(0)
    model = BatchScaled(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    x, y = torch.rand(12, 6), torch.randint(0, 3, (12,))
    _front_door_step_is_refused(model, x, y, "removing the batch's last examples changed")


class NoisyScaled(nn.Module):
    """Random draws in training (a Dropout layer, or a hand-drawn mask): where each draw lands in the generator's
    stream depends on the batch's size, so the removal run compares with the rates at 0, or in evaluation mode."""

    def __init__(self, mask: str, scaled: bool) -> None:
        super().__init__()
        self.lin, self.head, self.drop = nn.Linear(6, 16), nn.Linear(16, 3), nn.Dropout(0.3)
        self.mask, self.scaled = mask, scaled

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.mask == "layer":
            h = self.drop(h)
        elif self.training:
            h = h * (torch.rand_like(h) > 0.3)
        h = self.head(h)
        return h / x.shape[0] if self.scaled else h


@pytest.mark.parametrize("mask", ["layer", "drawn"])
@pytest.mark.parametrize("scaled", [False, True])
def test_random_draws_neither_hide_a_batch_size_nor_fail_the_removal_run(mask, scaled):
    torch.manual_seed(0)
    x, y = torch.rand(8, 6), torch.randint(0, 3, (8,))
    if scaled:
        with pytest.raises(UnsupportedLayerError, match="removing the batch's last examples"):
            step(make_variant("dpsgd", 4.0, 64), NoisyScaled(mask, scaled), x, y)
    else:
        step(make_variant("dpsgd", 4.0, 64), NoisyScaled(mask, scaled), x, y)


class FaintMixing(nn.Module):
    """``h + 1e-12 h.sum(0)``, detached: on ordinary inputs a change below any tolerance (the probe passed it on the
    first batch), but a later batch's extreme example (-1e13) moved every other example: 85 C at n = 64 (review)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        h = h + 1e-12 * h.sum(0, keepdim=True).detach()
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("name", ["dpsgd", "jl"])  # (backprop clips each layer's input rows: no extreme row there)
def test_mixing_too_faint_for_ordinary_inputs_is_refused_on_the_first_batch(name):
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError, match="changing example 0 alone changed other rows"):
        step(make_variant(name, 4.0, 64), FaintMixing(), torch.rand(8, 6), torch.randint(0, 3, (8,)))
