"""Clipless DP-SGD with a Lipschitz network (Béthune et al. 2024, "DP-SGD without clipping").

No per-example work: the per-example gradient norm of every parameter tensor is bounded analytically by
"backpropagation for bounds" (``fastdp.nn.lipschitz.lipschitz_bounds``) from the input bound X_0, the loss's
Lipschitz constant and the layers' certified constants on the current weights. One backward of the summed loss, in
which the layers sum their gradients over the batch in float64 (``fastdp.nn.layers.SummedLayer``; the noise below
is scaled by 1 + s for that sum's rounding, ``rounding_noise_factor``), then noise on the sum and division by the
expected batch size q N:

* ``strategy="per-layer"``: tensor l gets noise std s * Delta_l. D tensors released together are D Gaussian
  mechanisms with multiplier s each, which account as one with multiplier s / sqrt(D); the ``noise_multiplier``
  given here is that effective multiplier sigma (what the accountant records), so s = sigma * sqrt(D).
* ``strategy="global"``: every tensor gets std sigma * sqrt(sum_l Delta_l^2) (one Gaussian mechanism).

Adjacency add/remove-one. After the optimizer step the projection Pi restores the Lipschitz constraints
(post-processing of a private output: no privacy cost). The bounds are those of the current (private) weights, every
step (certified, carried across steps: ``fastdp.nn.lipschitz.LipschitzLinear``).

``project_every=k`` projects after every k-th step only. The projection costs about 2 n^2 m per n x m dense layer
whatever the batch (2 n / (3 B) of a step), so at small batches it dominates; between projections every bound is
still certified for the weights as they are (a dense layer's carried certificate plus ||W - W_certified||_F, a
convolution's Gram iteration, a bias's norm), only looser, so the noise grows with the drift, and the drift with
the noise (keep the learning rate small): a trade of noise for time, measured in docs/variant-lipschitz.md. Privacy
does not depend on k.

Logit-gradient clipping at a private quantile (``logit_clip_quantile``; Béthune et al. 2024 section 3.1, adaptive as
in Andrew et al. 2021): each example's loss gradient w.r.t. the logits is clipped to C_t, so the bound rules start
from min(L, C_t) instead of L; C_t follows the quantile q of the batch's logit-gradient norms. That reads private
data, so each step also releases the count of the batch's examples with norm <= C_t (sensitivity 1 under
add/remove-one) with noise N(0, sigma_c^2), in the same draw as the gradient sums, and sets
C_{t+1} = C_t exp(-eta (count~ / (q N) - q)) from it (post-processing), clamped to [1e-6 L, L]. The sums and the
count are one Gaussian mechanism on the same Poisson sample: with the sums' multiplier sigma_g it has the effective
multiplier sigma = (sigma_g^-2 + sigma_c^-2)^-1/2, which is what ``noise_multiplier`` is and what the accountant
records; the sums get sigma_g = (sigma^-2 - sigma_c^-2)^-1/2 > sigma. Default sigma_c = q N / 20 (Andrew et al.),
which costs the sums about 0.3 % more noise at q N = 256 and sigma = 1, and at least 4 sigma (3 %).
"""

from __future__ import annotations

import math

import torch

from fastdp._precision import exact_fp32
from fastdp.algorithms.base import (
    SUMMED_IN_LOW_PRECISION,
    Batch,
    Variant,
    bounded_gradient_sums,
    refuse_unsummed,
    release_noisy_mean,
    rounding_noise_factor,
    summed_forward,
    trainable_parameters,
)
from fastdp.nn.clip import CLIP_MARGIN, clip_rows
from fastdp.nn.lipdp import loss_from_config
from fastdp.nn.lipschitz import (
    LipschitzLoss,
    TauCrossEntropy,
    check_rules,
    lipschitz_bounds,
    mul_up,
    project_,
    sqrt_up,
    sum_up,
)
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
        logit_clip_quantile: float | None = None,
        count_noise_multiplier: float | None = None,
        logit_clip_lr: float = 0.2,
        project_every: int = 1,
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
        self.num_examples = num_examples  # bounds every batch: the rounding of its float64 sums (noise_stds)
        if input_bound is not None and not (math.isfinite(input_bound) and input_bound > 0):
            raise ValueError(f"input bound X_0 must be finite and > 0, got {input_bound}")
        self.input_bound = input_bound
        self.strategy = strategy
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.last_bounds: torch.Tensor | None = None  # Delta_l of the last step, one per trainable tensor
        self.logit_clip_quantile = logit_clip_quantile
        self.logit_clip: torch.Tensor | None = None  # C_t (float64 0-d, on the model's device), set at the first step
        self._count: torch.Tensor | None = None  # this step's count of examples under C_t, until its release
        self.logit_clip_lr = float(logit_clip_lr)
        self.count_noise_multiplier = self._count_noise(count_noise_multiplier)
        if isinstance(project_every, bool) or not isinstance(project_every, int) or project_every < 1:
            raise ValueError(f"project_every must be an int >= 1 (project after every k-th step), got "
                             f"{project_every!r}")  # fmt: skip
        self.project_every = project_every
        self.steps_since_projection = 0

    @property
    def gradient_noise_multiplier(self) -> float:
        """sigma_g, the sums' multiplier: with the count's sigma_c, the joint mechanism has the effective
        ``noise_multiplier`` sigma (module docstring); sigma itself without logit-clip quantile. Derived from sigma
        every time, so a copy with sigma = 0 (the audit's noiseless release) releases without noise."""
        sigma = self.noise_multiplier
        if self.logit_clip_quantile is None or sigma == 0:
            return sigma
        # 1 + 2**-40 covers the float rounding of the formula: the joint multiplier is never below sigma
        return (sigma**-2 - self.count_noise_multiplier**-2) ** -0.5 * (1 + 2.0**-40)

    def _count_noise(self, count_noise_multiplier: float | None) -> float:
        """sigma_c, the count's multiplier (checked); inf without logit-clip quantile."""
        q = self.logit_clip_quantile
        if q is None:
            if count_noise_multiplier is not None:
                raise ValueError(
                    "count_noise_multiplier is the noise of the logit-clip count: give logit_clip_quantile"
                )
            return math.inf
        if isinstance(q, bool) or not (isinstance(q, (int, float)) and 0 < q < 1):
            raise ValueError(f"logit_clip_quantile must be in (0, 1), got {q!r}")
        if not (math.isfinite(self.logit_clip_lr) and self.logit_clip_lr > 0):
            raise ValueError(f"logit_clip_lr must be finite and > 0, got {self.logit_clip_lr!r}")
        sigma_c = count_noise_multiplier
        if sigma_c is None:  # Andrew et al.'s q N / 20, and at least 4 sigma (the sums then pay 3 % more noise)
            sigma_c = max(self.expected_batch_size / 20, 4 * self.noise_multiplier, 1e-3)
        if not (math.isfinite(sigma_c) and sigma_c > self.noise_multiplier):
            raise ValueError(
                f"count_noise_multiplier ({sigma_c!r}) must be finite and larger than the effective noise multiplier "
                f"({self.noise_multiplier}): the count and the sums share it, sigma^-2 = sigma_g^-2 + sigma_c^-2. Give "
                "a larger count_noise_multiplier (default: the larger of expected batch size / 20 and 4 sigma)"
            )
        return float(sigma_c)

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> Clipless:
        # the input bound X_0 lives in the model (BoundedInput, see fastdp.train.models); the loss: config.loss
        return cls(noise_multiplier, sample_rate, num_examples, loss=loss_from_config(config),
                   strategy=config.noise_strategy, reproducible_seed=noise_seed,
                   logit_clip_quantile=getattr(config, "logit_clip_quantile", None),
                   project_every=getattr(config, "project_every", 1))  # fmt: skip

    def checkpoint_state(self) -> dict:
        """What a resumed run needs beyond the model and optimizer: the logit clip value C_t (a released value) and,
        with ``project_every`` > 1, the steps since the last projection (a resumed run projects on the same steps)."""
        state = {} if self.logit_clip is None else {"logit_clip": float(self.logit_clip)}
        if self.project_every > 1:
            state["steps_since_projection"] = self.steps_since_projection
        return state

    def restore_checkpoint_state(self, state: dict) -> None:
        """Adopt a saved C_t and count of steps since the last projection. Any C_t in [1e-6 L, L] is safe (the clip
        enforces it and the bounds use it), any count in [0, project_every) too (the bounds do not depend on it);
        others are refused."""
        steps = state.get("steps_since_projection", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < self.project_every:
            raise ValueError(f"a saved count of steps since the last projection must be an int in [0, project_every = "
                             f"{self.project_every}), got {steps!r}")  # fmt: skip
        self.steps_since_projection = steps
        clip = state.get("logit_clip")
        if clip is None:
            return
        lipschitz = float(self.loss_fn.lipschitz)
        if isinstance(clip, bool) or not isinstance(clip, float) or not 1e-6 * lipschitz <= clip <= lipschitz:
            raise ValueError(f"a saved logit clip value must be a float in [1e-6 L, L] = [{1e-6 * lipschitz}, "
                             f"{lipschitz}], got {clip!r}")  # fmt: skip
        self.logit_clip = torch.tensor(clip, dtype=torch.float64)

    def noise_stds(self, model: torch.nn.Module) -> torch.Tensor:
        """Noise std on the summed gradient of every trainable parameter, from the current bounds: a float32 tensor
        on the parameters' device, computed without reading any device value on the host.

        Computed in float64 from the float64 bounds with every product, sum and square root rounded up, and
        rounded up once to float32 (``last_bounds`` too): never below the exact sigma sqrt(D) Delta_l (or sigma
        sqrt(sum Delta^2)) of the bounds, where casts and float32 products round to nearest, half the time down.
        Times ``1 + s``: the rounding of the batch's float64 sums moves one example's contribution by at most
        ``s Delta_l`` (``fastdp.algorithms.base.rounding_noise_factor``; s < 1e-3 for a million examples)."""
        x_bound = math.inf if self.input_bound is None else self.input_bound  # else the model's BoundedInput
        bounds = lipschitz_bounds(model, self.loss_fn, x_bound, self.logit_clip)
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
        sigma = mul_up(self.gradient_noise_multiplier, rounding_noise_factor(self.num_examples))
        if self.strategy == "global":
            std = mul_up(sigma, sqrt_up(sum_up(mul_up(bounds64, bounds64))))
            return round_up(std, torch.float32).expand(len(params))
        scale = mul_up(sigma, sqrt_up(float(len(params))))
        return round_up(mul_up(scale, bounds64), torch.float32)

    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self.input_bound is not None:  # enforce X_0 on the inputs (a per-example projection)
            batch = Batch(clip_rows(batch.x, self.input_bound * CLIP_MARGIN), batch.y, batch.mask)
        check_rules(model)  # before the forward: names every layer without a rule (then the release computes them)
        if batch.x.shape[0] == 0:  # an empty Poisson batch: zero sums (some layers cannot run on 0 rows)
            empty = torch.zeros((), device=batch.x.device)
            return bounded_gradient_sums(model, [], empty), empty
        with exact_fp32():  # the analytic bounds leave no room for TF32/bf16 products (as for autocast, refused)
            logits, records = summed_forward(lambda: self._forward(model, batch.x), batch.x.shape[0])
            # the loss's gradient at a detached copy of the logits: this backward must not reach the layers' hooks
            leaf = logits.detach().requires_grad_()
            losses = self.loss_fn(leaf, batch.y) * batch.mask
            (grad,) = torch.autograd.grad(losses.sum(), leaf)
            return self._output_sums(model, logits, grad, records, batch.mask), losses.detach().sum()

    def _output_sums(
        self,
        model: torch.nn.Module,
        logits: torch.Tensor,
        grad: torch.Tensor,
        records: list,
        mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Each example's gradient w.r.t. its logits (row of ``grad``) clipped to the loss's constant L (a hair below,
        so that the chain rule's rounding cannot carry a row above what the bound rules credit the loss with), or,
        with ``logit_clip_quantile``, to C_t, the real examples (``mask``) with norm <= C_t added to this step's
        count (released with its sums); then one backward through the model of :func:`summed_forward`
        (``records``), whose layers sum their gradients over the batch in float64."""
        if self.logit_clip_quantile is None:
            clipped = clip_rows(grad, self.loss_fn.lipschitz * CLIP_MARGIN)
            return bounded_gradient_sums(model, records, logits, clipped)
        if self.logit_clip is None:  # C_0 = L: the first step clips nothing the bounds did not already cover
            self.logit_clip = torch.full((), float(self.loss_fn.lipschitz), dtype=torch.float64, device=grad.device)
        norms = torch.linalg.vector_norm(grad.reshape(grad.shape[0], -1).to(torch.float64), dim=1)
        factor = (self.logit_clip * CLIP_MARGIN / norms.clamp_min(1e-300)).clamp(max=1.0)
        clipped = grad * factor.to(grad.dtype).reshape(-1, *([1] * (grad.dim() - 1)))
        under = norms <= self.logit_clip
        if mask is not None:
            under = under & mask.bool()
        count = under.sum().to(torch.float64).reshape(1)
        self._count = count if self._count is None else self._count + count  # micro-batches of one step add up
        return bounded_gradient_sums(model, records, logits, clipped)

    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        # the bounds are those of the weights the sums were computed with (the step has not changed them yet)
        with deferred_finite_checks():  # no host sync in the step; the trainer checks the weights every epoch
            stds = self.noise_stds(model)
        params = trainable_parameters(model)
        if self.logit_clip_quantile is None:
            release_noisy_mean(params, sums, stds, self.expected_batch_size, self.keys, step)
            return
        # a step without examples (an empty Poisson batch) releases a count of 0, noised like any other
        count = self._count if self._count is not None else torch.zeros(1, dtype=torch.float64, device=stds.device)
        self._count = None
        release_noisy_mean(params, sums, stds, self.expected_batch_size, self.keys, step,
                           extra=(count, self.count_noise_multiplier))  # fmt: skip
        # post-processing of the released (noisy) fraction: the geometric update, on the device
        fraction = count[0].clamp(0.0, 1.0)
        lipschitz = float(self.loss_fn.lipschitz)
        updated = self.logit_clip * torch.exp(-self.logit_clip_lr * (fraction - self.logit_clip_quantile))
        self.logit_clip = updated.clamp(1e-6 * lipschitz, lipschitz)

    def output_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The front door's forward (in the front door's :func:`summed_forward`): with ``input_bound`` X_0, the one
        input tensor projected onto the X_0 ball."""
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
            return model(clip_rows(args[0], self.input_bound * CLIP_MARGIN))

    def sums_of_output(
        self, model: torch.nn.Module, output: torch.Tensor, grad: torch.Tensor, records: list
    ) -> list[torch.Tensor]:
        """The front door's sums: each example's gradient w.r.t. its output row clipped as in :meth:`clipped_sum`
        (whatever loss the user computed, the bound rules credit it with L, or C_t), one backward through the model."""
        with exact_fp32():
            return self._output_sums(model, output, grad, records)

    def check_model(self, model: torch.nn.Module) -> None:
        """The Lipschitz bound rules (their refusal names every layer without one) and the layers that sum the
        gradients, before the row probe."""
        with torch.no_grad():
            self.noise_stds(model)
        refuse_unsummed(model)

    def after_step(self, model: torch.nn.Module) -> None:
        self.steps_since_projection += 1
        if self.steps_since_projection < self.project_every:
            return
        self.steps_since_projection = 0
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
            "logit_clip_quantile": self.logit_clip_quantile,
            "logit_clip": None if self.logit_clip is None else float(self.logit_clip),
            "count_noise_multiplier": None if self.logit_clip_quantile is None else self.count_noise_multiplier,
            "gradient_noise_multiplier": self.gradient_noise_multiplier,
            "project_every": self.project_every,
            "privacy_randomness": self.keys.label,
        }


class WeightClip(Clipless):
    """Lip-DP-SGD (Barczewski and Ramon 2023) with its privacy defects fixed (W1-W8, docs/papers.md): the same
    bound machinery as clipless, on a network whose layers keep ||W_k||_2 <= C by rescaling only when above C (model
    ``weightclip_mlp``). Sensitivities come from data-independent bounds (inputs projected onto the X_0 ball, bias
    norms added, downstream constants only, eq. 14), the sum is divided by the expected batch size, and per-layer
    noise is accounted with its effective multiplier."""

    name = "weightclip"
