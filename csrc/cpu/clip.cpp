// CPU kernels of per-example row clipping (math and work split: csrc/include/fastdp/clip.h).
//
// A row is read in chunks (about kClipChunk elements, whole l15 channels); each chunk's norm^2 (and <g, x> for
// the backward) is summed in fp32 vector lanes over pieces of kLane elements, pieces and chunks in double, in a
// fixed order. Then the row is scaled (or its gradient written) in a second sweep, which re-reads the row
// from cache. Unclipped rows (scale 1, no norm term) are copied. Short l2 rows (<= kShortRow elements, e.g.
// logits) go in blocks of kRowBlock rows instead: one conversion, the block's norms, then its rows.
// fp16/bf16 are converted to fp32 on stack buffers (F16C; bf16 by bit operations, both round to nearest even).
// The fp32 loops are `omp simd` loops compiled for AVX-512, AVX2 and baseline x86-64 (target_clones, picked at
// load time). Parallel over rows (at::parallel_for), or, with fewer rows than threads, over the chunks of all
// rows in two phases (partials, then scaling); both orders give the same bits. The l15 backward keeps the
// channels' L1 norms of the first sweep ([C] floats per row) for the second.
#include "cpu/clip.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define FASTDP_CLIP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define FASTDP_CLIP_F16C 1
#else
#define FASTDP_CLIP_CLONES
#endif

namespace fastdp {
namespace {

constexpr int64_t kSub = 2048;      // elements converted / processed per call of the fp32 loops
constexpr int64_t kLane = 256;      // elements summed in fp32 vector lanes before a double accumulation
constexpr int64_t kShortRow = 64;   // l2 rows up to this long go through short_rows()
constexpr int64_t kRowBlock = 64;   // rows per block of short_rows()

// ------------------------------------------------------------------------------------------- fp32 loops

// Reductions: fp32 vector lanes over pieces of kLane elements, the pieces added in double. The bodies are
// always_inline so that every target clone (and channel_l1) gets them compiled for its ISA.
#define FASTDP_CLIP_REDUCE(total, n, expr)                  \
  double total = 0.0;                                       \
  for (int64_t i0 = 0; i0 < (n); i0 += kLane) {            \
    const int64_t i1 = std::min<int64_t>((n), i0 + kLane);  \
    float acc = 0.0f;                                       \
    _Pragma("omp simd reduction(+ : acc)")                  \
    for (int64_t i = i0; i < i1; ++i) acc += (expr);        \
    total += acc;                                           \
  }

inline __attribute__((always_inline)) double sum_abs_body(const float* x, int64_t n) {
  FASTDP_CLIP_REDUCE(total, n, x[i] < 0.0f ? -x[i] : x[i])
  return total;
}

FASTDP_CLIP_CLONES double sum_sq(const float* x, int64_t n) {
  FASTDP_CLIP_REDUCE(total, n, x[i] * x[i])
  return total;
}

FASTDP_CLIP_CLONES double sum_abs(const float* x, int64_t n) { return sum_abs_body(x, n); }

FASTDP_CLIP_CLONES double dot(const float* a, const float* b, int64_t n) {
  FASTDP_CLIP_REDUCE(total, n, a[i] * b[i])
  return total;
}

// out[c] = L1 norm of channel c of x ([channels, positions], fp32), c < channels: one call for many channels.
FASTDP_CLIP_CLONES void channel_l1(const float* x, int64_t channels, int64_t positions, float* out) {
  for (int64_t c = 0; c < channels; ++c) out[c] = static_cast<float>(sum_abs_body(x + c * positions, positions));
}

// y = s x (y may alias x).
FASTDP_CLIP_CLONES void scale(const float* x, float s, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
}

// dx = s g - coef x (l2; dx may alias g).
FASTDP_CLIP_CLONES void grad_l2(const float* g, const float* x, float s, float coef, float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = s * g[i] - coef * x[i];
}

// dx = s g - coef_c sign(x) over n elements of one l15 channel (coef_c = coef * l1_c; dx may alias g).
inline __attribute__((always_inline)) void grad_l15_body(const float* g, const float* x, float s, float coef_c,
                                                         float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float sign = (x[i] > 0.0f ? 1.0f : 0.0f) - (x[i] < 0.0f ? 1.0f : 0.0f);
    dx[i] = s * g[i] - coef_c * sign;
  }
}

FASTDP_CLIP_CLONES void grad_l15(const float* g, const float* x, float s, float coef_c, float* dx, int64_t n) {
  grad_l15_body(g, x, s, coef_c, dx, n);
}

// The same over `channels` whole channels of `positions` elements, channel c with coef * l1[c].
FASTDP_CLIP_CLONES void grad_l15_channels(const float* g, const float* x, float s, float coef, const float* l1,
                                          int64_t channels, int64_t positions, float* dx) {
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t o = c * positions;
    grad_l15_body(g + o, x + o, s, coef * l1[c], dx + o, positions);
  }
}

// ------------------------------------------------------------------------------------------ conversions

// bf16 <-> fp32 by bit operations (round to nearest even, NaN -> quiet NaN: as c10::BFloat16).
FASTDP_CLIP_CLONES void bf16_to_float(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(src[i]) << 16);
}

FASTDP_CLIP_CLONES void float_to_bf16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = __builtin_bit_cast(uint32_t, src[i]);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    dst[i] = (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
  }
}

// fp16 <-> fp32: F16C (8 at a time, round to nearest even) when the CPU has it, else c10's scalar conversion.
#ifdef FASTDP_CLIP_F16C
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return has;
}
#endif

void half_to_float(const c10::Half* src, float* dst, int64_t n) {
#ifdef FASTDP_CLIP_F16C
  if (cpu_has_f16c()) return half_to_float_f16c(reinterpret_cast<const uint16_t*>(src), dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void float_to_half(const float* src, c10::Half* dst, int64_t n) {
#ifdef FASTDP_CLIP_F16C
  if (cpu_has_f16c()) return float_to_half_f16c(src, reinterpret_cast<uint16_t*>(dst), n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// n elements as fp32: the input itself for fp32, else converted into buf (n floats).
const float* as_float(const float* x, int64_t, float*) { return x; }
const float* as_float(const c10::Half* x, int64_t n, float* buf) {
  half_to_float(x, buf, n);
  return buf;
}
const float* as_float(const c10::BFloat16* x, int64_t n, float* buf) {
  bf16_to_float(reinterpret_cast<const uint16_t*>(x), buf, n);
  return buf;
}

// n fp32 results in buf to out (fp32: the loops wrote out itself, nothing to do).
void store(const float*, int64_t, float*) {}
void store(const float* buf, int64_t n, c10::Half* out) { float_to_half(buf, out, n); }
void store(const float* buf, int64_t n, c10::BFloat16* out) {
  float_to_bf16(buf, reinterpret_cast<uint16_t*>(out), n);
}

// Where the fp32 loops write: out itself for fp32, else buf (then stored).
float* out_floats(float* out, float*) { return out; }
template <typename T>
float* out_floats(T*, float* buf) {
  return buf;
}

template <typename T>
double range_sum_sq(const T* x, int64_t n) {
  float buf[kSub];
  double total = 0.0;
  for (int64_t i = 0; i < n; i += kSub) {
    const int64_t m = std::min(kSub, n - i);
    total += sum_sq(as_float(x + i, m, buf), m);
  }
  return total;
}

template <typename T>
float range_l1(const T* x, int64_t n) {
  float buf[kSub];
  double total = 0.0;
  for (int64_t i = 0; i < n; i += kSub) {
    const int64_t m = std::min(kSub, n - i);
    total += sum_abs(as_float(x + i, m, buf), m);
  }
  return static_cast<float>(total);
}

template <typename T>
double range_dot(const T* g, const T* x, int64_t n) {
  float bg[kSub], bx[kSub];
  double total = 0.0;
  for (int64_t i = 0; i < n; i += kSub) {
    const int64_t m = std::min(kSub, n - i);
    total += dot(as_float(g + i, m, bg), as_float(x + i, m, bx), m);
  }
  return total;
}

// ------------------------------------------------------------------------------------------ rows

struct Sums {
  double norm_sq = 0.0;
  double dot = 0.0;
};

// Sums of units [u0, u1) of one row (g: nullptr in the forward). l15: the channels' L1 norms go to l1[c].
template <typename T>
Sums chunk_sums(const T* x, const T* g, const ClipShape& s, int64_t u0, int64_t u1, float* l1) {
  Sums out;
  const int64_t ulen = clip_unit_len(s);
  if (s.norm == ClipNorm::kL15) {
    float buf[kSub], a[kSub];
    const int64_t group = std::max<int64_t>(1, kSub / ulen);  // channels converted and summed per call
    for (int64_t c0 = u0; c0 < u1; c0 += group) {
      const int64_t nc = std::min(group, u1 - c0);
      if (ulen <= kSub) {
        channel_l1(as_float(x + c0 * ulen, nc * ulen, buf), nc, ulen, a);
      } else {
        a[0] = range_l1(x + c0 * ulen, ulen);  // one long channel, in pieces
      }
      for (int64_t c = 0; c < nc; ++c) {
        if (l1 != nullptr) l1[c0 + c] = a[c];
        out.norm_sq += static_cast<double>(a[c]) * static_cast<double>(a[c]);
      }
    }
  } else {
    out.norm_sq = range_sum_sq(x + u0, u1 - u0);
  }
  if (g != nullptr) out.dot = range_dot(g + u0 * ulen, x + u0 * ulen, (u1 - u0) * ulen);
  return out;
}

// Forward: y = s x over elements [e0, e1) of a row.
template <typename T>
void scale_range(const T* x, T* y, int64_t e0, int64_t e1, float s) {
  if (s == 1.0f) {  // unclipped: x exactly (NaN != 1)
    std::memcpy(y + e0, x + e0, static_cast<size_t>(e1 - e0) * sizeof(T));
    return;
  }
  float bx[kSub], by[kSub];
  for (int64_t i = e0; i < e1; i += kSub) {
    const int64_t m = std::min(kSub, e1 - i);
    float* out = out_floats(y + i, by);
    scale(as_float(x + i, m, bx), s, out, m);
    store(out, m, y + i);
  }
}

// Backward: dx over units [u0, u1) of a row, from the row's scale, coefficient and (l15) channel L1 norms.
template <typename T>
void grad_range(const T* g, const T* x, T* dx, const ClipShape& s, int64_t u0, int64_t u1, const ClipScale& cs,
                float coef, const float* l1) {
  const int64_t ulen = clip_unit_len(s);
  if (cs.scale == 1.0f && coef == 0.0f) {  // unclipped: the upstream gradient as it is
    std::memcpy(dx + u0 * ulen, g + u0 * ulen, static_cast<size_t>((u1 - u0) * ulen) * sizeof(T));
    return;
  }
  float bg[kSub], bx[kSub], bd[kSub];
  if (s.norm == ClipNorm::kL15 && ulen <= kSub) {  // whole channels, several per call
    const int64_t group = kSub / ulen;
    for (int64_t c0 = u0; c0 < u1; c0 += group) {
      const int64_t nc = std::min(group, u1 - c0), i = c0 * ulen, m = nc * ulen;
      float* out = out_floats(dx + i, bd);
      grad_l15_channels(as_float(g + i, m, bg), as_float(x + i, m, bx), cs.scale, coef, l1 + c0, nc, ulen, out);
      store(out, m, dx + i);
    }
    return;
  }
  if (s.norm == ClipNorm::kL15) {  // long channels, in pieces
    for (int64_t c = u0; c < u1; ++c) {
      const float coef_c = coef * l1[c];
      for (int64_t i = c * ulen; i < (c + 1) * ulen; i += kSub) {
        const int64_t m = std::min(kSub, (c + 1) * ulen - i);
        float* out = out_floats(dx + i, bd);
        grad_l15(as_float(g + i, m, bg), as_float(x + i, m, bx), cs.scale, coef_c, out, m);
        store(out, m, dx + i);
      }
    }
    return;
  }
  for (int64_t i = u0; i < u1; i += kSub) {
    const int64_t m = std::min(kSub, u1 - i);
    float* out = out_floats(dx + i, bd);
    grad_l2(as_float(g + i, m, bg), as_float(x + i, m, bx), cs.scale, coef, out, m);
    store(out, m, dx + i);
  }
}

// Short l2 rows (len <= kShortRow, e.g. logits): kRowBlock contiguous rows at a time, converted in one go, their
// scales computed together, then written; no per-row chunk machinery.
template <typename T>
void short_rows(const T* x, const T* g, T* out, int64_t r_begin, int64_t r_end, int64_t len, float bound) {
  float bx[kRowBlock * kShortRow], bg[kRowBlock * kShortRow], bo[kRowBlock * kShortRow];
  float norm_sq[kRowBlock], dots[kRowBlock];
  ClipScale scales[kRowBlock];
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, r_end - r0), n = rows * len;
    const float* xf = as_float(x + r0 * len, n, bx);
    const float* gf = g != nullptr ? as_float(g + r0 * len, n, bg) : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      norm_sq[r] = static_cast<float>(sum_sq(xf + r * len, len));
      dots[r] = gf != nullptr ? static_cast<float>(dot(gf + r * len, xf + r * len, len)) : 0.0f;
    }
    for (int64_t r = 0; r < rows; ++r) scales[r] = clip_scale(norm_sq[r], bound);
    float* of = out_floats(out + r0 * len, bo);
    for (int64_t r = 0; r < rows; ++r) {
      if (gf != nullptr) {
        grad_l2(gf + r * len, xf + r * len, scales[r].scale, clip_backward_coef(scales[r], dots[r]), of + r * len, len);
      } else {
        scale(xf + r * len, scales[r].scale, of + r * len, len);
      }
    }
    store(of, n, out + r0 * len);
  }
}

// Forward (g == nullptr: out = y) or backward (out = dx) over all rows.
template <typename T>
void clip_typed(const T* x, const T* g, T* out, const ClipShape& s, float bound) {
  const int64_t rows = s.rows, len = clip_row_len(s), units = clip_units(s), ulen = clip_unit_len(s);
  const int64_t per = clip_units_per_chunk(s), chunks = clip_chunks_per_row(s);
  const bool backward = g != nullptr;
  const bool keep_l1 = backward && s.norm == ClipNorm::kL15;
  auto row_of = [len](const T* p, int64_t b) { return p == nullptr ? nullptr : p + b * len; };
  auto apply = [&](int64_t b, int64_t u0, int64_t u1, const ClipScale& cs, float coef, const float* l1) {
    if (backward) {
      grad_range(g + b * len, x + b * len, out + b * len, s, u0, u1, cs, coef, l1);
    } else {
      scale_range(x + b * len, out + b * len, u0 * ulen, u1 * ulen, cs.scale);
    }
  };

  if (chunks > 1 && rows < at::get_num_threads()) {  // few long rows: chunks of all rows in parallel
    std::vector<Sums> partial(static_cast<size_t>(rows * chunks));
    std::vector<float> l1(keep_l1 ? static_cast<size_t>(rows * s.channels) : 0);
    at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = w / chunks, u0 = (w % chunks) * per;
        float* row_l1 = keep_l1 ? l1.data() + b * s.channels : nullptr;
        partial[w] = chunk_sums(x + b * len, row_of(g, b), s, u0, std::min(u0 + per, units), row_l1);
      }
    });
    std::vector<ClipScale> scales(static_cast<size_t>(rows));
    std::vector<float> coefs(static_cast<size_t>(rows));
    for (int64_t b = 0; b < rows; ++b) {
      Sums total;
      for (int64_t k = 0; k < chunks; ++k) {  // in chunk order, as the row-parallel path
        total.norm_sq += partial[b * chunks + k].norm_sq;
        total.dot += partial[b * chunks + k].dot;
      }
      scales[b] = clip_scale(static_cast<float>(total.norm_sq), bound);
      coefs[b] = clip_backward_coef(scales[b], static_cast<float>(total.dot));
    }
    at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = w / chunks, u0 = (w % chunks) * per;
        apply(b, u0, std::min(u0 + per, units), scales[b], coefs[b], keep_l1 ? l1.data() + b * s.channels : nullptr);
      }
    });
    return;
  }

  const int64_t grain = std::max<int64_t>(1, kClipChunk / std::max<int64_t>(1, len));  // rows per task
  if (s.norm == ClipNorm::kL2 && len <= kShortRow) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { short_rows(x, g, out, begin, end, len, bound); });
    return;
  }
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> l1(keep_l1 ? static_cast<size_t>(s.channels) : 0);
    for (int64_t b = begin; b < end; ++b) {
      Sums total;
      for (int64_t k = 0; k < chunks; ++k) {
        const int64_t u0 = k * per;
        const Sums p = chunk_sums(x + b * len, row_of(g, b), s, u0, std::min(u0 + per, units),
                                  keep_l1 ? l1.data() : nullptr);
        total.norm_sq += p.norm_sq;
        total.dot += p.dot;
      }
      const ClipScale cs = clip_scale(static_cast<float>(total.norm_sq), bound);
      apply(b, 0, units, cs, clip_backward_coef(cs, static_cast<float>(total.dot)), keep_l1 ? l1.data() : nullptr);
    }
  });
}

template <typename T>
void dispatch(const void* x, const void* g, void* out, const ClipShape& s, float bound) {
  clip_typed(static_cast<const T*>(x), static_cast<const T*>(g), static_cast<T*>(out), s, bound);
}

void run(const void* x, const void* g, void* out, const ClipShape& s, float bound, ScalarKind kind) {
  if (s.rows == 0 || clip_row_len(s) == 0) return;
  switch (kind) {
    case ScalarKind::kFloat32: dispatch<float>(x, g, out, s, bound); break;
    case ScalarKind::kFloat16: dispatch<c10::Half>(x, g, out, s, bound); break;
    case ScalarKind::kBFloat16: dispatch<c10::BFloat16>(x, g, out, s, bound); break;
  }
}

}  // namespace

void clip_rows_cpu(const void* x, void* y, const ClipShape& shape, float bound, ScalarKind kind) {
  run(x, nullptr, y, shape, bound, kind);
}

void clip_rows_backward_cpu(const void* grad, const void* x, void* dx, const ClipShape& shape, float bound,
                            ScalarKind kind) {
  run(x, grad, dx, shape, bound, kind);
}

}  // namespace fastdp
