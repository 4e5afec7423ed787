// CUDA kernels of Björck orthonormalisation, batched over a list of matrices (math: csrc/cuda/orthogonal.h).
//
// Two tiled shared-memory SGEMMs per step, SIMT fp32 (fmaf; no TF32, no fast-math), each ONE launch over
// every matrix: blockIdx.z picks the matrix from a BjorckMatrix table in device memory, and blocks whose
// tile lies outside that matrix return at once (the grid is sized by the largest matrix):
// * gram_kernel: block (j, i, l) makes the 64 x 64 tile G[i0:, j0:] of G_l = X_l^T X_l, staging
//   kChunk rows of X's column blocks i and j per step (coalesced row reads);
// * bjorck_update_kernel: block (r, j, l) makes Y[r0:, j0:] = (1 + beta) X - beta (X G) on a
//   64 x 64 tile, staging X[r0:, k0:] transposed (padded: no bank conflicts) and G[k0:, j0:].
// Each of the 16 x 16 threads keeps a 4 x 4 sub-tile in registers (rows ty + 16 i, columns
// tx + 16 j). Out-of-range rows and columns are staged as 0. int64 indexing; deterministic.
#include "cuda/orthogonal.h"

namespace fastdp {
namespace {

constexpr int kSide = 16;                // threads per side of the block
constexpr int kThreads = kSide * kSide;  // 256
constexpr int kSub = 4;                  // sub-tile side per thread
constexpr int kTile = kSide * kSub;      // 64: output tile side
static_assert(kTile == kBjorckTile, "the launcher's tile count must match the kernels' tile");
constexpr int kChunk = 16;               // reduction elements staged per step

// acc[i][j] += sum_c a[c][ty + 16 i] * b[c][tx + 16 j] over the staged chunk.
__device__ __forceinline__ void multiply_chunk(const float (*a)[kTile + 1], const float (*b)[kTile + 1],
                                               float (&acc)[kSub][kSub]) {
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    float va[kSub], vb[kSub];
#pragma unroll
    for (int i = 0; i < kSub; ++i) va[i] = a[c][ty + kSide * i];
#pragma unroll
    for (int j = 0; j < kSub; ++j) vb[j] = b[c][tx + kSide * j];
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) acc[i][j] = fmaf(va[i], vb[j], acc[i][j]);
    }
  }
}

// Block (blockIdx.x, blockIdx.y, blockIdx.z) = (column block j, column block i, matrix l):
// G[i0 + a, j0 + b] = sum_k X[k, i0 + a] X[k, j0 + b] with X = buf_l[parity], G = gram_l.
__global__ void __launch_bounds__(kThreads) gram_kernel(const BjorckMatrix* __restrict__ table, int parity) {
  __shared__ float sh_i[kChunk][kTile + 1];
  __shared__ float sh_j[kChunk][kTile + 1];
  const BjorckMatrix mat = table[blockIdx.z];
  const int64_t m = mat.m, n = mat.n;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile;
  if (i0 >= n || j0 >= n) return;  // the whole block: outside this matrix's Gram tiles
  const float* __restrict__ x = mat.buf + parity * m * n;
  float* __restrict__ gram = mat.gram;
  float acc[kSub][kSub] = {};
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
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t gi = i0 + ty + kSide * i;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int64_t gj = j0 + tx + kSide * j;
      if (gi < n && gj < n) gram[gi * n + gj] = acc[i][j];
    }
  }
}

// Block (blockIdx.x, blockIdx.y, blockIdx.z) = (row block r, column block j, matrix l), with X = buf_l[parity],
// Y = buf_l[1 - parity], G = gram_l:
// Y[r0 + a, j0 + b] = (1 + beta) X[r0 + a, j0 + b] - beta sum_k X[r0 + a, k] G[k, j0 + b].
__global__ void __launch_bounds__(kThreads)
    bjorck_update_kernel(const BjorckMatrix* __restrict__ table, int parity, float beta) {
  __shared__ float sh_x[kChunk][kTile + 1];  // sh_x[c][a] = X[r0 + a, k0 + c] (transposed)
  __shared__ float sh_g[kChunk][kTile + 1];  // sh_g[c][b] = G[k0 + c, j0 + b]
  const BjorckMatrix mat = table[blockIdx.z];
  const int64_t m = mat.m, n = mat.n;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kTile;
  if (r0 >= m || j0 >= n) return;  // the whole block: outside this matrix's tiles
  const float* __restrict__ x = mat.buf + parity * m * n;
  float* __restrict__ y = mat.buf + (1 - parity) * m * n;
  const float* __restrict__ gram = mat.gram;
  float acc[kSub][kSub] = {};
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
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const float keep = 1.0f + beta;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = r0 + ty + kSide * i;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int64_t col = j0 + tx + kSide * j;
      if (row < m && col < n) {
        const int64_t idx = row * n + col;
        y[idx] = keep * x[idx] - beta * acc[i][j];
      }
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
