// CPU kernels of a recurrent layer's gates, one time step per call (math and arguments: cpu/recurrence.h).
//
// Each kernel walks its rows and, in a row, the hidden units in blocks of W lanes: GCC vector types of W floats
// (W = 16 compiled for AVX-512, 8 for AVX2, 4 for the x86-64 baseline; picked once, at the first call) or W = 1
// double. The last block of a row is read zero-padded and written partially, so any hidden size runs the same
// arithmetic. float's exp is Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial, the power
// of two from the exponent bits), its tanh Cephes' tanhf (an odd polynomial below |x| = 0.625, 1 - 2 / (e^{2|x|} +
// 1) above): relative errors ~1.2e-7 against the double functions (tests/test_recurrence_ops.py), NaN in gives NaN
// out, +-inf saturates. No fast-math; GCC contracts a * b + c into an FMA where the target has one (the AVX-512
// kernels), so the ISAs' results differ in the last bits (as MKL's GEMMs do between CPUs). double uses std::exp and
// std::tanh.
#include "cpu/recurrence.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTDP_RNN_X86 1
#pragma GCC diagnostic ignored "-Wpsabi"  // vector arguments of the always_inline helpers: never called out of line
#endif

#define FASTDP_INLINE inline __attribute__((always_inline))

namespace fastdp {
namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));

// Lanes: T the element type, V a block of W of them, M the comparison mask, U unsigned lanes (bits).
template <class Vec, class Mask, class Bits, int Lanes>
struct FloatLanes {
  using T = float;
  using V = Vec;
  using M = Mask;
  using U = Bits;
  static constexpr int W = Lanes;
};
using F16 = FloatLanes<f32x16, i32x16, u32x16, 16>;
using F8 = FloatLanes<f32x8, i32x8, u32x8, 8>;
using F4 = FloatLanes<f32x4, i32x4, u32x4, 4>;

struct D1 {
  using T = double;
  using V = double;
  static constexpr int W = 1;
};

template <class L>
FASTDP_INLINE typename L::V splat(typename L::T x) {
  return typename L::V{} + x;
}

// m ? a : b, lane by lane (m: all bits set or clear, as comparisons give)
template <class L>
FASTDP_INLINE typename L::V select(typename L::M m, typename L::V a, typename L::V b) {
  using U = typename L::U;
  return (typename L::V)(((U)m & (U)a) | (~(U)m & (U)b));
}

// Cephes expf: exp(x) for x in [-87, 88] (clamped there; NaN stays NaN)
template <class L>
FASTDP_INLINE typename L::V exp_lanes(typename L::V x) {
  using V = typename L::V;
  x = select<L>(x < -87.0f, splat<L>(-87.0f), x);
  x = select<L>(x > 88.0f, splat<L>(88.0f), x);
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2), ties to even
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = splat<L>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const typename L::U bits = ((typename L::U)__builtin_convertvector(n, typename L::M) + 127u) << 23;
  return y * (V)bits;
}

template <class L>
FASTDP_INLINE typename L::V sigmoid_lanes(typename L::V x) {
  return 1.0f / (1.0f + exp_lanes<L>(-x));
}

// Cephes tanhf
template <class L>
FASTDP_INLINE typename L::V tanh_lanes(typename L::V x) {
  using V = typename L::V;
  using U = typename L::U;
  const U sign = (U)x & 0x80000000u;
  const V a = (V)((U)x & 0x7fffffffu);
  const V big = (V)((U)(1.0f - 2.0f / (exp_lanes<L>(2.0f * a) + 1.0f)) | sign);
  const V z = x * x;
  V s = splat<L>(-5.70498872745e-3f);
  s = s * z + 2.06390887954e-2f;
  s = s * z - 5.37397155531e-2f;
  s = s * z + 1.33314422036e-1f;
  s = s * z - 3.33332819422e-1f;
  const V small = s * z * x + x;
  return select<L>(a < 0.625f, small, big);
}

// The lanes' functions by element type: float blocks above, double one at a time.
template <class L>
FASTDP_INLINE typename L::V sigmoid(typename L::V x) {
  if constexpr (L::W == 1) {
    return 1.0 / (1.0 + std::exp(-x));
  } else {
    return sigmoid_lanes<L>(x);
  }
}

template <class L>
FASTDP_INLINE typename L::V tanh(typename L::V x) {
  if constexpr (L::W == 1) {
    return std::tanh(x);
  } else {
    return tanh_lanes<L>(x);
  }
}

// relu that keeps NaN (x < 0 is false for it)
template <class L>
FASTDP_INLINE typename L::V relu(typename L::V x) {
  if constexpr (L::W == 1) {
    return x < 0 ? 0.0 : x;
  } else {
    return select<L>(x < 0.0f, splat<L>(0.0f), x);
  }
}

// [x > 0] as 1 or 0
template <class L>
FASTDP_INLINE typename L::V positive(typename L::V x) {
  if constexpr (L::W == 1) {
    return x > 0 ? 1.0 : 0.0;
  } else {
    return select<L>(x > 0.0f, splat<L>(1.0f), splat<L>(0.0f));
  }
}

// n <= W values at p (the rest of the block zero). A whole block is one fixed-size copy (a vector load or store);
// only a row's last, partial block takes a copy of variable size (a library call).
template <class L>
FASTDP_INLINE typename L::V load(const typename L::T* p, int64_t n) {
  if constexpr (L::W == 1) {
    return *p;
  } else {
    typename L::V v{};
    if (n == L::W) {
      std::memcpy(&v, p, sizeof v);
    } else {
      std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(typename L::T));
    }
    return v;
  }
}

template <class L>
FASTDP_INLINE void store(typename L::T* p, typename L::V v, int64_t n) {
  if constexpr (L::W == 1) {
    *p = v;
  } else if (n == L::W) {
    std::memcpy(p, &v, sizeof v);
  } else {
    std::memcpy(p, &v, static_cast<size_t>(n) * sizeof(typename L::T));
  }
}

template <class T>
FASTDP_INLINE void copy_row(T* dst, const T* src, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
}

template <class T>
FASTDP_INLINE void zero_row(T* dst, int64_t n) {
  std::fill(dst, dst + n, T(0));
}

// ------------------------------------------------------------------------------------------------ kernels

template <class L>
FASTDP_INLINE void lstm_forward_rows(const LstmForwardStep<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  using V = typename L::V;
  const int64_t h = a.hidden;
  for (int64_t b = begin; b < end; ++b) {
    const T* gx = a.gx + b * a.gx_ld;
    const T* pre = a.pre + b * 4 * h;
    const T* c_prev = a.c_prev + b * h;
    T* acts = a.acts + b * 4 * h;
    T* c_next = a.c_next + b * h;
    T* tanh_c = a.tanh_c + b * h;
    T* out = a.out + b * h;
    const bool keep = a.keep == nullptr || a.keep[b];
    for (int64_t j = 0; j < h; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, h - j);
      const V i = sigmoid<L>(load<L>(gx + j, n) + load<L>(pre + j, n));
      const V f = sigmoid<L>(load<L>(gx + h + j, n) + load<L>(pre + h + j, n));
      const V g = tanh<L>(load<L>(gx + 2 * h + j, n) + load<L>(pre + 2 * h + j, n));
      const V o = sigmoid<L>(load<L>(gx + 3 * h + j, n) + load<L>(pre + 3 * h + j, n));
      store<L>(acts + j, i, n);
      store<L>(acts + h + j, f, n);
      store<L>(acts + 2 * h + j, g, n);
      store<L>(acts + 3 * h + j, o, n);
      const V cp = load<L>(c_prev + j, n);
      const V c = f * cp + i * g;
      const V tc = tanh<L>(c);
      store<L>(tanh_c + j, tc, n);
      store<L>(c_next + j, keep ? c : cp, n);
      store<L>(out + j, o * tc, n);
    }
    if (!keep && a.keeps_prev) copy_row(out, a.h_prev + b * h, h);
  }
}

template <class L>
FASTDP_INLINE void lstm_backward_rows(const LstmBackwardStep<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  using V = typename L::V;
  const int64_t h = a.hidden;
  for (int64_t b = begin; b < end; ++b) {
    const T* d_h = a.d_h + b * a.out_size;
    T* grad = a.grad + b * a.grad_ld;
    if (a.keep != nullptr && !a.keep[b]) {  // zero gradient; dL/dh and dL/dc pass through
      zero_row(grad, 4 * h);
      if (a.d_h_pass != nullptr) copy_row(a.d_h_pass + b * a.out_size, d_h, a.out_size);
      continue;
    }
    const T* d_out = a.d_out == nullptr ? nullptr : a.d_out + b * a.d_out_ld;
    const T* dm_row = a.dm == nullptr ? nullptr : a.dm + b * h;
    const T* acts = a.acts + b * 4 * h;
    const T* c_prev = a.c_prev + b * h;
    const T* tanh_c = a.tanh_c + b * h;
    T* d_c = a.d_c + b * h;
    for (int64_t j = 0; j < h; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, h - j);
      V dm;
      if (dm_row != nullptr) {
        dm = load<L>(dm_row + j, n);
      } else {
        dm = load<L>(d_h + j, n);
        if (d_out != nullptr) dm = dm + load<L>(d_out + j, n);
      }
      const V i = load<L>(acts + j, n);
      const V f = load<L>(acts + h + j, n);
      const V g = load<L>(acts + 2 * h + j, n);
      const V o = load<L>(acts + 3 * h + j, n);
      const V tc = load<L>(tanh_c + j, n);
      const V dc = load<L>(d_c + j, n) + dm * ((1 - tc * tc) * o);
      store<L>(grad + j, dc * ((i - i * i) * g), n);
      store<L>(grad + h + j, dc * ((f - f * f) * load<L>(c_prev + j, n)), n);
      store<L>(grad + 2 * h + j, dc * ((1 - g * g) * i), n);
      store<L>(grad + 3 * h + j, dm * ((o - o * o) * tc), n);
      store<L>(d_c + j, dc * f, n);
    }
    if (a.d_h_pass != nullptr) zero_row(a.d_h_pass + b * a.out_size, a.out_size);
  }
}

template <class L>
FASTDP_INLINE void masked_sum(const MaskedSumRows<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  for (int64_t b = begin; b < end; ++b) {
    T* out = a.out + b * a.out_ld;
    if (a.keep != nullptr && !a.keep[b]) {
      zero_row(out, a.n);
      continue;
    }
    const T* x = a.a + b * a.n;
    const T* d = a.d == nullptr ? nullptr : a.d + b * a.d_ld;
    for (int64_t j = 0; j < a.n; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, a.n - j);
      typename L::V v = load<L>(x + j, n);
      if (d != nullptr) v = v + load<L>(d + j, n);
      store<L>(out + j, v, n);
    }
  }
}

template <class L>
FASTDP_INLINE void gru_forward_rows(const GruForwardStep<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  using V = typename L::V;
  const int64_t h = a.hidden;
  for (int64_t b = begin; b < end; ++b) {
    const T* gx = a.gx + b * a.gx_ld;
    const T* gh = a.gh + b * 3 * h;
    const T* h_prev = a.h_prev + b * h;
    T* rz = a.rz + b * 2 * h;
    T* n_out = a.n + b * h;
    T* gh_n = a.gh_n + b * h;
    T* h_next = a.h_next + b * h;
    const bool keep = a.keep == nullptr || a.keep[b];
    for (int64_t j = 0; j < h; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, h - j);
      V hr = load<L>(gh + j, n), hz = load<L>(gh + h + j, n), hn = load<L>(gh + 2 * h + j, n);
      if (a.b_hh != nullptr) {
        hr = hr + load<L>(a.b_hh + j, n);
        hz = hz + load<L>(a.b_hh + h + j, n);
        hn = hn + load<L>(a.b_hh + 2 * h + j, n);
      }
      const V r = sigmoid<L>(load<L>(gx + j, n) + hr);
      const V z = sigmoid<L>(load<L>(gx + h + j, n) + hz);
      const V cand = tanh<L>(load<L>(gx + 2 * h + j, n) + r * hn);
      const V hp = load<L>(h_prev + j, n);
      store<L>(rz + j, r, n);
      store<L>(rz + h + j, z, n);
      store<L>(gh_n + j, hn, n);
      store<L>(n_out + j, cand, n);
      store<L>(h_next + j, keep ? cand + z * (hp - cand) : hp, n);
    }
  }
}

template <class L>
FASTDP_INLINE void gru_backward_rows(const GruBackwardStep<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  using V = typename L::V;
  const int64_t h = a.hidden;
  for (int64_t b = begin; b < end; ++b) {
    const T* d_h = a.d_h + b * h;
    T* grad = a.grad + b * a.grad_ld;
    T* d_h_next = a.d_h_next + b * h;
    if (a.keep != nullptr && !a.keep[b]) {
      zero_row(grad, 6 * h);
      copy_row(d_h_next, d_h, h);
      continue;
    }
    const T* d_out = a.d_out == nullptr ? nullptr : a.d_out + b * a.d_out_ld;
    const T* rz = a.rz + b * 2 * h;
    const T* n_in = a.n + b * h;
    const T* gh_n = a.gh_n + b * h;
    const T* h_prev = a.h_prev + b * h;
    for (int64_t j = 0; j < h; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, h - j);
      V dh = load<L>(d_h + j, n);
      if (d_out != nullptr) dh = dh + load<L>(d_out + j, n);
      const V r = load<L>(rz + j, n);
      const V z = load<L>(rz + h + j, n);
      const V cand = load<L>(n_in + j, n);
      const V gx_n = dh * ((1 - cand * cand) * (1 - z));
      const V g_r = gx_n * ((r - r * r) * load<L>(gh_n + j, n));
      const V g_z = dh * ((load<L>(h_prev + j, n) - cand) * (z - z * z));
      store<L>(grad + j, g_r, n);
      store<L>(grad + h + j, g_z, n);
      store<L>(grad + 2 * h + j, gx_n, n);
      store<L>(grad + 3 * h + j, g_r, n);
      store<L>(grad + 4 * h + j, g_z, n);
      store<L>(grad + 5 * h + j, gx_n * r, n);
      store<L>(d_h_next + j, dh * z, n);
    }
  }
}

template <class L>
FASTDP_INLINE void rnn_forward_rows(const RnnForwardStep<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  using V = typename L::V;
  const int64_t h = a.hidden;
  for (int64_t b = begin; b < end; ++b) {
    const T* gx = a.gx + b * a.gx_ld;
    const T* pre = a.pre + b * h;
    T* h_next = a.h_next + b * h;
    if (a.keep != nullptr && !a.keep[b]) {
      copy_row(h_next, a.h_prev + b * h, h);
      continue;
    }
    for (int64_t j = 0; j < h; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, h - j);
      const V x = load<L>(gx + j, n) + load<L>(pre + j, n);
      store<L>(h_next + j, a.relu ? relu<L>(x) : tanh<L>(x), n);
    }
  }
}

template <class L>
FASTDP_INLINE void rnn_backward_rows(const RnnBackwardStep<typename L::T>& a, int64_t begin, int64_t end) {
  using T = typename L::T;
  using V = typename L::V;
  const int64_t h = a.hidden;
  for (int64_t b = begin; b < end; ++b) {
    const T* d_h = a.d_h + b * h;
    T* grad = a.grad + b * a.grad_ld;
    if (a.keep != nullptr && !a.keep[b]) {
      zero_row(grad, h);
      if (a.d_h_pass != nullptr) copy_row(a.d_h_pass + b * h, d_h, h);
      continue;
    }
    const T* d_out = a.d_out == nullptr ? nullptr : a.d_out + b * a.d_out_ld;
    const T* y = a.h + b * h;
    for (int64_t j = 0; j < h; j += L::W) {
      const int64_t n = std::min<int64_t>(L::W, h - j);
      V dh = load<L>(d_h + j, n);
      if (d_out != nullptr) dh = dh + load<L>(d_out + j, n);
      const V out = load<L>(y + j, n);
      store<L>(grad + j, dh * (a.relu ? positive<L>(out) : 1 - out * out), n);
    }
    if (a.d_h_pass != nullptr) zero_row(a.d_h_pass + b * h, h);
  }
}

// ------------------------------------------------------------------------------ one entry per ISA and kernel

enum class Isa { kBaseline, kAvx2, kAvx512 };

Isa best_isa() {
#ifdef FASTDP_RNN_X86
  static const Isa isa = __builtin_cpu_supports("avx512f") ? Isa::kAvx512
                         : __builtin_cpu_supports("avx2")  ? Isa::kAvx2
                                                           : Isa::kBaseline;
  return isa;
#else
  return Isa::kBaseline;
#endif
}

// the ISA the float kernels run: the CPU's best, or a lesser one set by the tests (set_recurrence_float_isa)
std::atomic<int> chosen_isa{-1};

Isa float_isa() {
  const int chosen = chosen_isa.load(std::memory_order_relaxed);
  return chosen < 0 ? best_isa() : static_cast<Isa>(chosen);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

// name##_f32(args, begin, end): the float kernel for this CPU; name##_f64: the double one.
#ifdef FASTDP_RNN_X86
#define FASTDP_RNN_KERNEL(name, rows, Args)                                                                    \
  __attribute__((target("avx512f"))) void name##_avx512(const Args<float>& a, int64_t b0, int64_t b1) {      \
    rows<F16>(a, b0, b1);                                                                                      \
  }                                                                                                            \
  __attribute__((target("avx2"))) void name##_avx2(const Args<float>& a, int64_t b0, int64_t b1) {           \
    rows<F8>(a, b0, b1);                                                                                       \
  }                                                                                                            \
  void name##_f32(const Args<float>& a, int64_t b0, int64_t b1) {                                             \
    switch (float_isa()) {                                                                                     \
      case Isa::kAvx512: return name##_avx512(a, b0, b1);                                                      \
      case Isa::kAvx2: return name##_avx2(a, b0, b1);                                                          \
      default: return rows<F4>(a, b0, b1);                                                                     \
    }                                                                                                          \
  }                                                                                                            \
  void name##_f64(const Args<double>& a, int64_t b0, int64_t b1) { rows<D1>(a, b0, b1); }
#else
#define FASTDP_RNN_KERNEL(name, rows, Args)                                                                    \
  void name##_f32(const Args<float>& a, int64_t b0, int64_t b1) { rows<F4>(a, b0, b1); }                      \
  void name##_f64(const Args<double>& a, int64_t b0, int64_t b1) { rows<D1>(a, b0, b1); }
#endif

FASTDP_RNN_KERNEL(lstm_forward, lstm_forward_rows, LstmForwardStep)
FASTDP_RNN_KERNEL(lstm_backward, lstm_backward_rows, LstmBackwardStep)
FASTDP_RNN_KERNEL(masked_sum, masked_sum, MaskedSumRows)
FASTDP_RNN_KERNEL(gru_forward, gru_forward_rows, GruForwardStep)
FASTDP_RNN_KERNEL(gru_backward, gru_backward_rows, GruBackwardStep)
FASTDP_RNN_KERNEL(rnn_forward, rnn_forward_rows, RnnForwardStep)
FASTDP_RNN_KERNEL(rnn_backward, rnn_backward_rows, RnnBackwardStep)

}  // namespace

void lstm_forward_step(const LstmForwardStep<float>& s, int64_t b0, int64_t b1) { lstm_forward_f32(s, b0, b1); }
void lstm_forward_step(const LstmForwardStep<double>& s, int64_t b0, int64_t b1) { lstm_forward_f64(s, b0, b1); }
void lstm_backward_step(const LstmBackwardStep<float>& s, int64_t b0, int64_t b1) { lstm_backward_f32(s, b0, b1); }
void lstm_backward_step(const LstmBackwardStep<double>& s, int64_t b0, int64_t b1) { lstm_backward_f64(s, b0, b1); }
void masked_sum_rows(const MaskedSumRows<float>& r, int64_t b0, int64_t b1) { masked_sum_f32(r, b0, b1); }
void masked_sum_rows(const MaskedSumRows<double>& r, int64_t b0, int64_t b1) { masked_sum_f64(r, b0, b1); }
void gru_forward_step(const GruForwardStep<float>& s, int64_t b0, int64_t b1) { gru_forward_f32(s, b0, b1); }
void gru_forward_step(const GruForwardStep<double>& s, int64_t b0, int64_t b1) { gru_forward_f64(s, b0, b1); }
void gru_backward_step(const GruBackwardStep<float>& s, int64_t b0, int64_t b1) { gru_backward_f32(s, b0, b1); }
void gru_backward_step(const GruBackwardStep<double>& s, int64_t b0, int64_t b1) { gru_backward_f64(s, b0, b1); }
void rnn_forward_step(const RnnForwardStep<float>& s, int64_t b0, int64_t b1) { rnn_forward_f32(s, b0, b1); }
void rnn_forward_step(const RnnForwardStep<double>& s, int64_t b0, int64_t b1) { rnn_forward_f64(s, b0, b1); }
void rnn_backward_step(const RnnBackwardStep<float>& s, int64_t b0, int64_t b1) { rnn_backward_f32(s, b0, b1); }
void rnn_backward_step(const RnnBackwardStep<double>& s, int64_t b0, int64_t b1) { rnn_backward_f64(s, b0, b1); }

const char* recurrence_float_isa() { return isa_name(float_isa()); }

bool set_recurrence_float_isa(const std::string& name) {
  for (const Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa) && static_cast<int>(isa) <= static_cast<int>(best_isa())) {
      chosen_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
      return true;
    }
  }
  if (name.empty()) {
    chosen_isa.store(-1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

}  // namespace fastdp
