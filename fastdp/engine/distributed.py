"""Data-parallel DP training on ``torch.distributed``: N processes, one global Poisson batch, noise added once.

The front door's (``fastdp.PrivacyEngine`` finds an initialised process group: a user's script under torchrun),
and so the CLI's. ``fastdp train --nproc N`` starts N processes with torchrun (``python -m torch.distributed.run
--standalone --nproc_per_node N -m fastdp.train.cli train ...``); each initialises the default process group from
the torchrun environment (gloo on CPU, nccl on CUDA, rank r on ``cuda:LOCAL_RANK``) and runs the ordinary
:class:`fastdp.train.trainer.Trainer`, which finds the process group and hands its data-parallel work to
:class:`DataParallel`. One step, on every rank r of W:

1. Sampling. The default sampler draws from OS entropy, which differs per process: rank 0 draws each global Poisson
   sample (each example included with probability q, once, globally) and broadcasts it (ranks drawing their own
   would include an example on any of W ranks, probability 1 - (1 - q)^W, not q). With a reproducible privacy seed
   every rank runs the same seeded sampler and draws the same sample without communicating. Rank r keeps the shard
   ``indices[r::W]`` and pads / micro-batches it like a single process does (``--pad``: to ceil(b / W) rows per
   rank, b the single-process physical batch). An empty shard is fine: it contributes zero sums and still joins
   the collectives.
2. Clipping. Each rank computes :meth:`~fastdp.algorithms.base.Variant.clipped_sum` of its own examples (its
   micro-batches summed). Nothing here depends on the other ranks' examples, so every per-example bound holds as in
   one process.
3. All-reduce. :meth:`~fastdp.algorithms.base.Variant.reduce` sums the clipped sums (and the summed loss, and
   whatever else a variant's release reads, e.g. the non-private baseline's example count) over the ranks:
   ``torch.distributed.all_reduce(SUM)`` on one flat buffer per dtype, so a step costs one collective per dtype.
   Afterwards every rank holds the global batch's sums, bitwise identical on all ranks (the ring all-reduce
   reduces each chunk once and broadcasts it).
4. Noise, once. The default keys come from OS entropy inside each release, so the ranks' draws would differ: rank
   0's released gradient is broadcast and replaces every other rank's (each rank's own draw is discarded unused;
   the secret key never leaves rank 0, only the released gradient, which is the output of the mechanism anyway, is
   sent). With a reproducible privacy seed every rank releases the identical sums with the identical key and step,
   so each holds the same noisy gradient without a broadcast. Either way the release is one Gaussian mechanism with
   std sigma*C on the global sum, divided by the expected batch size q*N (not N draws, not sigma*C/sqrt(W) per
   rank). JL's tangents: with OS entropy rank 0 draws the step's tangent key and sends it to the others before the
   step (tangents are revealed in JL's analysis anyway; one set per step, as with micro-batches); with a
   reproducible seed every rank derives the same key.
5. Update and accounting. Every rank steps its optimizer with the same gradient, so the models, which start
   identical (same seed, and rank 0's parameters and buffers are broadcast once at start), stay identical; this is
   checked bitwise once per epoch. Every rank steps its accountant identically (deterministic), so all agree on
   epsilon, and only rank 0 logs and writes results and checkpoints.

Why not ``torch.nn.parallel.DistributedDataParallel``: fastdp's DP layers compute each layer's clipped sum from
detached parameters (ghost clipping), so DDP's reducer would see no ``.grad`` to reduce, and for the variants that do
run an ordinary backward it would average unnoised gradients of per-rank means (the wrong units: the release needs
the global sum). All-reducing the clipped sums directly is what DDP's reducer does (bucketed all-reduce), on the
quantity the privacy argument is about.

Refused, with a clear error: processes started with different settings or data (a fingerprint of the run's
configuration, data, torch version and kernel backends is gathered from every rank and compared at start);
resuming a checkpoint with a different number of processes (the world size is part of the checkpoint's identity);
``--device cuda:K`` with more than one process (each rank takes ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from fastdp.algorithms.base import Batch, Variant, trainable_parameters
from fastdp.privacy.sampling import Sampler

__all__ = ["DataParallel", "launch", "launched_by_torchrun", "process_group", "software_fingerprint", "tensor_digest"]

T = TypeVar("T")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (its rendezvous variables are set)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def backend_for(device: str) -> str:
    """The collective backend for a training device: nccl on CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(device: str = "cpu") -> Iterator[None]:
    """Initialise the default process group from the torchrun environment (``env://``) for training on ``device``
    (gloo on CPU; nccl on CUDA, this process on ``cuda:LOCAL_RANK``); destroy it on exit."""
    if not launched_by_torchrun():
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise ValueError(
            f"distributed training needs the torchrun environment ({', '.join(missing)} not set); start it with "
            "`fastdp train --nproc N ...` or `torchrun --nproc_per_node N -m fastdp.train.cli train ...`"
        )
    backend = backend_for(device)
    if backend == "nccl":
        local_rank, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local_rank >= gpus:
            raise ValueError(
                f"--device {device}: local rank {local_rank} needs GPU {local_rank}, but this machine has {gpus} "
                "CUDA device(s); use at most one process per GPU (--nproc <= number of GPUs)"
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``fastdp`` with ``argv`` (e.g. ``["train", ...]``, without ``--nproc``) on ``nproc`` local processes via
    torchrun; returns torchrun's exit status. Each process gets ``OMP_NUM_THREADS`` = cores / nproc unless set."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "fastdp.train.cli", *argv]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(command, env=env, check=False).returncode


def _flat_groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, in order of first appearance (the same on every rank: one collective each)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def tensor_digest(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the tensors' shapes, dtypes and bytes (bitwise identity across ranks)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def software_fingerprint(device_type: str) -> dict:
    """What must match across ranks besides the configuration for them to compute identically: the torch version and
    the kernel backend each fastdp op family runs on ``device_type`` (e.g. the noise: one backend's draw on every
    rank)."""
    from fastdp import _backend

    backends = {family: _backend.resolve(family, device_type)[0] for family in _backend.VALIDATED}
    return {"torch": torch.__version__, "backends": backends}


class DataParallel:
    """This process's part in a data-parallel run on the default process group (see the module docstring)."""

    def __init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("DataParallel needs an initialised torch.distributed process group (see process_group)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = dist.get_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        # collectives run on this device: nccl needs CUDA tensors, gloo takes CPU ones
        self.comm_device = torch.device("cuda", local_rank) if self.backend == "nccl" else torch.device("cpu")

    @classmethod
    def current(cls) -> DataParallel | None:
        """The data-parallel context of this process, or None when no process group is initialised (one process)."""
        if dist.is_available() and dist.is_initialized():
            return cls()
        return None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes results and checkpoints."""
        return self.rank == 0

    def device(self, requested: str) -> torch.device:
        """The training device of this rank: ``cuda`` becomes ``cuda:LOCAL_RANK``; CPU stays CPU."""
        device = torch.device(requested)
        if device.type == "cuda":
            if device.index is not None and self.world_size > 1:
                raise ValueError(
                    f"--device {requested} with {self.world_size} processes would put every rank on one GPU; pass "
                    "--device cuda: rank r then uses cuda:LOCAL_RANK"
                )
            if self.backend != "nccl":
                raise ValueError(f"training on CUDA needs the nccl backend, but the process group uses {self.backend}")
            return self.comm_device
        if self.backend == "nccl":
            raise ValueError(f"the process group uses nccl, which needs CUDA tensors; got --device {requested}")
        return device

    # ------------------------------------------------------------------------------ start-up checks

    def check_same_run(self, settings: dict) -> None:
        """Refuse to start unless every rank was given the same ``settings`` (configuration, seed, data fingerprint,
        versions): the ranks must draw the same sample and the same noise, or the noise would not be added once."""
        gathered: list[dict | None] = [None] * self.world_size
        dist.all_gather_object(gathered, settings)
        differing = sorted({key for other in gathered for key in set(other) | set(settings)
                            if other.get(key) != gathered[0].get(key)})  # fmt: skip
        if differing:
            details = "; ".join(
                f"{key}: " + ", ".join(f"rank {r} = {g.get(key)!r}" for r, g in enumerate(gathered))
                for key in differing
            )
            raise ValueError(
                f"the {self.world_size} processes of this run were started with different settings ({details}). "
                "Every process must run the same command with the same seed and data (fastdp train --nproc N does): "
                "the ranks draw the global Poisson sample and the noise from the shared seed, and differing seeds "
                "would sample differently and add a different noise on every rank"
            )

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Give every rank rank 0's parameters and buffers (they already agree when the seed does; this makes sure)."""
        with torch.no_grad():
            self.broadcast_from_main([*module.parameters(), *module.buffers()])

    def check_in_sync(self, module: torch.nn.Module, epoch: int) -> None:
        """Refuse to go on if the ranks' models differ bitwise (one all-gather of a digest; called once per epoch).
        They cannot if every rank computes identically; they can on mixed GPU models or nondeterministic kernels."""
        digests: list[str | None] = [None] * self.world_size
        dist.all_gather_object(digests, tensor_digest([*module.parameters(), *module.buffers()]))
        if len(set(digests)) > 1:
            groups = {d: [r for r, x in enumerate(digests) if x == d] for d in digests}
            raise RuntimeError(
                f"after epoch {epoch} the ranks hold different models (ranks grouped by identical parameters: "
                f"{sorted(groups.values())}): they did not compute identically (different GPU models, drivers or "
                "nondeterministic kernels?). Run every rank on the same kind of device and software"
            )

    # ------------------------------------------------------------------------------ per step

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This rank's examples of the global sample ``indices``: every W-th one from position r (may be empty)."""
        return indices[self.rank :: self.world_size]

    def physical_batch_size(self, physical: int) -> int:
        """Rows a rank pads its shard to when one process would pad the whole batch to ``physical``."""
        return -(-physical // self.world_size)

    def shared_sampler(self, sampler):
        """``sampler`` if its draws are replayable from the seed (every rank draws the same sample itself); for an
        OS-entropy sampler (the default), a wrapper whose samples rank 0 draws and broadcasts."""
        return sampler if getattr(sampler, "reproducible", True) else _MainRankSampler(sampler, self)

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each tensor over all ranks, in place: one ``all_reduce`` per dtype on a flat buffer."""
        for group in _flat_groups(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.comm_device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            self._unflatten(flat, group)

    def broadcast_from_main(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite each tensor with rank 0's, in place: one ``broadcast`` per dtype on a flat buffer."""
        for group in _flat_groups(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.comm_device)
            dist.broadcast(flat, src=0)
            if not self.is_main:
                self._unflatten(flat, group)

    @staticmethod
    def _unflatten(flat: torch.Tensor, group: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(part.view(t.shape))

    def broadcast_indices(self, indices: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's int64 index tensor on every rank (``indices`` is ignored elsewhere)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        if self.is_main:
            size[0] = indices.numel()
        dist.broadcast(size, src=0)
        if self.is_main:
            buffer = indices.to(device=self.comm_device, dtype=torch.int64).contiguous()
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.int64, device=self.comm_device)
        if buffer.numel():
            dist.broadcast(buffer, src=0)
        return buffer.cpu()

    def gradient(
        self, variant: Variant, model: torch.nn.Module, batch: Batch | Sequence[Batch], step: int, *, os_entropy: bool
    ) -> torch.Tensor:
        """Set ``p.grad`` to the global step's released gradient on every rank; returns the global summed loss.

        ``batch``: this rank's shard of the global sample (one Batch or its micro-batches). The clipped sums are
        all-reduced before the release; ``os_entropy`` (the variant's keys come from OS entropy, different on every
        rank): rank 0's released gradient replaces the others', so the noise is still added exactly once, and (JL)
        rank 0's tangent key of the step is shared first, so every rank projects on the same tangents."""
        if os_entropy:
            self.share_tangent_key(variant, step)
        loss = variant.gradient(model, batch, step, all_reduce_sum=self.all_reduce_sum)
        if os_entropy:
            self.broadcast_from_main([p.grad for p in trainable_parameters(model)])
        return loss

    def share_tangent_key(self, variant: Variant, step: int) -> None:
        """A variant that draws random tangents (JL) with OS-entropy keys: every rank adopts rank 0's tangent key of
        ``step``, so all project on the same tangents (tangents are revealed in JL's analysis anyway)."""
        if getattr(variant, "draws_tangents", False):
            key = self.from_main(lambda: variant.keys.tangent_key(step, variant.projections)[0])
            variant.keys.adopt_tangent_key(step, key)

    def from_main(self, read: Callable[[], T]) -> T:
        """``read()`` on rank 0, its result (or its exception, raised on every rank) sent to all ranks: e.g. a
        checkpoint only rank 0 can see, with one error instead of ranks hanging in the next collective."""
        box: list = [None]
        if self.is_main:
            try:
                box[0] = (True, read())
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                box[0] = (False, exc)
        dist.broadcast_object_list(box, src=0, device=self.comm_device)
        ok, value = box[0]
        if not ok:
            raise value
        return value


class _MainRankSampler(Sampler):
    """A sampler whose every sample rank 0 draws and broadcasts (OS-entropy draws differ per process)."""

    reproducible = False

    def __init__(self, sampler, parallel: DataParallel) -> None:
        self.sampler = sampler
        self.parallel = parallel
        self.sample_rate = sampler.sample_rate
        self.num_examples = sampler.num_examples
        self.steps_per_epoch = sampler.steps_per_epoch

    @property
    def expected_batch_size(self) -> float:
        return self.sampler.expected_batch_size

    def sample(self) -> torch.Tensor:
        return self.parallel.broadcast_indices(self.sampler.sample() if self.parallel.is_main else None)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
