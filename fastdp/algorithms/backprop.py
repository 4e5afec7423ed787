"""Backpropagation clipping (Stevens et al. 2022, corrected): per-layer input clip C1 and upstream-gradient clip C2.

One backward of the summed loss through layers converted by ``fastdp.nn.backprop.convert_backprop``, which sum
their gradients over the batch in float64 (``fastdp.nn.layers.SummedLayer``); each parameter tensor's per-example
gradient norm is <= Delta_l (C1 C2 for weights, C2 or sqrt(T) C2 for biases), so tensor l of the sum gets noise std
s Delta_l (1 + s') (s': the sums' rounding, ``rounding_noise_factor``) and the sum is divided by the expected batch
size q N — once: the published code divided the sensitivity by the batch size a second time (noise b times too
small).

The N tensors are N Gaussian mechanisms with multiplier s, which account as one with multiplier s / sqrt(N)
(``fastdp.privacy.per_layer_noise_multiplier``); ``noise_multiplier`` here is that effective sigma (what the
accountant records under Poisson sampling), so s = sigma sqrt(N). The paper's zCDP figure (no subsampling
amplification, disjoint batches) is reported alongside for comparison by :meth:`zcdp_epsilon`.
"""

from __future__ import annotations

import math
import weakref

import torch

from fastdp._precision import exact_fp32
from fastdp.algorithms.base import (
    SUMMED_IN_LOW_PRECISION,
    Batch,
    Variant,
    bounded_gradient_sums,
    per_example_cross_entropy,
    release_noisy_mean,
    rounding_noise_factor,
    summed_forward,
    trainable_parameters,
)
from fastdp.nn.backprop import (
    BackpropClipConv2d,
    BackpropClipLinear,
    check_backprop_supported,
    convert_backprop,
    parameter_sensitivities,
    refuse_reused_layers,
    reset_calls,
)
from fastdp.privacy.accounting import zcdp_rho, zcdp_to_epsilon
from fastdp.privacy.rng import PrivacyKeys


class BackpropClip(Variant):
    """Backpropagation clipping with input clip ``input_clip`` (C1) and gradient clip ``grad_clip`` (C2)."""

    name = "backprop"
    private = True
    front_door = "output"
    low_precision_refusal = (
        "its bounds are enforced inside the network (inputs clipped to C1, upstream gradients to C2), and the weight "
        "gradients are formed from them afterwards; " + SUMMED_IN_LOW_PRECISION
    )

    def __init__(
        self,
        input_clip: float,
        grad_clip: float,
        noise_multiplier: float,
        sample_rate: float,
        num_examples: int,
        reproducible_seed: int | None = None,
        loss_fn=per_example_cross_entropy,
    ) -> None:
        super().__init__(loss_fn)
        for what, value in (("input clip C1", input_clip), ("gradient clip C2", grad_clip)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"backprop clipping: {what} must be finite and > 0, got {value}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.input_clip, self.grad_clip = float(input_clip), float(grad_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        self.num_examples = num_examples  # bounds every batch: the rounding of its float64 sums (release)
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.tensors = 0
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models converted (by identity; a freed id can recur)

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> BackpropClip:
        return cls(config.input_clip, config.clip_norm, noise_multiplier, sample_rate, num_examples,
                   reproducible_seed=noise_seed)  # fmt: skip

    def prepare(self, model: torch.nn.Module) -> None:
        """Convert the model's layers to backprop-clip layers once per model (in place)."""
        if model not in self._prepared:
            convert_backprop(model, self.input_clip, self.grad_clip)
            self._prepared.add(model)

    def row_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The clipping layers: each clips its input rows (C1) and output-gradient rows (C2) one example per row."""
        return [m for m in model.modules() if isinstance(m, (BackpropClipLinear, BackpropClipConv2d))]

    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        self.prepare(model)
        check_backprop_supported(model)  # every step: train/eval mode and requires_grad can change after convert
        reset_calls(model)
        with exact_fp32():  # the weight gradients are the clipped sums: no TF32/bf16 rounding of the clipped rows
            out, records = summed_forward(lambda: self._forward(model, batch.x), batch.x.shape[0])
            refuse_reused_layers(model)  # a layer called k times sums k clipped terms: k C1 C2, not the C1 C2 credited
            losses = self.loss_fn(out, batch.y) * batch.mask
            return bounded_gradient_sums(model, records, losses.sum()), losses.detach().sum()

    def output_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The front door's forward (in the front door's :func:`summed_forward`), with the checks of
        :meth:`clipped_sum` (each layer called once)."""
        self.prepare(model)
        check_backprop_supported(model)
        reset_calls(model)
        output = model(*args, **kwargs)
        refuse_reused_layers(model)
        return output

    def sums_of_output(
        self, model: torch.nn.Module, output: torch.Tensor, grad: torch.Tensor, records: list
    ) -> list[torch.Tensor]:
        """The front door's sums: one backward from the output gradient; the layers clip each example's inputs (C1)
        and upstream gradients (C2) on the way, as in :meth:`clipped_sum`, and sum their gradients in float64."""
        with exact_fp32():
            return bounded_gradient_sums(model, records, output, grad)

    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        params = trainable_parameters(model)
        sensitivities = parameter_sensitivities(model)
        self.tensors = len(params)
        # times 1 + s: the rounding of the float64 batch sums (rounding_noise_factor), rounded up with the product
        scale = self.noise_multiplier * math.sqrt(len(params)) * rounding_noise_factor(self.num_examples)
        stds = [math.nextafter(scale * sensitivities[p], math.inf) for p in params]  # on the sum; / q N once, below
        release_noisy_mean(params, sums, stds, self.expected_batch_size, self.keys, step)

    def privacy_event(self) -> tuple[float, float]:
        return self.noise_multiplier, self.sample_rate

    def zcdp_epsilon(self, epochs: int, delta: float) -> float:
        """The paper's accounting, for comparison only: per tensor rho = 1 / (2 s^2) per epoch (disjoint batches,
        no amplification), N tensors and ``epochs`` epochs composed, converted to epsilon at ``delta``."""
        per_tensor = self.noise_multiplier * math.sqrt(max(self.tensors, 1))
        return zcdp_to_epsilon(zcdp_rho(per_tensor, epochs * max(self.tensors, 1)), delta)

    def comparison_epsilons(self, epochs: int, delta: float) -> dict[str, float]:
        return {"zcdp_paper": self.zcdp_epsilon(epochs, delta)}

    def describe(self) -> dict:
        return {
            "variant": self.name,
            "input_clip": self.input_clip,
            "grad_clip": self.grad_clip,
            "noise_multiplier": self.noise_multiplier,
            "noise_multiplier_per_tensor": self.noise_multiplier * math.sqrt(max(self.tensors, 1)),
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "privacy_randomness": self.keys.label,
        }
