// CUDA kernel of the fused per-tensor Gaussian noise (math: csrc/include/fastdp/noise.h).
// One launch over a list of tensors, multi-tensor-apply style: block b handles chunk b
// (kNoiseChunk elements of tensor chunk_tensor[b]); each thread draws one Philox group
// (4 normals) per iteration and moves 4 elements with one vector load/store when aligned.
#include "cuda/noise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fastdp/philox.h"

namespace fastdp {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    noise_kernel(const NoiseTensor* __restrict__ tensors,
                 const int32_t* __restrict__ chunk_tensor, NoiseArgs args) {
  const int64_t chunk = blockIdx.x;
  const NoiseTensor t = tensors[chunk_tensor[chunk]];
  const int64_t begin = (chunk - t.first_chunk) * kNoiseChunk;
  const int64_t end = min(t.numel, begin + kNoiseChunk);
  T* grad = static_cast<T*>(t.grad);
  T* param = static_cast<T*>(t.param);
  const bool aligned =
      (reinterpret_cast<uintptr_t>(grad) % sizeof(Pack4<T>) == 0) &&
      (!args.fused || reinterpret_cast<uintptr_t>(param) % sizeof(Pack4<T>) == 0);
  const float inv_sqrt_draws = 1.0f / sqrtf(static_cast<float>(args.num_draws));

  for (int64_t base = begin + 4 * static_cast<int64_t>(threadIdx.x); base < end;
       base += 4 * kThreads) {
    const uint64_t group = (t.stream_start + static_cast<uint64_t>(base)) >> 2;
    float z[4], n[4];
    normal4(group, 0, args.offset, args.seed, z);
    for (uint32_t k = 1; k < args.num_draws; ++k) {
      normal4(group, k, args.offset, args.seed, n);
#pragma unroll
      for (int j = 0; j < 4; ++j) z[j] += n[j];
    }
    if (args.num_draws != 1) {
#pragma unroll
      for (int j = 0; j < 4; ++j) z[j] *= inv_sqrt_draws;
    }
    if (aligned && base + 4 <= end) {
      Pack4<T> g = *reinterpret_cast<const Pack4<T>*>(grad + base);
      if (args.fused) {
        Pack4<T> p = *reinterpret_cast<const Pack4<T>*>(param + base);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float noisy = to_float(g.v[j]) + t.std * z[j];
          p.v[j] = from_float<T>(to_float(p.v[j]) - args.step * noisy);
        }
        *reinterpret_cast<Pack4<T>*>(param + base) = p;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) g.v[j] = from_float<T>(to_float(g.v[j]) + t.std * z[j]);
        *reinterpret_cast<Pack4<T>*>(grad + base) = g;
      }
    } else {
      const int64_t lanes = min(static_cast<int64_t>(4), end - base);
      for (int64_t j = 0; j < lanes; ++j) {
        const float noisy = to_float(grad[base + j]) + t.std * z[j];
        if (args.fused) {
          param[base + j] = from_float<T>(to_float(param[base + j]) - args.step * noisy);
        } else {
          grad[base + j] = from_float<T>(noisy);
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_noise_cuda(const NoiseTensor* tensors, const int32_t* chunk_tensor,
                              int64_t num_chunks, ScalarKind kind, NoiseArgs args,
                              cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  if (num_chunks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned int>(num_chunks));
  switch (kind) {
    case ScalarKind::kFloat32:
      noise_kernel<float><<<grid, kThreads, 0, stream>>>(tensors, chunk_tensor, args);
      break;
    case ScalarKind::kFloat16:
      noise_kernel<__half><<<grid, kThreads, 0, stream>>>(tensors, chunk_tensor, args);
      break;
    case ScalarKind::kBFloat16:
      noise_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(tensors, chunk_tensor, args);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fastdp
