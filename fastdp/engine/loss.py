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
called as it is and must return one loss per row of its input), sums each row's elements (never their mean: its
divisor would count the padded positions the batch's longest example sets), and returns the rows' mean
(``loss_reduction="mean"``) or sum as the loss's value. The value is not connected to the losses' graph: its backward
hands each row's loss the backward's seed, measures what the criterion sends its own input (the criterion's graph
alone) and keeps it; ``optimizer.step()`` backpropagates it from there through the model inside the forward's gate
(``fastdp.nn.ghost.Gate``), the only backward the forward's DP layers then record. Under ``loss_reduction="mean"``
the step is refused when the private forward's loss did not come from a DPLoss, when any gradient reached its DP
layers otherwise (another term of the loss, by any path into the model: an output, a stored activation, a hooked
tensor), and when the DPLoss's loss was scaled before ``backward()`` (a seed other than 1: ``loss / len(x)`` is the
plain mean again). The release divides the noisy sum by the expected batch size, the same ``p.grad`` as a mean.
``make_private(..., criterion=..., grad_sample_mode="ghost")`` returns one, as Opacus does for ghost clipping.

Each row's loss must come from its own row alone: the criterion is probed like the model (``fastdp.nn.rows``, once
per input signature, on its detached input and target): a row's loss must not change when other rows are replaced or
when the batch loses its last rows (in-batch negatives, ``out - out.mean(0)``, a division by ``len(out)`` are
refused). Code between the model's output and the criterion's input, and a criterion's division by a padded length
that the collate function set, are the user's part of the contract (not seen by either probe).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
from torch import nn

from fastdp.engine.module import PrivateModule, Recorded
from fastdp.nn.rows import RowProbe


class _SeededReduction(torch.autograd.Function):
    """The batch's mean or sum of per-example losses, not connected to their graph: the backward hands each row's loss
    the incoming seed itself, measures what the criterion sends its input (the criterion's own graph; the DP layers
    ignore it: ``Gate.measure``) and keeps it for the step to backpropagate from that input, through whatever lies
    between it and the model's outputs, and the model (``fastdp.engine.module.backpropagate_sent``). Nothing flows
    from here into the model during the user's backward, so whatever reaches its DP layers then came from elsewhere
    (``Gate``)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, mean: bool, held: list) -> torch.Tensor:
        ctx.held = held  # [per-example losses, the criterion's input, the forwards]: not autograd inputs (not followed)
        per = held[0].detach()
        return per.mean() if mean else per.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.held is None:
            raise RuntimeError("the DP criterion's loss was backpropagated twice: call backward() once per loss (the "
                               "step backpropagates what it measured through the model once)")  # fmt: skip
        per, input, forwards = ctx.held
        ctx.held = None
        seeds = grad.expand(per.shape)
        with contextlib.ExitStack() as stack:  # the criterion's own graph only: the DP layers ignore it
            for recorded in forwards:
                stack.enter_context(recorded.gate.measure())
            # retain_graph: several DP criteria may share nodes of the loss's graph; it goes with ``per`` (dropped)
            (sent,) = torch.autograd.grad(per, [input], seeds, retain_graph=True, allow_unused=True)
        for recorded in forwards:
            recorded.seeded = True
            recorded.seeds.append(grad.detach())
        if sent is not None and forwards:
            forwards[0].sent.append((input, sent))  # one backward from every criterion's input, at the step
        return None, None, None


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
        self._probe = RowProbe()

    def _per_row(self, structure: tuple) -> torch.Tensor:
        """The criterion's loss for each row of ``(input, target, args, kwargs)``, checked: one per row."""
        input, target, args, kwargs = structure
        per = self._per_element(input, target, *args, **kwargs) if target is not None or args or kwargs else (
            self._per_element(input))  # fmt: skip
        if not isinstance(per, torch.Tensor) or per.dim() == 0:
            raise ValueError(
                "the criterion gave one number for the whole batch: DPLoss needs one loss per example (a torch loss "
                "module is called with reduction='none'; a function must return one loss per row)"
            )
        rows = input.shape[0] if input.dim() else 0
        if per.shape[0] != rows:
            raise ValueError(
                f"the criterion gave losses of shape {tuple(per.shape)} for an input of {rows} rows: its first "
                "dimension must be the input's rows (one loss per example, or per row of the batch's rows flattened)"
            )
        # an example's (a row's) elements are summed, never averaged: a mean's divisor would count its padded
        # positions, set by the batch's longest example (one example then rescales every other's gradient)
        return per.reshape(rows, -1).sum(1) if per.dim() > 1 else per

    def forward(self, input: torch.Tensor, target=None, *args, **kwargs) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"the criterion's input must be a tensor (the model's output rows), got "
                            f"{type(input).__name__}")  # fmt: skip
        pending = self._module._pending
        forwards = _forwards_of(input, pending) if input.requires_grad else []
        plain = not forwards and not self._module.training  # an evaluation forward's loss: the plain criterion
        if input.requires_grad and not forwards and not plain:
            raise ValueError(
                "the criterion's input was not computed from an output of the private model's training forward since "
                "the last step: compute the loss from what the model returned, after the forward"
            )
        per = self._per_row((input, target, args, kwargs))
        if plain:
            return per.mean() if self.reduction == "mean" else per.sum()
        with torch.no_grad():  # each row's loss from its own row alone (fastdp.nn.rows), once per input signature
            self._probe.check(lambda structure, _: self._per_row(structure), self, (input.detach(), target, args,
                              kwargs), [], "the DP criterion", batch=input.shape[0])  # fmt: skip
        anchor = torch.zeros((), device=per.device, requires_grad=True)
        return _SeededReduction.apply(anchor, self.reduction == "mean", [per, input, forwards])
