"""The front door's model wrapper: the user's model, whose training forwards record what the private step needs.

``PrivateModule(model)`` converts the model's layers to fastdp's DP layers in place (``fastdp.nn.convert``: same
parameters, same ``state_dict``) and runs each forward that needs gradients (training mode, grad enabled) inside a
:class:`fastdp.nn.GhostClipping` context: every DP layer keeps its input A and registers a hook that stores its output
gradient G when the user calls ``loss.backward()``. No weight gradient is formed by that backward (the DP layers use
detached parameters); the optimizer's ``step()`` (:class:`fastdp.engine.DPOptimizer`) turns the recorded A and G into
the clipped sums, adds the noise and sets ``p.grad``. Evaluation forwards (``eval()`` or ``torch.no_grad()``) are the
plain model.

Per-example gradients under the loss's reduction (Opacus' ``loss_reduction``): with ``"mean"`` the loss is taken to
be ``(1/n) sum_i loss_i`` over the n examples of the batch, and G is multiplied by n, so example i's gradient is that
of ``loss_i``; with ``"sum"`` it is ``sum_i loss_i`` and G is used as it is. Each ``loss_i`` must depend on example i
alone: a mean over the batch's *tokens* (``CrossEntropyLoss(ignore_index=...)`` on flattened [B T] tokens, whose
divisor counts every example's tokens) is not a mean over examples; average each example's tokens first (``loss_i``
= the mean of its own tokens) and take the mean or sum of those, or use ``reduction="sum"`` over tokens with
``loss_reduction="sum"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastdp.nn import GhostClipping, check_supported, convert


@dataclass
class Recorded:
    """One training forward: its DP layer calls (with G once ``loss.backward()`` ran) and its number of examples."""

    records: list
    examples: int
    inputs: torch.Tensor | None  # the forward's input when it was one batch-first tensor (for the row probe)


def batch_size_of(args: tuple, kwargs: dict) -> int | None:
    """The leading dimension of the first tensor among the forward's arguments (positional first, then keyword,
    looking into lists, tuples and dicts): the number of examples, for batch-first inputs."""
    stack = [*args, *kwargs.values()]
    while stack:
        value = stack.pop(0)
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.dim() else None
        if isinstance(value, dict):
            stack[:0] = list(value.values())
        elif isinstance(value, (list, tuple)):
            stack[:0] = list(value)
    return None


class PrivateModule(nn.Module):
    """The user's model for private training (module docstring). Attribute access falls through to the model, so
    ``private.fc1`` or ``private.config`` work; ``private._module`` is the model itself."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        check_supported(convert(module))
        self._module = module
        self._pending: list[Recorded] = []

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_module"], name)

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self._module(*args, **kwargs)
        examples = batch_size_of(args, kwargs)
        if examples is None:
            raise ValueError(
                "the private model's forward got no tensor argument with a batch dimension: fastdp needs batch-first "
                "inputs (the first dimension of the first tensor argument is the number of examples)"
            )
        with GhostClipping() as ctx:
            out = self._module(*args, **kwargs)
        single = args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) else None
        self._pending.append(Recorded(ctx.records, examples, single))
        return out

    def take_recorded(self) -> list[Recorded]:
        """The training forwards since the last call (their G filled by the backward), and forget them."""
        pending, self._pending = self._pending, []
        return pending

    def forget_recorded(self) -> None:
        """Drop what the forwards since the last step recorded (``optimizer.zero_grad()``)."""
        self._pending = []
