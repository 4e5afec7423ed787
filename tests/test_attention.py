"""The DP nn.MultiheadAttention (fastdp.nn.attention): clipped sums and JL projections against torch.func's per-example
gradients of the unconverted model (float64), the norm bounds, torch's own forward outside a DP step, Transformer
encoders, the row probe and the front door."""

import copy
import io

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.algorithms import DPSGD, JL, Batch
from fastdp.algorithms.base import per_example_cross_entropy as loss_fn
from fastdp.algorithms.dpsgd import (
    clipped_gradient_sum,
    ghost_backward,
    ghost_clipped_gradient_sum,
    per_example_gradients,
)
from fastdp.algorithms.jl import jl_projections
from fastdp.nn import DPLayer, GhostClipping, Linear, MultiheadAttention, UnsupportedLayerError, convert, validate
from fastdp.privacy.rng import PrivacyKeys
from tests.variants import assert_ghost_is_reference, projection_reference

VOCAB, CLASSES, HEADS, FEATURES = 11, 3, 2, 4
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch.func over SDPA


class SelfAttentionNet(nn.Module):
    """Embedding -> nn.MultiheadAttention (query is key is value) -> mean over positions -> Linear head. ``mask``:
    None, "causal" (float [T, T] with the is_causal hint), "causal-bool" (bool [T, T]) or "per-example" (bool
    [B * heads, T, T] from the tokens); ``padding``: token 0 is padding (key_padding_mask); ``need_weights``: the
    returned attention weights enter the loss too."""

    def __init__(self, batch_first=True, dim=8, mask=None, padding=False, need_weights=False, average=True, **kw):
        super().__init__()
        self.batch_first, self.mask, self.padding = batch_first, mask, padding
        self.need_weights, self.average = need_weights, average
        self.embed = nn.Embedding(VOCAB, dim)
        self.attention = nn.MultiheadAttention(dim, HEADS, batch_first=batch_first, **kw)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        t = x.shape[1]
        kwargs = {}
        if self.padding:  # float with a float attn_mask (torch deprecates mixing the two)
            padding = x == 0
            float_mask = h.new_zeros(x.shape).masked_fill(padding, -torch.inf)
            kwargs["key_padding_mask"] = float_mask if self.mask == "causal" else padding
        if self.mask == "causal":
            kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype), is_causal=True)
        elif self.mask == "causal-bool":
            kwargs["attn_mask"] = torch.ones(t, t, dtype=torch.bool).triu(1)
        elif self.mask == "per-example":  # position s hidden from l where token s is a multiple of 3, but never l
            hidden = (x % 3 == 0).unsqueeze(1) & ~torch.eye(t, dtype=torch.bool)
            kwargs["attn_mask"] = hidden.repeat_interleave(HEADS, 0)
        seq = h if self.batch_first else h.transpose(0, 1)
        out, weights = self.attention(seq, seq, seq, need_weights=self.need_weights,
                                      average_attn_weights=self.average, **kwargs)  # fmt: skip
        pooled = (out if self.batch_first else out.transpose(0, 1)).mean(1)
        if weights is not None:
            pooled = pooled + weights.flatten(1).square().sum(1, keepdim=True)
        return self.head(pooled)


class CrossAttentionNet(nn.Module):
    """Linear layers in -> nn.MultiheadAttention with queries from the first 3 positions and keys/values from all of
    them (``shared``: key is value), ``kdim``/``vdim`` -> mean -> Linear head; ``padding``: a key_padding_mask from
    the input (never the first position)."""

    def __init__(self, batch_first=True, dim=8, kdim=None, vdim=None, shared=True, padding=False, **kw):
        super().__init__()
        self.batch_first, self.shared, self.padding = batch_first, shared, padding
        self.query_in = nn.Linear(FEATURES, dim)
        self.key_in = nn.Linear(FEATURES, kdim or dim)
        self.value_in = None if shared else nn.Linear(FEATURES, vdim or dim)
        self.attention = nn.MultiheadAttention(dim, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim, **kw)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        query, key = self.query_in(x[:, :3]), self.key_in(x)
        value = key if self.shared else self.value_in(x)
        padding = None
        if self.padding:
            padding = torch.cat([torch.zeros_like(x[:, :1, 0], dtype=torch.bool), x[:, 1:, 0] > 0.5], 1)
        if not self.batch_first:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
            value = key if self.shared else value.transpose(0, 1)
        out, _ = self.attention(query, key, value, key_padding_mask=padding, need_weights=False)
        return self.head((out if self.batch_first else out.transpose(0, 1)).mean(1))


def _tokens(b=6, t=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (b, t), generator=gen)
    x[:, 0] = torch.randint(1, VOCAB, (b,), generator=gen)  # every example attends to a non-padding position
    return Batch(x, torch.randint(0, CLASSES, (b,), generator=gen), torch.ones(b, dtype=torch.bool))


def _features(b=6, t=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, FEATURES, generator=gen, dtype=torch.float64)
    return Batch(x, torch.randint(0, CLASSES, (b,), generator=gen), torch.ones(b, dtype=torch.bool))


def _assert_ghost_is_reference(model, batch, clip=0.05):
    """DP-SGD's clipped sums of the converted model equal torch.func's per-example gradients of the unconverted one,
    clipped and summed (float64); the attention and its out_proj are DP layers."""
    assert_ghost_is_reference(model, batch, clip)
    assert isinstance(model.attention, MultiheadAttention) and isinstance(model.attention.out_proj, Linear)


SELF_CASES = {
    "plain": {},
    "no-bias": dict(bias=False),
    "bias-kv": dict(add_bias_kv=True),
    "zero-attn": dict(add_zero_attn=True),
    "bias-kv-zero-attn-padding": dict(add_bias_kv=True, add_zero_attn=True, padding=True),
    "padding": dict(padding=True),
    "causal": dict(mask="causal"),
    "causal-padding": dict(mask="causal", padding=True),
    "causal-bool-weights": dict(mask="causal-bool", need_weights=True),
    "per-example-mask": dict(mask="per-example", add_zero_attn=True),
    "weights": dict(need_weights=True),
    "weights-per-head-bias-kv": dict(need_weights=True, average=False, add_bias_kv=True, padding=True),
    "wide": dict(dim=32),  # the in-projection's ghost norm (narrow: its per-example gradient)
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", list(SELF_CASES))
def test_self_attention_clipped_sums_equal_torch_func(case, batch_first):
    torch.manual_seed(0)
    model = SelfAttentionNet(batch_first, **SELF_CASES[case]).double()
    _assert_ghost_is_reference(model, _tokens())


CROSS_CASES = {
    "shared-kv": {},  # packed in_proj_weight: a query group and a key/value group
    "three-inputs": dict(shared=False),
    "kdim-vdim": dict(kdim=5, vdim=6, shared=False),  # q/k/v_proj_weight
    "kdim-shared": dict(kdim=5, vdim=5),
    "bias-kv-zero-attn-padding": dict(add_bias_kv=True, add_zero_attn=True, padding=True),
    "kdim-vdim-no-bias-padding": dict(kdim=5, vdim=6, shared=False, bias=False, padding=True),
    "wide": dict(dim=32, shared=False),
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", list(CROSS_CASES))
def test_cross_attention_clipped_sums_equal_torch_func(case, batch_first):
    torch.manual_seed(0)
    model = CrossAttentionNet(batch_first, **CROSS_CASES[case]).double()
    _assert_ghost_is_reference(model, _features())


@pytest.mark.parametrize(
    "frozen",
    [("in_proj_weight", "in_proj_bias"), ("out_proj.weight", "out_proj.bias"), ("in_proj_weight", "bias_k"),
     ("k_proj_weight", "in_proj_bias", "bias_v")],
)  # fmt: skip
def test_frozen_parameters_of_the_attention(frozen):
    """Any subset of the attention's parameters frozen (the out_proj alone trainable: the attention still runs its DP
    forward so that out_proj is called)."""
    torch.manual_seed(0)
    separate = "k_proj_weight" in frozen
    model = CrossAttentionNet(kdim=5 if separate else None, vdim=6 if separate else None, shared=False,
                              add_bias_kv=True).double()  # fmt: skip
    for name in frozen:
        model.attention.get_parameter(name).requires_grad_(False)
    _assert_ghost_is_reference(model, _features())


def _attention_norms(model, batch):
    """(the DP attention's per-example squared norms, the exact ones from torch.func) of its own parameters."""
    convert(model)
    run = ghost_backward(model, loss_fn, batch)
    (index,) = [i for i, layer in enumerate(run.layers) if layer is model.attention]
    bounds = model.attention.per_example_sq_norms(run.saved[index], run.grads_out[index])
    own = {id(p) for p in model.attention.dp_parameters()}
    grads = per_example_gradients(model, loss_fn, batch.x, batch.y)
    params = [p for p in model.parameters() if p.requires_grad]
    exact = sum(g.reshape(g.shape[0], -1).square().sum(1) for g, p in zip(grads, params, strict=True) if id(p) in own)
    return bounds, exact


@pytest.mark.parametrize("dim", [8, 32])
@pytest.mark.parametrize(
    ("net", "kwargs"),
    [(SelfAttentionNet, dict(add_bias_kv=True, padding=True)), (CrossAttentionNet, dict(add_bias_kv=True)),
     (CrossAttentionNet, dict(kdim=5, vdim=6, shared=False))],
)  # fmt: skip
def test_norm_bounds_are_upper_bounds_within_1e_9(net, kwargs, dim):
    """dim 32: the in-projection's certified ghost norms, rigorous upper bounds; dim 8: the norms of its per-example
    gradients, the very tensors the clipped sum adds (equal to torch.func's up to float64 rounding)."""
    torch.manual_seed(0)
    model = net(dim=dim, **kwargs).double()
    bounds, exact = _attention_norms(model, _tokens() if net is SelfAttentionNet else _features())
    if dim == 32:
        assert torch.all(bounds >= exact), (bounds - exact).min()
    else:
        torch.testing.assert_close(bounds, exact, rtol=1e-13, atol=0)
    assert torch.all(bounds - exact <= 1e-9 * exact), ((bounds - exact) / exact).max()


@pytest.mark.parametrize("batch_first", [True, False])
def test_jl_projections_equal_per_example_gradient_dot_tangent(batch_first):
    torch.manual_seed(0)
    model = convert(CrossAttentionNet(batch_first, shared=False, add_bias_kv=True, padding=True).double())
    batch = _features(b=7)
    r, seed, step = 5, 11, 2
    p, err, allowance = jl_projections(ghost_backward(model, loss_fn, batch), PrivacyKeys(seed), step, r, chunk=2)
    expected = projection_reference(model, per_example_gradients(model, loss_fn, batch.x, batch.y), seed, step, r)
    torch.testing.assert_close(p, expected, rtol=1e-10, atol=1e-12)
    assert torch.all(err < 1e-10) and torch.all(allowance > 0)


def test_jl_trains_the_attention():
    torch.manual_seed(0)
    model = SelfAttentionNet(add_bias_kv=True, padding=True)
    batch = _tokens(b=8)
    batch = Batch(batch.x, batch.y, batch.mask)
    variant = JL(0.5, 0.5, 0.1, 80, projections=4, reproducible_seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        variant.gradient(model, batch, step)
        for p in model.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all()
            p.data -= 0.1 * p.grad
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


ALL_OPTIONS = [
    dict(batch_first=True), dict(batch_first=False), dict(batch_first=True, add_bias_kv=True, add_zero_attn=True),
    dict(batch_first=True, kdim=5, vdim=6), dict(batch_first=False, bias=False, dropout=0.3),
]  # fmt: skip


@pytest.mark.parametrize("options", ALL_OPTIONS)
def test_outside_a_dp_step_it_is_torchs_module(options):
    """Converted: the same state_dict (keys, tensors, storage), isinstance, and bitwise the outputs of torch's module
    (training mode with the same dropout draws; eval mode under no_grad, torch's fast path where it applies)."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, HEADS, **options)
    twin = copy.deepcopy(attention)
    state = {k: (v.clone(), v.data_ptr()) for k, v in attention.state_dict().items()}
    model = convert(nn.Sequential(attention))
    assert isinstance(attention, nn.MultiheadAttention) and isinstance(attention, MultiheadAttention)
    after = attention.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], v) and after[k].data_ptr() == ptr for k, (v, ptr) in state.items())
    assert validate(model) == []
    first = 0 if options["batch_first"] else 1
    shape = [4, 4]
    shape[first] = 3
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(*shape, 8, generator=gen)
    key = torch.randn(*shape[:2], options.get("kdim", 8), generator=gen)
    value = torch.randn(*shape[:2], options.get("vdim", 8), generator=gen)
    padding = torch.zeros(3, 4, dtype=torch.bool)
    padding[:, -1] = True
    args = (query, query, query) if "kdim" not in options else (query, key, value)
    for kwargs in ({}, dict(need_weights=False), dict(key_padding_mask=padding, average_attn_weights=False)):
        for train in (True, False):
            attention.train(train), twin.train(train)
            with torch.no_grad() if not train else torch.enable_grad():
                torch.manual_seed(5)
                got = attention(*args, **kwargs)
                torch.manual_seed(5)
                expected = twin(*args, **kwargs)
            for g, e in zip(got, expected, strict=True):
                assert (g is None and e is None) or torch.equal(g, e)


def test_converted_attention_pickles_and_deepcopies_as_itself():
    torch.manual_seed(0)
    model = convert(SelfAttentionNet(add_bias_kv=True))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = _tokens().x
    for clone in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert type(clone.attention) is MultiheadAttention and isinstance(clone.attention.out_proj, Linear)
        torch.testing.assert_close(clone(x), model(x))


def test_an_empty_batch_gives_zero_sums():
    torch.manual_seed(0)
    model = convert(CrossAttentionNet(shared=False, add_bias_kv=True).double())
    sums, _ = ghost_clipped_gradient_sum(model, loss_fn, _features(b=0), 0.05)
    run = ghost_backward(model, loss_fn, _features(b=0))  # the front door's empty Poisson batches run the layers
    (index,) = [i for i, layer in enumerate(run.layers) if layer is model.attention]
    saved, grad_out = run.saved[index], run.grads_out[index]
    assert model.attention.per_example_sq_norms(saved, grad_out).shape == (0,)
    empty = model.attention.clipped_grad_sums(saved, grad_out, torch.zeros(0, dtype=torch.float64))
    for s, p in zip([*sums, *empty], [*model.parameters(), *model.attention.dp_parameters()], strict=True):
        assert s.shape == p.shape and not s.any()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_inside_a_dp_step_the_outputs_and_weights_are_torchs(batch_first, need_weights):
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, HEADS, batch_first=batch_first, add_bias_kv=True).double()
    twin = copy.deepcopy(attention)
    convert(attention)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    for kwargs in (dict(need_weights=need_weights), dict(need_weights=need_weights, average_attn_weights=False,
                                                         attn_mask=mask, is_causal=True)):  # fmt: skip
        with GhostClipping() as ctx:
            got = attention(x, x, x, **kwargs)
        assert [r.layer for r in ctx.records] == [attention, attention.out_proj]
        assert all(r.shape[0] == 3 for r in ctx.records)  # batch-first records whatever batch_first says
        expected = twin(x, x, x, **kwargs)
        for g, e in zip(got, expected, strict=True):
            assert (g is None and e is None) or (torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14) is None)


def test_forward_mode_ad_inside_a_dp_step_takes_the_math_path():
    """CPU's fused scaled_dot_product_attention has no forward derivative: under forward-mode AD the DP step's
    attention is the math formulation, whose tangent is torch's."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, HEADS, batch_first=True).double()
    twin = copy.deepcopy(attention)
    convert(attention)
    x, tangent = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    with GhostClipping(), fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        out = fwAD.unpack_dual(attention(dual, dual, dual, need_weights=False)[0])
    _, expected = torch.func.jvp(lambda t: twin(t, t, t, need_weights=True)[0], (x,), (tangent,))
    torch.testing.assert_close(out.tangent, expected, rtol=1e-12, atol=1e-14)


def test_refused_inside_a_dp_step_unbatched_inputs():
    attention = convert(nn.MultiheadAttention(8, HEADS))
    x = torch.randn(5, 8)
    attention(x, x, x)  # outside a step: torch's unbatched attention
    with GhostClipping(), pytest.raises(ValueError, match="batched 3-D inputs"):
        attention(x, x, x)


class OwnAttention(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        return super().forward(2 * query, key, value, **kwargs)


def test_a_subclass_overriding_forward_and_its_out_proj_stay_refused():
    model = nn.Sequential(OwnAttention(8, HEADS))
    with pytest.raises(UnsupportedLayerError) as raised:
        convert(model)
    message = str(raised.value)
    assert "0 (OwnAttention): a subclass of torch.nn.modules.activation.MultiheadAttention that overrides forward" in (
        message
    )
    assert "0.out_proj (NonDynamicallyQuantizableLinear)" in message
    assert not isinstance(model[0], DPLayer) and not isinstance(model[0].out_proj, DPLayer)
    assert [p.module for p in validate(model)] == ["0", "0.out_proj"]


class EncoderClassifier(nn.Module):
    """Token and position embeddings -> nn.TransformerEncoder (batch_first, key padding mask, optional causal mask)
    -> mean over positions -> Linear head."""

    def __init__(self, dim=16, layers=2, dropout=0.0, norm_first=False, causal=False, nested=False):
        super().__init__()
        self.causal = causal
        self.embed, self.position = nn.Embedding(VOCAB, dim), nn.Embedding(8, dim)
        layer = nn.TransformerEncoderLayer(dim, HEADS, 2 * dim, dropout, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        b, t = x.shape
        h = self.embed(x) + self.position(torch.arange(t).expand(b, t))
        mask, padding = None, x == 0
        if self.causal:  # float masks both (torch deprecates mixing bool and float)
            mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
            padding = h.new_zeros(b, t).masked_fill(padding, -torch.inf)
        h = self.encoder(h, mask=mask, src_key_padding_mask=padding, is_causal=self.causal)
        return self.head(h.mean(1))


@pytest.mark.parametrize("options", [{}, dict(norm_first=True), dict(causal=True)])
def test_transformer_encoder_clipped_sums_equal_torch_func(options):
    torch.manual_seed(0)
    model = EncoderClassifier(**options).double()
    reference = copy.deepcopy(model)
    batch = _tokens(b=5, t=6)
    expected, _ = clipped_gradient_sum(reference, loss_fn, batch, 0.1)
    convert(model)
    assert all(isinstance(layer.self_attn, MultiheadAttention) for layer in model.encoder.layers)
    sums, _ = ghost_clipped_gradient_sum(model, loss_fn, batch, 0.1)
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-13)


def test_transformer_encoder_eval_fast_paths_are_torchs():
    """Eval mode under no_grad: torch's fused encoder layer (torch._transformer_encoder_layer_fwd) and the encoder's
    nested-tensor path run for the converted model too, with the same outputs."""
    torch.manual_seed(0)
    model = EncoderClassifier(nested=True, dropout=0.1).eval()
    twin = copy.deepcopy(model)
    convert(model)
    x = _tokens(b=4, t=6).x
    x[:, -2:] = 0  # right padding: the nested-tensor path applies
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))
    model.train(), twin.train()
    torch.manual_seed(3)
    got = model(x)
    torch.manual_seed(3)
    assert torch.equal(got, twin(x))


def test_dpsgd_trains_a_transformer_encoder_with_dropout_and_the_row_probe_passes():
    torch.manual_seed(0)
    model = EncoderClassifier(dropout=0.2)
    batch = _tokens(b=8, t=6)
    variant = DPSGD(1.0, 0.5, 0.1, 80, reproducible_seed=3)
    for step in range(2):
        variant.gradient(model, batch, step)  # the row probe runs on the first batch of each shape
        for p in model.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all()
            p.data -= 0.1 * p.grad


def _front_door(model, x, y, **kwargs):
    """(private model, optimizer, criterion: the batch's mean cross-entropy, loader)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    return PrivacyEngine(accountant="rdp").make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                        noise_multiplier=0.8, max_grad_norm=0.5, reproducible_seed=7,
                                                        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
                                                        **kwargs)  # fmt: skip


def test_the_front_door_trains_a_transformer_encoder_as_the_variant_api():
    torch.manual_seed(0)
    model = EncoderClassifier()
    reference = copy.deepcopy(model)
    data = _tokens(b=40, t=6, seed=4)
    private, optimizer, criterion, _ = _front_door(model, data.x, data.y)
    xb, yb = data.x[:8], data.y[:8]
    before = [p.detach().clone() for p in private.parameters()]
    optimizer.zero_grad()
    criterion(private(xb), yb).backward()
    optimizer.step()
    derived = (7 * 0x9E3779B97F4A7C15 + 1) % 2**63  # the noise key the engine derives from reproducible_seed
    DPSGD(0.5, 0.8, 8 / 40, 40, reproducible_seed=derived).gradient(reference, Batch(xb, yb, torch.ones(8).bool()), 0)
    for b, p, r in zip(before, private.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(b - p.detach(), r.grad, rtol=1e-5, atol=1e-6)
    for _ in range(2):
        optimizer.zero_grad()
        criterion(private(xb), yb).backward()
        optimizer.step()
    assert optimizer.steps_taken == 3


class SequenceFirst(nn.Module):
    """Embedding -> (transpose) -> nn.MultiheadAttention(batch_first=False) -> mean -> head; ``wrong``: the
    batch-first tensor fed to the sequence-first attention (attention across the batch)."""

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong
        self.embed = nn.Embedding(VOCAB, 8)
        self.attention = nn.MultiheadAttention(8, HEADS)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        h = h if self.wrong else h.transpose(0, 1)
        out = self.attention(h, h, h, need_weights=False)[0]
        return self.head((out if self.wrong else out.transpose(0, 1)).mean(1))


def test_the_row_probe_accepts_a_sequence_first_attention_and_refuses_one_across_the_batch():
    torch.manual_seed(0)
    data = _tokens(b=40, t=8, seed=5)
    private, optimizer, criterion, _ = _front_door(SequenceFirst(), data.x, data.y)
    optimizer.zero_grad()
    criterion(private(data.x[:8]), data.y[:8]).backward()
    optimizer.step()
    private, optimizer, criterion, _ = _front_door(SequenceFirst(wrong=True), data.x, data.y)  # T = B = 8: shapes pass
    optimizer.zero_grad()
    criterion(private(data.x[:8]), data.y[:8]).backward()
    with pytest.raises(UnsupportedLayerError, match=r"attention \(MultiheadAttention\), input of shape"):
        optimizer.step()


def test_compiled_dpsgd_step_with_attention_matches_eager():
    """DPSGD.compile (aot_eager): the DP attention's forward (its tap a graph break, as every DP layer's) and its
    per-example work compile, with the eager step's gradients."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = SelfAttentionNet(add_bias_kv=True, padding=True)
    compiled = copy.deepcopy(eager)
    batch = _tokens(b=8)
    plain, fast = DPSGD(0.5, 0.5, 0.1, 80, reproducible_seed=1), DPSGD(0.5, 0.5, 0.1, 80, reproducible_seed=1)
    fast.compile(backend="aot_eager")
    for step in range(2):
        plain.gradient(eager, batch, step)
        fast.gradient(compiled, batch, step)
        for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    torch._dynamo.reset()


class Twice(nn.Module):
    """One attention applied twice (a weight-shared block): self-attention over the sequence, then cross-attention
    from its first positions to the sequence (or, ``kdim``, separate q/k/v weights); its parameters, out_proj's
    included, are used by two calls (``fastdp.nn.forms``)."""

    def __init__(self, kdim=None, **kw):
        super().__init__()
        self.inp = nn.Linear(FEATURES, 8)
        self.key_in = nn.Linear(FEATURES, kdim or 8)
        self.attention = nn.MultiheadAttention(8, HEADS, batch_first=True, kdim=kdim, vdim=kdim, **kw)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h, k = self.inp(x), self.key_in(x)
        packed = self.attention._qkv_same_embed_dim  # packed: self-attention then cross-attention to h; else to k
        kv = h if packed else k
        h = h + self.attention(h, kv, kv, need_weights=False)[0]
        kv = h if packed else k
        return self.head(self.attention(h[:, :2], kv, kv, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("kw", [{}, {"add_bias_kv": True}, {"kdim": 5}])
def test_an_attention_called_twice_equals_torch_func(kw, path, monkeypatch):
    import fastdp.nn.forms as forms

    monkeypatch.setattr(forms, "direct_is_cheaper", lambda uses, numel: path == "direct")
    torch.manual_seed(0)
    model = Twice(**kw).double()
    _assert_ghost_is_reference(model, _features())
