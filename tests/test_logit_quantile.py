"""Logit-gradient clipping at a private quantile (clipless/weightclip, papers/00 section 3.1 with Andrew et al. 2021):
each example's bound, the count's noise, and the epsilon of the joint release against dp-accounting."""

import math

import pytest
import torch
from torch import nn

from fastdp.algorithms import Batch, Clipless, WeightClip
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear, lipschitz_bounds
from fastdp.privacy.accounting import PrivacyAccountant


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(BoundedInput(3.0), LipschitzLinear(10, 16), GroupSort2(), LipschitzLinear(16, 3))


def batch(rows: int, scale: float = 3.0, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(rows, 10, generator=gen)
    return Batch(x, torch.randint(0, 3, (rows,), generator=gen), torch.ones(rows, dtype=torch.bool))


def test_each_example_gradient_stays_within_the_bound_from_the_clip_value():
    """With C_t below the loss's constant L, each example's per-tensor gradient (one example per batch) is within the
    bound the noise is calibrated to, which starts from min(L, C_t); the inputs include examples at the bound."""
    model = mlp()
    variant = Clipless(1.0, 0.5, 64, logit_clip_quantile=0.5, reproducible_seed=0)
    variant.logit_clip = torch.tensor(0.05, dtype=torch.float64)  # far below L = sqrt(2): clipping is active
    bounds = lipschitz_bounds(model, variant.loss_fn, math.inf, variant.logit_clip)
    params = [p for p in model.parameters() if p.requires_grad]
    loose = lipschitz_bounds(model, variant.loss_fn)
    for i in range(12):
        one = batch(1, scale=1e4 if i % 3 == 0 else 3.0, seed=i)
        sums, _ = variant.clipped_sum(model, one, i)
        for p, s in zip(params, sums, strict=True):
            assert float(s.norm()) <= float(bounds[p]) * (1 + 1e-6)
            assert float(bounds[p]) < 0.05 * float(loose[p])  # the clip value, not L, drives the bound
        assert variant._count is not None and float(variant._count) in (0.0, 1.0)


def test_noise_stds_use_the_sums_multiplier_and_the_count_its_own():
    model = mlp()
    variant = Clipless(2.0, 0.25, 1024, logit_clip_quantile=0.9, count_noise_multiplier=10.0)
    sigma_g = variant.gradient_noise_multiplier
    assert sigma_g > 2.0
    assert (sigma_g**-2 + 10.0**-2) ** -0.5 >= 2.0  # the joint multiplier is never below the accounted one
    assert variant.privacy_event() == (2.0, 0.25)
    stds = variant.noise_stds(model)
    d = len(stds)
    for std, bound in zip(stds.tolist(), variant.last_bounds.tolist(), strict=True):
        assert std >= sigma_g * math.sqrt(d) * bound * (1 - 1e-6)  # (the bounds shown are rounded up to float32)


def test_the_count_gets_noise_of_its_std():
    """The released fraction minus the true fraction, over many steps, has the std sigma_c / (q N)."""
    model = mlp()
    variant = Clipless(1.0, 0.25, 256, logit_clip_quantile=0.5, count_noise_multiplier=8.0, reproducible_seed=3)
    released, true = [], []
    for step in range(400):
        b = batch(64, seed=step)
        sums, _ = variant.clipped_sum(model, b, step)
        true.append(float(variant._count))
        count = variant._count
        variant.release(model, sums, step)
        released.append(float(count[0]) * variant.expected_batch_size)  # the noisy count, divided back
    errors = torch.tensor(released) - torch.tensor(true)
    assert abs(float(errors.mean())) < 4 * 8.0 / 20  # mean 0 (4 standard errors)
    assert 0.85 < float(errors.std()) / 8.0 < 1.15  # 400 draws: the std within 15 %


def test_the_clip_value_tracks_the_quantile_and_stays_in_range():
    model = mlp()
    variant = Clipless(1.0, 0.25, 1024, logit_clip_quantile=0.5, reproducible_seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(80):
        variant.gradient(model, batch(256, seed=step), step)
        optimizer.step()
        variant.after_step(model)
    clip = float(variant.logit_clip)
    assert 1e-6 * math.sqrt(2) <= clip < math.sqrt(2)  # moved down from L, within its clamp
    # about half of a fresh batch's logit-gradient norms are under it
    logits = model(batch(512, seed=999).x)
    y = batch(512, seed=999).y
    grad = torch.softmax(logits, dim=1) - torch.nn.functional.one_hot(y, 3)
    below = float((grad.norm(dim=1) <= clip).double().mean())
    assert 0.3 < below < 0.7


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_epsilon_of_the_joint_release_matches_dp_accounting(mechanism):
    """The accountant records (sigma, q) per step; the mechanism actually run is the Poisson-sampled Gaussian with the
    joint multiplier of the sums' and the count's noise: dp-accounting's epsilon for it is within the reported one."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event, rdp

    variant = WeightClip(1.3, 0.01, 10_000, logit_clip_quantile=0.9)
    steps = 500
    accountant = PrivacyAccountant(mechanism)
    sigma, q = variant.privacy_event()
    accountant.step(sigma, q, steps)
    reported = accountant.get_epsilon(1e-5)
    joint = (variant.gradient_noise_multiplier**-2 + variant.count_noise_multiplier**-2) ** -0.5
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(joint)), steps)
    reference = rdp.RdpAccountant() if mechanism == "rdp" else dp_accounting.pld.PLDAccountant()
    reference.compose(event)
    actual = reference.get_epsilon(1e-5)
    assert actual <= reported * (1 + 1e-9)
    assert reported == pytest.approx(actual, rel=1e-3)
    # the count is not free: accounting only the sums' noise would report less than what was spent
    sums_only = rdp.RdpAccountant() if mechanism == "rdp" else dp_accounting.pld.PLDAccountant()
    sums_event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(variant.gradient_noise_multiplier))
    sums_only.compose(dp_event.SelfComposedDpEvent(sums_event, steps))
    assert sums_only.get_epsilon(1e-5) < reported


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"logit_clip_quantile": 1.0}, "logit_clip_quantile"),
    ({"logit_clip_quantile": 0.5, "count_noise_multiplier": 0.5}, "count_noise_multiplier"),
    ({"count_noise_multiplier": 5.0}, "give logit_clip_quantile"),
    ({"logit_clip_quantile": 0.5, "logit_clip_lr": 0.0}, "logit_clip_lr"),
])  # fmt: skip
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Clipless(1.0, 0.1, 100, **kwargs)


def test_trainer_runs_the_quantile_and_resumes_its_clip_value(tmp_path):
    """``fastdp train --logit-clip-quantile``: epsilon within the target with the count's noise inside it, the clip
    value reported, and carried across a checkpoint."""
    from fastdp.train.trainer import TrainConfig, Trainer, train

    def config(epochs: int, resume: bool) -> TrainConfig:
        return TrainConfig(variant="clipless", model="lipschitz_mlp", dataset="breast_cancer", epsilon=1.0,
                           epochs=epochs, batch_size=128, lr=0.03, hidden=16, quiet=True, progress=False,
                           logit_clip_quantile=0.9, reproducible_privacy_seed=0, checkpoint=str(tmp_path / "c.pt"),
                           resume=resume)  # fmt: skip

    result = train(config(2, False))
    assert result["epsilon"] <= 1.0
    described = result["variant_config"]
    assert described["logit_clip_quantile"] == 0.9 and 0 < described["logit_clip"] <= math.sqrt(2) * (1 + 1e-12)
    assert described["gradient_noise_multiplier"] > described["noise_multiplier"]
    resumed = Trainer(config(3, True))
    resumed.load_checkpoint(tmp_path / "c.pt")
    assert float(resumed.variant.logit_clip) == described["logit_clip"]
    with pytest.raises(ValueError, match="logit-clip-quantile"):
        TrainConfig(variant="dpsgd", epsilon=1.0, logit_clip_quantile=0.5).validate()


def test_a_loss_with_a_wrong_constant_cannot_break_the_bound():
    """Without the quantile too, each example's logit gradient is clipped to the loss's stated constant L, so a loss
    that understates L (or the rounding of the chain rule) cannot carry an example above the bound."""
    from fastdp.nn.lipschitz import TauCrossEntropy

    class Understated(TauCrossEntropy):
        lipschitz = 0.01  # the true constant is sqrt(2)

    model = mlp()
    variant = Clipless(1.0, 0.5, 64, loss=Understated(), reproducible_seed=0)
    bounds = lipschitz_bounds(model, variant.loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(6):
        sums, _ = variant.clipped_sum(model, batch(1, scale=1e3, seed=i), i)
        for p, s in zip(params, sums, strict=True):
            assert float(s.norm()) <= float(bounds[p]) * (1 + 1e-6)
