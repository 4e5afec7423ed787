"""Backpropagation clipping: per-example bounds C1 C2 (L2 / l15), noise on the sum (the published 1/b^2 bug absent)."""

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fastdp.algorithms import BackpropClip, Batch
from fastdp.nn.backprop import convert_backprop, parameter_sensitivities
from fastdp.nn.clip import clip_rows
from fastdp.train.trainer import TrainConfig, train

SIGMAS = 5.0


def per_example_norms(model, x, y):
    params = {n: p.detach() for n, p in model.named_parameters()}
    by_name = dict(model.named_parameters())

    def one(ps, xi, yi):
        out = functional_call(model, ps, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return {by_name[n]: g.reshape(g.shape[0], -1).norm(dim=1) for n, g in grads.items()}


@pytest.mark.parametrize("kind", ["mlp", "tokens", "cnn"])
def test_per_example_gradients_within_c1_c2(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model, x = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4)), 50 * torch.randn(64, 10)
    elif kind == "tokens":
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4), nn.Flatten(), nn.Linear(5 * 4, 4))
        x = 50 * torch.randn(64, 5, 10)
    else:
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.Flatten(),
                              nn.Linear(4 * 3 * 3, 4))  # fmt: skip
        x = 50 * torch.randn(64, 2, 8, 8)
    convert_backprop(model, input_clip=0.7, grad_clip=0.3)
    y = torch.randint(0, 4, (64,))
    model(x)  # records token positions for the bias bounds
    bounds = parameter_sensitivities(model)
    for p, n in per_example_norms(model, x, y).items():
        assert n.max() <= bounds[p] * (1 + 1e-5), f"{kind}: {n.max()} > {bounds[p]}"


def test_clip_rows_norms():
    g = torch.randn(5, 3, 4, 4) * 10
    assert (clip_rows(g, 2.0).flatten(1).norm(dim=1) <= 2.0 + 1e-5).all()
    l15 = clip_rows(g, 2.0, "l15").abs().flatten(2).sum(2).pow(2).sum(1).sqrt()
    assert (l15 <= 2.0 + 1e-5).all()


class ZeroLoss(nn.Module):
    def forward(self, logits, y):
        return 0.0 * logits.sum(1)


@pytest.mark.parametrize("batch", [16, 32])
def test_noise_on_the_sum_does_not_depend_on_the_batch(batch):
    """Regression test for the published bug (sensitivity divided by b twice): at fixed clips, the noise std on the
    clipped sum is sigma sqrt(N) C1 C2 whatever the batch size, and the mean is divided by q N once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 300), nn.ReLU(), nn.Linear(300, 200, bias=False))
    sigma, c1, c2, q, n = 1.2, 0.5, 2.0, 0.1, 1000
    variant = BackpropClip(c1, c2, sigma, q, n, reproducible_seed=7, loss_fn=ZeroLoss())
    x, y = torch.randn(batch, 200), torch.zeros(batch, dtype=torch.int64)
    variant.gradient(model, Batch(x, y, torch.ones(batch, dtype=torch.bool)), step=0)
    for p in (model[0].weight, model[2].weight):
        noise_on_sum = p.grad.reshape(-1).double() * (q * n)
        expected = sigma * math.sqrt(3) * c1 * c2  # 3 tensors
        assert abs(noise_on_sum.std().item() - expected) < SIGMAS * expected / math.sqrt(2 * noise_on_sum.numel())
    bias_noise = model[0].bias.grad.double() * (q * n)
    assert abs(bias_noise.std().item() - sigma * math.sqrt(3) * c2) < SIGMAS * sigma * math.sqrt(3) * c2 / math.sqrt(
        600
    )
    assert variant.privacy_event() == (sigma, q)


def test_unsupported_layers_are_named():
    with pytest.raises(ValueError, match=r"1 \(LayerNorm\)"):
        convert_backprop(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), 1.0, 1.0)
    with pytest.raises(ValueError, match="input clip"):
        convert_backprop(nn.Sequential(nn.Linear(3, 3)), 0.0, 1.0)


def test_backprop_trains_on_breast_cancer():
    result = train(TrainConfig(variant="backprop", dataset="breast_cancer", model="mlp", epsilon=3.0, input_clip=5.0,
                               clip_norm=1.0, epochs=20, batch_size=64, optimizer="adam", lr=0.01, quiet=True,
                               progress=False))  # fmt: skip
    assert result["epsilon"] <= 3.0 and result["variant"] == "backprop"
    assert result["comparison_epsilons"]["zcdp_paper"] > 0  # the paper's accounting, reported beside ours
    assert result["test_auroc"] > 0.85


@pytest.mark.parametrize("kind", ["mlp", "tokens", "cnn"])
def test_every_layer_input_is_clipped_to_c1_in_the_forward(kind, monkeypatch):
    """What each trainable layer multiplies with its weight has per-example L2 norm <= C1."""
    torch.manual_seed(1)
    if kind == "cnn":
        model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
        x = 30 * torch.randn(9, 2, 8, 8)
    elif kind == "tokens":
        model, x = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), 30 * torch.randn(9, 4, 6)
    else:
        model, x = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), 30 * torch.randn(9, 6)
    convert_backprop(model, input_clip=0.25, grad_clip=1.0)
    seen = []
    for name in ("linear", "conv2d"):
        original = getattr(nn.functional, name)
        monkeypatch.setattr(nn.functional, name, lambda inp, *a, _f=original, **k: seen.append(inp) or _f(inp, *a, **k))
    model(x)
    assert len(seen) == sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in model)
    for inp in seen:
        assert inp.reshape(inp.shape[0], -1).norm(dim=1).max() <= 0.25 * (1 + 1e-6)


def test_zero_noise_and_loose_clips_is_plain_sgd():
    """Up to the rounding of the batch's sum, which fastdp forms in float64 (plain SGD's is float32)."""
    torch.manual_seed(2)
    make = lambda: nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))  # noqa: E731
    model, plain = make(), make()
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 4, (8,))
    q, n = 0.1, 80
    BackpropClip(1e30, 1e30, 0.0, q, n).gradient(model, Batch(x, y, torch.ones(8, dtype=torch.bool)), step=0)
    losses = nn.functional.cross_entropy(plain(x), y, reduction="none")
    grads = torch.autograd.grad(losses.sum(), list(plain.parameters()))
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g / (q * n), rtol=1e-5, atol=1e-7)
