"""Book-keeping for DP-SGD in one forward and one backward (Bu et al. 2023, "book-keeping" BK).

Inside a :class:`GhostClipping` context, every fastdp DP layer computes its output with
*detached* parameters and registers a gradient hook on it. One backward of the summed
per-example losses then hands each layer its output gradient G (rows are per-example,
because the loss is a sum over examples and no layer mixes examples); no weight
gradient is formed. A hook registered before an in-place op on the output (ReLU(inplace=True))
receives the gradient of the value before that op, which is the G wanted. From each layer's saved input A
and G the layer gives its per-example squared gradient norm without materialising
per-example gradients (||a_i||^2 ||g_i||^2, or the ghost norm <A_i A_i^T, G_i G_i^T>),
the clip factors follow, and each layer's clipped sum is one GEMM A^T (c * G).

A layer called several times in one forward records each call; a parameter several calls use (a layer called twice,
tied weights) gets the sum of its uses' per-example gradients, normed with their cross terms (``fastdp.nn.forms``).

Memory (``form_budget``, what DP-SGD passes): keeping every layer's A and G until the backward ends costs more than a
non-private backward, which frees each G as it goes. A layer call whose per-example gradients take no more bytes than
its A and G (a GroupNorm's or LayerNorm's affine parameters always; a Linear or convolution with many positions and
few parameters; at most ``form_budget`` bytes) forms them in its gradient hook, in the accumulation dtype, and drops
A and G: the record then holds ``formed``, the very tensors whose norms and weighted sums the step takes (what the
direct path computes after the backward, computed earlier). Forming is linear in G, so it needs G whole: a second
backward through the same forward is refused for such a record.

The context lives for one step only: nothing is registered on the model.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from fastdp.nn.forms import dense
from fastdp.ops.summation import CompensatedSum

_state = threading.local()
_summing = 0  # summing contexts open in any thread (summing_anywhere)
_summing_lock = threading.Lock()


@dataclass
class Gate:
    """Who may send one forward's DP layers their gradient G. The front door (``fastdp.engine``: every private
    forward's loss comes from ``fastdp.engine.loss.DPLoss``) makes its private forwards ``strict``: only the backward
    the DP criterion drives (``driving``) reaches their records; a gradient arriving otherwise (another term of the
    loss, by any path into the model) is not recorded and marks ``foreign``, and the step is refused. While
    ``measuring`` (the criterion's own backward, which stops at its input but fires the hook of a DP layer whose
    output that input is), arriving gradients are ignored."""

    strict: bool = False
    driving: int = 0
    measuring: int = 0
    foreign: bool = False

    def admits(self) -> bool:
        if self.measuring:
            return False
        if self.strict and not self.driving:
            self.foreign = True
            return False
        return True

    @contextlib.contextmanager
    def drive(self):
        self.driving += 1
        try:
            yield
        finally:
            self.driving -= 1

    @contextlib.contextmanager
    def measure(self):
        self.measuring += 1
        try:
            yield
        finally:
            self.measuring -= 1


@dataclass
class Record:
    """One DP layer call: the layer, what it saved (detached), its output's shape and dtype, and G once the backward
    ran."""

    layer: torch.nn.Module
    saved: tuple | None
    shape: torch.Size
    dtype: torch.dtype
    grad: torch.Tensor | None = None
    form_budget: int | None = None  # see the module docstring
    formed: list[torch.Tensor] | None = None  # per-example gradients of ``layer.dp_parameters()``, A and G dropped
    formed_from_half: bool = False  # whether the A or G that ``formed`` came from had a dtype below float32
    summed: bool = False  # a summing context's record (:class:`GhostClipping`, ``sums``) ...
    sums: list[CompensatedSum] | None = None  # ... and the batch's gradient of each of ``layer.dp_parameters()``
    gate: Gate | None = None  # the forward's (:class:`Gate`), where the front door restricts who backpropagates
    versions: tuple = ()  # the saved tensors' version counters when the layer ran (:meth:`check_saved`)

    def __post_init__(self) -> None:
        self.versions = tuple(t._version for t in _tensors(self.saved))

    def check_saved(self) -> None:
        """Refuse a saved input changed in place after the layer ran (``h.sub_(h.mean(0))`` after the layer read
        ``h``: the step would norm and sum the changed rows, which another example may have written; a review
        measured 258 C), as torch refuses a tensor its backward saved."""
        if self.saved is not None and tuple(t._version for t in _tensors(self.saved)) != self.versions:
            raise RuntimeError(
                f"the input a DP layer ({type(self.layer).__name__}) saved for the private step was modified by an "
                "in-place operation after the layer ran: the per-example gradients would be formed from the changed "
                "values, not from what the layer computed with. Use an out-of-place operation (h = h - m, not "
                "h.sub_(m)) on tensors a layer has read"
            )

    def _capture(self, grad: torch.Tensor) -> None:
        if self.gate is not None and not self.gate.admits():
            return
        self.check_saved()
        if self.summed:
            self._sum(grad)
            return
        if self.formed is not None:
            raise RuntimeError(
                f"a second backward through one forward reached a {type(self.layer).__name__} whose per-example "
                "gradients were formed in the first (DP-SGD keeps them instead of its input and output gradient): "
                "sum the losses and call backward once per forward"
            )
        self.grad = grad if self.grad is None else self.grad + grad
        if self.form_budget is not None:
            self._form()

    @torch.no_grad()
    def _sum(self, grad: torch.Tensor) -> None:
        """A summing context's record (:class:`GhostClipping`, ``sums``): the layer's float64 gradient sums of this
        G added to the record's (sums are linear in G: a second backward adds its part); G is not kept."""
        parts = self.layer.grad_sums(self.saved, grad)
        if self.sums is None:
            self.sums = [CompensatedSum() for _ in parts]
        for total, part in zip(self.sums, parts, strict=True):
            total.add_(part)

    @torch.no_grad()
    def _form(self) -> None:
        """Form the per-example gradients in place of A and G where they take no more memory (module docstring)."""
        grad, params = self.grad, self.layer.dp_parameters()
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        size = grad.shape[0] * sum(p.numel() for p in params) * acc.itemsize
        kept = grad.numel() * grad.element_size() + sum(t.numel() * t.element_size() for t in _tensors(self.saved))
        if not params or size > kept or size > self.form_budget:
            return
        with torch.autocast(grad.device.type, enabled=False):
            forms = self.layer.per_example_forms(self.saved, grad)
            self.formed = [dense(f, p.shape, acc) for f, p in zip(forms, params, strict=True)]
        self.formed_from_half = any(
            t.is_floating_point() and t.element_size() < 4 for t in [grad, *_tensors(self.saved)]
        )
        self.saved, self.grad = None, None


class GhostClipping:
    """Context of one DP-SGD step's forward: DP layers record themselves here instead of producing weight grads."""

    def __init__(
        self, batch: int | None = None, form_budget: int | None = None, sums: bool = False, gate: Gate | None = None
    ) -> None:
        self.records: list[Record] = []
        self.gate = gate  # given to every record (:class:`Gate`)
        self.batch = batch  # the number of examples of the forward, where known (an index shared by them is expanded)
        self.form_budget = form_budget  # per-example gradients formed in the hooks, within it (module docstring)
        # a summing context (clipless, weight clipping, backpropagation clipping): the layers of those variants
        # (``fastdp.nn.layers.SummedLayer``) record themselves and sum their gradients over the batch in float64 in
        # their hooks; DP layers run as torch's (their parameters' gradients are then unbounded: the variants refuse
        # them)
        self.sums = sums

    @torch.compiler.disable
    def tap(self, layer: torch.nn.Module, saved: tuple, output: torch.Tensor) -> torch.Tensor:
        """Register a layer call; returns ``output`` with a hook that stores its gradient G in the record.

        Never compiled (``torch.compiler.disable``: a graph break per layer under torch.compile): it is Python
        bookkeeping and a hook registration, and tracing it would guard on this step's records."""
        if not torch.is_grad_enabled() or _checkpointing():
            raise RuntimeError(
                f"a DP layer ({type(layer).__name__}) ran without gradients inside a private training forward: "
                "activation checkpointing (torch.utils.checkpoint, a Hugging Face model's "
                "gradient_checkpointing_enable()) runs layers without gradients and recomputes them in the backward, "
                "outside the forward fastdp records, and a layer with trainable parameters under torch.no_grad() "
                "inside the forward takes no part in the step. Disable the checkpointing (BatchMemoryManager bounds "
                "the memory instead), and keep no_grad parts of the model frozen or in eval() mode"
            )
        record = Record(layer, saved, output.shape, output.dtype, form_budget=self.form_budget, summed=self.sums,
                        gate=self.gate)  # fmt: skip
        if not output.requires_grad:
            # First layer: neither input nor (detached) parameters need grad. A non-leaf copy keeps in-place
            # ops on the output (ReLU(inplace=True)) legal.
            output = output.requires_grad_().clone()
        output.register_hook(record._capture)
        self.records.append(record)
        return output

    def __enter__(self) -> GhostClipping:
        global _summing
        if getattr(_state, "context", None) is not None:
            raise RuntimeError("GhostClipping contexts do not nest")
        _state.context = self
        if self.sums:
            with _summing_lock:
                _summing += 1
        return self

    def __exit__(self, *exc) -> None:
        global _summing
        _state.context = None
        if self.sums:
            with _summing_lock:
                _summing -= 1


def _checkpointing() -> bool:
    """Whether a non-reentrant torch.utils.checkpoint region is running (its saved-tensor hooks are the innermost):
    read from torch's internals, so False wherever they are not as in torch 2.x."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return bool(hooks) and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a layer's saved tuple (nested tuples and lists walked, anything else skipped)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def active_context() -> GhostClipping | None:
    """The GhostClipping context of the current thread, if a DP-SGD (or JL) step's forward is running: DP layers
    record themselves in it."""
    ctx = getattr(_state, "context", None)
    return None if ctx is None or ctx.sums else ctx


def summing_anywhere() -> bool:
    """Whether a summing context is open in any thread: a module-level count, which torch.compile guards by value
    (``fastdp.nn.layers.SummedLayer``); the thread's own context is :func:`summing_context`."""
    return _summing > 0


def summing_context() -> GhostClipping | None:
    """The summing GhostClipping context (``sums``) of the current thread, if the forward of a step of a variant whose
    bound lives in the network is running: ``fastdp.nn.layers.SummedLayer`` layers record themselves in it."""
    ctx = getattr(_state, "context", None)
    return ctx if ctx is not None and ctx.sums else None


def output_gradients(scalar_of, batch: int | None = None) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """``(layer, G)`` of every DP layer call in one forward and one backward of ``scalar_of()`` (a scalar computed by
    a forward of the model on ``batch`` examples), in call order: what the row probe (``fastdp.nn.rows``) compares
    between two batches."""
    with torch.enable_grad(), GhostClipping(batch) as ctx:
        total = scalar_of()
        if total.requires_grad:
            total.backward()
    return [(r.layer, r.grad if r.grad is not None else torch.zeros(r.shape, dtype=r.dtype)) for r in ctx.records]
