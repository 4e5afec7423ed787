"""The front door's model wrapper: the user's model, whose training forwards record what the private step needs.

``PrivateModule(model, variant)`` runs each forward that needs gradients (training mode, grad enabled) so that the
optimizer's ``step()`` (:class:`fastdp.engine.DPOptimizer`) can form the variant's bounded sums from the user's own
``loss.backward()``, in one of two ways (the variant's ``front_door``):

* "ghost" (DP-SGD, DP-SGD-JL): the model's layers are converted to fastdp's DP layers in place
  (``fastdp.nn.convert``: same parameters, same ``state_dict``) and the forward runs inside a
  :class:`fastdp.nn.GhostClipping` context: every DP layer keeps its input A and registers a hook that stores its
  output gradient G when the user calls ``loss.backward()``. No weight gradient is formed by that backward (the DP
  layers use detached parameters); ``step()`` turns the recorded A and G into the clipped sums.
* "output" (clipless, weightclip, backprop: variants whose bound lives in the network): the forward is the
  variant's (``Variant.output_forward``: an input bound, a count of layer calls) and its output is handed to the
  user detached, as a leaf; ``loss.backward()`` stops there, leaving the loss's gradient at the output, and
  ``step()`` backpropagates it once through the model (``Variant.sums_of_output``). The model must return one
  batch-first tensor. Gradients the user's loss sends into the model by any other path are never used: ``step()``
  overwrites ``p.grad``.

Evaluation forwards (``eval()`` or ``torch.no_grad()``) are the plain model.

Per-example gradients and the loss: a private training forward's loss must come from the DP criterion
(:class:`fastdp.engine.DPLoss`, what ``make_private(..., criterion=...)`` returns), under either ``loss_reduction``:
its backward seeds each example's loss with the backward's own seed, so G holds each example's own loss gradient,
and any other gradient reaching the forward's DP layers is refused (:class:`fastdp.nn.ghost.Gate`, strict for every
private forward; ``DPOptimizer`` checks it at the step). A loss written by hand cannot be checked to be a sum of
per-example losses, and a batch mean in it (its 1/n) re-rounds every example's gradient when one example joins or
leaves the batch. Forwards of public data (:meth:`PrivateModule.public`) may use any loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from fastdp.algorithms.base import Variant, summed_forward
from fastdp.nn import GhostClipping, check_supported, convert
from fastdp.nn.ghost import Gate


@dataclass
class Recorded:
    """One training forward: its DP layer calls (with G once ``loss.backward()`` ran) and its number of examples."""

    records: list  # the DP layers' calls ("ghost"), or the summing layers' ("output": their gradients' sums)
    examples: int
    inputs: tuple  # the forward's (args, kwargs), for the row probe
    output: torch.Tensor | None = None  # "output": the model's output (its graph) ...
    leaf: torch.Tensor | None = None  # ... and the detached leaf the user's loss was computed from
    public: bool = False  # run under PrivateModule.public(): rows of no private example (a GAN's generated batch)
    # "ghost": (gradient edge, shape) of each of the output's tensors (fastdp.engine.loss.DPLoss)
    output_edges: tuple = ()
    gate: Gate | None = None  # who may send its DP layers their gradient (fastdp.nn.ghost.Gate)
    seeded: bool = False  # a DPLoss's backward reached it: each example's loss got that backward's seed, never 1/n
    seeds: list = field(default_factory=list)  # those seeds (a 0-d tensor per DPLoss backward; must be 1 under "mean")
    sent: list = field(default_factory=list)  # (a DPLoss criterion's input, its gradient there): backpropagate_sent

    @property
    def backpropagated(self) -> bool:
        """Whether the user's backward reached this forward (the output leaf's gradient, or a DP layer's G; a forward
        without DP layer calls counts, its step then names the parameters no DP layer covered)."""
        if self.seeded or (self.gate is not None and self.gate.foreign):  # a DPLoss, or a gated-out gradient
            return True
        if self.output is not None:
            return self.leaf.grad is not None
        return not self.records or any(r.grad is not None or r.formed is not None for r in self.records)


def _output_tensors(out) -> list[torch.Tensor]:
    """The tensors of a forward's output: pytree containers (tuples, lists, dicts, Hugging Face outputs) and
    dataclasses walked."""
    found = []
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(_output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found


def backpropagate_sent(forwards: list[Recorded]) -> None:
    """The backward of what the DPLoss criteria sent their inputs (``Recorded.sent``), through whatever lies between
    those inputs and the forwards' outputs and through the model: once, from all of them at once (each node reached
    once: an output upstream of another is not counted twice), inside every forward's gate (the only backward their
    DP layers record)."""
    sent = [item for recorded in forwards for item in recorded.sent]
    for recorded in forwards:
        recorded.sent = []
    if sent:
        with contextlib.ExitStack() as stack:
            for recorded in forwards:
                if recorded.gate is not None:
                    stack.enter_context(recorded.gate.drive())
            torch.autograd.backward([t for t, _ in sent], [g for _, g in sent])


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

    def __init__(self, module: nn.Module, variant: Variant) -> None:
        super().__init__()
        if variant.front_door not in ("ghost", "output"):
            raise ValueError(f"variant {variant.name!r} cannot be trained through the front door")
        if variant.front_door == "ghost":
            check_supported(convert(module))
        else:
            variant.prepare(module)
        self._module = module
        self._variant = variant
        self._pending: list[Recorded] = []
        self._dropped: list[Recorded] = []  # dropped by the last zero_grad(), until the next step
        self._internal_loss = False
        self._buffer_watch = None  # the step's watch on the model's buffers, from its first training forward
        self._public = False

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
        inputs = (args, kwargs)
        if self._buffer_watch is None:
            self._buffer_watch = self._variant.watch_buffers(self._module)
        if self._variant.front_door == "ghost":
            gate = Gate(strict=not self._public)  # private: only a DPLoss backpropagates into it
            with GhostClipping(examples, self._variant.form_budget, gate=gate) as ctx:
                out = self._module(*args, **kwargs)
            edges = tuple((get_gradient_edge(t), t.shape) for t in _output_tensors(out) if t.grad_fn is not None)
            self._pending.append(Recorded(ctx.records, examples, inputs, public=self._public, output_edges=edges,
                                          gate=gate))  # fmt: skip
            self._watch_internal_loss(out)
            return out
        return self._output_forward(args, kwargs, examples)

    @contextlib.contextmanager
    def public(self):
        """Training forwards in this context are of public data (rows of no private example: a GAN's generated
        batch, a public auxiliary set). Their gradients are clipped per row and released with the step's like any
        other (at no cost in privacy: they do not depend on a private example), but they do not count as the step's
        one private forward, nor as rows drawn from the private data loader. Marking private data public voids the
        guarantee for it.

            with private_discriminator.public():
                loss_fake = criterion(private_discriminator(fake.detach()), zeros)
        """
        previous, self._public = self._public, True
        try:
            yield self
        finally:
            self._public = previous

    def _watch_internal_loss(self, out) -> None:
        """A loss the model computed itself (``outputs.loss``, ``out["loss"]``: a Hugging Face model given
        ``labels``) is marked when it is backpropagated, and the step refuses it (:meth:`internal_loss_used`): fastdp
        cannot see whether it is a sum of per-example terms, and the usual one is not (a mean over the whole batch's
        tokens, whose divisor counts every example's tokens)."""
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(self._mark_internal_loss)

    def _mark_internal_loss(self, grad: torch.Tensor) -> None:
        self._internal_loss = True

    def internal_loss_used(self) -> bool:
        """Whether a model-computed loss was backpropagated since the last call (and forget it)."""
        used, self._internal_loss = self._internal_loss, False
        return used

    def _output_forward(self, args: tuple, kwargs: dict, examples: int):
        variant = self._variant
        autocast = [kind for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
        if autocast:
            raise ValueError(
                f"variant {variant.name!r} cannot train under autocast ({autocast[0]}): "
                f"{variant.low_precision_refusal}. Run its forward in fp32 (autocast is available for variant='dpsgd')"
            )
        gate = Gate(strict=not self._public)  # private: only a DPLoss backpropagates into it
        out, records = summed_forward(lambda: variant.output_forward(self._module, args, kwargs), examples, gate)
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != examples:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"variant {variant.name!r} takes its step from the gradient at the model's output, so the model must "
                f"return one tensor whose rows are the batch's {examples} examples; it returned {shape}"
            )
        leaf = out.detach().requires_grad_()
        self._pending.append(Recorded(records, examples, (args, kwargs), out, leaf, public=self._public, gate=gate))
        return leaf

    def take_recorded(self) -> list[Recorded]:
        """The training forwards since the last call (their G filled by the backward), and forget them."""
        pending, self._pending = self._pending, []
        return pending

    def check_buffers(self) -> None:
        """Refuse the step if its forwards, backward or row probe wrote a buffer of the model (a statistic of the
        batch saved with the model, unnoised: ``fastdp.nn.validate.BufferWatch``); then watch the next step's."""
        watch, self._buffer_watch = self._buffer_watch, None
        if watch is not None:
            self._variant.check_buffers(self._module, watch)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and drop what the forwards since the last step recorded, as the optimizer's
        ``zero_grad()`` does (a GAN's generator step through this model, then ``model.zero_grad()``)."""
        super().zero_grad(set_to_none=set_to_none)
        self.forget_recorded()

    def forget_recorded(self) -> None:
        """Drop what the forwards since the last step recorded (``optimizer.zero_grad()``). The buffer watch stays:
        a buffer written by a forward before ``zero_grad()`` is as released as one written after it. The dropped
        forwards are kept until the next step only to tell whether a backward reached one of them after all
        (``zero_grad()`` between the forward and ``loss.backward()``: :meth:`dropped_then_backpropagated`)."""
        self._dropped = [r for r in self._pending if not r.backpropagated]
        self._pending = []
        self._internal_loss = False

    def dropped_then_backpropagated(self) -> bool:
        """Whether a forward that ``zero_grad()`` dropped before its backward was backpropagated afterwards (and
        forget them)."""
        dropped, self._dropped = self._dropped, []
        return any(r.backpropagated for r in dropped)
