"""DP-SGD-JL: jvp projections, the norm estimator's law, re-weighting, tangents, noise, refusals."""

import json
import math

import pytest
import torch
from scipy import stats
from torch import nn

from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import per_example_cross_entropy as loss_fn
from fastdp.algorithms.base import trainable_parameters
from fastdp.algorithms.dpsgd import ghost_backward, per_example_gradients
from fastdp.algorithms.jl import (
    JL,
    _clipped_sum,
    draw_tangents,
    jl_projections,
    norm_estimates,
)
from fastdp.nn import convert
from fastdp.privacy.accounting import PrivacyAccountant, get_noise_multiplier
from fastdp.privacy.jl import jl_epsilon, jl_epsilon_of_runs, jl_z_floor
from fastdp.privacy.rng import PrivacyKeys, tangent_seed
from fastdp.train.trainer import TrainConfig, Trainer, train


class _Tokenwise(nn.Module):
    """A token-wise Linear on [B, T, d] (optionally LayerNorm), mean-pooled: the sequence path."""

    def __init__(self, d=5, hidden=6, norm=False):
        super().__init__()
        self.inner, self.head = nn.Linear(d, hidden), nn.Linear(hidden, 3)
        self.norm = nn.LayerNorm(hidden) if norm else nn.Tanh()

    def forward(self, x):
        return self.head(self.norm(self.inner(x)).mean(1))


def _model(kind="mlp"):
    torch.manual_seed(0)
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                             nn.Linear(4 * 4 * 4, 3))  # fmt: skip
    if kind == "tokens":
        return nn.Sequential(nn.Embedding(11, 4, padding_idx=0), nn.LayerNorm(4), nn.Flatten(), nn.Linear(4 * 5, 3))
    if kind == "sequence":
        return _Tokenwise()
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(kind="mlp", b=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        x = torch.randn(b, 2, 6, 6, generator=gen)
    elif kind == "tokens":
        x = torch.randint(0, 11, (b, 5), generator=gen)
    elif kind == "sequence":
        x = torch.randn(b, 4, 5, generator=gen)
    else:
        x = torch.randn(b, 6, generator=gen)
    return x, torch.randint(0, 3, (b,), generator=gen)


def _batch(x, y, mask=None):
    return Batch(x, y, torch.ones(x.shape[0], dtype=torch.bool) if mask is None else mask)


def _run(model, x, y):
    convert(model)
    return ghost_backward(model, loss_fn, _batch(x, y))


def _flat_per_example(model, x, y):
    return torch.cat([g.reshape(g.shape[0], -1) for g in per_example_gradients(model, loss_fn, x, y)], dim=1)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "tokens", "sequence"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_projections_equal_per_example_gradient_dot_tangent(kind, chunk):
    """P_ij from the layers' A and G (one backward) is <g_i, v_j> of torch.func's per-example gradient; the rounding
    bounds are small for ordinary examples."""
    model = _model(kind)
    x, y = _data(kind)
    r, seed, step = 5, 123, 4
    p, err, allowance = jl_projections(_run(model, x, y), PrivacyKeys(seed), step, r, chunk=chunk)
    params = [q for q in model.parameters() if q.requires_grad]
    tangents = draw_tangents(params, PrivacyKeys(seed), step, r, 0, r)
    v = torch.cat([t.reshape(r, -1) for t in tangents], dim=1)  # [r, d]
    expected = _flat_per_example(model, x, y).double() @ v.double().t()
    torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)
    m = norm_estimates(p)
    # allowance: mass / MASS_RATIO, which binds the weight only where it exceeds M (positions cancelling)
    assert torch.all(err < 1e-9 * (1 + m)) and torch.all(allowance > 0) and torch.all(allowance < 1e-2 * (1 + m))


def test_tangents_are_fresh_per_step_shared_by_chunks_and_independent_of_the_noise_key():
    params = [torch.zeros(4, 5), torch.zeros(3)]
    keys = PrivacyKeys(9)
    a = draw_tangents(params, keys, step=2, projections=4, first=0, count=4)
    b = draw_tangents(params, keys, step=2, projections=4, first=2, count=2)
    torch.testing.assert_close(a[0][2:], b[0], rtol=0, atol=0)  # tangent j does not depend on the chunking
    c = draw_tangents(params, keys, step=3, projections=4, first=0, count=4)
    assert not torch.equal(a[0], c[0])  # fresh every step
    assert tangent_seed(9) != 9 and 0 <= tangent_seed(2**63 - 1) < 2**63
    s1 = draw_tangents(params, PrivacyKeys(), 0, 1, 0, 1)
    s2 = draw_tangents(params, PrivacyKeys(), 0, 1, 0, 1)
    assert not torch.equal(s1[0], s2[0])  # OS entropy (the default)


def test_norm_estimate_is_unbiased_and_follows_the_chi_law():
    """E[M^2] = ||g||^2 and M / ||g|| ~ sqrt(chi2_r / r) (papers/03 Prop 2.1), over fresh tangents per step."""
    model = _model()
    x, y = _data(b=4)
    true = _flat_per_example(model, x, y).norm(dim=1).double()
    r, steps = 3, 250
    run = _run(model, x, y)
    ratios = torch.stack([norm_estimates(jl_projections(run, PrivacyKeys(5), s, r)[0]) / true for s in range(steps)])
    mean_sq = ratios.pow(2).mean().item()
    assert abs(mean_sq - 1) < 4 * math.sqrt(2 / r / ratios.numel()), mean_sq  # std of chi2_r / r is sqrt(2 / r)
    law = stats.chi(r, scale=1 / math.sqrt(r))
    assert stats.kstest(ratios.flatten().numpy(), law.cdf).pvalue > 1e-3


@pytest.mark.parametrize("kind", ["cnn", "tokens", "sequence"])
def test_reweighted_sum_equals_weighted_sum_of_per_example_gradients(kind):
    model = _model(kind)
    x, y = _data(kind)
    w = torch.rand(x.shape[0], dtype=torch.float64)
    run = _run(model, x, y)
    caches = [{} for _ in run.layers]
    jl_projections(run, PrivacyKeys(1), 0, 2, caches=caches)
    sums = _clipped_sum(run, w, caches)
    per = per_example_gradients(model, loss_fn, x, y)
    for s, g in zip(sums, per, strict=True):
        assert s.dtype == torch.float64
        torch.testing.assert_close(s, torch.einsum("b,b...->...", w, g.double()), rtol=1e-5, atol=1e-6)


def test_with_exact_norms_the_update_is_dpsgds():
    """Replacing the factors by DP-SGD's (exact norms) gives DP-SGD's update, with the same noise seed."""
    model = _model()
    x, y = _data(b=9)
    batch = _batch(x, y)
    clip = 0.05
    jl = JL(clip, 0.7, sample_rate=0.1, num_examples=90, projections=4, reproducible_seed=11)
    exact = _flat_per_example(model, x, y).norm(dim=1)
    jl.clip_weights = lambda *_: (clip / (exact + 1e-6)).clamp(max=1.0)
    jl.gradient(model, batch, step=3)
    ours = [p.grad.clone() for p in model.parameters()]
    DPSGD(clip, 0.7, sample_rate=0.1, num_examples=90, reproducible_seed=11, mode="reference").gradient(
        model, batch, step=3
    )
    for a, p in zip(ours, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def test_noise_std_on_the_mean_is_sigma_c_over_expected_batch():
    model = nn.Sequential(nn.Linear(200, 100))
    x, y = _data(b=3)
    x = torch.randn(3, 200)
    batch = Batch(x, y, torch.zeros(3, dtype=torch.bool))  # all padding: the released gradient is pure noise
    sigma, clip, q, n = 1.3, 0.4, 0.05, 200
    JL(clip, sigma, q, n, projections=2, reproducible_seed=3).gradient(model, batch, step=0)
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected = sigma * clip / (q * n)
    assert abs(noise.std().item() / expected - 1) < 0.03
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(noise.numel())


def test_clip_weights_bound_the_estimated_norm_and_zero_padding():
    model = _model()
    x, y = _data(b=6)
    x = 100 * x
    mask = torch.tensor([True, True, False, True, True, False])
    jl = JL(0.1, 1.0, 0.1, 60, projections=3, reproducible_seed=0)
    run = _run(model, x, y)
    w = jl.clip_weights(run, mask, 0, [{} for _ in run.layers])
    m = norm_estimates(jl_projections(run, PrivacyKeys(0), 0, 3)[0])
    assert torch.all(w[~mask] == 0)
    assert torch.all(w[mask] * m[mask] <= 0.1) and torch.all(w[mask] * m[mask] > 0.1 * (1 - 1e-5))
    assert torch.all(w <= 1)


def test_an_example_cancelling_at_large_magnitude_stays_within_its_accounted_bound():
    """Issue 14 (found by the fuzzer): positions s u + e and -s u, alternately, into a token-wise Linear (with or
    without LayerNorm), mean-pooled, fp32. With jvp estimates and a separate re-weighted backward (two roundings) the
    contribution left the chi-square law: this check measured 1.079 on 6fdb990. Now ||change|| <= C max(Z(change),
    z_floor): the JL estimate of the change itself is <= C, or the change is below C z_floor."""
    d, clip, r = 6, 1.0, 4
    signs = torch.tensor([(-1.0) ** t for t in range(4)])[:, None]
    worst = 0.0
    for scale in (3e5, 1e7):
        for norm in (False, True):
            for seed in range(12):
                torch.manual_seed(seed)
                model = _Tokenwise(d, 8, norm)
                gen = torch.Generator().manual_seed(seed)
                x, y = torch.randn(6, 4, d, generator=gen), torch.randint(0, 3, (6,), generator=gen)
                u = torch.randn(d, generator=gen, dtype=torch.float64).float()
                x[0] = scale * signs * u + (signs > 0) * x[0]
                jl = JL(clip, 0.0, 0.5, 12, projections=r, reproducible_seed=seed)
                full, less = (jl.clipped_sum(model, b, 0)[0] for b in (_batch(x, y), _batch(x[1:], y[1:])))
                change = torch.cat([(a - c).double().flatten() for a, c in zip(full, less, strict=True)])
                tangents = draw_tangents(trainable_parameters(model), jl.keys, 0, r, 0, r)
                v = torch.cat([t.double().reshape(r, -1) for t in tangents], dim=1)
                estimate = (v @ change).pow(2).mean().sqrt().item()
                worst = max(worst, min(estimate / clip, change.norm().item() / (clip * jl.z_floor)))
    assert worst <= 1 + 1e-5, worst


@pytest.mark.parametrize("r", [1, 4, 10, 30])
@pytest.mark.parametrize("sigma", [0.02, 1.0, 4.0])
def test_the_z_floor_is_the_smallest_sensitivity_the_accountant_credits(r, sigma):
    """DP-SGD-JL absorbs its rounding into C max(Z, z_floor): sound only if every bin is credited with >= z_floor."""
    from fastdp.privacy.jl import _sensitivity_bins

    z, weights, _ = _sensitivity_bins(sigma, float(r), 200)
    floor = jl_z_floor(r, sigma)
    assert len(z) == 0 or z.min() >= floor
    assert 0 < floor <= 1 and jl_z_floor(math.inf, sigma) == 1.0


def test_refusals():
    with pytest.raises(ValueError, match="projections r must be an integer >= 1"):
        JL(1.0, 1.0, 0.1, 10, projections=0)
    with pytest.raises(ValueError, match="projections r must be an integer >= 1"):
        JL(1.0, 1.0, 0.1, 10, projections=2.5)
    with pytest.raises(ValueError, match="clip norm"):
        JL(0.0, 1.0, 0.1, 10)
    x, y = _data(b=4)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="BatchNorm1d"):
        JL(1.0, 1.0, 0.1, 40, projections=2).gradient(model, _batch(x, y), 0)
    model.eval().requires_grad_(False)[0].requires_grad_(True)  # public statistics, frozen: allowed
    JL(1.0, 1.0, 0.1, 40, projections=2).gradient(model, _batch(x, y), 0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3))  # one forward: dropout is allowed
    JL(1.0, 1.0, 0.1, 40, projections=2).gradient(model, _batch(x, y), 0)


def test_empty_batch_releases_noise_only():
    model = _model()
    jl = JL(1.0, 1.0, 0.5, 10, projections=2)
    empty = Batch(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    loss = jl.gradient(model, empty, 0)
    assert loss.item() == 0 and all(p.grad is not None for p in model.parameters())


# ----------------------------------------------------------------------------------------------- accounting, trainer

FAST = dict(dataset="breast_cancer", epochs=3, batch_size=64, lr=0.5, momentum=0.9, quiet=True, progress=False)


def test_accountant_records_jl_steps_with_their_own_privacy_curve():
    acc = PrivacyAccountant("pld")
    acc.step(1.0, 0.05, 40, projections=10)
    acc.step(1.0, 0.05, 10)
    assert acc.history == [(1.0, 0.05, 40, 10.0), (1.0, 0.05, 10)]
    eps = acc.get_epsilon(1e-5)
    assert eps == pytest.approx(jl_epsilon_of_runs([(1.0, 0.05, 10, 40), (1.0, 0.05, math.inf, 10)], 1e-5))
    gaussian = PrivacyAccountant("pld")
    gaussian.step(1.0, 0.05, 50)
    assert eps > gaussian.get_epsilon(1e-5)  # estimated norms cost privacy
    restored = PrivacyAccountant("pld")
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.history == acc.history and restored.get_epsilon(1e-5) == eps
    with pytest.raises(ValueError, match="RDP cannot account DP-SGD-JL"):
        PrivacyAccountant("rdp").step(1.0, 0.05, 1, projections=10)
    with pytest.raises(ValueError, match="DP-SGD-JL run in an 'rdp' accountant"):
        PrivacyAccountant("rdp").load_state_dict({**acc.state_dict(), "mechanism": "rdp"})
    with pytest.raises(ValueError, match="RDP cannot account DP-SGD-JL"):
        get_noise_multiplier(3.0, 1e-5, 0.05, 100, accountant="rdp", projections=10)


def test_calibrated_sigma_reaches_the_target_under_the_jl_curve():
    sigma = get_noise_multiplier(3.0, 1e-5, 0.05, 100, accountant="pld", projections=10)
    exact = get_noise_multiplier(3.0, 1e-5, 0.05, 100, accountant="pld")
    assert sigma > exact
    assert 0.97 * 3.0 <= jl_epsilon(sigma, 0.05, 10, 100, 1e-5) <= 3.0


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])  # adam: DP-Adam-JL (torch's Adam, beta2 bias correction)
def test_jl_training_reaches_its_epsilon_and_learns(optimizer):
    lr = 0.5 if optimizer == "sgd" else 0.05
    result = train(TrainConfig(variant="jl", accountant="pld", epsilon=3.0, projections=10, optimizer=optimizer,
                               **{**FAST, "lr": lr}))  # fmt: skip
    assert 0.97 * 3.0 <= result["epsilon"] <= 3.0
    assert result["variant_config"]["projections"] == 10
    assert result["test_accuracy"] > 0.8


def test_jl_training_refuses_rdp_and_bad_projections():
    with pytest.raises(ValueError, match="needs --accountant pld"):
        Trainer(TrainConfig(variant="jl", epsilon=3.0, **FAST))
    with pytest.raises(ValueError, match="projections"):
        Trainer(TrainConfig(variant="jl", accountant="pld", epsilon=3.0, projections=0, **FAST))
