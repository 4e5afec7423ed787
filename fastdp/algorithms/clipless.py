"""Clipless DP-SGD with a Lipschitz network (Béthune et al. 2024, "DP-SGD without clipping").

No per-example work: the per-example gradient norm of every parameter tensor is bounded analytically by
"backpropagation for bounds" (``fastdp.nn.lipschitz.lipschitz_bounds``) from the input bound X_0, the loss's
Lipschitz constant and the layers' certified constants on the current weights. One ordinary backward of the
summed loss, then noise on the sum and division by the expected batch size q N:

* ``strategy="per-layer"``: tensor l gets noise std s * Delta_l. D tensors released together are D Gaussian
  mechanisms with multiplier s each, which account as one with multiplier s / sqrt(D); the ``noise_multiplier``
  given here is that effective multiplier sigma (what the accountant records), so s = sigma * sqrt(D).
* ``strategy="global"``: every tensor gets std sigma * sqrt(sum_l Delta_l^2) (one Gaussian mechanism).

Adjacency add/remove-one. After the optimizer step the projection Pi restores the Lipschitz constraints
(post-processing of a private output: no privacy cost). The bounds are recomputed every step from the current
(private) weights.
"""

from __future__ import annotations

import math

import torch

from fastdp._precision import exact_fp32
from fastdp.algorithms.base import (
    SUMMED_IN_LOW_PRECISION,
    Batch,
    Variant,
    gradient_sums,
    release_noisy_mean,
    summed_loss_gradients,
    trainable_parameters,
)
from fastdp.nn.clip import clip_rows
from fastdp.nn.lipschitz import LipschitzLoss, TauCrossEntropy, lipschitz_bounds, mul_up, project_, sqrt_up, sum_up
from fastdp.ops.spectral import deferred_finite_checks
from fastdp.privacy.rng import PrivacyKeys
from fastdp.ref.spectral import round_up

STRATEGIES = ("per-layer", "global")


class Clipless(Variant):
    """Clipless DP-SGD; ``noise_multiplier`` is the effective sigma the accountant records."""

    name = "clipless"
    private = True
    front_door = "output"
    low_precision_refusal = (
        "its per-example bounds are analytic (Lipschitz constants and the input bound) on the exact gradient, with "
        "no per-example step that would absorb rounding; " + SUMMED_IN_LOW_PRECISION
    )

    def __init__(
        self,
        noise_multiplier: float,
        sample_rate: float,
        num_examples: int,
        input_bound: float | None = None,  # X_0 enforced here by projecting inputs; None: the model's BoundedInput
        loss: LipschitzLoss | None = None,
        strategy: str = "per-layer",
        reproducible_seed: int | None = None,
    ) -> None:
        loss = loss or TauCrossEntropy()
        if not isinstance(loss, LipschitzLoss):
            raise ValueError(f"clipless training needs a loss with a Lipschitz constant (LipschitzLoss), got {loss}")
        super().__init__(loss)
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown noise strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        if input_bound is not None and not (math.isfinite(input_bound) and input_bound > 0):
            raise ValueError(f"input bound X_0 must be finite and > 0, got {input_bound}")
        self.input_bound = input_bound
        self.strategy = strategy
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.last_bounds: torch.Tensor | None = None  # Delta_l of the last step, one per trainable tensor

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> Clipless:
        # the input bound X_0 lives in the model (BoundedInput, see fastdp.train.models)
        return cls(noise_multiplier, sample_rate, num_examples, loss=TauCrossEntropy(config.tau),
                   strategy=config.noise_strategy, reproducible_seed=noise_seed)  # fmt: skip

    def noise_stds(self, model: torch.nn.Module) -> torch.Tensor:
        """Noise std on the summed gradient of every trainable parameter, from the current bounds: a float32 tensor
        on the parameters' device, computed without reading any device value on the host.

        Computed in float64 from the float64 bounds with every product, sum and square root rounded up, and
        rounded up once to float32 (``last_bounds`` too): never below the exact sigma sqrt(D) Delta_l (or sigma
        sqrt(sum Delta^2)) of the bounds, where casts and float32 products round to nearest, half the time down."""
        x_bound = math.inf if self.input_bound is None else self.input_bound  # else the model's BoundedInput
        bounds = lipschitz_bounds(model, self.loss_fn, x_bound)
        params = trainable_parameters(model)
        device = params[0].device if params else torch.device("cpu")
        if not params:
            self.last_bounds = torch.zeros(0, device=device)
            return self.last_bounds
        # constant bounds are filled on the device (no host-to-device copy), weight-dependent ones are already there
        bounds64 = torch.stack([
            bounds[p].to(torch.float64) if isinstance(bounds[p], torch.Tensor)
            else torch.full((), bounds[p], dtype=torch.float64, device=device)
            for p in params
        ])  # fmt: skip
        self.last_bounds = round_up(bounds64, torch.float32)
        if self.strategy == "global":
            std = mul_up(self.noise_multiplier, sqrt_up(sum_up(mul_up(bounds64, bounds64))))
            return round_up(std, torch.float32).expand(len(params))
        scale = mul_up(self.noise_multiplier, sqrt_up(float(len(params))))
        return round_up(mul_up(scale, bounds64), torch.float32)

    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self.input_bound is not None:  # enforce X_0 on the inputs (a per-example projection)
            batch = Batch(clip_rows(batch.x, self.input_bound), batch.y, batch.mask)
        with exact_fp32():  # the analytic bounds leave no room for TF32/bf16 products (as for autocast, refused)
            return summed_loss_gradients(model, self.loss_fn, batch, self._forward)

    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        # the bounds are those of the weights the sums were computed with (the step has not changed them yet)
        with deferred_finite_checks():  # no host sync in the step; the trainer checks the weights every epoch
            stds = self.noise_stds(model)
        release_noisy_mean(trainable_parameters(model), sums, stds, self.expected_batch_size, self.keys, step)

    def output_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The front door's forward: with ``input_bound`` X_0, the one input tensor projected onto the X_0 ball."""
        if self.input_bound is None:
            with exact_fp32():  # the activations' norms are in the bounds too
                return model(*args, **kwargs)
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise ValueError(
                f"variant {self.name!r} with input_bound projects the model's input onto the X_0 ball, so the model "
                "must be called with one batch-first tensor; for other inputs start the model with "
                "fastdp.nn.lipschitz.BoundedInput and drop input_bound"
            )
        with exact_fp32():
            return model(clip_rows(args[0], self.input_bound))

    def sums_of_output(self, model: torch.nn.Module, output: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        """The front door's sums: each example's gradient w.r.t. its output row clipped to the loss's Lipschitz
        constant (a hair below, so that rounding cannot carry it above), which is what the bound rules credit the
        loss with, whatever loss the user computed; then one backward through the model."""
        bounded = clip_rows(grad, self.loss_fn.lipschitz * (1 - 2**-20))
        with exact_fp32():
            return gradient_sums(trainable_parameters(model), output, bounded)

    def check_model(self, model: torch.nn.Module) -> None:
        """The Lipschitz bound rules (their refusal names every layer without one), before the row probe."""
        with torch.no_grad():
            self.noise_stds(model)

    def after_step(self, model: torch.nn.Module) -> None:
        with deferred_finite_checks():
            project_(model)

    def privacy_event(self) -> tuple[float, float]:
        return self.noise_multiplier, self.sample_rate

    def describe(self) -> dict:
        return {
            "variant": self.name,
            "noise_multiplier": self.noise_multiplier,
            "strategy": self.strategy,
            "input_bound": self.input_bound,
            "loss": type(self.loss_fn).__name__,
            "loss_lipschitz": self.loss_fn.lipschitz,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "gradient_bounds": [] if self.last_bounds is None else self.last_bounds.tolist(),
            "privacy_randomness": self.keys.label,
        }


class WeightClip(Clipless):
    """Lip-DP-SGD (Barczewski and Ramon 2023) with its privacy defects fixed (W1-W8, docs/papers.md): the same
    bound machinery as clipless, on a network whose layers keep ||W_k||_2 <= C by rescaling only when above C (model
    ``weightclip_mlp``). Sensitivities come from data-independent bounds (inputs projected onto the X_0 ball, bias
    norms added, downstream constants only, eq. 14), the sum is divided by the expected batch size, and per-layer
    noise is accounted with its effective multiplier."""

    name = "weightclip"
