"""fastdp.nn.lipdp: lip-dp's losses (tau-BCE, K-cosine) and layers (max pooling, global L2-norm pooling, GroupSort(n),
channel GroupSort2, patches) against autograd and torch.func per-example gradients, adversarial inputs included; the
image models lipschitz_vgg / lipschitz_mixer; --loss; certified robust accuracy (certified examples cannot be
flipped)."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vjp, vmap

from fastdp.algorithms import Batch, Clipless
from fastdp.nn.lipdp import (
    LOSSES,
    ChannelGroupSort2,
    GlobalL2NormPool2d,
    GroupSort,
    KCosineSimilarity,
    MaxPool2d,
    TauBinaryCrossEntropy,
    ToPatches,
    certified_accuracy,
    certified_mask,
    lipschitz_constant,
    lipschitz_loss,
    loss_from_config,
)
from fastdp.nn.lipschitz import (
    BoundedInput,
    ClipGradient,
    GroupSort2,
    L2NormPool2d,
    LipschitzConv2d,
    LipschitzLinear,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    TauCrossEntropy,
    lipschitz_bounds,
    project_,
)
from fastdp.train.models import build_model
from fastdp.train.trainer import TrainConfig, train
from tests.variants import per_example_grad_norms

FP64_SLACK = 1 + 1e-12  # float64 autograd against a bound: a few roundings
FP32_SLACK = 1 + 1e-6  # float32: the tolerance every Lipschitz test uses


def _logit_grads(loss: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's gradient of its loss w.r.t. its logits (autograd on the summed loss), flattened: [B, K]."""
    logits = logits.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(logits, y).sum(), logits)
    return g.reshape(g.shape[0], -1)


def _adversarial_logits(rows: int, classes: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random logits at every scale, and the extremes: all equal (ties), zero, one huge logit, huge of one sign."""
    parts = [s * torch.randn(rows, classes, generator=gen, dtype=torch.float64) for s in (1e-30, 1e-3, 0.5, 1, 3, 1e3)]
    parts.append(torch.zeros(rows, classes, dtype=torch.float64))
    parts.append(torch.full((rows, classes), 7.0, dtype=torch.float64))
    spike = torch.zeros(rows, classes, dtype=torch.float64)
    spike[:, 0] = 1e4
    parts += [spike, -spike, 1e30 * torch.ones(rows, classes, dtype=torch.float64)]
    return torch.cat(parts).to(dtype)


# ------------------------------------------------------------------------------------------------------------ losses


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tau", [0.01, 1.0, 20.0, 300.0])
@pytest.mark.parametrize("width", [0, 1, 2])  # [B], [B, 1], [B, 2] logits
def test_tau_bce_logit_gradient_is_within_one(dtype, tau, width):
    gen = torch.Generator().manual_seed(0)
    logits = _adversarial_logits(16, max(width, 1), dtype, gen)
    logits = logits[:, 0] if width == 0 else logits
    rows = logits.shape[0]
    loss = TauBinaryCrossEntropy(tau)
    slack = FP64_SLACK if dtype == torch.float64 else FP32_SLACK
    random = torch.randint(0, 2, (rows,), generator=gen)
    for y in (torch.zeros_like(random), torch.ones_like(random), random, 2 * random - 1):
        g = _logit_grads(loss, logits, y)
        assert torch.isfinite(g).all()
        assert g.norm(dim=1).max() <= loss.lipschitz * slack, f"tau {tau}, width {width}"
    # tight: a confidently wrong example (z very negative, label 1) has gradient norm ~1
    wrong = torch.full((1,) if width == 0 else (1, max(width, 1)), -50.0 / tau, dtype=dtype)
    if width == 2:
        wrong[0, 0] = 50.0 / tau
    g = _logit_grads(loss, wrong, torch.ones(1, dtype=torch.int64))
    assert g.norm() >= 0.99
    assert loss.lipschitz == 1.0


def test_tau_bce_values_and_its_two_logit_reading():
    torch.manual_seed(1)
    z, y = 3 * torch.randn(50, dtype=torch.float64), torch.randint(0, 2, (50,))
    loss = TauBinaryCrossEntropy(4.0)
    expected = F.binary_cross_entropy_with_logits(4.0 * z, y.double(), reduction="none") / 4.0
    torch.testing.assert_close(loss(z, y), expected)
    torch.testing.assert_close(loss(z[:, None], y), expected)
    torch.testing.assert_close(loss(z, 2 * y - 1), expected, msg="-1/+1 labels read as 0/1")
    # on two logits: CE with temperature tau c, rescaled: TauCrossEntropy(tau c)(z) * c
    two = 3 * torch.randn(50, 2, dtype=torch.float64)
    from fastdp.nn.lipdp import _HALF_SQRT2

    assert 2 * Fraction(_HALF_SQRT2) ** 2 <= 1 < 2 * Fraction(_HALF_SQRT2 + 2**-24) ** 2
    assert float(torch.tensor(_HALF_SQRT2, dtype=torch.float32)) == _HALF_SQRT2
    torch.testing.assert_close(loss(two, y), TauCrossEntropy(4.0 * _HALF_SQRT2)(two, y) * _HALF_SQRT2)
    with pytest.raises(ValueError, match="one logit per example"):
        loss(torch.randn(4, 3), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="tau must be finite and > 0"):
        TauBinaryCrossEntropy(0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [0.01, 0.1, 0.7, 1.0, 3.0, 40.0])
def test_k_cosine_logit_gradient_is_within_its_bound_and_tight(dtype, k):
    gen = torch.Generator().manual_seed(2)
    logits = _adversarial_logits(16, 5, dtype, gen)
    logits = torch.cat([logits, (k * 0.999 / math.sqrt(5)) * torch.ones(1, 5, dtype=dtype),
                        (k / math.sqrt(5)) * torch.ones(1, 5, dtype=dtype)])  # fmt: skip
    y = torch.randint(0, 5, (logits.shape[0],), generator=gen)
    loss = KCosineSimilarity(k)
    exact = 1 / (Fraction(k) * max(Fraction(1), Fraction(k)))
    assert Fraction(loss.lipschitz) >= exact and loss.lipschitz == pytest.approx(float(exact), rel=1e-15)
    g = _logit_grads(loss, logits, y)
    assert torch.isfinite(g).all(), "finite at z = 0 and at 1e30"
    slack = FP64_SLACK if dtype == torch.float64 else FP32_SLACK
    norms = g.double().norm(dim=1)
    assert norms.max() <= loss.lipschitz * slack
    inside = logits.double().norm(dim=1) < 0.99 * k
    assert inside.any() and torch.allclose(norms[inside], torch.full_like(norms[inside], float(exact)), rtol=1e-5)


def test_k_cosine_is_lip_dp_formula():
    """lip-dp: -sum(l2_normalize(y, eps=K^2) * l2_normalize(z, eps=K^2)), l2_normalize(v, eps) = v / sqrt(max(||v||^2,
    eps)); lip-dp's get_L = 1 / K^2, which our bound equals for K >= 1 and beats by 1/K for K < 1."""
    torch.manual_seed(3)
    z, y = torch.randn(40, 4, dtype=torch.float64) * torch.logspace(-2, 1, 40, dtype=torch.float64)[:, None], None
    y = torch.randint(0, 4, (40,))
    for k in (0.3, 1.0, 2.5):
        onehot = F.one_hot(y, 4).double()
        ref = -((onehot / onehot.norm(dim=1, keepdim=True).clamp(min=k))
                * (z / z.norm(dim=1, keepdim=True).clamp(min=k))).sum(1)  # fmt: skip
        torch.testing.assert_close(KCosineSimilarity(k)(z, y), ref)
        lip_dp = 1 / k**2
        assert KCosineSimilarity(k).lipschitz <= lip_dp * (1 + 1e-15)
    assert KCosineSimilarity(0.1).lipschitz == pytest.approx(10.0)  # lip-dp: 100


def test_loss_registry_and_config():
    assert set(LOSSES) == {"tau-ce", "tau-bce", "kr", "hinge", "hkr", "cosine"}
    kinds = {"tau-ce": TauCrossEntropy, "tau-bce": TauBinaryCrossEntropy, "kr": MulticlassKR,
             "hinge": MulticlassHinge, "hkr": MulticlassHKR, "cosine": KCosineSimilarity}  # fmt: skip
    for name, kind in kinds.items():
        assert type(lipschitz_loss(name)) is kind
    config = SimpleNamespace(loss="hkr", tau=2.0, margin=0.5, hkr_alpha=3.0, cosine_k=0.2)
    hkr = loss_from_config(config)
    assert hkr.alpha == 3.0 and hkr.hinge.margin == 0.5
    assert loss_from_config(SimpleNamespace(loss="cosine", cosine_k=0.25)).lipschitz == 4.0
    assert loss_from_config(SimpleNamespace(tau=5.0)).tau == 5.0  # no loss field: tau-ce
    with pytest.raises(ValueError, match="unknown loss 'mse'"):
        lipschitz_loss("mse")
    with pytest.raises(ValueError, match="margin must be finite and > 0"):
        lipschitz_loss("hinge", margin=0.0)
    with pytest.raises(ValueError, match="K must be finite and > 0"):
        lipschitz_loss("cosine", cosine_k=math.inf)


# ------------------------------------------------------------------------------------------------------------ layers


def _images(gen: torch.Generator, shape=(3, 4, 6, 6), dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Adversarial [B, C, H, W] inputs: random, ties (constant images, repeated pairs), zeros, zero channels, tiny
    and huge magnitudes."""
    x = torch.randn(*shape, generator=gen, dtype=dtype)
    ties = x.clone()
    ties[:, 1] = ties[:, 0]  # channel pairs (0, 1) equal
    ties[:, shape[1] // 2] = ties[:, 0]  # channel pairs (j, j + C/2) equal
    zero_channel = x.clone()
    zero_channel[0, 2] = 0
    return {"random": x, "constant": torch.ones_like(x), "ties": ties, "zeros": torch.zeros_like(x),
            "zero-channel": zero_channel, "tiny": 1e-30 * x, "huge": 1e30 * x}  # fmt: skip


LAYERS = {
    "maxpool2": (lambda: MaxPool2d(2), False),
    "maxpool3": (lambda: MaxPool2d(3), False),
    "global-l2": (lambda: GlobalL2NormPool2d(), True),
    "groupsort2-channels": (lambda: GroupSort(2, dim=1), True),
    "groupsort4-width": (lambda: GroupSort(3, dim=-1), True),
    "groupsort-full": (lambda: GroupSort(4, dim=1), True),
    "channel-groupsort2": (lambda: ChannelGroupSort2(), True),
    "patches": (lambda: ToPatches(2), True),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_rules_hold_against_per_example_gradients(name):
    """For every adversarial input: ||f(x)|| <= ||x|| (= for the norm-preserving layers), ||f(x) - f(x')|| <=
    ||x - x'||, and each example's input gradient J^T g (torch.func vmap(vjp), one example at a time) is finite with
    norm <= ||g||: the rules propagate(X) = X, backpropagate(g) = g and no sensitivities."""
    make, preserving = LAYERS[name]
    layer = make()
    assert layer.propagate(2.5) == 2.5 and layer.backpropagate(0.75) == 0.75 and layer.sensitivities(1.0, 1.0) == {}
    gen = torch.Generator().manual_seed(4)
    for kind, x in _images(gen).items():
        scale = x.flatten(1).norm(dim=1)
        y = layer(x)
        out = y.flatten(1).norm(dim=1)
        assert (out <= scale * FP64_SLACK).all(), f"{name}, {kind}: norm grew"
        if preserving:
            torch.testing.assert_close(out, scale, rtol=1e-12, atol=0, msg=f"{name}, {kind}: not norm preserving")
        other = x + torch.randn(x.shape, generator=gen, dtype=x.dtype) * (scale.max() + 1e-300) * 1e-3
        moved = (layer(other) - y).flatten(1).norm(dim=1)
        assert (moved <= (other - x).flatten(1).norm(dim=1) * FP64_SLACK).all(), f"{name}, {kind}: not 1-Lipschitz"

        def one(xi):
            return layer(xi.unsqueeze(0)).squeeze(0)

        cot = torch.randn(y.shape, generator=gen, dtype=y.dtype)
        _, pullback = vjp(vmap(one), x)
        (gx,) = pullback(cot)
        assert torch.isfinite(gx).all(), f"{name}, {kind}: non-finite gradient"
        g_norm = gx.flatten(1).norm(dim=1)
        assert (g_norm <= cot.flatten(1).norm(dim=1) * FP64_SLACK).all(), f"{name}, {kind}: gradient grew"


def test_max_pool_ties_route_each_window_gradient_to_one_pixel():
    x = torch.ones(1, 1, 4, 5, requires_grad=True)  # 5: the last column fills no window and is dropped
    y = MaxPool2d(2)(x)
    assert y.shape == (1, 1, 2, 2)
    g = torch.randn(1, 1, 2, 2)
    (gx,) = torch.autograd.grad(y, x, g)
    assert (gx != 0).sum() == 4 and gx.norm() == pytest.approx(float(g.norm()), rel=1e-6)
    assert (gx[..., 4] == 0).all()
    with pytest.raises(ValueError, match="smaller than one 3x3 window"):
        MaxPool2d(3)(torch.randn(1, 1, 2, 5))
    with pytest.raises(ValueError, match="kernel_size must be an integer >= 1"):
        MaxPool2d(0)


def test_global_l2_pool_values_zero_gradient_and_scales():
    torch.manual_seed(5)
    x = torch.randn(3, 4, 5, 7)
    x[1, 2] = 0
    xr = x.clone().requires_grad_(True)
    y = GlobalL2NormPool2d()(xr)
    assert y.shape == (3, 4)
    torch.testing.assert_close(y, x.flatten(2).norm(dim=2))
    (gx,) = torch.autograd.grad(y.sum(), xr)
    assert torch.isfinite(gx).all() and (gx[1, 2] == 0).all()
    # the gradient of a channel is its unit direction
    torch.testing.assert_close(gx[0, 0], x[0, 0] / x[0, 0].norm())
    for scale in (1e-40, 1e-22, 1e30):  # squares that underflow or overflow float32
        big = (torch.rand(2, 3, 4, 4, dtype=torch.float64) + 0.1) * scale
        out = GlobalL2NormPool2d()(big.float())
        torch.testing.assert_close(out.double(), big.flatten(2).norm(dim=2), rtol=1e-5, atol=1.5e-45)
    grads = vmap(grad(lambda xi: GlobalL2NormPool2d()(xi.unsqueeze(0)).sum()))(x)
    assert torch.isfinite(grads).all() and (grads[1, 2] == 0).all()
    assert GlobalL2NormPool2d()(x[0]).shape == (4,)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\] or \[C, H, W\]"):
        GlobalL2NormPool2d()(torch.randn(3, 4))


def test_group_sort_is_a_sort_of_consecutive_groups():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, -1.0, 5.0]])
    assert GroupSort(2)(x).tolist() == [[1.0, 3.0, 2.0, 2.0, -1.0, 5.0]]
    assert GroupSort(3)(x).tolist() == [[1.0, 2.0, 3.0, -1.0, 2.0, 5.0]]
    assert GroupSort(6)(x).tolist() == [sorted(x[0].tolist())]
    assert torch.equal(GroupSort(1)(x), x)
    img = torch.randn(2, 6, 3, 3)
    expected = img.movedim(1, -1).unflatten(-1, (3, 2)).sort(-1).values.flatten(-2).movedim(-1, 1)
    assert torch.equal(GroupSort(2, dim=1)(img), expected)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        GroupSort(4)(x)
    with pytest.raises(ValueError, match="batch dimension 0"):
        GroupSort(2, dim=0)(x)
    with pytest.raises(ValueError, match="batch dimension 0"):
        GroupSort(2, dim=-2)(x)


def test_channel_group_sort2_is_group_sort2_over_channels():
    torch.manual_seed(6)
    x = torch.randn(3, 6, 4, 5)
    expected = GroupSort2()(x.movedim(1, -1)).movedim(-1, 1)
    assert torch.equal(ChannelGroupSort2()(x), expected)
    flat = torch.randn(4, 6)
    assert torch.equal(ChannelGroupSort2()(flat), GroupSort2()(flat))
    with pytest.raises(ValueError, match="even number of channels"):
        ChannelGroupSort2()(torch.randn(2, 3, 4, 4))


def test_patches_are_a_permutation():
    x = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    p = ToPatches(2)(x)
    assert p.shape == (2, 6, 12)
    assert torch.equal(p.flatten(1).sort(1).values, x.flatten(1).sort(1).values)
    torch.testing.assert_close(p[0, 1], x[0, :, 0:2, 2:4].reshape(-1))  # token 1: rows 0-1, columns 2-3
    with pytest.raises(ValueError, match="multiples of 4"):
        ToPatches(4)(x)


# --------------------------------------------------------------------------------------- whole models: the bounds


def _lipdp_cnn() -> nn.Module:
    return nn.Sequential(
        BoundedInput(4.0), LipschitzConv2d(1, 8, 3, (8, 8), padding=1), ChannelGroupSort2(), MaxPool2d(2),
        LipschitzConv2d(8, 8, 3, (4, 4), padding=1), GroupSort(4, dim=1), L2NormPool2d(2),
        GlobalL2NormPool2d(), LipschitzLinear(8, 4),
    )  # fmt: skip


MODELS = {
    "cnn": _lipdp_cnn,
    "vgg": lambda: build_model("lipschitz_vgg", (1, 8, 8), 4, hidden=8, input_bound=4.0),
    "mixer": lambda: build_model("lipschitz_mixer", (1, 8, 8), 4, hidden=8, input_bound=4.0),
}


@pytest.mark.parametrize("loss_name", ["tau-ce", "kr", "hkr", "cosine"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_per_example_gradients_never_exceed_the_bounds(model_name, loss_name):
    """The privacy guarantee on models of the new layers and the zoo's image models, with the new losses: inputs on
    the X_0 sphere, far outside, constant images (pooling ties), black images; through projected training steps."""
    torch.manual_seed(7)
    model = MODELS[model_name]()
    loss = lipschitz_loss(loss_name, tau=3.0, cosine_k=0.3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for round_ in range(3):
        x = torch.randn(24, 64)
        x = torch.cat([4.0 * F.normalize(x[:8], dim=1), 1e3 * x[8:16], torch.ones(4, 64) * (0.5 + round_),
                       torch.zeros(4, 64)]).reshape(24, 1, 8, 8)  # fmt: skip
        y = torch.randint(0, 4, (24,))
        bounds = lipschitz_bounds(model, loss)
        for p, n in per_example_grad_norms(model, loss, x, y).items():
            assert torch.isfinite(n).all()
            assert n.max() <= float(bounds[p]) * FP32_SLACK, f"{model_name}, {loss_name}, round {round_}"
        optimizer.zero_grad()
        (loss(model(x), y).sum() * 10).backward()
        optimizer.step()
        project_(model)


def test_tau_bce_bounds_on_a_one_logit_model():
    torch.manual_seed(8)
    model = nn.Sequential(BoundedInput(2.0), nn.Flatten(), LipschitzLinear(16, 8), GroupSort(4), LipschitzLinear(8, 1))
    loss = TauBinaryCrossEntropy(10.0)
    x = torch.cat([2.0 * F.normalize(torch.randn(16, 16), dim=1), 50 * torch.randn(16, 16)])
    y = torch.randint(0, 2, (32,))
    bounds = lipschitz_bounds(model, loss)
    for p, n in per_example_grad_norms(model, loss, x, y).items():
        assert n.max() <= float(bounds[p]) * FP32_SLACK


def test_conv_kernel_bound_needs_its_sqrt_overlap_factor():
    """docs/variant-lipschitz.md: a constant image and a constant upstream gradient make the per-example kernel
    gradient ~sqrt(m) ||x|| ||g|| (m = 9 for 3x3, stride 1): far above Table 5's RKO factor (~1.03) times ||x|| ||g||,
    which lip-dp's Quick layers apply to the kernel the convolution uses, and within the rule's sqrt(m)."""
    conv = LipschitzConv2d(1, 1, 3, (32, 32), padding=1)
    x = torch.ones(1, 1, 32, 32)
    out = conv(x)
    (gk,) = torch.autograd.grad(out, conv.weight, torch.ones_like(out))
    ratio = float(gk.norm() / (x.norm() * out.numel() ** 0.5))
    table5 = math.sqrt(1 / ((1 - 2 / 64) * (1 - 2 / 64)))
    assert 2.8 < ratio <= 3.0 and ratio > 2.7 * table5
    rule = conv.sensitivities(float(x.norm()), float(out.numel() ** 0.5))[conv.weight]
    assert float(rule) >= float(gk.norm()) * (1 - 1e-6)


# ------------------------------------------------------------------------------------------------------------ models


@pytest.mark.parametrize("name", ["lipschitz_vgg", "lipschitz_mixer"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_image_models_build_and_take_clipless_steps(name, shape):
    torch.manual_seed(9)
    model = build_model(name, shape, 10, hidden=16)
    x = torch.randn(6, *shape)
    assert model(x).shape == (6, 10)
    variant = Clipless(1.0, 0.1, 60, reproducible_seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    batch = Batch(x, torch.randint(0, 10, (6,)), torch.ones(6, dtype=torch.bool))
    for step in range(2):
        variant.gradient(model, batch, step)
        optimizer.step()
        variant.after_step(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(float(b) > 0 for b in variant.last_bounds)


def test_image_models_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="is for images"):
        build_model("lipschitz_vgg", (64,), 10)
    with pytest.raises(ValueError, match="2\\^depth pixels"):
        build_model("lipschitz_vgg", (1, 3, 3), 10)
    with pytest.raises(ValueError, match="even hidden width"):
        build_model("lipschitz_mixer", (1, 8, 8), 10, hidden=15)
    with pytest.raises(ValueError, match="no patch size"):
        build_model("lipschitz_mixer", (1, 17, 19), 10)


@pytest.mark.parametrize("model", ["lipschitz_vgg", "lipschitz_mixer"])
def test_image_models_train_on_digits_with_certified_accuracy(model):
    result = train(TrainConfig(variant="clipless", model=model, dataset="digits", hidden=16, noise_multiplier=2.0,
                               epochs=2, batch_size=256, optimizer="adam", lr=0.01, tau=3.0, quiet=True,
                               progress=False, reproducible_privacy_seed=0))  # fmt: skip
    assert result["steps"] > 0 and 0 <= result["test_accuracy"] <= 1
    assert result["certify_radius"] == pytest.approx(36 / 255)  # images: the paper's default radius
    assert 0 <= result["test_certified_accuracy"] <= result["test_accuracy"]
    assert all("test_certified_accuracy" in h for h in result["history"])


@pytest.mark.parametrize("loss", ["hkr", "cosine", "kr"])
def test_loss_choice_flows_to_the_variant(loss):
    result = train(TrainConfig(variant="clipless", model="lipschitz_mlp", dataset="digits", loss=loss, cosine_k=0.5,
                               hkr_alpha=2.0, noise_multiplier=2.0, epochs=1, batch_size=256, quiet=True,
                               progress=False, reproducible_privacy_seed=0, certify_radius=0.0))  # fmt: skip
    expected = lipschitz_loss(loss, cosine_k=0.5, alpha=2.0)
    assert result["variant_config"]["loss"] == type(expected).__name__
    assert result["variant_config"]["loss_lipschitz"] == expected.lipschitz
    assert result["test_certified_accuracy"] <= result["test_accuracy"]


def test_tau_bce_trains_a_binary_task_and_weightclip_takes_a_loss():
    result = train(TrainConfig(variant="weightclip", model="weightclip_mlp", dataset="breast_cancer", loss="tau-bce",
                               tau=2.0, noise_multiplier=1.0, epochs=2, batch_size=64, quiet=True, progress=False,
                               reproducible_privacy_seed=0))  # fmt: skip
    assert result["variant_config"]["loss"] == "TauBinaryCrossEntropy"
    assert result["variant_config"]["loss_lipschitz"] == 1.0
    assert result["test_certified_accuracy"] is None  # tabular data: no default radius


def test_unknown_loss_and_bad_radius_are_refused():
    with pytest.raises(ValueError, match="unknown loss 'l2'"):
        TrainConfig(variant="clipless", model="lipschitz_mlp", loss="l2", epsilon=1.0).validate()
    with pytest.raises(ValueError, match="certify-radius"):
        TrainConfig(variant="clipless", model="lipschitz_mlp", certify_radius=-1.0, epsilon=1.0).validate()


def test_cli_trains_the_mixer_with_a_loss_and_a_radius(capsys):
    from fastdp.train.cli import main

    rc = main(["train", "--variant", "clipless", "--model", "lipschitz_mixer", "--dataset", "digits", "--hidden", "8",
               "--noise-multiplier", "2", "--epochs", "1", "--batch-size", "256", "--loss", "hkr", "--hkr-alpha", "5",
               "--certify-radius", "0.1", "--reproducible-privacy-seed", "0", "--quiet"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert '"test_certified_accuracy"' in out and '"certify_radius": 0.1' in out


# -------------------------------------------------------------------------------------------- certified robustness


def test_lipschitz_constant_covers_the_model_and_refuses_clip_gradient():
    torch.manual_seed(10)
    model = nn.Sequential(BoundedInput(3.0), nn.Flatten(), LipschitzLinear(12, 10), GroupSort(2),
                          LipschitzLinear(10, 4))  # fmt: skip
    with torch.no_grad():
        model[2].weight.mul_(1.7)
    constant = float(lipschitz_constant(model))
    w1, w2 = model[2].weight.detach().double(), model[4].weight.detach().double()
    exact = float(torch.linalg.matrix_norm(w1, 2) * torch.linalg.matrix_norm(w2, 2))
    assert exact <= constant <= exact * 1.01
    x, x2 = torch.randn(500, 12), torch.randn(500, 12)
    ratios = (model(x) - model(x2)).norm(dim=1) / (x - x2).norm(dim=1)
    assert ratios.max() <= constant
    with pytest.raises(ValueError, match="ClipGradient"):
        lipschitz_constant(nn.Sequential(LipschitzLinear(4, 4), ClipGradient(0.1)))
    with pytest.raises(ValueError, match="no Lipschitz bound rule"):
        lipschitz_constant(nn.Sequential(nn.Linear(4, 4)))


def test_the_sqrt2_margin_rule_is_tight():
    """A 1-Lipschitz two-class linear model whose margin falls by exactly sqrt(2) r along u: an example with margin
    just above sqrt(2) r is certified, one just below is not, and the perturbation r u flips it."""
    u = F.normalize(torch.randn(6, dtype=torch.float64), dim=0)
    layer = LipschitzLinear(6, 2)
    layer.double()
    with torch.no_grad():
        layer.weight.copy_(torch.stack([u, -u]) / math.sqrt(2))  # ||W||_2 = 1
    model = nn.Sequential(layer)
    constant = lipschitz_constant(model)
    assert float(constant) == pytest.approx(1.0, rel=1e-3)
    r = 0.25
    for factor, certified in ((1.01, True), (0.99, False)):
        x = (factor * r * float(constant) * u)[None]  # margin sqrt(2) u.x = factor sqrt(2) r L
        logits = model(x).detach()
        margin = float(logits[0, 0] - logits[0, 1])
        assert margin == pytest.approx(factor * math.sqrt(2) * r * float(constant), rel=1e-9)
        y = torch.zeros(1, dtype=torch.int64)
        assert bool(certified_mask(logits, y, constant, r)[0]) == certified
        attacked = model(x - r * u[None]).detach()
        assert bool(attacked[0, 0] > attacked[0, 1]) == certified  # the uncertified one is flipped


def _pgd_flips(model: nn.Module, x: torch.Tensor, y: torch.Tensor, radius: float, steps: int = 30) -> torch.Tensor:
    """Projected gradient ascent on max_{j != y} z_j - z_y inside the L2 ball of ``radius`` around each x, from a
    random start; returns which examples some iterate misclassifies."""
    gen = torch.Generator().manual_seed(11)
    delta = F.normalize(torch.randn(x.shape, generator=gen, dtype=x.dtype).flatten(1), dim=1).reshape(x.shape)
    delta = delta * radius * 0.5
    flipped = torch.zeros(x.shape[0], dtype=torch.bool)
    others = ~F.one_hot(y, model(x[:1]).shape[1]).bool()
    for _ in range(steps):
        delta.requires_grad_(True)
        z = model(x + delta)
        flipped |= z.argmax(1) != y
        gap = z.masked_fill(~others, -math.inf).amax(1) - z.gather(1, y[:, None])[:, 0]
        (g,) = torch.autograd.grad(gap.sum(), delta)
        with torch.no_grad():
            step = F.normalize(g.flatten(1), dim=1).reshape(x.shape) * radius * 0.25
            delta = delta + step
            norm = delta.flatten(1).norm(dim=1).clamp(min=1e-30)
            delta = delta * (radius / norm).clamp(max=1.0).reshape(-1, *[1] * (x.dim() - 1))
    with torch.no_grad():
        flipped |= model(x + delta).argmax(1) != y
    return flipped


@pytest.mark.parametrize("name", ["lipschitz_mlp", "lipschitz_mixer", "lipschitz_vgg"])
def test_certified_examples_cannot_be_flipped(name):
    """Trained a few steps, then: certified examples (labels = the model's predictions, radius at the median
    certified radius) survive 200 random perturbations of norm r each and 30 PGD steps; PGD at 4 r flips some
    uncertified ones (the attack works)."""
    torch.manual_seed(12)
    shape = (16,) if name == "lipschitz_mlp" else (1, 8, 8)
    model = build_model(name, shape, 5, hidden=16, input_bound=6.0).double()
    x = torch.randn(64, *shape, dtype=torch.float64)
    labels = torch.randint(0, 5, (64,))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(20):
        optimizer.zero_grad()
        TauCrossEntropy(5.0)(model(x), labels).mean().backward()
        optimizer.step()
        project_(model)
    with torch.no_grad():
        logits = model(x)
    y = logits.argmax(1)
    constant = lipschitz_constant(model)
    top = logits.topk(2, dim=1).values
    radii = (top[:, 0] - top[:, 1]) / (math.sqrt(2) * float(constant))
    r = float(radii.median())
    certified = certified_mask(logits, y, constant, r)
    assert 0 < int(certified.sum()) < 64
    assert certified_accuracy(logits, y, constant, r) == pytest.approx(float(certified.double().mean()))
    assert certified_accuracy(logits, y, constant, 0.0) == 1.0
    gen = torch.Generator().manual_seed(13)
    kept = x[certified]
    with torch.no_grad():
        for _ in range(200):
            noise = F.normalize(torch.randn(kept.shape, generator=gen, dtype=kept.dtype).flatten(1), dim=1)
            assert (model(kept + r * noise.reshape(kept.shape)).argmax(1) == y[certified]).all()
    assert not _pgd_flips(model, kept, y[certified], r).any()
    assert _pgd_flips(model, x[~certified], y[~certified], 4 * r).any()


def test_certified_mask_refuses_bad_radius_and_counts_ties_as_uncertified():
    logits = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    y = torch.tensor([0, 0])
    assert certified_mask(logits, y, 1.0, 0.0).tolist() == [False, True]
    assert certified_mask(logits, y, 1.0, 2.0 / math.sqrt(2)).tolist() == [False, False]  # margin 2 = sqrt(2) L r
    with pytest.raises(ValueError, match="radius must be finite and >= 0"):
        certified_mask(logits, y, 1.0, -0.1)
