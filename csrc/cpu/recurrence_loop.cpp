// Time loops of the recurrent layers on CPU (cpu/recurrence_loop.h): the Python loops of fastdp/nn/recurrent.py
// cost about 10 small kernels of a few microseconds of dispatch each per step, as much as the step's GEMM at
// B 64, H 128; here a step is one GEMM (StepGemm) and one gate kernel (cpu/recurrence.h) whose rows are split over
// the threads when there are enough of them.
#include "cpu/recurrence_loop.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "cpu/recurrence.h"

namespace fastdp {
namespace {

// A step's rows are split over threads in chunks of at least this many gate values (a parallel region costs a
// few microseconds; a [64, 512] LSTM step's gates take about 10).
constexpr int64_t kChunkValues = 8192;

template <class F>
void for_rows(int64_t rows, int64_t values_per_row, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kChunkValues / std::max<int64_t>(1, values_per_row));
  at::parallel_for(0, rows, grain, f);
}

// ------------------------------------------------------------------------------------------------- GEMMs
//
// A step's GEMM y [B, N] = x [B, K] rhs [K, N] (rhs: W_hh^T, W_hr^T forward; W_hh, W_hr backward). float32 runs
// oneDNN's linear where torch was built with it (the mkldnn::_linear_pointwise op on the weight rhs^T [N, K]): its
// AVX-512 kernels take 45 us for the LSTM step at B 64, H 128 on the benchmark's CPU, at::mm (MKL) 77 us. (Packing
// the weight first, mkldnn::_reorder_linear_weight, saves 4 us a step and costs 190 us a sequence.) float64, float32 without oneDNN and with torch.backends.mkldnn.enabled
// False run at::mm.

std::atomic<bool> onednn_chosen{true};  // set_recurrence_gemm: "onednn" (where available) or "aten"

const std::optional<c10::OperatorHandle>& onednn_op(int which) {
  static const std::optional<c10::OperatorHandle> ops[2] = {
      c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""}),
      c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", "binary"}),
  };
  return ops[which];
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  torch::jit::Stack stack{x, w, c10::IValue(), "none", c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  onednn_op(0)->callBoxed(stack);
  return stack[0].toTensor();
}

at::Tensor onednn_linear_add(const at::Tensor& x, const at::Tensor& other, const at::Tensor& w) {
  torch::jit::Stack stack{x, other, w, c10::IValue(), "add"};
  onednn_op(1)->callBoxed(stack);
  return stack[0].toTensor();
}

// Whether oneDNN's linear runs here: the ops exist and give x w^T on a probe (once per process).
bool onednn_works() {
  static const bool works = [] {
    if (!onednn_op(0) || !onednn_op(1)) return false;
    try {
      const at::Tensor x = at::arange(6, at::kFloat).reshape({2, 3}), w = at::arange(12, at::kFloat).reshape({4, 3});
      const at::Tensor expected = at::mm(x, w.t());
      return at::equal(onednn_linear(x, w), expected) &&
             at::equal(onednn_linear_add(x, expected, w), expected * 2);
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
}

// oneDNN for this run's float32 steps: chosen (set_recurrence_gemm), working, and not switched off by the user
// (torch.backends.mkldnn.enabled = False)
bool onednn_runs() {
  return onednn_chosen.load(std::memory_order_relaxed) && at::globalContext().userEnabledMkldnn() && onednn_works();
}

struct StepGemm {
  at::Tensor rhs;     // [K, N]
  at::Tensor weight;  // oneDNN's weight rhs^T [N, K] contiguous, or undefined: at::mm

  explicit StepGemm(const at::Tensor& rhs_) : rhs(rhs_) {
    if (rhs.scalar_type() == at::kFloat && onednn_runs()) weight = rhs.t().contiguous();
  }

  // x rhs: into `out` (at::mm) or a new tensor (oneDNN); the result is returned
  at::Tensor operator()(const at::Tensor& x, at::Tensor& out) const {
    if (weight.defined()) return onednn_linear(x, weight);
    at::mm_out(out, x, rhs);
    return out;
  }

  // acc + x rhs: in place (at::mm) or a new tensor (oneDNN)
  at::Tensor add(const at::Tensor& x, at::Tensor& acc) const {
    if (weight.defined()) return onednn_linear_add(x, acc, weight);
    return acc.addmm_(x, rhs);
  }
};

// (position s, index of the state before it, index of the state after it) of processing step k
struct Step {
  int64_t s, before, after;
};

Step step_at(int64_t k, int64_t t, bool reverse) {
  if (reverse) {
    const int64_t s = t - 1 - k;
    return {s, s + 1, s};
  }
  return {k, k, k + 1};
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

const bool* keep_at(const at::Tensor& mask, int64_t s) {
  return mask.defined() ? mask.data_ptr<bool>() + s * mask.size(1) : nullptr;
}

// The backward's dL/dh_{t-1} = result of this step's GEMM: the next step reads it as `cur`; `next` stays a buffer
// the GEMM (at::mm) or the kernel (the passed rows, onto which the GEMM adds) can write without touching cur.
void advance(at::Tensor& cur, at::Tensor& next, const at::Tensor& result) {
  if (result.is_same(next)) {
    std::swap(cur, next);
  } else {
    cur = result;
  }
}

// These loops run below autograd (their tensors are internal buffers; the caller is an autograd.Function):
// the dispatcher then skips the autograd and view-tracking kernels of every op.
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

template <typename T>
std::vector<at::Tensor> lstm_forward(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& c0,
                                     const at::Tensor& w_hh, const at::Tensor& w_hr, const at::Tensor& mask,
                                     bool reverse) {
  const BelowAutograd guard;
  const int64_t t = gx.size(0), b = gx.size(1), hidden = gx.size(2) / 4, out_size = h0.size(1);
  const bool proj = w_hr.defined();
  const auto options = gx.options();
  at::Tensor states = at::empty({t + 1, b, out_size}, options), cs = at::empty({t + 1, b, hidden}, options);
  at::Tensor acts = at::empty({t, b, 4 * hidden}, options), tanh_c = at::empty({t, b, hidden}, options);
  at::Tensor ms = proj ? at::empty({t, b, hidden}, options) : at::Tensor();
  const int64_t first = reverse ? t : 0;
  states.select(0, first).copy_(h0);
  cs.select(0, first).copy_(c0);
  at::Tensor pre = at::empty({b, 4 * hidden}, options);  // the GEMM's output where at::mm runs it
  const StepGemm gemm(w_hh.t());
  const std::optional<StepGemm> gemm_hr = proj ? std::optional<StepGemm>(StepGemm(w_hr.t())) : std::nullopt;
  T* state = states.data_ptr<T>();
  T* c = cs.data_ptr<T>();
  for (int64_t k = 0; k < t; ++k) {
    const Step st = step_at(k, t, reverse);
    const at::Tensor gates_h = gemm(states.select(0, st.before), pre);
    const bool* keep = keep_at(mask, st.s);
    const LstmForwardStep<T> step{gx.data_ptr<T>() + st.s * gx.stride(0),
                                  gx.stride(1),
                                  gates_h.data_ptr<T>(),
                                  c + st.before * b * hidden,
                                  state + st.before * b * out_size,
                                  keep,
                                  acts.data_ptr<T>() + st.s * b * 4 * hidden,
                                  c + st.after * b * hidden,
                                  tanh_c.data_ptr<T>() + st.s * b * hidden,
                                  proj ? ms.data_ptr<T>() + st.s * b * hidden : state + st.after * b * out_size,
                                  !proj,
                                  hidden};
    for_rows(b, 6 * hidden, [&](int64_t begin, int64_t end) { lstm_forward_step(step, begin, end); });
    if (proj) {
      at::Tensor h_after = states.select(0, st.after);
      const at::Tensor projected = (*gemm_hr)(ms.select(0, st.s), h_after);
      if (!projected.is_same(h_after)) h_after.copy_(projected);
      if (keep != nullptr) {
        for (int64_t row = 0; row < b; ++row) {
          if (!keep[row]) {
            std::memcpy(state + (st.after * b + row) * out_size, state + (st.before * b + row) * out_size,
                        static_cast<size_t>(out_size) * sizeof(T));
          }
        }
      }
    }
  }
  return {states, cs, acts, tanh_c, ms};
}

template <typename T>
std::vector<at::Tensor> lstm_backward(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& d_c,
                                      const at::Tensor& acts, const at::Tensor& cs, const at::Tensor& tanh_c,
                                      const at::Tensor& w_hh, const at::Tensor& w_hr, const at::Tensor& mask,
                                      bool reverse) {
  const BelowAutograd guard;
  const int64_t t = acts.size(0), b = acts.size(1), hidden = acts.size(2) / 4, out_size = w_hh.size(1);
  const bool proj = w_hr.defined();
  const int64_t width = 4 * hidden + (proj ? out_size : 0);
  const auto options = acts.options();
  at::Tensor grad = at::empty({b, t, width}, options);  // batch-first: the carrier's layout
  at::Tensor cur = at::empty({b, out_size}, options), next = at::empty({b, out_size}, options);
  cur.copy_(d_h);
  at::Tensor dc = at::empty({b, hidden}, options);
  dc.copy_(d_c);
  at::Tensor dm_buffer = proj ? at::empty({b, hidden}, options) : at::Tensor(), dm;
  const StepGemm gemm(w_hh);
  const std::optional<StepGemm> gemm_hr = proj ? std::optional<StepGemm>(StepGemm(w_hr)) : std::nullopt;
  const T* d_out_data = ptr_or_null<T>(d_out);
  for (int64_t k = t - 1; k >= 0; --k) {
    const Step st = step_at(k, t, reverse);
    const bool* keep = keep_at(mask, st.s);
    const T* d_out_s = d_out_data == nullptr ? nullptr : d_out_data + st.s * d_out.stride(0);
    const int64_t d_out_ld = d_out.defined() ? d_out.stride(1) : 0;
    T* grad_s = grad.data_ptr<T>() + st.s * width;  // rows t * width apart
    if (proj) {  // dL/dh_t is the projection's G; dL/dm_t = dL/dh_t W_hr
      const MaskedSumRows<T> rows{cur.data_ptr<T>(), d_out_s, d_out_ld, keep, grad_s + 4 * hidden, t * width,
                                  out_size};
      for_rows(b, out_size, [&](int64_t begin, int64_t end) { masked_sum_rows(rows, begin, end); });
      dm = (*gemm_hr)(grad.select(1, st.s).narrow(1, 4 * hidden, out_size), dm_buffer);
    }
    const LstmBackwardStep<T> step{cur.data_ptr<T>(),
                                   proj ? nullptr : d_out_s,
                                   d_out_ld,
                                   proj ? dm.data_ptr<T>() : nullptr,
                                   dc.data_ptr<T>(),
                                   acts.data_ptr<T>() + st.s * b * 4 * hidden,
                                   cs.data_ptr<T>() + st.before * b * hidden,
                                   tanh_c.data_ptr<T>() + st.s * b * hidden,
                                   keep,
                                   grad_s,
                                   t * width,
                                   keep == nullptr ? nullptr : next.data_ptr<T>(),
                                   hidden,
                                   out_size};
    for_rows(b, 6 * hidden, [&](int64_t begin, int64_t end) { lstm_backward_step(step, begin, end); });
    const at::Tensor dpre = grad.select(1, st.s).narrow(1, 0, 4 * hidden);
    // masked: onto the passed dL/dh of the masked rows (zero elsewhere)
    advance(cur, next, keep == nullptr ? gemm(dpre, next) : gemm.add(dpre, next));
  }
  return {grad, cur, dc};
}

template <typename T>
std::vector<at::Tensor> gru_forward(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh,
                                    const at::Tensor& b_hh, const at::Tensor& mask, bool reverse) {
  const BelowAutograd guard;
  const int64_t t = gx.size(0), b = gx.size(1), hidden = gx.size(2) / 3;
  const auto options = gx.options();
  at::Tensor states = at::empty({t + 1, b, hidden}, options), rz = at::empty({t, b, 2 * hidden}, options);
  at::Tensor ns = at::empty({t, b, hidden}, options), gh_n = at::empty({t, b, hidden}, options);
  states.select(0, reverse ? t : 0).copy_(h0);
  at::Tensor gh_buffer = at::empty({b, 3 * hidden}, options);
  const StepGemm gemm(w_hh.t());
  T* state = states.data_ptr<T>();
  for (int64_t k = 0; k < t; ++k) {
    const Step st = step_at(k, t, reverse);
    const at::Tensor gh = gemm(states.select(0, st.before), gh_buffer);
    const GruForwardStep<T> step{gx.data_ptr<T>() + st.s * gx.stride(0),
                                 gx.stride(1),
                                 gh.data_ptr<T>(),
                                 ptr_or_null<T>(b_hh),
                                 state + st.before * b * hidden,
                                 keep_at(mask, st.s),
                                 rz.data_ptr<T>() + st.s * b * 2 * hidden,
                                 ns.data_ptr<T>() + st.s * b * hidden,
                                 gh_n.data_ptr<T>() + st.s * b * hidden,
                                 state + st.after * b * hidden,
                                 hidden};
    for_rows(b, 5 * hidden, [&](int64_t begin, int64_t end) { gru_forward_step(step, begin, end); });
  }
  return {states, rz, ns, gh_n};
}

template <typename T>
std::vector<at::Tensor> gru_backward(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& rz,
                                     const at::Tensor& ns, const at::Tensor& gh_n, const at::Tensor& states,
                                     const at::Tensor& w_hh, const at::Tensor& mask, bool reverse) {
  const BelowAutograd guard;
  const int64_t t = ns.size(0), b = ns.size(1), hidden = ns.size(2);
  const auto options = ns.options();
  at::Tensor grad = at::empty({b, t, 6 * hidden}, options);
  at::Tensor cur = at::empty({b, hidden}, options), next = at::empty({b, hidden}, options);
  cur.copy_(d_h);
  const StepGemm gemm(w_hh);
  const T* d_out_data = ptr_or_null<T>(d_out);
  for (int64_t k = t - 1; k >= 0; --k) {
    const Step st = step_at(k, t, reverse);
    const GruBackwardStep<T> step{cur.data_ptr<T>(),
                                  d_out_data == nullptr ? nullptr : d_out_data + st.s * d_out.stride(0),
                                  d_out.defined() ? d_out.stride(1) : 0,
                                  rz.data_ptr<T>() + st.s * b * 2 * hidden,
                                  ns.data_ptr<T>() + st.s * b * hidden,
                                  gh_n.data_ptr<T>() + st.s * b * hidden,
                                  states.data_ptr<T>() + st.before * b * hidden,
                                  keep_at(mask, st.s),
                                  grad.data_ptr<T>() + st.s * 6 * hidden,
                                  t * 6 * hidden,
                                  next.data_ptr<T>(),
                                  hidden};
    for_rows(b, 8 * hidden, [&](int64_t begin, int64_t end) { gru_backward_step(step, begin, end); });
    advance(cur, next, gemm.add(grad.select(1, st.s).narrow(1, 3 * hidden, 3 * hidden), next));
  }
  return {grad, cur};
}

template <typename T>
std::vector<at::Tensor> rnn_forward(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh, bool relu,
                                    const at::Tensor& mask, bool reverse) {
  const BelowAutograd guard;
  const int64_t t = gx.size(0), b = gx.size(1), hidden = gx.size(2);
  const auto options = gx.options();
  at::Tensor states = at::empty({t + 1, b, hidden}, options);
  states.select(0, reverse ? t : 0).copy_(h0);
  at::Tensor pre_buffer = at::empty({b, hidden}, options);
  const StepGemm gemm(w_hh.t());
  T* state = states.data_ptr<T>();
  for (int64_t k = 0; k < t; ++k) {
    const Step st = step_at(k, t, reverse);
    const at::Tensor pre = gemm(states.select(0, st.before), pre_buffer);
    const RnnForwardStep<T> step{gx.data_ptr<T>() + st.s * gx.stride(0),
                                 gx.stride(1),
                                 pre.data_ptr<T>(),
                                 state + st.before * b * hidden,
                                 keep_at(mask, st.s),
                                 state + st.after * b * hidden,
                                 relu,
                                 hidden};
    for_rows(b, 2 * hidden, [&](int64_t begin, int64_t end) { rnn_forward_step(step, begin, end); });
  }
  return {states};
}

template <typename T>
std::vector<at::Tensor> rnn_backward(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& states,
                                     const at::Tensor& w_hh, bool relu, const at::Tensor& mask, bool reverse) {
  const BelowAutograd guard;
  const int64_t t = states.size(0) - 1, b = states.size(1), hidden = states.size(2);
  const auto options = states.options();
  at::Tensor grad = at::empty({b, t, hidden}, options);
  at::Tensor cur = at::empty({b, hidden}, options), next = at::empty({b, hidden}, options);
  cur.copy_(d_h);
  const StepGemm gemm(w_hh);
  const T* d_out_data = ptr_or_null<T>(d_out);
  for (int64_t k = t - 1; k >= 0; --k) {
    const Step st = step_at(k, t, reverse);
    const bool* keep = keep_at(mask, st.s);
    const RnnBackwardStep<T> step{cur.data_ptr<T>(),
                                  d_out_data == nullptr ? nullptr : d_out_data + st.s * d_out.stride(0),
                                  d_out.defined() ? d_out.stride(1) : 0,
                                  states.data_ptr<T>() + st.after * b * hidden,
                                  keep,
                                  grad.data_ptr<T>() + st.s * hidden,
                                  t * hidden,
                                  keep == nullptr ? nullptr : next.data_ptr<T>(),
                                  relu,
                                  hidden};
    for_rows(b, 2 * hidden, [&](int64_t begin, int64_t end) { rnn_backward_step(step, begin, end); });
    const at::Tensor grad_s = grad.select(1, st.s);
    advance(cur, next, keep == nullptr ? gemm(grad_s, next) : gemm.add(grad_s, next));
  }
  return {grad, cur};
}

}  // namespace

const char* recurrence_gemm() { return onednn_runs() ? "onednn" : "aten"; }

bool set_recurrence_gemm(const std::string& name) {
  if (name == "aten" || name.empty()) {
    onednn_chosen.store(name.empty());
    return true;
  }
  if (name == "onednn" && onednn_works()) {
    onednn_chosen.store(true);
    return true;
  }
  return false;
}

std::vector<at::Tensor> lstm_forward_cpu(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& c0,
                                         const at::Tensor& w_hh, const at::Tensor& w_hr, const at::Tensor& mask,
                                         bool reverse) {
  if (gx.scalar_type() == at::kDouble) return lstm_forward<double>(gx, h0, c0, w_hh, w_hr, mask, reverse);
  return lstm_forward<float>(gx, h0, c0, w_hh, w_hr, mask, reverse);
}

std::vector<at::Tensor> lstm_backward_cpu(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& d_c,
                                          const at::Tensor& acts, const at::Tensor& cs, const at::Tensor& tanh_c,
                                          const at::Tensor& ms, const at::Tensor& w_hh, const at::Tensor& w_hr,
                                          const at::Tensor& mask, bool reverse) {
  (void)ms;  // the projection's A: saved for the norms, not needed here
  if (acts.scalar_type() == at::kDouble) {
    return lstm_backward<double>(d_out, d_h, d_c, acts, cs, tanh_c, w_hh, w_hr, mask, reverse);
  }
  return lstm_backward<float>(d_out, d_h, d_c, acts, cs, tanh_c, w_hh, w_hr, mask, reverse);
}

std::vector<at::Tensor> gru_forward_cpu(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh,
                                        const at::Tensor& b_hh, const at::Tensor& mask, bool reverse) {
  if (gx.scalar_type() == at::kDouble) return gru_forward<double>(gx, h0, w_hh, b_hh, mask, reverse);
  return gru_forward<float>(gx, h0, w_hh, b_hh, mask, reverse);
}

std::vector<at::Tensor> gru_backward_cpu(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& rz,
                                         const at::Tensor& ns, const at::Tensor& gh_n, const at::Tensor& states,
                                         const at::Tensor& w_hh, const at::Tensor& mask, bool reverse) {
  if (ns.scalar_type() == at::kDouble) return gru_backward<double>(d_out, d_h, rz, ns, gh_n, states, w_hh, mask, reverse);
  return gru_backward<float>(d_out, d_h, rz, ns, gh_n, states, w_hh, mask, reverse);
}

std::vector<at::Tensor> rnn_forward_cpu(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh,
                                        bool relu, const at::Tensor& mask, bool reverse) {
  if (gx.scalar_type() == at::kDouble) return rnn_forward<double>(gx, h0, w_hh, relu, mask, reverse);
  return rnn_forward<float>(gx, h0, w_hh, relu, mask, reverse);
}

std::vector<at::Tensor> rnn_backward_cpu(const at::Tensor& d_out, const at::Tensor& d_h, const at::Tensor& states,
                                         const at::Tensor& w_hh, bool relu, const at::Tensor& mask, bool reverse) {
  if (states.scalar_type() == at::kDouble) return rnn_backward<double>(d_out, d_h, states, w_hh, relu, mask, reverse);
  return rnn_backward<float>(d_out, d_h, states, w_hh, relu, mask, reverse);
}

}  // namespace fastdp
