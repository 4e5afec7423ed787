"""DP-SGD reference path: per-example gradients, clipping bound, noise std actually added, padding, scaling."""

import math

import pytest
import torch

from fastdp.algorithms import DPSGD, Batch, NonPrivate
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import clipped_gradient_sum, per_example_gradients

SIGMAS = 5.0


def _model(seed=0, d=6, k=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.Tanh(), torch.nn.Linear(16, k)).double()


def _batch(b=12, d=6, k=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=gen, dtype=torch.float64)
    y = torch.randint(0, k, (b,), generator=gen)
    return Batch(x, y, torch.ones(b, dtype=torch.bool))


def test_per_example_gradients_match_one_at_a_time():
    model, batch = _model(), _batch()
    per_example = per_example_gradients(model, per_example_cross_entropy, batch.x, batch.y)
    for i in range(batch.x.shape[0]):
        model.zero_grad()
        per_example_cross_entropy(model(batch.x[i : i + 1]), batch.y[i : i + 1]).sum().backward()
        for g, p in zip(per_example, model.parameters(), strict=True):
            torch.testing.assert_close(g[i], p.grad, msg=f"example {i}")


def test_clipped_sum_matches_manual_clipping():
    model, batch = _model(), _batch()
    clip = 0.05
    sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, clip)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(batch.x.shape[0]):
        model.zero_grad()
        per_example_cross_entropy(model(batch.x[i : i + 1]), batch.y[i : i + 1]).sum().backward()
        norm = math.sqrt(sum(p.grad.pow(2).sum().item() for p in model.parameters()))
        for e, p in zip(expected, model.parameters(), strict=True):
            e += p.grad * min(1.0, clip / (norm + 1e-6))
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s, e)


def test_one_huge_example_moves_the_clipped_sum_by_at_most_c():
    model, batch = _model(), _batch()
    clip = 0.5
    without, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, clip)
    outlier = Batch(
        torch.cat([batch.x, 1e6 * torch.ones(1, 6, dtype=torch.float64)]),
        torch.cat([batch.y, torch.tensor([2])]),
        torch.ones(13, dtype=torch.bool),
    )
    with_outlier, _ = clipped_gradient_sum(model, per_example_cross_entropy, outlier, clip)
    shift = math.sqrt(sum((a - b).pow(2).sum().item() for a, b in zip(with_outlier, without, strict=True)))
    assert shift <= clip * (1 + 1e-9), f"one example moved the clipped sum by {shift} > C = {clip}"
    assert shift > 0.5 * clip, "the outlier's (clipped) gradient should count"


def test_padding_rows_never_change_the_update():
    model, batch = _model(), _batch(b=7)
    padded = Batch(
        torch.cat([batch.x, 50 * torch.randn(5, 6, dtype=torch.float64)]),
        torch.cat([batch.y, torch.zeros(5, dtype=torch.int64)]),
        torch.cat([batch.mask, torch.zeros(5, dtype=torch.bool)]),
    )
    for make in (lambda: DPSGD(1.0, 1.3, 0.1, 70, reproducible_seed=4), NonPrivate):
        grads = []
        for b in (batch, padded):  # one variant object per release: a reproducible key serves a step once
            make().gradient(model, b, step=3)
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_zero_gradient_step_adds_exactly_the_claimed_noise_std():
    """Zero loss: the update is pure noise with std sigma C / (q N) per coordinate."""
    torch.manual_seed(0)
    model = torch.nn.Linear(500, 200)  # 100,200 coordinates
    sigma, clip, q, n = 1.7, 0.8, 0.05, 1000
    variant = DPSGD(clip, sigma, q, n, reproducible_seed=11, loss_fn=lambda logits, y: 0.0 * logits.sum(1))
    x, y = torch.randn(40, 500), torch.zeros(40, dtype=torch.int64)
    variant.gradient(model, Batch(x, y, torch.ones(40, dtype=torch.bool)), step=0)
    noise = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    expected = sigma * clip / (q * n)
    count = noise.numel()
    assert abs(noise.std().item() - expected) < SIGMAS * expected / math.sqrt(2 * count)
    assert abs(noise.mean().item()) < SIGMAS * expected / math.sqrt(count)


def test_empty_batch_gives_a_noise_only_update_scaled_by_the_expected_size():
    model = _model()
    variant = DPSGD(1.0, 2.0, 0.01, 1000, reproducible_seed=2)
    empty = Batch(torch.zeros(0, 6, dtype=torch.float64), torch.zeros(0, dtype=torch.int64),
                  torch.zeros(0, dtype=torch.bool))  # fmt: skip
    loss = variant.gradient(model, empty, step=0)
    assert loss.item() == 0.0
    noise = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert noise.abs().max() > 0 and torch.isfinite(noise).all()
    assert variant.privacy_event() == (2.0, 0.01)


def test_realised_batch_size_is_never_used_for_scaling():
    """sigma = 0: the gradient is exactly the clipped sum / (q N), whatever the realised size."""
    model = _model()
    for b in (3, 12):
        batch = _batch(b=b)
        variant = DPSGD(0.1, 0.0, 0.02, 500, reproducible_seed=0)
        variant.gradient(model, batch, step=0)
        sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.1)
        for p, s in zip(model.parameters(), sums, strict=True):
            torch.testing.assert_close(p.grad, s / 10.0)


def test_noise_is_keyed_by_step():
    """A reproducible key: the same seed and step give the same noise (two variant objects); one variant never
    releases a step twice (refused); another step gives other noise."""
    model = _model()
    first, variant = DPSGD(1.0, 1.0, 0.1, 100, reproducible_seed=5), DPSGD(1.0, 1.0, 0.1, 100, reproducible_seed=5)
    grads = []
    for v, step in ((first, 0), (variant, 0), (variant, 1)):
        v.gradient(model, _batch(), step=step)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    with pytest.raises(ValueError, match="refusing a release at step 0: this variant already released step 1"):
        variant.gradient(model, _batch(), step=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_norm=0.0, noise_multiplier=1.0, sample_rate=0.1, num_examples=10), "clip norm"),
        (dict(clip_norm=1.0, noise_multiplier=-1.0, sample_rate=0.1, num_examples=10), "noise multiplier"),
        (dict(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.0, num_examples=10), "sample rate"),
    ],
)
def test_dpsgd_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGD(**kwargs)


def test_per_layer_clipping_noise_and_accounting():
    """Per-layer bounds C_l: layer l gets noise std sigma sqrt(L) C_l on its sum; the step accounts as sigma."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 300))
    sigma, bounds, q, n = 1.3, [0.5, 2.0], 0.1, 100
    variant = DPSGD(bounds, sigma, q, n, reproducible_seed=3, loss_fn=lambda logits, y: 0.0 * logits.sum(1))
    x, y = torch.randn(8, 300), torch.zeros(8, dtype=torch.int64)
    variant.gradient(model, Batch(x, y, torch.ones(8, dtype=torch.bool)), step=0)
    for layer, bound in zip(model, bounds, strict=True):
        noise = torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad]).double()
        expected = sigma * math.sqrt(2) * bound / (q * n)
        assert abs(noise.std().item() - expected) < SIGMAS * expected / math.sqrt(2 * noise.numel())
    assert variant.privacy_event() == (pytest.approx(sigma), q)


def test_per_layer_clipping_bounds_each_layer():
    """One huge example moves each layer's clipped sum by at most that layer's bound."""
    model = _model()
    bounds = [0.3, 0.05]
    batch = _batch()
    outlier = Batch(torch.cat([batch.x, 1e6 * torch.ones(1, 6, dtype=torch.float64)]), torch.cat([batch.y,
                    torch.tensor([1])]), torch.ones(13, dtype=torch.bool))  # fmt: skip
    from fastdp.algorithms.dpsgd import ghost_clipped_gradient_sum
    from fastdp.nn import convert

    convert(model)
    without, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, bounds)
    with_outlier, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, outlier, bounds)
    for layer_params, bound in (((0, 1), bounds[0]), ((2, 3), bounds[1])):
        shift = math.sqrt(sum((with_outlier[i] - without[i]).pow(2).sum().item() for i in layer_params))
        assert shift <= bound * (1 + 1e-9)


def test_ghost_and_reference_modes_give_the_same_update():
    model = _model()
    for mode in ("ghost", "reference"):
        DPSGD(0.2, 1.0, 0.1, 120, reproducible_seed=9, mode=mode).gradient(model, _batch(), step=4)
        grads = [p.grad.clone() for p in model.parameters()]
        if mode == "ghost":
            ghost = grads
    for a, b in zip(ghost, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
