"""DP recurrent layers: ``torch.nn.RNN`` (tanh and relu), ``nn.LSTM`` (``proj_size`` included) and ``nn.GRU``, any
``num_layers``, ``bidirectional``, ``bias``, ``batch_first``, ``dropout``, an initial state and PackedSequence
inputs. Converted by :func:`fastdp.nn.convert` like the layers of :mod:`fastdp.nn.layers` (per-example norms, clipped
sums and JL projections from one forward and one backward); outside a DP step each is its torch module (cuDNN/mkldnn).

Every weight of a recurrent layer is a Linear applied at each time step, so its per-example gradient is a sum over
the positions, as a sequence Linear's. For one layer and direction, with the gate pre-activations
``pre_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh`` ([B, gates * H]: 4 gates for the LSTM, 1 for the RNN) and
``g_t = dL/dpre_t``, each example's gradients are

    dW_ih = sum_t g_t^T x_t,    dW_hh = sum_t g_t^T h_{t-1},    db_ih = db_hh = sum_t g_t,

that is one Linear ``[W_ih | W_hh]`` of width d + H on ``a_t = [x_t, h_{t-1}]`` over the T positions: its norm is
:func:`~fastdp.nn.layers._sequence_weight_sq`'s (certified ghost norm or the per-example gradient, the cheaper), its
clipped sum one GEMM. The GRU's candidate ``n_t = tanh(W_in x_t + b_in + r_t * (W_hn h_{t-1} + b_hn))`` puts r_t
between the hidden product and the pre-activation, so its W_ih, b_ih take ``gx_t = dL/d(x_t W_ih^T + b_ih)`` and its
W_hh, b_hh ``gh_t = dL/d(h_{t-1} W_hh^T + b_hh)`` (equal on the r and z gates, ``r_t gx_t`` on n): two Linears.
An LSTM with ``proj_size`` adds ``h_t = m_t W_hr^T``, ``m_t = o_t * tanh(c_t)``: ``dW_hr = sum_t (dL/dh_t)^T m_t``.

A layer is tapped once per call (:meth:`fastdp.nn.ghost.GhostClipping.tap`), so all layers and directions share one
record. Its output is a *carrier* (:class:`_Carrier`): zeros ``[B, T, L * D, width]`` (L layers, D directions; width
4H (+ proj_size) for the LSTM, ``[gx | gh]`` = 6H for the GRU, H for the RNN) that every recurrence takes as an
input and whose gradient it returns as those G's, so after the backward the record holds, batch-first, every g
above. The saved A are, per layer and direction, the layer's input x (after the dropout between layers), the states
h_{t-1} that entered each step and, for ``proj_size``, the m_t.

The recurrence (:class:`_Recurrence`) runs a time loop without autograd and writes its own backward through time:
the input projections of all steps are one GEMM before it, each step one ``h W_hh^T`` GEMM and the gates; an
autograd graph of the same loop (:func:`_reference_recurrence`, what forward-mode AD runs) costs 2.2 (LSTM) and 4.8
(GRU) times as much, forward and backward (CPU, one thread, B 64, T 32, H 128: 9.4 against 20.6 ms and 7.3 against
35 ms), in the bookkeeping of its small per-step ops. On CPU tensors of float32 or float64 the time loops are
``fastdp._C``'s (csrc/cpu/recurrence_loop.cpp, the "recurrence" family of :mod:`fastdp._backend`): per step one GEMM
and one fused kernel of the gates' elementwise math, forward and backward, in place of the torch loops' ~10 small
kernels per step (dispatch of a few microseconds each, as much as the step's GEMM at B 64, H 128); the torch loops
below run without the extension, with ``FASTDP_BACKEND=torch``, on CUDA, for half types and under torch.compile.
Inside, the layers run time-major (each step's rows contiguous), whatever ``batch_first`` says; the extension's
backward writes the carrier's gradient batch-first, in the carrier's own layout. Reverse directions and
PackedSequences run in the input's time frame: a reverse direction walks the positions backwards, and a padded
position (past a sequence's length) keeps the state unchanged, outputs zero and gets zero gradient, so with a
reverse direction each sequence starts at its own last element, as torch's packed recurrence does.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from fastdp import _backend, _ext
from fastdp.nn.forms import Dense, Form, Outer
from fastdp.nn.ghost import active_context
from fastdp.nn.layers import (
    DP_LAYERS,
    DPLayer,
    _clipped_weight_sum,
    _mass,
    _projections,
    _rowsq,
    _sequence_weight_sq,
)
from fastdp.ops import summation

__all__ = ["GRU", "LSTM", "RNN"]

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _steps(t: int, reverse: bool) -> list[tuple[int, int, int]]:
    """(position s, index of the state before it, index of the state after it), in processing order. States are
    kept in a [T + 1, B, H] buffer in the input's time frame: the initial state at 0 (forward) or T (reverse)."""
    return [(s, s + 1, s) for s in range(t - 1, -1, -1)] if reverse else [(s, s, s + 1) for s in range(t)]


def _before(reverse: bool) -> slice:
    """The states buffer's slice of the states that entered each position (h_{t-1} of the module docstring)."""
    return slice(1, None) if reverse else slice(0, -1)


def _after(reverse: bool) -> slice:
    """The states buffer's slice of the states each position produced."""
    return slice(0, -1) if reverse else slice(1, None)


def _reference_recurrence(mode, reverse, gates_x, carrier, h0, c0, w_hh, b_hh, w_hr, mask):
    """:class:`_Recurrence` with differentiable torch ops, the carrier added (it is zeros) where its gradient is the
    G of the module docstring: what forward-mode AD runs, and the fused recurrence's test oracle.

    Time-major (each step's rows contiguous): ``gates_x`` [T, B, gates * H]: ``x W_ih^T`` plus the input bias
    (LSTM/RNN: b_ih + b_hh, GRU: b_ih); ``carrier`` [B, T, width] (batch-first, as the record); ``h0`` [B, H_out],
    ``c0`` [B, H] (LSTM) or None; ``b_hh``: the GRU's hidden bias (else None); ``w_hr``: the LSTM's projection or
    None; ``mask`` [T, B] bool (PackedSequence: False past a sequence's length) or None. Returns (outputs
    [T, B, H_out], last state, last cell state or None, states before each position [T, B, H_out], m or None), the
    last two detached."""
    t, b, width = gates_x.shape
    hsz = width // GATES[mode]
    carrier = carrier.transpose(0, 1)
    gx = gates_x + carrier[..., :width]
    h, c = h0, c0
    outs, before, ms = [None] * t, [None] * t, [None] * t
    for s, _, _ in _steps(t, reverse):
        before[s] = h
        c_new = None
        if mode == "LSTM":
            i, f, g, o = torch.addmm(gx[s], h, w_hh.t()).chunk(4, 1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            ms[s] = torch.sigmoid(o) * torch.tanh(c_new)
            h_new = ms[s] if w_hr is None else ms[s] @ w_hr.t() + carrier[s, :, width:]
        elif mode == "GRU":
            gh = h @ w_hh.t() + carrier[s, :, width:]
            gh = gh if b_hh is None else gh + b_hh
            r, z = torch.sigmoid(gx[s, :, : 2 * hsz] + gh[:, : 2 * hsz]).chunk(2, 1)
            n = torch.tanh(gx[s, :, 2 * hsz :] + r * gh[:, 2 * hsz :])
            h_new = (1 - z) * n + z * h
        else:
            pre = torch.addmm(gx[s], h, w_hh.t())
            h_new = torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)
        outs[s] = h_new
        if mask is not None:
            keep = mask[s].unsqueeze(1)
            outs[s] = h_new * keep
            h_new = torch.where(keep, h_new, h)
            c_new = None if c_new is None else torch.where(keep, c_new, c)
        h, c = h_new, c_new
    m = torch.stack(ms).detach() if w_hr is not None else None
    return torch.stack(outs), h, c, torch.stack(before).detach(), m


def _tanh(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """tanh(``t``) into ``out`` (which may be ``t``), as ``2 sigmoid(2 t) - 1``: torch's CPU tanh costs 4 times its
    sigmoid on a step's [B, H] (10 against 2.4 us at B 64, H 128), and more on a strided slice; measured on the LSTM
    forward (B 64, T 32, H 128, 2 threads): 3.3 ms against 8.1 ms with torch.tanh. The result differs from tanh by
    a rounding of the sigmoid (an absolute ~1e-7 in fp32); the backward's derivative 1 - y^2 is taken from this y."""
    return torch.mul(t, 2, out=out).sigmoid_().mul_(2).sub_(1)


def _lstm_forward(reverse, gx, h0, c0, w_hh, w_hr, mask):
    t, b, four = gx.shape
    hsz = four // 4
    states, cs = gx.new_empty(t + 1, b, h0.shape[1]), gx.new_empty(t + 1, b, hsz)
    acts, tanh_c = gx.new_empty(t, b, four), gx.new_empty(t, b, hsz)  # i, f, g, o after their nonlinearities
    ms = None if w_hr is None else gx.new_empty(t, b, hsz)
    first = t if reverse else 0
    states[first], cs[first] = h0, c0
    w_t = w_hh.t()
    # each step's views made at once (indexing one at a time costs as much as a step's small kernels)
    gx_, states_, cs_, acts_, tanh_c_ = gx.unbind(0), states.unbind(0), cs.unbind(0), acts.unbind(0), tanh_c.unbind(0)
    for s, p, q in _steps(t, reverse):
        pre = torch.addmm(gx_[s], states_[p], w_t)
        pre[:, 2 * hsz : 3 * hsz].mul_(2)  # g: tanh(x) = 2 sigmoid(2x) - 1, one sigmoid for the four gates
        i, f, g, o = torch.sigmoid(pre, out=acts_[s]).chunk(4, 1)
        g.mul_(2).sub_(1)
        c = torch.mul(f, cs_[p], out=cs_[q]).addcmul_(i, g)
        tc = _tanh(c, tanh_c_[s])
        if w_hr is None:
            torch.mul(o, tc, out=states_[q])
        else:
            torch.mm(torch.mul(o, tc, out=ms[s]), w_hr.t(), out=states_[q])
        if mask is not None:
            keep = mask[s].unsqueeze(1)
            torch.where(keep, states_[q], states_[p], out=states_[q])
            torch.where(keep, c, cs_[p], out=c)
    return states, (acts, cs, tanh_c, ms, w_hh, w_hr, mask)


def _lstm_backward(reverse, d_out, d_h, d_c, acts, cs, tanh_c, ms, w_hh, w_hr, mask):
    t, b, four = acts.shape
    hsz = four // 4
    i, f, g, o = acts.unflatten(2, (4, hsz)).unbind(2)
    # dL/dpre_{i,f,g} = dL/dc_t * k[:3], dL/dpre_o = dL/dm_t * k[3]: the sigmoids' derivatives s (1 - s) times
    # g, c_{t-1} and tanh(c_t), and (1 - g^2) i; few passes over [T, B, H] (they cost as much as the loop's kernels)
    k = torch.addcmul(acts, acts, acts, value=-1).unflatten(2, (4, hsz))
    one = acts.new_ones(())
    k_i, k_f, k_g, k_o = k.unbind(2)
    k_i.mul_(g)
    k_f.mul_(cs[_before(reverse)])
    torch.addcmul(one, g, g, value=-1, out=k_g).mul_(i)
    k_o.mul_(tanh_c)
    dc_per_dm = torch.addcmul(one, tanh_c, tanh_c, value=-1).mul_(o)  # dL/dc_t += dL/dm_t * o_t tanh'(c_t)
    grad = acts.new_empty(t, b, four + (0 if w_hr is None else w_hr.shape[0]))
    dpre = grad[..., :four].unflatten(2, (4, hsz))
    dpre_ifg, dpre_o, grad_, dc_per_dm, k_o, k_ifg, f = (
        dpre[:, :, :3].unbind(0), dpre[:, :, 3].unbind(0), grad[..., :four].unbind(0), dc_per_dm.unbind(0),
        k_o.unbind(0), k[:, :, :3].unbind(0), f.unbind(0),
    )  # fmt: skip
    d_out = None if d_out is None else d_out.unbind(0)
    for s, _, _ in reversed(_steps(t, reverse)):
        dh = d_h if d_out is None else d_h + d_out[s]
        dc = d_c
        if mask is not None:
            keep = mask[s].unsqueeze(1)
            dh, dc, pass_h, pass_c = dh * keep, dc * keep, d_h * ~keep, d_c * ~keep
        if w_hr is None:
            dm = dh
        else:
            grad[s, :, four:] = dh
            dm = dh @ w_hr
        dc = torch.addcmul(dc, dm, dc_per_dm[s])
        torch.mul(dc.unsqueeze(1), k_ifg[s], out=dpre_ifg[s])
        torch.mul(dm, k_o[s], out=dpre_o[s])
        d_c = dc.mul_(f[s])
        d_h = torch.mm(grad_[s], w_hh)
        if mask is not None:
            d_h, d_c = d_h + pass_h, d_c + pass_c
    return grad, grad[..., :four], d_h, d_c


def _gru_forward(reverse, gx, h0, w_hh, b_hh, mask):
    t, b, three = gx.shape
    hsz = three // 3
    states = gx.new_empty(t + 1, b, hsz)
    rz, ns, gh_n = gx.new_empty(t, b, 2 * hsz), gx.new_empty(t, b, hsz), gx.new_empty(t, b, hsz)
    states[t if reverse else 0] = h0
    w_t = w_hh.t()
    gx_, states_, rz_, ns_, gh_n_ = gx.unbind(0), states.unbind(0), rz.unbind(0), ns.unbind(0), gh_n.unbind(0)
    for s, p, q in _steps(t, reverse):
        h = states_[p]
        gh = torch.mm(h, w_t) if b_hh is None else torch.addmm(b_hh, h, w_t)
        r, z = torch.add(gx_[s][:, : 2 * hsz], gh[:, : 2 * hsz], out=rz_[s]).sigmoid_().chunk(2, 1)
        gh_n_[s].copy_(gh[:, 2 * hsz :])
        n = _tanh(torch.addcmul(gx_[s][:, 2 * hsz :], r, gh_n_[s], out=ns_[s]), ns_[s])
        torch.lerp(n, h, z, out=states_[q])  # (1 - z) n + z h
        if mask is not None:
            torch.where(mask[s].unsqueeze(1), states_[q], h, out=states_[q])
    return states, (rz, ns, gh_n, states, w_hh, mask)


def _gru_backward(reverse, d_out, d_h, rz, ns, gh_n, states, w_hh, mask):
    t, b, hsz = ns.shape
    r, z = rz.chunk(2, 2)
    one = ns.new_ones(())
    k_n = torch.addcmul(one, ns, ns, value=-1).mul_(1 - z)  # gx_n = dL/dh_t * k_n
    k_z = torch.sub(states[_before(reverse)], ns).mul_(torch.addcmul(z, z, z, value=-1))  # g_z = dL/dh_t * k_z
    k_r = torch.addcmul(r, r, r, value=-1).mul_(gh_n)  # g_r = gx_n * k_r
    grad = ns.new_empty(t, b, 6 * hsz)  # [gx | gh], each [r, z, n]
    gx_n_, gh_r_, gh_z_, gh_n_ = (grad[..., i * hsz : (i + 1) * hsz].unbind(0) for i in (2, 3, 4, 5))
    gh_ = grad[..., 3 * hsz :].unbind(0)
    k_n, k_z, k_r, r, z = k_n.unbind(0), k_z.unbind(0), k_r.unbind(0), r.unbind(0), z.unbind(0)
    d_out = None if d_out is None else d_out.unbind(0)
    for s, _, _ in reversed(_steps(t, reverse)):
        dh = d_h if d_out is None else d_h + d_out[s]
        if mask is not None:
            keep = mask[s].unsqueeze(1)
            dh, pass_h = dh * keep, d_h * ~keep
        gx_n = torch.mul(dh, k_n[s], out=gx_n_[s])
        torch.mul(gx_n, k_r[s], out=gh_r_[s])
        torch.mul(dh, k_z[s], out=gh_z_[s])
        torch.mul(gx_n, r[s], out=gh_n_[s])
        d_h = torch.addmm(dh * z[s], gh_[s], w_hh)
        if mask is not None:
            d_h = d_h + pass_h
    grad[..., : 2 * hsz] = grad[..., 3 * hsz : 5 * hsz]  # gx = gh on the r and z gates
    return grad, grad[..., : 3 * hsz], d_h, None


def _rnn_forward(reverse, gx, h0, w_hh, relu, mask):
    t, b, hsz = gx.shape
    states = gx.new_empty(t + 1, b, hsz)
    states[t if reverse else 0] = h0
    w_t = w_hh.t()
    gx_, states_ = gx.unbind(0), states.unbind(0)
    for s, p, q in _steps(t, reverse):
        pre = torch.addmm(gx_[s], states_[p], w_t)
        if relu:
            torch.clamp_min(pre, 0, out=states_[q])
        else:
            _tanh(pre, states_[q])
        if mask is not None:
            torch.where(mask[s].unsqueeze(1), states_[q], states_[p], out=states_[q])
    return states, (states, w_hh, mask)


def _rnn_backward(reverse, relu, d_out, d_h, states, w_hh, mask):
    h = states[_after(reverse)]
    slope = (h > 0).to(h.dtype) if relu else torch.addcmul(h.new_ones(()), h, h, value=-1)  # from the output
    grad = torch.empty_like(h)
    grad_, slope = grad.unbind(0), slope.unbind(0)
    d_out = None if d_out is None else d_out.unbind(0)
    for s, _, _ in reversed(_steps(h.shape[0], reverse)):
        dh = d_h if d_out is None else d_h + d_out[s]
        if mask is not None:
            keep = mask[s].unsqueeze(1)
            dh, pass_h = dh * keep, d_h * ~keep
        d_h = torch.mm(torch.mul(dh, slope[s], out=grad_[s]), w_hh)
        if mask is not None:
            d_h = d_h + pass_h
    return grad, grad, d_h, None


_STALE_EXTENSION_WARNED = False


def _extension(*tensors):
    """``fastdp._C`` where its time loops run this recurrence (csrc/cpu/recurrence_loop.cpp: eager CPU tensors of
    float32 or float64, and the "recurrence" family's backend is fastdp._C, as it is by default where it is built),
    else None: the torch loops above (``FASTDP_BACKEND=torch``, no extension, CUDA, half types, torch.compile)."""
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    if not _backend.eager([t for t in tensors if t is not None]) or _backend.select("recurrence", "cpu") != "cuda":
        return None
    if not hasattr(_ext._C, "lstm_forward"):
        global _STALE_EXTENSION_WARNED
        if not _STALE_EXTENSION_WARNED:
            _STALE_EXTENSION_WARNED = True
            warnings.warn(
                "fastdp recurrence on cpu: fastdp._C was built without the recurrence kernels (an older build); "
                f"the torch loops run instead. To get them, {_ext.BUILD_HINT}.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return _ext._C


class _Recurrence(torch.autograd.Function):
    """One layer and direction of a recurrent module, its backward through time written out: the arguments and
    results of :func:`_reference_recurrence`, whose gradients it gives (the carrier's: the G's of the module
    docstring; ``gates_x``'s: the pre-activation gradients of the input side; the initial states'). The carrier's
    value is not read (it is zeros). Not twice differentiable."""

    @staticmethod
    def forward(ctx, mode, reverse, gates_x, carrier, h0, c0, w_hh, b_hh, w_hr, mask):
        ext = _extension(gates_x, h0, c0, w_hh, b_hh, w_hr)
        if mode == "LSTM":
            if ext is not None:
                states, cs, acts, tanh_c, ms = ext.lstm_forward(gates_x, h0, c0, w_hh, w_hr, mask, reverse)
                kept = (acts, cs, tanh_c, ms, w_hh, w_hr, mask)
            else:
                states, kept = _lstm_forward(reverse, gates_x, h0, c0, w_hh, w_hr, mask)
            cs, ms = kept[1], kept[3]
            c_n = cs[0 if reverse else -1].clone()
        elif mode == "GRU":
            if ext is not None:
                states, rz, ns, gh_n = ext.gru_forward(gates_x, h0, w_hh, b_hh, mask, reverse)
                kept = (rz, ns, gh_n, states, w_hh, mask)
            else:
                states, kept = _gru_forward(reverse, gates_x, h0, w_hh, b_hh, mask)
            c_n, ms = None, None
        else:
            relu = mode == "RNN_RELU"
            if ext is not None:
                (states,) = ext.rnn_forward(gates_x, h0, w_hh, relu, mask, reverse)
                kept = (states, w_hh, mask)
            else:
                states, kept = _rnn_forward(reverse, gates_x, h0, w_hh, relu, mask)
            c_n, ms = None, None
        ctx.mode, ctx.reverse, ctx.ext = mode, reverse, ext
        ctx.set_materialize_grads(False)  # an unused output (often the sequence) gets no zeros to add per step
        ctx.state_shapes = (h0.shape, None if c0 is None else c0.shape)
        ctx.save_for_backward(*kept)
        out = states[_after(reverse)]  # copied: the states stay private (saved for the norms and the backward)
        out = out.clone() if mask is None else out * mask.unsqueeze(2)
        before = states[_before(reverse)]
        ctx.mark_non_differentiable(*(x for x in (before, ms) if x is not None))
        return out, states[0 if reverse else -1].clone(), c_n, before, ms

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_h, d_c, _d_before, _d_m):
        saved = ctx.saved_tensors
        h_shape, c_shape = ctx.state_shapes
        d_h = saved[0].new_zeros(h_shape) if d_h is None else d_h
        ext = ctx.ext if ctx.ext is not None and _extension(saved[0], d_out, d_h, d_c) is not None else None
        relu = ctx.mode == "RNN_RELU"
        if ext is not None:  # the carrier's gradient batch-first [B, T, width], gates_x's a time-major view of it
            if ctx.mode == "LSTM":
                d_c = saved[0].new_zeros(c_shape) if d_c is None else d_c
                grad, d_h0, d_c0 = ext.lstm_backward(d_out, d_h, d_c, *saved, ctx.reverse)
                gates = saved[0].shape[2]
            elif ctx.mode == "GRU":
                (grad, d_h0), d_c0 = ext.gru_backward(d_out, d_h, *saved, ctx.reverse), None
                gates = 3 * saved[1].shape[2]
            else:
                states, w_hh, mask = saved
                (grad, d_h0), d_c0 = ext.rnn_backward(d_out, d_h, states, w_hh, relu, mask, ctx.reverse), None
                gates = grad.shape[2]
            grad_x = grad[..., :gates].transpose(0, 1)
            return None, None, grad_x, grad, d_h0, d_c0, None, None, None, None
        if ctx.mode == "LSTM":
            d_c = saved[0].new_zeros(c_shape) if d_c is None else d_c
            grad, grad_x, d_h0, d_c0 = _lstm_backward(ctx.reverse, d_out, d_h, d_c, *saved)
        elif ctx.mode == "GRU":
            grad, grad_x, d_h0, d_c0 = _gru_backward(ctx.reverse, d_out, d_h, *saved)
        else:
            grad, grad_x, d_h0, d_c0 = _rnn_backward(ctx.reverse, relu, d_out, d_h, *saved)
        return None, None, grad_x, grad.transpose(0, 1), d_h0, d_c0, None, None, None, None


def _input_projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` at every position (W and b detached): oneDNN's linear where the recurrences' float32 steps run
    on it (fastdp._C's ``recurrence_gemm``; CPU, B 64, T 32, d 64, 4H 512, one thread: 0.51 against F.linear's MKL
    1.17 ms, its input gradient the same), else F.linear (also under forward-mode AD)."""
    ext = _extension(x, w, bias)
    if (
        ext is None
        or x.dtype != torch.float32
        or forward_ad._current_level >= 0
        or not hasattr(ext, "recurrence_gemm")
        or ext.recurrence_gemm() != "onednn"
    ):
        return F.linear(x, w, bias)
    return _OneDNNLinear.apply(x, w, bias)


class _OneDNNLinear(torch.autograd.Function):
    """``x W^T + b`` by oneDNN (torch's ``mkldnn::_linear_pointwise``) and the input's gradient ``g W`` by it too;
    none for W and b (the recurrent layers' weights are detached: their gradients are the clipped sums)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(w)
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], None)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        (w,) = ctx.saved_tensors
        return torch.ops.mkldnn._linear_pointwise(grad, w.t().contiguous(), None, "none", [], None), None, None


class _Carrier(torch.autograd.Function):
    """The carrier (module docstring): zeros of ``shape``, one expanded zero (nothing filled; its value is read by
    the reference recurrence only), that require grad and pass no gradient on. The tap's hook takes its gradient,
    the G's; a leaf carrier would also accumulate that into its ``.grad``, a copy of every G in every step."""

    @staticmethod
    def forward(ctx, anchor, shape):
        return anchor.new_zeros(()).expand(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return None, None


def _recurrence(mode, reverse, gates_x, carrier, h0, c0, w_hh, b_hh, w_hr, mask):
    """One layer and direction (:func:`_reference_recurrence`'s arguments and results): the fused recurrence, or
    the reference under forward-mode AD (which the fused one does not define)."""
    run = _reference_recurrence if forward_ad._current_level >= 0 else _Recurrence.apply
    return run(mode, reverse, gates_x, carrier, h0, c0, w_hh, b_hh, w_hr, mask)


class _Recurrent(DPLayer):
    """Shared by RNN/LSTM/GRU (``self.mode``: torch's "RNN_TANH", "RNN_RELU", "LSTM" or "GRU"); see the module
    docstring."""

    def forward(self, input, hx=None):
        ctx = active_context()
        if ctx is None or not self._trains():
            return super().forward(input, hx)
        name = type(self).__name__
        names = self._dp_names()
        if len(names) != len(self.dp_parameters()):
            raise ValueError(
                f"fastdp.nn.{name}: a Parameter is registered under two names of the layer, so its per-example "
                "gradient sums both uses, which its per-name norms do not; give each weight its own Parameter"
            )
        if isinstance(input, PackedSequence):
            x, lengths = pad_packed_sequence(input)  # [T, B, d], in the input's own example order
            mask = (torch.arange(x.shape[0]).unsqueeze(1) < lengths.unsqueeze(0)).to(x.device)
            data, batch_sizes = input.data, input.batch_sizes
        else:
            if input.dim() != 3:
                raise ValueError(
                    f"fastdp.nn.{name}: a DP step needs a batch of sequences (a 3-D input), got a {input.dim()}-D "
                    "input (an unbatched sequence); add the batch dimension"
                )
            x, lengths, mask = (input.transpose(0, 1) if self.batch_first else input), None, None
            data, batch_sizes = input, None
        dtype = self.weight_ih_l0.dtype
        h0, c0 = self._initial_state(hx, data, batch_sizes, x.shape[1], dtype)
        device = x.device.type
        exact = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()
        with exact:  # the recurrence in the parameters' dtype: its G and A (and the norms) too
            out, h_n, c_n, saved, carrier = self._layers(x.to(dtype), h0, c0, mask)
        ctx.tap(self, saved, carrier)
        if lengths is not None:
            out = self._packed_like(out, input, lengths)
        elif self.batch_first:
            out = out.transpose(0, 1).contiguous()
        return (out, (h_n, c_n)) if self.mode == "LSTM" else (out, h_n)

    def _initial_state(self, hx, data, batch_sizes, batch: int, dtype: torch.dtype):
        """(h0 [L * D, B, H_out], c0 [L * D, B, H] for the LSTM else None): the user's (checked as torch checks it;
        in the input's example order, as torch takes it for a PackedSequence too) or zeros."""
        layers = self.num_layers * (2 if self.bidirectional else 1)
        if hx is None:
            h0 = data.new_zeros(layers, batch, self.proj_size or self.hidden_size, dtype=dtype)
            c0 = data.new_zeros(layers, batch, self.hidden_size, dtype=dtype) if self.mode == "LSTM" else None
            return h0, c0
        self.check_forward_args(data, hx, batch_sizes)
        if self.mode == "LSTM":
            return hx[0].to(dtype), hx[1].to(dtype)
        return hx.to(dtype), None

    def _layers(self, x, h0, c0, mask):
        """The layers' recurrences on time-major ``x`` [T, B, d] (each step's rows contiguous): (output
        [T, B, D * H_out], h_n, c_n or None, the saved A, batch-first: per layer and direction (x, states before each
        position[, m]), the carrier)."""
        t, b = x.shape[:2]
        directions = 2 if self.bidirectional else 1
        gates = GATES[self.mode] * self.hidden_size
        width = {"LSTM": gates + self.proj_size, "GRU": 2 * gates}.get(self.mode, gates)
        # positions first: a PackedSequence's padding is then at the end of each example's row (the row probe's
        # fingerprints of a row do not change when another example changes the longest length)
        blocks_n = self.num_layers * directions
        carrier = _Carrier.apply(x.new_zeros((), requires_grad=True), (b, t, blocks_n, width))
        # one block: a view, whose backward is one too (unbind's stacks the blocks' gradients into a new tensor)
        blocks = carrier.unbind(2) if blocks_n > 1 else (carrier.squeeze(2),)
        saved, h_n, c_n = [], [], []
        layer_in = x
        for layer in range(self.num_layers):
            suffixes = ("", "_reverse")[:directions]
            w_ih = torch.cat([self._detached(f"weight_ih_l{layer}{s}") for s in suffixes])
            bias = None
            if self.bias:
                bias = torch.cat([self._detached(f"bias_ih_l{layer}{s}") for s in suffixes])
                if self.mode != "GRU":  # b_hh adds to the pre-activation as b_ih does (the GRU's: inside r_t * ...)
                    bias = bias + torch.cat([self._detached(f"bias_hh_l{layer}{s}") for s in suffixes])
            # every position of both directions: one GEMM, on a batch-first input's own rows (its time-major view
            # would take a batched GEMM); the recurrences read the projections in either layout
            rows = layer_in.transpose(0, 1)
            if rows.is_contiguous():
                projected = _input_projection(rows, w_ih, bias).transpose(0, 1)
            else:
                projected = _input_projection(layer_in, w_ih, bias)
            # one direction: no split, whose backward is a cat (a copy of the gradient, in the time-major layout,
            # which the projection's backward then copied back to the rows': 1.5 ms of a 12.5 ms LSTM step)
            gates_x = (projected,) if directions == 1 else projected.split(gates, 2)
            a = layer_in.detach().transpose(0, 1)
            outs = []
            for k, suffix in enumerate(suffixes):
                index = layer * directions + k
                b_hh = self._detached(f"bias_hh_l{layer}{suffix}") if self.mode == "GRU" and self.bias else None
                w_hh = self._detached(f"weight_hh_l{layer}{suffix}")
                w_hr = self._detached(f"weight_hr_l{layer}{suffix}") if self.proj_size else None
                c0_k = None if c0 is None else c0[index]
                out, h, c, before, m = _recurrence(
                    self.mode, k == 1, gates_x[k], blocks[index], h0[index], c0_k, w_hh, b_hh, w_hr, mask
                )
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
                saved += [a, before.transpose(0, 1)] + ([] if m is None else [m.transpose(0, 1)])
            layer_in = outs[0] if directions == 1 else torch.cat(outs, 2)
            if layer < self.num_layers - 1 and self.dropout > 0 and self.training:
                layer_in = F.dropout(layer_in, self.dropout, True)
        c_n = torch.stack(c_n) if self.mode == "LSTM" else None
        return layer_in, torch.stack(h_n), c_n, tuple(saved), carrier

    @staticmethod
    def _packed_like(out: torch.Tensor, packed: PackedSequence, lengths: torch.Tensor) -> PackedSequence:
        """``out`` [T, B, *] (the input's example order) packed as ``packed`` is (its batch sizes and ordering)."""
        order = packed.sorted_indices
        if order is not None:
            out, lengths = out.index_select(1, order), lengths[order.cpu()]
        data = pack_padded_sequence(out, lengths).data
        return PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)

    def _dp_names(self) -> list[str]:
        """The names of :meth:`dp_parameters`, in that order."""
        return [n for n, p in self._parameters.items() if p is not None and p.requires_grad]

    def _trainable(self, name: str) -> bool:
        p = self._parameters.get(name)
        return p is not None and p.requires_grad

    def _linears(self, saved, grad_out: torch.Tensor) -> tuple[list, list]:
        """The layer's Linears over the positions (module docstring), trainable parameters only: weights as
        ``(names, [a, ...], g)`` (several names where they share g, W_ih and W_hh of the LSTM and RNN: one Linear on
        the a's concatenated) and biases as ``(names, g)`` (each name's per-example gradient is ``sum_t g_t``)."""
        directions = 2 if self.bidirectional else 1
        per_block = 3 if self.proj_size else 2
        gates = GATES[self.mode] * self.hidden_size
        weights, biases = [], []
        for index in range(self.num_layers * directions):
            layer, k = divmod(index, directions)
            suffix = f"_l{layer}" + ("_reverse" if k else "")
            x, before = saved[per_block * index], saved[per_block * index + 1]
            g = grad_out[:, :, index]
            if self.mode == "GRU":
                gx, gh = g[..., :gates], g[..., gates:]
                linears = [(("weight_ih",), (x,), gx), (("weight_hh",), (before,), gh)]
                sums = [(("bias_ih",), gx), (("bias_hh",), gh)]
            else:
                gx = g[..., :gates]
                linears = [(("weight_ih", "weight_hh"), (x, before), gx)]
                sums = [(("bias_ih", "bias_hh"), gx)]
                if self.proj_size:
                    linears.append((("weight_hr",), (saved[per_block * index + 2],), g[..., gates:]))
            for names, parts, g_part in linears:
                kept = [(n + suffix, a) for n, a in zip(names, parts, strict=True) if self._trainable(n + suffix)]
                if kept:
                    weights.append(([n for n, _ in kept], [a for _, a in kept], g_part))
            for names, g_part in sums:
                kept = [n + suffix for n in names if self._trainable(n + suffix)]
                if kept:
                    biases.append((kept, g_part))
        return weights, biases

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        weights, biases = self._linears(saved, grad_out)
        total = torch.zeros(grad_out.shape[0], dtype=torch.float64, device=grad_out.device)
        for j, (_, parts, g) in enumerate(weights):
            kept = None if cache is None else {}
            total += _sequence_weight_sq(torch.cat(parts, 2) if len(parts) > 1 else parts[0], g, kept)
            if kept:
                cache[f"weight{j}"] = kept["weight"]
        for j, (names, g) in enumerate(biases):
            bias = g.sum(1)  # per-example [B, gates * H], the same for b_ih and b_hh where both are in names
            if cache is not None:
                cache[f"bias{j}"] = bias
            total += len(names) * _rowsq(bias)
        return total

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        weights, biases = self._linears(saved, grad_out)
        sums = {}
        for j, (names, parts, g) in enumerate(weights):
            if cache and f"weight{j}" in cache:
                total = summation.weighted_sum(factors, cache[f"weight{j}"])
            else:
                total = _clipped_weight_sum(torch.cat(parts, 2) if len(parts) > 1 else parts[0], g, factors)
            if len(parts) == 1:
                sums[names[0]] = total
            else:
                for name, part in zip(names, total.split([p.shape[-1] for p in parts], 1), strict=True):
                    sums[name] = part.contiguous()
        for j, (names, g) in enumerate(biases):
            bias = cache[f"bias{j}"] if cache and f"bias{j}" in cache else g.to(torch.float64).sum(1)  # as JL projects
            total = summation.weighted_sum(factors, bias)
            for n, name in enumerate(names):
                sums[name] = total if n == 0 else total.clone()  # each parameter its own gradient tensor
        return [sums[name] for name in self._dp_names()]

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """Each weight's ``sum_t g_t a_t^T`` (its own a) and each bias's ``sum_t g_t`` (``fastdp.nn.forms``: a layer
        called more than once in a forward)."""
        weights, biases = self._linears(saved, grad_out)
        of: dict[str, Form] = {}
        for names, parts, g in weights:
            of.update({name: Outer(g, a) for name, a in zip(names, parts, strict=True)})
        for names, g in biases:
            of.update(dict.fromkeys(names, Dense(g.sum(1))))
        return [of[name] for name in self._dp_names()]

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of each parameter's per-example gradient, formed in float64 (:func:`_projections`): a weight's
        ``sum_t g_t^T a_t`` of its own a (the GEMM of several weights sums each weight's columns from its a alone), a
        bias's ``sum_t g_t``."""

        def pieces(saved, grad_out):
            weights, biases = self._linears(saved, grad_out)
            of = {}
            for names, parts, g in weights:
                g = g.to(torch.float64)
                for name, a in zip(names, parts, strict=True):
                    a = a.to(torch.float64)
                    of[name] = (torch.einsum("btp,btd->bpd", g, a), _mass(a, g), a.shape[1])
            for names, g in biases:
                g = g.to(torch.float64)
                of.update(dict.fromkeys(names, (g.sum(1), _mass(None, g), g.shape[1])))
            return [of[name] for name in self._dp_names()]

        return _projections(pieces, saved, grad_out, tangents)


class RNN(_Recurrent, nn.RNN):
    """``torch.nn.RNN`` (tanh or relu)."""


class LSTM(_Recurrent, nn.LSTM):
    """``torch.nn.LSTM`` (``proj_size`` included)."""


class GRU(_Recurrent, nn.GRU):
    """``torch.nn.GRU``."""


DP_LAYERS.update({nn.RNN: RNN, nn.LSTM: LSTM, nn.GRU: GRU})
