"""Lipschitz layers, losses, backpropagation for bounds, and the clipless variant's privacy-relevant numbers."""

import math

import pytest
import torch
from torch import nn

from fastdp.algorithms import Batch, Clipless
from fastdp.nn.lipschitz import (
    AddBias,
    BoundedInput,
    ClipGradient,
    GroupSort2,
    L2NormPool2d,
    LayerCentering,
    LipschitzConv2d,
    LipschitzLinear,
    LipschitzLoss,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    Residual,
    TauCrossEntropy,
    Transpose,
    lipschitz_bounds,
    project_,
)
from fastdp.train.trainer import TrainConfig, train
from tests.variants import per_example_grad_norms, steps_without_host_reads

SIGMAS = 5.0


def mlp(d=12, hidden=16, classes=4, bound=3.0, bias=True, residual=True, clip=None) -> nn.Module:
    layers = [BoundedInput(bound), LipschitzLinear(d, hidden), GroupSort2()]
    if bias:
        layers += [AddBias(hidden, 0.5)]
    if residual:
        layers += [Residual(LipschitzLinear(hidden, hidden), GroupSort2(), LayerCentering())]
    layers += [LipschitzLinear(hidden, classes)]
    if clip is not None:
        layers += [ClipGradient(clip)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    "loss",
    [TauCrossEntropy(0.01), TauCrossEntropy(1.0), TauCrossEntropy(50.0), MulticlassKR(), MulticlassHinge(1.0),
     MulticlassHKR(5.0)],
)  # fmt: skip
def test_loss_lipschitz_constants_hold_at_extreme_logits(loss):
    torch.manual_seed(0)
    for scale in (1e-3, 1.0, 1e3):
        logits = (scale * torch.randn(200, 5)).requires_grad_()
        y = torch.randint(0, 5, (200,))
        (g,) = torch.autograd.grad(loss(logits, y).sum(), logits)
        assert g.norm(dim=1).max() <= loss.lipschitz * (1 + 1e-6)


def test_parameter_free_layers():
    x = torch.randn(10, 8)
    torch.testing.assert_close(GroupSort2()(x).norm(dim=1), x.norm(dim=1))
    assert (LayerCentering()(x).norm(dim=1) <= x.norm(dim=1) + 1e-6).all()
    clipped = BoundedInput(1.5)(x * 10)
    assert (clipped.norm(dim=1) <= 1.5 + 1e-5).all()
    small = 0.01 * x
    torch.testing.assert_close(BoundedInput(1.5)(small), small)


@pytest.mark.parametrize("kind", ["chain", "bias+residual", "clip-gradient"])
def test_per_example_gradients_never_exceed_the_bounds(kind):
    """The privacy guarantee: per-example gradient norms <= Delta_l, for inputs on the X_0 sphere, huge inputs,
    random and extreme logits, and after projected training steps."""
    torch.manual_seed(1)
    loss = TauCrossEntropy(5.0)
    model = {
        "chain": lambda: mlp(bias=False, residual=False),
        "bias+residual": lambda: mlp(),
        "clip-gradient": lambda: mlp(clip=0.3),
    }[kind]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for round_ in range(4):
        x = torch.randn(64, 12)
        x = torch.cat([3.0 * x[:32] / x[:32].norm(dim=1, keepdim=True), 1e3 * x[32:]])  # sphere and far outside
        y = torch.randint(0, 4, (64,))
        bounds = lipschitz_bounds(model, loss)
        norms = per_example_grad_norms(model, loss, x, y)
        for p, n in norms.items():
            assert n.max() <= bounds[p] * (1 + 1e-5), f"{kind}, round {round_}: {n.max()} > {bounds[p]}"
        optimizer.zero_grad()
        (loss(model(x), y).sum() * 10).backward()
        optimizer.step()
        project_(model)


def test_gnp_chain_has_equal_bounds():
    """Bias-free chain of orthogonal square layers + GroupSort2 after BoundedInput: every Delta_d = L X_0."""
    torch.manual_seed(0)
    model = nn.Sequential(BoundedInput(2.0), *[m for _ in range(3) for m in (LipschitzLinear(8, 8), GroupSort2())],
                          LipschitzLinear(8, 8))  # fmt: skip
    project_(model)
    bounds = list(lipschitz_bounds(model, TauCrossEntropy()).values())
    for b in bounds:
        assert b == pytest.approx(math.sqrt(2) * 2.0, rel=5e-3)  # certified norms: within 0.1% of 1 each


def test_projection_keeps_weights_orthonormal_and_bias_in_its_ball():
    torch.manual_seed(0)
    model = mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    project_(model)
    for m in model.modules():
        if isinstance(m, LipschitzLinear):
            s = torch.linalg.svdvals(m.weight)
            assert (s - 1).abs().max() < 1e-3
        if isinstance(m, AddBias):
            assert m.bias.norm() <= 0.5 + 1e-6


def test_layers_without_rules_are_refused():
    model = nn.Sequential(BoundedInput(1.0), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"have no Lipschitz bound rule.*: 1 \(Linear\)"):
        lipschitz_bounds(model, TauCrossEntropy())
    with pytest.raises(ValueError, match="unbounded"):
        lipschitz_bounds(nn.Sequential(LipschitzLinear(4, 4)), TauCrossEntropy())


class ZeroLoss(LipschitzLoss):
    lipschitz = math.sqrt(2.0)

    def forward(self, logits, y):
        return 0.0 * logits.sum(1)


@pytest.mark.parametrize("strategy", ["per-layer", "global"])
def test_clipless_adds_exactly_the_claimed_noise(strategy):
    """Zero loss: each tensor's update is N(0, s_l^2) / (q N) with s_l = sigma sqrt(D) Delta_l (per-layer) or
    sigma sqrt(sum Delta^2) (global); the accountant records sigma."""
    torch.manual_seed(0)
    model = nn.Sequential(BoundedInput(2.0), LipschitzLinear(300, 200), GroupSort2(), LipschitzLinear(200, 300))
    sigma, q, n = 1.5, 0.1, 200
    variant = Clipless(sigma, q, n, loss=ZeroLoss(), strategy=strategy, reproducible_seed=4)
    variant.gradient(model, Batch(torch.randn(8, 300), torch.zeros(8, dtype=torch.int64),
                                  torch.ones(8, dtype=torch.bool)), step=0)  # fmt: skip
    bounds = variant.last_bounds
    for p, delta in zip(model.parameters(), bounds, strict=True):
        if strategy == "per-layer":
            expected = sigma * math.sqrt(2) * delta / (q * n)
        else:
            expected = sigma * math.sqrt(sum(b * b for b in bounds)) / (q * n)
        noise = p.grad.reshape(-1).double()
        assert abs(noise.std().item() - expected) < SIGMAS * expected / math.sqrt(2 * noise.numel())
    assert variant.privacy_event() == (sigma, q)


def test_clipless_trains_on_breast_cancer():
    """Settings from a small sweep (AUROC 0.92 at epsilon 1, 2 seeds): expected batch 256, lr 0.1, tau 1."""
    result = train(TrainConfig(variant="clipless", model="lipschitz_mlp", dataset="breast_cancer", epsilon=1.0,
                               epochs=20, batch_size=256, lr=0.1, tau=1.0, hidden=32, quiet=True,
                               progress=False, reproducible_privacy_seed=0))  # fmt: skip
    assert result["epsilon"] <= 1.0
    assert result["test_auroc"] > 0.85
    assert all(b > 0 for b in result["variant_config"]["gradient_bounds"])


def test_clipless_needs_a_lipschitz_model():
    with pytest.raises(ValueError, match="lipschitz_mlp"):
        train(TrainConfig(variant="clipless", model="mlp", epsilon=1.0, quiet=True, progress=False))


# ---------------------------------------------------------------------------------------------- weight clipping


def test_clip_projection_rescales_only_above_c_and_fixed_always():
    torch.manual_seed(0)
    small = LipschitzLinear(6, 5, projection="clip", max_norm=2.0)
    with torch.no_grad():
        small.weight.mul_(0.5)  # ||W|| = 0.5 < C
    before = small.weight.detach().clone()
    project_(small)
    assert torch.equal(small.weight, before), "weights below C must be unchanged"
    big = LipschitzLinear(6, 5, projection="clip", max_norm=2.0)
    with torch.no_grad():
        big.weight.copy_(7.0 * torch.randn(5, 6))  # distinct singular values: the singular vectors are unique
    u_before = torch.linalg.svd(big.weight.detach())[0]
    project_(big)
    s = torch.linalg.svdvals(big.weight.detach())
    assert s.max() <= 2.0 and s.max() > 2.0 * (1 - 1e-3)
    torch.testing.assert_close(torch.linalg.svd(big.weight.detach())[0].abs(), u_before.abs(), atol=1e-4, rtol=0)
    fixed = LipschitzLinear(6, 5, projection="fixed", max_norm=2.0)
    with torch.no_grad():
        fixed.weight.mul_(0.1)
    project_(fixed)
    assert torch.linalg.svdvals(fixed.weight.detach()).max() == pytest.approx(2.0, rel=1e-3)


def test_weightclip_network_bounds_hold():
    """Biased layers, ReLU, C > 1 (bounds grow with depth): per-example gradients stay within Delta_l."""
    from fastdp.train.models import build_model

    torch.manual_seed(2)
    model = build_model("weightclip_mlp", (12,), 3, hidden=16, input_bound=2.0, max_weight_norm=1.7)
    loss = TauCrossEntropy(2.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(4):
        x = torch.cat([2.0 * torch.nn.functional.normalize(torch.randn(32, 12), dim=1), 50 * torch.randn(32, 12)])
        y = torch.randint(0, 3, (64,))
        bounds = lipschitz_bounds(model, loss)
        for p, n in per_example_grad_norms(model, loss, x, y).items():
            assert n.max() <= bounds[p] * (1 + 1e-5)
        optimizer.zero_grad()
        (loss(model(x), y).sum() * 10).backward()
        optimizer.step()
        project_(model)
        for m in model.modules():
            if isinstance(m, LipschitzLinear):
                assert torch.linalg.svdvals(m.weight.detach()).max() <= 1.7 * (1 + 1e-6)


def test_weightclip_trains_on_breast_cancer():
    """papers/01 Table 1 setting (epsilon 1.672, delta 1/n, which needs allow_large_delta); settings from a small
    sweep (2 seeds: accuracy 0.89, the paper reports 0.798): Adam lr 0.01, C = 3, expected batch 64."""
    result = train(TrainConfig(variant="weightclip", model="weightclip_mlp", dataset="breast_cancer", epsilon=1.672,
                               delta=1 / 455, epochs=20, batch_size=64, optimizer="adam", lr=0.01, max_weight_norm=3.0,
                               hidden=32, quiet=True, progress=False, allow_large_delta=True,
                               reproducible_privacy_seed=0))  # fmt: skip
    assert result["epsilon"] <= 1.672 and result["variant"] == "weightclip"
    assert result["test_accuracy"] > 0.8


# ------------------------------------------------------------------------------------------------ convolutions


def test_conv_factor_covers_the_exact_operator_norm():
    """papers/00 P3: the constant 3x3 kernel after RKO has operator norm > 1 on 32x32; the certified factor used
    in the bounds is >= the exact norm."""
    from fastdp.ops import conv_operator_norm

    layer = LipschitzConv2d(1, 1, 3, input_hw=(32, 32), padding=1)
    with torch.no_grad():
        layer.weight.fill_(1.0 / 3.0)
        layer.project_()
    exact, _ = conv_operator_norm(layer.weight.detach().double(), (1, 32, 32), padding=(1, 1), iters=300)
    assert exact > 1.0
    assert layer._factor() >= float(exact)


def test_cnn_bounds_hold():
    torch.manual_seed(3)
    model = nn.Sequential(
        BoundedInput(4.0), LipschitzConv2d(1, 4, 3, input_hw=(8, 8), padding=1), GroupSort2(), L2NormPool2d(2),
        LipschitzConv2d(4, 8, 3, input_hw=(4, 4), stride=2, padding=1), GroupSort2(), nn.Flatten(),
        LipschitzLinear(32, 5),
    )  # fmt: skip
    loss = TauCrossEntropy(3.0)
    x = torch.cat([4.0 * torch.nn.functional.normalize(torch.randn(16, 64), dim=1), 30 * torch.randn(16, 64)])
    x = x.reshape(32, 1, 8, 8)
    y = torch.randint(0, 5, (32,))
    bounds = lipschitz_bounds(model, loss)
    for p, n in per_example_grad_norms(model, loss, x, y).items():
        assert n.max() <= bounds[p] * (1 + 1e-5)


def test_l2_norm_pooling_preserves_norm():
    x = torch.randn(3, 2, 6, 6)
    torch.testing.assert_close(L2NormPool2d(2)(x).flatten(1).norm(dim=1), x.flatten(1).norm(dim=1))


def test_mlp_mixer_bounds_hold():
    """Token mixing and channel mixing with token-wise LipschitzLinear layers on [B, T, C]."""
    torch.manual_seed(4)
    tokens, channels = 6, 8
    model = nn.Sequential(
        BoundedInput(3.0),
        Transpose(1, 2), LipschitzLinear(tokens, tokens), GroupSort2(), Transpose(1, 2),
        Residual(LipschitzLinear(channels, channels), GroupSort2(), LayerCentering()),
        nn.Flatten(), LipschitzLinear(tokens * channels, 4),
    )  # fmt: skip
    loss = MulticlassHKR(3.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(3):
        x = torch.cat([3.0 * torch.nn.functional.normalize(torch.randn(16, 48), dim=1), 20 * torch.randn(16, 48)])
        x = x.reshape(32, tokens, channels)
        y = torch.randint(0, 4, (32,))
        bounds = lipschitz_bounds(model, loss)
        for p, n in per_example_grad_norms(model, loss, x, y).items():
            assert n.max() <= bounds[p] * (1 + 1e-5)
        optimizer.zero_grad()
        loss(model(x), y).sum().backward()
        optimizer.step()
        project_(model)


def test_residual_with_clip_gradient_inside_is_bounded():
    """ClipGradient's rule is not linear: the residual must apply the block's rules to g / 2 itself."""
    torch.manual_seed(0)
    inner = LipschitzLinear(8, 8)
    with torch.no_grad():
        inner.weight.copy_(torch.eye(8))
    model = nn.Sequential(BoundedInput(1.0), LipschitzLinear(8, 8), Residual(inner, ClipGradient(0.1)),
                          ClipGradient(0.05))  # fmt: skip
    loss = TauCrossEntropy()
    x, y = 10 * torch.randn(256, 8), torch.randint(0, 8, (256,))
    bounds = lipschitz_bounds(model, loss)
    for p, n in per_example_grad_norms(model, loss, x, y).items():
        assert n.max() <= bounds[p] * (1 + 1e-5)


def test_a_parameter_used_twice_gets_the_sum_of_its_bounds():
    torch.manual_seed(0)
    shared = LipschitzLinear(6, 6)
    model = nn.Sequential(BoundedInput(2.0), shared, GroupSort2(), shared, LipschitzLinear(6, 3))
    loss = TauCrossEntropy()
    x, y = 5 * torch.randn(128, 6), torch.randint(0, 3, (128,))
    bounds = lipschitz_bounds(model, loss)
    for p, n in per_example_grad_norms(model, loss, x, y).items():
        assert n.max() <= bounds[p] * (1 + 1e-5)


def test_clipless_input_bound_is_enforced_without_bounded_input():
    """Clipless(input_bound=X_0) on a model without BoundedInput projects the inputs itself: the sum of the
    per-example gradients of huge inputs stays within the batch size times the bound."""
    torch.manual_seed(0)
    model = nn.Sequential(LipschitzLinear(5, 6), GroupSort2(), LipschitzLinear(6, 3))
    variant = Clipless(0.0, 0.5, 8, input_bound=1.0, reproducible_seed=0)
    x, y = 1e4 * torch.randn(4, 5), torch.randint(0, 3, (4,))
    variant.gradient(model, Batch(x, y, torch.ones(4, dtype=torch.bool)), step=0)
    for p, bound in zip(model.parameters(), variant.last_bounds, strict=True):
        assert p.grad.norm() * variant.expected_batch_size <= 4 * bound * (1 + 1e-5)


def _cnn() -> nn.Module:
    return nn.Sequential(BoundedInput(5.0), LipschitzConv2d(1, 4, 3, (8, 8), padding=1), GroupSort2(), L2NormPool2d(2),
                         nn.Flatten(), LipschitzLinear(4 * 4 * 4, 3, bias=True))  # fmt: skip


@pytest.mark.parametrize("kind", ["mlp", "mlp-clip", "cnn", "weightclip", "global"])
def test_clipless_step_reads_no_device_value_on_the_host(kind, monkeypatch):
    """Zero host synchronisations: the step's bounds, noise and projection never turn a tensor into a Python
    value (on CPU, where nothing synchronises, every such read is made to fail; on CUDA see the sync-debug test)."""
    torch.manual_seed(0)
    if kind == "cnn":
        model, x = _cnn(), torch.randn(6, 1, 8, 8)
    elif kind == "weightclip":
        model = nn.Sequential(BoundedInput(3.0), LipschitzLinear(12, 16, bias=True, projection="clip", max_norm=0.5),
                              nn.ReLU(), LipschitzLinear(16, 3, projection="fixed", max_norm=2.0))  # fmt: skip
        x = torch.randn(6, 12)
    else:
        model, x = mlp(classes=3, clip=0.5 if kind == "mlp-clip" else None), torch.randn(6, 12)
    variant = Clipless(1.0, 0.1, 60, strategy="global" if kind == "global" else "per-layer")
    batch = Batch(x, torch.randint(0, 3, (6,)), torch.ones(6, dtype=torch.bool))
    steps_without_host_reads(monkeypatch, variant, model, batch)


@pytest.mark.cuda
def test_clipless_step_has_no_cuda_sync():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    model = _cnn().cuda()
    variant = Clipless(1.0, 0.1, 60)
    batch = Batch(torch.randn(6, 1, 8, 8, device="cuda"), torch.randint(0, 3, (6,), device="cuda"),
                  torch.ones(6, dtype=torch.bool, device="cuda"))  # fmt: skip
    variant.gradient(model, batch, 0)  # warm-up (lazy initialisation may synchronise)
    variant.after_step(model)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        variant.gradient(model, batch, 1)
        variant.after_step(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_tensor_stds_release_the_same_gaussian_as_float_stds():
    from fastdp.algorithms.base import release_noisy_mean
    from fastdp.privacy.rng import PrivacyKeys

    shapes = [(30, 20), (20,), (5, 20)]
    stds = [0.3, 1.7, 0.0]
    out = []
    for as_tensor in (False, True):
        params = [nn.Parameter(torch.zeros(s)) for s in shapes]
        sums = [torch.full(s, 0.25) for s in shapes]
        release_noisy_mean(params, sums, torch.tensor(stds) if as_tensor else stds, 8.0, PrivacyKeys(5), step=3)
        out.append([p.grad for p in params])
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert torch.equal(out[1][2], torch.full((5, 20), 0.25 / 8.0))  # std 0: the sum alone
