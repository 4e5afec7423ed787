// Time loops of the recurrent layers on CPU (cpu/recurrence_loop.h): the Python loops of fastdp/nn/recurrent.py
// cost about 10 small kernels of a few microseconds of dispatch each per step, as much as the step's GEMM at
// B 64, H 128; here a step is one GEMM (StepGemm) and one gate kernel (cpu/recurrence.h). With several threads
// each runs whole steps on its own rows of the batch (the examples are independent): one parallel region per
// step, in which the GEMMs run on one thread each (nested parallelism is serial in ATen, MKL and oneDNN).
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

// ------------------------------------------------------------------------------------------------- GEMMs
//
// A step's GEMM y [B, N] = x [B, K] rhs [K, N] (rhs: W_hh^T, W_hr^T forward; W_hh, W_hr backward). float32 runs
// oneDNN's linear where torch was built with it (the mkldnn::_linear_pointwise op on the weight rhs^T [N, K]): its
// AVX-512 kernels take 45 us for the LSTM step at B 64, H 128 on the benchmark's CPU, at::mm (MKL) 77 us. (Packing
// the weight first, mkldnn::_reorder_linear_weight, saves 4 us a step and costs 190 us a sequence.) float64,
// float32 without oneDNN, and torch.backends.mkldnn.enabled = False run at::mm. oneDNN follows torch's oneDNN
// settings (a bf16 or tf32 fp32_precision, if the user chose one, as torch's own oneDNN ops do): that changes the
// accuracy of the G and A these loops produce, not the clipping bound, since the norms and the clipped sums are
// taken of exactly those G and A.

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

const bool* keep_rows(const at::Tensor& mask, int64_t s, int64_t b0) {
  return mask.defined() ? mask.data_ptr<bool>() + s * mask.size(1) + b0 : nullptr;
}

// These loops run below autograd (their tensors are internal buffers; the caller is an autograd.Function):
// the dispatcher then skips the autograd and view-tracking kernels of every op.
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

// At least this many rows per thread: a step of B 64, H 128 splits in two halves (a parallel region costs a few
// microseconds, a half step's GEMM and gates about 25).
constexpr int64_t kMinRows = 16;

// f(b0, b1) for chunks of the batch's rows, one per thread (the dispatch guard is thread-local: set in each)
template <class F>
void for_batch(int64_t rows, const F& f) {
  at::parallel_for(0, rows, kMinRows, [&](int64_t b0, int64_t b1) {
    const BelowAutograd guard;
    f(b0, b1);
  });
}

// y = the GEMM's result for rows of `out` (a view): in place where at::mm wrote it, else copied in
void store_rows(at::Tensor& out, const at::Tensor& result) {
  if (!result.is_same(out)) out.copy_(result);
}

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
  const at::Tensor pre = at::empty({b, 4 * hidden}, options);  // the GEMM's output where at::mm runs it
  const StepGemm gemm(w_hh.t());
  const std::optional<StepGemm> gemm_hr = proj ? std::optional<StepGemm>(StepGemm(w_hr.t())) : std::nullopt;
  T* state = states.data_ptr<T>();
  T* c = cs.data_ptr<T>();
  for (int64_t k = 0; k < t; ++k) {
    const Step st = step_at(k, t, reverse);
    for_batch(b, [&](int64_t b0, int64_t b1) {
      const int64_t n = b1 - b0;
      at::Tensor pre_rows = pre.narrow(0, b0, n);
      const at::Tensor gates_h = gemm(states.select(0, st.before).narrow(0, b0, n), pre_rows);
      const bool* keep = keep_rows(mask, st.s, b0);
      T* h_before = state + (st.before * b + b0) * out_size;
      T* h_after = state + (st.after * b + b0) * out_size;
      const LstmForwardStep<T> step{gx.data_ptr<T>() + st.s * gx.stride(0) + b0 * gx.stride(1),
                                    gx.stride(1),
                                    gates_h.data_ptr<T>(),
                                    c + (st.before * b + b0) * hidden,
                                    h_before,
                                    keep,
                                    acts.data_ptr<T>() + (st.s * b + b0) * 4 * hidden,
                                    c + (st.after * b + b0) * hidden,
                                    tanh_c.data_ptr<T>() + (st.s * b + b0) * hidden,
                                    proj ? ms.data_ptr<T>() + (st.s * b + b0) * hidden : h_after,
                                    !proj,
                                    hidden};
      lstm_forward_step(step, 0, n);
      if (proj) {
        at::Tensor h_rows = states.select(0, st.after).narrow(0, b0, n);
        store_rows(h_rows, (*gemm_hr)(ms.select(0, st.s).narrow(0, b0, n), h_rows));
        for (int64_t row = 0; keep != nullptr && row < n; ++row) {
          if (!keep[row]) {
            std::memcpy(h_after + row * out_size, h_before + row * out_size,
                        static_cast<size_t>(out_size) * sizeof(T));
          }
        }
      }
    });
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
  const at::Tensor dm_buffer = proj ? at::empty({b, hidden}, options) : at::Tensor();
  const StepGemm gemm(w_hh);
  const std::optional<StepGemm> gemm_hr = proj ? std::optional<StepGemm>(StepGemm(w_hr)) : std::nullopt;
  const int64_t d_out_ld = d_out.defined() ? d_out.stride(1) : 0;
  for (int64_t k = t - 1; k >= 0; --k) {
    const Step st = step_at(k, t, reverse);
    for_batch(b, [&](int64_t b0, int64_t b1) {
      const int64_t n = b1 - b0;
      const bool* keep = keep_rows(mask, st.s, b0);
      const T* d_out_rows = d_out.defined() ? d_out.data_ptr<T>() + st.s * d_out.stride(0) + b0 * d_out_ld : nullptr;
      T* grad_rows = grad.data_ptr<T>() + b0 * t * width + st.s * width;  // rows t * width apart
      const at::Tensor grad_s = grad.select(1, st.s).narrow(0, b0, n);
      at::Tensor dm;
      if (proj) {  // dL/dh_t is the projection's G; dL/dm_t = dL/dh_t W_hr
        const MaskedSumRows<T> rows{cur.data_ptr<T>() + b0 * out_size, d_out_rows, d_out_ld, keep,
                                    grad_rows + 4 * hidden, t * width, out_size};
        masked_sum_rows(rows, 0, n);
        at::Tensor dm_rows = dm_buffer.narrow(0, b0, n);
        dm = (*gemm_hr)(grad_s.narrow(1, 4 * hidden, out_size), dm_rows);
      }
      const LstmBackwardStep<T> step{cur.data_ptr<T>() + b0 * out_size,
                                     proj ? nullptr : d_out_rows,
                                     d_out_ld,
                                     proj ? dm.data_ptr<T>() : nullptr,
                                     dc.data_ptr<T>() + b0 * hidden,
                                     acts.data_ptr<T>() + (st.s * b + b0) * 4 * hidden,
                                     cs.data_ptr<T>() + (st.before * b + b0) * hidden,
                                     tanh_c.data_ptr<T>() + (st.s * b + b0) * hidden,
                                     keep,
                                     grad_rows,
                                     t * width,
                                     keep == nullptr ? nullptr : next.data_ptr<T>() + b0 * out_size,
                                     hidden,
                                     out_size};
      lstm_backward_step(step, 0, n);
      // dL/dh_{t-1} = dL/dpre W_hh (masked: onto the passed dL/dh of the masked rows, zero elsewhere)
      at::Tensor next_rows = next.narrow(0, b0, n);
      const at::Tensor dpre = grad_s.narrow(1, 0, 4 * hidden);
      store_rows(next_rows, keep == nullptr ? gemm(dpre, next_rows) : gemm.add(dpre, next_rows));
    });
    std::swap(cur, next);
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
  const at::Tensor gh_buffer = at::empty({b, 3 * hidden}, options);
  const StepGemm gemm(w_hh.t());
  T* state = states.data_ptr<T>();
  for (int64_t k = 0; k < t; ++k) {
    const Step st = step_at(k, t, reverse);
    for_batch(b, [&](int64_t b0, int64_t b1) {
      const int64_t n = b1 - b0;
      at::Tensor gh_rows = gh_buffer.narrow(0, b0, n);
      const at::Tensor gh = gemm(states.select(0, st.before).narrow(0, b0, n), gh_rows);
      const GruForwardStep<T> step{gx.data_ptr<T>() + st.s * gx.stride(0) + b0 * gx.stride(1),
                                   gx.stride(1),
                                   gh.data_ptr<T>(),
                                   b_hh.defined() ? b_hh.data_ptr<T>() : nullptr,
                                   state + (st.before * b + b0) * hidden,
                                   keep_rows(mask, st.s, b0),
                                   rz.data_ptr<T>() + (st.s * b + b0) * 2 * hidden,
                                   ns.data_ptr<T>() + (st.s * b + b0) * hidden,
                                   gh_n.data_ptr<T>() + (st.s * b + b0) * hidden,
                                   state + (st.after * b + b0) * hidden,
                                   hidden};
      gru_forward_step(step, 0, n);
    });
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
  const int64_t d_out_ld = d_out.defined() ? d_out.stride(1) : 0;
  for (int64_t k = t - 1; k >= 0; --k) {
    const Step st = step_at(k, t, reverse);
    for_batch(b, [&](int64_t b0, int64_t b1) {
      const int64_t n = b1 - b0;
      const GruBackwardStep<T> step{
          cur.data_ptr<T>() + b0 * hidden,
          d_out.defined() ? d_out.data_ptr<T>() + st.s * d_out.stride(0) + b0 * d_out_ld : nullptr,
          d_out_ld,
          rz.data_ptr<T>() + (st.s * b + b0) * 2 * hidden,
          ns.data_ptr<T>() + (st.s * b + b0) * hidden,
          gh_n.data_ptr<T>() + (st.s * b + b0) * hidden,
          states.data_ptr<T>() + (st.before * b + b0) * hidden,
          keep_rows(mask, st.s, b0),
          grad.data_ptr<T>() + b0 * t * 6 * hidden + st.s * 6 * hidden,
          t * 6 * hidden,
          next.data_ptr<T>() + b0 * hidden,
          hidden};
      gru_backward_step(step, 0, n);
      // dL/dh_{t-1} = dL/dh_t z (+ passed rows) + gh W_hh
      at::Tensor next_rows = next.narrow(0, b0, n);
      store_rows(next_rows, gemm.add(grad.select(1, st.s).narrow(0, b0, n).narrow(1, 3 * hidden, 3 * hidden),
                                     next_rows));
    });
    std::swap(cur, next);
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
  const at::Tensor pre_buffer = at::empty({b, hidden}, options);
  const StepGemm gemm(w_hh.t());
  T* state = states.data_ptr<T>();
  for (int64_t k = 0; k < t; ++k) {
    const Step st = step_at(k, t, reverse);
    for_batch(b, [&](int64_t b0, int64_t b1) {
      const int64_t n = b1 - b0;
      at::Tensor pre_rows = pre_buffer.narrow(0, b0, n);
      const at::Tensor pre = gemm(states.select(0, st.before).narrow(0, b0, n), pre_rows);
      const RnnForwardStep<T> step{gx.data_ptr<T>() + st.s * gx.stride(0) + b0 * gx.stride(1),
                                   gx.stride(1),
                                   pre.data_ptr<T>(),
                                   state + (st.before * b + b0) * hidden,
                                   keep_rows(mask, st.s, b0),
                                   state + (st.after * b + b0) * hidden,
                                   relu,
                                   hidden};
      rnn_forward_step(step, 0, n);
    });
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
  const int64_t d_out_ld = d_out.defined() ? d_out.stride(1) : 0;
  for (int64_t k = t - 1; k >= 0; --k) {
    const Step st = step_at(k, t, reverse);
    for_batch(b, [&](int64_t b0, int64_t b1) {
      const int64_t n = b1 - b0;
      const bool* keep = keep_rows(mask, st.s, b0);
      const RnnBackwardStep<T> step{
          cur.data_ptr<T>() + b0 * hidden,
          d_out.defined() ? d_out.data_ptr<T>() + st.s * d_out.stride(0) + b0 * d_out_ld : nullptr,
          d_out_ld,
          states.data_ptr<T>() + (st.after * b + b0) * hidden,
          keep,
          grad.data_ptr<T>() + b0 * t * hidden + st.s * hidden,
          t * hidden,
          keep == nullptr ? nullptr : next.data_ptr<T>() + b0 * hidden,
          relu,
          hidden};
      rnn_backward_step(step, 0, n);
      at::Tensor next_rows = next.narrow(0, b0, n);
      const at::Tensor grad_s = grad.select(1, st.s).narrow(0, b0, n);
      store_rows(next_rows, keep == nullptr ? gemm(grad_s, next_rows) : gemm.add(grad_s, next_rows));
    });
    std::swap(cur, next);
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
  if (ns.scalar_type() == at::kDouble) {
    return gru_backward<double>(d_out, d_h, rz, ns, gh_n, states, w_hh, mask, reverse);
  }
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
