// CUDA kernels of the batched power iteration (math: csrc/include/fastdp/spectral.h,
// fastdp/ref/spectral.py). Two paths, no host synchronisation in either:
// * power_iteration_kernel: ONE launch over the small matrices of a list (any shapes and
//   element types): block l runs every step of matrix l (descriptor mats[l]);
// * power_split_kernel + power_split_finish_kernel: matrices above kPowerSplitMinNumel
//   elements over the whole GPU, one block per region, two launches per step and one to
//   finish (the serial split-K reduction described in fastdp/spectral.h; below).
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

// ------------------------------------------------------------------ whole-GPU path (fastdp/spectral.h)

// sum(ptr[0:count]) in a fixed order, the same in every block: strided per-thread partials, then block_sum.
__device__ __forceinline__ float sum_blocks(const float* ptr, int64_t count, float* scratch) {
  float x = 0.0f;
  for (int64_t k = threadIdx.x; k < count; k += kThreads) x += __ldcg(ptr + k);
  return block_sum(x, scratch);
}

// Whether this block is the last of `expected` blocks to arrive at `counter` (block-uniform). The barrier, then
// thread 0's GPU-scope fence and atomic, publish every thread's earlier global writes (the release); the last
// block's thread 0 fences again after the atomic (the acquire) and the barrier passes that on to its threads, which
// then read the partials with __ldcg (L2, not a stale L1 line).
__device__ __forceinline__ bool arrive_last(int32_t* counter, int64_t expected, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const int32_t before = atomicAdd(counter, 1);
    __threadfence();
    *flag = before == expected - 1;
  }
  __syncthreads();
  return *flag != 0;
}

// out[lo:hi] = sum over k = 0, 1, ..., count - 1 of part[k * stride + lo:hi] (in that order; the other blocks'
// partials read from L2); returns the block's sum of squares of out[lo:hi], to every thread.
__device__ __forceinline__ float sum_partials(const float* part, int64_t stride, int64_t count, float* out,
                                              int64_t lo, int64_t hi, float* scratch) {
  float sum_sq = 0.0f;
  for (int64_t x = lo + threadIdx.x; x < hi; x += kThreads) {
    float acc = 0.0f;
    for (int64_t k = 0; k < count; ++k) acc += __ldcg(part + k * stride + x);
    out[x] = acc;
    sum_sq = fmaf(acc, acc, sum_sq);
  }
  return block_sum(sum_sq, scratch);
}

// part[j, rows of region i] = s_u W[region] u[columns of region j]; the last block of row region i sums the
// n_j partials into v[rows] and writes the block's sum of squares. First step: u = u_in, normalised here.
template <typename T>
__device__ void split_rows_block(const PowerIterSplitMatrix& d, int64_t i, int64_t j, bool first, float* scratch,
                                 int* flag) {
  const T* __restrict__ w = static_cast<const T*>(d.w);
  const int64_t m = d.m, n = d.n;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r_lo = i * d.rows, r_hi = min(r_lo + d.rows, m);
  const int64_t c_lo = j * d.cols, c_hi = min(c_lo + d.cols, n);
  const float* u = first ? d.u_in : d.u;
  float sum_sq = 0.0f;
  if (first) {
    for (int64_t c = threadIdx.x; c < n; c += kThreads) sum_sq = fmaf(u[c], u[c], sum_sq);
    sum_sq = block_sum(sum_sq, scratch);
  } else {
    sum_sq = sum_blocks(d.sq, d.n_j, scratch);
  }
  const float scale = 1.0f / fmaxf(sqrtf(sum_sq), kPowerEps);
  for (int64_t r = r_lo + warp; r < r_hi; r += kWarps) {
    const T* row = w + r * n;
    float acc = 0.0f;
    for (int64_t c = c_lo + lane; c < c_hi; c += 32) acc = fmaf(to_float(row[c]), u[c], acc);
    acc = warp_sum(acc);
    if (lane == 0) d.part[j * m + r] = acc * scale;
  }
  if (!arrive_last(d.counts + i, d.n_j, flag)) return;
  sum_sq = sum_partials(d.part, m, d.n_j, d.v, r_lo, r_hi, scratch);
  if (threadIdx.x == 0) {
    d.sq[d.n_j + i] = sum_sq;
    d.counts[i] = 0;  // every block of the region has arrived: ready for the next launch
  }
}

// part[i, columns of region j] = s_v W[region]^T v[rows of region i]; the last block of column region j sums the
// n_i partials into u[columns] and writes the block's sum of squares.
template <typename T>
__device__ void split_cols_block(const PowerIterSplitMatrix& d, int64_t i, int64_t j, float* scratch,
                                 float* col_part, int* flag) {
  const T* __restrict__ w = static_cast<const T*>(d.w);
  const int64_t n = d.n;
  const int64_t r_lo = i * d.rows, r_hi = min(r_lo + d.rows, d.m);
  const int64_t c_lo = j * d.cols, c_hi = min(c_lo + d.cols, n);
  const float scale = 1.0f / fmaxf(sqrtf(sum_blocks(d.sq + d.n_j, d.n_i, scratch)), kPowerEps);
  const int tc = column_tile(c_hi - c_lo);
  const int groups = kThreads / tc;
  const int col = threadIdx.x % tc, group = threadIdx.x / tc;
  for (int64_t c0 = c_lo; c0 < c_hi; c0 += tc) {
    const int64_t c = c0 + col;
    float acc = 0.0f;
    if (c < c_hi) {
      for (int64_t r = r_lo + group; r < r_hi; r += groups) acc = fmaf(to_float(w[r * n + c]), d.v[r], acc);
    }
    col_part[threadIdx.x] = acc;
    __syncthreads();
    if (group == 0 && c < c_hi) {
      float total = 0.0f;
      for (int g = 0; g < groups; ++g) total += col_part[g * tc + col];
      d.part[i * n + c] = total * scale;
    }
    __syncthreads();  // col_part free for the next tile
  }
  if (!arrive_last(d.counts + d.n_i + j, d.n_i, flag)) return;
  const float sum_sq = sum_partials(d.part, n, d.n_i, d.u, c_lo, c_hi, scratch);
  if (threadIdx.x == 0) {
    d.sq[j] = sum_sq;
    d.counts[d.n_i + j] = 0;
  }
}

template <typename T>
__device__ void split_block(const PowerIterSplitMatrix& d, const PowerIterItem& item, bool first, bool transposed,
                            float* scratch, float* col_part, int* flag) {
  if (transposed) {
    split_cols_block<T>(d, item.i, item.j, scratch, col_part, flag);
  } else {
    split_rows_block<T>(d, item.i, item.j, first, scratch, flag);
  }
}

// Block b: region items[b] of its matrix, v = W u (transposed = 0) or u = W^T v (transposed = 1).
__global__ void __launch_bounds__(kThreads)
    power_split_kernel(const PowerIterSplitMatrix* __restrict__ mats, const PowerIterItem* __restrict__ items,
                       int32_t first, int32_t transposed) {
  __shared__ float scratch[kWarps];
  __shared__ float col_part[kThreads];
  __shared__ int flag;
  const PowerIterItem item = items[blockIdx.x];
  const PowerIterSplitMatrix d = mats[item.matrix];
  switch (d.kind) {  // block-uniform
    case ScalarKind::kFloat32: split_block<float>(d, item, first, transposed, scratch, col_part, &flag); break;
    case ScalarKind::kFloat16: split_block<__half>(d, item, first, transposed, scratch, col_part, &flag); break;
    case ScalarKind::kBFloat16:
      split_block<__nv_bfloat16>(d, item, first, transposed, scratch, col_part, &flag);
      break;
    default: break;  // rejected by the binding
  }
}

// Block l: sigma_l = ||u_l||, and u_l, v_l scaled to unit vectors.
__global__ void __launch_bounds__(kThreads) power_split_finish_kernel(const PowerIterSplitMatrix* __restrict__ mats) {
  __shared__ float scratch[kWarps];
  const PowerIterSplitMatrix d = mats[blockIdx.x];
  const float sigma = sqrtf(sum_blocks(d.sq, d.n_j, scratch));
  const float scale_u = 1.0f / fmaxf(sigma, kPowerEps);
  const float scale_v = 1.0f / fmaxf(sqrtf(sum_blocks(d.sq + d.n_j, d.n_i, scratch)), kPowerEps);
  for (int64_t r = threadIdx.x; r < d.m; r += kThreads) d.v[r] *= scale_v;
  for (int64_t c = threadIdx.x; c < d.n; c += kThreads) d.u[c] *= scale_u;
  if (threadIdx.x == 0) *d.sigma = sigma;
}

}  // namespace

cudaError_t launch_power_iteration_cuda(const PowerIterMatrix* mats, int64_t num_mats, int32_t iters,
                                        cudaStream_t stream) {
  if (num_mats == 0) return cudaSuccess;
  if (num_mats < 0 || num_mats > 0x7fffffffLL || iters < 1) return cudaErrorInvalidValue;
  power_iteration_kernel<<<static_cast<unsigned int>(num_mats), kThreads, 0, stream>>>(mats, iters);
  return cudaGetLastError();
}

cudaError_t launch_power_iteration_split_cuda(const PowerIterSplitMatrix* mats, int64_t num_mats,
                                              const PowerIterItem* items, int64_t num_items, int32_t iters,
                                              cudaStream_t stream) {
  if (num_mats == 0) return cudaSuccess;
  if (num_mats < 0 || num_mats > 0x7fffffffLL || num_items < num_mats || num_items > 0x7fffffffLL || iters < 1) {
    return cudaErrorInvalidValue;
  }
  for (int32_t step = 0; step < iters; ++step) {
    for (int32_t transposed = 0; transposed < 2; ++transposed) {
      power_split_kernel<<<static_cast<unsigned int>(num_items), kThreads, 0, stream>>>(mats, items, step == 0,
                                                                                        transposed);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  power_split_finish_kernel<<<static_cast<unsigned int>(num_mats), kThreads, 0, stream>>>(mats);
  return cudaGetLastError();
}

}  // namespace fastdp
