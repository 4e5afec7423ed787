#pragma once

// Time loops of one layer and direction of a recurrent layer on CPU tensors, forward and backward through time
// (fastdp/nn/recurrent.py's _lstm_forward, _lstm_backward, _gru_*, _rnn_*, with the same arguments and results, except
// that the backward's carrier gradient is batch-first): per step one GEMM (the hidden one; oneDNN's linear for float32,
// at::mm otherwise) and one call of the step's gate kernel (cpu/recurrence.h); with several threads, each runs whole
// steps on its own rows of the batch. Inputs are checked by csrc/bindings.cpp: CPU, one floating dtype (float32 or
// float64), shapes; sequence tensors are time-major [T, B, *] with a unit last stride. A reverse direction walks the
// positions backwards; the states buffers [T + 1, B, *] hold the initial state at 0 (forward) or T (reverse), as
// fastdp.nn.recurrent._steps.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace fastdp {

// {states [T+1, B, P], cs [T+1, B, H], acts [T, B, 4H], tanh_c [T, B, H], ms [T, B, H] or undefined}
// gx [T, B, 4H], h0 [B, P], c0 [B, H], w_hh [4H, P], w_hr [P, H] or undefined (then P = H), mask [T, B] bool
// contiguous or undefined.
std::vector<at::Tensor> lstm_forward_cpu(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& c0,
                                         const at::Tensor& w_hh, const at::Tensor& w_hr, const at::Tensor& mask,
                                         bool reverse);

// {grad [B, T, 4H (+ P with w_hr)], d_h0 [B, P], d_c0 [B, H]}; d_out [T, B, P] or undefined, d_h [B, P], d_c [B, H].
// grad, the carrier's gradient (dL/dpre, then dL/dh_t with a projection), is batch-first, as the carrier.
std::vector<at::Tensor> lstm_backward_cpu(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& d_c,
                                          const at::Tensor& acts, const at::Tensor& cs, const at::Tensor& tanh_c,
                                          const at::Tensor& ms, const at::Tensor& w_hh, const at::Tensor& w_hr,
                                          const at::Tensor& mask, bool reverse);

// {states [T+1, B, H], rz [T, B, 2H], ns [T, B, H], gh_n [T, B, H]}; gx [T, B, 3H], h0 [B, H], w_hh [3H, H], b_hh
// [3H] contiguous or undefined.
std::vector<at::Tensor> gru_forward_cpu(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh,
                                        const at::Tensor& b_hh, const at::Tensor& mask, bool reverse);

// {grad [B, T, 6H] = [gx | gh] (batch-first), d_h0 [B, H]}
std::vector<at::Tensor> gru_backward_cpu(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& rz,
                                         const at::Tensor& ns, const at::Tensor& gh_n, const at::Tensor& states,
                                         const at::Tensor& w_hh, const at::Tensor& mask, bool reverse);

// {states [T+1, B, H]}; gx [T, B, H], h0 [B, H], w_hh [H, H].
std::vector<at::Tensor> rnn_forward_cpu(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh,
                                        bool relu, const at::Tensor& mask, bool reverse);

// {grad [B, T, H] (batch-first), d_h0 [B, H]}
std::vector<at::Tensor> rnn_backward_cpu(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& states,
                                         const at::Tensor& w_hh, bool relu, const at::Tensor& mask, bool reverse);

// Which GEMM the float32 loops run: "onednn" (torch's mkldnn::_linear_pointwise, where torch has it, it passes a probe
// and torch.backends.mkldnn.enabled is True) or "aten" (at::mm). set_recurrence_gemm("aten") forces at::mm, "onednn"
// restores it where it works (false where it does not), "" restores the default (tests run both).
const char* recurrence_gemm();
bool set_recurrence_gemm(const std::string& name);

}  // namespace fastdp
