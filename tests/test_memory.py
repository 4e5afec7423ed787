"""DP-SGD's memory: per-example gradients formed in the gradient hooks in place of A and G where smaller
(``fastdp.nn.ghost``), the normalisation layers' x_hat recomputed instead of kept, the previous step's gradients
dropped before the forward. The sums must not change, and what the hooks refuse must be refused clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastdp import PrivacyEngine
from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import ghost_backward, ghost_clipped_gradient_sum
from fastdp.nn import GhostClipping, convert
from fastdp.nn.layers import DIRECT_MEMORY_BUDGET


def _cnn(dtype=torch.float32) -> nn.Module:
    """A conv with many positions and few parameters (forms), a GroupNorm (always forms: its per-example affine
    gradients are tiny), a Linear head on one position per example (keeps A and G: p d > p + d)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 5)
    ).to(dtype)


def _batch(b=6, dtype=torch.float32) -> Batch:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, 3, 8, 8, generator=gen, dtype=dtype)
    return Batch(x, torch.randint(0, 5, (b,), generator=gen), torch.ones(b, dtype=torch.bool))


def test_records_form_where_their_per_example_gradients_are_smaller_than_a_and_g():
    model = convert(_cnn())
    run = ghost_backward(model, per_example_cross_entropy, _batch(), form_budget=DIRECT_MEMORY_BUDGET)
    kinds = [type(layer).__name__ for layer in run.layers]
    assert kinds == ["Conv2d", "GroupNorm", "Linear"]
    assert run.formed is not None and [f is not None for f in run.formed] == [True, True, False]
    for layer, formed, saved, grad in zip(run.layers, run.formed, run.saved, run.grads_out, strict=True):
        if formed is None:
            assert saved is not None and grad is not None
            continue
        assert saved is None and grad is None  # A and G dropped: only the per-example gradients are held
        assert [t.shape for t in formed] == [(6, *p.shape) for p in layer.dp_parameters()]
    kept = ghost_backward(model, per_example_cross_entropy, _batch())
    assert kept.formed is None and all(g is not None for g in kept.grads_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forming_in_the_hooks_gives_the_same_clipped_sums(dtype):
    model, batch = convert(_cnn(dtype)), _batch(dtype=dtype)
    batch.mask[2] = False
    formed, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.3)
    kept, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.3, form_budget=None)
    for a, b in zip(formed, kept, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=0)


def test_a_second_backward_through_a_formed_record_is_refused():
    model, batch = convert(_cnn()), _batch()
    with GhostClipping(batch.x.shape[0], DIRECT_MEMORY_BUDGET):
        loss = per_example_cross_entropy(model(batch.x), batch.y).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through one forward reached a GroupNorm"):
        loss.backward()


def test_a_low_precision_backward_is_still_seen_when_every_record_formed():
    """The front door under the user's autocast: the non-finite handling of bf16 must stay on when the hooks
    dropped every low-precision A and G. An example whose input overflows bf16 contributes zero and is counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten())  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(b=4).x, torch.randint(0, 4, (4,))
    x[1] = 1e38  # inf in bf16's conv output
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    private, opt, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum", reproducible_seed=3,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = private(x)
    criterion(out.float(), y).backward()
    records = list(private._pending[-1].records)  # G arrives in the step (the DP criterion's measured gradient)
    opt.step()
    assert all(r.formed is not None and r.formed_from_half for r in records)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert int(opt.variant.nonfinite_examples) == 1


def test_forming_in_the_hooks_lowers_the_peak(monkeypatch):
    """The largest total of live tensors in one DP-SGD step of a GroupNorm CNN (the CPU counterpart of CUDA's
    max_memory_allocated, from torch.profiler's memory timeline): lower when the hooks form and drop A and G."""
    pytest.importorskip("torch.profiler._memory_profiler")
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    sys.modules.pop("harness", None)
    import harness

    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 5, (32,), generator=gen),
                  torch.ones(32, dtype=torch.bool))  # fmt: skip

    def step(budget):
        return lambda: ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 1.0, form_budget=budget)

    formed, kept = harness.live_peak_mb(step(DIRECT_MEMORY_BUDGET)), harness.live_peak_mb(step(None))
    assert formed < 0.85 * kept, (formed, kept)


def test_certified_grams_never_copy_the_whole_batch_to_float64(monkeypatch):
    """The certified ghost norm's float64 copies of A and G cover a few examples at a time: its live peak stays
    below the inputs' own size (a whole-batch copy is twice their size in float64)."""
    pytest.importorskip("torch.profiler._memory_profiler")
    import sys
    from pathlib import Path

    from fastdp.ops import certified_ghost_norm_sq

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    sys.modules.pop("harness", None)
    import harness

    a, g = torch.randn(64, 32, 128), torch.randn(64, 32, 384)  # an attention in-projection's A and G, 4 MiB
    inputs = (a.numel() + g.numel()) * 4 / 2**20
    peak = harness.live_peak_mb(lambda: certified_ghost_norm_sq(a, g)) - inputs
    assert peak < 0.75 * inputs, (peak, inputs)


def test_the_variant_drops_the_previous_gradient_before_its_forward():
    """p.grad of the last step is overwritten at the release: it must not be held through the next forward."""
    model = convert(_cnn())
    variant = DPSGD(1.0, 1.0, 0.1, 60, reproducible_seed=5)
    variant.gradient(model, _batch(), 0)
    seen = []
    hook = model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.grad))
    variant.gradient(model, _batch(), 1)
    hook.remove()
    assert seen and all(g is None for g in seen)
    assert all(p.grad is not None for p in model.parameters())
