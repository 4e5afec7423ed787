"""fastdp._C's recurrence time loops (csrc/cpu/recurrence.cpp, recurrence_loop.cpp) against the torch loops of
fastdp.nn.recurrent they replace: LSTM (with and without proj_size), GRU (with and without b_hh), tanh and relu RNN;
forward and reverse directions; with and without a PackedSequence mask; float32 and float64; hidden sizes that are no
multiple of the kernels' 16, 8 or 4 lanes; strided inputs (one direction's slice of both directions' input
projections); every float ISA this CPU runs, and both step GEMMs (oneDNN's and at::mm). Then the float gate math
against float64 (sigmoid, tanh, relu; NaN and inf), the argument checks, and which path fastdp.nn's layers take."""

from __future__ import annotations

import math
import os

import pytest
import torch

import fastdp
from fastdp import _ext
from fastdp.nn import recurrent as R

C = _ext._C
if C is None or not hasattr(C, "lstm_forward"):
    if os.environ.get("FASTDP_REQUIRE_EXT") == "1":
        raise RuntimeError(f"fastdp._C must be built with the recurrence kernels for this run ({_ext.LOAD_ERROR})")
    pytest.skip("fastdp._C (with the recurrence kernels) is not built", allow_module_level=True)

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}
SHAPES = [(3, 5, 17), (1, 1, 1), (4, 6, 33), (2, 3, 8)]  # (B, T, H)
CELLS = [("LSTM", 0, True), ("LSTM", 3, True), ("GRU", 0, True), ("GRU", 0, False), ("RNN_TANH", 0, True),
         ("RNN_RELU", 0, True)]  # fmt: skip


ISAS = ["avx512", "avx2", "baseline"]


def _set_isa(name: str) -> None:
    """Run the float kernels of ``name`` ("" for the CPU's best); skips the test where this CPU cannot."""
    if not C.set_recurrence_isa(name):
        pytest.skip(f"this CPU cannot run the {name} kernels")


@pytest.fixture(params=ISAS)
def isa(request):
    """The float kernels of one ISA; restores the CPU's best."""
    _set_isa(request.param)
    yield request.param
    assert C.set_recurrence_isa("")


@pytest.fixture(params=[(torch.float64, "", "")] + [(torch.float32, name, "") for name in ISAS]
                + [(torch.float32, "", "aten")],
                ids=["float64"] + [f"float32-{name}" for name in ISAS] + ["float32-aten-gemm"])  # fmt: skip
def dtype(request):
    """float64 (one kernel: std::exp, std::tanh; at::mm), or float32 with the kernels of one ISA and the default
    step GEMM (oneDNN's where torch has it), or with at::mm's."""
    dtype, name, gemm = request.param
    _set_isa(name)
    assert C.set_recurrence_gemm(gemm)
    yield dtype
    assert C.set_recurrence_isa("") and C.set_recurrence_gemm("")


def _inputs(mode, proj, bias, b, t, hsz, dtype, masked, strided, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=dtype) * scale

    gates = R.GATES[mode] * hsz
    out_size = proj or hsz
    # one direction's slice of both directions' projections (as _layers passes them), or a contiguous tensor
    gx = randn(t, b, 2 * gates, scale=1.5)[..., gates:] if strided else randn(t, b, gates, scale=1.5)
    h0 = randn(b, out_size)
    c0 = randn(b, hsz) if mode == "LSTM" else None
    w_hh = randn(gates, out_size, scale=1.5 / math.sqrt(out_size))
    b_hh = randn(gates) if mode == "GRU" and bias else None
    w_hr = randn(proj, hsz, scale=1 / math.sqrt(hsz)) if proj else None
    lengths = torch.tensor([t, 1, max(1, t - 2), max(1, t // 2)] * b)[:b]
    mask = torch.arange(t).unsqueeze(1) < lengths.unsqueeze(0) if masked else None
    d_out = randn(t, b, 2 * out_size)[..., :out_size] if strided else randn(t, b, out_size)
    d_h = randn(b, out_size)
    d_c = randn(b, hsz) if mode == "LSTM" else None
    return gx, h0, c0, w_hh, b_hh, w_hr, mask, d_out, d_h, d_c


def _torch_loops(mode, reverse, gx, h0, c0, w_hh, b_hh, w_hr, mask, d_out, d_h, d_c):
    """(forward results, backward results) of fastdp.nn.recurrent's torch loops, in the extension's order."""
    if mode == "LSTM":
        states, kept = R._lstm_forward(reverse, gx, h0, c0, w_hh, w_hr, mask)
        acts, cs, tanh_c, ms = kept[:4]
        grad, _, dh0, dc0 = R._lstm_backward(reverse, d_out, d_h, d_c, *kept)
        return [states, cs, acts, tanh_c, ms], [grad, dh0, dc0], kept
    if mode == "GRU":
        states, kept = R._gru_forward(reverse, gx, h0, w_hh, b_hh, mask)
        grad, _, dh0, _ = R._gru_backward(reverse, d_out, d_h, *kept)
        return [states, *kept[:3]], [grad, dh0], kept
    states, kept = R._rnn_forward(reverse, gx, h0, w_hh, mode == "RNN_RELU", mask)
    grad, _, dh0, _ = R._rnn_backward(reverse, mode == "RNN_RELU", d_out, d_h, *kept)
    return [states], [grad, dh0], kept


def _extension(mode, reverse, gx, h0, c0, w_hh, b_hh, w_hr, mask, d_out, d_h, d_c, kept):
    """The extension's forward from the same inputs, and its backward from the torch loops' saved tensors (each
    half compared on its own)."""
    relu = mode == "RNN_RELU"
    if mode == "LSTM":
        forward = C.lstm_forward(gx, h0, c0, w_hh, w_hr, mask, reverse)
        backward = C.lstm_backward(d_out, d_h, d_c, *kept, reverse)
    elif mode == "GRU":
        forward = C.gru_forward(gx, h0, w_hh, b_hh, mask, reverse)
        backward = C.gru_backward(d_out, d_h, *kept, reverse)
    else:
        forward = C.rnn_forward(gx, h0, w_hh, relu, mask, reverse)
        backward = C.rnn_backward(d_out, d_h, kept[0], w_hh, relu, mask, reverse)
    return forward, [backward[0].transpose(0, 1), *backward[1:]]  # the carrier's gradient batch-first


NAMES = {"LSTM": (["states", "cs", "acts", "tanh_c", "ms"], ["grad", "d_h0", "d_c0"]),
         "GRU": (["states", "rz", "ns", "gh_n"], ["grad", "d_h0"])}  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-H{}".format(*s))
@pytest.mark.parametrize(("masked", "strided"), [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "masked", "strided", "masked-strided"])  # fmt: skip
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize(("mode", "proj", "bias"), CELLS, ids=lambda v: str(v))
def test_time_loops_equal_the_torch_loops(mode, proj, bias, reverse, masked, strided, shape, dtype):
    b, t, hsz = shape
    args = _inputs(mode, proj, bias, b, t, hsz, dtype, masked, strided)
    expected_fwd, expected_bwd, kept = _torch_loops(mode, reverse, *args)
    got_fwd, got_bwd = _extension(mode, reverse, *args, kept)
    names_fwd, names_bwd = NAMES.get(mode, (["states"], ["grad", "d_h0"]))
    assert len(got_fwd) == len(expected_fwd) and len(got_bwd) == len(expected_bwd)
    for name, got, expected in zip(names_fwd + names_bwd, got_fwd + got_bwd, expected_fwd + expected_bwd, strict=True):
        assert (got is None) == (expected is None), name
        if expected is not None:
            contiguous = got.transpose(0, 1) if name == "grad" else got
            assert got.dtype == dtype and contiguous.is_contiguous(), name
            torch.testing.assert_close(got, expected, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("masked", "reverse"), [(False, False), (True, True)], ids=["plain", "masked-reverse"])
@pytest.mark.parametrize(("mode", "proj", "bias"), CELLS, ids=lambda v: str(v))
def test_steps_split_over_threads_by_rows(mode, proj, bias, masked, reverse, dtype, two_threads):
    """B 37 on two threads: each runs whole steps (GEMM and gates) on its own rows, 19 and 18 of them."""
    args = _inputs(mode, proj, bias, 37, 4, 9, dtype, masked, strided=True)
    expected_fwd, expected_bwd, kept = _torch_loops(mode, reverse, *args)
    got_fwd, got_bwd = _extension(mode, reverse, *args, kept)
    for got, expected in zip(got_fwd + got_bwd, expected_fwd + expected_bwd, strict=True):
        if expected is not None:
            torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN_TANH"])
def test_no_output_gradient_and_a_transposed_one(mode):
    """d_out None (only the last state is used) and a d_out whose last stride is not 1 (copied by the binding)."""
    dtype = torch.float64
    args = list(_inputs(mode, 0, True, 3, 4, 5, dtype, masked=True, strided=False))
    for d_out in (None, args[7].transpose(1, 2).contiguous().transpose(1, 2)):
        args[7] = d_out
        _, expected_bwd, kept = _torch_loops(mode, False, *args)
        _, got_bwd = _extension(mode, False, *args, kept)
        for got, expected in zip(got_bwd, expected_bwd, strict=True):
            torch.testing.assert_close(got, expected, **TOL[dtype])


def _special_inputs() -> torch.Tensor:
    """float32 inputs over the whole range, the polynomial's switch points and the edges of exp's clamp."""
    spread = torch.linspace(-30, 30, 6001)
    special = [0.0, -0.0, 1e-30, -1e-30, 1e-7, 0.6249, 0.625, 0.6251, -0.625, 43.0, 44.5, 86.9, 87.5, 88.5, 89.0,
               -87.5, -88.5, -89.0, 100.0, -100.0, 1e30, -1e30]  # fmt: skip
    return torch.cat([spread, torch.tensor(special)]).to(torch.float32)


def test_float_gate_math_is_within_2_ulp_of_float64(isa):
    """tanh (the RNN with W_hh = 0, h0 = 0: h_t = tanh(gx_t)) and sigmoid (the LSTM's i, f, o with W_hh = 0) of
    float32 inputs against float64: relative error <= 2.5e-7 (2 ulp), where the result is a normal float."""
    x = _special_inputs()
    n = x.numel()
    (states,) = C.rnn_forward(x.reshape(1, n, 1), torch.zeros(n, 1), torch.zeros(1, 1), False, None, False)
    tanh = states[1, :, 0].double()
    exact = torch.tanh(x.double())
    assert torch.all((tanh - exact).abs() <= 2.5e-7 * exact.abs()), (tanh - exact).abs().max()
    nonzero = x != 0  # (-0 reaches tanh as +0: the step adds h0 W_hh^T = +0)
    assert torch.equal(torch.signbit(tanh[nonzero]), torch.signbit(x[nonzero]))
    gx = x.reshape(1, n, 1).expand(1, n, 4).contiguous()
    out = C.lstm_forward(gx, torch.zeros(n, 1), torch.zeros(n, 1), torch.zeros(4, 1), None, None, False)
    sig = out[2][0, :, 0].double()
    exact = torch.sigmoid(x.double())
    normal = exact >= torch.finfo(torch.float32).tiny
    err = (sig - exact).abs()
    assert torch.all(err[normal] <= 2.5e-7 * exact[normal]), err[normal].max()
    assert torch.all(err[~normal] <= torch.finfo(torch.float32).tiny)  # exp clamped at -87: below the normal range


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_nan_propagates_and_inf_saturates(dtype, isa):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -2.0, 3.0], dtype=dtype)
    n = x.numel()
    zeros = torch.zeros(n, 1, dtype=dtype)
    w = torch.zeros(1, 1, dtype=dtype)
    for relu, expected in ((False, [math.nan, 1.0, -1.0, math.tanh(-2.0), math.tanh(3.0)]),
                           (True, [math.nan, math.inf, 0.0, 0.0, 3.0])):  # fmt: skip
        (states,) = C.rnn_forward(x.reshape(1, n, 1), zeros, w, relu, None, False)
        torch.testing.assert_close(states[1, :, 0], torch.tensor(expected, dtype=dtype), equal_nan=True)
    gx = x.reshape(1, n, 1).expand(1, n, 4).contiguous()
    acts = C.lstm_forward(gx, zeros, zeros, torch.zeros(4, 1, dtype=dtype), None, None, False)[2][0, :, 0]
    torch.testing.assert_close(acts, torch.sigmoid(x), equal_nan=True, atol=1e-7, rtol=1e-6)


def test_argument_checks():
    gx, h0, c0 = torch.randn(2, 3, 8), torch.randn(3, 2), torch.randn(3, 2)
    w = torch.randn(8, 2)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        C.lstm_forward(gx.half(), h0.half(), c0.half(), w.half(), None, None, False)
    with pytest.raises(RuntimeError, match=r"h0 must have shape \[3, 2\]"):
        C.lstm_forward(gx, h0[:2], c0, w, None, None, False)
    with pytest.raises(RuntimeError, match="w_hh is Double; every tensor must be Float"):
        C.lstm_forward(gx, h0, c0, w.double(), None, None, False)
    with pytest.raises(RuntimeError, match=r"mask must have shape \[2, 3\]"):
        C.lstm_forward(gx, h0, c0, w, None, torch.ones(3, 2, dtype=torch.bool), False)
    with pytest.raises(RuntimeError, match="mask must be a CPU bool tensor"):
        C.gru_forward(torch.randn(2, 3, 6), h0, torch.randn(6, 2), None, torch.ones(2, 3), False)
    with pytest.raises(RuntimeError, match="gx must be"):
        C.lstm_forward(torch.randn(2, 3, 7), h0, c0, w, None, None, False)


def test_float32_steps_run_onednn_where_torch_has_it():
    """The default float32 step GEMM is oneDNN's (torch's mkldnn linear) where torch was built with oneDNN."""
    assert C.recurrence_gemm() == ("onednn" if torch.backends.mkldnn.is_available() else "aten")
    assert C.set_recurrence_gemm("aten") and C.recurrence_gemm() == "aten"
    assert C.set_recurrence_gemm("") and not C.set_recurrence_gemm("bogus")


def test_the_layers_run_the_extension_unless_the_torch_backend_is_chosen(restore_backend):
    x = torch.zeros(2, 3)
    assert R._extension(x, None) is C
    assert R._extension(x.half()) is None and R._extension(x.to(torch.bfloat16)) is None
    fastdp.set_backend("torch")
    assert R._extension(x) is None
