// Launcher of the batched CUDA Björck orthonormalisation: raw device pointers and a stream, no torch types.
//
// Math (fastdp/ref/orthogonal.py, bjorck_orthonormalize) for each X_l [m_l, n_l], m_l >= n_l (the binding
// transposes a wide matrix, whose [m, m] Gram is then the smaller one, as the ref and the Triton path do),
// fp32 data and fp32 accumulation, products in 3xTF32 on tensor cores (csrc/cuda/orthogonal.cu), `iters` steps of
//     G = X^T X                                  [n, n]
//     X <- (1 + beta) X - beta X G
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fastdp {

// One matrix of a batched Björck orthonormalisation (blockIdx.z of both kernels). Device pointers.
struct BjorckMatrix {
  float* buf;    // fp32 [2, m, n] row-major: X_0 in buf[0]; step k reads buf[k % 2], writes buf[(k + 1) % 2],
                 // so X_iters ends in buf[iters % 2]
  float* gram;   // fp32 workspace [n, n]
  int64_t m;     // rows (m >= n)
  int64_t n;     // columns (>= 1)
};

// `iters` Björck steps on every matrix of `table` (device memory, `count` entries), all on `stream`:
// per step one Gram launch and one fused-update launch over all matrices (the launch boundary is the
// grid-wide barrier), so 2 iters launches whatever `count` is. Grids are sized by the largest matrix:
// `max_row_tiles` = max over l of ceil(m_l / kBjorckTile), `max_col_tiles` likewise for n_l; blocks outside a
// matrix's tiles return at once. 1 <= count <= 65535, iters >= 0. Returns the first launch error.
constexpr int64_t kBjorckTile = 64;  // output tile side of both kernels
cudaError_t launch_bjorck_cuda(const BjorckMatrix* table, int64_t count, int64_t max_row_tiles,
                               int64_t max_col_tiles, int32_t iters, float beta, cudaStream_t stream);

}  // namespace fastdp
