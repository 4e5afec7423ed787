"""The front door's data loader: Poisson batches from any map-style data set, through the user's ``collate_fn``.

Opacus' ``DPDataLoader`` semantics: each example joins each batch independently with probability
``q = batch_size / len(dataset)`` (the sample rate the accountant analyses); an epoch is ``len(loader)`` steps of the
original loader (about N / batch_size); batches have random size, and may be empty. The inclusions come from
:class:`fastdp.privacy.PoissonSampler`: OS entropy by default, a seeded generator only on an explicit request
(``reproducible_seed``, NOT FOR RELEASE).

An empty batch is collated from one example's structure with every tensor cut to zero rows (and every list to no
element), so a model, a loss and ``loss.backward()`` run on it as on any batch and the step still releases noise (a
skipped step would reveal that the sample was empty). The structure comes from ``dataset[0]``: its shapes and dtypes,
never its values, reach the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from fastdp.privacy.sampling import PoissonSampler


def empty_like_batch(batch):
    """``batch`` (a collated structure: tensors, lists, tuples, dicts, anything else) with every tensor cut to its
    first zero rows and every list or tuple of non-tensors emptied: a well-formed batch of no example."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)({k: empty_like_batch(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(empty_like_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch):
            return type(batch)(empty_like_batch(v) for v in batch)
        return type(batch)()  # a collated list of strings, ids, ...: one entry per example
    return batch


class _BatchSampler:
    """Batches of dataset indices from a :class:`PoissonSampler`, ``steps_per_epoch`` per epoch; data-parallel
    (``parallel``), this rank's shard of each global sample (rank 0 draws an OS-entropy sample and broadcasts it)."""

    def __init__(self, sampler: PoissonSampler, parallel=None) -> None:
        self.sampler = sampler if parallel is None else parallel.shared_sampler(sampler)
        self.parallel = parallel

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch

    def __iter__(self):
        for _ in range(self.sampler.steps_per_epoch):
            indices = self.sampler.sample()
            yield (indices if self.parallel is None else self.parallel.shard(indices)).tolist()


class _Counted(NamedTuple):
    """A collated batch with its number of examples: counted in the main process as it is yielded (a NamedTuple, so
    that workers pickle it and pin_memory pins the batch inside)."""

    examples: int
    batch: Any


class DPDataLoader(DataLoader):
    """A ``DataLoader`` of Poisson batches with expected size ``sample_rate * len(dataset)``; see the module
    docstring. Built by :meth:`from_data_loader` (what ``PrivacyEngine.make_private`` does with the user's loader)."""

    def __init__(
        self,
        dataset: Dataset,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        collate_fn=None,
        reproducible_seed: int | None = None,
        parallel=None,
        **loader_kwargs,
    ) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ValueError(
                f"the private data loader samples from a map-style data set (with __getitem__ and __len__), got "
                f"{type(dataset).__name__}: Poisson sampling includes each example independently, which an "
                "iterable-style data set cannot do; load it into a map-style data set (e.g. a TensorDataset)"
            )
        if len(dataset) == 0:
            raise ValueError("the data set is empty: Poisson sampling needs at least one example")
        self.poisson = PoissonSampler(len(dataset), sample_rate, steps_per_epoch, reproducible_seed)
        self.sample_rate = self.poisson.sample_rate
        self._collate = collate_fn if collate_fn is not None else default_collate
        self.examples_drawn = 0  # examples in the batches yielded so far (this process's shard, data-parallel)
        self.batches_drawn = 0  # batches (logical: Poisson samples) yielded so far
        super().__init__(dataset, batch_sampler=_BatchSampler(self.poisson, parallel),
                         collate_fn=self._collate_or_empty, **loader_kwargs)  # fmt: skip

    def __iter__(self):
        """The batches, each counted into :attr:`examples_drawn` as it is yielded (the private optimizer checks that
        a step's forwards had no more rows than the examples drawn for it)."""
        for counted in super().__iter__():
            self.examples_drawn += counted.examples
            self.batches_drawn += 1
            yield counted.batch

    @property
    def expected_batch_size(self) -> float:
        """q N: what the noisy sum is divided by."""
        return self.poisson.expected_batch_size

    def _collate_or_empty(self, examples: list) -> _Counted:
        if examples:
            return _Counted(len(examples), self._collate(examples))
        return _Counted(0, empty_like_batch(self._collate([self.dataset[0]])))

    @classmethod
    def from_data_loader(
        cls, data_loader: DataLoader, reproducible_seed: int | None = None, poisson_sampling: bool = True, parallel=None
    ) -> DPDataLoader:
        """The Poisson version of ``data_loader``: same data set, ``collate_fn``, workers and pinning; sample rate
        ``batch_size / len(dataset)`` and ``len(data_loader)`` steps per epoch (Opacus' ``DPDataLoader``).
        ``parallel`` (a ``fastdp.engine.distributed.DataParallel``): ``batch_size`` is the global expected batch
        size, and this process loads its shard of each global sample."""
        if not poisson_sampling:
            raise ValueError(
                "poisson_sampling=False is refused: the accountants analyse Poisson sampling, and fixed-size "
                "shuffled batches are not what their epsilon is for. Keep poisson_sampling=True (the default)"
            )
        batch_size = data_loader.batch_size
        if batch_size is None and data_loader.batch_sampler is not None:
            batch_size = getattr(data_loader.batch_sampler, "batch_size", None)
        if not batch_size:
            raise ValueError(
                "the data loader has no batch_size (a custom batch_sampler?): give the DataLoader a batch_size, the "
                "expected size of the private Poisson batches"
            )
        n = len(data_loader.dataset)
        kwargs = dict(num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory,
                      timeout=data_loader.timeout, worker_init_fn=data_loader.worker_init_fn,
                      prefetch_factor=data_loader.prefetch_factor if data_loader.num_workers else None,
                      persistent_workers=data_loader.persistent_workers)  # fmt: skip
        return cls(data_loader.dataset, min(1.0, batch_size / n), len(data_loader), data_loader.collate_fn,
                   reproducible_seed, parallel, **kwargs)  # fmt: skip


def _rows(batch, start: int, stop: int):
    """Rows ``start:stop`` of a collated batch (every tensor and every per-example list cut the same way)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)({k: _rows(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_rows(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch):
            return type(batch)(_rows(v, start, stop) for v in batch)
        return type(batch)(batch[start:stop])
    return batch


def _num_rows(batch) -> int:
    from fastdp.engine.module import batch_size_of

    n = batch_size_of((batch,), {})
    if n is None:
        raise ValueError("a batch without a batch-first tensor cannot be split into physical batches")
    return n


class BatchMemoryManager:
    """Opacus' ``BatchMemoryManager``: iterate a private loader's logical (Poisson) batches as physical batches of at
    most ``max_physical_batch_size`` examples. Every physical batch but a logical batch's last tells the optimizer to
    skip its step (``signal_skip_step``): the clipped sums accumulate and the last step releases the logical batch
    once, with one accounting event. An empty logical batch is one (empty) physical batch.

        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=64, optimizer=optimizer) as batches:
            for x, y in batches:
                ...  # the ordinary loop
    """

    def __init__(self, *, data_loader, max_physical_batch_size: int, optimizer) -> None:
        if (
            isinstance(max_physical_batch_size, bool)
            or not isinstance(max_physical_batch_size, int)
            or (max_physical_batch_size < 1)
        ):
            raise ValueError(f"max_physical_batch_size must be an integer >= 1, got {max_physical_batch_size!r}")
        if not hasattr(optimizer, "signal_skip_step"):
            raise ValueError("BatchMemoryManager needs the optimizer make_private returned (a DPOptimizer)")
        self.data_loader, self.size, self.optimizer = data_loader, max_physical_batch_size, optimizer

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.optimizer.signal_skip_step(False)
        # a logical batch left before its last physical batch (a break, an exception) is not released: its clipped
        # sums would otherwise join the next logical batch's release (an example in both samples counted twice)
        self.optimizer.drop_pending_sums()

    def __len__(self) -> int:
        return len(self.data_loader)

    def __iter__(self):
        for batch in self.data_loader:
            n = _num_rows(batch)
            starts = list(range(0, n, self.size)) or [0]
            for k, start in enumerate(starts):
                self.optimizer.signal_skip_step(k < len(starts) - 1)
                yield _rows(batch, start, start + self.size) if n else batch
