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
refused). The code between the model's output and the criterion's input may only move values (views, reshapes,
slices, transposes, casts, concatenation: :data:`MOVES`, by the autograd graph), and :class:`Segment` checks by
experiment, once per segment, that it puts example e's output in the criterion's rows of example e, in order, and that
the gradient back through it is a copy (no hook rescaling it): a scale such as ``criterion(out / len(x), y)`` moved
DP-SGD's release by 3.94 C at n = 3001 before. What a criterion divides by (a padded length the collate function set)
and how the targets were made are the user's part of the contract (data, not seen by either probe).
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
        for edge, _ in recorded.output_edges:
            targets[edge.node] = recorded
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


# What may lie between a private forward's output and the DP criterion's input: operations that move values and do no
# arithmetic (views, reshapes, slices, transposes, casts, copies, concatenation), so the criterion's rows are the
# model's rows rearranged, which Segment.check verifies; arithmetic belongs in the criterion, where the probe sees it
MOVES = frozenset({
    "AliasBackward0", "CatBackward0", "CloneBackward0", "ExpandBackward0", "PermuteBackward0", "ReshapeAliasBackward0",
    "SelectBackward0", "SliceBackward0", "SplitBackward0", "SplitWithSizesBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4", "StackBackward0", "TBackward0",
    "ToCopyBackward0", "TransposeBackward0", "TransposeBackward1", "UnbindBackward0", "UnsafeViewBackward0",
    "UnsqueezeBackward0", "UnsqueezeBackward1", "ViewBackward0",
})  # fmt: skip


def _segment(tensor: torch.Tensor, recorded: Recorded) -> tuple[list, set]:
    """The autograd nodes between ``recorded``'s outputs (or its output leaf) and ``tensor``, and the outputs' edges
    where it ends ((node, output number): not those reached only through the model); ValueError naming the first node
    that is not a move (:data:`MOVES`)."""
    stops = {edge.node for edge, _ in recorded.output_edges}
    nodes, stack, seen, ends = [], [(tensor.grad_fn, tensor.output_nr)], set(), set()
    while stack:
        node, number = stack.pop()
        if node in stops:
            ends.add((node, number))
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad" and recorded.leaf is not None and node.variable is recorded.leaf:
            continue
        if type(node).__name__ not in MOVES:
            raise ValueError(
                f"the DP criterion's input was computed from the private model's output by {type(node).__name__}: "
                "between the model's output and the DP criterion only operations that move values may run (views, "
                "reshapes, slices, transposes, casts, concatenation), so that each of the criterion's rows is one "
                "example's. Put any arithmetic (a scale or temperature, a mask, a softmax, another tensor) into the "
                "criterion's function, where each row's loss is checked, and pass its extra tensors as arguments: "
                "DPLoss(lambda out, y, mask: loss(out / 2.0, y) * mask, model)(model(x), y, mask) (docs/front-door.md, "
                "'Per-example gradients and the loss')"
            )
        nodes.append(node)
        stack.extend(node.next_functions)
    return nodes, ends


def _describe(node) -> tuple:
    """A node's type and what it saved other than tensors (dimensions, sizes, slice bounds): two segments with the
    same descriptions move the same elements."""
    saved = []
    for name in dir(node):
        if name.startswith("_saved_"):
            value = getattr(node, name)
            if not isinstance(value, torch.Tensor):
                saved.append((name, repr(value)))
    return (type(node).__name__, tuple(saved))


class Segment:
    """Checks, once per segment (:func:`_describe` of its nodes, the shapes), that the code between a private forward's
    outputs and the DP criterion's input moves example e's rows to the criterion's rows e·k .. e·k + k - 1, in order
    (k = the criterion's rows / the examples), and that the gradient passing back through it is a copy (no gradient
    hook scaling it). By experiment on the segment's Jacobian J (the vector-Jacobian product differentiated once more
    in its seed): J·1 must hold only 0 and 1, and J·v_b, v_b the rows of the examples with bit b of their index set
    (or clear), may reach only the criterion's rows of those examples."""

    def __init__(self) -> None:
        self._seen: set = set()

    def check(self, input: torch.Tensor, forwards: list[Recorded]) -> None:
        private = [r for r in forwards if not r.public]
        if not private:
            return
        if len(forwards) > 1:
            raise ValueError(
                f"the DP criterion's input was computed from the outputs of {len(forwards)} training forwards: compute "
                "each forward's loss with its own call of the criterion (loss = criterion(model(x), y) + "
                "criterion(model(x2), y2)), so that each criterion row is one example of one forward"
            )
        (recorded,) = private
        nodes, ends = _segment(input, recorded)
        if recorded.examples == 0:  # an empty batch: no row to check (the moves were)
            return
        if recorded.leaf is not None:
            outputs = [(recorded.leaf, recorded.leaf.shape)]
        else:
            outputs = [(edge, shape) for edge, shape in recorded.output_edges if (edge.node, edge.output_nr) in ends]
        key = (tuple(_describe(node) for node in nodes), tuple(input.shape), input.dtype, recorded.examples,
               tuple(tuple(shape) for _, shape in outputs))  # fmt: skip
        if key in self._seen:
            return
        with recorded.gate.measure() if recorded.gate is not None else contextlib.nullcontext():
            self._check(input, recorded.examples, outputs)  # (the DP layers' hooks on the outputs ignore it)
        self._seen.add(key)

    @staticmethod
    def _check(input: torch.Tensor, n: int, outputs: list) -> None:
        rows = input.shape[0] if input.dim() else 0
        if rows == 0 or rows % n:
            raise ValueError(
                f"the DP criterion's input has {rows} rows for a batch of {n} examples: its rows must be the "
                "examples, or each example's rows in order (a [B, T, ...] output reshaped to [B*T, ...])"
            )
        per = rows // n
        with torch.enable_grad():
            seed = torch.zeros_like(input, requires_grad=True)
            grads = torch.autograd.grad(input, [t for t, _ in outputs], seed, create_graph=True, allow_unused=True)
            used = [(g, shape) for g, (_, shape) in zip(grads, outputs, strict=True) if g is not None]
            for _, shape in used:
                if len(shape) == 0 or shape[0] % n:
                    raise ValueError(
                        f"the DP criterion's input was computed from a model output of shape {tuple(shape)}, whose "
                        f"first dimension is not the batch's {n} examples (or a multiple): compute the loss from "
                        "batch-first outputs"
                    )

            def reach(select) -> torch.Tensor:  # J v, v = 1 on the output rows of the examples ``select`` keeps
                vs = []
                for g, shape in used:
                    examples = torch.arange(shape[0], device=g.device) // (shape[0] // n)
                    keep = select(examples).to(g.dtype).reshape(-1, *([1] * (len(shape) - 1)))
                    vs.append(keep.expand(shape))
                (jv,) = torch.autograd.grad([g for g, _ in used], seed, vs, retain_graph=True, allow_unused=True)
                return torch.zeros_like(input) if jv is None else jv.detach()

            ones = reach(lambda e: torch.ones_like(e, dtype=torch.bool))
            if not bool(((ones == 0) | (ones == 1)).all()):
                raise ValueError(
                    "the gradient from the DP criterion's input back to the private model's output is not a copy of "
                    "it: a gradient hook between them (tensor.register_hook) scales or changes it, and a change that "
                    "depends on the batch moves every example's gradient. Remove the hook; put any weighting into the "
                    "criterion's function"
                )
            row_example = torch.arange(rows, device=input.device) // per
            for bit in range(max(n - 1, 0).bit_length()):
                for side in (0, 1):
                    reached = reach(lambda e, b=bit, s=side: (e >> b) & 1 == s).reshape(rows, -1).ne(0).any(1)
                    wrong = reached & (((row_example >> bit) & 1) != side)
                    if bool(wrong.any()):
                        row = int(wrong.nonzero()[0])
                        raise ValueError(
                            f"row {row} of the DP criterion's input reads the output of another example than its "
                            f"own (example {row // per}: the code between the model and the criterion moves rows "
                            "across examples: a transpose of the batch dimension, a reshape that merges examples, a "
                            f"rotation of the rows); its rows must be the examples' rows in order, {per} per example, "
                            "as its targets are"
                        )


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
        self._segment = Segment()

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
        if forwards:  # the code between the model's output and this input: moves, each row one example's, in order
            self._segment.check(input, forwards)
        per = self._per_row((input, target, args, kwargs))
        if plain:
            return per.mean() if self.reduction == "mean" else per.sum()
        with torch.no_grad():  # each row's loss from its own row alone (fastdp.nn.rows), once per input signature
            self._probe.check(lambda structure, _: self._per_row(structure), self, (input.detach(), target, args,
                              kwargs), [], "the DP criterion", batch=input.shape[0])  # fmt: skip
        anchor = torch.zeros((), device=per.device, requires_grad=True)
        return _SeededReduction.apply(anchor, self.reduction == "mean", [per, input, forwards])
