// CUDA kernels of Björck orthonormalisation, batched over a list of matrices (math: csrc/cuda/orthogonal.h).
//
// Two tiled GEMMs per step on tensor cores, each ONE launch over every matrix: blockIdx.z picks the matrix from a
// BjorckMatrix table in device memory, and blocks whose tile lies outside that matrix return at once (the grid is
// sized by the largest matrix):
// * gram_kernel: block (j, i, l), i <= j, makes the 64 x 64 tile G[i0:, j0:] of G_l = X_l^T X_l and stores it
//   twice (G[i0:, j0:] and its transpose G[j0:, i0:]): the symmetric Gram's products are computed once;
// * bjorck_update_kernel: block (r, j, l) makes Y[r0:, j0:] = (1 + beta) X - beta (X G) on a 64 x 64 tile.
// Each stages kChunk rows of its two operands (fp32, zero-padded, coalesced row reads) in shared memory; the
// 64 x 64 output is 4 x 4 WMMA fragments of 16 x 16, warp w of 8 holds fragments (w / 2, 2 (w % 2) + q),
// q = 0, 1. Products in 3xTF32 (precision argument: kernels/orthogonal.py, whose Triton kernels do the same):
// each fp32 operand split into a TF32 high part and the TF32 rounding of the rest, then
// lo x hi + hi x lo + hi x hi accumulated in fp32 on the tensor cores (m16n16k8 TF32), the lo x lo term dropped:
// about fp32 accuracy. The tile goes through shared memory to coalesced global stores. int64 indexing;
// deterministic.
#include "cuda/orthogonal.h"

#include <mma.h>

namespace fastdp {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 256;  // 8 warps
constexpr int kTile = 64;      // output tile side
static_assert(kTile == kBjorckTile, "the launcher's tile count must match the kernels' tile");
constexpr int kChunk = 16;     // reduction rows staged per step (two TF32 k-steps of 8)
constexpr int kLd = kTile + 8;  // padded shared row: a multiple of 4 floats (WMMA), fragments 32-byte aligned
constexpr int kFrag = 16;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// big = tf32(x), small = tf32(x - big), element by element (the same layout for every fragment of a type).
template <typename Frag>
__device__ __forceinline__ void split_tf32(const Frag& x, Frag& big, Frag& small) {
#pragma unroll
  for (int e = 0; e < x.num_elements; ++e) {
    const float hi = wmma::__float_to_tf32(x.x[e]);
    big.x[e] = hi;
    small.x[e] = wmma::__float_to_tf32(x.x[e] - hi);
  }
}

// acc[q] += A B over the staged chunk, in 3xTF32: A(a, k) = sh_a[k][a] (column-major), B(k, b) = sh_b[k][b]
// (row-major); this warp's fragments (w / 2, 2 (w % 2) + q).
__device__ __forceinline__ void multiply_chunk(const float (*sh_a)[kLd], const float (*sh_b)[kLd],
                                               Accumulator (&acc)[2]) {
  const int warp = threadIdx.x / 32;
  const int frag_row = warp / 2, frag_col = 2 * (warp % 2);
#pragma unroll
  for (int kk = 0; kk < kChunk; kk += 8) {
    FragA a, a_big, a_small;
    wmma::load_matrix_sync(a, &sh_a[kk][kFrag * frag_row], kLd);
    split_tf32(a, a_big, a_small);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      FragB b, b_big, b_small;
      wmma::load_matrix_sync(b, &sh_b[kk][kFrag * (frag_col + q)], kLd);
      split_tf32(b, b_big, b_small);
      wmma::mma_sync(acc[q], a_small, b_big, acc[q]);  // the small terms first
      wmma::mma_sync(acc[q], a_big, b_small, acc[q]);
      wmma::mma_sync(acc[q], a_big, b_big, acc[q]);
    }
  }
}

// The block's 64 x 64 result into sh_out (row-major, kLd), readable by every thread after the barrier.
__device__ __forceinline__ void stage_tile(Accumulator (&acc)[2], float (*sh_out)[kLd]) {
  const int warp = threadIdx.x / 32;
  const int frag_row = warp / 2, frag_col = 2 * (warp % 2);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    wmma::store_matrix_sync(&sh_out[kFrag * frag_row][kFrag * (frag_col + q)], acc[q], kLd, wmma::mem_row_major);
  }
  __syncthreads();
}

// Block (blockIdx.x, blockIdx.y, blockIdx.z) = (column block j, column block i, matrix l), i <= j:
// G[i0 + a, j0 + b] = G[j0 + b, i0 + a] = sum_k X[k, i0 + a] X[k, j0 + b] with X = buf_l[parity], G = gram_l.
__global__ void __launch_bounds__(kThreads) gram_kernel(const BjorckMatrix* __restrict__ table, int parity) {
  __shared__ __align__(32) float sh_i[kChunk][kLd];  // sh_i[c][a] = X[k0 + c, i0 + a]
  __shared__ __align__(32) float sh_j[kChunk][kLd];  // sh_j[c][b] = X[k0 + c, j0 + b]
  __shared__ __align__(32) float sh_out[kTile][kLd];
  const BjorckMatrix mat = table[blockIdx.z];
  const int64_t m = mat.m, n = mat.n;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile;
  if (i0 > j0 || j0 >= n) return;  // the whole block: the lower triangle (mirrored) or outside this matrix
  const float* __restrict__ x = mat.buf + parity * m * n;
  float* __restrict__ gram = mat.gram;
  Accumulator acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  for (int64_t k0 = 0; k0 < m; k0 += kChunk) {
    for (int e = threadIdx.x; e < kChunk * kTile; e += kThreads) {
      const int r = e / kTile, c = e % kTile;  // consecutive threads: consecutive columns of a row
      const int64_t k = k0 + r;
      sh_i[r][c] = (k < m && i0 + c < n) ? x[k * n + i0 + c] : 0.0f;
      sh_j[r][c] = (k < m && j0 + c < n) ? x[k * n + j0 + c] : 0.0f;
    }
    __syncthreads();
    multiply_chunk(sh_i, sh_j, acc);
    __syncthreads();
  }
  stage_tile(acc, sh_out);
  for (int e = threadIdx.x; e < kTile * kTile; e += kThreads) {
    const int a = e / kTile, b = e % kTile;  // consecutive threads: consecutive columns of G
    if (i0 + a < n && j0 + b < n) gram[(i0 + a) * n + j0 + b] = sh_out[a][b];
    if (i0 != j0 && j0 + a < n && i0 + b < n) gram[(j0 + a) * n + i0 + b] = sh_out[b][a];  // the mirror tile
  }
}

// Block (blockIdx.x, blockIdx.y, blockIdx.z) = (row block r, column block j, matrix l), with X = buf_l[parity],
// Y = buf_l[1 - parity], G = gram_l:
// Y[r0 + a, j0 + b] = (1 + beta) X[r0 + a, j0 + b] - beta sum_k X[r0 + a, k] G[k, j0 + b].
__global__ void __launch_bounds__(kThreads)
    bjorck_update_kernel(const BjorckMatrix* __restrict__ table, int parity, float beta) {
  __shared__ __align__(32) float sh_x[kChunk][kLd];  // sh_x[c][a] = X[r0 + a, k0 + c] (transposed)
  __shared__ __align__(32) float sh_g[kChunk][kLd];  // sh_g[c][b] = G[k0 + c, j0 + b]
  __shared__ __align__(32) float sh_out[kTile][kLd];
  const BjorckMatrix mat = table[blockIdx.z];
  const int64_t m = mat.m, n = mat.n;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kTile;
  if (r0 >= m || j0 >= n) return;  // the whole block: outside this matrix's tiles
  const float* __restrict__ x = mat.buf + parity * m * n;
  float* __restrict__ y = mat.buf + (1 - parity) * m * n;
  const float* __restrict__ gram = mat.gram;
  Accumulator acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  for (int64_t k0 = 0; k0 < n; k0 += kChunk) {
    for (int e = threadIdx.x; e < kChunk * kTile; e += kThreads) {
      const int a = e / kChunk, c = e % kChunk;  // consecutive threads: consecutive k of a row
      const int64_t row = r0 + a, k = k0 + c;
      sh_x[c][a] = (row < m && k < n) ? x[row * n + k] : 0.0f;
      const int cg = e / kTile, b = e % kTile;  // consecutive threads: consecutive columns of G
      const int64_t kg = k0 + cg, col = j0 + b;
      sh_g[cg][b] = (kg < n && col < n) ? gram[kg * n + col] : 0.0f;
    }
    __syncthreads();
    multiply_chunk(sh_x, sh_g, acc);
    __syncthreads();
  }
  stage_tile(acc, sh_out);
  const float keep = 1.0f + beta;
  for (int e = threadIdx.x; e < kTile * kTile; e += kThreads) {
    const int a = e / kTile, b = e % kTile;
    const int64_t row = r0 + a, col = j0 + b;
    if (row < m && col < n) {
      const int64_t idx = row * n + col;
      y[idx] = keep * x[idx] - beta * sh_out[a][b];
    }
  }
}

}  // namespace

cudaError_t launch_bjorck_cuda(const BjorckMatrix* table, int64_t count, int64_t max_row_tiles,
                               int64_t max_col_tiles, int32_t iters, float beta, cudaStream_t stream) {
  if (iters == 0) return cudaSuccess;
  if (table == nullptr || count < 1 || max_row_tiles < 1 || max_col_tiles < 1 || iters < 0) {
    return cudaErrorInvalidValue;
  }
  if (count > 65535 || max_row_tiles > 0x7fffffffLL || max_col_tiles > 65535) return cudaErrorInvalidConfiguration;
  const unsigned int layers = static_cast<unsigned int>(count);
  const dim3 gram_grid(static_cast<unsigned int>(max_col_tiles), static_cast<unsigned int>(max_col_tiles), layers);
  const dim3 update_grid(static_cast<unsigned int>(max_row_tiles), static_cast<unsigned int>(max_col_tiles), layers);
  for (int32_t step = 0; step < iters; ++step) {
    const int parity = step % 2;
    gram_kernel<<<gram_grid, kThreads, 0, stream>>>(table, parity);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    bjorck_update_kernel<<<update_grid, kThreads, 0, stream>>>(table, parity, beta);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace fastdp
