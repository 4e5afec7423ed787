"""Same clipped gradient sum as Opacus' ghost clipping for the same batch (no noise)."""

import pytest
import torch
from torch import nn

from fastdp.algorithms import Batch
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import ghost_clipped_gradient_sum
from fastdp.nn import convert
from fastdp.train.models import build_model

opacus = pytest.importorskip("opacus")
from opacus.grad_sample import GradSampleModuleFastGradientClipping  # noqa: E402
from opacus.optimizers import DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping  # noqa: E402


def opacus_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> list[torch.Tensor]:
    """Opacus 'ghost' mode: two backward passes; p.grad after the second is sum_i c_i g_i (loss reduction sum)."""
    module = GradSampleModuleFastGradientClipping(model, max_grad_norm=clip, use_ghost_clipping=True,
                                                  loss_reduction="sum")  # fmt: skip
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(module.parameters(), lr=1.0), noise_multiplier=0.0,
                                                max_grad_norm=clip, expected_batch_size=x.shape[0],
                                                loss_reduction="sum")  # fmt: skip
    criterion = DPLossFastGradientClipping(module, optimizer, nn.CrossEntropyLoss(reduction="sum"), "sum")
    optimizer.zero_grad()
    criterion(module(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    module._close()
    return grads


@pytest.mark.parametrize("clip", [0.01, 1.0])
@pytest.mark.parametrize("name, shape", [("opacus_cnn", (1, 28, 28)), ("mlp", (40,))])
def test_same_update_as_opacus_ghost(name, shape, clip):
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    twin = build_model(name, shape, 10)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(16, *shape), torch.randint(0, 10, (16,))
    expected = opacus_clipped_sum(twin, x, y, clip)
    convert(model)
    ours, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy,
                                         Batch(x, y, torch.ones(16, dtype=torch.bool)), clip)  # fmt: skip
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-4, atol=1e-6)  # ours: float64 sums
