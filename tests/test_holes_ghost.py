"""Regression tests of the ghost-norm rounding hole (privacy review, hole 1): an example whose positions (tokens,
patches) cancel at large magnitude got a computed norm far too small, negative or NaN, while its contribution was
summed separately; one example moved the released sum by up to 246 C. The norm that sets a clip factor must bound
the contribution actually summed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastdp.algorithms import DPSGD, Batch
from fastdp.ops import certified_ghost_norm_sq, certified_token_match_norm_sq

C = 1.0


class TokenLinear(nn.Module):
    """A token-wise Linear, mean-pooled over positions, then a head."""

    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(d, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.head(self.lin(x).mean(1))


class ConvPool(nn.Module):
    """conv -> global average pool head (sizes where the conv's norm takes the Gram path: 2 L (C_out + k C_in) <
    C_out k C_in, ``fastdp.nn.layers._use_ghost``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(8, 128, 3), nn.Linear(128, 3)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def leave_one_out(model, x, y, precision="fp32", example=0) -> float:
    """||release(D) - release(D without ``example``)|| / C, noiseless, on the sum (the example masked out)."""
    variant = DPSGD(C, 0.0, 0.5, 2 * x.shape[0])
    variant.set_precision(precision)
    variant.prepare(model)

    def release(mask):
        sums, _ = variant.clipped_sum(model, Batch(x, y, mask), 0)
        return torch.cat([s.reshape(-1).double() for s in sums]) * variant.expected_batch_size

    full = torch.ones(x.shape[0], dtype=torch.bool)
    without = full.clone()
    without[example] = False
    return float((release(full) - release(without)).norm()) / C


def cancelling_tokens(scale: float, seed: int, batch: int = 4, positions: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, positions, d, generator=gen)
    u, e = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    x[0, 0], x[0, 1] = scale * u + e, -scale * u
    return x, torch.randint(0, 3, (batch,), generator=gen)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("scale", [3e5, 1e7])
def test_cancelling_tokens_stay_within_the_bound(precision, scale):
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        x, y = cancelling_tokens(scale, seed)
        worst = max(worst, leave_one_out(TokenLinear(), x, y, precision))
    assert worst <= 1 + 1e-5, f"one example moved the release by {worst} C"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1e5, 1e6, 1e7])
def test_a_checkerboard_image_into_conv_and_global_pool_stays_within_the_bound(precision, scale):
    worst = 0.0
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(4, 8, 6, 6)  # 4 x 4 output positions: the checkerboard's patches cancel in pairs
        board = (torch.arange(6).unsqueeze(0) + torch.arange(6).unsqueeze(1)) % 2 * 2.0 - 1.0
        x[0] = scale * board + 0.01 * torch.randn(8, 6, 6)
        worst = max(worst, leave_one_out(ConvPool(), x, torch.randint(0, 3, (4,)), precision))
    assert worst <= 1 + 1e-5, f"one example moved the release by {worst} C"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_certified_ghost_norm_bounds_the_exact_norm_and_is_tight_for_ordinary_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 5, 7, generator=gen, dtype=torch.float64)
    g = torch.randn(6, 5, 3, generator=gen, dtype=torch.float64)
    a[0, :2] = torch.stack([1e6 * a[0, 2] + a[0, 3], -1e6 * a[0, 2]])  # cancelling rows
    g[0, 1] = g[0, 0]
    a, g = a.to(dtype), g.to(dtype)
    bound, mass = certified_ghost_norm_sq(a, g)
    exact = torch.einsum("btd,btp->bdp", a.double(), g.double()).pow(2).sum((1, 2))
    assert bound.dtype == torch.float64 and (bound >= exact).all()
    assert (mass >= exact.sqrt()).all()
    assert torch.allclose(bound[1:], exact[1:], rtol=1e-9)


def test_certified_token_match_norm_bounds_the_embedding_gradient_norm():
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 4, (5, 6), generator=gen)
    g = torch.randn(5, 6, 3, generator=gen, dtype=torch.float64)
    idx[0] = 2  # one token repeated, gradients cancelling at large magnitude
    g[0, 0::2], g[0, 1::2] = 1e7 * g[0, 0] + 0.1, -1e7 * g[0, 0]
    bound, mass = certified_token_match_norm_sq(idx, g.float())
    exact = torch.zeros(5, 4, 3, dtype=torch.float64).scatter_add_(
        1, idx.unsqueeze(-1).expand(-1, -1, 3), g.float().double()).pow(2).sum((1, 2))  # fmt: skip
    assert (bound >= exact).all() and (mass >= exact.sqrt()).all()
    assert torch.allclose(bound[1:], exact[1:], rtol=1e-9)


def test_the_models_above_take_the_gram_path():
    """The regression tests above are about the Gram (ghost) norm: their layers must still take it."""
    from fastdp.nn.layers import _pixel_gram_pays, _use_ghost

    assert _use_ghost(16, 128, 8 * 9)  # ConvPool's conv: 4 x 4 output positions
    assert _pixel_gram_pays((6, 6), (4, 4), (0, 0), 9, 8)  # ... from the input pixels' Gram (stride 1)
    assert _use_ghost(2, 16, 8)  # TokenLinear's lin on cancelling_tokens' 2 positions


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att, self.head = nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.att(x, x, x, need_weights=False)[0].mean(1))


class _Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn, self.head = getattr(nn, kind)(16, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0].mean(1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["MultiheadAttention", "LSTM", "GRU"])
def test_cancelling_tokens_through_attention_and_recurrences_stay_within_the_bound(kind, precision):
    """Tokens ``+-s u`` (s up to 1e5) into nn.MultiheadAttention / nn.LSTM / nn.GRU, converted, in fp32 and under
    bf16 autocast: one example's leave-one-out change of the release stays <= C."""
    from fastdp.nn import convert

    worst = 0.0
    for seed in range(2):
        for scale in (1e3, 1e5):
            torch.manual_seed(seed)
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(6, 4, 16, generator=gen)
            u = torch.randn(16, generator=gen)
            x[0, 0], x[0, 1], x[0, 2], x[0, 3] = scale * u + x[0, 0], -scale * u, scale * u, -scale * u
            model = convert(_Attention() if kind == "MultiheadAttention" else _Recurrent(kind))
            worst = max(worst, leave_one_out(model, x, torch.randint(0, 3, (6,), generator=gen), precision))
    assert worst <= 1 + 1e-5, f"one example moved the release by {worst} C"
