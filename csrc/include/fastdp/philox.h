// fastdp noise stream v1: Philox4x32-10 + Box-Muller, shared by the CPU and
// CUDA kernels (and mirrored in kernels/noise.py and fastdp/ref/noise.py).
//
// For element e of a parameter list (e counts over the list with each tensor's
// start rounded up to a multiple of 4, see fastdp/ref/noise.py), draw k of K:
//   group  q = e / 4, lane = e % 4
//   ctr    = (q_lo, q_hi + (k << 28), offset_lo, offset_hi)
//   key    = (seed_lo, seed_hi)
//   r0..r3 = Philox4x32-10(ctr, key)
//   u_i    = float(r_i) * 2^-32 + 2^-33                  (fp32, in (0, 1])
//   n0, n1 = sqrt(-2 ln u0) * (cos, sin)(2 pi u1);  n2, n3 likewise from u2, u3
//   noise  = n_lane
// No torch headers here: this file compiles with plain g++ and nvcc.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTDP_HD __host__ __device__ __forceinline__
#else
#define FASTDP_HD inline
#endif

namespace fastdp {

struct U32x4 {
  uint32_t x, y, z, w;
};

FASTDP_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

// Philox4x32 with 10 rounds (Salmon et al. 2011, Random123 constants).
FASTDP_HD U32x4 philox4x32_10(U32x4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kMul0, ctr.x, &hi0);
    const uint32_t lo1 = mulhilo32(kMul1, ctr.z, &hi1);
    ctr = U32x4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// Counter of group q (4 elements), draw k, at a given 64-bit offset.
FASTDP_HD U32x4 noise_counter(uint64_t group, uint32_t draw, uint64_t offset) {
  return U32x4{static_cast<uint32_t>(group),
               static_cast<uint32_t>(group >> 32) + (draw << 28),
               static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
}

FASTDP_HD float uint_to_unit(uint32_t r) {
  // (0, 1]: never 0, so the logarithm below is finite.
  return static_cast<float>(r) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
}

// Four standard normals from one Philox call (two Box-Muller pairs).
FASTDP_HD void normal4(uint64_t group, uint32_t draw, uint64_t offset, uint64_t seed,
                       float out[4]) {
  const U32x4 r = philox4x32_10(noise_counter(group, draw, offset),
                                static_cast<uint32_t>(seed),
                                static_cast<uint32_t>(seed >> 32));
  const float u0 = uint_to_unit(r.x), u1 = uint_to_unit(r.y);
  const float u2 = uint_to_unit(r.z), u3 = uint_to_unit(r.w);
#if defined(__CUDA_ARCH__)
  const float rad0 = sqrtf(-2.0f * logf(u0)), rad1 = sqrtf(-2.0f * logf(u2));
  float s0, c0, s1, c1;
  sincospif(2.0f * u1, &s0, &c0);
  sincospif(2.0f * u3, &s1, &c1);
#else
  const float rad0 = __builtin_sqrtf(-2.0f * __builtin_logf(u0));
  const float rad1 = __builtin_sqrtf(-2.0f * __builtin_logf(u2));
  constexpr float kTwoPi = 6.283185307179586f;
  const float c0 = __builtin_cosf(kTwoPi * u1), s0 = __builtin_sinf(kTwoPi * u1);
  const float c1 = __builtin_cosf(kTwoPi * u3), s1 = __builtin_sinf(kTwoPi * u3);
#endif
  out[0] = rad0 * c0;
  out[1] = rad0 * s0;
  out[2] = rad1 * c1;
  out[3] = rad1 * s1;
}

}  // namespace fastdp
