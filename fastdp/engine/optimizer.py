"""The front door's optimizer: the user's optimizer, whose ``step()`` releases one private gradient.

``DPOptimizer(optimizer, module, variant, ...)`` wraps any ``torch.optim.Optimizer`` (its ``param_groups`` and
``state`` are the original's, so learning-rate schedulers and ``state_dict`` work). ``step()``:

1. takes what the model's training forwards since the last step recorded (:class:`fastdp.engine.PrivateModule`:
   each DP layer's A and, after ``loss.backward()``, G; or, for the variants whose bound lives in the network, the
   loss's gradient at the model's output), G being each example's own loss gradient: a private forward's loss must
   come from the DP criterion (``fastdp.engine.DPLoss``, under either ``loss_reduction``), which seeds every
   example's loss with the backward's seed, never with a batch mean's 1/n;
2. asks the variant for the bounded sums of that backward (``Variant.sums_of_backward``: DP-SGD's certified ghost
   norms, DP-SGD-JL's projections; ``Variant.sums_of_output``: clipless and weightclip clip the output gradient to
   the loss's Lipschitz constant, backprop's layers clip inputs and upstream gradients, in one backward through the
   model). One backpropagated training forward per ``step()`` call: with several, an example seen by two of them
   (two views of a batch, an attack crafted in training mode) would count twice, so they are refused; a larger
   batch is split into physical batches, each its own (skipped) step, whose sums add up (``BatchMemoryManager``);
3. unless the step is skipped (a virtual step of a larger logical batch, :meth:`signal_skip_step`), checks once per
   input signature that every row is one example (``fastdp.nn.rows``, for any batch-first inputs), adds the noise
   once with the step's key (the variant's ``release``: the same code and keys as the variant API, so the released
   gradient equals it for the same batch and key), sets ``p.grad`` to the noisy mean over the expected batch size
   (``loss_reduction="mean"``) or the noisy sum (``"sum"``, as Opacus), runs the original optimizer's step and records
   one accounting event (torch.optim.SGD, Adam and AdamW: their update applied in the release's own pass over the
   parameters, ``fastdp.engine.fused``). ``grad_reduction`` (not offered by ``make_private``; ``fastdp.train``'s
   trainer passes ``loss_reduction="sum", grad_reduction="mean"``) decouples what ``p.grad`` is from the loss's
   reduction.

Data-parallel (under ``torchrun``, ``parallel``): each process computes the bounded sums of its shard of the global
Poisson batch, the sums are all-reduced before the release, and the noise is added once: with OS-entropy keys rank 0's
released gradient replaces the others' (JL: rank 0's tangent key is shared before the sums), with a reproducible
seed every rank draws the same noise (``fastdp.engine.distributed``).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten

from fastdp.algorithms.base import Variant, fused_optimizer_step, sum_dtype, trainable_parameters
from fastdp.algorithms.dpsgd import GhostBackward
from fastdp.engine.fused import TorchOptimizerStep, fusable
from fastdp.engine.module import PrivateModule, Recorded, backpropagate_sent
from fastdp.nn import check_supported
from fastdp.nn.ghost import output_gradients
from fastdp.nn.rows import RowProbe, _rows_of, row_functional
from fastdp.ops.summation import CompensatedSum

LOSS_REDUCTIONS = ("mean", "sum")


def _delegated(name: str) -> property:
    """An attribute read from and written to the original optimizer."""
    return property(lambda self: getattr(self.original_optimizer, name),
                    lambda self, value: setattr(self.original_optimizer, name, value))  # fmt: skip


class DPOptimizer(Optimizer):
    """See the module docstring. ``accountant`` (a :class:`fastdp.privacy.PrivacyAccountant`) records each released
    step; ``projections`` is the variant's JL r (``math.inf`` for exact norms)."""

    def __init__(
        self,
        optimizer: Optimizer,
        module: PrivateModule,
        variant: Variant,
        accountant,
        loss_reduction: str = "mean",
        projections: float = float("inf"),
        parallel=None,
        *,
        grad_reduction: str | None = None,
        fuse_step: bool = True,
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {', '.join(LOSS_REDUCTIONS)}, got {loss_reduction!r}")
        grad_reduction = loss_reduction if grad_reduction is None else grad_reduction
        if grad_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"grad_reduction must be one of {', '.join(LOSS_REDUCTIONS)}, got {grad_reduction!r}")
        model_params = {id(p) for p in trainable_parameters(module._module)}
        opt_params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not opt_params <= {id(p) for p in module._module.parameters()}:
            raise ValueError("the optimizer holds parameters that are not the private model's: give make_private the "
                             "optimizer of this model's parameters")  # fmt: skip
        missing = model_params - opt_params
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters of the model are not in the optimizer: their noisy gradients "
                "would be released and never used. Freeze them (requires_grad=False) or add them to the optimizer"
            )
        self.original_optimizer = optimizer
        self.module, self.variant, self.accountant = module, variant, accountant
        self.loss_reduction = loss_reduction
        # what p.grad is: "mean" (the noisy sum over the expected batch size, the variant's release) or "sum"
        self.grad_reduction = grad_reduction
        self.projections = projections
        self.steps_taken = 0  # released steps: the index that keys the noise
        self._sums: list[torch.Tensor] | None = None
        self._skip_next = False
        self._probe = RowProbe()
        self.parallel = parallel  # a fastdp.engine.distributed.DataParallel under torchrun, else None
        self._tangents_shared_for: int | None = None
        # make_private's DPDataLoader: a step's forwards may have no more rows than the examples it drew since the
        # last release (a batch concatenated with its own copy, or used for two steps, would count examples twice)
        self.data_loader = None
        self._rows_since_release = 0
        self._drawn_at_release = 0
        self._pending_batch: int | None = None  # the loader's batch count when the pending sums began
        # torch.optim.SGD / Adam / AdamW steps applied inside the release's pass (fastdp.engine.fused); False: the
        # optimizer's own step() after the release
        self.fuse_step = fuse_step

    # -- torch.optim.Optimizer surface: the original optimizer's
    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("add a parameter group before make_private: the private step covers the parameters the "
                         "model had when it was made private")  # fmt: skip

    def state_dict(self) -> dict:
        return {"optimizer": self.original_optimizer.state_dict(), "steps_taken": self.steps_taken}

    def load_state_dict(self, state_dict: dict) -> None:
        self.original_optimizer.load_state_dict(state_dict["optimizer"])
        self.steps_taken = int(state_dict["steps_taken"])

    def __repr__(self) -> str:
        return f"DPOptimizer({self.variant.name}, {self.original_optimizer!r})"

    # -- Opacus' names
    @property
    def noise_multiplier(self) -> float:
        return self.variant.noise_multiplier

    @property
    def max_grad_norm(self):
        return self.variant.clip_norm

    @property
    def expected_batch_size(self) -> float:
        return self.variant.expected_batch_size

    @property
    def has_pending_sums(self) -> bool:
        """Whether clipped sums of skipped (virtual) steps wait for their logical step's release."""
        return self._sums is not None

    def drop_pending_sums(self) -> bool:
        """Forget the clipped sums of skipped (virtual) steps whose logical batch was left unfinished (never released:
        no privacy spent); whether there were any. ``BatchMemoryManager`` calls it when its loop ends."""
        pending = self._sums is not None
        if pending:
            warnings.warn("a logical batch was left before its last physical batch: its clipped sums were dropped, "
                          "not released", RuntimeWarning, stacklevel=2)  # fmt: skip
        self._sums, self._rows_since_release, self._pending_batch = None, 0, None
        return pending

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """The next ``step()`` only accumulates the clipped sums (a physical batch of a larger logical one): no noise,
        no optimizer step, no accounting (Opacus' ``BatchMemoryManager`` protocol)."""
        self._skip_next = do_skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the parameters' gradients and drop what the forwards recorded since the last step. The clipped sums
        of skipped (virtual) steps are kept until their logical step is released."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.module.forget_recorded()

    # -- the private step
    def _backward_sums(self, recorded: Recorded) -> list[torch.Tensor]:
        if recorded.output is not None:
            return self._output_sums(recorded)
        records = recorded.records
        model = self.module._module
        check_supported(model)  # every step, as the variants: modes, modules and tied weights can change
        params = trainable_parameters(model)
        owned = {id(p) for r in records for p in r.layer.dp_parameters()}
        missing = [p for p in params if id(p) not in owned]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters were not used through a fastdp DP layer in the forward: their "
                "gradients cannot be clipped per example. Freeze them (requires_grad=False) or replace the modules "
                "that hold them (fastdp.nn.validate(model) lists them)"
            )
        n = recorded.examples
        for r in records:
            if len(r.shape) == 0 or r.shape[0] != n:
                raise ValueError(
                    f"{type(r.layer).__name__} was called on a tensor whose first dimension ({tuple(r.shape)}) is not "
                    f"the batch ({n} examples): DP layers need batch-first inputs so each row belongs to one example"
                )
        known = [t for r in records for t in ([r.grad] if r.grad is not None else r.formed or [])]
        device = known[0].device if known else torch.device("cpu")
        run = GhostBackward.of_records(params, records, torch.zeros(n, device=device))
        dtype = known[0].dtype if known and known[0].is_floating_point() else torch.float32
        loss_scale = self._loss_scale(recorded, dtype)
        sums, _ = self.variant.sums_of_backward(model, run, torch.ones(n, dtype=torch.bool, device=device),
                                                self.steps_taken, loss_scale)  # fmt: skip
        del run
        records.clear()  # A and G freed before the row probe's forwards (peak memory)
        if n >= 2:  # before anything is released: the sums are kept only if it passes
            self._check_rows(model, recorded.inputs, n)
        return sums

    def _output_sums(self, recorded: Recorded) -> list[torch.Tensor]:
        """An "output" variant's sums of one forward: the loss's gradient at the output (each row the example's own
        loss gradient: :meth:`_loss_scale`), backpropagated once through the model by the variant."""
        model, n = self.module._module, recorded.examples
        if n >= 2:
            self._check_rows(model, recorded.inputs, n)
        grad = recorded.leaf.grad  # the DP criteria's part included (backpropagate_sent, in pre_step)
        scale = 1.0 if grad is None else self._loss_scale(recorded, grad.dtype)
        if scale != 1.0:  # a public forward's plain mean (below)
            grad = (grad.double() / scale).to(grad.dtype)
        with recorded.gate.drive() if recorded.gate is not None else contextlib.nullcontext():
            sums = self.variant.sums_of_output(model, recorded.output, grad, recorded.records)
        recorded.records.clear()
        return sums

    def _loss_scale(self, recorded: Recorded, dtype: torch.dtype) -> float:
        """What G holds of each example's loss gradient: 1 (a sum, or a DPLoss: each example's loss seeded with the
        backward's seed), or, for a public forward's plain mean only (a private one is refused: :meth:`pre_step`),
        the fl(1/n) its backward multiplied by (torch's mean backward divides in G's dtype)."""
        n = recorded.examples
        if self.loss_reduction == "sum" or recorded.seeded or not n:
            return 1.0
        return float(torch.ones((), dtype=dtype) / n)

    def _check_rows(self, model: torch.nn.Module, inputs: tuple, n: int) -> None:
        """Each row one example (``fastdp.nn.rows``): the model's output rows and the DP layers' input rows must not
        change when one example's input does (its row replaced in every batch-first tensor of the forward's
        arguments: tensors, tuples, dicts, keywords); once per input signature."""

        def batch_rows(structure: tuple, size: int) -> list[torch.Tensor]:  # size: the structure's examples
            args, kwargs = structure
            leaves = tree_flatten(model(*args, **kwargs))[0]
            return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim()
                    and t.shape[0] == size]  # fmt: skip

        def outputs(structure: tuple, size: int) -> torch.Tensor:
            rows = [t.reshape(size, -1).double() for t in batch_rows(structure, size)]
            return torch.cat(rows, 1) if rows else torch.zeros(size, 1, dtype=torch.float64)

        gradients = None
        if self.variant.front_door == "ghost":  # the DP layers' output gradients' rows must be examples too

            def gradients(structure: tuple, size: int) -> list:
                return output_gradients(lambda: row_functional(batch_rows(structure, size)), size)

        # a host read of the inputs each step (a synchronisation on CUDA): a batch with a NaN is probed apart
        finite = all(bool(torch.isfinite(t).all()) for t in _rows_of(inputs, n) if t.is_floating_point())
        with torch.no_grad():
            self._probe.check(outputs, model, inputs, self.variant.row_layers(model), f"variant {self.variant.name!r}",
                              before=lambda: self.variant.check_model(model), batch=n, gradients=gradients,
                              finite=finite)  # fmt: skip

    def pre_step(self) -> bool:
        """Add the clipped sums of the forwards since the last step; whether this step releases (not skipped)."""
        if self.parallel is not None and not self.variant.keys.reproducible:
            if self._tangents_shared_for != self.steps_taken:  # once per logical step, on every rank
                self.parallel.share_tangent_key(self.variant, self.steps_taken)
                self._tangents_shared_for = self.steps_taken
        if self.module.internal_loss_used():
            self.module.forget_recorded()
            raise ValueError(
                "the loss backpropagated was computed by the model itself (outputs.loss / out['loss'], e.g. a Hugging "
                "Face model given labels=): fastdp cannot check that it is a sum of per-example losses, and the usual "
                "one is not (a mean over the whole batch's tokens: its divisor counts every example's tokens, so "
                "removing one example rescales every other example's gradient beyond the clipping bound). Do not "
                "pass labels to the model; compute the loss from its logits, per example (docs/front-door.md, "
                "'Per-example gradients and the loss')"
            )
        if self.module.dropped_then_backpropagated():
            self.module.forget_recorded()
            raise ValueError(
                "zero_grad() ran between a training forward and its loss.backward(): it dropped what that forward "
                "recorded, so this step would release noise only and spend privacy for nothing. Call zero_grad() "
                "before the forward"
            )
        recorded_forwards = [r for r in self.module.take_recorded() if r.backpropagated]
        private_forwards = [r for r in recorded_forwards if not r.public]
        if len(private_forwards) > 1:
            raise ValueError(
                f"{len(private_forwards)} training forwards were backpropagated before this optimizer step: fastdp "
                "bounds each forward's per-example gradients separately, so an example that went through the model "
                "twice (two views or augmentations of one batch, an adversarial attack crafted with the model in "
                "training mode, two loader batches accumulated) would move the release by twice the bound the noise "
                "is calibrated to, and one step would be accounted for two batches. Give each step one training "
                "forward: put the views of an example into one forward (its output row covering them all), craft "
                "attacks with the model in eval() mode, split a large batch with BatchMemoryManager (each "
                "physical batch its own step() call), and run forwards of public data (a GAN's generated batch) "
                "under `with model.public():` (docs/front-door.md, 'One forward per step')"
            )
        self._check_seeded(private_forwards)
        backpropagate_sent(recorded_forwards)  # the DP criteria's backward through the model (fastdp.engine.loss)
        loader = self.data_loader
        if self._sums is not None and loader is not None and loader.batches_drawn != self._pending_batch:
            self.drop_pending_sums()  # pending sums of a logical batch abandoned for a newer sample of the loader
        for recorded in recorded_forwards:
            self._rows_since_release += 0 if recorded.public else recorded.examples
            sums = self._backward_sums(recorded)
            if self._sums is None:  # physical batches' sums added by TwoSum (fastdp.ops.summation)
                self._sums = [CompensatedSum() for _ in sums]
                self._pending_batch = None if loader is None else loader.batches_drawn
            for total, part in zip(self._sums, sums, strict=True):
                total.add_(part)
        self.module.check_buffers()  # after the row probe's forwards too, before anything is released
        skip, self._skip_next = self._skip_next, False
        if not skip:
            self._check_rows_drawn()
        return not skip

    def _check_seeded(self, forwards: list[Recorded]) -> None:
        """Every private forward's loss came from a DPLoss, unscaled (or scaled by the variant's fixed fp16 loss
        scale), and nothing else reached its DP layers (``fastdp.engine.loss``): under either ``loss_reduction``. A
        loss written by hand is not checked to be a sum of per-example losses, and a batch mean in it (its 1/n,
        rounded) re-rounds every example's gradient when n changes, which the model's backward can amplify."""
        how = (
            "Pass criterion=<your loss> and grad_sample_mode='ghost' to make_private and compute the loss with the "
            "criterion it returns (model, optimizer, criterion, data_loader = engine.make_private(...)), as Opacus' "
            "ghost clipping does, or wrap it yourself: fastdp.engine.DPLoss(<your loss>, model, "
            "reduction=<your loss_reduction>) (docs/front-door.md, 'Per-example gradients and the loss')"
        )
        scale = self.variant.loss_scale  # 1, or the fp16 loss scale set_precision fixed (a power of two)
        for recorded in forwards:
            if not recorded.seeded:
                raise ValueError(
                    "a private training forward's loss must come from fastdp's DP criterion (under loss_reduction="
                    f"'mean' and 'sum' alike), and this step's loss (loss_reduction={self.loss_reduction!r}) did not: "
                    "fastdp cannot check that a loss written by hand is a sum of per-example losses, and a batch mean "
                    "in it (a criterion with reduction='mean', loss.mean(), loss / len(x)) multiplies every example's "
                    "gradient by the rounded 1/n; n changes when one example is added or removed, and the model's "
                    "backward can amplify that re-rounding of every other example's gradient far beyond the clipping "
                    f"bound (21.6 x at 10 000 examples: tests/test_holes_mean.py). {how}"
                )
            if recorded.gate.foreign or (recorded.leaf is not None and recorded.leaf.grad is not None):
                raise ValueError(
                    "the model also got gradient from other terms of the loss than the DP criterion's (a regularizer, "
                    "an auxiliary head's or a stored activation's loss, averaged over the batch or not): only the DP "
                    "criterion's per-example losses may reach a private forward. Put every term into the criterion, "
                    f"per example (a function of the outputs giving one loss per row). {how}"
                )
            if any(bool(seed != scale) for seed in recorded.seeds):
                fixed = "" if scale == 1.0 else f" times the variant's fp16 loss scale {scale:g}"
                raise ValueError(
                    "the DP criterion's loss was scaled before backward() (e.g. divided by the batch's size or token "
                    "count): a scale that depends on the batch re-rounds every example's gradient as a plain mean "
                    f"does, so the criterion's loss is backpropagated as it is{fixed} (loss.backward()); it is "
                    "already the batch's mean or sum (its reduction), and BatchMemoryManager accumulates physical "
                    f"batches without scaling. {how}"
                )

    def _check_rows_drawn(self) -> None:
        """At a release: refuse more rows in the forwards since the last release than examples the private data loader
        yielded since then (once the loader is in use: batches of your own are yours to sample)."""
        rows, self._rows_since_release = self._rows_since_release, 0
        loader = self.data_loader
        if loader is None or loader.examples_drawn == 0:
            return
        drawn, self._drawn_at_release = loader.examples_drawn - self._drawn_at_release, loader.examples_drawn
        if rows == 0 and drawn > 0 and self._sums is None:
            raise ValueError(
                f"this step has no training forward's sums, but the private data loader yielded {drawn} examples since "
                "the last step: the step would release noise only and spend privacy for nothing. Call "
                "optimizer.zero_grad() (or model.zero_grad()) before the forward, not between the forward and "
                "loss.backward(): it drops what the forwards since the last step recorded"
            )
        if rows > drawn:
            self._sums = None
            raise ValueError(
                f"this step's training forwards had {rows} rows, but the private data loader yielded {drawn} examples "
                "since the last step: each row gets its own clipping bound, so rows beyond the sampled examples (a "
                "batch concatenated with an augmented copy of itself, a batch used for a second step, padding rows) "
                "let one example count more than once, and the accountant's sampling rate would not hold. Give the "
                "model each sampled example once per step (augment within the example's own row) and draw a new "
                "batch from the private loader for every step"
            )

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.pre_step():
            return loss
        model = self.module._module
        self.variant.check_parameters(model)
        params = trainable_parameters(model)
        sums = ([total.value() for total in self._sums] if self._sums is not None
                else [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params])  # fmt: skip
        self._sums = None
        if self.parallel is not None:  # data-parallel: the global batch's sums, then noise once
            self.parallel.all_reduce_sum(sums)
        broadcast = self.parallel is not None and not self.variant.keys.reproducible
        fused = None  # the optimizer's step inside the release's pass (fastdp.engine.fused), where it can be
        if self.fuse_step and not broadcast and self.grad_reduction == "mean" and fusable(self.original_optimizer):
            fused = TorchOptimizerStep(self.original_optimizer)
        with fused_optimizer_step(fused) if fused is not None else contextlib.nullcontext():
            self.variant._release_step(model, sums, self.steps_taken)  # compiled after Variant.compile (the trainer's)
        if broadcast:
            self.parallel.broadcast_from_main([p.grad for p in params])  # rank 0's draw; the others' are discarded
        if self.grad_reduction == "sum":
            for p in params:
                p.grad.mul_(self.variant.expected_batch_size)
        if fused is None or not fused.applied:
            self.original_optimizer.step()
        self.variant.after_step(model)
        event = self.variant.privacy_event()
        if event is not None:
            self.accountant.step(*event, projections=self.projections)
        self.steps_taken += 1
        return loss
