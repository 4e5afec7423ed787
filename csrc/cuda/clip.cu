// CUDA kernels of per-example row clipping (math and work split: csrc/include/fastdp/clip.h).
//
// Block w (256 threads) handles row chunk w: a whole row (chunks == 1) or a chunk of about kClipChunk elements
// of a row split over several blocks (few long rows). Per block:
//   1. the norm^2 (and <g, x>) of its units: l2, threads stride over 16-byte vectors of the elements (coalesced,
//      kUnroll vectors per tensor in flight per thread); l15, groups of G = min(32, next_pow2(ceil(P / V))) lanes
//      (V elements per 16-byte vector) take a channel each, sum |x| over its positions (16-byte vectors inside
//      the channel) and reduce the group with xor shuffles, so a channel's L1 norm is never split; a fixed-order
//      block reduction follows. Split rows: each block writes its partial, and a second launch adds a row's
//      partials in a fixed order before step 2.
//   2. the scale (or the backward coefficient) of the row, then a second sweep writes y (or dx) with 16-byte
//      stores. The l15 backward recomputes each channel's L1 norm in that sweep (the same lanes and order as
//      step 1, so the same bits) rather than keep [B, C] floats in memory.
// Rows on chip (clip_row_on_chip_kernel): with one block per row (chunks == 1) and rows of at most kStageBytes
// per tensor, the block first copies its row of x (and g) into dynamic shared memory with 16-byte loads (the
// copy keeps each element's address mod 16), and both sweeps read the copy: x and g are read from global memory
// once. Longer rows (clip_apply_kernel) re-read their units in step 2 (from L2 while the rows in flight fit in
// it, from HBM beyond); split rows read each chunk once in each of their two launches (clip_partial_kernel, then
// clip_apply_kernel): keeping those on chip would need a grid-wide wait between the chunks of a row.
// Vectors: a range (a block's elements, an l15 channel) whose pointers of x, g and out share their address
// mod 16 is a scalar head up to the first 16-byte boundary, 16-byte vectors, a scalar tail; pointers that do not
// share it (a view of x at an odd element offset) take scalars over the whole range. Decided per range from the
// addresses at run time; indexing is int64.
// fp32 math, IEEE sqrt and division (no fast-math), deterministic (no atomics): a thread accumulates its own
// elements in a fixed order (its vectors in turn, each in element order, then its head and tail elements) and
// the block reduction has a fixed order, so a tensor gives the same bits run to run (the copy on chip keeps the
// partition). The elements a thread takes follow the range's address mod 16, so equal values at another address
// phase may round differently in the last bits of the norm, as may the scalar kernels before this vectorisation;
// the math (fp32, the same expressions) and its one rounding to the output dtype are unchanged.
#include "cuda/clip.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fastdp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;              // l2: 16-byte loads per tensor in flight per thread
constexpr int kChannelUnroll = 2;       // l15: the same per lane of a channel (more spills with fp32)
constexpr int64_t kStageBytes = 16384;  // longest row (bytes per tensor) kept in shared memory by its block

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector

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

// 16-bit kinds <-> their bits (the same conversions as to_float / from_float).
__device__ __forceinline__ float bits_to_float(unsigned bits, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
__device__ __forceinline__ float bits_to_float(unsigned bits, __nv_bfloat16) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
}
__device__ __forceinline__ unsigned float_to_bits(float x, __half) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ unsigned float_to_bits(float x, __nv_bfloat16) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// The kVec<T> elements of a 16-byte vector as floats (element k at the k-th lowest address), and back.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[kVec<T>]) {
  if constexpr (sizeof(T) == 4) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  } else {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = bits_to_float(w[k] & 0xffffu, T());
      f[2 * k + 1] = bits_to_float(w[k] >> 16, T());
    }
  }
}
template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[kVec<T>]) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  } else {
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = float_to_bits(f[2 * k], T()) | (float_to_bits(f[2 * k + 1], T()) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// 16-byte loads and stores at a 16-byte aligned p, as single vector instructions (a uint4 assignment may be
// split into 4-byte accesses by the compiler): global memory (read-only path for loads) or, kShared, shared.
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
template <bool kShared, typename T>
__device__ __forceinline__ uint4 ld16(const T* p) {
  if constexpr (kShared) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(shared_address(p))
                 : "memory");
    return v;
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}
template <typename T>
__device__ __forceinline__ void st16_global(T* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// One element at p: global memory through the read-only path (__ldg), or (kShared) the block's copy.
template <bool kShared, typename T>
__device__ __forceinline__ float ld1(const T* p) {
  if constexpr (kShared) {
    return to_float(*p);
  } else {
    return to_float(__ldg(p));
  }
}
template <typename T>
__device__ __forceinline__ void st16_shared(T* p, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(shared_address(p)), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ unsigned phase16(const void* p) {
  return static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
}

// The scalar head of a range of n elements at p: the elements before its first 16-byte boundary (at most n).
// n (no vectors) when the range's pointers do not share their address mod 16 (co == false) or p is not
// element-aligned.
template <typename T>
__device__ __forceinline__ int64_t head_len(const T* p, bool co, int64_t n) {
  const unsigned ph = phase16(p);
  if (!co || ph % sizeof(T) != 0) return n;
  const int64_t h = static_cast<int64_t>(((16u - ph) & 15u) / sizeof(T));
  return h < n ? h : n;
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

// One round of the vector sweeps: vectors j + k kThreads (k < kUnroll) of xv (and gv when kTwo), 16 bytes each,
// zero past nv; all loads issued before any is used.
template <typename T, bool kTwo, bool kShared>
__device__ __forceinline__ void load_round(const T* xv, const T* gv, int64_t j, int64_t nv, uint4 (&a)[kUnroll],
                                           uint4 (&b)[kUnroll]) {
  constexpr int V = kVec<T>;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t jk = j + k * kThreads;
    const bool in = jk < nv;
    a[k] = in ? ld16<kShared>(xv + jk * V) : make_uint4(0u, 0u, 0u, 0u);
    b[k] = kTwo && in ? ld16<kShared>(gv + jk * V) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// ------------------------------------------------------------------------------------------ l2: elements
// x, g: the range's first element in global memory or (kShared) in the block's copy; out: global memory.

// This thread's share of (sum x^2, sum g x) over elements [0, n). Vectors j = threadIdx.x + k * kThreads in rounds
// of kUnroll (loads in flight together), each in element order, then its head and its tail element (< V each);
// no vectors: scalars i = threadIdx.x + k * kThreads in rounds of kUnroll.
template <typename T, bool kDot, bool kShared>
__device__ __forceinline__ float2 elem_sums(const T* __restrict__ x, const T* __restrict__ g, int64_t n) {
  constexpr int V = kVec<T>;
  bool co = true;
  if constexpr (kDot) co = phase16(x) == phase16(g);
  const int64_t h = head_len(x, co, n), nv = (n - h) / V, tail = h + nv * V;
  float norm_sq = 0.0f, dot = 0.0f;
  auto add = [&](float v, float w) {
    norm_sq = fmaf(v, v, norm_sq);
    if constexpr (kDot) dot = fmaf(w, v, dot);
  };
  if (nv == 0) {
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < n; i += kUnroll * kThreads) {
      float v[kUnroll], w[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t ik = i + k * kThreads;
        v[k] = ik < n ? ld1<kShared>(x + ik) : 0.0f;
        w[k] = kDot && ik < n ? ld1<kShared>(g + ik) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (i + k * kThreads < n) add(v[k], w[k]);
      }
    }
    return make_float2(norm_sq, dot);
  }
  const T* xv = x + h;  // 16-byte aligned
  const T* gv = kDot ? g + h : nullptr;
#pragma unroll 1
  for (int64_t j = threadIdx.x; j < nv; j += kUnroll * kThreads) {
    uint4 a[kUnroll], b[kUnroll];
    load_round<T, kDot, kShared>(xv, gv, j, nv, a, b);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (j + k * kThreads < nv) {
        float v[V], w[V];
        unpack<T>(a[k], v);
        if constexpr (kDot) unpack<T>(b[k], w);
#pragma unroll
        for (int e = 0; e < V; ++e) add(v[e], kDot ? w[e] : 0.0f);
      }
    }
  }
  const int64_t t = threadIdx.x;
  if (t < h) add(ld1<kShared>(x + t), kDot ? ld1<kShared>(g + t) : 0.0f);
  if (tail + t < n) add(ld1<kShared>(x + tail + t), kDot ? ld1<kShared>(g + tail + t) : 0.0f);
  return make_float2(norm_sq, dot);
}

// out[i] = x[i] * scale (forward) or scale * g[i] - coef * x[i] (backward, l2) for i in [0, n), in the partition
// of elem_sums.
template <typename T, bool kBackward, bool kShared>
__device__ __forceinline__ void elem_apply(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ out,
                                           int64_t n, float scale, float coef) {
  constexpr int V = kVec<T>;
  bool co = phase16(x) == phase16(out);
  if constexpr (kBackward) co = co && phase16(g) == phase16(x);
  const int64_t h = head_len(x, co, n), nv = (n - h) / V, tail = h + nv * V;
  auto value = [&](float v, float w) {
    if constexpr (kBackward) {
      return scale * w - coef * v;
    } else {
      return v * scale;
    }
  };
  auto store = [&](int64_t i) {
    out[i] = from_float<T>(value(ld1<kShared>(x + i), kBackward ? ld1<kShared>(g + i) : 0.0f));
  };
  if (nv == 0) {
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < n; i += kUnroll * kThreads) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (i + k * kThreads < n) store(i + k * kThreads);
      }
    }
    return;
  }
  const T* xv = x + h;  // 16-byte aligned, as are gv and ov
  const T* gv = kBackward ? g + h : nullptr;
  T* ov = out + h;
#pragma unroll 1
  for (int64_t j = threadIdx.x; j < nv; j += kUnroll * kThreads) {
    uint4 a[kUnroll], b[kUnroll];
    load_round<T, kBackward, kShared>(xv, gv, j, nv, a, b);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t jk = j + k * kThreads;
      if (jk < nv) {
        float v[V], w[V], o[V];
        unpack<T>(a[k], v);
        if constexpr (kBackward) unpack<T>(b[k], w);
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = value(v[e], kBackward ? w[e] : 0.0f);
        st16_global(ov + jk * V, pack<T>(o));
      }
    }
  }
  const int64_t t = threadIdx.x;
  if (t < h) store(t);
  if (tail + t < n) store(tail + t);
}

// ------------------------------------------------------------------------------------------ l15: channels

// f(p) for p = first, first + step, ... < end, in that order, kChannelUnroll calls a round so that their loads
// can be in flight together (unrolled by hand: the compiler's unrolling of a loop of run-time stride divides in
// int64 for the trip count).
template <typename F>
__device__ __forceinline__ void strided(int64_t first, int64_t end, int step, F&& f) {
#pragma unroll 1
  for (int64_t p = first; p < end; p += kChannelUnroll * step) {
    f(p);
#pragma unroll
    for (int k = 1; k < kChannelUnroll; ++k) {
      if (p + k * step < end) f(p + k * step);
    }
  }
}

// Lane `sub` of a channel's group of `group` lanes: adds its share of sum_p |x_p| to l1 (and of sum_p g_p x_p to
// dot) over the channel's P positions at x (g), whose scalar head is h positions: its vectors sub, sub + group,
// ... of the n_v = (P - h) / V after the head, then its head and tail positions; all P positions in scalars when
// n_v = 0. The order depends only on (P, h, sub, group): the same h gives the same bits.
template <typename T, bool kDot, bool kShared>
__device__ __forceinline__ void channel_pass(const T* __restrict__ x, const T* __restrict__ g, int64_t positions,
                                             int64_t h, int sub, int group, float& l1, float& dot) {
  constexpr int V = kVec<T>;
  const int64_t nv = (positions - h) / V;
  auto add = [&](int64_t p) {
    const float v = ld1<kShared>(x + p);
    l1 += fabsf(v);
    if constexpr (kDot) dot = fmaf(ld1<kShared>(g + p), v, dot);
  };
  if (nv == 0) {
    strided(sub, positions, group, add);
    return;
  }
  strided(sub, nv, group, [&](int64_t m) {
    float v[V], w[V];
    unpack<T>(ld16<kShared>(x + h + m * V), v);
    if constexpr (kDot) unpack<T>(ld16<kShared>(g + h + m * V), w);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      l1 += fabsf(v[e]);
      if constexpr (kDot) dot = fmaf(w[e], v[e], dot);
    }
  });
#pragma unroll 1
  for (int64_t p = sub; p < h; p += group) add(p);  // < V positions
#pragma unroll 1
  for (int64_t p = h + nv * V + sub; p < positions; p += group) add(p);  // < V positions
}

// This thread's share of (sum_c l1_c^2, sum g x) over `channels` channels of P positions at x (and g).
template <typename T, bool kDot, bool kShared>
__device__ __forceinline__ float2 channel_sums(const T* __restrict__ x, const T* __restrict__ g, int64_t channels,
                                               int64_t positions, int group) {
  bool co = true;
  if constexpr (kDot) co = phase16(x) == phase16(g);
  float norm_sq = 0.0f, dot = 0.0f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % group;
  const int per_warp = 32 / group;  // channels per warp and round
  for (int64_t base = static_cast<int64_t>(warp) * per_warp; base < channels; base += kWarps * per_warp) {
    const int64_t c = base + lane / group;  // the loop condition is uniform over the warp: shuffles are safe
    float l1 = 0.0f;
    if (c < channels) {
      const T* xc = x + c * positions;
      channel_pass<T, kDot, kShared>(xc, kDot ? g + c * positions : nullptr, positions,
                                     head_len(xc, co, positions), sub, group, l1, dot);
    }
    l1 = group_sum(l1, group);
    if (c < channels && sub == 0) norm_sq = fmaf(l1, l1, norm_sq);
  }
  return make_float2(norm_sq, dot);
}

// The l15 backward's sweep: out = scale * g - coef * l1_c * sign(x) over `channels` channels of P positions.
template <typename T, bool kShared>
__device__ __forceinline__ void channel_apply(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ out,
                                              int64_t channels, int64_t positions, int group, float scale,
                                              float coef) {
  constexpr int V = kVec<T>;
  const bool co_sums = phase16(x) == phase16(g);  // as channel_sums<T, true>: l1 with the bits of step 1
  const bool co = co_sums && phase16(out) == phase16(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % group;
  const int per_warp = 32 / group;
  for (int64_t base = static_cast<int64_t>(warp) * per_warp; base < channels; base += kWarps * per_warp) {
    const int64_t c = base + lane / group;
    const T* xc = x + c * positions;
    float l1 = 0.0f, unused = 0.0f;
    if (c < channels) {
      channel_pass<T, false, kShared>(xc, nullptr, positions, head_len(xc, co_sums, positions), sub, group, l1,
                                      unused);
    }
    l1 = group_sum(l1, group);
    if (c < channels) {
      const float coef_c = coef * l1;
      const T* gc = g + c * positions;
      T* oc = out + c * positions;
      const int64_t h = head_len(xc, co, positions), nv = (positions - h) / V;
      auto store = [&](int64_t p) {
        const float v = ld1<kShared>(xc + p);
        oc[p] = from_float<T>(scale * ld1<kShared>(gc + p) - coef_c * sign_of(v));
      };
      if (nv == 0) {
        strided(sub, positions, group, store);
      } else {
        strided(sub, nv, group, [&](int64_t m) {
          float v[V], w[V], o[V];
          unpack<T>(ld16<kShared>(xc + h + m * V), v);
          unpack<T>(ld16<kShared>(gc + h + m * V), w);
#pragma unroll
          for (int e = 0; e < V; ++e) o[e] = scale * w[e] - coef_c * sign_of(v[e]);
          st16_global(oc + h + m * V, pack<T>(o));
        });
#pragma unroll 1
        for (int64_t p = sub; p < h; p += group) store(p);  // < V positions
#pragma unroll 1
        for (int64_t p = h + nv * V + sub; p < positions; p += group) store(p);  // < V positions
      }
    }
  }
}

// --------------------------------------------------------------------------------------------- per block

// This thread's share of (norm^2, <g, x>) over `units` units at x (and g): the range's first element.
template <typename T, bool kDot, bool kShared>
__device__ __forceinline__ float2 thread_sums(const T* __restrict__ x, const T* __restrict__ g, const ClipShape& s,
                                              int64_t units, int group) {
  if (s.norm == ClipNorm::kL2) return elem_sums<T, kDot, kShared>(x, g, units);
  return channel_sums<T, kDot, kShared>(x, g, units, s.positions, group);
}

// The second sweep over `units` units at x (g, out) from the block's total (norm^2, <g, x>): y = s x, or dx.
template <typename T, bool kBackward, bool kShared>
__device__ __forceinline__ void apply_units(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ out,
                                            const ClipShape& s, int64_t units, int group, float2 total,
                                            float bound) {
  const ClipScale cs = clip_scale(total.x, bound);
  if (!kBackward) {
    elem_apply<T, false, kShared>(x, nullptr, out, units * clip_unit_len(s), cs.scale, 0.0f);
    return;
  }
  const float coef = clip_backward_coef(cs, total.y);
  if (s.norm == ClipNorm::kL2) {
    elem_apply<T, true, kShared>(x, g, out, units, cs.scale, coef);
  } else {
    channel_apply<T, kShared>(x, g, out, units, s.positions, group, cs.scale, coef);
  }
}

// A row's copy into shared memory: dst, the copy's first element in buf (16-byte aligned, at least
// n * sizeof(T) + 16 bytes) at the same address mod 16 as the source, so the source's scalar head of h elements
// and its nv vectors map onto the copy's.
template <typename T>
struct StageCopy {
  T* dst;
  int64_t h, nv;
  __device__ __forceinline__ StageCopy(const T* src, uint4* buf, int64_t n)
      : dst(reinterpret_cast<T*>(buf) + phase16(src) / sizeof(T)),
        h(head_len(src, true, n)),
        nv((n - h) / kVec<T>) {}
};

// Copies the n elements of a row of x (and, kTwo, of g) from global memory into xbuf (gbuf); xs (gs): the copies'
// first elements. kUnroll 16-byte loads per tensor in flight per thread.
template <typename T, bool kTwo>
__device__ __forceinline__ void stage_rows(const T* __restrict__ x, const T* __restrict__ g, int64_t n,
                                           uint4* xbuf, uint4* gbuf, const T*& xs, const T*& gs) {
  constexpr int V = kVec<T>;
  const StageCopy<T> cx(x, xbuf, n);
  const StageCopy<T> cg(kTwo ? g : x, kTwo ? gbuf : xbuf, kTwo ? n : 0);
  const int64_t most = kTwo && cg.nv > cx.nv ? cg.nv : cx.nv;
#pragma unroll 1
  for (int64_t j = threadIdx.x; j < most; j += kUnroll * kThreads) {
    uint4 a[kUnroll], b[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t jk = j + k * kThreads;
      a[k] = jk < cx.nv ? ld16<false>(x + cx.h + jk * V) : make_uint4(0u, 0u, 0u, 0u);
      b[k] = kTwo && jk < cg.nv ? ld16<false>(g + cg.h + jk * V) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t jk = j + k * kThreads;
      if (jk < cx.nv) st16_shared(cx.dst + cx.h + jk * V, a[k]);
      if (kTwo && jk < cg.nv) st16_shared(cg.dst + cg.h + jk * V, b[k]);
    }
  }
  // Heads and tails: < V elements each (all n for a row shorter than a vector's reach).
#pragma unroll 1
  for (int64_t i = threadIdx.x; i < cx.h; i += kThreads) cx.dst[i] = __ldg(x + i);
#pragma unroll 1
  for (int64_t i = cx.h + cx.nv * V + threadIdx.x; i < n; i += kThreads) cx.dst[i] = __ldg(x + i);
  if constexpr (kTwo) {
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < cg.h; i += kThreads) cg.dst[i] = __ldg(g + i);
#pragma unroll 1
    for (int64_t i = cg.h + cg.nv * V + threadIdx.x; i < n; i += kThreads) cg.dst[i] = __ldg(g + i);
  }
  xs = cx.dst;
  gs = kTwo ? cg.dst : nullptr;
}

// Blocks of row chunks (split rows, first launch): partial[w] (forward) or partial[2w], partial[2w + 1].
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    clip_partial_kernel(const T* __restrict__ x, const T* __restrict__ g, ClipShape s, int64_t chunks, int group,
                        float* __restrict__ partial) {
  __shared__ float2 shared[kWarps + 1];
  const int64_t w = blockIdx.x;
  const int64_t b = w / chunks, per = clip_units_per_chunk(s);
  const int64_t u0 = (w % chunks) * per, u1 = min(u0 + per, clip_units(s));
  const int64_t first = b * clip_row_len(s) + u0 * clip_unit_len(s);  // the chunk's first element
  const float2 sums =
      thread_sums<T, kBackward, false>(x + first, kBackward ? g + first : nullptr, s, u1 - u0, group);
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
// chunks == 1: two sweeps over the row in global memory (rows longer than kStageBytes).
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    clip_apply_kernel(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ out, ClipShape s,
                      int64_t chunks, int group, float bound, const float* __restrict__ partial) {
  __shared__ float2 shared[kWarps + 1];
  const int64_t w = blockIdx.x;
  const int64_t b = w / chunks, per = chunks == 1 ? clip_units(s) : clip_units_per_chunk(s);
  const int64_t u0 = (w % chunks) * per, u1 = min(u0 + per, clip_units(s)), units = u1 - u0;
  const int64_t first = b * clip_row_len(s) + u0 * clip_unit_len(s);  // the block's first element
  const T* xr = x + first;
  const T* gr = kBackward ? g + first : nullptr;
  float2 sums = make_float2(0.0f, 0.0f);
  if (chunks == 1) {
    sums = thread_sums<T, kBackward, false>(xr, gr, s, units, group);
  } else {
    for (int64_t k = threadIdx.x; k < chunks; k += kThreads) {  // the row's partials, fixed order
      sums.x += partial[(kBackward ? 2 : 1) * (b * chunks + k)];
      if (kBackward) sums.y += partial[2 * (b * chunks + k) + 1];
    }
  }
  const float2 total = block_sum2(sums.x, sums.y, shared);
  apply_units<T, kBackward, false>(xr, gr, out + first, s, units, group, total, bound);
}

// Block b: row b (chunks == 1, rows of at most kStageBytes), copied into dynamic shared memory (stage_bytes per
// tensor, from the launcher): x (and g) are read from global memory once, then both sweeps read the copy.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    clip_row_on_chip_kernel(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ out, ClipShape s,
                            int group, float bound, int64_t stage_bytes) {
  __shared__ float2 shared[kWarps + 1];
  extern __shared__ uint4 stage[];
  const int64_t len = clip_row_len(s), first = static_cast<int64_t>(blockIdx.x) * len;
  const T* xs;
  const T* gs;
  stage_rows<T, kBackward>(x + first, kBackward ? g + first : nullptr, len, stage, stage + stage_bytes / 16, xs,
                           gs);
  __syncthreads();
  const float2 sums = thread_sums<T, kBackward, true>(xs, gs, s, clip_units(s), group);
  const float2 total = block_sum2(sums.x, sums.y, shared);
  apply_units<T, kBackward, true>(xs, gs, out + first, s, clip_units(s), group, total, bound);
}

// Lanes per l15 channel: min(32, next power of two >= the channel's 16-byte vectors ceil(P / vec)); 1 for l2
// (unused).
int lane_group(const ClipShape& s, int vec) {
  if (s.norm != ClipNorm::kL15) return 1;
  const int64_t vectors = (s.positions + vec - 1) / vec;
  int group = 1;
  while (group < 32 && group < vectors) group *= 2;
  return group;
}

template <typename T, bool kBackward>
cudaError_t launch_typed(const void* x, const void* g, void* out, ClipShape s, float bound, int64_t chunks,
                         float* partial, cudaStream_t stream) {
  const int64_t blocks = s.rows * chunks;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const int group = lane_group(s, kVec<T>);
  const T* xt = static_cast<const T*>(x);
  const T* gt = static_cast<const T*>(g);
  const int64_t row_bytes = clip_row_len(s) * static_cast<int64_t>(sizeof(T));
  if (chunks == 1 && row_bytes <= kStageBytes) {
    // A buffer per tensor: the row's bytes rounded up to 16, plus 16 for its address mod 16 (<= 32800 bytes in
    // all: under the 48 KB that needs no opt-in).
    const int64_t stage_bytes = (row_bytes + 15) / 16 * 16 + 16;
    const size_t smem = static_cast<size_t>(stage_bytes * (kBackward ? 2 : 1));
    clip_row_on_chip_kernel<T, kBackward><<<static_cast<unsigned int>(blocks), kThreads, smem, stream>>>(
        xt, gt, static_cast<T*>(out), s, group, bound, stage_bytes);
    return cudaGetLastError();
  }
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
