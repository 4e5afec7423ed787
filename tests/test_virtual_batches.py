"""Virtual batches: a logical batch processed as fixed-size micro-batches gives the unsplit update, for every
variant, with one noise release and one accounting step per logical batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastdp.algorithms import DPSGD, Batch
from fastdp.privacy.sampling import micro_batches, pad_batch
from fastdp.train.trainer import TrainConfig, Trainer
from tests.variants import VARIANT_NAMES, make_variant, small_model

N, FEATURES, CLASSES = 60_000, 12, 3


def _variant(name: str):
    return make_variant(name, 4096, N)


def _model(name: str) -> nn.Module:
    return small_model(name, FEATURES, CLASSES)


def _logical_batch(size: int) -> Batch:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size, FEATURES, generator=gen) * 2
    return Batch(x, torch.randint(0, CLASSES, (size,), generator=gen), torch.ones(size, dtype=torch.bool))


def _split(batch: Batch, size: int) -> list[Batch]:
    rows = torch.arange(batch.x.shape[0])
    return [Batch(batch.x[i], batch.y[i], batch.mask[i] & m) for i, m in micro_batches(rows, batch.mask, size)]


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_micro_batches_give_the_unsplit_update(name):
    """Acceptance: a logical batch of 4096 split into micro-batches of 256 (the last one padded here: 4000 rows)
    gives the unsplit update, noise included (same seed and step)."""
    batch = _logical_batch(4000 if name != "dpsgd-reference" else 1000)
    grads = []
    for pieces in ([batch], _split(batch, 256)):
        model, variant = _model(name), _variant(name)
        loss = variant.gradient(model, pieces if len(pieces) > 1 else pieces[0], step=3)
        grads.append(([p.grad.clone() for p in model.parameters()], loss))
    (whole, whole_loss), (split, split_loss) = grads
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(split_loss, whole_loss, rtol=1e-5, atol=1e-4)


def test_the_noise_is_released_once_per_logical_batch():
    """With zero gradients (all rows padding) the update is pure noise of std sigma C / (qN) per coordinate, the same
    whether one micro-batch or sixteen went in: noise is not added per micro-batch."""
    empty = Batch(torch.zeros(4096, FEATURES), torch.zeros(4096, dtype=torch.long), torch.zeros(4096, dtype=torch.bool))
    model, variant = _model("dpsgd"), DPSGD(1.0, 2.0, 0.1, 10_000, reproducible_seed=3)
    variant.gradient(model, _split(empty, 256), step=0)
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected = 2.0 * 1.0 / (0.1 * 10_000)
    assert abs(noise.std().item() / expected - 1) < 0.15, (noise.std().item(), expected)


def test_no_micro_batch_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        _variant("dpsgd").gradient(_model("dpsgd"), [], step=0)


def test_micro_batches_are_fixed_size_and_masked():
    indices = torch.tensor([5, 9, 2, 7, 1])
    pieces = micro_batches(indices, torch.ones(5, dtype=torch.bool), 2)
    assert [i.tolist() for i, _ in pieces] == [[5, 9], [2, 7], [1, 0]]
    assert [m.tolist() for _, m in pieces] == [[True, True], [True, True], [True, False]]
    (only,) = micro_batches(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), 4)
    assert only[1].tolist() == [False] * 4  # an empty Poisson batch still runs (its noise is released)
    padded, mask = pad_batch(indices, 4)  # --pad first, then micro-batches: padding stays masked
    assert [m.tolist() for _, m in micro_batches(padded, mask, 3)] == [[True] * 3, [True, True, False], [False] * 3]
    with pytest.raises(ValueError, match="micro-batch size"):
        micro_batches(indices, torch.ones(5, dtype=torch.bool), 0)


FAST = dict(
    dataset="breast_cancer", epochs=2, batch_size=128, lr=0.5, quiet=True, progress=False, reproducible_privacy_seed=0
)  # compared run against run: NOT FOR RELEASE keys


@pytest.mark.parametrize("variant", ["dpsgd", "nonprivate"])
def test_trainer_with_micro_batches_trains_like_without(variant):
    """In training the model never sees more than a micro-batch, and the run matches the unsplit one step for step: same
    parameters, same accountant."""
    extra = {"noise_multiplier": 1.0} if variant == "dpsgd" else {}
    plain = Trainer(TrainConfig(variant=variant, **FAST, **extra))
    virtual = Trainer(TrainConfig(variant=variant, micro_batch=32, **FAST, **extra))
    seen = []
    virtual.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]) if m.training else None)
    plain.run(), virtual.run()
    assert max(seen) == 32  # never more than a micro-batch (the row probe's removal run sees half of one)
    assert virtual.step == plain.step and virtual.accountant.steps == plain.accountant.steps == (
        plain.step if extra else 0
    )
    for a, b in zip(plain.model.parameters(), virtual.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_bad_micro_batch_is_refused():
    with pytest.raises(ValueError, match="micro-batch size must be an integer >= 1"):
        Trainer(TrainConfig(variant="nonprivate", micro_batch=0, **FAST))
