// CUDA kernels of Björck orthonormalisation (math: csrc/cuda/orthogonal.h).
//
// Two tiled shared-memory SGEMMs per step, SIMT fp32 (fmaf; no TF32, no fast-math):
// * gram_kernel: block (i, j) makes the 64 x 64 tile G[i0:, j0:] of G = X^T X, staging
//   kChunk rows of X's column blocks i and j per step (coalesced row reads);
// * bjorck_update_kernel: block (r, j) makes Y[r0:, j0:] = (1 + beta) X - beta (X G) on a
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

// Block (blockIdx.x, blockIdx.y) = (column block j, column block i): G[i0 + a, j0 + b] =
// sum_k X[k, i0 + a] X[k, j0 + b].
__global__ void __launch_bounds__(kThreads)
    gram_kernel(const float* __restrict__ x, float* __restrict__ gram, int64_t m, int64_t n) {
  __shared__ float sh_i[kChunk][kTile + 1];
  __shared__ float sh_j[kChunk][kTile + 1];
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile;
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

// Block (blockIdx.x, blockIdx.y) = (row block r, column block j):
// Y[r0 + a, j0 + b] = (1 + beta) X[r0 + a, j0 + b] - beta sum_k X[r0 + a, k] G[k, j0 + b].
__global__ void __launch_bounds__(kThreads)
    bjorck_update_kernel(const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ gram,
                         int64_t m, int64_t n, float beta) {
  __shared__ float sh_x[kChunk][kTile + 1];  // sh_x[c][a] = X[r0 + a, k0 + c] (transposed)
  __shared__ float sh_g[kChunk][kTile + 1];  // sh_g[c][b] = G[k0 + c, j0 + b]
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kTile;
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

cudaError_t launch_bjorck_cuda(float* buf, float* gram, int64_t m, int64_t n, int32_t iters, float beta,
                               cudaStream_t stream) {
  if (iters == 0) return cudaSuccess;
  if (m < n || n < 1 || iters < 0) return cudaErrorInvalidValue;
  const int64_t row_tiles = (m + kTile - 1) / kTile;
  const int64_t col_tiles = (n + kTile - 1) / kTile;
  if (row_tiles > 0x7fffffffLL || col_tiles > 65535) return cudaErrorInvalidConfiguration;
  const dim3 gram_grid(static_cast<unsigned int>(col_tiles), static_cast<unsigned int>(col_tiles));
  const dim3 update_grid(static_cast<unsigned int>(row_tiles), static_cast<unsigned int>(col_tiles));
  const int64_t mn = m * n;
  for (int32_t step = 0; step < iters; ++step) {
    const float* x = buf + (step % 2) * mn;
    float* y = buf + ((step + 1) % 2) * mn;
    gram_kernel<<<gram_grid, kThreads, 0, stream>>>(x, gram, m, n);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    bjorck_update_kernel<<<update_grid, kThreads, 0, stream>>>(x, y, gram, m, n, beta);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace fastdp
