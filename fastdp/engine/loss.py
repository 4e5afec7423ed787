"""``DPLoss``: the front door's criterion, whose backward gives every example's loss the same seed whatever the batch.

A plain mean over the batch (``nn.CrossEntropyLoss()(model(x), y)``, ``loss.mean()``) sends each example the
gradient ``fl(fl(1/n) v_i)``: v_i, the example's own loss gradient, multiplied by the rounded 1/n and rounded again.
n counts the batch, so adding or removing one example re-rounds every other example's gradient, and dividing by
``fl(1/n)`` afterwards cannot undo it (the product lost what distinguished the values). The model's backward can
amplify that rounding without limit: where an example's gradient is the small difference of large terms (two paths
that nearly cancel, or a loss gradient in a near-null space of the head), a change of one unit in the last place of
v_i moves the example's clipped gradient by a few per cent of the bound, the same way for identical examples. Measured
through the front door (DP-SGD, ``tests/test_holes_mean.py``): one example moved the released sum by 3.8 C at
n = 3001 and 21.6 C at n = 10 000. With ``loss_reduction="sum"`` the seed is 1 for every example and no such term
exists.

``DPLoss(criterion, module)`` computes the per-example losses (the criterion with ``reduction="none"``; a function is
called as it is and must return one loss per row), reduces each example's own elements by their mean (Opacus'
convention for per-token losses), and returns the batch's mean (``loss_reduction="mean"``) or sum as the loss's value,
whose backward sends each example's loss the backward's own seed (1 for ``loss.backward()``, whatever the user scales
it by), never 1/n: the release then divides the noisy sum by the expected batch size, the same ``p.grad`` as a mean.
Under ``loss_reduction="mean"`` the optimizer refuses a step whose private forward was not backpropagated through a
DPLoss, or whose DPLoss input got gradient from other terms of the loss as well (a plain-mean regularizer on the same
tensor). ``make_private(..., criterion=..., grad_sample_mode="ghost")`` returns one, as Opacus does for ghost clipping.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from torch import nn

from fastdp.engine.module import PrivateModule, Recorded
from fastdp.nn.ghost import criterion_pass


class _SeededReduction(torch.autograd.Function):
    """The batch's mean or sum of per-example losses, whose backward gives each example the incoming seed itself, and
    records what those losses send each output of their forwards (:meth:`Recorded.check_gradient` compares it with
    everything that reaches the output)."""

    @staticmethod
    def forward(ctx, per: torch.Tensor, mean: bool, forwards: list) -> torch.Tensor:
        ctx.save_for_backward(per)
        ctx.forwards = forwards
        return per.mean() if mean else per.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (per,) = ctx.saved_tensors
        seeds = grad.expand(per.shape)
        outputs = [(r, k, t) for r in ctx.forwards for k, t in enumerate(r.outputs()) if t.requires_grad]
        if outputs:  # the criterion's own gradient at each output: the loss's graph only, once more
            for recorded in ctx.forwards:  # this backward fires the outputs' hooks too: not the whole gradient
                recorded.measuring += 1
            try:
                with criterion_pass():  # the DP layers' records ignore it
                    sent = torch.autograd.grad(per, [t for _, _, t in outputs], seeds, retain_graph=True,
                                               allow_unused=True)  # fmt: skip
            finally:
                for recorded in ctx.forwards:
                    recorded.measuring -= 1
            for (recorded, k, _), part in zip(outputs, sent, strict=True):
                recorded.add_criterion_gradient(k, part)
        for recorded in ctx.forwards:
            recorded.seeded = True
        return seeds, None, None


def _per_example_criterion(criterion):
    """The criterion giving one loss per element: a torch loss module copied with ``reduction="none"``, a function
    with a ``reduction`` parameter (``torch.nn.functional.cross_entropy``) called with it; any other function (or
    module) as it is."""
    if not callable(criterion):
        raise TypeError(f"criterion must be a loss module or function, got {type(criterion).__name__}")
    reduction = getattr(criterion, "reduction", None)
    if isinstance(criterion, nn.Module):
        if isinstance(reduction, str) and reduction != "none":
            criterion = copy.copy(criterion)  # the user's module keeps its own reduction
            criterion.reduction = "none"
        return criterion
    try:
        takes_reduction = "reduction" in inspect.signature(criterion).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_reduction = False
    return functools.partial(criterion, reduction="none") if takes_reduction else criterion


def _forwards_of(tensor: torch.Tensor, pending: list[Recorded]) -> list[Recorded]:
    """The training forwards whose output ``tensor`` was computed from (a search of its autograd graph back to the
    forwards' output nodes, or to an output variant's leaf)."""
    targets: dict = {}
    for recorded in pending:
        for node in recorded.output_nodes:
            targets[node] = recorded
    found: dict[int, Recorded] = {}
    start = tensor.grad_fn
    if start is None:  # a leaf: an output variant's leaf itself
        return [r for r in pending if r.leaf is tensor]
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        recorded = targets.get(node)
        if recorded is None and type(node).__name__ == "AccumulateGrad":
            recorded = next((r for r in pending if r.leaf is not None and r.leaf is node.variable), None)
        if recorded is not None:
            found[id(recorded)] = recorded
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


class DPLoss(nn.Module):
    """The front door's criterion (module docstring): ``loss = criterion(model(x), y); loss.backward()``.

    Args:
        criterion: a torch loss module or functional loss (called with ``reduction="none"``), or a function
            ``(input, target, ...) ->`` per-example or per-element losses (first dimension the batch, or the batch's
            rows flattened).
        module: the private model (``make_private``'s first result).
        reduction: the loss's value, ``"mean"`` or ``"sum"`` of the per-example losses (its gradient is the same:
            each example's loss gets the backward's seed); make_private passes its ``loss_reduction``.
    """

    def __init__(self, criterion, module: PrivateModule, reduction: str = "mean") -> None:
        super().__init__()
        if isinstance(criterion, DPLoss):
            criterion = criterion.criterion
        if not isinstance(module, PrivateModule):
            raise TypeError(f"module must be the private model make_private returned, got {type(module).__name__}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.criterion = criterion
        self.reduction = reduction
        self._per_element = _per_example_criterion(criterion)
        self._module = module

    def forward(self, input: torch.Tensor, target=None, *args, **kwargs) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"the criterion's input must be a tensor (the model's output rows), got "
                            f"{type(input).__name__}")  # fmt: skip
        pending = self._module._pending
        forwards = _forwards_of(input, pending) if input.requires_grad else []
        if input.requires_grad and not forwards:
            raise ValueError(
                "the criterion's input was not computed from an output of the private model's training forward since "
                "the last step: compute the loss from what the model returned, after the forward"
            )
        per = self._per_element(input, target, *args, **kwargs) if target is not None or args or kwargs else (
            self._per_element(input))  # fmt: skip
        if not isinstance(per, torch.Tensor) or per.dim() == 0:
            raise ValueError(
                "the criterion gave one number for the whole batch: DPLoss needs one loss per example (a torch loss "
                "module is called with reduction='none'; a function must return one loss per row)"
            )
        n = forwards[0].examples if forwards else per.shape[0]
        if per.shape[0] != n:
            if per.dim() != 1 or per.numel() % n:
                raise ValueError(
                    f"the criterion gave losses of shape {tuple(per.shape)} for a batch of {n} examples: its first "
                    "dimension must be the batch, or the batch's rows flattened (n x positions)"
                )
        per = per.reshape(n, -1).mean(1) if per.dim() > 1 or per.shape[0] != n else per
        return _SeededReduction.apply(per, self.reduction == "mean", forwards)
