"""What every training variant provides to the trainer.

A variant turns a batch into this step's gradient (written to ``p.grad``) whose
sensitivity it knows, and names the accounting event that release was. The trainer
knows no variant by name: it builds one (:meth:`Variant.from_config`) and trains it through
the front door (``fastdp.engine``: :meth:`sums_of_backward` / :meth:`sums_of_output`, then
:meth:`release`), or, for the non-private baseline and compiled steps, calls
:meth:`Variant.gradient`, steps the optimizer and records :meth:`Variant.privacy_event`.

A step has two phases: :meth:`Variant.clipped_sum` (each example's bounded contribution, summed; no noise) and
:meth:`Variant.release` (noise once, the mean, ``p.grad``). A logical batch too large for memory is processed as
micro-batches (virtual batches): their sums are added and released once, one accounting event, the same update
as the unsplit batch.

Mixed precision and compilation live here too: :meth:`Variant.set_precision` (bf16/fp16 autocast of the model's
forward only, for the variants whose bound survives it) and :meth:`Variant.compile` (torch.compile of both phases).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from fastdp.nn.ghost import GhostClipping, output_gradients
from fastdp.nn.layers import SummedLayer, own_trainable
from fastdp.nn.rows import RowProbe, row_functional
from fastdp.nn.validate import BufferWatch, check_parameter_dtypes
from fastdp.ops import OptimizerUpdate, add_noise_, add_noise_at_, release_, summation
from fastdp.ops.summation import CompensatedSum
from fastdp.privacy.rng import NOISE_DRAWS, PrivacyKeys
from fastdp.ref.noise import stream_starts

# Training precisions: the autocast dtype of the model's forward (and thereby its backward); None is plain fp32.
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16: the summed loss is multiplied by this fixed power of two before the backward (fp16 gradients below 6e-8
# underflow to zero), and the sums are unscaled in fp32. Fixed, not dynamic: a scale adapted to overflows seen in
# past batches would be a function of the private data that no accountant counts (see ``Variant.set_precision``).
DEFAULT_LOSS_SCALE = 2.0**10
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Backends Variant.compile takes; others (e.g. dynamo's "cudagraphs") would capture CUDA graphs the step's copy-out
# and replay marking (Variant._clipped_sum_step) do not handle.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# Why variants whose bound lives inside the network refuse AMP (their low_precision_refusal starts with their own
# reason and ends with this).
SUMMED_IN_LOW_PRECISION = (
    "under autocast each weight gradient is one bf16/fp16 matmul over the whole batch, rounded to 8 (bf16) or 11 "
    "(fp16) significant bits after the examples are summed, so one example can change the rounding of the sum by "
    "up to 2^-8 (2^-11) of the batch's summed gradient: more than its bound once the batch exceeds 256 (2048) "
    "examples"
)

# Why DP-SGD, whose bound survives autocast, still refuses low-precision parameters.
LOW_PRECISION_PARAMETERS_DPSGD = (
    "its bf16/fp16 argument (set_precision) keeps fp32 parameters and runs only the forward under autocast, with the "
    "per-example norms and clip factors in fp32 and the clipped sums in float64; bf16/fp16 parameters (the norms "
    "and the update in the parameters' dtype) are not validated against the bound"
)


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


def resolve_loss_scale(precision: str, loss_scale: float | None) -> float:
    """The loss scale of a run in ``precision``: ``loss_scale`` checked (fp16: a power of two in [1, 2**24], default
    ``DEFAULT_LOSS_SCALE``), 1 for fp32/bf16 (where giving one is an error)."""
    if precision != "fp16":
        if loss_scale is not None and loss_scale != 1.0:
            raise ValueError(
                f"a loss scale ({loss_scale}) is for fp16 only: bf16 has fp32's exponent range, so nothing underflows "
                "there that scaling would save; drop the loss scale or use fp16"
            )
        return 1.0
    scale = DEFAULT_LOSS_SCALE if loss_scale is None else float(loss_scale)
    if not (math.isfinite(scale) and 1.0 <= scale <= 2.0**24 and math.frexp(scale)[0] == 0.5):
        raise ValueError(
            f"the fp16 loss scale must be a power of two in [1, 2**24] (unscaling is then exact in fp32), got "
            f"{loss_scale}; the default is {DEFAULT_LOSS_SCALE:g}"
        )
    return scale


def check_compile(mode: str | None, backend: str) -> None:
    """Refuse a torch.compile mode or backend :meth:`Variant.compile` cannot use, saying what can be used."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if backend not in COMPILE_BACKENDS:
        raise ValueError(
            f"unsupported torch.compile backend {backend!r}; choose one of {', '.join(COMPILE_BACKENDS)} (inductor "
            "generates kernels, and CUDA graphs with mode reduce-overhead; aot_eager and eager only trace, quick to "
            "check graphs with)"
        )
    if mode not in (None, "default") and backend != "inductor":
        raise ValueError(f"torch.compile mode {mode!r} is inductor's: use backend 'inductor', not {backend!r}")


class Variant(abc.ABC):
    """A training variant (DP-SGD, non-private, ...)."""

    name: ClassVar[str]
    private: ClassVar[bool]
    # Why the variant's sensitivity bound does not survive bf16/fp16 arithmetic; None where it does (the argument
    # is in the variant's module: fastdp.algorithms.dpsgd). A variant must make that argument to accept AMP.
    low_precision_refusal: ClassVar[str | None] = (
        "no argument that its sensitivity bound holds under low-precision rounding has been made for it"
    )
    # Tensor attributes that clipped_sum assigns (running counts): copied out of the CUDA-graph memory pool after
    # a replay of a compiled clipped_sum (mode "reduce-overhead"), as its returned sums are.
    _graph_state: ClassVar[tuple[str, ...]] = ()
    # How the front door (``fastdp.engine``) takes this variant's step from the user's own forward and backward:
    # "ghost" (DP layers record each layer's input A and output gradient G: :meth:`sums_of_backward`), "output" (the
    # gradient at the model's output is captured and backpropagated once through the model: :meth:`sums_of_output`),
    # None (not through the front door).
    front_door: ClassVar[str | None] = None
    # "ghost": the most bytes a DP layer call may form its per-example gradients in, in its gradient hook, in place of
    # its A and G where they are smaller (``fastdp.nn.ghost``); None: A and G are kept (what the variant's sums need).
    form_budget: ClassVar[int | None] = None

    def __init__(self, loss_fn=per_example_cross_entropy) -> None:
        self.loss_fn = loss_fn
        self.precision = "fp32"  # see set_precision
        self.loss_scale = 1.0
        self._compiled: tuple | None = None  # (clipped_sum, release, cudagraphs) after compile()

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> Variant:
        """The variant a :class:`fastdp.train.trainer.TrainConfig` asks for (the trainer knows no variant by name)."""
        raise ValueError(f"variant {cls.name!r} cannot be built from a training configuration")

    @classmethod
    def accounting_projections(cls, config) -> float:
        """JL projections r behind the clip factors under ``config`` (Bu et al. 2021); ``math.inf`` for exact
        norms, i.e. each step is a Gaussian mechanism. The accountant needs it: with finite r the sensitivity is
        random."""
        return math.inf

    @classmethod
    def check_precision(cls, precision: str) -> None:
        """Refuse an unknown precision, and bf16/fp16 for a variant whose bound low-precision rounding can break."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        if precision != "fp32" and cls.low_precision_refusal is not None:
            raise ValueError(
                f"variant {cls.name!r} cannot train in {precision}: {cls.low_precision_refusal}. Train it in fp32 "
                "(--precision fp32); bf16/fp16 autocast is available for dpsgd and nonprivate"
            )

    def set_precision(self, precision: str, loss_scale: float | None = None) -> None:
        """Run the model's forward (and thereby its backward) under ``torch.autocast`` to ``precision`` ("fp32",
        "bf16" or "fp16"); per-example norms and clip factors stay in fp32, sums and noise in float64 (see
        :meth:`_forward`).

        fp16 multiplies the summed loss by ``loss_scale`` (default ``DEFAULT_LOSS_SCALE``; a power of two, so
        unscaling in fp32 is exact) before the backward. The scale is fixed: there is no skipped step. A step that
        is skipped because its batch overflowed would reveal, without noise, that some example overflowed; each
        variant that accepts fp16 instead keeps every example's contribution bounded (DP-SGD gives an example whose
        gradient is not finite a zero contribution, a per-example operation like clipping)."""
        self.check_precision(precision)
        self.precision, self.loss_scale = precision, resolve_loss_scale(precision, loss_scale)

    def check_parameters(self, model: torch.nn.Module) -> None:
        """Refuse, for a private variant, trainable parameters that are not float32/float64 (``model.half()``,
        ``model.bfloat16()``): the model's forward and backward then run in that dtype, and each weight gradient is
        one low-precision matmul over the batch, rounded after the examples are summed, which breaks the sensitivity
        bound as autocast does for the variants that refuse it (``low_precision_refusal``; DP-SGD's autocast
        argument needs fp32 parameters and fp32 accumulation). Called by :meth:`gradient` before anything of the
        step is computed; names the offending parameters. Non-private variants (no bound) are not checked.

        Frozen (requires_grad=False) low-precision parameters are not refused: no gradient sum is formed for them;
        they round each example's own forward and backward, i.e. they change which per-example function is
        computed, as autocast's rounding does, without summing examples in low precision."""
        if self.private:
            check_parameter_dtypes(model, self.name, self.low_precision_refusal or LOW_PRECISION_PARAMETERS_DPSGD,
                                   autocast=self.low_precision_refusal is None)  # fmt: skip

    def _forward(self, model, x: torch.Tensor) -> torch.Tensor:
        """``model(x)`` (any callable of the input) under autocast to this variant's precision, the output cast to
        fp32. Every variant's model forward goes through here, so autocast covers exactly the forward and, through
        the dtypes it chose, the backward of it; the loss and everything the variant does with the backward's
        results (per-example norms, clip factors, clipped sums, noise) run outside autocast, where a matmul of fp32
        tensors stays fp32 (under autocast it would silently run in bf16/fp16)."""
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return model(x)
        with torch.autocast(x.device.type, dtype=dtype):
            out = model(x)
        return out.float()

    def compile(self, mode: str | None = None, backend: str = "inductor") -> None:
        """Run this variant's steps through ``torch.compile``: :meth:`clipped_sum` (the forward, the backward and the
        per-example work of one micro-batch) and :meth:`release` are compiled; graph breaks (the DP layers' gradient
        hooks, ``torch.func`` transforms) leave Python between the graphs, so the compiled step gives the eager one.

        ``mode`` is ``torch.compile``'s (None or "default", "reduce-overhead", "max-autotune",
        "max-autotune-no-cudagraphs"; for ``backend="inductor"``). With CUDA graphs ("reduce-overhead",
        "max-autotune") the clipped sums are captured and replayed; use fixed shapes (``--pad`` and
        ``--micro-batch``), else every new batch size records a new graph. The release is compiled without CUDA
        graphs, and noise (and JL's random tangents) are always drawn eagerly with the step's key
        (:func:`draw_eagerly`): a replayed graph can never repeat an earlier step's noise. The step index is
        specialised at the first step and dynamic from the second: the first two steps compile."""
        check_compile(mode, backend)
        cudagraphs = mode in ("reduce-overhead", "max-autotune")
        release_mode = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
        clipped_sum = torch.compile(self.clipped_sum, mode=mode, backend=backend)
        release = torch.compile(self.release, mode=release_mode, backend=backend)
        self._compiled = (clipped_sum, release, cudagraphs)

    def output_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The front door's training forward of an "output" variant (:attr:`front_door`; run in
        :func:`summed_forward`): ``model(*args, **kwargs)``, with whatever the variant enforces on it (an input
        bound, a count of layer calls)."""
        return model(*args, **kwargs)

    def sums_of_output(
        self, model: torch.nn.Module, output: torch.Tensor, grad: torch.Tensor, records: list
    ) -> list[torch.Tensor]:
        """The front door's sums of an "output" variant: the gradient of ``sum_i <output_i, grad_i>`` w.r.t. each
        trainable parameter (one backward through the model's graph, whose forward ran in :func:`summed_forward`
        and left ``records``), ``grad`` row i being example i's loss gradient w.r.t. its output row; what bounds
        each example's contribution is the variant's."""
        raise ValueError(f"variant {self.name!r} does not take its step from the gradient at the model's output")

    def row_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Modules whose input rows this variant processes one example per row (per-example norms or clipping);
        :meth:`_check_rows` checks that each row is one example. None by default: the per-example losses are
        checked for every private variant."""
        return []

    def _check_rows(self, model: torch.nn.Module, batch: Batch) -> None:
        """Private variants: refuse a model in which one example changes another's loss, or another row of a
        :meth:`row_layers` input (a sequence-first layout, an operation over the batch), by experiment, once per
        shape signature (:class:`fastdp.nn.rows.RowProbe`; outside compiled code, after each micro-batch's clipped
        sum and before the release, so a variant's own named refusals come first)."""
        if not self.private or batch.x.shape[0] < 2:
            return
        probe = self.__dict__.setdefault("_row_probe", RowProbe())

        def losses(x: torch.Tensor, size: int) -> torch.Tensor:  # size < len(batch.y): its first examples
            return self.loss_fn(self._forward(model, x), batch.y[:size])

        gradients = None
        if self.front_door == "ghost" and getattr(self, "mode", "ghost") == "ghost":  # G's rows must be examples too

            def gradients(x: torch.Tensor, size: int) -> list:
                return output_gradients(lambda: row_functional([self._forward(model, x)]), size)

        with torch.no_grad():
            probe.check(losses, model, batch.x, self.row_layers(model), f"variant {self.name!r}",
                        before=lambda: self.check_model(model), gradients=gradients)  # fmt: skip

    def check_model(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional hook, nothing by default
        """Refuse a model the variant cannot bound, naming what is wrong; run before the row probe (when one is due),
        for checks the variant otherwise makes later in the step (e.g. at the release)."""

    def prepare(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional hook, nothing by default
        """Called before every micro-batch, outside compiled code: one-time model changes (layer conversion)."""

    def _clipped_sum_step(
        self, model: torch.nn.Module, batch: Batch, step: int
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`clipped_sum`, compiled after :meth:`compile`."""
        self.prepare(model)
        if self._compiled is None:
            sums, loss = self.clipped_sum(model, batch, step)
        else:
            clipped_sum, _, cudagraphs = self._compiled
            cudagraphs = cudagraphs and batch.x.is_cuda  # inductor captures CUDA graphs on CUDA devices only
            if cudagraphs:  # a new replay: the outputs of the previous one may be overwritten from here on
                torch.compiler.cudagraph_mark_step_begin()
            sums, loss = clipped_sum(model, batch, step)
            if cudagraphs:  # CUDA-graph outputs live in the graph's pool: copy out what the step keeps
                sums, loss = [s.clone() for s in sums], loss.clone()
                for name in self._graph_state:
                    value = getattr(self, name)
                    if isinstance(value, torch.Tensor):
                        setattr(self, name, value.clone())
        self._check_rows(model, batch)  # after the variant's own (named) refusals, before anything is released
        return sums, loss

    def _release_step(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        """:meth:`release`, compiled after :meth:`compile`."""
        (self.release if self._compiled is None else self._compiled[1])(model, sums, step)

    @abc.abstractmethod
    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(sum over the real examples of ``batch`` of each one's bounded gradient contribution, per trainable
        parameter in ``sum_dtype``; their summed loss, a detached scalar). No noise. Called once per micro-batch of
        a logical batch, all with the logical step's index ``step`` (e.g. JL tangents are keyed by it)."""

    @abc.abstractmethod
    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        """Noise, once per logical step (keyed by ``step``), on the logical batch's ``sums``; set every trainable
        parameter's ``p.grad`` to the released mean. ``sums`` may be modified in place."""

    def gradient(
        self, model: torch.nn.Module, batch: Batch | Sequence[Batch], step: int, all_reduce_sum=None
    ) -> torch.Tensor:
        """Set ``p.grad`` of every trainable parameter to this step's gradient.

        ``batch`` is the logical batch, or its micro-batches (virtual batches: sums added, one release). ``step`` is
        the global step index (keys the noise). ``all_reduce_sum`` (data-parallel training, see :meth:`reduce`):
        ``batch`` is this process's shard of the logical batch, and the sums are reduced over the processes before
        the release. Returns the summed loss of the real examples (a detached scalar tensor; no host
        synchronisation; the global batch's under ``all_reduce_sum``)."""
        batches = [batch] if isinstance(batch, Batch) else list(batch)
        if not batches:
            raise ValueError(
                "a logical batch needs at least one (possibly empty) micro-batch: the noise is released "
                "every step, also for an empty Poisson sample"
            )
        self.check_parameters(model)  # every step, before anything is computed: dtypes can change between steps
        for p in trainable_parameters(model):  # overwritten at the release: not held through the forward and backward
            p.grad = None
        self.prepare(model)
        watch = self.watch_buffers(model)
        sums, loss = self._clipped_sum_step(model, batches[0], step)
        if len(batches) > 1:  # micro-batches' sums added by TwoSum (fastdp.ops.summation): bounded rounding
            totals = [CompensatedSum().add_(s) for s in sums]
            for micro in batches[1:]:
                more, more_loss = self._clipped_sum_step(model, micro, step)
                for total, part in zip(totals, more, strict=True):
                    total.add_(part)
                loss = loss + more_loss
            sums = [total.value() for total in totals]
        self.check_buffers(model, watch)
        if all_reduce_sum is not None:
            loss = self.reduce(sums, loss, all_reduce_sum)
        self._release_step(model, sums, step)
        return loss

    def watch_buffers(self, model: torch.nn.Module) -> BufferWatch:
        """A watch on the model's buffers for one step (``fastdp.nn.validate.BufferWatch``), by value on the model's
        first step; :meth:`check_buffers` refuses the step, before its release, if the step wrote one."""
        probed = self.__dict__.setdefault("_buffers_probed", weakref.WeakSet())
        return BufferWatch(model, values=model not in probed)

    def check_buffers(self, model: torch.nn.Module, watch: BufferWatch) -> None:
        if not self.private:  # non-private training releases the batch's statistics like everything else
            return
        watch.check(f"variant {self.name!r}")
        self.__dict__["_buffers_probed"].add(model)

    def reduce(self, sums: list[torch.Tensor], loss: torch.Tensor, all_reduce_sum) -> torch.Tensor:
        """Data-parallel training (``fastdp.engine.distributed``), between :meth:`clipped_sum` and :meth:`release`:
        turn this process's ``sums`` (in place) and summed ``loss`` into the global batch's, and return that loss.
        ``all_reduce_sum(tensors)`` sums each tensor over the processes, in place (one collective per dtype, so
        the list must have the same dtypes on every process). A variant whose release reads more of the batch
        than the sums (the non-private mean's example count) reduces that here too. No noise: the release adds it
        once, to the global sums."""
        dtype = next((t.dtype for t in sums if t.is_floating_point()), torch.float32)  # the same on every process
        total = loss.detach().to(dtype).reshape(1).clone()
        all_reduce_sum([*sums, total])
        return total.reshape(()).to(loss.dtype)

    def after_step(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional hook, nothing by default
        """Called after the optimizer step (e.g. a projection onto the constraint set: post-processing)."""

    def checkpoint_state(self) -> dict:
        """State a resumed run needs beyond the model, the optimizer and the accountant (e.g. an adaptive clip value):
        plain values, saved in the trainer's checkpoint. Nothing by default."""
        return {}

    def restore_checkpoint_state(self, state: dict) -> None:  # noqa: B027 - optional hook, nothing by default
        """Adopt :meth:`checkpoint_state` of the run being resumed (checked: a checkpoint is a file from outside)."""

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
    """Gradient sums and their noise are float64 until the noisy result is cast to the parameter's dtype: the sums'
    rounding is bounded in float64 (``fastdp.ops.summation``), and rounding a sum before the noise would make the
    release depend on the data beyond the sensitivity bound; after the noise it is post-processing."""
    return torch.float64


def summed_loss_gradients(
    model: torch.nn.Module, loss_fn, batch: Batch, forward=None, loss_scale: float = 1.0
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(gradient of the summed loss of the real examples w.r.t. each trainable parameter, in ``sum_dtype``; that
    summed loss). One ordinary backward, its sums over the batch in float32: for the non-private baseline (the
    private variants' sums have bounded rounding: :func:`bounded_gradient_sums`, DP-SGD's clipped sums).

    ``forward(model, x)`` runs the model (default ``model(x)``; a variant passes its ``_forward``, which applies
    autocast); the backward is of ``loss_scale`` times the summed loss, and the gradients are divided by it in fp32
    (fp16 loss scaling)."""
    params = trainable_parameters(model)
    if batch.x.shape[0] == 0:
        return [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params], torch.zeros((), device=batch.x.device)
    losses = loss_fn(model(batch.x) if forward is None else forward(model, batch.x), batch.y) * batch.mask
    grads = torch.autograd.grad(losses.sum() * loss_scale if loss_scale != 1.0 else losses.sum(), params,
                                allow_unused=True)  # fmt: skip
    sums = [torch.zeros_like(p, dtype=sum_dtype(p)) if g is None else g.to(sum_dtype(p))
            for p, g in zip(params, grads, strict=True)]  # fmt: skip
    if loss_scale != 1.0:
        torch._foreach_div_(sums, loss_scale)
    return sums, losses.detach().sum()


def summed_forward(forward, examples: int, gate=None) -> tuple[torch.Tensor, list]:
    """(``forward()``, its records): the forward in a summing :class:`fastdp.nn.GhostClipping`, where the layers of the
    variants whose bound lives in the network (``fastdp.nn.layers.SummedLayer``) record themselves and will sum their
    parameters' gradients over the batch in float64 in the backward (:func:`bounded_gradient_sums`). ``gate``: the
    front door's (``fastdp.nn.ghost.Gate``)."""
    with GhostClipping(examples, sums=True, gate=gate) as ctx:
        output = forward()
    return output, ctx.records


def bounded_gradient_sums(
    model: torch.nn.Module, records: list, outputs: torch.Tensor, grad_outputs: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """The gradient of ``outputs`` (a scalar, or weighted by ``grad_outputs``) w.r.t. each trainable parameter, float64,
    after one backward through the graph of :func:`summed_forward`: each parameter's sum over the batch as its
    layers formed it (float64 chunks added by TwoSum, ``fastdp.ops.summation``: one example moves it by at most its
    bound times ``1 + sensitivity_slack``), zero for parameters the forward did not use. Refuses trainable
    parameters outside such layers (an ordinary backward would sum their gradient in float32, unbounded)."""
    refuse_unsummed(model)
    params = trainable_parameters(model)
    escaped: list[torch.nn.Parameter] = []  # parameters the backward reached outside a summing layer's record
    handles = [p.register_hook(lambda grad, p=p: escaped.append(p)) for p in params]
    try:
        if outputs.requires_grad:
            torch.autograd.backward(outputs, grad_outputs)
    finally:
        for handle in handles:
            handle.remove()
    if escaped:
        names = {id(p): name for name, p in model.named_parameters()}
        listed = ", ".join(dict.fromkeys(names.get(id(p), "?") for p in escaped))
        raise ValueError(
            f"the gradient of {listed} reached it outside a fastdp layer that sums it over the batch in float64 (a "
            "subclass overriding the layer's forward, or the parameter used directly by other code, e.g. a tied "
            "weight read by another module): that part would be an ordinary float32 batch sum with no bound on its "
            "rounding (and, under backprop clipping, unclipped). Use each trainable parameter only through its "
            "fastdp layer's own forward"
        )
    sums: dict[int, CompensatedSum] = {}
    for record in records:
        for p, part in zip(record.layer.dp_parameters(), record.sums or (), strict=False):
            sums.setdefault(id(p), CompensatedSum()).add_(part.value())
    return [sums[id(p)].value() if id(p) in sums else torch.zeros_like(p, dtype=torch.float64)
            for p in params]  # fmt: skip


def refuse_unsummed(model: torch.nn.Module) -> None:
    """Refuse trainable parameters held by a module that does not sum their gradient over the batch itself
    (``fastdp.nn.layers.SummedLayer``), for the variants whose bound lives in the network."""
    held = [(name or "<model>", type(m).__name__) for name, m in model.named_modules()
            if own_trainable(m) and not isinstance(m, SummedLayer)]  # fmt: skip
    if held:
        listed = ", ".join(f"{name} ({kind})" for name, kind in held)
        raise ValueError(
            f"trainable parameters in {listed}: the variants whose per-example bound lives in the network (clipless, "
            "weightclip, backprop) release their parameters' gradient summed over the batch, which fastdp's own "
            "layers sum in float64 with a bounded rounding (a float32 sum over the batch, as an ordinary backward "
            "forms it, is re-rounded by every example: one example can move it beyond its bound). Build the "
            "trainable part from fastdp.nn.lipschitz / fastdp.nn.weightclip layers (LipschitzLinear, "
            "LipschitzConv2d, AddBias, WeightClipConv2d) or, for backprop, torch Linear/Conv2d layers, and freeze "
            "the rest (requires_grad=False)"
        )


def rounding_noise_factor(num_examples: int) -> float:
    """``1 + sensitivity_slack`` (rounded up) for batches of at most ``num_examples`` examples: how much the float64
    batch sums of :func:`bounded_gradient_sums` can add to one example's bound, which the noise of those variants
    is scaled by (``fastdp.ops.summation``)."""
    return math.nextafter(1 + summation.sensitivity_slack(num_examples, summation.world_size()), math.inf)


class FusedOptimizerStep(Protocol):
    """An optimizer step the release may apply in its own pass over the parameters (:func:`fused_optimizer_step`;
    ``fastdp.engine`` builds one from the user's torch.optim.SGD, Adam or AdamW)."""

    applied: bool  # set by the release that applied it: the caller then skips the optimizer's own step

    def updates(self, params: list[torch.nn.Parameter], sums: list[torch.Tensor]) -> list[OptimizerUpdate] | None:
        """The updates of ``params`` (released from ``sums``, in that order), their optimizer state initialised and
        this step counted; None (nothing changed) where the step cannot be fused."""


_FUSED_STEP: contextvars.ContextVar[FusedOptimizerStep | None] = contextvars.ContextVar("fastdp_fused_step",
                                                                                         default=None)  # fmt: skip


@contextlib.contextmanager
def fused_optimizer_step(step: FusedOptimizerStep):
    """Within the block, a release (:func:`release_noisy_mean`) applies ``step`` in the same pass as the noise and
    the division (one read and write of each parameter and state, instead of one per operation) and sets
    ``step.applied``; a release that cannot (weight-dependent stds, ``step.updates`` None) leaves it to the caller."""
    token = _FUSED_STEP.set(step)
    try:
        yield
    finally:
        _FUSED_STEP.reset(token)


def release_noisy_mean(
    params: list[torch.nn.Parameter],
    sums: list[torch.Tensor],
    stds: list[float] | torch.Tensor,
    expected_batch_size: float,
    keys: PrivacyKeys,
    step: int,
    extra: tuple[torch.Tensor, float] | None = None,
) -> None:
    """p.grad = (sum + N(0, std^2)) / (q N) for each parameter: the noise is keyed by ``keys.noise_key(step)`` (OS
    entropy by default; a reproducible key refuses a step it already released) and every value is a 4-draw sum
    (``fastdp.privacy.rng``); the divisor is the expected batch size, never the realised one. Noise and division
    are one pass (``fastdp.ops.release_``), with the optimizer's update inside :func:`fused_optimizer_step`.

    ``stds`` may be a tensor on the sums' device (stds that depend on the weights, e.g. Lipschitz bounds): the
    noise is then added as ``std * (sum / std + N(0, 1))``, the same Gaussian mechanism, with the std never read
    on the host (no synchronisation). A zero std there is treated as 1e-30 (its sum is 0 by its bound).

    ``extra`` = (tensor, std): one more statistic released in the same draw (tensor stds only), e.g. the count of
    examples under a clip value (``fastdp.algorithms.clipless``): noised and divided in place like the sums, not
    assigned to a gradient."""
    if isinstance(stds, torch.Tensor):
        scale = [s.to(total.dtype) for s, total in zip(stds.clamp_min(1e-30).unbind(), sums, strict=True)]
        noised = list(sums)
        if extra is not None:
            noised.append(extra[0])
            scale.append(torch.full((), max(extra[1], 1e-30), dtype=extra[0].dtype, device=extra[0].device))
        torch._foreach_div_(noised, scale)
        _add_noise(noised, [1.0] * len(noised), keys, step)
        torch._foreach_mul_(noised, scale)
        if expected_batch_size != 1.0:  # 1.0: the caller folded the division into the sums and stds
            torch._foreach_div_(noised, expected_batch_size)
    elif extra is not None:
        raise ValueError("release_noisy_mean: an extra statistic needs tensor stds")
    else:
        _release(params, sums, stds, expected_batch_size, keys, step)
    for p, total in zip(params, sums, strict=True):
        p.grad = total.to(p.dtype)  # cast after the noise: post-processing


def _release(params: list[torch.nn.Parameter], sums: list[torch.Tensor], stds: list[float], scale: float,
             keys: PrivacyKeys, step: int) -> None:  # fmt: skip
    if torch.compiler.is_compiling():  # drawn eagerly, outside any graph (see draw_eagerly)
        _release_eagerly(params, sums, stds, scale, keys, step)
        return
    if any(s.dtype == torch.float64 and p.dtype != torch.float64 for p, s in zip(params, sums, strict=True)):
        _add_noise(sums, stds, keys, step)  # float64 sums of lower-precision parameters: noise, then the mean
        if scale != 1.0:
            torch._foreach_div_(sums, scale)
        return
    seed, offset = keys.noise_key(step)  # here, eagerly: a graph never captures a key
    fused = _FUSED_STEP.get()
    updates = fused.updates(params, sums) if fused is not None else None
    release_(sums, stds, scale, seed, offset, NOISE_DRAWS, updates or ())
    if updates is not None:
        fused.applied = True


def _add_noise(sums: list[torch.Tensor], stds: list[float], keys: PrivacyKeys, step: int) -> None:
    if torch.compiler.is_compiling():  # drawn eagerly, outside any graph (see draw_eagerly)
        _add_noise_eagerly(sums, stds, keys, step)
        return
    seed, offset = keys.noise_key(step)  # here, eagerly: a graph never captures a key
    wide = [s.dtype == torch.float64 for s in sums]
    if not any(wide):
        add_noise_(sums, stds, seed=seed, offset=offset, num_draws=NOISE_DRAWS)
        return
    # float64 sums (fastdp.ops.summation): their noise drawn by the float32 kernel (no float64 draws: the
    # reference's, several passes), then added in float64 before any cast. Each element takes its own place in the
    # stream of the whole list (add_noise_at_), so the values are add_noise_'s whatever the pieces; the pieces go
    # through one float32 buffer of NOISE_BLOCK elements or 1/64 of the sums, whichever is larger (a float32 copy of
    # every sum held at once made DP-SGD-JL's release the step's peak: tests/test_jl_memory.py)
    starts = stream_starts([s.numel() for s in sums])
    narrow = [t for t, w in enumerate(wide) if not w]
    if narrow:
        add_noise_at_([sums[t] for t in narrow], [stds[t] for t in narrow], [starts[t] for t in narrow], seed,
                      offset, NOISE_DRAWS)  # fmt: skip
    dense = {t: sums[t] if sums[t].is_contiguous() else sums[t].contiguous() for t, w in enumerate(wide) if w}
    wide_sums = [(d.view(-1), stds[t], starts[t]) for t, d in dense.items()]
    total = sum(flat.numel() for flat, _, _ in wide_sums)
    block = max(NOISE_BLOCK, (total // 64 + 3) // 4 * 4)  # a multiple of 4: every piece starts where a draw does
    buffer = torch.empty(min(block, total), dtype=torch.float32, device=sums[0].device)
    group: list[tuple[torch.Tensor, float, int]] = []
    used = 0
    for flat, std, start in wide_sums:
        for k in range(0, flat.numel(), block):
            piece = flat[k : k + block]
            if used + piece.numel() > block:
                _add_drawn(group, buffer, seed, offset)
                group, used = [], 0
            group.append((piece, std, start + k))
            used += piece.numel()
    if group:
        _add_drawn(group, buffer, seed, offset)
    for t, d in dense.items():
        if d is not sums[t]:  # a strided sum (e.g. a transposed GEMM's): its elements in row-major stream order
            sums[t].copy_(d)


NOISE_BLOCK = 1 << 16  # float32 elements of the buffer float64 sums' noise is drawn through, at least


def _add_drawn(group: list[tuple[torch.Tensor, float, int]], buffer: torch.Tensor, seed: int, offset: int) -> None:
    """Draw each (float64 piece, std, stream start)'s noise into its part of ``buffer`` and add it to the piece."""
    drawn, at = [], 0
    for piece, _, _ in group:
        drawn.append(buffer[at : at + piece.numel()].zero_())
        at += piece.numel()
    add_noise_at_(drawn, [std for _, std, _ in group], [start for _, _, start in group], seed, offset, NOISE_DRAWS)
    for (piece, _, _), d in zip(group, drawn, strict=True):
        piece.add_(d)


def draw_eagerly(fn):
    """``fn`` run outside torch.compile graphs (a graph break around the call): for draws keyed by the step. A
    graph captured as a CUDA graph would replay the key it was recorded with, so every step would get the first
    step's noise; eagerly, each call draws with the key it is given."""
    return torch.compiler.disable(fn, recursive=True)


_add_noise_eagerly = draw_eagerly(_add_noise)
_release_eagerly = draw_eagerly(_release)
