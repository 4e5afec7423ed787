"""The convolutions' per-example norm paths (fastdp.nn.layers._ConvNd): per-example weight gradients by convolution
backwards with the batch folded into the groups (CPU float32, many output positions), the certified ghost norm from
the input pixels' Gram (``certified_conv_ghost_norm_sq``, stride 1), and which path each layer takes."""

from __future__ import annotations

import copy
import itertools
import math
from fractions import Fraction

import pytest
import torch
from torch import nn

import fastdp.nn.layers as layers
from fastdp.algorithms import Batch
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import clipped_gradient_sum, ghost_clipped_gradient_sum
from fastdp.nn import Conv1d, Conv2d, convert
from fastdp.ops import certified_conv_ghost_norm_sq, certified_ghost_norm_sq

CONFIGS = [  # (spatial, C_in, C_out, kernel, stride, padding, dilation, groups, size)
    (2, 3, 4, 3, 1, 1, 1, 1, 12),
    (2, 4, 6, 3, 2, 1, 1, 2, 24),
    (2, 2, 4, 2, 1, 0, 2, 1, 14),
    (2, 4, 4, 1, 2, 0, 1, 4, 25),
    (1, 3, 6, 5, 1, 2, 1, 3, 160),
    (1, 2, 2, 3, 2, 0, 2, 1, 300),
]


def _layer(spatial, cin, cout, k, s, p, d, groups, bias=False):
    cls = Conv1d if spatial == 1 else Conv2d
    return cls(cin, cout, k, stride=s, padding=p, dilation=d, groups=groups, bias=bias)


def _input(spatial, b, cin, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (b, cin, size) if spatial == 1 else (b, cin, size, size + 1)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _im2col(layer, x, g):
    """The per-example weight gradients by the batched GEMM over im2col patches."""
    saved = layers.CONV_BACKWARD_MIN_POSITIONS
    layers.CONV_BACKWARD_MIN_POSITIONS = 1 << 62
    try:
        return layer._per_example_weight(x, g)
    finally:
        layers.CONV_BACKWARD_MIN_POSITIONS = saved


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_convolution_backwards_form_the_per_example_weight_gradients(config, rows, monkeypatch):
    """Chunks of one example, of two (5 = 2 + 2 + 1), and the whole batch: the float64 per-example gradients."""
    spatial, cin, cout, k, s, p, d, groups, size = config
    layer = _layer(spatial, cin, cout, k, s, p, d, groups)
    x = _input(spatial, 5, cin, size)
    with torch.no_grad():
        g = torch.randn_like(layer(x))
    per_example_bytes = (x[0].numel() + g[0].numel() + layer.weight.numel()) * 4
    monkeypatch.setattr(layers, "CONV_BACKWARD_CHUNK_BYTES", rows * per_example_bytes + per_example_bytes // 2)
    formed = torch.cat(layer._per_example_weight_conv(x, g))
    exact = _im2col(layer.double(), x.double(), g.double())
    assert formed.dtype == torch.float32 and formed.shape == (5, *layer.weight.shape)
    torch.testing.assert_close(formed.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_one_examples_values_never_reach_another_examples_gradient(config, monkeypatch):
    """The groups of the folded convolution are the examples: huge, infinite or NaN values in example 2 leave every
    other example's per-example gradient bitwise unchanged (its clip factor reads that example alone)."""
    monkeypatch.setattr(layers, "CONV_BACKWARD_CHUNK_BYTES", 1 << 30)  # all five examples in one convolution
    spatial, cin, cout, k, s, p, d, groups, size = config
    layer = _layer(spatial, cin, cout, k, s, p, d, groups)
    x = _input(spatial, 5, cin, size)
    with torch.no_grad():
        g = torch.randn_like(layer(x))
    clean = torch.cat(layer._per_example_weight_conv(x, g))
    for value in (3e38, float("inf"), float("nan")):
        xb, gb = x.clone(), g.clone()
        xb[2], gb[2] = value, value
        dirty = torch.cat(layer._per_example_weight_conv(xb, gb))
        others = [0, 1, 3, 4]
        assert torch.equal(dirty[others], clean[others])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_clipped_sums_of_a_float32_cnn_equal_torch_func(bias, chunk_bytes, monkeypatch):
    """A float32 CNN whose convolutions take each path: convolution backwards (16 x 16 positions; all examples in one
    call, or one per call: blocks kept for the sum), im2col (1 x 1 over 4 x 4), the patches' Gram (stride 2 to 4 x 4)
    and the pixels' Gram (stride 1 at 4 x 4). DP-SGD's clipped sums equal torch.func's per-example gradients, clipped
    and summed."""
    if chunk_bytes is not None:
        monkeypatch.setattr(layers, "CONV_BACKWARD_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.Conv2d(8, 32, 3, stride=2, padding=1, bias=bias), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=bias), nn.ReLU(),
        nn.Conv2d(64, 8, 1, bias=bias), nn.ReLU(),
        nn.Conv2d(8, 64, 3, padding=1, bias=bias), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 3),
    )  # fmt: skip
    x = torch.randn(6, 3, 16, 16)
    batch = Batch(x, torch.randint(0, 3, (6,)), torch.ones(6, dtype=torch.bool))
    expected, _ = clipped_gradient_sum(copy.deepcopy(model), per_example_cross_entropy, batch, 0.05)
    converted = convert(model)
    paths, h = [], x
    with torch.no_grad():
        for m in converted:
            if isinstance(m, nn.Conv2d):
                out = m(h)
                positions, k = math.prod(out.shape[2:]), math.prod(m.kernel_size)
                if layers._use_ghost(positions, m.out_channels, m.in_channels * k):
                    pixels = layers._pixel_gram_pays(h.shape[2:], out.shape[2:], m.padding, k, m.in_channels)
                    paths.append("pixels" if pixels else "patches")
                else:
                    paths.append("convbwd" if layers._conv_backward_pays(h, positions, k) else "im2col")
            h = m(h)
    assert paths == ["convbwd", "convbwd", "patches", "im2col", "pixels"]
    sums, _ = ghost_clipped_gradient_sum(converted, per_example_cross_entropy, batch, 0.05)
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=2e-4, atol=1e-6)


def _exact_sq_norm(x, g, k, s, p, d) -> list[Fraction]:
    """||sum_t g_t a_t^T||_F^2 of each example in exact rational arithmetic (x [N, C, H, W], g [N, P, Ho, Wo])."""
    out = []
    n, c, h, w = x.shape
    ho, wo = g.shape[2], g.shape[3]
    for i in range(n):
        xi = [[[Fraction(float(v)) for v in row] for row in ch] for ch in x[i].double().tolist()]
        gi = [[[Fraction(float(v)) for v in row] for row in ch] for ch in g[i].double().tolist()]
        total = Fraction(0)
        for o, ci, kh, kw in itertools.product(range(g.shape[1]), range(c), range(k[0]), range(k[1])):
            entry = Fraction(0)
            for r, q in itertools.product(range(ho), range(wo)):
                row, col = s[0] * r + d[0] * kh - p[0], s[1] * q + d[1] * kw - p[1]
                if 0 <= row < h and 0 <= col < w:
                    entry += gi[o][r][q] * xi[ci][row][col]
            total += entry * entry
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1e5, 1e7, 1e12])
@pytest.mark.parametrize(
    "geometry", [((3, 3), (1, 1), (0, 0), (1, 1)), ((2, 3), (1, 1), (0, 0), (2, 1)), ((2, 3), (1, 2), (0, 1), (2, 1))]
)
def test_the_pixel_gram_bound_holds_where_the_grams_lose_everything_to_rounding(dtype, scale, geometry):
    """Example 0 is a checkerboard at a large ``scale`` plus noise at the input dtype's last bits, and its output
    gradient is equal at every position: without padding its patches cancel in pairs, the float64 Grams' terms are
    ~scale^4 and its exact norm is that of the noise (float64 inputs: the Gram value is rounding noise, far from the
    exact norm). The bound stays >= the exact squared norm (rational arithmetic), the mass >= its square root, and
    the ordinary examples' bounds are tight."""
    k, s, p, d = geometry
    gen = torch.Generator().manual_seed(int(math.log10(scale)))
    x = torch.randn(3, 2, 6, 7, generator=gen, dtype=torch.float64)
    board = ((torch.arange(6).unsqueeze(1) + torch.arange(7).unsqueeze(0)) % 2 * 2.0 - 1.0).double()
    noise = 1e-10 if dtype == torch.float64 else 2.0**-18
    x[0] = scale * (board + noise * torch.randn(2, 6, 7, generator=gen, dtype=torch.float64))
    ho = (6 + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    wo = (7 + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    g = torch.randn(3, 3, ho, wo, generator=gen, dtype=torch.float64)
    g[0] = torch.randn(3, 1, 1, generator=gen, dtype=torch.float64).expand(3, ho, wo)
    x, g = x.to(dtype), g.to(dtype)
    bound, mass = certified_conv_ghost_norm_sq(x, g, k, s, p, d)
    exact = _exact_sq_norm(x, g, k, s, p, d)
    assert bound.dtype == mass.dtype == torch.float64
    for i in range(3):
        assert Fraction(float(bound[i])) >= exact[i], (i, float(bound[i]), float(exact[i]))
        assert Fraction(float(mass[i])) ** 2 >= exact[i]
    for i in (1, 2):
        assert math.isclose(float(bound[i]), float(exact[i]), rel_tol=1e-9)
    # the same bound as the patches' Gram (certified_ghost_norm_sq) up to the rounding allowance's d
    layer = Conv2d(2, 3, k, stride=s, padding=p, dilation=d, bias=False).to(dtype)
    patches_bound, patches_mass = certified_ghost_norm_sq(*layer._grouped(x, g))
    torch.testing.assert_close(mass, patches_mass, rtol=1e-12, atol=0)
    torch.testing.assert_close(bound[1:], patches_bound[1:], rtol=1e-9, atol=0)


def test_the_pixel_gram_is_taken_at_stride_1_and_the_patches_otherwise():
    # ResNet-18-GN's 3 x 3 convolutions at 8 x 8 and 4 x 4, stride 1: pixels; stride 2 and 1 x 1: patches
    assert layers._pixel_gram_pays((8, 8), (8, 8), (1, 1), 9, 256)
    assert layers._pixel_gram_pays((4, 4), (4, 4), (1, 1), 9, 512)
    assert not layers._pixel_gram_pays((16, 16), (8, 8), (1, 1), 9, 128)
    assert not layers._pixel_gram_pays((8, 8), (4, 4), (0, 0), 1, 256)
    # the layer's choice: the pixel path gives the bound of the patch path (float64, ordinary inputs)
    layer = Conv1d(4, 64, 3, padding=1).double()
    x = torch.randn(3, 4, 9, dtype=torch.float64)
    g = torch.randn(3, 64, 9, dtype=torch.float64)
    patches = certified_ghost_norm_sq(*layer._grouped(x, g))[0]
    torch.testing.assert_close(layer._ghost_bound(x, g)[0], patches, rtol=1e-12, atol=0)


def test_convolution_backwards_are_taken_for_float32_on_cpu_over_enough_positions():
    x = torch.zeros(2, 3, 4, 4)
    assert layers._conv_backward_pays(x, 16, 9) and not layers._conv_backward_pays(x, 15, 9)
    assert layers._conv_backward_pays(x, 64, 1) and not layers._conv_backward_pays(x, 63, 1)  # 1 x 1: from 64
    assert not layers._conv_backward_pays(x.double(), 1024, 9)  # no oneDNN kernel: im2col
    assert not layers._conv_backward_pays(x.bfloat16(), 1024, 9)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cancelling_image_through_the_convolution_backward_path_stays_within_the_bound(precision):
    """Leave-one-out of the noiseless release, for a convolution over 16 x 16 positions (the convolution-backward
    path in fp32) and an example whose patches cancel at large magnitude."""
    from tests.test_holes_ghost import leave_one_out

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv2d(4, 8, 3, padding=1), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.conv(x).mean((2, 3)))

    worst = 0.0
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(4, 4, 16, 16)
        board = (torch.arange(16).unsqueeze(0) + torch.arange(16).unsqueeze(1)) % 2 * 2.0 - 1.0
        x[0] = 1e6 * board + 0.01 * torch.randn(4, 16, 16)
        worst = max(worst, leave_one_out(Net(), x, torch.randint(0, 3, (4,)), precision))
    assert worst <= 1 + 1e-5, f"one example moved the release by {worst} C"
