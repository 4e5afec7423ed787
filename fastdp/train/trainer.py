"""The trainer: a variant, an optimizer, a sampler and an accountant, composed.

Every step: sample a batch (Poisson), then, for a private variant, the front door's loop
(``fastdp.engine``: the model's forward through ``PrivateModule``, the masked summed loss, one
backward, ``DPOptimizer.step()``, which releases the gradient, steps the optimizer and records
the privacy event; docs/front-door.md, "The trainer"; with ``--compile`` the model's forward and
backward and the release compiled); for the non-private baseline, the variant API's step (the
variant writes the gradient, the optimizer steps).
Per epoch: evaluate on the test split and log loss, accuracy (AUROC for binary tasks), epsilon so far and steps/s.
Checkpoints hold the model, optimizer, accountant and sampler states, so a resumed
run neither loses nor double-counts a step (and, with a reproducible privacy seed,
continues the same random streams).

Privacy randomness (``docs/privacy-randomness.md``): by default every privacy draw
(noise, Poisson sampling, JL tangents) comes from OS entropy; ``reproducible_privacy_seed``
keys them reproducibly, and the result labels such a run NOT FOR RELEASE. ``seed`` fixes
only the train/test split and the initial weights (not privacy draws).

Data (``docs/data.md``): a bundled data set (``dataset``) or the user's file (``data``, ``target``), split as
``fastdp.train.data`` does, kept as it is (``Trainer.data``); every batch, and the test split for evaluation, goes
through the run's standardisation. A private run pays for it in epsilon (``standardize="dp"``: a Gaussian-mechanism
estimate whose releases the run's accountant records and composes with the steps) or has none (``"off"``); only a
non-private run may fit it exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastdp.algorithms import VARIANTS, Batch, Variant
from fastdp.algorithms.base import check_compile, resolve_loss_scale
from fastdp.engine.data import DPDataLoader
from fastdp.engine.distributed import DataParallel, software_fingerprint, tensor_digest
from fastdp.engine.loss import DPLoss
from fastdp.engine.module import PrivateModule
from fastdp.engine.optimizer import DPOptimizer
from fastdp.engine.privacy_engine import private_training
from fastdp.nn.lipdp import LOSSES, certified_accuracy, lipschitz_constant
from fastdp.nn.lipschitz import mul_up
from fastdp.privacy.accounting import (
    MECHANISMS,
    PrivacyAccountant,
    check_delta_for_data,
    get_noise_multiplier,
    solve_noise_multiplier,
    truncation_delta,
)
from fastdp.privacy.rng import OS_ENTROPY, REPRODUCIBLE, check_reproducible_seed
from fastdp.privacy.sampling import (
    PoissonSampler,
    ShuffleSampler,
    micro_batches,
    pad_batch,
    physical_batch_size,
)
from fastdp.train.data import (
    STANDARDIZE,
    STANDARDIZE_PRECISION,
    Dataset,
    RawSplit,
    Standardisation,
    dp_noised_coordinates,
    fastdp_noise,
    file_format,
    fit_dp,
    fit_exact,
    fit_off,
    load_file,
    load_raw,
    precision_noise_multiplier,
    release_noise_multipliers,
)
from fastdp.train.models import LIPSCHITZ_MODELS, build_model

# --compile through the front door: the model's forward is compiled without CUDA graphs (the DP layers' recorded
# inputs must not live in a graph's memory pool that the next replay overwrites), as Variant.compile's release is
FORWARD_COMPILE_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}
CHECKPOINT_VERSION = 1
# what a checkpoint of CHECKPOINT_VERSION holds (save_checkpoint), each checked before anything is loaded
_CHECKPOINT_FIELDS = {
    "identity": dict, "step": int, "epoch": int, "model": dict, "optimizer": dict, "accountant": dict,
    "sampler": dict, "torch_rng": torch.Tensor, "history": list, "train_seconds": float,
}  # fmt: skip
# settings that may differ between the processes of one data-parallel run (the rest must match on every rank)
_PER_RANK_FIELDS = ("device", "out", "progress", "quiet")


@dataclass
class TrainConfig:
    """One training run. Units: ``batch_size`` is the expected batch size q*N; ``clip_norm``
    is the per-example L2 bound C; noise std on the clipped sum is ``noise_multiplier * C``."""

    variant: str = "dpsgd"
    dataset: str = "breast_cancer"
    data_dir: str | None = None
    data: str | None = None  # the user's data file (CSV/TSV, Parquet, .npz), instead of ``dataset``
    target: str | None = None  # its label column (CSV/TSV, Parquet)
    # auto: dp for private runs, exact for non-private runs (docs/data.md)
    standardize: str = "auto"
    # dp: its noise multiplier (default: Trainer._default_standardize_noise, from the steps' and the data's size)
    standardize_noise: float | None = None
    model: str = "auto"
    hidden: int = 64
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.0
    clip_norm: float = 1.0
    projections: int = 10  # jl: r, the JL projections per step behind each per-example norm estimate
    jl_chunk: int | None = None  # jl: tangents projected at once per layer (None: from jl_memory_budget)
    jl_memory_budget: float | None = None  # jl: chunk budget, a multiple of the step's own tensors (None: 0.5)
    input_bound: float | None = None  # Lipschitz models: X_0, inputs projected onto this L2 ball (default sqrt(d))
    input_clip: float = 1.0  # backprop: C1, each example's input to every trainable layer is clipped to this norm
    max_weight_norm: float = 1.0  # weightclip: C, the bound kept on each layer's spectral norm
    tau: float = 1.0  # clipless: temperature of the tau cross-entropy (Lipschitz constant sqrt(2) in logits)
    noise_strategy: str = "per-layer"  # clipless: per-layer or global noise
    loss: str = "tau-ce"  # clipless, weightclip: the Lipschitz loss, one of fastdp.nn.lipdp.LOSSES
    margin: float = 1.0  # loss hinge or hkr: the margin
    hkr_alpha: float = 10.0  # loss hkr: the hinge's weight alpha (L = alpha + sqrt(2))
    cosine_k: float = 1.0  # loss cosine: K, the floor of the logits' norm (L = 1 / (K max(1, K)))
    # Lipschitz models: also report the test accuracy certified at this L2 radius, in the data's own units (images:
    # pixels in [0, 1]); None: 36/255 for images, no certificate for tabular data
    certify_radius: float | None = None
    # clipless, weightclip: clip each example's logit gradient at this quantile of the batch's logit-gradient norms,
    # estimated privately (its noise is part of the step's noise multiplier; fastdp.algorithms.clipless)
    logit_clip_quantile: float | None = None
    # clipless, weightclip: project the weights after every k-th step only (bounds stay certified, looser between)
    project_every: int = 1
    epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None
    accountant: str = "rdp"
    shuffle: bool = False
    pad: bool = False
    micro_batch: int | None = None  # virtual batches: each logical batch runs as micro-batches of this many rows
    precision: str = "fp32"  # fp32, bf16 or fp16: autocast of the model's forward (norms, sums, noise stay fp32)
    loss_scale: float | None = None  # fp16: fixed power-of-two loss scale (default 2**10)
    compile: str | None = None  # torch.compile the step: None (eager), "default", "reduce-overhead" (CUDA graphs), ...
    compile_backend: str = "inductor"
    # None (default): every privacy draw (noise, Poisson sampling, JL tangents) from OS entropy. An int: all of them
    # keyed by it, reproducibly; the result is labelled NOT FOR RELEASE (anyone who knows it can subtract the noise).
    reproducible_privacy_seed: int | None = None
    secure: bool = False  # refuse anything not for release: a reproducible privacy seed (and so --shuffle)
    allow_large_delta: bool = False  # accept delta >= 1/N (which permits releasing an example outright)
    seed: int = 0  # the train/test split and the initial weights only (not privacy draws)
    device: str = "cpu"
    checkpoint: str | None = None
    resume: bool = False
    out: str | None = None
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    quiet: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(sorted(VARIANTS))}")
        if self.accountant not in MECHANISMS:
            raise ValueError(f"unknown accountant {self.accountant!r}; choose one of {', '.join(MECHANISMS)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}; typical: 1e-5 or below 1/N")
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be finite and > 0, got {self.epsilon}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch size must be >= 1, got {self.epochs} and {self.batch_size}")
        if not (math.isfinite(self.lr) and 0 < self.lr <= torch.finfo(torch.float32).max):
            raise ValueError(f"learning rate must be finite and > 0 in float32 (the parameters' dtype), got {self.lr}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose sgd or adam")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        radius = self.certify_radius
        if radius is not None and (isinstance(radius, bool) or not isinstance(radius, numbers.Real)
                                   or not (math.isfinite(radius) and radius >= 0)):  # fmt: skip
            raise ValueError(f"--certify-radius must be a finite L2 radius >= 0, got {radius!r}")
        quantile = self.logit_clip_quantile
        if quantile is not None:
            if self.variant not in ("clipless", "weightclip"):
                raise ValueError(f"--logit-clip-quantile is for the clipless and weightclip variants, not "
                                 f"{self.variant!r}")  # fmt: skip
            if isinstance(quantile, bool) or not isinstance(quantile, numbers.Real) or not 0 < quantile < 1:
                raise ValueError(f"--logit-clip-quantile must be in (0, 1), e.g. 0.9, got {quantile!r}")
        every = self.project_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"--project-every must be an int >= 1, got {every!r}")
        if every != 1 and self.variant not in ("clipless", "weightclip"):
            raise ValueError(f"--project-every is for the clipless and weightclip variants, not {self.variant!r}")
        self._validate_data()
        if VARIANTS[self.variant].private and self.epsilon is None and self.noise_multiplier is None:
            raise ValueError(
                f"variant {self.variant!r} is private: give --epsilon (the noise is calibrated to reach it) "
                "or --noise-multiplier (epsilon is then reported)"
            )
        if self.variant == "jl" and self.accountant == "rdp":
            raise ValueError(
                "variant jl needs --accountant pld: with JL-estimated norms a step's sensitivity is random, its "
                "privacy loss has moments only below r/2, and RDP cannot account it (Bu et al. 2021 §2.1)"
            )
        if isinstance(self.projections, bool) or not isinstance(self.projections, int) or self.projections < 1:
            raise ValueError(f"projections (JL dimension r) must be an integer >= 1, got {self.projections!r}")
        if self.micro_batch is not None and (
            isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1
        ):
            raise ValueError(f"micro-batch size must be an integer >= 1 (or None: no virtual batches), got "
                             f"{self.micro_batch!r}")  # fmt: skip
        VARIANTS[self.variant].check_precision(self.precision)
        resolve_loss_scale(self.precision, self.loss_scale)
        if self.compile is not None:
            check_compile(self.compile, self.compile_backend)
        if self.resume and not self.checkpoint:
            raise ValueError("--resume needs --checkpoint PATH")
        check_reproducible_seed(self.reproducible_privacy_seed, "reproducible privacy seed")
        if self.secure and self.reproducible_privacy_seed is not None:
            raise ValueError(
                "--secure refuses what is not for release, and --reproducible-privacy-seed is not: whoever knows the "
                "seed can regenerate the run's noise and batches and subtract the noise from the model; drop "
                "--reproducible-privacy-seed (privacy draws then come from OS entropy, the default)"
            )
        if self.shuffle and VARIANTS[self.variant].private and self.reproducible_privacy_seed is None:
            raise ValueError(
                "--shuffle is not for a private release: shuffled batches come from a seeded permutation and have no "
                "proven guarantee (the epsilon assumes Poisson sampling), so a private run with --shuffle is an "
                "experiment and needs --reproducible-privacy-seed N (its result is then labelled NOT FOR RELEASE); "
                "for a model to release, drop --shuffle"
            )

    def _validate_data(self) -> None:
        """The data file and the standardisation: refused before anything is read or released."""
        if self.data is not None:
            file_format(self.data)
            if not Path(self.data).expanduser().is_file():
                raise FileNotFoundError(f"data file {self.data} does not exist (or is not a file); check the path "
                                        "given to --data")  # fmt: skip
        elif self.target is not None:
            raise ValueError("--target names the label column of a data file: give the file with --data FILE")
        if self.standardize not in STANDARDIZE:
            raise ValueError(f"unknown standardisation {self.standardize!r}; choose one of {', '.join(STANDARDIZE)}")
        private = VARIANTS[self.variant].private
        if private and self.standardize == "exact":
            raise ValueError(
                "--standardize exact fits the mean and std of the training split without noise: the model would "
                "then depend on every training example outside the accounted epsilon. A private run takes "
                "--standardize dp (a Gaussian-mechanism estimate, paid for in epsilon) or off (no standardisation); "
                "exact is for --variant nonprivate"
            )
        noise = self.standardize_noise
        if noise is not None and (isinstance(noise, bool) or not isinstance(noise, numbers.Real)
                                  or not (math.isfinite(noise) and noise > 0)):  # fmt: skip
            raise ValueError(f"--standardize-noise must be a finite noise multiplier > 0, got {noise!r}")


class RunAccountant(PrivacyAccountant):
    """The run's accountant: the training steps, as :class:`PrivacyAccountant` records them (``steps``, ``history``),
    and the releases of the data's preprocessing (``preprocessing``: the noise multipliers of full-batch Gaussian
    mechanisms, each the event ``(sigma, q=1, 1 step)``). :meth:`get_epsilon` composes both: every epsilon the run
    reports includes the preprocessing; :meth:`training_epsilon` is the steps' alone."""

    def __init__(self, mechanism: str = "rdp") -> None:
        super().__init__(mechanism)
        self.preprocessing: list[float] = []
        self._composed: dict[tuple, float] = {}

    def record_preprocessing(self, noise_multiplier: float) -> None:
        """Record one full-batch Gaussian release of add/remove sensitivity Delta with noise std sigma * Delta."""
        PrivacyAccountant(self.mechanism).step(noise_multiplier, 1.0, 1)  # its checks
        self.preprocessing.append(float(noise_multiplier))
        self._composed = {}

    def training_epsilon(self, delta: float) -> float:
        return super().get_epsilon(delta)

    def get_epsilon(self, delta: float) -> float:
        if not self.preprocessing:
            return super().get_epsilon(delta)
        state = super().state_dict()
        key = (tuple(self.preprocessing), json.dumps(state["history"]), delta)
        if key not in self._composed:
            composed = PrivacyAccountant(self.mechanism)
            composed.load_state_dict({**state, "history": [[s, 1.0, 1] for s in self.preprocessing] + state["history"]})
            self._composed = {key: composed.get_epsilon(delta)}
        return self._composed[key]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "preprocessing": list(self.preprocessing)}

    def load_state_dict(self, state: dict) -> None:
        preprocessing = state.get("preprocessing", []) if isinstance(state, dict) else []
        if not isinstance(preprocessing, list):
            raise ValueError(f"corrupt accountant state: preprocessing must be a list, got {preprocessing!r}")
        for sigma in preprocessing:
            try:
                PrivacyAccountant(self.mechanism).step(sigma, 1.0, 1)
            except ValueError as err:
                raise ValueError(f"corrupt accountant state: preprocessing {preprocessing!r}: {err}") from None
        super().load_state_dict(state)
        self.preprocessing = [float(s) for s in preprocessing]
        self._composed = {}


class ExampleIndices(torch.utils.data.Dataset):
    """The training split as the front door's loader sees it: example i is its index i. The trainer gathers each
    batch's rows itself (standardised as they are drawn, padded to ``--pad``'s fixed shapes, split into
    ``--micro-batch``es), so the loader carries indices, not rows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


def _log(config: TrainConfig, message: str) -> None:
    if not config.quiet:
        print(message, file=sys.stderr, flush=True)


def _make_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: Dataset, device: torch.device, certify: tuple[object, float] | None = None
) -> dict:
    """Test loss, accuracy and (binary tasks) AUROC. FloatingPointError if the model's outputs are not finite
    (finite weights whose forward overflows float32, e.g. after a diverging learning rate): no metric, record or
    epsilon is reported for such a model. Deciding on the released weights and the test split is post-processing.

    ``certify`` = (L, r): also ``test_certified_accuracy``, the fraction of test rows certified robust at L2 radius r
    for logits L-Lipschitz in the rows as given (``fastdp.nn.lipdp.certified_mask``), and ``certify_radius`` r."""
    model.eval()
    logits = torch.cat([model(x.to(device)).cpu() for x in data.x_test.split(1024)])
    model.train()
    bad = ~torch.isfinite(logits).all(1)
    if bool(bad.any()):
        raise FloatingPointError(
            f"the model's outputs are not finite on {int(bad.sum())} of the {bad.numel()} test rows of {data.name} "
            "(finite weights whose forward overflows float32): lower the learning rate; no result or checkpoint is "
            "written for this run"
        )
    loss = torch.nn.functional.cross_entropy(logits, data.y_test).item()
    accuracy = (logits.argmax(1) == data.y_test).double().mean().item()
    metrics = {"test_loss": loss, "test_accuracy": accuracy}
    if certify is not None:
        metrics["test_certified_accuracy"] = certified_accuracy(logits, data.y_test, *certify)
        metrics["certify_radius"] = certify[1]
    if data.task == "binary" and data.y_test.unique().numel() == 2:
        from sklearn.metrics import roc_auc_score

        scores = (logits[:, 1].double() - logits[:, 0].double()).numpy()  # float64: no overflow of the difference
        metrics["test_auroc"] = float(roc_auc_score(data.y_test.numpy(), scores))
    return metrics


class Trainer:
    """Runs one :class:`TrainConfig`; :meth:`run` returns the result dict (also written as JSON)."""

    def __init__(self, config: TrainConfig) -> None:
        config.validate()
        self.config = config
        # data-parallel when a torch.distributed process group is up (fastdp train --nproc N); None: one process
        self.distributed = DataParallel.current()
        if self.distributed is not None and config.logit_clip_quantile is not None:
            raise ValueError("--logit-clip-quantile runs in one process: each rank would release its own count of "
                             "the shared step; train it without --nproc")  # fmt: skip
        self.device = self.distributed.device(config.device) if self.distributed else torch.device(config.device)
        # The run seed fixes the train/test split and the initial weights (and the global generator, which no
        # privacy draw uses). Neither is a privacy draw: the guarantee holds for every split and initialisation, as
        # they do not depend on the training examples (docs/privacy-randomness.md).
        torch.manual_seed(config.seed)
        if config.data is not None:
            self.raw: RawSplit = load_file(config.data, config.target, seed=config.seed)
        else:
            self.raw = load_raw(config.dataset, config.data_dir, seed=config.seed)
        # the seeded split as it is (images: float32 pixels in [0, 1]); batches are standardised as they are drawn
        self.data = self._raw_dataset(self.raw)
        n = self.data.x_train.shape[0]
        if config.batch_size > n:
            raise ValueError(f"batch size {config.batch_size} exceeds the {n} training examples of {self.raw.name}")
        self.private = VARIANTS[config.variant].private
        self.standardize = self._standardize_mode()
        if self.private:
            check_delta_for_data(config.delta, n, config.allow_large_delta,
                                 "--allow-large-delta (allow_large_delta=True)", f" of {self.raw.name}")  # fmt: skip
        self.model = build_model(config.model, self.data.input_shape, self.data.num_classes, hidden=config.hidden,
                                 input_bound=config.input_bound, max_weight_norm=config.max_weight_norm)  # fmt: skip
        needs = {"clipless": "lipschitz_mlp", "weightclip": "weightclip_mlp"}.get(config.variant)
        if needs and config.model not in LIPSCHITZ_MODELS:
            raise ValueError(
                f"{config.variant} training needs a Lipschitz model (--model {needs}), got {config.model!r}"
            )
        self.model.to(self.device)
        self.optimizer = _make_optimizer(config, self.model)
        # privacy draws: OS entropy unless a reproducible privacy seed is given (the non-private baseline's shuffled
        # batches are no privacy draw: seeded by --seed)
        privacy_seed = config.reproducible_privacy_seed if self.private else None
        self.loader: DPDataLoader | None = None  # the front door's data loader (Poisson runs through it)
        if not self.private:
            self.sampler = ShuffleSampler(n, config.batch_size, seed=config.seed)
        elif config.shuffle:  # validate(): only with a reproducible privacy seed
            self.sampler = ShuffleSampler(n, config.batch_size, seed=privacy_seed)
        elif self._front_door():  # the front door's loader: Poisson batches of the split's indices (sharded, torchrun)
            self.loader = DPDataLoader(ExampleIndices(n), config.batch_size / n, reproducible_seed=privacy_seed,
                                       parallel=self.distributed)  # fmt: skip
            self.sampler = self.loader.batch_sampler.sampler  # its PoissonSampler (rank 0's, data-parallel)
        else:
            self.sampler = PoissonSampler(n, config.batch_size / n, reproducible_seed=privacy_seed)
        self.total_steps = config.epochs * len(self.sampler)
        self.accountant = RunAccountant(config.accountant)
        self.projections = VARIANTS[config.variant].accounting_projections(config)
        self.num_coordinates = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.physical = physical_batch_size(n, self.sampler.sample_rate) if config.pad else None
        if self.distributed is not None:
            self._join_process_group()
        self.sigma_from_checkpoint = False  # a resumed calibrated run keeps the sigma its checkpoint was run with
        saved = self._checkpoint_plan() if config.resume else None
        # sigma of the steps, and of the standardisation (dp; None otherwise)
        self.noise_multiplier, self.standardize_noise = self._noise_multipliers(saved)
        self.variant = self._make_variant()  # checks sigma
        self._check_truncation()
        # the standardisation's releases (dp), recorded with the steps: every epsilon reported includes them
        self.standardisation = self._fit_standardisation(saved)
        if self.private:
            for sigma in self.standardisation.noise_multipliers:
                self.accountant.record_preprocessing(sigma)
        self._transform = self._batch_transform(self.standardisation)
        self.test_data = self._standardised_test_split()  # what evaluate() sees
        self.variant.set_precision(config.precision, config.loss_scale)
        if config.compile is not None:
            self.variant.compile(config.compile, config.compile_backend)
        # the private steps through the front door (fastdp.engine): the model wrapped and the optimizer made the
        # DPOptimizer that releases each step, as make_private does (None: the variant API's path, see _front_door)
        self.private_model: PrivateModule | None = None
        self.dp_optimizer: DPOptimizer | None = None
        self.criterion: DPLoss | None = None  # the front door's DP criterion: the masked per-example losses, summed
        if self._front_door():
            self.private_model, self.dp_optimizer = private_training(
                self.model, self.optimizer, self.variant, self.accountant, loss_reduction="sum",
                grad_reduction="mean", projections=self.projections, parallel=self.distributed)  # fmt: skip
            self.criterion = DPLoss(self._masked_losses, self.private_model, "sum")
            if config.compile is not None:  # the model's forward (and its backward) compiled; the release is too
                self.model.compile(mode=FORWARD_COMPILE_MODES.get(config.compile, config.compile),
                                   backend=config.compile_backend)  # fmt: skip
        self.step = 0
        self.epoch = 0
        self.history: list[dict] = []
        self.train_seconds = 0.0

    def _front_door(self) -> bool:
        """Whether the steps go through the front door (``fastdp.engine``: ``PrivateModule`` and ``DPOptimizer``,
        the ordinary forward, summed loss, backward and ``optimizer.step()``): every private variant (each has a
        front door: "ghost" for dpsgd and jl, "output" for clipless, weightclip and backprop), compiled or not
        (``--compile``: the model's forward and backward through ``torch.compile``, the variant's release compiled
        by :meth:`Variant.compile`). The non-private baseline runs the variant API's step (:meth:`Variant.gradient`):
        docs/front-door.md, "The trainer"."""
        return self.private and VARIANTS[self.config.variant].front_door is not None

    def _join_process_group(self) -> None:
        """Data-parallel run (``fastdp.engine.distributed``): refuse ranks started with different settings or data,
        start from rank 0's weights, share OS-entropy samples, pad per-rank shards, and let rank 0 alone log."""
        d = self.distributed
        settings = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in _PER_RANK_FIELDS}
        # the split as read: this check comes before the standardisation's release (a collective of its own, rank 0's
        # sent to every rank), so ranks started with other settings or data stop here
        settings["data"] = tensor_digest([self.data.x_train, self.data.y_train, self.data.x_test, self.data.y_test])
        settings.update(software_fingerprint(self.device.type))
        d.check_same_run(settings)
        d.broadcast_module(self.model)
        if self.loader is None:  # the front door's loader shares rank 0's samples itself
            self.sampler = d.shared_sampler(self.sampler)
        if self.physical is not None:
            self.physical = d.physical_batch_size(self.physical)
        if not d.is_main:
            self.config = dataclasses.replace(self.config, quiet=True, progress=False)
        if d.world_size > self.config.batch_size:
            _log(self.config, f"note: {d.world_size} processes for an expected batch of {self.config.batch_size}: "
                              "most ranks will often have no examples (correct, but idle)")  # fmt: skip

    @property
    def is_main(self) -> bool:
        """Whether this process logs and writes results and checkpoints (rank 0, or the only process)."""
        return self.distributed is None or self.distributed.is_main

    # ------------------------------------------------------------------------- data and standardisation

    @staticmethod
    def _raw_dataset(raw: RawSplit) -> Dataset:
        """The seeded split as read (tabular float64, images float32 pixels in [0, 1]), checked by Dataset."""
        dtype = torch.float32 if raw.image else torch.float64
        return Dataset(
            name=raw.name,
            x_train=torch.from_numpy(raw.x_train).to(dtype),
            y_train=torch.from_numpy(raw.y_train),
            x_test=torch.from_numpy(raw.x_test).to(dtype),
            y_test=torch.from_numpy(raw.y_test),
            num_classes=raw.num_classes,
            input_shape=raw.input_shape,
            task="binary" if raw.num_classes == 2 else "multiclass",
            source=raw.source,
        )

    def _standardize_mode(self) -> str:
        """``auto`` resolved: dp for private runs (tables and images: for images its one release costs almost nothing,
        and standardised pixels train better than [0, 1] ones), exact for non-private runs."""
        mode = self.config.standardize
        if mode == "auto":
            mode = "dp" if self.private else "exact"
        return mode

    def _release_sigmas(self, standardize_noise: float | None) -> list[float]:
        """The noise multipliers of the standardisation's releases (none without dp)."""
        return [] if standardize_noise is None else release_noise_multipliers(self.raw.image, standardize_noise)

    def _planned_epsilon(self, sigma: float | None, steps: int, standardize_noise: float | None, delta: float) -> float:
        """Epsilon of the standardisation's releases (at ``standardize_noise``) and ``steps`` steps at ``sigma``."""
        probe = RunAccountant(self.config.accountant)
        for release in self._release_sigmas(standardize_noise):
            probe.record_preprocessing(release)
        if sigma is not None and steps > 0:
            probe.step(sigma, self.sampler.sample_rate, steps, projections=self.projections)
        return probe.get_epsilon(delta)

    def _preprocessing_truncation(self, standardize_noise: float | None) -> float:
        """``truncation_delta`` of the standardisation's releases (each one release of its own coordinates)."""
        if not self.private or standardize_noise is None:
            return 0.0
        coordinates = dp_noised_coordinates(self.raw)
        releases = self._release_sigmas(standardize_noise)
        return min(1.0, sum(truncation_delta(s, 1, c) for s, c in zip(releases, coordinates, strict=True)))

    def _default_standardize_noise(self, sigma: float | None) -> float:
        """The standardisation's noise multiplier when none is given: the larger of the one at which its estimates
        have a noise std of ``STANDARDIZE_PRECISION`` of each feature's clip range (more noise would make them
        useless, less is not needed: ``precision_noise_multiplier``) and the steps' own ``sigma`` (so that its
        releases together cost no more than one full-batch step of training). A function of sigma and the data's
        size alone, not of the number of steps: a run resumed with more epochs goes on as the longer run would."""
        needed = precision_noise_multiplier(len(self.raw.y_train), self.raw.input_shape, self.raw.image)
        valid = isinstance(sigma, numbers.Real) and not isinstance(sigma, bool) and 0 <= sigma < math.inf
        return max(needed, float(sigma)) if valid else needed  # an invalid sigma: the variant refuses it

    def _noise_multipliers(self, saved: dict | None) -> tuple[float | None, float | None]:
        """(sigma of the steps, sigma of the standardisation: dp only, else None).

        Each is given (``noise_multiplier``, ``standardize_noise``), or (resume) the checkpoint's, or: the
        standardisation's from the steps' (:meth:`_default_standardize_noise`); the steps' calibrated to the target
        epsilon over all planned steps composed with the standardisation's releases, at delta minus the truncation
        bound (``truncation_delta``)."""
        config = self.config
        dp = self.standardize == "dp"
        given = config.standardize_noise if dp else None
        if not self.private:
            return None, (None if not dp else given if given is not None else self._default_standardize_noise(None))
        sigma = config.noise_multiplier
        if saved is not None:
            if sigma is None and saved["noise_multiplier"] is not None:
                # keep the run's noise; epsilon then grows with the extra steps (reported)
                sigma, self.sigma_from_checkpoint = saved["noise_multiplier"], True
            if dp and given is None and saved["standardize_noise"] is not None:
                given = saved["standardize_noise"]  # the checkpoint's standardisation is the one its model learned on

        def standardize_noise(steps_sigma: float | None) -> float | None:
            if not dp:
                return None
            return given if given is not None else self._default_standardize_noise(steps_sigma)

        if sigma is not None:
            self._check_preprocessing_fits(standardize_noise(sigma))
            return sigma, standardize_noise(sigma)
        steps = self.total_steps

        def calibrate(delta: float) -> float:
            if not dp:
                return get_noise_multiplier(config.epsilon, delta, self.sampler.sample_rate, steps,
                                            accountant=config.accountant, projections=self.projections)  # fmt: skip
            # as sigma grows, the epsilon of the steps goes to 0 and that of the releases to theirs at `given`, or 0
            base = 0.0
            if given is not None:
                self._check_preprocessing_fits(given)
                base = self._planned_epsilon(None, 0, given, delta)
            return solve_noise_multiplier(
                lambda s: self._planned_epsilon(s, steps, standardize_noise(s), delta),
                config.epsilon,
                low_enough=0.99 * config.epsilon,
                base=base,
                unreachable=lambda e: ValueError(
                    f"unreachable: the noise multiplier of the steps would have to exceed 1e4 for epsilon "
                    f"{config.epsilon:.4g} (it gives {e:.4g}); use a larger epsilon, fewer steps or a smaller "
                    "sample rate"
                ),
            )

        sigma = calibrate(config.delta)
        spent = self._truncation(sigma, steps) + self._preprocessing_truncation(standardize_noise(sigma))
        if 0 < spent <= config.delta / 100 and config.delta - spent < config.delta:
            sigma = calibrate(config.delta - spent)  # a larger sigma: its truncation bound is smaller still
        return sigma, standardize_noise(sigma)

    def _check_preprocessing_fits(self, standardize_noise: float | None) -> None:
        """Refuse a target epsilon that the standardisation's releases alone exceed."""
        target = self.config.epsilon
        if target is None or standardize_noise is None:
            return
        alone = self._planned_epsilon(None, 0, standardize_noise, self.config.delta)
        if alone >= target:
            raise ValueError(
                f"the standardisation alone (--standardize dp at noise multiplier {standardize_noise:.4g}) spends "
                f"epsilon {alone:.4g}, not below the target epsilon {target:g}: give it more noise (a larger "
                "--standardize-noise), or --standardize off"
            )

    def _checkpoint_plan(self) -> dict | None:
        """The sigmas and the standardisation recorded in the checkpoint to resume, or None where it cannot be read
        (``run`` then refuses the file with the reason)."""

        def read() -> dict | None:  # data-parallel: on rank 0 only, the one that reads checkpoints
            try:
                state = torch.load(self.config.checkpoint, map_location="cpu", weights_only=True)
                identity = state["identity"]
            except Exception:  # noqa: BLE001 - any failure (no file included): the full check in run() names it
                return None

            def sigma(key: str) -> float | None:
                value = identity.get(key)
                return value if isinstance(value, float) and math.isfinite(value) and value >= 0 else None

            standardization = state.get("standardization")
            return {"noise_multiplier": sigma("noise_multiplier"), "standardize_noise": sigma("standardize_noise"),
                    "standardization": standardization if isinstance(standardization, dict) else None}  # fmt: skip

        return read() if self.distributed is None else self.distributed.from_main(read)

    def _fit_standardisation(self, saved: dict | None) -> Standardisation:
        """The run's standardisation: off, exact, or dp (released here: on rank 0 and sent, data-parallel; a resumed
        run takes its checkpoint's instead, releasing nothing new)."""
        raw = self.raw
        if self.standardize == "off":
            return fit_off(raw.image)
        if self.standardize == "exact":
            return fit_exact(raw.x_train, raw.image)
        if saved is not None and saved["standardization"] is not None:
            restored = self._restored_standardisation(saved["standardization"])
            if restored is not None:
                return restored
        seed = self.config.reproducible_privacy_seed
        # its own key (a different Philox key from the steps' noise), counter = the release index
        noise = fastdp_noise(None if seed is None else (seed * 0x9E3779B97F4A7C15 + 2) % 2**63)

        def fit() -> Standardisation:
            return fit_dp(raw.x_train, raw.image, self.standardize_noise, noise)

        return fit() if self.distributed is None else self.distributed.from_main(fit)

    def _restored_standardisation(self, state: dict) -> Standardisation | None:
        """A checkpoint's dp standardisation, if it is one for this data and noise (None otherwise: fitted anew, and
        the checkpoint then refused by the full check)."""
        try:
            restored = Standardisation.from_state_dict(state)
        except (KeyError, TypeError, ValueError):
            return None
        shape = () if self.raw.image else (self.raw.x_train.shape[1],)
        arrays = [restored.mean, restored.std] + ([] if self.raw.image else [restored.bound])
        ok = (
            restored.mode == "dp"
            and restored.image == self.raw.image
            and all(a is not None and a.shape == shape and np.isfinite(a).all() and (a > 0).all() for a in arrays[1:])
            and restored.mean is not None and restored.mean.shape == shape and np.isfinite(restored.mean).all()
            and list(restored.noise_multipliers) == self._release_sigmas(self.standardize_noise)
        )  # fmt: skip
        return restored if ok else None

    def _batch_transform(self, standardisation: Standardisation):
        """``x -> (clip(x, -bound, bound) - mean) / std`` in float64, as float32 (the numpy transform of
        ``Standardisation.apply``, on the batch)."""
        if standardisation.mode == "off":
            return lambda x: x.to(torch.float32)
        mean = torch.as_tensor(standardisation.mean, dtype=torch.float64)
        std = torch.as_tensor(standardisation.std, dtype=torch.float64)
        bound = None if standardisation.bound is None else torch.as_tensor(standardisation.bound, dtype=torch.float64)

        def transform(x: torch.Tensor) -> torch.Tensor:
            x = x.to(torch.float64)
            if bound is not None:
                x = torch.clamp(x, min=-bound, max=bound)
            return ((x - mean) / std).to(torch.float32)

        return transform

    def _standardised_test_split(self) -> Dataset:
        """The data with the test split standardised (what evaluation sees), after checking that no standardised
        row of either split leaves float32's range."""
        limit = torch.finfo(torch.float32).max

        def standardised(split: str, x: torch.Tensor) -> torch.Tensor:
            parts = [self._transform(chunk) for chunk in x.split(4096)]
            out = torch.cat(parts) if parts else x.to(torch.float32)
            bad = ~torch.isfinite(out.reshape(len(out), -1)).all(1)
            if bool(bad.any()):
                raise ValueError(
                    f"{self.raw.name}: {int(bad.sum())} of the {len(out)} {split} rows have features beyond float32's "
                    f"range ({limit:.3g}) after --standardize {self.standardisation.mode} (first: row "
                    f"{int(torch.nonzero(bad)[0])}); scale them, or standardise them (--standardize dp)"
                )
            return out

        standardised("training", self.data.x_train)
        return dataclasses.replace(self.data, x_test=standardised("test", self.data.x_test))

    # ------------------------------------------------------------------------------ privacy

    def _truncation(self, sigma: float | None, steps: int) -> float:
        """``truncation_delta`` of ``steps`` steps at ``sigma`` for this run's model (0 for a non-private run, and
        for sigma = 0, whose epsilon is infinite anyway)."""
        if not self.private or sigma is None or not 0 < sigma < math.inf:
            return 0.0
        return truncation_delta(sigma, steps, self.num_coordinates, self.projections)

    def delta_truncation(self, steps: int | None = None) -> float:
        """The mass of outputs impossible without an example, over ``steps`` steps (default: the steps taken) and the
        standardisation's releases, at this run's sigmas: part of delta (``docs/privacy-randomness.md``)."""
        steps = self.step if steps is None else steps
        return self._truncation(self.noise_multiplier, steps) + self._preprocessing_truncation(self.standardize_noise)

    def _check_truncation(self) -> None:
        """Refuse, before training, a run whose bounded noise alone could spend more than delta / 100."""
        spent = self.delta_truncation(self.total_steps)
        limit = self.config.delta / 100
        if spent > limit:
            more = ", more --projections" if math.isfinite(self.projections) else ""
            pre = self._preprocessing_truncation(self.standardize_noise)
            also = (f" ({pre:.3g} of it from the standardisation's releases at noise multiplier "
                    f"{self.standardize_noise:.4g}: a larger --standardize-noise)") if pre > 0 else ""  # fmt: skip
            raise ValueError(
                f"noise multiplier {self.noise_multiplier:.4g} is too small for {self.total_steps} steps: fastdp's "
                f"noise is bounded (a sum of 4 Box-Muller draws, at most 13.54 std per pair of coordinates), and "
                f"the probability that some step's output is impossible without one example is bounded only by "
                f"{spent:.3g} here ({self.num_coordinates} noised coordinates), above delta/100 = {limit:.3g}{also} "
                f"(docs/privacy-randomness.md). Use a larger noise multiplier (a smaller --epsilon or a larger "
                f"--batch-size){more} or fewer steps (--epochs)"
            )

    def _make_variant(self) -> Variant:
        config = self.config
        # Noise seed: None (OS entropy, the default) or derived from the reproducible privacy seed. Every release and
        # every JL tangent is keyed by the variant's PrivacyKeys (fastdp.privacy.rng).
        privacy_seed = config.reproducible_privacy_seed
        noise_seed = None if privacy_seed is None else (privacy_seed * 0x9E3779B97F4A7C15 + 1) % 2**63
        return VARIANTS[config.variant].from_config(
            config,
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sampler.sample_rate,
            num_examples=self.data.x_train.shape[0],
            noise_seed=noise_seed,
        )

    # ------------------------------------------------------------------------------ steps

    def _batch(self, indices: torch.Tensor) -> Batch | list[Batch]:
        """The logical batch of ``indices``: one Batch, or its micro-batches (``micro_batch``: virtual batches, each
        of exactly that many rows, so peak memory does not depend on the logical batch size). Data-parallel: this
        rank's shard of it."""
        if self.distributed is not None and self.loader is None:  # the front door's loader yields this rank's shard
            indices = self.distributed.shard(indices)
        if self.physical is not None:
            indices, mask = pad_batch(indices, self.physical)
        else:
            mask = torch.ones(indices.numel(), dtype=torch.bool)
        if self.config.micro_batch is None:
            return self._rows(indices, mask)
        return [self._rows(i, m) for i, m in micro_batches(indices, mask, self.config.micro_batch)]

    def _gradient(self, batch: Batch | list[Batch]) -> torch.Tensor:
        """The variant writes this step's gradient; data-parallel: from every rank's shard, noise added once."""
        if self.distributed is None:
            return self.variant.gradient(self.model, batch, self.step)
        os_entropy = self.private and self.config.reproducible_privacy_seed is None
        return self.distributed.gradient(self.variant, self.model, batch, self.step, os_entropy=os_entropy)

    def _loader_batches(self):
        """The front door's loader's Poisson batches of indices (this rank's shard, data-parallel), from its batch
        sampler: the draws iterating the loader makes, without the ``DataLoader`` iterator's worker base seed (drawn
        from torch's global generator at every epoch: a seeded draw that secure runs must not make, and one that
        would move the global RNG state that checkpoints hold)."""
        for indices in self.loader.batch_sampler:
            yield torch.tensor(indices, dtype=torch.int64)

    def _front_door_step(self, batch: Batch | list[Batch]) -> torch.Tensor:
        """One private step through the front door, as any user's loop: for each micro-batch, the model's forward
        (under the run's autocast), the DP criterion's sum of the masked per-example losses (padded rows weigh
        exactly 0), one backward (times the fp16 loss scale, which the variant divides out exactly),
        ``optimizer.step()``. Every
        micro-batch but the last signals a skipped step (``signal_skip_step``): its clipped sums wait, and the last
        releases the logical batch once (noise, the mean over the expected batch size, one accounting event).
        Returns the summed loss of the real examples (detached; this rank's shard, data-parallel)."""
        batches = [batch] if isinstance(batch, Batch) else list(batch)
        scale = self.variant.loss_scale
        loss = torch.zeros((), device=self.device)
        for k, micro in enumerate(batches):
            self.dp_optimizer.signal_skip_step(k < len(batches) - 1)
            out = self.variant._forward(self.private_model, micro.x)
            total = self.criterion(out, micro.y, micro.mask)
            reported = total.detach()
            if self.variant.precision != "fp32":  # an example whose loss overflowed contributes 0 (DP-SGD), and
                with torch.no_grad():  # is left out of the reported loss
                    losses = self._masked_losses(out.detach(), micro.y, micro.mask)
                reported = torch.where(torch.isfinite(losses), losses, 0).sum()
            (total * scale if scale != 1.0 else total).backward()
            self.dp_optimizer.step()
            loss = loss + reported
        return loss

    def _masked_losses(self, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The per-example losses, padded rows weighed 0 (the front door's DP criterion, :attr:`criterion`)."""
        return self.variant.loss_fn(out, y) * mask

    def _rows(self, indices: torch.Tensor, mask: torch.Tensor) -> Batch:
        x = self._transform(self.data.x_train[indices]).to(self.device)
        y = self.data.y_train[indices].to(self.device)
        return Batch(x, y, mask.to(self.device))

    def epsilon(self) -> float:
        """Epsilon of the steps taken, at delta minus their truncation bound (``delta_truncation``)."""
        if not self.private:
            return math.inf
        return self.accountant.get_epsilon(self.config.delta - self.delta_truncation())

    def _step_budget(self) -> int:
        """Steps allowed in total: all planned ones, or (sigma and a target epsilon both given) the most whose
        epsilon, with the standardisation's releases, stays within the target."""
        target = self.config.epsilon
        if not self.private or target is None or self.config.noise_multiplier is None:
            return self.total_steps
        return self._max_steps(self.noise_multiplier, target, self.standardize_noise,
                               lambda steps: self.config.delta - self.delta_truncation(steps))  # fmt: skip

    def _max_steps(self, sigma: float, target: float, standardize_noise: float | None, delta) -> int:
        """The most steps (up to all planned) at ``sigma`` whose epsilon, with the standardisation's releases at
        ``standardize_noise``, stays within ``target``; ``delta(steps)`` is the delta to report at."""

        def eps(steps: int) -> float:
            return self._planned_epsilon(sigma, steps, standardize_noise, delta(steps))

        if eps(self.total_steps) <= target:
            return self.total_steps
        low, high = 0, self.total_steps  # eps(low) <= target < eps(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if eps(mid) <= target else (low, mid)
        return low

    def _check_finite_parameters(self) -> None:
        """One host sync per epoch: steps do not check their own numbers (that would synchronise every step), so a
        NaN/Inf that reached the weights (from the data, a diverging learning rate, or a non-finite bound) stops the
        run here, before an epoch record, a checkpoint or an epsilon is written for a broken model."""
        params = [p for p in self.model.parameters()]
        if not params or bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
            return
        bad = [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]
        raise FloatingPointError(
            f"non-finite parameters after epoch {self.epoch} (step {self.step}): {', '.join(bad)}. Check the data for "
            "NaN/Inf and lower the learning rate (with --precision fp16 and a non-private run: an fp16 overflow, "
            "lower --loss-scale or use bf16); no result or checkpoint is written for this run"
        )

    def run(self) -> dict:
        config = self.config
        if config.resume:
            self.load_checkpoint(config.checkpoint)
            if self.sigma_from_checkpoint:
                _log(config, f"resuming with sigma={self.noise_multiplier:.4f}, as calibrated for the checkpointed "
                             f"run's epsilon={config.epsilon}: steps beyond that run spend more than that epsilon "
                             "(the result reports the epsilon spent)")  # fmt: skip
        _log(config, self._header())
        if self.dp_optimizer is not None:
            self.dp_optimizer.steps_taken = self.step  # the released steps: the index that keys the noise
        budget = self._step_budget()
        while self.epoch < config.epochs and self.step < budget:
            start, loss_sum, examples = time.perf_counter(), torch.zeros((), device=self.device), 0
            steps = self._progress(len(self.sampler))
            for indices in self.sampler if self.loader is None else self._loader_batches():
                if self.step >= budget:
                    _log(config, f"stopping at step {self.step}: one more step would exceed epsilon={config.epsilon}")
                    break
                batch = self._batch(indices)
                examples += indices.numel()
                if self.dp_optimizer is not None:
                    loss_sum += self._front_door_step(batch)
                else:
                    loss_sum += self._gradient(batch)
                    self.optimizer.step()
                    self.variant.after_step(self.model)
                    event = self.variant.privacy_event()
                    if event is not None:
                        self.accountant.step(*event, projections=self.projections)
                self.step += 1
                steps.update(1)
            steps.close()
            if self.dp_optimizer is not None and self.distributed is not None:  # the global batches' summed loss
                self.distributed.all_reduce_sum([loss_sum])  # (every rank's shard) ...
                if self.loader is not None:  # ... and example count (the loader yields this rank's shard)
                    count = torch.tensor([examples], dtype=torch.int64, device=loss_sum.device)
                    self.distributed.all_reduce_sum([count])
                    examples = int(count.item())
            seconds = time.perf_counter() - start
            self.train_seconds += seconds
            self.epoch += 1
            if self.distributed is not None:
                self.distributed.check_in_sync(self.model, self.epoch)
            self._check_finite_parameters()
            record = {
                "epoch": self.epoch,
                "step": self.step,
                "train_loss": loss_sum.item() / max(examples, 1),
                "epsilon": self.epsilon(),
                "steps_per_second": len(self.sampler) / seconds if seconds > 0 else math.inf,
                **evaluate(self.model, self.test_data, self.device, self._certification()),
            }
            self.history.append(record)
            _log(config, self._format(record))
            if config.checkpoint and self.is_main:
                self.save_checkpoint(config.checkpoint)
        result = self.result(stopped_early=budget < self.total_steps)
        if config.out and self.is_main:
            Path(config.out).parent.mkdir(parents=True, exist_ok=True)
            Path(config.out).write_text(json.dumps(result, indent=2))
        return result

    # ------------------------------------------------------------------------- reporting

    def _progress(self, total: int):
        show = self.config.progress if self.config.progress is not None else sys.stderr.isatty()
        if show and not self.config.quiet:
            from tqdm import tqdm

            return tqdm(total=total, desc=f"epoch {self.epoch + 1}/{self.config.epochs}", leave=False)
        return _NoProgress()

    def _header(self) -> str:
        c = self.config
        n = self.data.x_train.shape[0]
        text = (
            f"fastdp train: {c.variant} on {self.raw.name} ({n} train / {self.data.x_test.shape[0]} test), "
            f"model {c.model}, {c.epochs} epochs x {len(self.sampler)} steps, expected batch {c.batch_size}, "
            f"standardisation {self.standardize}"
        )
        if self.standardize_noise is not None:
            text += f" (sigma={self.standardize_noise:.4f})"
        if self.private:
            text += (
                f", C={c.clip_norm}, sigma={self.noise_multiplier:.4f}, q={self.sampler.sample_rate:.5f}, "
                f"delta={c.delta:g}, accountant {c.accountant}, privacy randomness {self._randomness()}"
            )
        return text

    def _certification(self) -> tuple[object, float] | None:
        """(L, r) for :func:`evaluate`'s certified accuracy, or None (not a Lipschitz model; tabular data without
        ``certify_radius``). r is in the data's own units (images: pixels in [0, 1]) and L the Lipschitz constant of
        the model (``fastdp.nn.lipdp.lipschitz_constant``, on the current weights) times that of the standardisation
        the test rows went through: x -> (clip(x) - mean) / std is 1 / min(std)-Lipschitz in L2."""
        c = self.config
        radius = c.certify_radius if c.certify_radius is not None else (36 / 255 if self.raw.image else None)
        if radius is None or c.model not in LIPSCHITZ_MODELS:
            return None
        constant = lipschitz_constant(self.model)
        std = self.standardisation.std
        if self.standardisation.mode != "off" and std is not None:
            smallest = float(np.min(std))
            constant = mul_up(constant, math.nextafter(1.0 / smallest, math.inf))  # 1 / min(std), rounded up
        return constant, float(radius)

    def _randomness(self) -> str | None:
        if not self.private:
            return None
        return OS_ENTROPY if self.config.reproducible_privacy_seed is None else REPRODUCIBLE

    @staticmethod
    def _format(record: dict) -> str:
        text = (
            f"epoch {record['epoch']:3d}  step {record['step']:6d}  loss {record['train_loss']:.4f}  "
            f"test acc {record['test_accuracy']:.4f}"
        )
        if "test_auroc" in record:
            text += f"  auroc {record['test_auroc']:.4f}"
        if "test_certified_accuracy" in record:
            text += f"  certified {record['test_certified_accuracy']:.4f} at r={record['certify_radius']:.4g}"
        return text + f"  eps {record['epsilon']:.3f}  {record['steps_per_second']:.1f} steps/s"

    def result(self, stopped_early: bool = False) -> dict:
        c = self.config
        final = (self.history[-1] if self.history
                 else evaluate(self.model, self.test_data, self.device, self._certification()))  # fmt: skip
        result = {
            "variant": c.variant,
            "dataset": self.raw.name,
            "data_source": self.data.source,
            "data_file": self.raw.provenance,
            "standardization": self._standardization_record(),
            "epsilon": self.epsilon(),
            "delta": c.delta if self.private else None,
            "delta_truncation": self.delta_truncation() if self.private else None,
            "privacy_randomness": self._randomness(),
            "accountant": c.accountant if self.private else None,
            "sampling": "shuffle" if isinstance(self.sampler, ShuffleSampler) else "poisson",
            "steps": self.step,
            "epochs": self.epoch,
            "stopped_at_target_epsilon": stopped_early,
            "train_seconds": self.train_seconds,
            "test_accuracy": final["test_accuracy"],
            "test_auroc": final.get("test_auroc"),
            "test_certified_accuracy": final.get("test_certified_accuracy"),
            "certify_radius": final.get("certify_radius"),
            "variant_config": self.variant.describe(),
            "config": {k: v for k, v in dataclasses.asdict(c).items() if k != "extra"},
            "history": self.history,
        }
        if self.private:
            result["comparison_epsilons"] = self.variant.comparison_epsilons(self.epoch, c.delta)
        if self.private and result["sampling"] == "shuffle":
            result["note"] = (
                "batches were shuffled, not Poisson-sampled: the reported epsilon assumes Poisson sampling "
                "and is not a proven guarantee for this run"
            )
        if self.private and c.reproducible_privacy_seed is not None:
            result["note_privacy_randomness"] = (
                "NOT FOR RELEASE: noise, sampling and JL tangents were keyed by --reproducible-privacy-seed, so "
                "anyone who knows it (and the code) can regenerate the noise and subtract it from the model; train "
                "without it (privacy draws from OS entropy, the default) for a model to publish"
            )
        elif self.private:
            result["note_privacy_randomness"] = (
                "noise, Poisson sampling and JL tangents drawn from OS entropy (the run is not replayable); the "
                "train/test split and the initial weights are seeded by --seed, as they are not privacy draws"
            )
        if self.raw.notes:
            result["note_labels"] = "; ".join(self.raw.notes)
        if self.private and c.epsilon is not None and result["epsilon"] > c.epsilon:
            result["note_epsilon"] = (
                f"epsilon spent {result['epsilon']:.4g} exceeds the target {c.epsilon:g}: the run was resumed past "
                f"the steps its noise multiplier {self.noise_multiplier:.4g} was calibrated for"
            )
        return result

    def _standardization_record(self) -> dict:
        """What the result says of the standardisation: its mode, statistics and (private runs) its share of epsilon:
        ``epsilon`` = the run's epsilon less the steps' alone (both at the run's delta), ``epsilon_alone`` = its
        releases' epsilon on their own."""
        c, std = self.config, self.standardisation
        record = {
            "mode": std.mode,
            "requested": c.standardize,
            "description": std.describe(),
            "noise_multiplier": self.standardize_noise,
            "noise_multiplier_rule": None,
            "epsilon": None,
            "epsilon_alone": None,
            **{k: v for k, v in std.state_dict().items() if k not in ("mode", "image")},
        }
        if std.mode == "dp" and c.standardize_noise is None:
            needed = precision_noise_multiplier(len(self.raw.y_train), self.raw.input_shape, self.raw.image)
            sigma = self.noise_multiplier
            steps = "" if sigma is None else f"the steps' noise multiplier {sigma:.4g}, "
            record["noise_multiplier_rule"] = (f"the larger of {steps}and {needed:.4g}, at which the estimates' noise "
                                               f"std is {STANDARDIZE_PRECISION} of each clip range")  # fmt: skip
        if self.private:
            delta = c.delta - self.delta_truncation()
            record["epsilon"] = 0.0
            record["epsilon_alone"] = 0.0
            if self.accountant.preprocessing:
                record["epsilon"] = self.epsilon() - self.accountant.training_epsilon(delta)
                record["epsilon_alone"] = self._planned_epsilon(None, 0, self.standardize_noise, delta)
        return record

    # ------------------------------------------------------------------------ checkpoints

    def _identity(self) -> dict:
        c = self.config
        identity = {
            "variant": c.variant,
            "dataset": self.raw.name,
            "model": c.model,
            "hidden": c.hidden,
            "batch_size": c.batch_size,
            "seed": c.seed,
            "accountant": c.accountant,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": c.clip_norm if self.private else None,
            "shuffle": isinstance(self.sampler, ShuffleSampler),
            "num_examples": self.data.x_train.shape[0],
            "sample_rate": self.sampler.sample_rate,
            "standardize": self.standardize,  # the inputs the model learned on
            "standardize_noise": self.standardize_noise,
        }
        if self.raw.provenance is not None:  # a data file: the same bytes and label column
            identity.update({"data_sha256": self.raw.provenance["sha256"], "target": c.target})
        if self.private:  # everything a resumed run's guarantee depends on must be the same
            identity.update({
                "epsilon": c.epsilon,
                "delta": c.delta,
                "precision": c.precision,
                "loss_scale": resolve_loss_scale(c.precision, c.loss_scale),
                "privacy_randomness": "os-entropy" if c.reproducible_privacy_seed is None else "reproducible",
                "reproducible_privacy_seed": c.reproducible_privacy_seed,
            })  # fmt: skip
            if c.variant == "jl":
                identity["projections"] = c.projections
            if c.variant == "backprop":
                identity["input_clip"] = c.input_clip
            if c.variant in ("clipless", "weightclip"):
                identity.update({"tau": c.tau, "noise_strategy": c.noise_strategy})
                if c.logit_clip_quantile is not None:  # (checkpoints from before the option keep their identity)
                    identity["logit_clip_quantile"] = c.logit_clip_quantile
                if c.project_every != 1:
                    identity["project_every"] = c.project_every
                if c.loss != "tau-ce":  # (checkpoints of tau-ce runs from before --loss keep their identity)
                    identity.update({"loss": c.loss, "margin": c.margin, "hkr_alpha": c.hkr_alpha,
                                     "cosine_k": c.cosine_k})  # fmt: skip
            if c.model in LIPSCHITZ_MODELS:
                identity.update({"input_bound": c.input_bound, "max_weight_norm": c.max_weight_norm})
        if self._world_size() > 1:  # data-parallel: a resume must use as many processes
            identity["world_size"] = self._world_size()
        return identity

    def _world_size(self) -> int:
        return 1 if self.distributed is None else self.distributed.world_size

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Atomic write (temporary file, then rename): a crash never leaves a half-written checkpoint."""
        state = {
            "version": CHECKPOINT_VERSION,
            "identity": self._identity(),
            "step": self.step,
            "epoch": self.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "accountant": self.accountant.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
            "train_seconds": self.train_seconds,
            "standardization": self.standardisation.state_dict(),
            "variant_state": self.variant.checkpoint_state(),
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        if self.distributed is None:
            state = self._read_checkpoint(path, self.device)
        else:  # rank 0 (the one that writes checkpoints) reads and sends it; its error is raised on every rank
            state = self.distributed.from_main(lambda: self._read_checkpoint(path, torch.device("cpu")))
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.accountant.load_state_dict(state["accountant"])
            self.sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["torch_rng"])
            self.variant.restore_checkpoint_state(state.get("variant_state", {}))
        except (KeyError, RuntimeError, TypeError, ValueError) as exc:  # its parts do not fit this run's objects
            message = f"checkpoint {path} is corrupt: its saved state does not load into this run ({exc})"
            raise ValueError(message) from exc
        self.step, self.epoch = state["step"], state["epoch"]
        self.history, self.train_seconds = state["history"], state["train_seconds"]

    def _read_checkpoint(self, path: str | os.PathLike, map_location: torch.device) -> dict:
        """The checkpoint at ``path``, checked to be one this run may resume from."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist; run once without --resume to create it")
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)  # no code from the file
        except Exception as exc:  # noqa: BLE001 - any load failure means a corrupt or foreign file
            raise ValueError(f"checkpoint {path} is corrupt or not a fastdp checkpoint ({exc})") from exc
        if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
            found = f"version {state.get('version')!r}" if isinstance(state, dict) else f"a {type(state).__name__}"
            raise ValueError(f"checkpoint {path} is not a fastdp checkpoint of version {CHECKPOINT_VERSION} (found "
                             f"{found}); resume only from a checkpoint this version of fastdp wrote")  # fmt: skip
        missing = [key for key, kind in _CHECKPOINT_FIELDS.items() if not isinstance(state.get(key), kind)]
        if missing:
            raise ValueError(f"checkpoint {path} is corrupt: fields missing or of the wrong type: {', '.join(missing)}")
        bad = [name for name, t in state["model"].items() if not isinstance(t, torch.Tensor)
               or (t.is_floating_point() and not bool(torch.isfinite(t).all()))]  # fmt: skip
        if bad:
            raise ValueError(f"checkpoint {path} is corrupt: non-finite or non-tensor model entries: {', '.join(bad)} "
                             "(fastdp never saves a model that is not finite)")  # fmt: skip
        saved_world = state["identity"].get("world_size", 1)
        if saved_world != self._world_size():
            raise ValueError(
                f"checkpoint {path} was written by a run on {saved_world} process(es), but this run has "
                f"{self._world_size()}: the number of processes cannot change on resume (each rank's shard, padding "
                f"and summation order depend on it, so the resumed run would not continue the same computation); "
                f"resume with --nproc {saved_world}" + ("" if saved_world > 1 else " (or without --nproc)")
            )
        saved, current = state["identity"], self._identity()
        if saved != current:

            def shown(identity: dict, key: str) -> str:
                return repr(identity[key]) if key in identity else "(absent)"

            keys = [k for k in dict.fromkeys([*saved, *current])
                    if (k in saved) != (k in current) or saved.get(k) != current.get(k)]  # fmt: skip
            differ = [f"{k}: {shown(saved, k)} in the checkpoint, {shown(current, k)} here" for k in keys]
            raise ValueError(
                f"checkpoint {path} was written by a different run: " + "; ".join(differ) + ". Every setting its "
                "privacy guarantee depends on (variant, noise multiplier, clip norms, projections, sample rate, "
                "N, delta, accountant, precision, privacy randomness, standardisation, ...) must stay the same on "
                "resume; resume with the same settings (epochs may grow)"
            )
        if state.get("standardization") != self.standardisation.state_dict():
            raise ValueError(f"checkpoint {path} is corrupt: its standardisation (the inputs its model learned on) is "
                             "missing or not one this run can use")  # fmt: skip
        return state


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def train(config: TrainConfig) -> dict:
    """Train one model as configured; returns the result dict."""
    return Trainer(config).run()
