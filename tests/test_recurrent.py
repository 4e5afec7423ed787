"""DP recurrent layers (fastdp.nn.RNN, LSTM, GRU): clipped sums, per-example norms and JL projections against
per-example gradients of the unconverted torch module (float64), the fused backward through time against autograd
of the same recurrence, the torch module outside a DP step, forward-mode AD, the front door and the row probe.

The reference takes one example at a time through the torch module (``torch.func.vmap`` of ``nn.LSTM``'s aten
recurrence fails: its in-place ops do not batch)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

import fastdp
import fastdp.nn as dpnn
from fastdp import PrivacyEngine
from fastdp.algorithms import DPSGD, JL, Batch
from fastdp.algorithms.base import per_example_cross_entropy as loss_fn
from fastdp.algorithms.dpsgd import ghost_backward, ghost_clipped_gradient_sum
from fastdp.algorithms.jl import jl_projections
from fastdp.nn import GhostClipping, UnsupportedLayerError, convert
from fastdp.nn.recurrent import GATES, _extension, _Recurrence, _reference_recurrence
from fastdp.privacy.rng import PrivacyKeys
from tests.variants import projection_reference

KINDS = {
    "lstm": (nn.LSTM, {}),
    "lstm-proj": (nn.LSTM, {"proj_size": 3}),
    "gru": (nn.GRU, {}),
    "rnn-tanh": (nn.RNN, {}),
    "rnn-relu": (nn.RNN, {"nonlinearity": "relu"}),
}
# (num_layers, bidirectional, batch_first, bias, initial state from the input, PackedSequence input)
CONFIGS = {
    "1-layer": (1, False, True, True, False, False),
    "2-layer-bidirectional-time-major-initial-state": (2, True, False, True, True, False),
    "2-layer-no-bias-initial-state": (2, False, True, False, True, False),
    "bidirectional": (1, True, True, True, False, False),
    "2-layer-bidirectional-packed-initial-state": (2, True, True, True, True, True),
}


@pytest.fixture(params=["extension", "torch"])
def loops(request):
    """The recurrences' time loops: fastdp._C's (csrc/cpu/recurrence_loop.cpp, the default where it is built) or the
    torch loops of fastdp.nn.recurrent (FASTDP_BACKEND=torch, or no extension)."""
    previous = fastdp.get_backend()
    if request.param == "torch":
        fastdp.set_backend("torch")
    elif _extension(torch.zeros(1)) is None:
        if os.environ.get("FASTDP_REQUIRE_EXT") == "1":
            pytest.fail("fastdp._C with the recurrence kernels must be built for this run")
        pytest.skip("fastdp._C with the recurrence kernels is not built")
    yield request.param
    fastdp.set_backend(previous)


class Net(nn.Module):
    """A recurrent layer and a Linear head on its summed outputs, last hidden state (and last cell state). The
    input's last feature marks the valid positions (packed: the lengths); an initial state, from a Linear of the
    first position, makes the gradient flow into h0 (and a constant c0)."""

    def __init__(self, kind, kw, layers=1, bidirectional=False, batch_first=True, bias=True, init=False,
                 packed=False, d=3, hidden=4):  # fmt: skip
        super().__init__()
        self.rnn = kind(d, hidden, num_layers=layers, bias=bias, batch_first=batch_first,
                        bidirectional=bidirectional, **kw)  # fmt: skip
        directions = 2 if bidirectional else 1
        self.out_size = kw.get("proj_size", 0) or hidden
        self.init = nn.Linear(d, layers * directions * self.out_size) if init else None
        self.lstm, self.packed, self.d = kind is nn.LSTM, packed, d
        self.head = nn.Linear((directions + 1) * self.out_size + (hidden if self.lstm else 0), 3)

    def forward(self, x):
        b = x.shape[0]
        hx = None
        if self.init is not None:
            h0 = torch.tanh(self.init(x[:, 0, : self.d])).reshape(b, -1, self.out_size).transpose(0, 1)
            hx = (h0, torch.full((h0.shape[0], b, self.rnn.hidden_size), 0.3, dtype=x.dtype)) if self.lstm else h0
        seq = x[:, :, : self.d]
        if self.packed:
            lengths = (x[:, :, self.d] > 0).sum(1).cpu()
            out, state = self.rnn(pack_padded_sequence(seq, lengths, batch_first=True, enforce_sorted=False), hx)
            out = pad_packed_sequence(out, batch_first=True)[0]
        else:
            out, state = self.rnn(seq if self.rnn.batch_first else seq.transpose(0, 1), hx)
            out = out if self.rnn.batch_first else out.transpose(0, 1)
        h = state[0] if self.lstm else state
        return self.head(torch.cat([out.sum(1), h[-1]] + ([state[1][0]] if self.lstm else []), 1))


def _data(b=5, t=6, d=3, lengths=(6, 2, 4, 1, 6), seed=1, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d + 1, generator=gen, dtype=dtype)
    x[:, :, d] = (torch.arange(t).unsqueeze(0) < torch.tensor(lengths[:b]).unsqueeze(1)).to(dtype)
    return Batch(x, torch.randint(0, 3, (b,), generator=gen), torch.ones(b, dtype=torch.bool))


def _model(kind, config="1-layer", proj_size=None, **kwargs):
    torch.manual_seed(0)
    cls, kw = KINDS[kind]
    kw = kw if proj_size is None or "proj_size" not in kw else {"proj_size": proj_size}
    layers, bidirectional, batch_first, bias, init, packed = CONFIGS[config]
    return Net(cls, kw, layers, bidirectional, batch_first, bias, init, packed, **kwargs).double()


def _per_example_gradients(model, batch):
    """One example at a time through ``model`` (the unconverted torch modules): [B, *p.shape] per trainable p."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(loss_fn(model(batch.x[i : i + 1]), batch.y[i : i + 1]).sum(), params)
            for i in range(batch.x.shape[0])]  # fmt: skip
    return [torch.stack(g) for g in zip(*rows, strict=True)]


def _clipped_reference(model, batch, clip):
    """sum_i min(1, C / (||g_i|| + 1e-6)) g_i per parameter, as DP-SGD clips."""
    grads = _per_example_gradients(model, batch)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in grads).sqrt()
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return [torch.einsum("b,b...->...", factors, g) for g in grads]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", KINDS)
def test_clipped_sums_equal_clipped_per_example_gradients(kind, config, loops):
    model = _model(kind, config)
    batch = _data()
    expected = _clipped_reference(copy.deepcopy(model), batch, 0.05)
    convert(model)
    assert isinstance(model.rnn, dpnn.DPLayer) and isinstance(model.rnn, KINDS[kind][0])
    sums, _ = ghost_clipped_gradient_sum(model, loss_fn, batch, 0.05)
    for s, e, (name, p) in zip(sums, expected, model.named_parameters(), strict=True):
        assert s.shape == p.shape
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-13, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("config", ["2-layer-bidirectional-time-major-initial-state",
                                    "2-layer-bidirectional-packed-initial-state"])  # fmt: skip
@pytest.mark.parametrize("kind", KINDS)
def test_float32_clipped_sums_of_the_extension_equal_the_torch_loops(kind, config, restore_backend):
    """float32 (the extension's vectorised gates, oneDNN's step GEMMs and input projections where torch has them,
    their input gradients between the layers) against the torch loops."""
    if _extension(torch.zeros(1)) is None:
        pytest.skip("fastdp._C with the recurrence kernels is not built")
    model = convert(_model(kind, config).float())
    batch = _data(dtype=torch.float32)
    sums = {}
    for backend in ("auto", "torch"):
        fastdp.set_backend(backend)
        sums[backend], _ = ghost_clipped_gradient_sum(model, loss_fn, batch, 0.05)
    for s, e, (name, _) in zip(sums["auto"], sums["torch"], model.named_parameters(), strict=True):
        torch.testing.assert_close(s, e, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["lstm", "lstm-proj", "gru"])
def test_frozen_weights_of_a_recurrent_layer_are_left_out(kind):
    model = _model(kind, "2-layer-bidirectional-time-major-initial-state")
    for name in ("weight_hh_l0", "bias_ih_l1_reverse", "weight_ih_l1"):
        getattr(model.rnn, name).requires_grad_(False)
    batch = _data()
    expected = _clipped_reference(copy.deepcopy(model), batch, 0.05)
    convert(model)
    sums, _ = ghost_clipped_gradient_sum(model, loss_fn, batch, 0.05)
    assert len(sums) == len(expected) == sum(p.requires_grad for p in model.parameters())
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-13)


CELLS = [("LSTM", 0, True), ("LSTM", 3, True), ("GRU", 0, True), ("GRU", 0, False), ("RNN_TANH", 0, True),
         ("RNN_RELU", 0, True)]  # fmt: skip


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("mode", "proj", "bias"), CELLS)
def test_fused_backward_through_time_equals_autograd_of_the_recurrence(mode, proj, bias, reverse, masked, loops):
    """Outputs, the carrier's gradient (the G's), the input projections' and the initial states' gradients, with
    either time loops."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    b, t, hsz = 3, 5, 4
    gates, out_size = GATES[mode] * hsz, proj or hsz
    width = {"LSTM": gates + proj, "GRU": 2 * gates}.get(mode, gates)
    gates_x, h0 = randn(t, b, gates).requires_grad_(), randn(b, out_size).requires_grad_()  # time-major
    c0 = randn(b, hsz).requires_grad_() if mode == "LSTM" else None
    w_hh, b_hh = randn(gates, out_size) * 0.5, randn(gates) if mode == "GRU" and bias else None
    w_hr = randn(proj, hsz) if proj else None
    mask = torch.arange(t).unsqueeze(1) < torch.tensor([5, 2, 3]).unsqueeze(0) if masked else None
    weights = randn(t, b, out_size)
    assert (_extension(gates_x) is not None) == (loops == "extension")
    results = []
    for run in (_Recurrence.apply, _reference_recurrence):
        carrier = torch.zeros(b, t, width, dtype=torch.float64, requires_grad=True)
        out, h, c, before, m = run(mode, reverse, gates_x, carrier, h0, c0, w_hh, b_hh, w_hr, mask)
        loss = (out * weights).sum() + h.square().sum() + (c.sin().sum() if c is not None else 0)
        inputs = [gates_x, carrier, h0] + ([c0] if c0 is not None else [])
        results.append([out, h, c, before, m, *torch.autograd.grad(loss, inputs)])
    for fused, reference in zip(*results, strict=True):
        assert (fused is None) == (reference is None)
        if fused is not None:
            torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", KINDS)
def test_per_example_norms_bound_the_exact_norms_and_are_within_1e_9(kind):
    """Input width 16, hidden size 24 (projected to 16) over 4 positions: every weight takes the certified ghost norm
    (no per-example gradient cached); no bias, so every term is a rigorous bound, which must not be below the exact
    norm."""
    model = _model(kind, "2-layer-no-bias-initial-state", proj_size=16, d=16, hidden=24)
    batch = _data(t=4, d=16, lengths=(4, 4, 4, 4, 4))
    grads = _per_example_gradients(copy.deepcopy(model), batch)
    names = [n for n, _ in model.named_parameters()]
    exact = sum(g.flatten(1).pow(2).sum(1) for n, g in zip(names, grads, strict=True) if n.startswith("rnn."))
    convert(model)
    run = ghost_backward(model, loss_fn, batch)
    (index,) = [i for i, layer in enumerate(run.layers) if layer is model.rnn]
    cache = {}
    bound = model.rnn.per_example_sq_norms(run.saved[index], run.grads_out[index], cache)
    assert not cache  # the Gram path: nothing summed as-is
    assert torch.all(bound >= exact), (bound - exact) / exact
    torch.testing.assert_close(bound, exact, rtol=1e-9, atol=0)


def test_the_norm_of_a_cached_per_example_gradient_is_that_of_the_tensor_summed():
    model = _model("lstm", "bidirectional")
    batch = _data()
    convert(model)
    run = ghost_backward(model, loss_fn, batch)
    (index,) = [i for i, layer in enumerate(run.layers) if layer is model.rnn]
    cache = {}
    sq = model.rnn.per_example_sq_norms(run.saved[index], run.grads_out[index], cache)
    assert sorted(cache) == ["bias0", "bias1", "weight0", "weight1"]  # per direction: [W_ih | W_hh], b_ih = b_hh
    summed = sum((1 if k.startswith("weight") else 2) * v.flatten(1).pow(2).sum(1) for k, v in cache.items())
    assert torch.all(sq >= summed)  # rounded up (fastdp.ops.summation.sq_norms_up), by at most gamma_n
    torch.testing.assert_close(sq, summed, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_outside_a_step_the_converted_module_is_the_torch_module(kind, batch_first):
    cls, kw = KINDS[kind]
    torch.manual_seed(0)
    module = cls(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first, **kw)
    reference = copy.deepcopy(module)
    keys = list(module.state_dict())
    convert(module)
    assert type(module).__name__ == cls.__name__ and isinstance(module, cls) and isinstance(module, dpnn.DPLayer)
    assert list(module.state_dict()) == keys
    x = torch.randn(5, 6, 3) if batch_first else torch.randn(6, 5, 3)
    got, expected = module(x), reference(x)
    assert torch.equal(got[0], expected[0])
    for g, e in zip(*(s if isinstance(s, tuple) else (s,) for s in (got[1], expected[1])), strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("kind", ["lstm-proj", "gru", "rnn-relu"])
def test_inside_a_step_the_outputs_are_the_torch_modules_and_forward_mode_ad_works(kind):
    cls, kw = KINDS[kind]
    torch.manual_seed(0)
    module = cls(3, 4, num_layers=2, bidirectional=True, **kw).double()
    reference = copy.deepcopy(module)
    convert(module)
    x, tangent = torch.randn(6, 5, 3, dtype=torch.float64), torch.randn(6, 5, 3, dtype=torch.float64)
    expected, expected_tangent = torch.func.jvp(lambda x: reference(x)[0], (x,), (tangent,))
    with GhostClipping() as ctx:
        out, state = module(x)
    with GhostClipping() as ctx_ad, fwAD.dual_level():
        dual = fwAD.unpack_dual(module(fwAD.make_dual(x, tangent))[0])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dual.primal, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dual.tangent, expected_tangent, rtol=1e-12, atol=1e-14)
    width = {"lstm-proj": 4 * 4 + 3, "gru": 2 * 3 * 4, "rnn-relu": 4}[kind]
    assert [r.shape for r in ctx.records + ctx_ad.records] == [(5, 6, 4, width)] * 2  # [B, T, L * D, width]


@pytest.mark.parametrize(("kind", "sequence"), [("lstm", False), ("lstm-proj", True), ("gru", True)])
def test_jl_projections_equal_per_example_gradient_dot_tangent(kind, sequence):
    config = "2-layer-bidirectional-packed-initial-state" if sequence else "1-layer"
    model = _model(kind, config)
    batch = _data(b=4)
    grads = _per_example_gradients(copy.deepcopy(model), batch)
    convert(model)
    r, seed, step = 5, 11, 2
    p, err, allowance = jl_projections(ghost_backward(model, loss_fn, batch), PrivacyKeys(seed), step, r, chunk=2)
    expected = projection_reference(model, grads, seed, step, r)
    torch.testing.assert_close(p, expected, rtol=1e-10, atol=1e-12)
    assert torch.all(err < 1e-10) and torch.all(allowance > 0)
    JL(0.5, 1.0, 0.1, 40, projections=4, reproducible_seed=1).gradient(model, batch, 0)
    assert all(torch.isfinite(q.grad).all() for q in model.parameters())


class Tokens(nn.Module):
    """Embedding -> recurrent layer (time-major unless ``batch_first``) -> Linear on the last hidden state."""

    def __init__(self, kind=nn.LSTM, batch_first=True, **kw):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8), nn.Linear(16, 3)
        self.rnn = kind(8, 16, batch_first=batch_first, **kw)

    def forward(self, idx):
        e = self.emb(idx)
        out, state = self.rnn(e if self.rnn.batch_first else e.transpose(0, 1))
        return self.head((state[0] if isinstance(state, tuple) else state)[-1])


@pytest.mark.parametrize(("kind", "batch_first"), [(nn.LSTM, True), (nn.LSTM, False), (nn.GRU, False)])
def test_the_front_door_trains_a_recurrent_model(kind, batch_first):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 10, (48, 12), generator=gen), torch.randint(0, 3, (48,), generator=gen)
    model = Tokens(kind, batch_first, num_layers=2, dropout=0.2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, criterion, loader = engine.make_private(module=model, optimizer=opt,
                                                        data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
                                                        noise_multiplier=1.0, max_grad_norm=1.0, reproducible_seed=3,
                                                        criterion=nn.CrossEntropyLoss(),
                                                        grad_sample_mode="ghost")  # fmt: skip
    for xb, yb in loader:
        opt.zero_grad()
        criterion(model(xb), yb).backward()  # the batch's mean cross-entropy (fastdp.engine.DPLoss)
        opt.step()
    assert opt.steps_taken == len(loader) and engine.get_epsilon(1e-5) > 0
    assert all(torch.isfinite(p).all() and not torch.equal(p.detach(), b)
               for p, b in zip(model.parameters(), before, strict=True))  # fmt: skip


def test_the_row_probe_refuses_batch_first_data_given_to_a_time_major_recurrent_layer():
    """[B, T] tokens with B == T into an LSTM without batch_first: every shape check passes, but the recurrence runs
    over the examples; the probe sees each of the layer's (batch-first) input rows change with one example."""
    torch.manual_seed(0)

    class Misused(Tokens):
        def forward(self, idx):
            return self.head(self.rnn(self.emb(idx))[1][0][-1])

    model = Misused(batch_first=False)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 10, (8, 8), generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, criterion, loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    opt.zero_grad()
    criterion(model(x), y).backward()  # the loss the mean's check accepts: the step reaches the row probe
    with pytest.raises(UnsupportedLayerError, match=r"rnn \(LSTM\), input of shape \(8, 8, 8\)"):
        opt.step()


def test_bf16_autocast_trains_with_the_recurrence_in_the_parameters_dtype():
    """Under autocast the layer runs in float32 (autocast off inside): its G, A and norms are float32."""
    torch.manual_seed(0)
    model = Tokens(nn.LSTM, num_layers=2)
    variant = DPSGD(1.0, 1.0, 0.1, 160, reproducible_seed=1)
    variant.set_precision("bf16")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 10, (16, 7), generator=gen), torch.randint(0, 3, (16,), generator=gen)
    variant.gradient(model, Batch(x, y, torch.ones(16, dtype=torch.bool)), 0)
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16), GhostClipping() as ctx:
        model(x)
    (record,) = [r for r in ctx.records if r.layer is model.rnn]
    assert record.dtype == torch.float32 and all(a.dtype == torch.float32 for a in record.saved)


def test_an_extension_without_the_recurrence_kernels_runs_the_torch_loops_once_warned(monkeypatch, restore_backend):
    import fastdp.nn.recurrent as recurrent

    class Stale:  # fastdp._C built before the recurrence kernels
        pass

    monkeypatch.setattr(recurrent._ext, "_C", Stale())
    monkeypatch.setattr(recurrent, "_STALE_EXTENSION_WARNED", False)
    monkeypatch.setattr(recurrent._backend, "available", lambda backend, device: (True, "stale build"))
    fastdp.set_backend("cuda")
    with pytest.warns(RuntimeWarning, match="built without the recurrence kernels") as caught:
        assert _extension(torch.zeros(1)) is None
        assert _extension(torch.zeros(1)) is None
    assert len(caught) == 1


def test_refusals():
    model = convert(nn.LSTM(3, 4))
    with GhostClipping(), pytest.raises(ValueError, match="a DP step needs a batch of sequences"):
        model(torch.randn(5, 3))
    cell = nn.Sequential(nn.LSTMCell(3, 4))
    with pytest.raises(UnsupportedLayerError, match=r"0 \(LSTMCell\): use nn.LSTM over the whole sequence"):
        convert(cell)
    tied = nn.LSTM(4, 4, num_layers=2)
    tied.weight_hh_l1 = tied.weight_hh_l0
    convert(tied)
    with GhostClipping(), pytest.raises(ValueError, match="registered under two names"):
        tied(torch.randn(3, 2, 4))


class Twice(nn.Module):
    """One recurrent layer called on two sequences (an encoder shared by two inputs): its parameters are used by two
    layer calls, so each example's gradient sums both (``fastdp.nn.forms``)."""

    def __init__(self, kind, kw, d=3, hidden=4):
        super().__init__()
        self.rnn = kind(d, hidden, batch_first=True, **kw)
        self.head = nn.Linear(2 * (kw.get("proj_size", 0) or hidden), 3)

    def forward(self, x):
        first, second = x[:, :, :3], x[:, :, 1:].flip(1)
        return self.head(torch.cat([self.rnn(first)[0].sum(1), self.rnn(second)[0][:, -1]], 1))


@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("kind", ["lstm", "lstm-proj", "gru", "rnn-tanh"])
def test_a_recurrent_layer_called_twice_equals_clipped_per_example_gradients(kind, path, monkeypatch):
    import fastdp.nn.forms as forms

    monkeypatch.setattr(forms, "direct_is_cheaper", lambda uses, numel: path == "direct")
    torch.manual_seed(0)
    cls, kw = KINDS[kind]
    model = Twice(cls, kw).double()
    batch = _data()
    expected = _clipped_reference(copy.deepcopy(model), batch, 0.05)
    sums, _ = ghost_clipped_gradient_sum(convert(model), loss_fn, batch, 0.05)
    for s, e, (name, p) in zip(sums, expected, model.named_parameters(), strict=True):
        assert s.shape == p.shape
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-13, msg=lambda m, name=name: f"{name}: {m}")


class _Stacked(nn.Module):
    """A 2-layer ``kind`` with dropout between the layers (batch-first), its per-example reference: the same weights
    as two 1-layer modules with a fixed dropout mask applied between them by hand."""

    def __init__(self, cls, kw, mask, p):
        super().__init__()
        self.rnn = cls(3, 4, num_layers=2, batch_first=True, dropout=p, **kw)
        self.head = nn.Linear(self.rnn.proj_size or 4, 3)
        self.mask, self.p = mask, p  # mask [T, B, H_out] (time-major, as fastdp's layers apply it)

    def forward(self, x):
        return self.head(self.rnn(x)[0].sum(1))

    def reference(self, x, rows):
        """The output for the examples ``rows`` of the batch, the mask applied between the two layers by hand."""
        rnn = self.rnn
        kw = {"proj_size": rnn.proj_size} if rnn.proj_size else {}
        if isinstance(rnn, nn.RNN):
            kw["nonlinearity"] = rnn.nonlinearity
        first = type(rnn)(3, 4, batch_first=True, **kw)
        second = type(rnn)(rnn.proj_size or 4, 4, batch_first=True, **kw)
        for k, layer in enumerate((first, second)):
            for name in list(layer._parameters):
                del layer._parameters[name]
                setattr(layer, name, getattr(self.rnn, name.replace("_l0", f"_l{k}")))
        hidden = first(x)[0] * self.mask[:, rows].transpose(0, 1) / (1 - self.p)
        return self.head(second(hidden)[0].sum(1))


@pytest.mark.parametrize("kind", ["lstm", "lstm-proj", "gru", "rnn-relu"])
def test_dropout_between_layers_equals_clipped_per_example_gradients_with_the_same_mask(kind, loops, monkeypatch):
    """``dropout`` between the layers of a converted recurrent module, training mode: the clipped sums are those of
    the per-example gradients of the same function, dropout mask included (its rows are the examples' own)."""
    cls, kw = KINDS[kind]
    b, t, p = 5, 6, 0.4
    gen = torch.Generator().manual_seed(7)
    out_size = kw.get("proj_size", 4)
    mask = (torch.rand(t, b, out_size, generator=gen) > p).double()
    torch.manual_seed(0)
    model = _Stacked(cls, kw, mask, p).double().train()
    x = torch.randn(b, t, 3, generator=gen, dtype=torch.float64)
    batch = Batch(x, torch.randint(0, 3, (b,), generator=gen), torch.ones(b, dtype=torch.bool))
    params = [prm for prm in model.parameters()]
    rows = [torch.autograd.grad(loss_fn(model.reference(x[i : i + 1], [i]), batch.y[i : i + 1]).sum(), params)
            for i in range(b)]  # fmt: skip
    grads = [torch.stack(g) for g in zip(*rows, strict=True)]
    norms = sum(g.flatten(1).pow(2).sum(1) for g in grads).sqrt()
    factors = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    expected = [torch.einsum("b,b...->...", factors, g) for g in grads]

    def fixed_dropout(input, p_, training=True, inplace=False):
        assert p_ == p and training and input.shape == mask.shape
        return input * mask / (1 - p)

    monkeypatch.setattr(torch.nn.functional, "dropout", fixed_dropout)
    convert(model)
    sums, _ = ghost_clipped_gradient_sum(model, loss_fn, batch, 0.05)
    assert (factors < 1).any()
    for s, e, (name, _) in zip(sums, expected, model.named_parameters(), strict=True):
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-13, msg=lambda m, name=name: f"{name}: {m}")
