"""Parameters used by several DP layer calls (tied weights, a layer called more than once): each example's gradient is
the sum of the uses', normed with their cross terms (``fastdp.nn.forms``), in one backward."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import fastdp.nn.forms as forms
from fastdp.algorithms.base import Batch, per_example_cross_entropy
from fastdp.algorithms.dpsgd import (
    ghost_backward,
    ghost_clipped_gradient_sum,
    per_example_gradients,
)
from fastdp.algorithms.jl import jl_projections
from fastdp.nn import convert
from fastdp.nn.layers import DIRECT_MEMORY_BUDGET
from fastdp.privacy.rng import PrivacyKeys
from tests.variants import assert_ghost_is_reference, projection_reference


class Shared(nn.Module):
    """Every kind of sharing: an output layer tied to the token embedding (Rows with Outer), a Linear called twice
    (Outer with Outer, its bias Dense with Dense), a LayerNorm called twice, a Linear's bias tied to a LayerNorm's
    weight (Dense with Dense across layer types)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.other = nn.Linear(dim, dim)
        self.other.bias = self.norm.weight
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(idx)))
        h = self.norm(torch.tanh(self.mix(h)) + self.other(h))
        return self.head(self.norm(h)).mean(1)


def _batch(b: int = 5, t: int = 7, vocab: int = 11, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, vocab, (b, t), generator=gen), torch.randint(0, vocab, (b,), generator=gen)
    return Batch(x, y, torch.ones(b, dtype=torch.bool))


@pytest.mark.parametrize("path", ["direct", "gram"])
def test_shared_parameters_clipped_sums_equal_torch_func(path, monkeypatch):
    monkeypatch.setattr(forms, "direct_is_cheaper", lambda uses, numel: path == "direct")
    torch.manual_seed(0)
    model = Shared().double()
    batch = _batch()
    for clip in (0.05, 1e3):  # clipped, and not clipped (the sums' own rounding)
        assert_ghost_is_reference(model, batch, clip)
    assert len([p for p in model.parameters() if p.requires_grad]) == 6


def _random_forms(b: int, t: int, rows: int, dim: int, gen: torch.Generator) -> list:
    left, right = torch.randn(b, t, rows, generator=gen), torch.randn(b, t, dim, generator=gen)
    idx, g = torch.randint(0, rows, (b, t + 2), generator=gen), torch.randn(b, t + 2, dim, generator=gen)
    return [
        forms.Dense(torch.randn(b, rows, dim, generator=gen)),
        forms.Outer(left, right),
        forms.Rows(idx, g, rows),
        forms.Outer(torch.randn(b, t - 1, rows, generator=gen), torch.randn(b, t - 1, dim, generator=gen)),
    ]


def test_every_pair_of_forms_has_the_inner_product_of_its_gradients():
    gen = torch.Generator().manual_seed(1)
    b, rows, dim = 3, 5, 4
    shape = torch.Size((rows, dim))
    uses = _random_forms(b, 6, rows, dim, gen)
    dense = [forms.dense(f, shape, torch.float64) for f in uses]
    for f, df in zip(uses, dense, strict=True):
        for h, dh in zip(uses, dense, strict=True):
            value, k = forms._inner(f, h, shape)
            torch.testing.assert_close(value, (df * dh).sum((1, 2)), rtol=1e-12, atol=1e-12)
            assert k > 2
    bound, masses = forms.shared_norm_sq(uses, shape)
    exact = sum(dense).pow(2).sum((1, 2))
    assert torch.all(bound >= exact) and torch.all(bound <= exact * (1 + 1e-12))
    assert torch.all(masses >= sum(torch.linalg.vector_norm(d.reshape(b, -1), dim=1) for d in dense))
    c = torch.tensor([0.5, -2.0, 1.5], dtype=torch.float64)
    for f, d in zip(uses, dense, strict=True):
        torch.testing.assert_close(forms.clipped_sum(f, c, shape), torch.einsum("b,bij->ij", c, d))


def test_cancelling_uses_stay_within_the_clip_bound_in_float32(monkeypatch):
    """A Linear called on x and on -x + s at large magnitude: each use's gradient is ~1e4 times the sum's, which
    float32 Grams (and float32 per-example gradients) get wrong. Each example's clipped contribution, summed alone,
    stays within C on both paths, and the bound is never below the exact norm."""

    class Cancel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            big = 1e4 * x
            return self.head(self.lin(big) + self.lin(-big + x[..., :1]))

    torch.manual_seed(0)
    # formed in the hooks (Dense forms: each use's GEMV sum rounds at the uses' magnitude), or from A and G (Outer)
    for path, budget in itertools.product(("direct", "gram"), (DIRECT_MEMORY_BUDGET, None)):
        monkeypatch.setattr(forms, "direct_is_cheaper", lambda uses, numel, path=path: path == "direct")
        model = convert(Cancel())
        x, y = torch.randn(4, 6, 8), torch.randint(0, 3, (4,))

        def loss_fn(out, target):
            return per_example_cross_entropy(out.mean(1), target)

        clip = 1e-3
        for i in range(4):
            alone = torch.zeros(4, dtype=torch.bool)
            alone[i] = True
            sums, _ = ghost_clipped_gradient_sum(model, loss_fn, Batch(x, y, alone), clip, form_budget=budget)
            assert torch.sqrt(sum(s.double().pow(2).sum() for s in sums)) <= clip * (1 + 1e-6), (path, budget)
        run = ghost_backward(model, loss_fn, Batch(x, y, torch.ones(4, dtype=torch.bool)))
        uses = forms.parameter_uses(run.layers, run.saved, run.grads_out)
        row = forms.formed_norm_sq(uses, torch.float32, 1 << 30)
        if path == "gram":  # the bound covers the exact norm of the float32 A and G (float64 products are exact)
            exact = sum(sum(forms.dense(f, u.param.shape, torch.float64) for f in u.forms).reshape(4, -1).pow(2).sum(1)
                        for u in uses)  # fmt: skip
            assert torch.all(row.double() >= exact)


def test_jl_projections_of_a_tied_model_are_the_summed_gradient_dot_tangent():
    torch.manual_seed(0)
    model = convert(Shared())
    batch = _batch(b=6)
    r, seed, step = 4, 5, 1
    p, err, _ = jl_projections(ghost_backward(model, per_example_cross_entropy, batch), PrivacyKeys(seed), step, r)
    expected = projection_reference(
        model, per_example_gradients(model, per_example_cross_entropy, batch.x, batch.y), seed, step, r
    )
    torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)
    assert torch.all(err < 1e-6)


def test_per_layer_clipping_of_shared_parameters_is_refused():
    model = convert(Shared())
    layers = [m for m in model.modules() if hasattr(m, "dp_parameters") and m.dp_parameters()]
    with pytest.raises(ValueError, match="per-layer clipping needs each trainable parameter in one layer"):
        ghost_clipped_gradient_sum(model, per_example_cross_entropy, _batch(), [1.0] * len(layers))


@pytest.mark.parametrize("path", ["direct", "gram"])
def test_a_non_finite_example_of_a_shared_layer_contributes_zero_under_bf16(path, monkeypatch):
    """bf16 autocast: an example whose norm is not finite (a NaN input) is dropped per example, the shared
    parameters' forms and per-example gradients cleaned like every layer's A and G: the sums are those of the batch
    without it."""
    monkeypatch.setattr(forms, "direct_is_cheaper", lambda uses, numel: path == "direct")
    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)))
    model[2] = model[0]  # one layer called twice
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    x[2, 1] = float("nan")
    without = torch.ones(5, dtype=torch.bool)
    without[2] = False

    def forward(module, inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(inputs)

    got, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, Batch(x, y, torch.ones(5, dtype=torch.bool)),
                                        0.5, forward=forward, finite_only=True)  # fmt: skip
    clean = x.clone()
    clean[2] = 0
    expected, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, Batch(clean, y, without), 0.5,
                                             forward=forward, finite_only=True)  # fmt: skip
    for g, e in zip(got, expected, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, e)
