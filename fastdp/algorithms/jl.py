"""DP-SGD-JL (Bu et al. 2021): per-example norms estimated from r Johnson-Lindenstrauss projections.

One step, for the batch B (Poisson-sampled with rate q from N examples), with g_i the gradient of example i's loss:
    v_1..v_r ~ N(0, I_d)                       fresh each step, shared by the batch, independent of the data
    P_ij     = <g_i, v_j>                      r projections per example, no per-example norm
    M_i      = sqrt((1/r) sum_j P_ij^2)         E[M_i^2] = ||g_i||^2,  M_i / ||g_i|| ~ sqrt(chi2_r / r)
    w_i      = min(1, C / (M_i + ...))          constants (see "Rounding" below for the ...)
    G        = sum_i w_i g_i + N(0, (sigma C)^2 I)
    grad     = G / (q N)

How. One forward and one backward through fastdp's DP layers (``fastdp.nn``, as DP-SGD's ghost mode: plain torch
layers are converted): each layer keeps its input A and output gradient G, and gives each example's projections
``P_ij = <a_i^T g_i, v_j>`` (each DP layer's ``per_example_projections``: its per-example gradient formed in float64
for a chunk of examples at a time and projected, never kept; an Embedding gathers the tangents' rows by token
instead); the re-weighted sum is then each layer's clipped sum of the same A and G with factors w_i (one GEMM). The
paper computes P with r forward-mode jvp's and the sum with a second, re-weighted backward; fastdp departs from it
because there the estimate and the sum are two computations with different rounding (next paragraph).

Rounding (privacy review, issue 14). The accountant (``fastdp.privacy.jl``) needs each example's contribution to be
at most ``C Z`` with ``Z = ||g|| / M(g)``, M the projection estimate *of the very vector summed*. When the jvp's and
the backward's roundings differ, an example whose positions cancel at large magnitude (its true gradient tiny against
``u sum_t |a_t| |g_t|``) had an estimate of one rounding and a contribution of another: 1.44 x the bound at 1e7 in
fp32. Now both come from the same A and G, and what rounding remains is bounded per example: ``err_i`` bounds the
float64 projections' error, and ``E_i`` (the layers' ``allowance``) how far the fp32 clipped sum moves from
``w_i g_i`` per unit weight. With ``w_i = min(1, C / ((M_i + err_i + K E_i + 1e-6) (1 + 4u)))`` and
``K = 1 / z_floor`` (``fastdp.privacy.jl.jl_z_floor``: the smallest Z the accountant credits, 0.46 for r = 10), the
contribution ``w_i (g_i + e_i)``, ``|e_i| <= E_i``, has norm at most ``C (Z M + E) / (M + K E) <= C max(Z, z_floor)``,
which the accountant accounts. For an ordinary example ``E_i`` is about ``T^1.5 u`` of its norm (3e-5 at T = 64).

Tangents come from fastdp's counter-based noise stream (4-draw sums, like the noise) under a key of their own:
by default one OS-entropy key per step, drawn the first time the step is seen and kept until its release, so every
micro-batch of a logical step (and, data-parallel, every rank) projects on the same r tangents, as the analysis
assumes (one set per step); with a reproducible seed (NOT FOR RELEASE) the noise seed mixed with a constant, counter
``step * r + j`` (``fastdp.privacy.rng.PrivacyKeys.tangent_key``). ``chunk`` tangents are drawn at a time, never
stored r x d, never reused across steps.

Privacy. w_i g_i can exceed C when M_i under-estimates ||g_i||, so a step is not a Gaussian mechanism with
sensitivity C: it is dominated by a Gaussian mechanism whose sensitivity Z_r = (chi2_r / r)^(-1/2) is random and
revealed (Bu et al. 2021 Thm B.7). The accountant is the PLD of that mixture (``fastdp.privacy.jl``); RDP cannot account
it (its privacy loss has moments only below r/2) and is refused. DP-Adam-JL is this gradient fed to Adam (the
trainer's ``--optimizer adam``; torch's Adam, whose second-moment bias correction uses beta2 -- the paper's
Algorithm 2 misprints beta1 there).

Models: those of DP-SGD's ghost mode (every trainable parameter in a DP layer; layers that mix examples refused,
``fastdp.nn.check_supported``; a layer's rows must be examples, ``fastdp.nn.rows``). Dropout is allowed: the
projections and the sum read the same forward.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from fastdp._precision import exact_fp32
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
from fastdp.algorithms.dpsgd import GhostBackward, dp_layers, ghost_backward
from fastdp.nn import check_supported, convert
from fastdp.ops import add_noise_, rounding_gamma
from fastdp.privacy.jl import jl_z_floor
from fastdp.privacy.rng import NOISE_DRAWS, PrivacyKeys

NORM_EPS = 1e-6  # in the clip factor's denominator, as in DP-SGD


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
    run: GhostBackward, keys: PrivacyKeys, step: int, projections: int, chunk: int = 8, caches: list | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P [B, r], err [B], allowance [B])``, float64, summed over the DP layers of ``run``: the projections of each
    example's gradient onto the step's r tangents (``chunk`` drawn at a time), the bound on their rounding (for every
    j) and the bound on the clipped sum's rounding per unit weight (each DP layer's ``per_example_projections``).
    ``caches``: one dict per layer call, filled for the layers' clipped sums."""
    b = run.grads_out[0].shape[0] if run.grads_out else 0
    device = run.losses.device
    p = torch.empty(b, projections, dtype=torch.float64, device=device)
    err = torch.zeros(b, dtype=torch.float64, device=device)
    allowance = torch.zeros_like(err)
    caches = caches if caches is not None else [None] * len(run.layers)
    for first in range(0, projections, chunk):
        count = min(chunk, projections - first)
        tangents = draw_tangents(run.params, keys, step, projections, first, count)
        of = {id(q): t for q, t in zip(run.params, tangents, strict=True)}
        p[:, first : first + count] = 0
        chunk_err = torch.zeros_like(err)
        for layer, saved, grad_out, cache in zip(run.layers, run.saved, run.grads_out, caches, strict=True):
            proj, e, a = layer.per_example_projections(saved, grad_out, [of[id(q)] for q in layer.dp_parameters()],
                                                       cache)  # fmt: skip
            p[:, first : first + count] += proj
            chunk_err += e
            if first == 0:
                allowance += a
        err = torch.maximum(err, chunk_err)
    return p, err, allowance


def norm_estimates(p: torch.Tensor) -> torch.Tensor:
    """M_i = sqrt(mean_j P_ij^2): the JL estimate of each example's gradient norm."""
    return p.pow(2).mean(dim=1).sqrt()


def jl_weights(
    p: torch.Tensor, err: torch.Tensor, allowance: torch.Tensor, clip_norm: float, z_floor: float, acc: torch.dtype
) -> torch.Tensor:
    """``w_i = min(1, C / ((M_i + err_i + allowance_i / z_floor + 1e-6) (1 + 4u)))`` (module docstring, "Rounding"):
    the factor whose contribution ``w_i (g_i + e_i)`` stays within ``C max(Z, z_floor)``. M is rounded up (its own
    float64 rounding); ``(1 + 4u)`` covers rounding w to ``acc`` (u its unit roundoff)."""
    m = norm_estimates(p) * (1 + rounding_gamma(p.shape[1] + 4, torch.float64))
    denominator = (m + err + allowance / z_floor + NORM_EPS) * (1 + 4 * torch.finfo(acc).eps / 2)
    return (clip_norm / denominator).clamp(max=1.0)


def _clipped_sum(run: GhostBackward, weights: torch.Tensor, caches: list) -> list[torch.Tensor]:
    sums = []
    with exact_fp32():  # the allowances are IEEE float32's, whatever the user's TF32/bf16 settings
        for layer, saved, grad_out, cache in zip(run.layers, run.saved, run.grads_out, caches, strict=True):
            sums.append(layer.clipped_grad_sums(saved, grad_out, weights.to(sum_dtype(grad_out)), cache))
    return run.by_parameter(sums)


class JL(Variant):
    """DP-SGD-JL: clip factors from r JL norm estimates; noise std sigma * C on the sum; its own accountant."""

    name = "jl"
    private = True
    front_door = "ghost"
    draws_tangents = True  # data-parallel OS-entropy runs share each step's tangent key (fastdp.engine.distributed)
    low_precision_refusal = (
        "its rounding bounds (fastdp.algorithms.jl, 'Rounding') are made for fp32 and float64 layer inputs and "
        "sums; " + SUMMED_IN_LOW_PRECISION
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
            raise ValueError(f"chunk (tangents drawn and projected at a time) must be an integer >= 1, got {chunk!r}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        self.projections = projections
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.chunk = chunk
        # the smallest Z the accountant credits (sigma = 0, noiseless: the bins' quantile without a tail cut)
        self.z_floor = jl_z_floor(projections, self.noise_multiplier if self.noise_multiplier > 0 else math.inf)
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models converted (by identity; a freed id can recur)

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> JL:
        return cls(config.clip_norm, noise_multiplier, sample_rate, num_examples, projections=config.projections,
                   reproducible_seed=noise_seed)  # fmt: skip

    @classmethod
    def accounting_projections(cls, config) -> float:
        return config.projections

    def prepare(self, model: nn.Module) -> None:
        """Convert torch layers to DP layers once per model (in place; parameters are kept), as DP-SGD's ghost mode."""
        if model not in self._prepared:
            convert(model)
            self._prepared.add(model)

    def row_layers(self, model: nn.Module) -> list[nn.Module]:
        """Every DP layer's input rows are projected and summed per example."""
        return dp_layers(model)

    def clip_weights(self, run: GhostBackward, mask: torch.Tensor, step: int, caches: list) -> torch.Tensor:
        """w_i (:func:`jl_weights`) on real rows (``mask``), 0 on padding."""
        p, err, allowance = jl_projections(run, self.keys, step, self.projections, self.chunk, caches)
        acc = sum_dtype(run.grads_out[0]) if run.grads_out else torch.float32
        weights = jl_weights(p, err, allowance, self.clip_norm, self.z_floor, acc)
        return weights * mask.to(weights.dtype)

    def sums_of_backward(
        self, model: nn.Module, run: GhostBackward, mask: torch.Tensor, step: int, loss_scale: float = 1.0
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`clipped_sum` of a backward the caller ran (the front door, ``fastdp.engine``); fp32/float64.
        ``run.grads_out`` are gradients of ``loss_scale`` times the summed per-example losses: divided out first
        (the projections' rounding bounds are those of the gradients they project)."""
        low = [str(g.dtype) for g in run.grads_out if g.dtype not in (torch.float32, torch.float64)]
        if low:
            raise ValueError(f"DP-SGD-JL trains in fp32 only, but the backward ran in {low[0]} (autocast): "
                             f"{self.low_precision_refusal}. Run the forward without autocast")  # fmt: skip
        if loss_scale != 1.0:
            run.grads_out = [g / loss_scale for g in run.grads_out]
        caches = [{} for _ in run.layers]
        return _clipped_sum(run, self.clip_weights(run, mask, step, caches), caches), run.losses.sum()

    def clipped_sum(self, model: nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        self.prepare(model)
        check_supported(model)  # every step: train/eval mode and tied weights can change after convert()
        if batch.x.shape[0] == 0:
            params = trainable_parameters(model)
            return [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params], torch.zeros((), device=batch.x.device)
        return self.sums_of_backward(model, ghost_backward(model, self.loss_fn, batch, self._forward), batch.mask, step)

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
