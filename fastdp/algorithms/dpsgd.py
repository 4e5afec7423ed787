"""DP-SGD (Abadi et al. 2016): per-example clipping to C, Gaussian noise on the clipped sum.

One step, for the batch B (Poisson-sampled with rate q from N examples):
    g_i  = grad of loss_i,   c_i = min(1, C / (||g_i||_2 + 1e-6))      (||.|| over all parameters)
    G    = sum_i c_i g_i + N(0, (sigma C)^2 I)
    grad = G / (q N)                                                  (expected batch size)
Adjacency add/remove-one: the sum has L2 sensitivity C, so the noise multiplier sigma is
what the accountant records with sample rate q.

Per-example gradients come from ``torch.func`` (vmap of grad): the reference path. A
faster one-backward path plugs in here as another ``clipped_gradient_sum``.
"""

from __future__ import annotations

import math

import torch
from torch.func import functional_call, grad, vmap

from fastdp.algorithms.base import Batch, Variant, per_example_cross_entropy, trainable_parameters
from fastdp.ops import add_noise_

NORM_EPS = 1e-6  # in the clip factor's denominator (Opacus' convention)


def per_example_gradients(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradient of each example's loss w.r.t. each trainable parameter: tensors of shape [B, *p.shape]."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def example_loss(trainable, xi, yi):
        out = functional_call(model, {**trainable, **frozen, **buffers}, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    grads = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    return [grads[n] for n in names]


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """c_i = min(1, C / (norm_i + 1e-6))."""
    return (clip_norm / (norms + NORM_EPS)).clamp(max=1.0)


def clipped_gradient_sum(
    model: torch.nn.Module, loss_fn, batch: Batch, clip_norm: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(sum over real examples of the clipped per-example gradients per parameter, summed loss). Reference path."""
    params = trainable_parameters(model)
    if batch.x.shape[0] == 0:
        return [torch.zeros_like(p) for p in params], torch.zeros((), device=batch.x.device)
    per_example = per_example_gradients(model, loss_fn, batch.x, batch.y)
    squared = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_example)
    weights = clip_factors(squared.sqrt(), clip_norm) * batch.mask.to(squared.dtype)
    sums = [torch.einsum("b,b...->...", weights, g) for g in per_example]
    with torch.no_grad():
        loss = (loss_fn(model(batch.x), batch.y) * batch.mask).sum()
    return sums, loss


class DPSGD(Variant):
    """DP-SGD with per-example clipping; ``noise_multiplier`` sigma, noise std sigma * C on the sum."""

    name = "dpsgd"
    private = True

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        sample_rate: float,
        num_examples: int,
        seed: int = 0,
        secure: bool = False,
        loss_fn=per_example_cross_entropy,
    ) -> None:
        super().__init__(loss_fn)
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip norm C must be finite and > 0, got {clip_norm}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        self.seed = seed
        self.secure = secure

    def gradient(self, model: torch.nn.Module, batch: Batch, step: int) -> torch.Tensor:
        sums, loss = clipped_gradient_sum(model, self.loss_fn, batch, self.clip_norm)
        std = self.noise_multiplier * self.clip_norm
        if self.secure:
            add_noise_(sums, std, secure=True)
        else:
            add_noise_(sums, std, seed=self.seed, offset=step)
        for p, total in zip(trainable_parameters(model), sums, strict=True):
            p.grad = total.div_(self.expected_batch_size)
        return loss

    def privacy_event(self) -> tuple[float, float]:
        return self.noise_multiplier, self.sample_rate

    def describe(self) -> dict:
        return {
            "variant": self.name,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
        }
