// CUDA kernel of the batched power iteration (math: csrc/include/fastdp/spectral.h,
// fastdp/ref/spectral.py). One launch over a list of matrices of any shapes and element
// types: block l runs every step of matrix l (descriptor mats[l]), so no grid-wide
// barrier and no host synchronisation are needed.
//
// Per step, with the norms carried as scale factors (applied on the next read, as the
// Triton kernel does: W is read twice per step, u and v written once):
//   v = scale_u * (W u):   warp per row, lanes stride the columns (coalesced), shuffles;
//   scale_v = 1 / max(||v||, eps)            (fixed-order block reduction);
//   u = scale_v * (W^T v): column tiles of `tc` columns x (256 / tc) row groups
//                          (coalesced rows), partials added in group order in shared memory;
//   sigma = ||u||, scale_u = 1 / max(sigma, eps).
// After the last step u and v are rescaled to unit vectors. fp32 math (W upcast on load),
// int64 indexing, deterministic (no atomics). u and v live in global memory (L1/L2
// resident); __syncthreads orders the block's writes before the reads of the next phase.
#include "cuda/spectral.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastdp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum of x over the block in a fixed order; every thread gets the result. Starts with a
// barrier, so the block's earlier global writes are visible after it returns.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  __syncthreads();  // scratch free (a previous call's readers are done); earlier writes ordered
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

// Columns per tile of the W^T v product: the smallest power of two >= n in [32, kThreads].
__device__ __forceinline__ int column_tile(int64_t n) {
  int tc = 32;
  while (tc < kThreads && tc < n) tc *= 2;
  return tc;
}

template <typename T>
__device__ void power_iteration_block(const PowerIterMatrix& d, int32_t iters, float* scratch, float* col_part) {
  const T* __restrict__ w = static_cast<const T*>(d.w);
  const int64_t m = d.m, n = d.n;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int tc = column_tile(n);
  const int groups = kThreads / tc;
  const int col = threadIdx.x % tc, group = threadIdx.x / tc;

  // u <- u_in / max(||u_in||, eps): the start vector is read in place, with its scale.
  float sum_sq = 0.0f;
  for (int64_t c = threadIdx.x; c < n; c += kThreads) sum_sq = fmaf(d.u_in[c], d.u_in[c], sum_sq);
  float scale_u = 1.0f / fmaxf(sqrtf(block_sum(sum_sq, scratch)), kPowerEps);
  const float* u_read = d.u_in;
  float scale_v = 1.0f;
  float sigma = 0.0f;

  for (int32_t step = 0; step < iters; ++step) {
    // v = scale_u * W u (unnormalised), ||v||^2.
    sum_sq = 0.0f;
    for (int64_t r = warp; r < m; r += kWarps) {
      const T* row = w + r * n;
      float acc = 0.0f;
      for (int64_t c = lane; c < n; c += 32) acc = fmaf(to_float(row[c]), u_read[c], acc);
      acc = warp_sum(acc) * scale_u;
      if (lane == 0) {
        d.v[r] = acc;
        sum_sq = fmaf(acc, acc, sum_sq);
      }
    }
    scale_v = 1.0f / fmaxf(sqrtf(block_sum(sum_sq, scratch)), kPowerEps);

    // u = scale_v * W^T v (unnormalised), sigma^2 = ||u||^2.
    sum_sq = 0.0f;
    for (int64_t c0 = 0; c0 < n; c0 += tc) {
      const int64_t c = c0 + col;
      float acc = 0.0f;
      if (c < n) {
        for (int64_t r = group; r < m; r += groups) acc = fmaf(to_float(w[r * n + c]), d.v[r], acc);
      }
      col_part[threadIdx.x] = acc;
      __syncthreads();
      if (group == 0 && c < n) {
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) total += col_part[g * tc + col];
        total *= scale_v;
        d.u[c] = total;
        sum_sq = fmaf(total, total, sum_sq);
      }
      __syncthreads();  // col_part free for the next tile
    }
    sigma = sqrtf(block_sum(sum_sq, scratch));
    scale_u = 1.0f / fmaxf(sigma, kPowerEps);
    u_read = d.u;
  }

  // Unit vectors (block_sum's barrier ordered every write above before these reads).
  for (int64_t r = threadIdx.x; r < m; r += kThreads) d.v[r] *= scale_v;
  for (int64_t c = threadIdx.x; c < n; c += kThreads) d.u[c] *= scale_u;
  if (threadIdx.x == 0) *d.sigma = sigma;
}

__global__ void __launch_bounds__(kThreads)
    power_iteration_kernel(const PowerIterMatrix* __restrict__ mats, int32_t iters) {
  __shared__ float scratch[kWarps];
  __shared__ float col_part[kThreads];
  const PowerIterMatrix d = mats[blockIdx.x];
  switch (d.kind) {  // block-uniform: the barriers inside are reached by every thread
    case ScalarKind::kFloat32: power_iteration_block<float>(d, iters, scratch, col_part); break;
    case ScalarKind::kFloat16: power_iteration_block<__half>(d, iters, scratch, col_part); break;
    case ScalarKind::kBFloat16: power_iteration_block<__nv_bfloat16>(d, iters, scratch, col_part); break;
    default: break;  // rejected by the binding
  }
}

}  // namespace

cudaError_t launch_power_iteration_cuda(const PowerIterMatrix* mats, int64_t num_mats, int32_t iters,
                                        cudaStream_t stream) {
  if (num_mats == 0) return cudaSuccess;
  if (num_mats < 0 || num_mats > 0x7fffffffLL || iters < 1) return cudaErrorInvalidValue;
  power_iteration_kernel<<<static_cast<unsigned int>(num_mats), kThreads, 0, stream>>>(mats, iters);
  return cudaGetLastError();
}

}  // namespace fastdp
