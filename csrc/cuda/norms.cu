// CUDA kernels of the per-example gradient norms (math and tiling: csrc/include/fastdp/norms.h).
//
// Ghost norm: block w handles work item w (example w / items, t-blocks k and n-1-k).
// For each 64 x 64 Gram tile, chunks of the t rows' and the s rows' columns are staged
// (zero-padded) in shared memory, both Gram tiles are accumulated, and their elementwise
// product is added up. A fixed-order block reduction writes the item's partial; a second
// kernel adds an example's partials in item order. int64 indexing; deterministic (no atomics).
// The tiles (GramTiles<T>, one per dtype, shared by the kernels):
// * float32: fp32 SIMT; chunks of kChunk columns staged as fp32, each of the 16 x 16
//   threads keeps a 4 x 4 sub-tile of both Gram tiles in registers (rows ty + 16 i,
//   columns tx + 16 j: no bank conflicts).
// * float16 / bfloat16: tensor cores (WMMA 16 x 16 x 16, HMMA on sm_80+), fp32 accumulation; chunks of kTcChunk columns staged in the input's type; the
//   64 x 64 tile is 4 x 4 fragments, warp w of 8 holds fragments (w / 2, 2 (w % 2) + q),
//   q = 0, 1, of both Gram tiles (same fragment type: the same element layout, so the
//   elementwise product is per register). 16-bit products are exact in fp32, so tensor
//   cores change only the order of the fp32 sums.
#include "cuda/norms.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

namespace fastdp {
namespace {

constexpr int kSide = 16;                // threads per side of the block
constexpr int kThreads = kSide * kSide;  // 256
constexpr int kSub = 4;                  // sub-tile side per thread: kSide * kSub = kGhostTile
constexpr int kChunk = 16;               // columns staged per step
static_assert(kSide * kSub == kGhostTile, "threads must cover a Gram tile");
constexpr int kTcChunk = 32;          // columns staged per step on the tensor-core path (two k-steps of 16)
constexpr int kTcLd = kTcChunk + 8;   // padded row: a multiple of 8 elements (WMMA), rows 80 B apart
constexpr int kFrag = 16;             // WMMA fragment side
static_assert(kGhostTile == 4 * kFrag && kThreads == 8 * 32, "8 warps cover 4 x 4 fragments, two each");
using Accumulator = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kFrag, kFrag, kFrag, float>;

// The Gram tiles of one block, x[t0:t0+64, k_lo:k_hi] x[s0:s0+64, k_lo:k_hi]^T (rows >= seq read as 0; x is
// [seq, k_dim]), with the shared staging they need (the kernels declare one __shared__ GramTiles<T>):
// * float (SIMT): acc[i][j] = tile[ty + 16 i][tx + 16 j] of thread (ty, tx) of 16 x 16;
// * 16-bit types (WMMA): acc[q] = this warp's fragments (w / 2, 2 (w % 2) + q).
// gram() ends with a barrier: the staging is free for the next call.
template <typename T, bool kTensorCores = !std::is_same_v<T, float>>
struct GramTiles;

template <typename T>
struct GramTiles<T, false> {
  using Acc = float[kSub][kSub];
  float sh_t[kChunk][kGhostTile + 1];  // sh_t[c][r] = x[t0 + r, k0 + c] (transposed: no bank conflicts)
  float sh_s[kChunk][kGhostTile + 1];

  __device__ __forceinline__ void gram(const T* __restrict__ x, int64_t t0, int64_t s0, int64_t seq, int64_t k_dim,
                                       int64_t k_lo, int64_t k_hi, Acc& acc) {
    const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) acc[i][j] = 0.0f;
    }
    for (int64_t k0 = k_lo; k0 < k_hi; k0 += kChunk) {
      for (int e = threadIdx.x; e < kGhostTile * kChunk; e += kThreads) {
        const int r = e / kChunk, c = e % kChunk;  // consecutive threads: consecutive columns of a row
        const int64_t k = k0 + c;
        const int64_t rt = t0 + r, rs = s0 + r;
        sh_t[c][r] = (rt < seq && k < k_hi) ? x[rt * k_dim + k] : 0.0f;
        sh_s[c][r] = (rs < seq && k < k_hi) ? x[rs * k_dim + k] : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        float vt[kSub], vs[kSub];
#pragma unroll
        for (int i = 0; i < kSub; ++i) vt[i] = sh_t[c][ty + kSide * i];
#pragma unroll
        for (int j = 0; j < kSub; ++j) vs[j] = sh_s[c][tx + kSide * j];
#pragma unroll
        for (int i = 0; i < kSub; ++i) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) acc[i][j] = fmaf(vt[i], vs[j], acc[i][j]);
        }
      }
      __syncthreads();
    }
  }

  // sum over this thread's elements of a * b
  static __device__ __forceinline__ float dot(const Acc& a, const Acc& b) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) sum = fmaf(a[i][j], b[i][j], sum);
    }
    return sum;
  }

  // tile[64 x 64] (fp32, row-major, global) = the block's accumulators
  static __device__ __forceinline__ void store(const Acc& acc, float* tile) {
    const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) tile[(ty + kSide * i) * kGhostTile + tx + kSide * j] = acc[i][j];
    }
  }
};

__device__ __forceinline__ __half zero_of(__half) { return __float2half(0.0f); }
__device__ __forceinline__ __nv_bfloat16 zero_of(__nv_bfloat16) { return __float2bfloat16(0.0f); }

template <typename T>
struct GramTiles<T, true> {
  using Acc = Accumulator[2];
  __align__(32) T sh_t[kGhostTile][kTcLd];  // sh_t[r][c] = x[t0 + r, k0 + c]
  __align__(32) T sh_s[kGhostTile][kTcLd];

  __device__ __forceinline__ void gram(const T* __restrict__ x, int64_t t0, int64_t s0, int64_t seq, int64_t k_dim,
                                       int64_t k_lo, int64_t k_hi, Acc& acc) {
    namespace wmma = nvcuda::wmma;
    const int warp = threadIdx.x / 32;
    const int frag_row = warp / 2, frag_col = 2 * (warp % 2);
    const T zero = zero_of(T{});
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
    for (int64_t k0 = k_lo; k0 < k_hi; k0 += kTcChunk) {
      for (int e = threadIdx.x; e < kGhostTile * kTcChunk; e += kThreads) {
        const int r = e / kTcChunk, c = e % kTcChunk;  // consecutive threads: consecutive columns of a row
        const int64_t k = k0 + c;
        const int64_t rt = t0 + r, rs = s0 + r;
        sh_t[r][c] = (rt < seq && k < k_hi) ? x[rt * k_dim + k] : zero;
        sh_s[r][c] = (rs < seq && k < k_hi) ? x[rs * k_dim + k] : zero;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTcChunk; kk += kFrag) {
        // A = rows of t (row-major [16, 16] at sh_t[16 r][kk]); B(k, n) = x[s row n][k]: column-major at sh_s.
        wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, &sh_t[kFrag * frag_row][kk], kTcLd);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, &sh_s[kFrag * (frag_col + q)][kk], kTcLd);
          wmma::mma_sync(acc[q], fa, fb, acc[q]);
        }
      }
      __syncthreads();
    }
  }

  // sum over this thread's elements of a * b (fragments of one type share their element layout)
  static __device__ __forceinline__ float dot(const Acc& a, const Acc& b) {
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
      for (int i = 0; i < a[q].num_elements; ++i) sum = fmaf(a[q].x[i], b[q].x[i], sum);
    }
    return sum;
  }

  static __device__ __forceinline__ void store(const Acc& acc, float* tile) {
    const int warp = threadIdx.x / 32;
    const int frag_row = warp / 2, frag_col = 2 * (warp % 2);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      nvcuda::wmma::store_matrix_sync(tile + kFrag * frag_row * kGhostTile + kFrag * (frag_col + q), acc[q],
                                      kGhostTile, nvcuda::wmma::mem_row_major);
    }
  }
};

// partial[w] = the block's sum of `local`, in a fixed order: warps by shuffles, then warp 0 over the warp sums.
__device__ __forceinline__ void write_block_sum(float local, float* warp_sums, float* __restrict__ partial,
                                                int64_t w) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) local += __shfl_down_sync(0xffffffffu, local, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (threadIdx.x == 0) partial[w] = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ghost_tiles_kernel(const T* __restrict__ a, const T* __restrict__ g, GhostNormShape shape, int64_t items,
                       int64_t num_t_blocks, float* __restrict__ partial) {
  __shared__ GramTiles<T> tiles;
  __shared__ float warp_sums[kThreads / 32];
  const int64_t w = blockIdx.x;
  const int64_t b = w / items, item = w % items;
  const int64_t seq = shape.seq;
  const T* ab = a + b * seq * shape.dim_a;
  const T* gb = g + b * seq * shape.dim_g;
  const int64_t last = num_t_blocks - 1 - item;
  float local = 0.0f;
  for (int pass = 0; pass < (last == item ? 1 : 2); ++pass) {
    const int64_t t0 = (pass == 0 ? item : last) * kGhostTile;
    for (int64_t s0 = t0; s0 < seq; s0 += kGhostTile) {
      typename GramTiles<T>::Acc ga, gg;
      tiles.gram(ab, t0, s0, seq, shape.dim_a, 0, shape.dim_a, ga);
      tiles.gram(gb, t0, s0, seq, shape.dim_g, 0, shape.dim_g, gg);
      local += (s0 == t0 ? 1.0f : 2.0f) * GramTiles<T>::dot(ga, gg);  // off-diagonal tiles: (t, s) and (s, t)
    }
  }
  write_block_sum(local, warp_sums, partial, w);
}

// (t-block, s-block), t <= s, of tile pair `pair` of the upper triangle of n x n blocks, row by row.
__device__ __forceinline__ void tile_pair(int64_t pair, int64_t n, int64_t& tb, int64_t& sb) {
  tb = 0;
  while (pair >= n - tb) {
    pair -= n - tb;
    ++tb;
  }
  sb = tb + pair;
}

// Block w = (b, pair, slice) of a split plan (fastdp/norms.h): the pair's Gram tile of example b over one column
// slice of a (slice < slices_a) or of g, into scratch tile w (64 x 64 fp32, row-major).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    ghost_slice_kernel(const T* __restrict__ a, const T* __restrict__ g, GhostNormShape shape, GhostPlan plan,
                       float* __restrict__ scratch) {
  const int64_t w = blockIdx.x;
  const int64_t slices = plan.slices_a + plan.slices_g;
  const int64_t piece = w % slices, pair = (w / slices) % plan.items, b = w / (slices * plan.items);
  int64_t tb, sb;
  tile_pair(pair, plan.t_blocks, tb, sb);
  const bool of_a = piece < plan.slices_a;
  const int64_t width = of_a ? shape.dim_a : shape.dim_g;
  const T* x = of_a ? a + b * shape.seq * shape.dim_a : g + b * shape.seq * shape.dim_g;
  const int64_t k_lo = of_a ? piece * plan.cols_a : (piece - plan.slices_a) * plan.cols_g;
  const int64_t k_hi = min(k_lo + (of_a ? plan.cols_a : plan.cols_g), width);
  __shared__ GramTiles<T> tiles;
  typename GramTiles<T>::Acc acc;
  tiles.gram(x, tb * kGhostTile, sb * kGhostTile, shape.seq, width, k_lo, k_hi, acc);
  GramTiles<T>::store(acc, scratch + w * kGhostTile * kGhostTile);
}

// Block w = (b, pair): the slices of both Gram tiles summed in slice order, multiplied, summed; partial[w] (the
// off-diagonal pairs twice).
__global__ void __launch_bounds__(kThreads)
    ghost_slices_product_kernel(const float* __restrict__ scratch, GhostNormShape shape, GhostPlan plan,
                                float* __restrict__ partial) {
  __shared__ float warp_sums[kThreads / 32];
  const int64_t w = blockIdx.x;
  const int64_t slices = plan.slices_a + plan.slices_g;
  const float* base = scratch + w * slices * kGhostTile * kGhostTile;
  float local = 0.0f;
  for (int e = threadIdx.x; e < kGhostTile * kGhostTile; e += kThreads) {
    float ga = 0.0f, gg = 0.0f;
    for (int64_t piece = 0; piece < plan.slices_a; ++piece) ga += base[piece * kGhostTile * kGhostTile + e];
    for (int64_t piece = plan.slices_a; piece < slices; ++piece) gg += base[piece * kGhostTile * kGhostTile + e];
    local = fmaf(ga, gg, local);
  }
  int64_t tb, sb;
  tile_pair(w % plan.items, plan.t_blocks, tb, sb);
  write_block_sum((tb == sb ? 1.0f : 2.0f) * local, warp_sums, partial, w);
}

// out[b] = sum of example b's item partials, in item order.
__global__ void ghost_sum_kernel(const float* __restrict__ partial, int64_t batch, int64_t items,
                                 float* __restrict__ out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  float sum = 0.0f;
  for (int64_t k = 0; k < items; ++k) sum += partial[b * items + k];
  out[b] = sum;
}

__global__ void clip_factors_kernel(const float* __restrict__ sq, int64_t layers, int64_t batch, float clip,
                                    float* __restrict__ norms, float* __restrict__ factors) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  float sum = 0.0f;
  for (int64_t l = 0; l < layers; ++l) sum += sq[l * batch + i];  // coalesced across threads
  const float norm = sqrtf(sum);                                  // IEEE (no fast-math)
  const float f = clip / (norm + kClipEps);
  norms[i] = norm;
  factors[i] = f > 1.0f ? 1.0f : f;  // not fminf: it would turn NaN into 1
}

template <typename T>
cudaError_t launch_ghost_typed(const void* a, const void* g, GhostNormShape shape, float* partial, float* scratch,
                               float* out, cudaStream_t stream) {
  const GhostPlan plan = ghost_plan(shape);
  const T* at = static_cast<const T*>(a);
  const T* gt = static_cast<const T*>(g);
  if (plan.split) {
    const int64_t blocks = shape.batch * plan.items * (plan.slices_a + plan.slices_g);
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
    ghost_slice_kernel<T><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(at, gt, shape, plan, scratch);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    ghost_slices_product_kernel<<<static_cast<unsigned int>(shape.batch * plan.items), kThreads, 0, stream>>>(
        scratch, shape, plan, partial);
  } else {
    const int64_t blocks = shape.batch * plan.items;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
    ghost_tiles_kernel<T><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(at, gt, shape, plan.items,
                                                                                      plan.t_blocks, partial);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t sum_blocks = (shape.batch + kThreads - 1) / kThreads;
  ghost_sum_kernel<<<static_cast<unsigned int>(sum_blocks), kThreads, 0, stream>>>(partial, shape.batch, plan.items,
                                                                                    out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_ghost_norm_sq_cuda(const void* a, const void* g, GhostNormShape shape, ScalarKind kind,
                                      float* partial, float* scratch, float* out, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  if (shape.seq <= 0 || shape.dim_a <= 0 || shape.dim_g <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case ScalarKind::kFloat32: return launch_ghost_typed<float>(a, g, shape, partial, scratch, out, stream);
    case ScalarKind::kFloat16: return launch_ghost_typed<__half>(a, g, shape, partial, scratch, out, stream);
    case ScalarKind::kBFloat16: return launch_ghost_typed<__nv_bfloat16>(a, g, shape, partial, scratch, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_clip_factors_cuda(const float* sq, int64_t layers, int64_t batch, float clip, float* norms,
                                     float* factors, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  const int64_t blocks = (batch + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  clip_factors_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(sq, layers, batch, clip, norms,
                                                                                  factors);
  return cudaGetLastError();
}

}  // namespace fastdp
