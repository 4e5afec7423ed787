"""Batch samplers: Poisson subsampling (what the accountants assume) and, by explicit choice, shuffling.

Poisson sampling includes each of the N examples independently with probability q
at every step, so batch sizes vary (Binomial(N, q)) and may be empty. Everything that
scales by a batch size uses the *expected* size q*N, never the realised one (the
realised size depends on the data set and would leak). For kernels and
``torch.compile`` that want fixed shapes, :func:`pad_batch` pads the index list to a
multiple of a physical batch size and returns a mask: padded rows repeat example 0
and must be given weight 0 (they then contribute nothing to gradients or norms).
"""

from __future__ import annotations

import abc
import math
import os

import numpy as np
import torch

from fastdp.privacy.rng import check_reproducible_seed

__all__ = ["PoissonSampler", "Sampler", "ShuffleSampler", "micro_batches", "pad_batch", "physical_batch_size"]


def _check_count(num_examples: int) -> None:
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
        raise ValueError(f"the data set must have at least one example, got {num_examples}")


class Sampler(abc.ABC):
    """An epoch of ``steps_per_epoch`` batches, each from :meth:`sample` (sorted int64 indices)."""

    steps_per_epoch: int

    @abc.abstractmethod
    def sample(self) -> torch.Tensor:
        """One batch of example indices."""

    def __iter__(self):
        for _ in range(self.steps_per_epoch):
            yield self.sample()

    def __len__(self) -> int:
        return self.steps_per_epoch


class PoissonSampler(Sampler):
    """Index batches of a data set of ``num_examples`` under Poisson sampling with rate ``sample_rate``.

    One epoch is ``steps_per_epoch`` steps (default ``round(1 / q)``, so an epoch sees N
    examples in expectation). By default every inclusion is drawn from the OS entropy source
    (a 53-bit uniform from ``os.urandom`` per example per step): the batches cannot be
    replayed or predicted. ``reproducible_seed`` (NOT FOR RELEASE: whoever knows it knows
    every batch) fixes the draws instead (``torch.Generator``, saved by :meth:`state_dict`).
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        reproducible_seed: int | None = None,
    ) -> None:
        _check_count(num_examples)
        if not (0.0 < sample_rate <= 1.0):
            raise ValueError(f"sample rate q must be in (0, 1], got {sample_rate}; q = expected batch size / N")
        self.num_examples = num_examples
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = steps_per_epoch or max(1, round(1.0 / self.sample_rate))
        if self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self.reproducible_seed = check_reproducible_seed(reproducible_seed)
        self.generator = None if self.reproducible_seed is None else torch.Generator().manual_seed(reproducible_seed)

    @property
    def reproducible(self) -> bool:
        """Whether the batches come from the seeded generator (else from OS entropy)."""
        return self.reproducible_seed is not None

    @property
    def expected_batch_size(self) -> float:
        """q * N: the divisor of the noisy gradient sum."""
        return self.sample_rate * self.num_examples

    def sample(self) -> torch.Tensor:
        """One Poisson batch: sorted int64 indices, possibly empty."""
        if not self.reproducible:
            words = np.frombuffer(os.urandom(8 * self.num_examples), dtype=np.uint64)
            uniform = (words >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53-bit uniforms in [0, 1)
            return torch.from_numpy(np.flatnonzero(uniform < self.sample_rate).astype(np.int64))
        included = torch.rand(self.num_examples, generator=self.generator, dtype=torch.float64) < self.sample_rate
        return torch.nonzero(included).reshape(-1)

    def state_dict(self) -> dict:
        """The seeded generator's state; an OS-entropy sampler has none to save (a resumed run draws afresh)."""
        if not self.reproducible:
            return {"kind": "poisson"}
        return {"kind": "poisson", "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "poisson":
            raise ValueError(f"sampler state is for a {state.get('kind')!r} sampler, not a Poisson sampler")
        if ("generator" in state) != self.reproducible:
            raise ValueError(
                "sampler state is for a Poisson sampler with "
                + ("a reproducible seed" if "generator" in state else "OS-entropy draws")
                + ", but this sampler "
                + ("has a reproducible seed" if self.reproducible else "draws from OS entropy")
            )
        if self.reproducible:
            self.generator.set_state(state["generator"])


class ShuffleSampler(Sampler):
    """Fixed-size batches from a fresh permutation each epoch (the last partial batch is dropped).

    Not what the accountants analyse: an epsilon reported for a run with this sampler
    assumes Poisson sampling, and the report says so. Use only when asked for explicitly.
    """

    assumes_poisson = True

    def __init__(self, num_examples: int, batch_size: int, seed: int = 0) -> None:
        _check_count(num_examples)
        if not 1 <= batch_size <= num_examples:
            raise ValueError(f"batch size must be in [1, {num_examples}], got {batch_size}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.sample_rate = batch_size / num_examples
        self.steps_per_epoch = num_examples // batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._pending: list[torch.Tensor] = []

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def sample(self) -> torch.Tensor:
        if not self._pending:
            order = torch.randperm(self.num_examples, generator=self.generator)
            self._pending = list(order[: self.steps_per_epoch * self.batch_size].split(self.batch_size))[::-1]
        return self._pending.pop().sort().values

    def state_dict(self) -> dict:
        return {"kind": "shuffle", "generator": self.generator.get_state(), "pending": list(self._pending)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "shuffle":
            raise ValueError(f"sampler state is for a {state.get('kind')!r} sampler, not a shuffle sampler")
        self.generator.set_state(state["generator"])
        self._pending = list(state["pending"])


def physical_batch_size(num_examples: int, sample_rate: float, overflow_probability: float = 1e-9) -> int:
    """Smallest size b with P(Binomial(N, q) > b) <= overflow_probability: a fixed shape to pad to.

    A batch larger than b is not truncated (that would change the sampling the accountant
    assumes): :func:`pad_batch` pads it to the next multiple of b instead.
    """
    from scipy import stats

    _check_count(num_examples)
    return max(1, int(stats.binom.isf(overflow_probability, num_examples, sample_rate)) + 1)


def pad_batch(indices: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ``indices`` to a positive multiple of ``multiple``; returns (indices, mask of real rows).

    Padded rows repeat index 0 (any valid example) and have mask ``False``: give them
    weight 0. An empty batch becomes ``multiple`` padded rows.
    """
    if multiple < 1:
        raise ValueError(f"physical batch size must be >= 1, got {multiple}")
    size = max(1, math.ceil(indices.numel() / multiple)) * multiple
    padded = torch.zeros(size, dtype=torch.int64)
    padded[: indices.numel()] = indices
    mask = torch.zeros(size, dtype=torch.bool)
    mask[: indices.numel()] = True
    return padded, mask


def micro_batches(indices: torch.Tensor, mask: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a logical batch (``indices`` and ``mask`` of its real rows) into micro-batches of exactly ``size`` rows,
    the last padded as by :func:`pad_batch`: fixed shapes, so peak memory does not grow with the logical batch.
    An empty logical batch gives one all-padding micro-batch (the step still releases its noise)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"micro-batch size must be an integer >= 1, got {size!r}")
    if mask.shape != indices.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and mask {tuple(mask.shape)} must have one shape")
    padded, real = pad_batch(indices, size)
    real[: mask.numel()] &= mask.to(torch.bool)
    return list(zip(padded.split(size), real.split(size), strict=True))
