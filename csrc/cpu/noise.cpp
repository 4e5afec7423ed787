// CPU kernel of the fused per-tensor Gaussian noise (see csrc/include/fastdp/noise.h).
//
// Written for the compiler's auto-vectoriser: a batch of kBatch Philox groups is
// computed lane by lane (rounds outside, lanes inside), then Box-Muller with
// branch-free polynomial log and sin/cos (Cephes single-precision coefficients, a few
// ulp), so every loop is straight-line arithmetic over arrays. The result is the
// fastdp noise stream up to fp32 rounding (checked against fastdp/ref/noise.py).
#include "cpu/noise.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "fastdp/philox.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTDP_NOISE_AVX512 1
#endif

namespace fastdp {
namespace {

constexpr int kBatch = 64;  // Philox groups per batch (256 elements)
static_assert(kNoiseChunk % (4 * kBatch) == 0, "a chunk holds whole batches");

inline float bits_to_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline uint32_t float_to_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// mask ? a : b, bitwise (keeps the loops free of branches for the vectoriser).
inline float select_bits(uint32_t mask, float a, float b) {
  return bits_to_float((float_to_bits(a) & mask) | (float_to_bits(b) & ~mask));
}

// ln(x) for normal x > 0 (here x in [2^-33, 1]).
inline float log_poly(float x) {
  const uint32_t bits = float_to_bits(x);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127);
  float m = bits_to_float((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  const uint32_t big = 0u - static_cast<uint32_t>(m > 1.41421356f);  // all ones if m > sqrt(2)
  m = select_bits(big, 0.5f * m, m);
  e = select_bits(big, e + 1.0f, e);
  const float f = m - 1.0f;  // [-0.293, 0.414]
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return (f + y) + 0.693359375f * e;
}

// cos(2 pi u) and sin(2 pi u) for u in (0, 1]: quadrant from 4u (exact), then
// polynomials on [-pi/4, pi/4].
inline void sincos_two_pi(float u, float* c, float* s) {
  const float v = 4.0f * u;
  const int32_t q = static_cast<int32_t>(v + 0.5f);
  const float x = (v - static_cast<float>(q)) * 1.5707963267948966f;
  const float z = x * x;
  const float sp = x + x * z * ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f);
  const float cp =
      1.0f - 0.5f * z + z * z * ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f);
  const uint32_t odd = 0u - static_cast<uint32_t>(q & 1);
  const float cv = select_bits(odd, sp, cp), sv = select_bits(odd, cp, sp);
  *c = bits_to_float(float_to_bits(cv) ^ (static_cast<uint32_t>((q + 1) & 2) << 30));  // negative in quadrants 1, 2
  *s = bits_to_float(float_to_bits(sv) ^ (static_cast<uint32_t>(q & 2) << 30));        // negative in quadrants 2, 3
}

// Philox4x32-10 rounds on a batch of counters (lane by lane: the vectoriser's loop).
__attribute__((target_clones("avx2", "default"))) void philox_batch(uint32_t (*r)[kBatch], uint64_t seed) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    for (int i = 0; i < kBatch; ++i) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * r[0][i];
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * r[2][i];
      const uint32_t c0 = static_cast<uint32_t>(p1 >> 32) ^ r[1][i] ^ k0;
      const uint32_t c2 = static_cast<uint32_t>(p0 >> 32) ^ r[3][i] ^ k1;
      r[0][i] = c0, r[1][i] = static_cast<uint32_t>(p1), r[2][i] = c2, r[3][i] = static_cast<uint32_t>(p0);
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

#ifdef FASTDP_NOISE_AVX512
// (hi, lo) 32-bit halves of a * m for 16 lanes: two 32x32->64 multiplies (even and odd lanes) and blends.
__attribute__((target("avx512f"))) inline __m512i mulhilo_avx512(__m512i a, __m512i m, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// The same rounds, 16 counters per AVX-512 register (about 1.4x the vectoriser's loop; same bits).
__attribute__((target("avx512f"))) void philox_batch_avx512(uint32_t (*r)[kBatch], uint64_t seed) {
  const __m512i m0 = _mm512_set1_epi64(0xD2511F53u), m1 = _mm512_set1_epi64(0xCD9E8D57u);
  for (int i = 0; i < kBatch; i += 16) {
    __m512i x = _mm512_loadu_si512(r[0] + i), y = _mm512_loadu_si512(r[1] + i);
    __m512i z = _mm512_loadu_si512(r[2] + i), w = _mm512_loadu_si512(r[3] + i);
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      __m512i lo0, lo1;
      const __m512i hi0 = mulhilo_avx512(x, m0, &lo0);
      const __m512i hi1 = mulhilo_avx512(z, m1, &lo1);
      x = _mm512_xor_si512(_mm512_xor_si512(hi1, y), _mm512_set1_epi32(static_cast<int>(k0)));
      z = _mm512_xor_si512(_mm512_xor_si512(hi0, w), _mm512_set1_epi32(static_cast<int>(k1)));
      y = lo1;
      w = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    _mm512_storeu_si512(r[0] + i, x);
    _mm512_storeu_si512(r[1] + i, y);
    _mm512_storeu_si512(r[2] + i, z);
    _mm512_storeu_si512(r[3] + i, w);
  }
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#else
void philox_batch_avx512(uint32_t (*r)[kBatch], uint64_t seed) { philox_batch(r, seed); }
bool cpu_has_avx512() { return false; }
#endif

// z[4 * i + j] = output j of group first_group + i, averaged over the draws.
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) void normal_batch(uint64_t first_group, const NoiseArgs& args, float* z) {
  uint32_t r[4][kBatch];
  float acc[4 * kBatch] = {};
  for (uint32_t draw = 0; draw < args.num_draws; ++draw) {
    for (int i = 0; i < kBatch; ++i) {
      const U32x4 ctr = noise_counter(first_group + i, draw, args.offset);
      r[0][i] = ctr.x, r[1][i] = ctr.y, r[2][i] = ctr.z, r[3][i] = ctr.w;
    }
    if (cpu_has_avx512()) {
      philox_batch_avx512(r, args.seed);
    } else {
      philox_batch(r, args.seed);
    }
    float n[4][kBatch];
    for (int i = 0; i < kBatch; ++i) {
      const float rad0 = __builtin_sqrtf(-2.0f * log_poly(uint_to_unit(r[0][i])));
      const float rad1 = __builtin_sqrtf(-2.0f * log_poly(uint_to_unit(r[2][i])));
      float c0, s0, c1, s1;
      sincos_two_pi(uint_to_unit(r[1][i]), &c0, &s0);
      sincos_two_pi(uint_to_unit(r[3][i]), &c1, &s1);
      n[0][i] = rad0 * c0, n[1][i] = rad0 * s0, n[2][i] = rad1 * c1, n[3][i] = rad1 * s1;
    }
    for (int i = 0; i < kBatch; ++i) {
      for (int j = 0; j < 4; ++j) acc[4 * i + j] += n[j][i];
    }
  }
  const float scale = args.num_draws == 1 ? 1.0f : 0.5f;  // 4 draws: sum / sqrt(4)
  for (int e = 0; e < 4 * kBatch; ++e) z[e] = acc[e] * scale;
}

template <typename T>
void noise_chunk(const NoiseTensor& t, int64_t begin, int64_t end, const NoiseArgs& args) {
  T* grad = static_cast<T*>(t.grad);
  T* param = static_cast<T*>(t.param);
  float z[4 * kBatch];
  for (int64_t base = begin; base < end; base += 4 * kBatch) {
    normal_batch((t.stream_start + static_cast<uint64_t>(base)) >> 2, args, z);
    const int64_t count = std::min<int64_t>(4 * kBatch, end - base);
    T* g = grad + base;
    if (args.update == NoiseUpdate::kSgdStep) {
      T* p = param + base;
      for (int64_t e = 0; e < count; ++e) {
        p[e] = static_cast<T>(static_cast<float>(p[e]) - args.step * (static_cast<float>(g[e]) + t.std * z[e]));
      }
    } else {
      for (int64_t e = 0; e < count; ++e) g[e] = static_cast<T>(static_cast<float>(g[e]) + t.std * z[e]);
    }
  }
}

// The optimizer's update of `count` elements, flags hoisted into template parameters so each loop is
// straight-line arithmetic the vectoriser takes (release_element's order of operations, element by element).
template <bool kWeightDecay, bool kMomentum, bool kNesterov>
__attribute__((always_inline)) inline void sgd_loop(const UpdateArgs& o, float grad_weight, float sign,
                                                    const float* __restrict g, float* __restrict p,
                                                    float* __restrict buf, int64_t count) {
  const float weight_decay = o.weight_decay, momentum = o.momentum, lr = o.lr;  // locals: no aliasing doubt
  for (int64_t e = 0; e < count; ++e) {
    float d = sign * g[e];
    if (kWeightDecay) d = d + weight_decay * p[e];
    if (kMomentum) {
      const float b = momentum * buf[e] + grad_weight * d;
      buf[e] = b;
      d = kNesterov ? d + momentum * b : b;
    }
    p[e] = p[e] - lr * d;
  }
}

template <bool kWeightDecay, bool kAmsgrad>
__attribute__((always_inline)) inline void adam_loop(const UpdateArgs& o, float sign, const float* __restrict g,
                                                     float* __restrict p, float* __restrict m,
                                                     float* __restrict v, float* __restrict vmax, int64_t count) {
  const float weight_decay = o.weight_decay, decay = o.decay, beta1_weight = o.beta1_weight, beta2 = o.beta2;
  const float beta2_weight = o.beta2_weight, step_size = o.step_size, bc2_sqrt = o.bc2_sqrt, eps = o.eps;
  for (int64_t e = 0; e < count; ++e) {
    float d = sign * g[e];
    if (kWeightDecay) d = d + weight_decay * p[e];
    const float q = p[e] * decay;
    const float m1 = m[e] + beta1_weight * (d - m[e]);
    const float v1 = v[e] * beta2 + beta2_weight * d * d;
    m[e] = m1;
    v[e] = v1;
    float second = v1;
    if (kAmsgrad) {
      second = vmax[e] > v1 ? vmax[e] : v1;
      vmax[e] = second;
    }
    p[e] = q - step_size * (m1 / (__builtin_sqrtf(second) / bc2_sqrt + eps));
  }
}

// Released gradients of `count` elements (g <- (g + std z) / scale), then the optimizer's update.
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) void release_batch(
    const NoiseArgs& args, const NoiseTensor& t, int64_t base, int64_t count, const float* z) {
  const UpdateArgs& o = args.opt;
  float* __restrict g = static_cast<float*>(t.grad) + base;
  const float std = t.std, scale = o.scale;
  for (int64_t e = 0; e < count; ++e) g[e] = (g[e] + std * z[e]) / scale;
  if (args.update == NoiseUpdate::kRelease) return;
  float* p = static_cast<float*>(t.param) + base;
  float* s[3];
  for (int k = 0; k < 3; ++k) s[k] = t.state[k] ? static_cast<float*>(t.state[k]) + base : nullptr;
  const float sign = o.maximize ? -1.0f : 1.0f;  // -g exactly
  const bool wd = o.weight_decay != 0.0f;
  if (args.update == NoiseUpdate::kReleaseSgd) {
    const bool momentum = o.momentum != 0.0f;
    if (!momentum) {
      wd ? sgd_loop<true, false, false>(o, 0.0f, sign, g, p, nullptr, count)
         : sgd_loop<false, false, false>(o, 0.0f, sign, g, p, nullptr, count);
    } else if (o.nesterov) {
      wd ? sgd_loop<true, true, true>(o, t.grad_weight, sign, g, p, s[0], count)
         : sgd_loop<false, true, true>(o, t.grad_weight, sign, g, p, s[0], count);
    } else {
      wd ? sgd_loop<true, true, false>(o, t.grad_weight, sign, g, p, s[0], count)
         : sgd_loop<false, true, false>(o, t.grad_weight, sign, g, p, s[0], count);
    }
    return;
  }
  if (o.amsgrad) {
    wd ? adam_loop<true, true>(o, sign, g, p, s[0], s[1], s[2], count)
       : adam_loop<false, true>(o, sign, g, p, s[0], s[1], s[2], count);
  } else {
    wd ? adam_loop<true, false>(o, sign, g, p, s[0], s[1], nullptr, count)
       : adam_loop<false, false>(o, sign, g, p, s[0], s[1], nullptr, count);
  }
}

// The release kinds (float32 only): one pass over the noisy sums, the parameters and the optimizer state, a batch
// of 4 * kBatch elements at a time (in cache between the noise, the division and the update).
void release_chunk(const NoiseTensor& t, int64_t begin, int64_t end, const NoiseArgs& args) {
  float z[4 * kBatch];
  for (int64_t base = begin; base < end; base += 4 * kBatch) {
    normal_batch((t.stream_start + static_cast<uint64_t>(base)) >> 2, args, z);
    release_batch(args, t, base, std::min<int64_t>(4 * kBatch, end - base), z);
  }
}

}  // namespace

void noise_cpu(const NoiseTensor* tensors, const int32_t* chunk_tensor, int64_t num_chunks, ScalarKind kind,
               const NoiseArgs& args) {
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const NoiseTensor& t = tensors[chunk_tensor[c]];
      const int64_t begin = (c - t.first_chunk) * kNoiseChunk;
      const int64_t end = std::min(t.numel, begin + kNoiseChunk);
      if (is_release(args.update)) {
        release_chunk(t, begin, end, args);  // float32 (checked by the binding)
        continue;
      }
      switch (kind) {
        case ScalarKind::kFloat32: noise_chunk<float>(t, begin, end, args); break;
        case ScalarKind::kFloat16: noise_chunk<c10::Half>(t, begin, end, args); break;
        case ScalarKind::kBFloat16: noise_chunk<c10::BFloat16>(t, begin, end, args); break;
      }
    }
  });
}

}  // namespace fastdp
