"""papers/01's per-layer-clipped DP-SGD baseline as the reproduction runs it (method ``dpsgd-per-layer``): the cell's
config gives fastdp's DPSGD one C_l per DP layer of the ``mlp``; the noise is calibrated to the release's L2
sensitivity sqrt(sum_l C_l^2); and every example's leave-one-out change of the released gradient (the noise keyed
alike in both releases cancels: sigma = 0 here) is within that bound, each layer's within its C_l, adversarial examples
included (and reached by them: the bound is what the noise must cover)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.reproduce.specs import MLP_DP_LAYERS, build_plan
from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import trainable_parameters
from fastdp.algorithms.dpsgd import dp_layers
from fastdp.train.models import build_model


def _cell(method: str, dataset: str = "breast_cancer"):
    return build_plan(sections=["weightclip"], methods=[method], datasets=[dataset], max_points=1).cells[0]


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", (30,), 2, hidden=32).double()


def test_per_layer_cell_gives_one_bound_per_mlp_layer():
    cell = _cell("dpsgd-per-layer")
    bound = cell.grid[0]["clip_norm"]
    config = cell.config(cell.grid[0], seed=0)
    assert config["variant"] == "dpsgd" and config["clip_norm"] == [bound] * MLP_DP_LAYERS
    assert len(dp_layers(_converted())) == MLP_DP_LAYERS  # the mlp the trainer builds (depth 2): 3 Linear layers
    flat = _cell("dpsgd")
    assert flat.config(flat.grid[0], seed=0)["clip_norm"] == bound  # the flat baseline keeps one C
    assert cell.paper.value == flat.paper.value  # both beside the paper's DP-SGD column (a per-layer baseline)
    for dataset in ("adult", "default_credit", "dropout"):
        assert _cell("dpsgd-per-layer", dataset).config(_cell("dpsgd", dataset).grid[0], 0)["clip_norm"] == [1.0] * 3


def _converted() -> torch.nn.Module:
    model = _mlp()
    DPSGD([1.0] * MLP_DP_LAYERS, 1.0, 0.1, 100).prepare(model)
    return model


def test_noise_is_calibrated_to_the_joint_sensitivity():
    sigma, q, n = 1.3, 0.1, 400
    model = _converted()
    params = trainable_parameters(model)
    equal = DPSGD([0.7] * 3, sigma, q, n)
    stds = equal._noise_stds(model, params)
    assert stds == pytest.approx([sigma * math.sqrt(3 * 0.7**2)] * len(params))  # isotropic: sigma sqrt(sum C_l^2)
    assert equal.privacy_event() == (pytest.approx(sigma), q)
    bounds = [0.3, 0.2, 0.5]
    unequal = DPSGD(bounds, sigma, q, n)
    stds = unequal._noise_stds(model, params)
    std_of = {id(p): s for p, s in zip(params, stds, strict=True)}
    layer_stds = []
    for layer, bound in zip(dp_layers(model), bounds, strict=True):
        layer_stds.append(std_of[id(layer.dp_parameters()[0])])
        assert [std_of[id(p)] for p in layer.dp_parameters()] == pytest.approx([sigma * math.sqrt(3) * bound] * 2)
    # whitened by its noise std, layer l has sensitivity C_l / std_l; together sqrt(sum_l (C_l / std_l)^2) = 1 / sigma
    whitened = math.sqrt(sum((c / s) ** 2 for c, s in zip(bounds, layer_stds, strict=True)))
    assert whitened == pytest.approx(1 / sigma) and unequal.privacy_event() == (pytest.approx(sigma), q)


def _release(variant: DPSGD, model, x, y, step: int) -> list[torch.Tensor]:
    """The released gradient of one step (the clipped sum divided by the expected batch size, plus the noise)."""
    variant.gradient(model, Batch(x, y, torch.ones(len(y), dtype=torch.bool)), step=step)
    return [p.grad.detach().clone() for p in trainable_parameters(model)]


@pytest.mark.parametrize("bounds", [[0.3, 0.2, 0.5], [1.0, 1.0, 1.0]], ids=["unequal", "equal"])
def test_leave_one_out_change_of_the_release_is_within_the_bound(bounds):
    torch.manual_seed(1)
    x = torch.randn(10, 30, dtype=torch.float64)
    adversarial = torch.stack([
        1e6 * torch.ones(30, dtype=torch.float64),  # huge: every layer's gradient far above its C_l
        -1e6 * torch.ones(30, dtype=torch.float64),
        torch.nn.functional.one_hot(torch.tensor(4), 30).double() * 1e8,  # one huge coordinate
        torch.zeros(30, dtype=torch.float64),  # only the biases' gradients
        x[0].clone(),  # a duplicate of another example
    ])  # fmt: skip
    x = torch.cat([x, adversarial])
    y = torch.randint(0, 2, (len(x),))
    model = _mlp()
    # sigma = 0: the release's data-dependent part alone (noise keyed alike in the two releases would cancel; one
    # variant releases successive steps, whose keys differ)
    variant = DPSGD(bounds, 0.0, 0.1, 120, reproducible_seed=7)
    scale = variant.expected_batch_size
    full = _release(variant, model, x, y, step=0)
    layers = dp_layers(model)
    index = {id(p): i for i, p in enumerate(trainable_parameters(model))}
    joint = math.sqrt(sum(c * c for c in bounds))
    changes = []
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        without = _release(variant, model, x[keep], y[keep], step=i + 1)
        diffs = [(a - b) * scale for a, b in zip(full, without, strict=True)]  # the clipped sums' difference
        total = math.sqrt(sum(d.pow(2).sum().item() for d in diffs))
        assert total <= joint * (1 + 1e-9), (i, total, joint)
        for layer, bound in zip(layers, bounds, strict=True):
            shift = math.sqrt(sum(diffs[index[id(p)]].pow(2).sum().item() for p in layer.dp_parameters()))
            assert shift <= bound * (1 + 1e-9), (i, shift, bound)
        changes.append(total)
    assert max(changes[10:13]) >= joint * (1 - 1e-6)  # the huge examples reach the bound: the noise must cover it
