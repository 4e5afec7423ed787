"""The clipped sums run in IEEE float32 whatever the user's TF32 / bfloat16 settings (``fastdp._precision``): their
rounding allowance is float32's, and TF32 (cuDNN's default for float32 convolutions) or bfloat16 products round
each input to 2^-11 or 2^-8 of itself, so an example whose terms cancel at large magnitude would move the release
far beyond its bound."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from fastdp._precision import _KEYS, effective_precisions, exact_fp32
from fastdp.algorithms import BackpropClip, Batch
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import clipped_gradient_sum, clipped_sums_of_backward, ghost_backward
from fastdp.nn import convert

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C, "_get_fp32_precision_getter"), reason="torch < 2.9 has no per-backend fp32_precision"
)

SETTINGS = ["highest", "high", "medium", "mkldnn-matmul-bf16", "mkldnn-conv-bf16", "generic-bf16", "cudnn-tf32"]


def _state():
    get = torch._C._get_fp32_precision_getter
    try:
        legacy = torch.get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32()
    except RuntimeError:  # the user mixed the legacy and the per-backend APIs
        legacy = "mixed"
    return legacy, {key: get(*key) for key in _KEYS}


@contextlib.contextmanager
def user_setting(name: str):
    """A user's reduced-precision setting, as they would make it; everything back to the defaults afterwards."""
    set_ = torch._C._set_fp32_precision_setter
    before = _state()
    try:
        if name in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(name)
        elif name == "mkldnn-matmul-bf16":
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        elif name == "mkldnn-conv-bf16":
            torch.backends.mkldnn.conv.fp32_precision = "bf16"
        elif name == "generic-bf16":
            torch.backends.fp32_precision = "bf16"
        elif name == "cudnn-tf32":
            torch.backends.cudnn.allow_tf32 = True
        yield
    finally:
        for key in _KEYS:
            set_(*key, "none")
        torch.set_float32_matmul_precision(before[0][0] if before[0] != "mixed" else "highest")
        torch._C._set_cudnn_allow_tf32(True)
        for key, value in before[1].items():
            set_(*key, value)


@pytest.mark.parametrize("setting", SETTINGS)
def test_exact_fp32_runs_ieee_products_and_restores_the_users_settings(setting):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 300, generator=gen), torch.randn(300, 200, generator=gen)
    x, w = torch.randn(4, 16, 12, 12, generator=gen), torch.randn(32, 16, 3, 3, generator=gen)
    exact = a @ b, torch.nn.functional.conv2d(x, w)
    with user_setting(setting):
        before = _state()
        with exact_fp32():
            assert set(effective_precisions().values()) == {"ieee"}
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
            inside = a @ b, torch.nn.functional.conv2d(x, w)
        assert _state() == before
        with pytest.raises(KeyError), exact_fp32():
            raise KeyError("restored on an exception too")
        assert _state() == before
    for got, want in zip(inside, exact, strict=True):
        assert torch.equal(got, want)


class TokenConv(nn.Module):
    """A convolution on channels 0-63 and a Linear on channels 64-127 read as two tokens, both on their Gram paths
    (sums by one weight-gradient convolution / one GEMM of the batch: the products a reduced precision changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.conv, self.head = nn.Linear(1152, 256), nn.Conv2d(64, 128, 3), nn.Linear(256 + 128, 3)

    def forward(self, x):
        tokens = x[:, 64:].reshape(x.shape[0], 2, 1152)
        return self.head(torch.cat([self.lin(tokens).mean(1), self.conv(x[:, :64]).mean((2, 3))], 1))


def _batch(cancel: float = 0.0, device: str = "cpu"):
    """64 examples [128, 6, 6]; with ``cancel``, example 0's patches (a checkerboard) and tokens (+-cancel u)
    cancel at large magnitude."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, 6, 6, generator=gen)
    if cancel:
        board = (torch.arange(6).unsqueeze(0) + torch.arange(6).unsqueeze(1)) % 2 * 2.0 - 1.0
        x[0, :64] = cancel * board + 0.01 * x[0, :64]
        u = torch.randn(32, 6, 6, generator=gen)
        x[0, 64:96], x[0, 96:] = cancel * u + x[0, 64:96], -cancel * u
    y = torch.randint(0, 3, (64,), generator=gen)
    return Batch(x.to(device), y.to(device), torch.ones(64, dtype=torch.bool, device=device))


def _sums_of_one_backward():
    """A function giving the DP-SGD clipped sums of one fixed backward (A and G) of TokenConv on the cancelling
    batch: what each call changes is only the clipping and the sums."""
    torch.manual_seed(0)
    model = convert(TokenConv())
    batch = _batch(cancel=1e5)
    run = ghost_backward(model, per_example_cross_entropy, batch, None, 1.0, None)
    return lambda: clipped_sums_of_backward(model, run, batch.mask, 1.0, 1.0, 1.0, False)[0]


@pytest.mark.parametrize("setting", SETTINGS[1:])
def test_ghost_clipped_sums_of_one_backward_are_bitwise_the_same_under_any_setting(setting):
    """The same A and G (one backward at full precision), the clip factors and the sums under the user's setting:
    bit for bit those of IEEE float32."""
    sums = _sums_of_one_backward()
    exact = sums()
    with user_setting(setting):
        for got, want in zip(sums(), exact, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("setting", ["medium", "mkldnn-matmul-bf16", "mkldnn-conv-bf16"])
def test_every_variant_with_a_sum_bound_sums_in_ieee_float32(setting, monkeypatch):
    """The sums of DP-SGD's reference mode (from the same per-example gradients), JL (from the same backward and
    weights) and backprop clipping (the whole step: its backward is the sum) are bitwise those of IEEE float32
    under a reduced-precision setting."""
    import fastdp.algorithms.dpsgd as dpsgd
    from fastdp.algorithms.jl import _clipped_sum

    torch.manual_seed(0)
    model = convert(TokenConv())
    batch = _batch(cancel=1e5)
    per_example = dpsgd.per_example_gradients(model, per_example_cross_entropy, batch.x, batch.y, None)
    monkeypatch.setattr(dpsgd, "per_example_gradients", lambda *args: per_example)
    run = ghost_backward(model, per_example_cross_entropy, batch, None, 1.0, None)
    weights = torch.rand(64, generator=torch.Generator().manual_seed(0))
    image = nn.Sequential(nn.Conv2d(64, 128, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 3))
    backprop = BackpropClip(1.0, 1.0, 0.0, 0.5, 128)
    steps = {
        "reference": lambda: clipped_gradient_sum(model, per_example_cross_entropy, batch, 1.0)[0],
        "jl": lambda: _clipped_sum(run, weights, [{} for _ in run.layers]),
        "backprop": lambda: backprop.clipped_sum(image, Batch(batch.x[:, :64], batch.y, batch.mask), 0)[0],
    }
    exact = {name: step() for name, step in steps.items()}
    with user_setting(setting):
        for name, step in steps.items():
            for got, want in zip(step(), exact[name], strict=True):
                assert torch.equal(got, want), name


def test_without_exact_fp32_a_reduced_precision_setting_changes_the_sums(monkeypatch):
    """What gives the tests above their teeth: with :func:`exact_fp32` taken out, a reduced-precision setting
    changes the clipped sums on this machine (oneDNN's bfloat16 passes, on a CPU with bf16 units); skipped where
    no setting changes them."""
    import fastdp.algorithms.dpsgd as dpsgd

    sums = _sums_of_one_backward()
    exact = sums()
    monkeypatch.setattr(dpsgd, "exact_fp32", contextlib.nullcontext)
    changed = []
    for setting in ("medium", "mkldnn-matmul-bf16", "mkldnn-conv-bf16"):
        with user_setting(setting):
            changed += [setting] if any(not torch.equal(g, w) for g, w in zip(sums(), exact, strict=True)) else []
    if not changed:
        pytest.skip("no reduced-precision setting changes float32 products on this CPU (no bf16 units)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("setting", ["cudnn-tf32", "high"])
def test_cancelling_examples_stay_within_the_bound_under_tf32_on_cuda(setting):
    """cuDNN's float32 convolutions default to TF32: the conv's clipped sum (one weight-gradient convolution of the
    batch) and, under 'high', the Linear's GEMM would round example 0's cancelling terms at 2^-11 of their size."""
    from tests.test_holes_ghost import leave_one_out

    torch.manual_seed(0)
    batch = _batch(cancel=1e6, device="cuda")
    with user_setting(setting):
        assert leave_one_out(TokenConv().cuda(), batch.x, batch.y) <= 1 + 1e-5


@pytest.mark.parametrize("setting", ["medium", "mkldnn-matmul-bf16"])
def test_clipless_steps_run_in_ieee_float32(setting, monkeypatch):
    """Clipless DP-SGD's bounds are analytic (Lipschitz constants, the input bound) on the exact forward and gradient,
    with no per-example step to absorb rounding: its whole step (and the front door's forward and sums) runs in IEEE
    float32, bitwise the same under a reduced-precision setting; without exact_fp32 the setting changes them."""
    import fastdp.algorithms.clipless as clipless
    from fastdp.algorithms import Clipless
    from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear

    torch.manual_seed(0)
    model = nn.Sequential(BoundedInput(5.0), LipschitzLinear(512, 512), GroupSort2(), LipschitzLinear(512, 10))
    gen = torch.Generator().manual_seed(0)
    batch = Batch(torch.randn(256, 512, generator=gen), torch.randint(0, 10, (256,), generator=gen),
                  torch.ones(256, dtype=torch.bool))  # fmt: skip
    variant = Clipless(1.0, 0.1, 2560)

    def sums():
        return variant.clipped_sum(model, batch, 0)[0]

    exact = sums()
    with user_setting(setting):
        for got, want in zip(sums(), exact, strict=True):
            assert torch.equal(got, want)
    monkeypatch.setattr(clipless, "exact_fp32", contextlib.nullcontext)
    with user_setting(setting):
        changed = any(not torch.equal(g, w) for g, w in zip(sums(), exact, strict=True))
    if not changed:
        pytest.skip("this CPU runs float32 products at full precision under the setting (no bf16 units)")
