"""DP layers: per-example norms and clipped sums against torch.func per-example gradients (float64)."""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

import fastdp.nn as dpnn
from fastdp.algorithms import Batch
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import clipped_gradient_sum, ghost_clipped_gradient_sum

HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RTOL = 1e-10


def _reference(layer: nn.Module, x: torch.Tensor, r: torch.Tensor) -> list[torch.Tensor]:
    """Per-example gradients of loss_i = <layer(x_i), r_i> for every trainable parameter."""
    params = {n: p.detach() for n, p in layer.named_parameters() if p.requires_grad}

    def loss(ps, xi, ri):
        return (functional_call(layer, ps, (xi.unsqueeze(0),)) * ri.unsqueeze(0)).sum()

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, r)
    return [grads[n] for n in params]


def check_layer(layer: nn.Module, x: torch.Tensor) -> None:
    """Per-example squared norms and clipped sums of a DP layer equal the torch.func reference."""
    dpnn.convert(layer)
    torch.manual_seed(0)
    with torch.no_grad():
        r = torch.randn_like(layer(x), dtype=torch.float64)
    with dpnn.GhostClipping() as ctx:
        out = layer(x)
    assert len(ctx.records) == 1
    record = ctx.records[0]
    (out * r).sum().backward()
    g = record.grad
    torch.testing.assert_close(g, r)  # the hook received the output gradient G
    factors = torch.rand(x.shape[0], dtype=torch.float64)
    cache = {}
    sq = layer.per_example_sq_norms(record.saved, g, cache)
    sums = layer.clipped_grad_sums(record.saved, g, factors, cache)
    torch.testing.assert_close(layer.per_example_sq_norms(record.saved, g), sq)  # without a cache: same result
    for with_cache, without in zip(sums, layer.clipped_grad_sums(record.saved, g, factors), strict=True):
        torch.testing.assert_close(with_cache, without, rtol=1e-12, atol=1e-12)
    params = [p for p in layer.parameters() if p.requires_grad]
    assert len(sums) == len(params)
    if x.shape[0] == 0:
        assert sq.shape == (0,)
        for s, p in zip(sums, params, strict=True):
            assert s.shape == p.shape and not s.any()
        return
    per_example = _reference(layer, x, r)
    expected_sq = sum(pe.reshape(pe.shape[0], -1).pow(2).sum(1) for pe in per_example)
    torch.testing.assert_close(sq, expected_sq, rtol=RTOL, atol=1e-12, msg=lambda m: f"{layer}: norms: {m}")
    for s, pe, p in zip(sums, per_example, params, strict=True):
        expected = torch.einsum("b,b...->...", factors, pe)
        torch.testing.assert_close(s, expected, rtol=RTOL, atol=1e-12, msg=lambda m, p=p: f"{layer} {p.shape}: {m}")


@HYPOTHESIS
@given(b=st.integers(0, 4), d=st.integers(1, 6), p=st.integers(1, 6), bias=st.booleans())
def test_linear_2d(b, d, p, bias):
    check_layer(nn.Linear(d, p, bias=bias).double(), torch.randn(b, d, dtype=torch.float64))


@HYPOTHESIS
@given(b=st.integers(0, 3), t=st.integers(1, 6), d=st.integers(1, 8), p=st.integers(1, 8), bias=st.booleans(),
       extra=st.booleans())  # fmt: skip
def test_linear_sequence_ghost_and_direct(b, t, d, p, bias, extra):
    """Both branches of the 2 T^2 < p d rule are hit across the drawn shapes; extra = a 4-D input [B, 2, T, d]."""
    shape = (b, 2, t, d) if extra else (b, t, d)
    check_layer(nn.Linear(d, p, bias=bias).double(), torch.randn(*shape, dtype=torch.float64))


@HYPOTHESIS
@given(
    b=st.integers(0, 3),
    cin=st.integers(1, 4),
    cout_per_group=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    size=st.integers(5, 9),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    bias=st.booleans(),
)
def test_conv2d(b, cin, cout_per_group, groups, size, k, stride, padding, dilation, bias):
    cin = cin * groups
    layer = nn.Conv2d(cin, cout_per_group * groups, k, stride=stride, padding=padding, dilation=dilation,
                      groups=groups, bias=bias).double()  # fmt: skip
    check_layer(layer, torch.randn(b, cin, size, size + 1, dtype=torch.float64))


@HYPOTHESIS
@given(b=st.integers(0, 3), cin=st.integers(1, 3), groups=st.sampled_from([1, 3]), length=st.integers(4, 12),
       k=st.integers(1, 4), stride=st.integers(1, 3), padding=st.integers(0, 2), dilation=st.integers(1, 2),
       bias=st.booleans())  # fmt: skip
def test_conv1d(b, cin, groups, length, k, stride, padding, dilation, bias):
    assume((k - 1) * dilation + 1 <= length + 2 * padding)
    cin = cin * groups
    layer = nn.Conv1d(cin, 2 * groups, k, stride=stride, padding=padding, dilation=dilation, groups=groups,
                      bias=bias).double()  # fmt: skip
    check_layer(layer, torch.randn(b, cin, length, dtype=torch.float64))


@HYPOTHESIS
@given(b=st.integers(0, 4), t=st.integers(1, 8), vocab=st.integers(1, 6), dim=st.integers(1, 5),
       padding_idx=st.sampled_from([None, 0]))  # fmt: skip
def test_embedding(b, t, vocab, dim, padding_idx):
    """Repeated tokens in an example add up (the 'sparse' part of the ghost norm); padding_idx rows get no grad."""
    layer = nn.Embedding(vocab, dim, padding_idx=padding_idx).double()
    check_layer(layer, torch.randint(0, vocab, (b, t)))


@HYPOTHESIS
@given(b=st.integers(0, 3), t=st.integers(1, 4), d=st.integers(2, 6), bias=st.booleans())
def test_layernorm(b, t, d, bias):
    layer = nn.LayerNorm(d, bias=bias).double()
    with torch.no_grad():
        layer.weight.normal_()
    check_layer(layer, torch.randn(b, t, d, dtype=torch.float64))


@HYPOTHESIS
@given(b=st.integers(0, 3), groups=st.sampled_from([1, 2]), channels_per_group=st.integers(1, 3),
       size=st.integers(1, 4))  # fmt: skip
def test_groupnorm(b, groups, channels_per_group, size):
    layer = nn.GroupNorm(groups, groups * channels_per_group).double()
    check_layer(layer, torch.randn(b, groups * channels_per_group, size, size + 1, dtype=torch.float64))


def test_frozen_parameters_are_skipped():
    layer = nn.Linear(4, 3).double()
    layer.bias.requires_grad_(False)
    check_layer(layer, torch.randn(3, 4, dtype=torch.float64))


# ------------------------------------------------------------------------------- whole models


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, channels)

    def forward(self, x):
        return torch.relu(x + self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x))))))


def resnet_style(classes: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), ResidualBlock(8), ResidualBlock(8),
        nn.Conv2d(8, 16, 1, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes),
    )  # fmt: skip


class TransformerStyle(nn.Module):
    """Token embedding, one pre-norm attention + MLP block written with Linear layers, mean pooling."""

    def __init__(self, vocab: int = 20, d: int = 16, seq: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(seq, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)  # batch-first, one row per example
        x = self.tokens(idx) + self.positions(positions)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(attention @ v)
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


@pytest.mark.parametrize("clip", [0.1, 100.0, [0.05, 0.2, 0.1, 0.3, 0.2, 0.1, 0.4, 0.2, 0.1, 0.3, 0.2, 0.5, 0.3]],
                         ids=["clipped", "unclipped", "per-layer"])  # fmt: skip
@pytest.mark.parametrize("model_name", ["resnet", "transformer"])
def test_ghost_clipped_sum_equals_reference_on_models(model_name, clip):
    torch.manual_seed(0)
    if model_name == "resnet":
        model, x, classes = resnet_style().double(), torch.randn(5, 3, 8, 8, dtype=torch.float64), 5
    else:
        model, x, classes = TransformerStyle().double(), torch.randint(0, 20, (5, 6)), 3
    dpnn.convert(model)
    layers = [m for m in model.modules() if isinstance(m, dpnn.DPLayer) and m.dp_parameters()]
    if isinstance(clip, list):
        clip = clip[: len(layers)] + [0.2] * (len(layers) - len(clip))
    y = torch.randint(0, classes, (5,))
    mask = torch.tensor([True, True, False, True, True])
    batch = Batch(x, y, mask)
    ghost, ghost_loss = ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, clip)
    ref, ref_loss = clipped_gradient_sum(model, per_example_cross_entropy, batch, clip)
    torch.testing.assert_close(ghost_loss, ref_loss)
    for a, b in zip(ghost, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_convert_swaps_classes_in_place_and_keeps_parameters():
    model = TransformerStyle()
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert dpnn.convert(model) is model
    assert isinstance(model.qkv, dpnn.Linear) and isinstance(model.tokens, dpnn.Embedding)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    fresh = TransformerStyle()
    fresh.load_state_dict(state)
    idx = torch.randint(0, 20, (2, 6))
    torch.testing.assert_close(model(idx), fresh(idx))


def test_unsupported_layers_are_listed_with_alternatives():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LSTMCell(4, 4))
    with pytest.raises(dpnn.UnsupportedLayerError) as err:
        dpnn.convert(model)
    text = str(err.value)
    assert (
        "1 (BatchNorm2d): use GroupNorm" in text
        and "3 (LSTMCell): use nn.LSTM over the whole sequence" in text
        and "Supported layers:" in text
    )
    frozen = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    frozen[1].requires_grad_(False)
    with pytest.raises(dpnn.UnsupportedLayerError, match="batch statistics in training mode"):
        dpnn.convert(frozen)  # frozen, but batch statistics in train mode still mix examples
    frozen[1].eval()
    dpnn.convert(frozen)  # eval mode: fixed (public) statistics, per-example gradients exist


def test_non_batch_first_input_is_refused():
    class Shared(nn.Module):
        """A Linear applied to a tensor shared by the batch (a learned prompt's projection), broadcast: its rows are
        not examples (an Embedding expands a shared index itself; a Linear does not)."""

        def __init__(self):
            super().__init__()
            self.tokens, self.prompt = nn.Embedding(4, 3), nn.Linear(3, 3)
            self.head = nn.Linear(3, 2)

        def forward(self, idx):
            return self.head(self.tokens(idx).mean(1) + self.prompt(torch.ones(1, 3)))

    model = dpnn.convert(Shared())
    batch = Batch(
        torch.zeros(5, 4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.bool)
    )
    with pytest.raises(ValueError, match="batch-first"):
        ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 1.0)


def test_inplace_activation_after_a_layer():
    """ReLU(inplace=True) on a DP layer's output: G is still the gradient of the layer's output."""
    torch.manual_seed(0)
    model = dpnn.convert(nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3))).double()
    batch = Batch(torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,)), torch.ones(6, dtype=torch.bool))
    ghost, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.3)
    reference, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.3)
    for a, b in zip(ghost, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_batch_statistics_in_train_mode_are_refused_at_every_step():
    """A BatchNorm without parameters passes the parameter check but mixes examples: the step refuses it."""
    model = dpnn.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False).eval(), nn.Linear(4, 2)))
    model.train()  # switched back to training mode after convert()
    batch = Batch(torch.randn(5, 4), torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.bool))
    with pytest.raises(dpnn.UnsupportedLayerError, match="BatchNorm1d"):
        ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_clipped_contribution_stays_within_c(dtype):
    """Sums are formed in float64: one example's clipped contribution never exceeds C through rounding."""
    torch.manual_seed(0)
    model = dpnn.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))).to(dtype)
    for b in (4, 64):
        x, y = torch.randn(b, 32, dtype=dtype), torch.randint(0, 10, (b,))
        mask = torch.ones(b, dtype=torch.bool)
        for i in range(min(b, 8)):
            single = torch.zeros(b, dtype=torch.bool)
            single[i] = True
            sums, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, Batch(x, y, single), 0.5)
            assert all(s.dtype == torch.float64 for s in sums)
            norm = torch.sqrt(sum(s.double().pow(2).sum() for s in sums))
            assert norm <= 0.5 * (1 + 1e-6)
        ghost_clipped_gradient_sum(model, per_example_cross_entropy, Batch(x, y, mask), 0.5)


def test_dp_layers_behave_like_torch_outside_a_step():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    converted = dpnn.convert(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)))
    converted.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    converted(x).sum().backward()
    for a, b in zip(plain.parameters(), converted.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_compiled_dp_model_matches_eager():
    """fullgraph compile of the model's forward; the DP step through a compiled model (the gradient hooks are
    registered eagerly at graph breaks) gives the same clipped sums as eager."""
    torch.manual_seed(0)
    model = dpnn.convert(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                                       nn.Linear(4 * 6 * 6, 3)))  # fmt: skip
    x = torch.randn(4, 1, 6, 6)
    torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="aot_eager")(x), model(x))
    batch = Batch(x, torch.tensor([0, 1, 2, 0]), torch.ones(4, dtype=torch.bool))
    eager, _ = ghost_clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.5)
    compiled, _ = ghost_clipped_gradient_sum(torch.compile(model, backend="aot_eager"), per_example_cross_entropy,
                                             batch, 0.5)  # fmt: skip
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)
