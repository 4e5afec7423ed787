"""What every training variant provides to the trainer.

A variant turns a batch into this step's gradient (written to ``p.grad``) whose
sensitivity it knows, and names the accounting event that release was. The trainer
knows no variant by name: it calls :meth:`Variant.gradient`, steps the optimizer and
records :meth:`Variant.privacy_event` with the accountant.

A step has two phases: :meth:`Variant.clipped_sum` (each example's bounded contribution, summed; no noise) and
:meth:`Variant.release` (noise once, the mean, ``p.grad``). A logical batch too large for memory is processed as
micro-batches (virtual batches): their sums are added and released once, one accounting event, the same update
as the unsplit batch.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from fastdp.nn.layers import own_trainable
from fastdp.ops import add_noise_


@dataclass
class Batch:
    """Examples of one step. ``mask`` marks real rows; padded rows (mask False) must count for nothing."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor

    @property
    def num_real(self) -> int:
        return int(self.mask.sum())


def per_example_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example loss: cross-entropy of the logits, no reduction."""
    return F.cross_entropy(logits, y, reduction="none")


class Variant(abc.ABC):
    """A training variant (DP-SGD, non-private, ...)."""

    name: ClassVar[str]
    private: ClassVar[bool]

    def __init__(self, loss_fn=per_example_cross_entropy) -> None:
        self.loss_fn = loss_fn

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> Variant:
        """The variant a :class:`fastdp.train.trainer.TrainConfig` asks for (the trainer knows no variant by name)."""
        raise ValueError(f"variant {cls.name!r} cannot be built from a training configuration")

    @classmethod
    def accounting_projections(cls, config) -> float:
        """JL projections r behind the clip factors under ``config`` (papers/03); ``math.inf`` for exact norms, i.e.
        each step is a Gaussian mechanism. The accountant needs it: with finite r the sensitivity is random."""
        return math.inf

    @abc.abstractmethod
    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(sum over the real examples of ``batch`` of each one's bounded gradient contribution, per trainable
        parameter in ``sum_dtype``; their summed loss, a detached scalar). No noise. Called once per micro-batch of
        a logical batch, all with the logical step's index ``step`` (e.g. JL tangents are keyed by it)."""

    @abc.abstractmethod
    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        """Noise, once per logical step (keyed by ``step``), on the logical batch's ``sums``; set every trainable
        parameter's ``p.grad`` to the released mean. ``sums`` may be modified in place."""

    def gradient(self, model: torch.nn.Module, batch: Batch | Sequence[Batch], step: int) -> torch.Tensor:
        """Set ``p.grad`` of every trainable parameter to this step's gradient.

        ``batch`` is the logical batch, or its micro-batches (virtual batches: sums added, one release). ``step`` is
        the global step index (keys the noise). Returns the summed loss of the real examples (a detached scalar
        tensor; no host synchronisation)."""
        batches = [batch] if isinstance(batch, Batch) else list(batch)
        if not batches:
            raise ValueError(
                "a logical batch needs at least one (possibly empty) micro-batch: the noise is released "
                "every step, also for an empty Poisson sample"
            )
        sums, loss = self.clipped_sum(model, batches[0], step)
        for micro in batches[1:]:
            more, more_loss = self.clipped_sum(model, micro, step)
            torch._foreach_add_(sums, more)
            loss = loss + more_loss
        self.release(model, sums, step)
        return loss

    def after_step(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional hook, nothing by default
        """Called after the optimizer step (e.g. a projection onto the constraint set: post-processing)."""

    def privacy_event(self) -> tuple[float, float] | None:
        """(noise multiplier, sample rate) of one step for the accountant; None if not private."""
        return None

    def comparison_epsilons(self, epochs: int, delta: float) -> dict[str, float]:
        """Epsilons of other accountings (e.g. a paper's), reported beside fastdp's guarantee, never instead of it."""
        return {}

    def describe(self) -> dict:
        """Hyperparameters that define the variant, for reports and checkpoints."""
        return {"variant": self.name}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``[p for p in model.parameters() if p.requires_grad]``, without ``parameters()``' per-module generators
    (every step calls it)."""
    return list(dict.fromkeys(p for m in model.modules() for p in own_trainable(m)))


def sum_dtype(p: torch.Tensor) -> torch.dtype:
    """Gradient sums and their noise stay in fp32 (fp64 for fp64 parameters) until the noisy result is cast to the
    parameter's dtype: rounding a low-precision sum before the noise would make the release depend on the data
    beyond the sensitivity bound; after the noise it is post-processing."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def summed_loss_gradients(model: torch.nn.Module, loss_fn, batch: Batch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(gradient of the summed loss of the real examples w.r.t. each trainable parameter, in ``sum_dtype``; that
    summed loss). One ordinary backward: for variants whose sensitivity is bounded inside the network."""
    params = trainable_parameters(model)
    losses = loss_fn(model(batch.x), batch.y) * batch.mask if batch.x.shape[0] else None
    if losses is None:
        return [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params], torch.zeros((), device=batch.x.device)
    grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
    sums = [torch.zeros_like(p, dtype=sum_dtype(p)) if g is None else g.to(sum_dtype(p))
            for p, g in zip(params, grads, strict=True)]  # fmt: skip
    return sums, losses.detach().sum()


def release_noisy_mean(
    params: list[torch.nn.Parameter],
    sums: list[torch.Tensor],
    stds: list[float] | torch.Tensor,
    expected_batch_size: float,
    seed: int,
    step: int,
    secure: bool,
) -> None:
    """p.grad = (sum + N(0, std^2)) / (q N) for each parameter: the noise is keyed by (seed, step) or, secure,
    drawn from OS entropy; the divisor is the expected batch size, never the realised one.

    ``stds`` may be a tensor on the sums' device (stds that depend on the weights, e.g. Lipschitz bounds): the
    noise is then added as ``std * (sum / std + N(0, 1))``, the same Gaussian mechanism, with the std never read
    on the host (no synchronisation). A zero std there is treated as 1e-30 (its sum is 0 by its bound)."""
    if isinstance(stds, torch.Tensor):
        scale = [s.to(total.dtype) for s, total in zip(stds.clamp_min(1e-30).unbind(), sums, strict=True)]
        torch._foreach_div_(sums, scale)
        _add_noise(sums, 1.0, seed, step, secure)
        torch._foreach_mul_(sums, scale)
    else:
        _add_noise(sums, stds, seed, step, secure)
    if expected_batch_size != 1.0:  # 1.0: the caller folded the division into the sums and stds
        torch._foreach_div_(sums, expected_batch_size)
    for p, total in zip(params, sums, strict=True):
        p.grad = total.to(p.dtype)  # cast after the noise: post-processing


def _add_noise(sums: list[torch.Tensor], stds, seed: int, step: int, secure: bool) -> None:
    if secure:
        add_noise_(sums, stds, secure=True)
    else:
        add_noise_(sums, stds, seed=seed, offset=step)
