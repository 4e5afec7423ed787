// Launcher of the CUDA Björck orthonormalisation: raw device pointers and a stream, no torch types.
//
// Math (fastdp/ref/orthogonal.py, bjorck_orthonormalize) for X [m, n], m >= n (the binding
// transposes a wide matrix, whose [m, m] Gram is then the smaller one, as the ref and the
// Triton path do), fp32 throughout, `iters` steps of
//     G = X^T X                                  [n, n]
//     X <- (1 + beta) X - beta X G
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fastdp {

// buf: device fp32 [2, m, n] row-major, X_0 in buf[0]; step k reads buf[k % 2] and writes
// buf[(k + 1) % 2], so X_iters ends in buf[iters % 2]. gram: device fp32 workspace [n, n].
// Two launches per step (Gram, then the fused update; the launch boundary is the grid-wide
// barrier), all on `stream`. m >= n >= 1, iters >= 0. Returns the first launch error.
cudaError_t launch_bjorck_cuda(float* buf, float* gram, int64_t m, int64_t n, int32_t iters, float beta,
                               cudaStream_t stream);

}  // namespace fastdp
