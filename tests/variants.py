"""Small variants, models and reference checks shared by the step-level tests (virtual batches, torch.compile,
data-parallel, the DP layers against torch.func)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fastdp.algorithms import DPSGD, JL, BackpropClip, Clipless, NonPrivate, WeightClip
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import clipped_gradient_sum, ghost_clipped_gradient_sum
from fastdp.algorithms.jl import draw_tangents
from fastdp.nn import convert
from fastdp.nn.layers import DIRECT_MEMORY_BUDGET
from fastdp.privacy.rng import PrivacyKeys
from fastdp.train.models import build_model

VARIANT_NAMES = ("dpsgd", "dpsgd-reference", "dpsgd-per-layer", "jl", "clipless", "weightclip", "backprop",
                 "nonprivate")  # fmt: skip


def make_variant(name: str, expected_batch: float, num_examples: int, reproducible_seed: int | None = 7):
    """Variant ``name`` (C = 1, sigma = 1) at sample rate expected_batch / num_examples, its privacy draws keyed by
    the reproducible seed 7 (NOT FOR RELEASE; the tests compare runs bitwise), or from OS entropy with
    ``reproducible_seed=None`` (the default of the library)."""
    q, n, key = expected_batch / num_examples, num_examples, reproducible_seed
    return {
        "dpsgd": lambda: DPSGD(1.0, 1.0, q, n, reproducible_seed=key),
        "dpsgd-reference": lambda: DPSGD(1.0, 1.0, q, n, reproducible_seed=key, mode="reference"),
        "dpsgd-per-layer": lambda: DPSGD([0.5, 0.7, 0.9], 1.0, q, n, reproducible_seed=key),
        "jl": lambda: JL(1.0, 1.0, q, n, projections=3, reproducible_seed=key),
        "clipless": lambda: Clipless(1.0, q, n, reproducible_seed=key),
        "weightclip": lambda: WeightClip(1.0, q, n, reproducible_seed=key),
        "backprop": lambda: BackpropClip(1.0, 1.0, 1.0, q, n, reproducible_seed=key),
        "nonprivate": NonPrivate,
    }[name]()


def small_model(name: str, features: int, classes: int, hidden: int = 16) -> nn.Module:
    """The model variant ``name`` trains (seeded): a Lipschitz MLP for clipless/weightclip, else three Linear layers
    (the per-layer DP-SGD variant has one clip norm for each)."""
    import torch

    torch.manual_seed(0)
    if name in ("clipless", "weightclip"):
        kind = "lipschitz_mlp" if name == "clipless" else "weightclip_mlp"
        return build_model(kind, (features,), classes, hidden=hidden, input_bound=4.0)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, classes))  # fmt: skip


def assert_ghost_is_reference(
    model, batch, clip=0.05, loss_fn=per_example_cross_entropy, atol=1e-13, expected=None
) -> nn.Module:
    """DP-SGD's clipped sums of ``model`` converted (one backward through DP layers) equal torch.func's per-example
    gradients of the unconverted model, clipped and summed (float64: rtol 1e-10), or ``expected`` where given, with
    the per-example gradients formed in the gradient hooks where smaller than A and G (the default) and with every A
    and G kept. Returns the converted model."""
    if expected is None:
        expected, _ = clipped_gradient_sum(copy.deepcopy(model), loss_fn, batch, clip)
    model = convert(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for budget in (DIRECT_MEMORY_BUDGET, None):
        sums, _ = ghost_clipped_gradient_sum(model, loss_fn, batch, clip, form_budget=budget)
        assert len(sums) == len(expected) == len(params)
        for s, e, p in zip(sums, expected, params, strict=True):
            assert s.shape == p.shape
            torch.testing.assert_close(s, e, rtol=1e-10, atol=atol)
    return model


def projection_reference(model: nn.Module, grads: list[torch.Tensor], seed: int, step: int, r: int) -> torch.Tensor:
    """``<g_i, v_j>`` [B, r] (float64) for per-example gradients ``grads`` (one [B, *p.shape] per trainable parameter)
    and the r tangents DP-SGD-JL draws at ``step`` under the reproducible seed ``seed``: what its projections must
    be."""
    params = [q for q in model.parameters() if q.requires_grad]
    tangents = draw_tangents(params, PrivacyKeys(seed), step, r, 0, r)
    v = torch.cat([t.reshape(r, -1) for t in tangents], dim=1).double()
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1).double() @ v.t()


def per_example_grad_norms(model: nn.Module, loss: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """parameter -> [B] per-example gradient norms of the summed loss (torch.func; the tests' ground truth)."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    by_name = dict(model.named_parameters())  # before functional_call, which swaps the attributes

    def one(ps, xi, yi):
        return loss(functional_call(model, ps, (xi.unsqueeze(0),)), yi.unsqueeze(0)).sum()

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return {by_name[n]: g.reshape(g.shape[0], -1).norm(dim=1) for n, g in grads.items()}


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def steps_without_host_reads(monkeypatch, variant, model: nn.Module, batch, steps: int = 2) -> None:
    """One warm-up step (the first step of a batch shape runs the row probe, which reads values on the host), then
    ``steps`` more steps (gradient, SGD, the variant's post-step hook) during which every way of turning a tensor into
    a Python value fails the test, ``torch.equal`` included: on CPU nothing synchronises, so this stands in for the
    zero-synchronisation check on a GPU."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(index: int) -> None:
        variant.gradient(model, batch, index)
        optimizer.step()
        variant.after_step(model)

    step(0)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: Tensor.{_n}"))
    monkeypatch.setattr(torch, "equal", lambda *a, **k: pytest.fail("host read: torch.equal"))
    for index in range(1, steps + 1):
        step(index)
    monkeypatch.undo()
    assert all(torch.isfinite(p).all() for p in model.parameters())
