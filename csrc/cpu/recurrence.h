#pragma once

// One time step of a recurrent layer's gates (LSTM, GRU, tanh/relu RNN), forward and backward through time, on
// raw pointers: every elementwise operation of the step in one pass over its rows. The step's GEMMs (h W_hh^T,
// dL/dpre W_hh, the LSTM projection) are not here: the time loops (csrc/cpu/recurrence_loop.cpp) run them (oneDNN's
// linear or at::mm) between the calls. Rows are examples: row b of every argument belongs to example b, and each kernel
// reads and writes row b of its arguments only. Math, as fastdp/nn/recurrent.py's torch steps:
//
//   LSTM: pre = gx + h_{t-1} W_hh^T = [i f g o] pre-activations; i, f, o = sigmoid, g = tanh;
//         c_t = f c_{t-1} + i g;  m_t = o tanh(c_t);  h_t = m_t (or m_t W_hr^T with a projection).
//   GRU:  gh = h_{t-1} W_hh^T + b_hh; r, z = sigmoid(gx_{r,z} + gh_{r,z}); n = tanh(gx_n + r gh_n);
//         h_t = n + z (h_{t-1} - n).
//   RNN:  h_t = tanh(gx + h_{t-1} W_hh^T) or relu(...).
//
// A row whose `keep` is false (a PackedSequence position past the example's length) keeps its state (h_t = h_{t-1},
// c_t = c_{t-1}), and in the backward gets a zero gradient and passes dL/dh_t, dL/dc_t through unchanged.
//
// float: vectorised (AVX-512, AVX2 or SSE2 by the CPU, picked at the first call) with Cephes-style exp and tanh
// (relative error ~1.2e-7, i.e. about 1 ulp; NaN propagates, +-inf saturates); double: std::exp and std::tanh.
// Single-threaded: the callers split the rows (at::parallel_for).

#include <cstdint>
#include <string>

namespace fastdp {

// LSTM forward. out: h_t, or m_t where a projection follows (keeps_prev false: masked rows get m_t too, the loop
// copies h_{t-1} over their projected h_t).
template <typename T>
struct LstmForwardStep {
  const T* gx;       // row b at gx + b * gx_ld: [i f g o] input projections and biases, 4H
  int64_t gx_ld;
  const T* pre;      // [B, 4H] contiguous: h_{t-1} W_hh^T
  const T* c_prev;   // [B, H]
  const T* h_prev;   // [B, H]: read for masked rows when keeps_prev
  const bool* keep;  // [B], or null: every row is kept
  T* acts;           // [B, 4H]: i, f, g, o after their nonlinearities
  T* c_next;         // [B, H]
  T* tanh_c;         // [B, H]: tanh(c_t) (of the unmasked c_t)
  T* out;            // [B, H]: h_t (keeps_prev) or m_t
  bool keeps_prev;
  int64_t hidden;
};

// LSTM backward. d_c is updated in place from dL/dc_t to dL/dc_{t-1}; grad gets dL/dpre (4H of each row);
// d_h_pass (when not null) gets keep ? 0 : d_h, onto which the loop's GEMM adds dL/dpre W_hh.
template <typename T>
struct LstmBackwardStep {
  const T* d_h;      // [B, P]: dL/dh_t from the later steps (P = H without a projection)
  const T* d_out;    // row b at d_out + b * d_out_ld: dL/d output_t, or null
  int64_t d_out_ld;
  const T* dm;       // [B, H]: dL/dm_t from the projection's GEMM, or null (then dL/dm_t = d_h + d_out)
  T* d_c;            // [B, H]
  const T* acts;     // [B, 4H]
  const T* c_prev;   // [B, H]
  const T* tanh_c;   // [B, H]
  const bool* keep;  // [B] or null
  T* grad;           // row b at grad + b * grad_ld: dL/dpre, 4H
  int64_t grad_ld;
  T* d_h_pass;       // [B, P] or null
  int64_t hidden;
  int64_t out_size;  // P
};

// rows of out (out + b * out_ld, n values) = keep ? a + d (d: d + b * d_ld, or nothing when null) : 0: the LSTM
// projection's G (dL/dh_t), before its GEMM.
template <typename T>
struct MaskedSumRows {
  const T* a;        // [B, n]
  const T* d;        // or null
  int64_t d_ld;
  const bool* keep;  // or null
  T* out;
  int64_t out_ld;
  int64_t n;
};

template <typename T>
struct GruForwardStep {
  const T* gx;       // row b at gx + b * gx_ld: [r z n] input projections plus b_ih, 3H
  int64_t gx_ld;
  const T* gh;       // [B, 3H] contiguous: h_{t-1} W_hh^T (without b_hh)
  const T* b_hh;     // [3H] or null
  const T* h_prev;   // [B, H]
  const bool* keep;  // [B] or null
  T* rz;             // [B, 2H]: r, z
  T* n;              // [B, H]
  T* gh_n;           // [B, H]: the n gate's hidden part, bias included
  T* h_next;         // [B, H]
  int64_t hidden;
};

// GRU backward: grad row = [gx | gh] = [g_r, g_z, gx_n, g_r, g_z, gh_n] (6H), d_h_next = dL/dh_t z (+ the passed
// dL/dh_t of a masked row); the loop's GEMM adds gh W_hh.
template <typename T>
struct GruBackwardStep {
  const T* d_h;      // [B, H]
  const T* d_out;    // or null
  int64_t d_out_ld;
  const T* rz;       // [B, 2H]
  const T* n;        // [B, H]
  const T* gh_n;     // [B, H]
  const T* h_prev;   // [B, H]
  const bool* keep;  // [B] or null
  T* grad;           // row b at grad + b * grad_ld: 6H
  int64_t grad_ld;
  T* d_h_next;       // [B, H]
  int64_t hidden;
};

template <typename T>
struct RnnForwardStep {
  const T* gx;       // row b at gx + b * gx_ld, H
  int64_t gx_ld;
  const T* pre;      // [B, H]: h_{t-1} W_hh^T
  const T* h_prev;   // [B, H]
  const bool* keep;  // [B] or null
  T* h_next;         // [B, H]
  bool relu;
  int64_t hidden;
};

// RNN backward: grad = dL/dh_t * slope, the slope taken from the output h_t (1 - h_t^2, or [h_t > 0]).
template <typename T>
struct RnnBackwardStep {
  const T* d_h;      // [B, H]
  const T* d_out;    // or null
  int64_t d_out_ld;
  const T* h;        // [B, H]: h_t
  const bool* keep;  // [B] or null
  T* grad;           // row b at grad + b * grad_ld: H
  int64_t grad_ld;
  T* d_h_pass;       // [B, H] or null
  bool relu;
  int64_t hidden;
};

// Rows [begin, end) of one step.
void lstm_forward_step(const LstmForwardStep<float>& step, int64_t begin, int64_t end);
void lstm_forward_step(const LstmForwardStep<double>& step, int64_t begin, int64_t end);
void lstm_backward_step(const LstmBackwardStep<float>& step, int64_t begin, int64_t end);
void lstm_backward_step(const LstmBackwardStep<double>& step, int64_t begin, int64_t end);
void masked_sum_rows(const MaskedSumRows<float>& rows, int64_t begin, int64_t end);
void masked_sum_rows(const MaskedSumRows<double>& rows, int64_t begin, int64_t end);
void gru_forward_step(const GruForwardStep<float>& step, int64_t begin, int64_t end);
void gru_forward_step(const GruForwardStep<double>& step, int64_t begin, int64_t end);
void gru_backward_step(const GruBackwardStep<float>& step, int64_t begin, int64_t end);
void gru_backward_step(const GruBackwardStep<double>& step, int64_t begin, int64_t end);
void rnn_forward_step(const RnnForwardStep<float>& step, int64_t begin, int64_t end);
void rnn_forward_step(const RnnForwardStep<double>& step, int64_t begin, int64_t end);
void rnn_backward_step(const RnnBackwardStep<float>& step, int64_t begin, int64_t end);
void rnn_backward_step(const RnnBackwardStep<double>& step, int64_t begin, int64_t end);

// Which float kernels run: "avx512", "avx2" or "baseline" (x86-64 SSE2; the only one elsewhere), the best this CPU
// has unless set_recurrence_float_isa chose another (the tests run each the CPU can); "" restores the best. False
// (and nothing changed) for a name this CPU cannot run.
const char* recurrence_float_isa();
bool set_recurrence_float_isa(const std::string& name);

}  // namespace fastdp
