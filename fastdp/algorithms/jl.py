"""DP-SGD-JL (Bu et al. 2021, papers/03): per-example norms estimated from r Johnson-Lindenstrauss projections.

One step, for the batch B (Poisson-sampled with rate q from N examples), with F(theta) = (loss_1, ..., loss_B):
    v_1..v_r ~ N(0, I_d)                       fresh each step, shared by the batch, independent of the data
    P_ij     = <grad loss_i, v_j>              r forward-mode jvp's of F (``torch.func.jvp``), no per-example grads
    M_i      = sqrt((1/r) sum_j P_ij^2)         E[M_i^2] = ||grad loss_i||^2,  M_i / ||g_i|| ~ sqrt(chi2_r / r)
    w_i      = min(1, C / (M_i + 1e-6))          constants (no gradient flows through them)
    G        = grad of sum_i w_i loss_i  + N(0, (sigma C)^2 I)       one ordinary backward
    grad     = G / (q N)

The tangents come from fastdp's counter-based noise stream (4-draw sums, like the noise) under a key of their own:
by default one OS-entropy key per step, drawn the first time the step is seen and kept until its release, so every
micro-batch of a logical step (and, data-parallel, every rank) projects on the same r tangents, as the analysis
assumes (one set per step); with a reproducible seed (NOT FOR RELEASE) the noise seed mixed with a constant, counter
``step * r + j`` (``fastdp.privacy.rng.PrivacyKeys.tangent_key``). They are generated on the device, one at a
time, never stored r x d, and never reused across steps.

Privacy. w_i g_i can exceed C when M_i under-estimates ||g_i||, so a step is not a Gaussian mechanism with
sensitivity C: it is dominated by a Gaussian mechanism whose sensitivity Z_r = (chi2_r / r)^(-1/2) is random and
revealed (papers/03 Thm B.7). The accountant is the PLD of that mixture (``fastdp.privacy.jl``); RDP cannot account
it (its privacy loss has moments only below r/2) and is refused. DP-Adam-JL is this gradient fed to Adam (the
trainer's ``--optimizer adam``; torch's Adam, whose second-moment bias correction uses beta2 — the paper's
Algorithm 2 misprints beta1 there).

Layers that mix examples (batch statistics in training mode) or draw randomness in the forward pass (dropout in
training mode) are refused: the jvp forwards and the backward would see different functions, and the estimates
would then be of some other gradient's norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call, jvp, vmap

from fastdp.algorithms.base import (
    SUMMED_IN_LOW_PRECISION,
    Batch,
    Variant,
    draw_eagerly,
    per_example_cross_entropy,
    release_noisy_mean,
    sum_dtype,
    trainable_parameters,
)
from fastdp.nn import mixes_examples
from fastdp.ops import add_noise_
from fastdp.privacy.rng import NOISE_DRAWS, PrivacyKeys

NORM_EPS = 1e-6  # in the clip factor's denominator, as in DP-SGD
_STOCHASTIC = (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)


def check_deterministic_per_example(model: nn.Module) -> None:
    """Refuse modules that make the per-example loss depend on other examples (``fastdp.nn.mixes_examples``, in
    either mode) or on fresh randomness (dropout in training mode)."""
    bad = [f"{n or '<model>'} ({type(m).__name__})" for n, m in model.named_modules()
           if mixes_examples(m) or (m.training and isinstance(m, _STOCHASTIC))]  # fmt: skip
    if bad:
        raise ValueError(
            "DP-SGD-JL needs each example's loss to be a fixed function of the parameters during a step, but these "
            "layers use batch statistics in eval mode (BatchNorm without running statistics), or batch statistics "
            "or dropout in training mode: " + ", ".join(bad) + ". Use GroupNorm or LayerNorm instead of batch "
            "statistics (or eval mode with running statistics, track_running_stats=True), and drop dropout (or put "
            "it in eval mode)."
        )


def draw_tangents(
    params: list[torch.Tensor], keys: PrivacyKeys, step: int, projections: int, first: int, count: int
) -> list[torch.Tensor]:
    """Tangents ``first .. first + count - 1`` of ``step``: one [count, *p.shape] N(0, 1) tensor per parameter (4-draw
    sums). Tangent j is counter ``base + j`` under the step's tangent key (``keys.tangent_key``: one key per step,
    whatever the chunking or the micro-batch). Under torch.compile they are drawn eagerly (``draw_eagerly``): never
    replayed from a captured graph."""
    if torch.compiler.is_compiling():
        return _draw_tangents_eagerly(params, keys, step, projections, first, count)
    seed, base = keys.tangent_key(step, projections)
    out = [torch.zeros(count, *p.shape, dtype=sum_dtype(p), device=p.device) for p in params]
    for k in range(count):
        add_noise_([t[k] for t in out], 1.0, seed=seed, offset=base + first + k, num_draws=NOISE_DRAWS)
    return [t.to(p.dtype) for t, p in zip(out, params, strict=True)]


_draw_tangents_eagerly = draw_eagerly(draw_tangents)


def jl_projections(
    model: nn.Module,
    loss_fn,
    x: torch.Tensor,
    y: torch.Tensor,
    projections: int,
    keys: PrivacyKeys,
    step: int,
    chunk: int = 8,
    forward=None,
) -> torch.Tensor:
    """P [B, r] with P_ij = <grad of example i's loss, v_j>, from forward-mode jvp's of the per-example loss vector.

    ``chunk`` tangents at a time go through one vmapped jvp (the primal forward is shared by the chunk).
    ``forward(fn, x)`` runs the model's forward ``fn`` (default ``fn(x)``; the variant passes its ``_forward``)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    fixed.update(dict(model.named_buffers()))

    def losses(trainable: dict) -> torch.Tensor:
        def run(inputs: torch.Tensor) -> torch.Tensor:
            return functional_call(model, {**trainable, **fixed}, (inputs,))

        return loss_fn(run(x) if forward is None else forward(run, x), y)

    def project(*tangent: torch.Tensor) -> torch.Tensor:
        return jvp(losses, (params,), (dict(zip(names, tangent, strict=True)),))[1]

    columns = []
    for first in range(0, projections, chunk):
        count = min(chunk, projections - first)
        tangents = draw_tangents([params[n] for n in names], keys, step, projections, first, count)
        columns.append(vmap(project)(*tangents).t())  # [B, count]
    return torch.cat(columns, dim=1).to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def norm_estimates(p: torch.Tensor) -> torch.Tensor:
    """M_i = sqrt(mean_j P_ij^2): the JL estimate of each example's gradient norm."""
    return p.pow(2).mean(dim=1).sqrt()


def reweighted_gradient_sum(
    model: nn.Module, loss_fn, batch: Batch, weights: torch.Tensor, forward=None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(gradient of sum_i w_i loss_i per trainable parameter, in ``sum_dtype``; the summed loss of the real rows).

    One forward (``forward(model, x)``, default ``model(x)``) and one ordinary backward; ``weights`` [B] are
    constants (detached) and should be 0 on padding."""
    params = trainable_parameters(model)
    losses = loss_fn(model(batch.x) if forward is None else forward(model, batch.x), batch.y)
    grads = torch.autograd.grad((losses * weights.detach().to(losses.dtype)).sum(), params, allow_unused=True)
    sums = [torch.zeros_like(p, dtype=sum_dtype(p)) if g is None else g.to(sum_dtype(p))
            for p, g in zip(params, grads, strict=True)]  # fmt: skip
    return sums, (losses.detach() * batch.mask).sum()


class JL(Variant):
    """DP-SGD-JL: clip factors from r JL norm estimates; noise std sigma * C on the sum; its own accountant."""

    name = "jl"
    private = True
    draws_tangents = True  # data-parallel OS-entropy runs share each step's tangent key (fastdp.train.distributed)
    low_precision_refusal = (
        "its accountant assumes each per-example norm estimate is exactly sqrt(chi2_r / r) times the exact norm "
        "(Gaussian projections of the exact gradient), which low-precision jvp's do not give, and the reweighted "
        "gradient is not clipped per example afterwards; " + SUMMED_IN_LOW_PRECISION
    )

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        sample_rate: float,
        num_examples: int,
        projections: int = 10,
        reproducible_seed: int | None = None,
        loss_fn=per_example_cross_entropy,
        chunk: int = 8,
    ) -> None:
        super().__init__(loss_fn)
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip norm C must be finite and > 0, got {clip_norm}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if isinstance(projections, bool) or not isinstance(projections, int) or projections < 1:
            raise ValueError(
                f"JL projections r must be an integer >= 1, got {projections!r} (exact norms: use the dpsgd variant)"
            )
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk (tangents per vmapped jvp) must be an integer >= 1, got {chunk!r}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        self.projections = projections
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.chunk = chunk

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> JL:
        return cls(config.clip_norm, noise_multiplier, sample_rate, num_examples, projections=config.projections,
                   reproducible_seed=noise_seed)  # fmt: skip

    @classmethod
    def accounting_projections(cls, config) -> float:
        return config.projections

    def clip_weights(self, model: nn.Module, batch: Batch, step: int) -> torch.Tensor:
        """w_i = min(1, C / (M_i + 1e-6)) on real rows, 0 on padding."""
        check_deterministic_per_example(model)
        p = jl_projections(model, self.loss_fn, batch.x, batch.y, self.projections, self.keys, step, self.chunk,
                           self._forward)  # fmt: skip
        weights = (self.clip_norm / (norm_estimates(p) + NORM_EPS)).clamp(max=1.0)
        return weights * batch.mask.to(weights.dtype)

    def clipped_sum(self, model: nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        if batch.x.shape[0] == 0:
            params = trainable_parameters(model)
            return [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params], torch.zeros((), device=batch.x.device)
        return reweighted_gradient_sum(model, self.loss_fn, batch, self.clip_weights(model, batch, step),
                                       self._forward)  # fmt: skip

    def release(self, model: nn.Module, sums: list[torch.Tensor], step: int) -> None:
        params = trainable_parameters(model)
        stds = [self.noise_multiplier * self.clip_norm] * len(params)
        release_noisy_mean(params, sums, stds, self.expected_batch_size, self.keys, step)

    def privacy_event(self) -> tuple[float, float]:
        return self.noise_multiplier, self.sample_rate

    def describe(self) -> dict:
        return {
            "variant": self.name,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "projections": self.projections,
            "privacy_randomness": self.keys.label,
        }
