// CUDA kernels of per-example row clipping (math and work split: csrc/include/fastdp/clip.h).
//
// Block w (256 threads) handles row chunk w: a whole row (chunks == 1) or a chunk of about kClipChunk elements
// of a row split over several blocks (few long rows). Per block:
//   1. the norm^2 (and <g, x>) of its units: l2, threads stride over the elements (coalesced, 4 loads in flight
//      per thread); l15, groups of G = min(32, next_pow2(P)) lanes take a channel each, sum |x| over its
//      positions and reduce the group with xor shuffles, so a channel's L1 norm is never split; a fixed-order
//      block reduction follows. Split rows: each block writes its partial, and a second launch adds a row's
//      partials in a fixed order before step 2.
//   2. the scale (or the backward coefficient) of the row, then a second sweep writes y (or dx); it re-reads
//      the units step 1 just read (L1/L2-hot for all but long rows). The l15 backward recomputes each channel's
//      L1 norm in that sweep rather than keep [B, C] floats in memory.
// fp32 math, IEEE sqrt and division (no fast-math), int64 indexing, deterministic (no atomics).
#include "cuda/clip.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastdp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // independent loads in flight per thread in the l2 sweeps

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float sign_of(float v) { return (v > 0.0f ? 1.0f : 0.0f) - (v < 0.0f ? 1.0f : 0.0f); }

// Sum of (a, b) over the block in a fixed order, returned to every thread. shared: kWarps + 1 slots.
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = make_float2(a, b);
  __syncthreads();
  if (warp == 0) {
    float2 v = lane < kWarps ? shared[lane] : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      v.x += __shfl_down_sync(0xffffffffu, v.x, offset);
      v.y += __shfl_down_sync(0xffffffffu, v.y, offset);
    }
    if (lane == 0) shared[kWarps] = v;
  }
  __syncthreads();
  const float2 total = shared[kWarps];
  __syncthreads();  // shared may be reused by the caller
  return total;
}

// Sum over a lane group of `group` lanes (a power of two <= 32), returned to every lane of the group.
__device__ __forceinline__ float group_sum(float v, int group) {
  for (int offset = group / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// This thread's share of (norm^2, <g, x>) over units [u0, u1) of a row (x, g: the row's first elements).
template <typename T, bool kDot>
__device__ __forceinline__ float2 thread_sums(const T* __restrict__ x, const T* __restrict__ g, const ClipShape& s,
                                              int64_t u0, int64_t u1, int group) {
  float norm_sq = 0.0f, dot = 0.0f;
  if (s.norm == ClipNorm::kL2) {
    int64_t i = u0 + threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < u1; i += kUnroll * kThreads) {
      float v[kUnroll], w[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        v[k] = to_float(x[i + k * kThreads]);
        w[k] = kDot ? to_float(g[i + k * kThreads]) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        norm_sq = fmaf(v[k], v[k], norm_sq);
        if (kDot) dot = fmaf(w[k], v[k], dot);
      }
    }
    for (; i < u1; i += kThreads) {
      const float v = to_float(x[i]);
      norm_sq = fmaf(v, v, norm_sq);
      if (kDot) dot = fmaf(to_float(g[i]), v, dot);
    }
    return make_float2(norm_sq, dot);
  }
  const int64_t positions = s.positions;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_warp = 32 / group;  // channels per warp and round
  for (int64_t base = u0 + static_cast<int64_t>(warp) * per_warp; base < u1; base += kWarps * per_warp) {
    const int64_t c = base + lane / group;  // the loop condition is uniform over the warp: shuffles are safe
    float l1 = 0.0f;
    if (c < u1) {
      for (int64_t p = lane % group; p < positions; p += group) {
        const float v = to_float(x[c * positions + p]);
        l1 += fabsf(v);
        if (kDot) dot = fmaf(to_float(g[c * positions + p]), v, dot);
      }
    }
    l1 = group_sum(l1, group);
    if (c < u1 && lane % group == 0) norm_sq = fmaf(l1, l1, norm_sq);
  }
  return make_float2(norm_sq, dot);
}

// Blocks of row chunks (MODE split, first launch): partial[w] (forward) or partial[2w], partial[2w + 1].
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    clip_partial_kernel(const T* __restrict__ x, const T* __restrict__ g, ClipShape s, int64_t chunks, int group,
                        float* __restrict__ partial) {
  __shared__ float2 shared[kWarps + 1];
  const int64_t w = blockIdx.x;
  const int64_t b = w / chunks, per = clip_units_per_chunk(s);
  const int64_t u0 = (w % chunks) * per, u1 = min(u0 + per, clip_units(s));
  const int64_t len = clip_row_len(s);
  const float2 sums = thread_sums<T, kBackward>(x + b * len, kBackward ? g + b * len : nullptr, s, u0, u1, group);
  const float2 total = block_sum2(sums.x, sums.y, shared);
  if (threadIdx.x == 0) {
    if (kBackward) {
      partial[2 * w] = total.x;
      partial[2 * w + 1] = total.y;
    } else {
      partial[w] = total.x;
    }
  }
}

// Block w: row w / chunks, chunk w % chunks. Forward: out = y; backward: out = dx (g: upstream gradient).
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    clip_apply_kernel(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ out, ClipShape s,
                      int64_t chunks, int group, float bound, const float* __restrict__ partial) {
  __shared__ float2 shared[kWarps + 1];
  const int64_t w = blockIdx.x;
  const int64_t b = w / chunks, len = clip_row_len(s), per = chunks == 1 ? clip_units(s) : clip_units_per_chunk(s);
  const int64_t u0 = (w % chunks) * per, u1 = min(u0 + per, clip_units(s));
  const T* xr = x + b * len;
  const T* gr = kBackward ? g + b * len : nullptr;
  T* outr = out + b * len;
  float2 sums = make_float2(0.0f, 0.0f);
  if (chunks == 1) {
    sums = thread_sums<T, kBackward>(xr, gr, s, u0, u1, group);
  } else {
    for (int64_t k = threadIdx.x; k < chunks; k += kThreads) {  // the row's partials, fixed order
      sums.x += partial[(kBackward ? 2 : 1) * (b * chunks + k)];
      if (kBackward) sums.y += partial[2 * (b * chunks + k) + 1];
    }
  }
  const float2 total = block_sum2(sums.x, sums.y, shared);
  const ClipScale cs = clip_scale(total.x, bound);
  if (!kBackward) {
    const float scale = cs.scale;
    for (int64_t i = u0 * clip_unit_len(s) + threadIdx.x; i < u1 * clip_unit_len(s); i += kThreads) {
      outr[i] = from_float<T>(to_float(xr[i]) * scale);
    }
    return;
  }
  const float coef = clip_backward_coef(cs, total.y);
  if (s.norm == ClipNorm::kL2) {
    for (int64_t i = u0 + threadIdx.x; i < u1; i += kThreads) {
      outr[i] = from_float<T>(cs.scale * to_float(gr[i]) - coef * to_float(xr[i]));
    }
    return;
  }
  const int64_t positions = s.positions;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_warp = 32 / group;
  for (int64_t base = u0 + static_cast<int64_t>(warp) * per_warp; base < u1; base += kWarps * per_warp) {
    const int64_t c = base + lane / group;
    float l1 = 0.0f;
    if (c < u1) {
      for (int64_t p = lane % group; p < positions; p += group) l1 += fabsf(to_float(xr[c * positions + p]));
    }
    l1 = group_sum(l1, group);
    if (c < u1) {
      const float coef_c = coef * l1;
      for (int64_t p = lane % group; p < positions; p += group) {
        const int64_t i = c * positions + p;
        const float v = to_float(xr[i]);
        outr[i] = from_float<T>(cs.scale * to_float(gr[i]) - coef_c * sign_of(v));
      }
    }
  }
}

// Lanes per l15 channel: min(32, next power of two >= P); 1 for l2 (unused).
int lane_group(const ClipShape& s) {
  if (s.norm != ClipNorm::kL15) return 1;
  int group = 1;
  while (group < 32 && group < s.positions) group *= 2;
  return group;
}

template <typename T, bool kBackward>
cudaError_t launch_typed(const void* x, const void* g, void* out, ClipShape s, float bound, int64_t chunks,
                         float* partial, cudaStream_t stream) {
  const int64_t blocks = s.rows * chunks;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const int group = lane_group(s);
  const T* xt = static_cast<const T*>(x);
  const T* gt = static_cast<const T*>(g);
  if (chunks > 1) {
    clip_partial_kernel<T, kBackward>
        <<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(xt, gt, s, chunks, group, partial);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  clip_apply_kernel<T, kBackward><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      xt, gt, static_cast<T*>(out), s, chunks, group, bound, partial);
  return cudaGetLastError();
}

template <bool kBackward>
cudaError_t launch(const void* x, const void* g, void* out, ClipShape s, float bound, ScalarKind kind, int64_t chunks,
                   float* partial, cudaStream_t stream) {
  if (s.rows == 0 || clip_row_len(s) == 0) return cudaSuccess;
  if (chunks != 1 && (chunks != clip_chunks_per_row(s) || partial == nullptr)) return cudaErrorInvalidValue;
  switch (kind) {
    case ScalarKind::kFloat32: return launch_typed<float, kBackward>(x, g, out, s, bound, chunks, partial, stream);
    case ScalarKind::kFloat16: return launch_typed<__half, kBackward>(x, g, out, s, bound, chunks, partial, stream);
    case ScalarKind::kBFloat16:
      return launch_typed<__nv_bfloat16, kBackward>(x, g, out, s, bound, chunks, partial, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_clip_rows_cuda(const void* x, void* y, ClipShape shape, float bound, ScalarKind kind,
                                  int64_t chunks, float* partial, cudaStream_t stream) {
  return launch<false>(x, nullptr, y, shape, bound, kind, chunks, partial, stream);
}

cudaError_t launch_clip_rows_backward_cuda(const void* grad, const void* x, void* dx, ClipShape shape, float bound,
                                           ScalarKind kind, int64_t chunks, float* partial, cudaStream_t stream) {
  return launch<true>(x, grad, dx, shape, bound, kind, chunks, partial, stream);
}

}  // namespace fastdp
