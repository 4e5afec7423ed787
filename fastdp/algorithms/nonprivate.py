"""Non-private training, for comparison: the mean loss of the real examples, one backward."""

from __future__ import annotations

import torch

from fastdp.algorithms.base import (
    Batch,
    Variant,
    per_example_cross_entropy,
    summed_loss_gradients,
    trainable_parameters,
)


class NonPrivate(Variant):
    name = "nonprivate"
    private = False
    low_precision_refusal = None  # no bound to keep
    _graph_state = ("_examples",)

    def __init__(self, loss_fn=per_example_cross_entropy) -> None:
        super().__init__(loss_fn)
        self._examples: torch.Tensor | int = 0  # real examples of the logical batch so far (its mean's divisor)

    @classmethod
    def from_config(cls, config, **_) -> NonPrivate:
        return cls()

    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        self._examples = self._examples + batch.mask.sum()
        return summed_loss_gradients(model, self.loss_fn, batch, self._forward, self.loss_scale)

    def reduce(self, sums: list[torch.Tensor], loss: torch.Tensor, all_reduce_sum) -> torch.Tensor:
        """The mean's divisor is the global batch's example count: reduced with the sums (an int64 collective)."""
        count = torch.as_tensor(self._examples, device=sums[0].device if sums else None).to(torch.int64).reshape(1)
        loss = super().reduce([*sums, count], loss, all_reduce_sum)
        self._examples = count.reshape(())
        return loss

    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        count = torch.as_tensor(self._examples).clamp(min=1)
        self._examples = 0
        for p, total in zip(trainable_parameters(model), sums, strict=True):
            p.grad = (total / count.to(total.device)).to(p.dtype)
