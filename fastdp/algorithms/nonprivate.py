"""Non-private training, for comparison: the mean loss of the real examples, one backward."""

from __future__ import annotations

import torch

from fastdp.algorithms.base import Batch, Variant, trainable_parameters


class NonPrivate(Variant):
    name = "nonprivate"
    private = False

    @classmethod
    def from_config(cls, config, **_) -> NonPrivate:
        return cls()

    def gradient(self, model: torch.nn.Module, batch: Batch, step: int) -> torch.Tensor:
        for p in trainable_parameters(model):
            p.grad = None
        losses = self.loss_fn(model(batch.x), batch.y) * batch.mask
        count = batch.mask.sum().clamp(min=1)
        (losses.sum() / count).backward()
        for p in trainable_parameters(model):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return losses.detach().sum()
