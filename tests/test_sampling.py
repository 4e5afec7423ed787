"""Poisson and shuffle samplers, padding to fixed physical batches."""

import pytest
import torch
from scipy import stats

from fastdp.privacy.sampling import PoissonSampler, ShuffleSampler, pad_batch, physical_batch_size

P_REJECT = 1e-6


def test_poisson_inclusion_frequency_is_q():
    n, q, steps = 500, 0.03, 400
    sampler = PoissonSampler(n, q, reproducible_seed=1)
    counts = torch.zeros(n)
    sizes = []
    for _ in range(steps):
        batch = sampler.sample()
        counts[batch] += 1
        sizes.append(batch.numel())
        assert torch.equal(batch, batch.unique()), "an example appears at most once per batch"
    total = int(counts.sum())
    assert stats.binomtest(total, n * steps, q).pvalue > P_REJECT
    # each example is included independently: per-example counts are Binomial(steps, q), variance steps q (1 - q)
    assert counts.var().item() == pytest.approx(steps * q * (1 - q), rel=0.3)
    assert len(set(sizes)) > 5, "Poisson batch sizes vary"


def test_poisson_batches_can_be_empty_and_epoch_length_is_one_over_q():
    sampler = PoissonSampler(10, 0.01)
    assert len(sampler) == 100
    assert sampler.expected_batch_size == pytest.approx(0.1)
    assert any(b.numel() == 0 for b in sampler)


def test_poisson_is_reproducible_and_resumable_with_a_reproducible_seed():
    a, b = PoissonSampler(100, 0.1, reproducible_seed=3), PoissonSampler(100, 0.1, reproducible_seed=3)
    first = [a.sample() for _ in range(5)]
    assert all(torch.equal(x, b.sample()) for x in first)
    state = a.state_dict()
    ahead = [a.sample() for _ in range(3)]
    c = PoissonSampler(100, 0.1, reproducible_seed=99)
    c.load_state_dict(state)
    assert all(torch.equal(x, c.sample()) for x in ahead)
    with pytest.raises(ValueError, match="OS-entropy draws"):  # an OS-entropy sampler's state into a seeded one
        c.load_state_dict(PoissonSampler(100, 0.1).state_dict())


def test_poisson_draws_from_os_entropy_by_default():
    sampler, other = PoissonSampler(10_000, 0.5), PoissonSampler(10_000, 0.5)
    assert not sampler.reproducible and sampler.generator is None
    a, b = sampler.sample(), sampler.sample()
    assert not torch.equal(a, b) and not torch.equal(a, other.sample())  # two default samplers: different batches
    assert abs(a.numel() - 5000) < 5 * (10_000 * 0.25) ** 0.5
    assert sampler.state_dict() == {"kind": "poisson"}  # nothing to save or replay


def test_shuffle_sampler_fixed_size_each_example_once_per_epoch():
    sampler = ShuffleSampler(103, 10, seed=0)
    batches = list(sampler)
    assert len(batches) == 10 and all(b.numel() == 10 for b in batches)
    assert torch.cat(batches).unique().numel() == 100
    state = sampler.state_dict()
    nxt = sampler.sample()
    other = ShuffleSampler(103, 10, seed=5)
    other.load_state_dict(state)
    assert torch.equal(other.sample(), nxt)


def test_pad_batch_masks_padding():
    idx = torch.tensor([4, 7, 9])
    padded, mask = pad_batch(idx, 4)
    assert padded.tolist() == [4, 7, 9, 0] and mask.tolist() == [True, True, True, False]
    padded, mask = pad_batch(torch.zeros(0, dtype=torch.int64), 4)
    assert padded.numel() == 4 and not mask.any()
    padded, mask = pad_batch(torch.arange(9), 4)  # overflow grows to the next multiple, never truncates
    assert padded.numel() == 12 and int(mask.sum()) == 9


def test_physical_batch_size_covers_the_binomial_tail():
    b = physical_batch_size(60_000, 256 / 60_000)
    assert 256 < b < 400
    assert stats.binom.sf(b, 60_000, 256 / 60_000) <= 1e-9


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: PoissonSampler(0, 0.1), "at least one example"),
        (lambda: PoissonSampler(10, 0.0), r"\(0, 1\]"),
        (lambda: PoissonSampler(10, 1.5), r"\(0, 1\]"),
        (lambda: PoissonSampler(10, 0.5, reproducible_seed=-1), "reproducible_seed must be None"),
        (lambda: PoissonSampler(10, 0.5, reproducible_seed=1.5), "reproducible_seed must be None"),
        (lambda: ShuffleSampler(10, 11), "batch size"),
        (lambda: pad_batch(torch.arange(3), 0), ">= 1"),
    ],
)
def test_sampler_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()
