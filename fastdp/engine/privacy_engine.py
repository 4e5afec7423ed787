"""``fastdp.PrivacyEngine``: Opacus' front door, fastdp's engine behind it.

An Opacus script runs by changing its import line::

    from fastdp import PrivacyEngine          # was: from opacus import PrivacyEngine

    engine = PrivacyEngine()
    model, optimizer, criterion, train_loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader, criterion=nn.CrossEntropyLoss(),
        grad_sample_mode="ghost", target_epsilon=3.0, target_delta=1e-5, epochs=10, max_grad_norm=1.0)
    for x, y in train_loader:                 # Poisson batches (possibly empty)
        optimizer.zero_grad()
        loss = criterion(model(x), y)         # mean over the batch's examples (fastdp.engine.DPLoss)
        loss.backward()                       # one backward: per-example norms from each layer's A and G
        optimizer.step()                      # clipped sum + noise once, original optimizer step, accounting
    print(engine.get_epsilon(1e-5))

What is the same as Opacus: the names and meanings of ``make_private`` / ``make_private_with_epsilon`` and their
arguments, the returned ``(module, optimizer, data_loader)`` (four values with ``grad_sample_mode="ghost"``: the
criterion, wrapped, as Opacus' ghost clipping), Poisson batches with expected size the loader's ``batch_size``,
``loss_reduction`` ("mean": the noisy sum is divided by the expected batch size; "sum": not),
``clipping="flat"|"per_layer"``, ``get_epsilon(delta)``, ``secure_mode``.

What differs, and why:

* The loss comes from the criterion make_private returns with ``grad_sample_mode="ghost"`` (or
  ``fastdp.engine.DPLoss(criterion, model, reduction)``), under ``loss_reduction="mean"`` and ``"sum"`` alike: a loss
  computed with the user's own criterion (``criterion(model(x), y)``) is refused at ``optimizer.step()``. fastdp
  cannot check that a hand-written loss is a sum of per-example losses, and a batch mean in it (its 1/n, rounded into
  every example's gradient) changes when one example is added or removed; a model's backward can amplify that
  re-rounding beyond the clipping bound (``fastdp.engine.loss``).

* The per-example path is fastdp's (``fastdp.engine.PrivateModule``): one forward, one backward, no per-sample
  gradient tensors; ``grad_sample_mode`` is accepted and ignored.
* ``accountant``: "rdp" and "pld" are fastdp's accountants of those names; "prv" (Opacus' default) is computed with
  fastdp's PLD accountant (also a tight numerical accountant; fastdp has no PRV implementation), and a warning says
  so. :attr:`PrivacyEngine.accountant_mechanism` is the one used.
* Privacy randomness: by default every draw (noise, Poisson sampling, JL tangents) is keyed by OS entropy.
  ``noise_generator`` (a ``torch.Generator``) is refused: noise from a generator anyone can seed can be regenerated
  and subtracted. ``reproducible_seed=N`` gives a reproducible run, NOT FOR RELEASE; ``secure_mode=True`` refuses it.
* fastdp's noise is a 4-draw sum with bounded tails: :meth:`get_epsilon` reports epsilon at ``delta`` minus the
  bound on the probability of an output impossible without an example (``fastdp.privacy.truncation_delta``), and
  ``make_private_with_epsilon`` calibrates so that the total stays within the target.
* ``delta >= 1 / N`` is refused (it permits releasing an example outright) unless ``allow_large_delta=True``.
* ``variant=``, each with its own bound parameters (docs/front-door.md, "Variants"):

  - "dpsgd" (Opacus' DP-SGD): ``max_grad_norm`` C, flat or per layer.
  - "jl" (DP-SGD-JL): ``max_grad_norm``, ``projections`` r; PLD accounting only.
  - "clipless" / "weightclip" (Lipschitz networks built from ``fastdp.nn.lipschitz`` layers; no gradient
    clipping): ``output_grad_bound`` L, the bound on each example's loss gradient w.r.t. the model's output (the
    loss's Lipschitz constant: sqrt(2) for cross-entropy, the default; a ``fastdp.nn.lipschitz.LipschitzLoss``
    passed as ``criterion`` gives its own), enforced by clipping that gradient, so any loss the user computes is
    covered; ``input_bound`` X_0 (else the model starts with ``BoundedInput``); ``noise_strategy`` "per-layer" or
    "global"; ``project_every`` k (project the weights after every k-th step only: ``fastdp.algorithms.clipless``).
    ``max_grad_norm`` is refused (nothing is clipped to it).
  - "backprop" (backpropagation clipping): ``input_clip`` C1 and ``grad_clip`` C2 (each layer's inputs and
    upstream gradients, per example); ``max_grad_norm`` is refused.

  ``noise_multiplier`` is the accounted (effective) multiplier for every variant; with per-layer noise each
  tensor's multiplier is larger (``fastdp.privacy.per_layer_noise_multiplier``).
* Data parallelism: the same script under ``torchrun`` (the user initialises the default process group: gloo on CPU,
  nccl on GPU, before ``make_private``) trains data-parallel, without ``DistributedDataParallel``: the loader's
  ``batch_size`` is the global expected batch size, rank 0's sample is shared and each process loads its shard, the
  bounded sums are all-reduced and the noise is added once (:class:`fastdp.engine.DPOptimizer`); processes started
  with different settings are refused; rank 0's initial parameters are broadcast.
* ``poisson_sampling=False`` and ``clipping="adaptive"`` are refused (no guarantee is computed for them here).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from fastdp.algorithms import DPSGD, JL, BackpropClip, Clipless, WeightClip
from fastdp.algorithms.base import trainable_parameters
from fastdp.engine import checkpoint
from fastdp.engine.data import DPDataLoader
from fastdp.engine.distributed import DataParallel, software_fingerprint
from fastdp.engine.loss import DPLoss
from fastdp.engine.module import PrivateModule
from fastdp.engine.optimizer import DPOptimizer
from fastdp.nn import validate
from fastdp.nn.lipschitz import LipschitzLoss, OutputGradientBound, TauCrossEntropy
from fastdp.privacy.accounting import (
    PrivacyAccountant,
    check_delta_for_data,
    get_noise_multiplier,
    truncation_delta,
)
from fastdp.privacy.rng import check_reproducible_seed

ACCOUNTANTS = {"rdp": "rdp", "pld": "pld", "prv": "pld"}
VARIANTS = ("dpsgd", "jl", "clipless", "weightclip", "backprop")
CLIPPED = ("dpsgd", "jl")  # the variants that clip per-example gradients to max_grad_norm
CLIPPINGS = ("flat", "per_layer")
GRAD_SAMPLE_MODES = ("hooks", "ghost", "functorch", "ew", "ghost_bk")


class PrivacyEngine:
    """See the module docstring. ``accountant``: "prv" (default, as Opacus; computed by PLD), "rdp" or "pld"."""

    def __init__(self, accountant: str = "prv", secure_mode: bool = False) -> None:
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
        if accountant == "prv":
            warnings.warn(
                "accountant='prv' is computed with fastdp's PLD accountant (privacy loss distributions, also tight; "
                "fastdp has no PRV implementation); pass accountant='pld' to say so, or 'rdp'",
                stacklevel=2,
            )
        self.accountant_requested = accountant
        self.accountant_mechanism = ACCOUNTANTS[accountant]
        self.accountant = EngineAccountant(self.accountant_mechanism)
        self.secure_mode = bool(secure_mode)
        self.optimizer: DPOptimizer | None = None
        self._num_examples: int | None = None
        self._allow_large_delta = False

    # ------------------------------------------------------------------------------------------------------ build
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | list[float] | None = None,
        criterion: nn.Module | None = None,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator=None,
        grad_sample_mode: str = "hooks",
        variant: str = "dpsgd",
        projections: int = 10,
        output_grad_bound: float | None = None,
        input_bound: float | None = None,
        noise_strategy: str = "per-layer",
        project_every: int = 1,
        input_clip: float | None = None,
        grad_clip: float | None = None,
        reproducible_seed: int | None = None,
        allow_large_delta: bool = False,
        **kwargs,
    ):
        """``(module, optimizer, data_loader)`` for private training (Opacus' ``make_private``); with
        ``grad_sample_mode="ghost"`` ``(module, optimizer, criterion, data_loader)``, as Opacus returns then.

        ``noise_multiplier`` sigma: noise std / sensitivity on the summed gradients (the accounted multiplier).
        ``max_grad_norm`` C ("dpsgd", "jl"): one bound, or one per DP layer (``clipping="per_layer"``, in
        ``model.modules()`` order). ``variant`` and its bound parameters (``projections``; ``output_grad_bound``,
        ``input_bound``, ``noise_strategy``, ``project_every``; ``input_clip``, ``grad_clip``): module docstring.
        ``reproducible_seed``: NOT FOR RELEASE (module docstring)."""
        if kwargs:
            raise TypeError(f"make_private got unexpected arguments: {', '.join(sorted(kwargs))}")
        if self.optimizer is not None:
            raise ValueError("this PrivacyEngine already made a model private: use one engine per model and run "
                             "(its accountant holds that run's steps)")  # fmt: skip
        if "DistributedDataParallel" in type(module).__name__:  # torch's DDP, Opacus' DPDDP
            raise ValueError(
                f"the model is wrapped in {type(module).__name__}: pass the model itself. Under torchrun fastdp trains "
                "data-parallel on its own (the bounded sums all-reduced, the noise added once in optimizer.step()); "
                "DDP's reducer would average un-noised gradients that fastdp's DP layers never form"
            )
        if not batch_first:
            raise ValueError("batch_first=False is refused: fastdp needs batch-first inputs (each row one example); "
                             "transpose sequence-first inputs before the model")  # fmt: skip
        if noise_generator is not None:
            raise ValueError(
                "noise_generator is refused: noise drawn from a torch.Generator can be regenerated by whoever knows "
                "its seed and subtracted from the model. fastdp keys its noise by OS entropy by default; for a "
                "reproducible (NOT FOR RELEASE) run pass reproducible_seed=N"
            )
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {', '.join(GRAD_SAMPLE_MODES)} (fastdp ignores it: "
                             f"its own one-backward path is used), got {grad_sample_mode!r}")  # fmt: skip
        if clipping not in CLIPPINGS:
            raise ValueError(
                f"clipping must be one of {', '.join(CLIPPINGS)}, got {clipping!r} (adaptive clipping is not "
                "offered: its threshold is a private quantity with its own accounting)"
            )
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if variant in CLIPPED:
            if max_grad_norm is None:
                raise TypeError(f"variant {variant!r} clips each example's gradient to max_grad_norm: pass one")
            per_layer = clipping == "per_layer"
            if per_layer and variant == "jl":
                raise ValueError(
                    "variant 'jl' clips each example's whole gradient to one max_grad_norm (its estimated norm covers "
                    "all layers at once): clipping='per_layer' is for variant 'dpsgd'; pass clipping='flat' and one "
                    "number"
                )
            if per_layer == isinstance(max_grad_norm, (int, float)):
                raise ValueError(
                    "clipping='per_layer' needs max_grad_norm as a list (one bound per DP layer), and clipping='flat' "
                    f"one number; got clipping={clipping!r}, max_grad_norm={max_grad_norm!r}"
                )
        elif max_grad_norm is not None or clipping != "flat":
            bounds = "input_clip and grad_clip" if variant == "backprop" else "output_grad_bound and input_bound"
            raise ValueError(
                f"variant {variant!r} does not clip per-example gradients, so max_grad_norm and clipping mean nothing "
                f"for it; its sensitivity comes from {bounds} (docs/front-door.md, Variants): drop max_grad_norm"
            )
        reproducible_seed = check_reproducible_seed(reproducible_seed)
        if self.secure_mode and reproducible_seed is not None:
            raise ValueError("secure_mode refuses reproducible_seed: whoever knows the seed can regenerate the noise "
                             "and the batches; drop it (privacy draws then come from OS entropy)")  # fmt: skip
        bounds = {"max_grad_norm": max_grad_norm, "projections": projections, "criterion": criterion,
                  "output_grad_bound": output_grad_bound, "input_bound": input_bound,
                  "noise_strategy": noise_strategy, "project_every": project_every, "input_clip": input_clip,
                  "grad_clip": grad_clip}  # fmt: skip
        parallel = DataParallel.current()
        if parallel is not None:  # under torchrun: the same run on every process, rank 0's initial model
            first = next(iter(module.parameters()), None)
            device_type = "cpu" if first is None else first.device.type
            parallel.check_same_run({
                "variant": variant, "bounds": repr(sorted(bounds.items(), key=lambda kv: kv[0])),
                "noise_multiplier": noise_multiplier, "loss_reduction": loss_reduction, "clipping": clipping,
                "examples": len(data_loader.dataset), "batch_size": data_loader.batch_size,
                "steps_per_epoch": len(data_loader), "reproducible_seed": reproducible_seed,
                "accountant": self.accountant_mechanism, "secure_mode": self.secure_mode,
                **software_fingerprint(device_type),
            })  # fmt: skip
            parallel.broadcast_module(module)
        loader = DPDataLoader.from_data_loader(data_loader, reproducible_seed, poisson_sampling, parallel)
        n = len(loader.dataset)
        seed = None if reproducible_seed is None else (reproducible_seed * 0x9E3779B97F4A7C15 + 1) % 2**63
        dp_variant, r = self._variant(variant, bounds, noise_multiplier, loader.sample_rate, n, seed)
        private, dp_optimizer = private_training(module, optimizer, dp_variant, self.accountant, projections=r,
                                                 loss_reduction=loss_reduction, parallel=parallel)  # fmt: skip
        self._num_examples, self._allow_large_delta = n, bool(allow_large_delta)
        d = sum(p.numel() for p in trainable_parameters(module))
        self.accountant.truncation = lambda steps: truncation_delta(noise_multiplier, steps, d, r)
        dp_optimizer.data_loader = loader  # a step's rows against the examples drawn for it
        self.optimizer = dp_optimizer
        if grad_sample_mode == "ghost":  # Opacus' ghost clipping: the criterion, wrapped (its default loss)
            dp_loss = DPLoss(nn.CrossEntropyLoss() if criterion is None else criterion, private, loss_reduction)
            return private, self.optimizer, dp_loss, loader
        return private, self.optimizer, loader

    def _variant(self, name: str, bounds: dict, sigma: float, q: float, n: int, seed: int | None):
        """(the variant ``name`` with its bound parameters from ``bounds``, its JL projections r for the
        accountant); refuses bound parameters that belong to another variant."""
        own = {"dpsgd": ("max_grad_norm",), "jl": ("max_grad_norm", "projections"),
               "clipless": ("criterion", "output_grad_bound", "input_bound", "noise_strategy", "project_every"),
               "backprop": ("input_clip", "grad_clip")}[name if name != "weightclip" else "clipless"]  # fmt: skip
        defaults = {"projections": 10, "noise_strategy": "per-layer", "project_every": 1}
        foreign = [k for k, v in bounds.items() if k not in own and k != "criterion" and k != "max_grad_norm"
                   and v is not None and v != defaults.get(k)]  # fmt: skip
        if foreign:
            raise ValueError(f"{', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} not a bound parameter of "
                             f"variant {name!r} (docs/front-door.md, Variants): drop it")  # fmt: skip
        clip = bounds["max_grad_norm"]
        if name == "jl":
            if self.accountant_mechanism != "pld":
                raise ValueError("variant='jl' is accounted by PLD only (its privacy loss has no useful RDP): "
                                 "PrivacyEngine(accountant='pld')")  # fmt: skip
            r = bounds["projections"]
            return JL(clip, sigma, q, n, projections=r, reproducible_seed=seed), float(r)
        if name == "dpsgd":
            return DPSGD(clip, sigma, q, n, reproducible_seed=seed), math.inf
        if name == "backprop":
            missing = [k for k in ("input_clip", "grad_clip") if bounds[k] is None]
            if missing:
                raise TypeError(f"variant 'backprop' needs {' and '.join(missing)} (C1: each layer's input, C2: its "
                                "upstream gradient, per example)")  # fmt: skip
            clip1, clip2 = bounds["input_clip"], bounds["grad_clip"]
            return BackpropClip(clip1, clip2, sigma, q, n, reproducible_seed=seed), math.inf
        loss = _lipschitz_loss(bounds["criterion"], bounds["output_grad_bound"])
        cls = Clipless if name == "clipless" else WeightClip
        return cls(sigma, q, n, input_bound=bounds["input_bound"], loss=loss, strategy=bounds["noise_strategy"],
                   reproducible_seed=seed, project_every=bounds["project_every"]), math.inf  # fmt: skip

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | list[float] | None = None,
        epsilon_tolerance: float = 0.01,
        **kwargs,
    ):
        """:meth:`make_private` with the noise multiplier calibrated so that ``epochs`` epochs (``len(data_loader)``
        steps each) are (target_epsilon, target_delta)-DP, the noise's truncation bound included."""
        if "noise_multiplier" in kwargs:
            raise TypeError("make_private_with_epsilon calibrates noise_multiplier: do not pass one")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
        n = len(data_loader.dataset)
        self._check_delta(target_delta, n, kwargs.get("allow_large_delta", False))
        steps = epochs * len(data_loader)
        q = min(1.0, data_loader.batch_size / n) if data_loader.batch_size else None
        if q is None:
            raise ValueError("the data loader has no batch_size: give the DataLoader a batch_size")
        variant = kwargs.get("variant", "dpsgd")
        r = float(kwargs.get("projections", 10)) if variant == "jl" else math.inf
        d = sum(p.numel() for p in trainable_parameters(module))

        def calibrate(delta: float) -> float:
            return get_noise_multiplier(target_epsilon, delta, q, steps, accountant=self.accountant_mechanism,
                                        epsilon_tolerance=epsilon_tolerance, projections=r)  # fmt: skip

        # one calibration, at delta less the most the truncation bound may take (refused above delta/100): the
        # epsilon at delta - spent is then within the target whenever the bound is within delta/100
        sigma = calibrate(target_delta * (1 - 1 / 100))
        spent = truncation_delta(sigma, steps, d, r)
        if spent > target_delta / 100:
            raise ValueError(
                f"noise multiplier {sigma:.4g} is too small for {steps} steps: fastdp's noise is bounded (a sum of 4 "
                f"Box-Muller draws), and the probability that some step's output is impossible without one example is "
                f"bounded only by {spent:.3g} here ({d} noised coordinates), above delta/100 = {target_delta / 100:.3g}"
                " (docs/privacy-randomness.md). Use a smaller target_epsilon, a larger batch_size, or fewer epochs"
            )
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader, noise_multiplier=sigma,
                                 max_grad_norm=max_grad_norm, **kwargs)  # fmt: skip

    @property
    def num_examples(self) -> int | None:
        """N, the size of the private model's data set (None before ``make_private``)."""
        return self._num_examples

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path, *, module, optimizer, data_loader=None, **kwargs) -> None:
        """Save model, optimizer, accountant, sampler and noise state with the privacy settings
        (:func:`fastdp.engine.checkpoint.save_checkpoint`; docs/front-door-checkpoints.md)."""
        checkpoint.save_checkpoint(self, path, module=module, optimizer=optimizer, data_loader=data_loader, **kwargs)

    def load_checkpoint(self, path, *, module, optimizer, data_loader=None) -> dict:
        """Resume from :meth:`save_checkpoint`'s file into this engine, made private with the same settings (others
        are refused); returns the checkpoint's extra entries (:func:`fastdp.engine.checkpoint.load_checkpoint`)."""
        return checkpoint.load_checkpoint(self, path, module=module, optimizer=optimizer, data_loader=data_loader)

    # ------------------------------------------------------------------------------------------------- accounting
    @staticmethod
    def _check_delta(delta: float, n: int, allow_large: bool) -> None:
        if not (isinstance(delta, (int, float)) and 0 < delta < 1):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        check_delta_for_data(delta, n, allow_large, "allow_large_delta=True to make_private")

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of the steps taken so far at ``delta``: the accountant's at ``delta`` minus the noise's truncation
        bound (module docstring); ``inf`` when that bound reaches delta."""
        if self.optimizer is None:
            raise ValueError("no model was made private with this engine yet: call make_private first")
        self._check_delta(delta, self._num_examples, self._allow_large_delta)
        return self.accountant.get_epsilon(delta)


class EngineAccountant(PrivacyAccountant):
    """The engine's accountant (``engine.accountant``): a :class:`PrivacyAccountant` whose epsilon at ``delta`` is
    the composition's at ``delta`` minus the noise's truncation bound over the steps taken (``truncation(steps)``,
    set by ``make_private``), so that every way of asking for epsilon reports the same number; and Opacus'
    ``get_privacy_spent(delta=...)``."""

    def __init__(self, mechanism: str) -> None:
        super().__init__(mechanism)
        self.truncation = lambda steps: 0.0

    def get_epsilon(self, delta: float) -> float:
        steps = self.steps
        spent = self.truncation(steps) if steps else 0.0
        if spent >= delta:
            return math.inf
        return super().get_epsilon(delta - spent)

    def get_privacy_spent(self, *, delta: float, alphas=None) -> tuple[float, None]:
        """``(epsilon, best_alpha)`` as Opacus' ``RDPAccountant.get_privacy_spent`` returns it; ``best_alpha`` is
        None (fastdp does not report the RDP order), whatever the mechanism."""
        return self.get_epsilon(delta), None


def private_training(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    variant,
    accountant,
    *,
    loss_reduction: str = "mean",
    grad_reduction: str | None = None,
    projections: float = math.inf,
    parallel=None,
) -> tuple[PrivateModule, DPOptimizer]:
    """The front door's model and optimizer for ``variant`` (a ``fastdp.algorithms`` variant with a
    ``front_door``): the model's problems refused in one error (``fastdp.nn.validate(strict=True)``), its layers
    converted (:class:`PrivateModule`), its parameters' dtypes and (variants whose bound lives in the network) the
    bound rules checked before the first step, and the :class:`DPOptimizer` whose ``step()`` releases each step and
    records it with ``accountant``. What :meth:`PrivacyEngine.make_private` builds, and what ``fastdp.train``'s
    ``Trainer`` (a client of the front door) trains through.

    ``grad_reduction`` (default: ``loss_reduction``) is what ``p.grad`` is: ``"mean"``, the noisy sum over the
    expected batch size (the variant API's release, bitwise), or ``"sum"``, the noisy sum. The trainer passes
    ``loss_reduction="sum"`` (its DP criterion's value is the summed loss it reports) with ``grad_reduction="mean"``;
    ``make_private`` keeps Opacus' pairing (``"mean"``/``"mean"``, ``"sum"``/``"sum"``)."""
    validate(module, variant, strict=True)  # every problem of the model, in one error (fastdp.nn.validate)
    private = PrivateModule(module, variant)
    variant.check_parameters(module)
    if variant.front_door == "output":
        with torch.no_grad():
            variant.check_model(module)  # the bound rules, named, before the first step
    dp_optimizer = DPOptimizer(optimizer, private, variant, accountant, loss_reduction, projections, parallel,
                               grad_reduction=grad_reduction)  # fmt: skip
    return private, dp_optimizer


def _lipschitz_loss(criterion, output_grad_bound: float | None) -> LipschitzLoss:
    """What the clipless and weightclip bound rules credit the loss with: the criterion's own Lipschitz constant
    (a :class:`LipschitzLoss`), else ``output_grad_bound``, else cross-entropy's sqrt(2); the front door clips each
    example's output gradient to it, so the user's loss cannot exceed it."""
    if isinstance(criterion, LipschitzLoss):
        if output_grad_bound is not None and output_grad_bound != criterion.lipschitz:
            raise ValueError(f"output_grad_bound={output_grad_bound} contradicts the criterion's Lipschitz constant "
                             f"{criterion.lipschitz} ({type(criterion).__name__}): pass one of them")  # fmt: skip
        return criterion
    return TauCrossEntropy() if output_grad_bound is None else OutputGradientBound(output_grad_bound)
