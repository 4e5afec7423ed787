// CUDA kernel of the fused per-tensor Gaussian noise (math: csrc/include/fastdp/noise.h).
// One launch over a list of tensors, multi-tensor-apply style: block b handles chunk b
// (kNoiseChunk elements of tensor chunk_tensor[b]); each thread draws one Philox group
// (4 normals) per iteration and moves 4 elements with one vector load/store when aligned.
// The release kinds (noisy mean and optimizer update, float32) run in release_kernel.
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

// Draws the noise of one Philox group (4 elements) for element `base` of tensor t.
__device__ __forceinline__ void group_noise(const NoiseTensor& t, int64_t base, const NoiseArgs& args,
                                            float z[4]) {
  const uint64_t group = (t.stream_start + static_cast<uint64_t>(base)) >> 2;
  float n[4];
  normal4(group, 0, args.offset, args.seed, z);
  for (uint32_t k = 1; k < args.num_draws; ++k) {
    normal4(group, k, args.offset, args.seed, n);
#pragma unroll
    for (int j = 0; j < 4; ++j) z[j] += n[j];
  }
  if (args.num_draws != 1) {
#pragma unroll
    for (int j = 0; j < 4; ++j) z[j] *= 0.5f;  // 4 draws: sum / sqrt(4)
  }
}

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
  const bool fused = args.update == NoiseUpdate::kSgdStep;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(grad) % sizeof(Pack4<T>) == 0) &&
      (!fused || reinterpret_cast<uintptr_t>(param) % sizeof(Pack4<T>) == 0);

  for (int64_t base = begin + 4 * static_cast<int64_t>(threadIdx.x); base < end;
       base += 4 * kThreads) {
    float z[4];
    group_noise(t, base, args, z);
    if (aligned && base + 4 <= end) {
      Pack4<T> g = *reinterpret_cast<const Pack4<T>*>(grad + base);
      if (fused) {
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
        if (fused) {
          param[base + j] = from_float<T>(to_float(param[base + j]) - args.step * noisy);
        } else {
          grad[base + j] = from_float<T>(noisy);
        }
      }
    }
  }
}


// The release kinds (float32): noisy mean, then the optimizer's update, one pass; float4
// loads and stores where every buffer of the tensor is 16-byte aligned.
__global__ void __launch_bounds__(kThreads)
    release_kernel(const NoiseTensor* __restrict__ tensors, const int32_t* __restrict__ chunk_tensor,
                   NoiseArgs args) {
  const int64_t chunk = blockIdx.x;
  const NoiseTensor t = tensors[chunk_tensor[chunk]];
  const int64_t begin = (chunk - t.first_chunk) * kNoiseChunk;
  const int64_t end = min(t.numel, begin + kNoiseChunk);
  float* grad = static_cast<float*>(t.grad);
  float* param = static_cast<float*>(t.param);
  float* state[3];
  bool aligned = reinterpret_cast<uintptr_t>(grad) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(param) % 16 == 0;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    state[k] = static_cast<float*>(t.state[k]);
    aligned = aligned && reinterpret_cast<uintptr_t>(state[k]) % 16 == 0;
  }
  for (int64_t base = begin + 4 * static_cast<int64_t>(threadIdx.x); base < end;
       base += 4 * kThreads) {
    float z[4];
    group_noise(t, base, args, z);
    float g[4], p[4] = {}, s[3][4] = {};
    const int64_t lanes = min(static_cast<int64_t>(4), end - base);
    const bool vector = aligned && lanes == 4;
    if (vector) {
      *reinterpret_cast<float4*>(g) = *reinterpret_cast<const float4*>(grad + base);
      if (param) *reinterpret_cast<float4*>(p) = *reinterpret_cast<const float4*>(param + base);
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (state[k]) *reinterpret_cast<float4*>(s[k]) = *reinterpret_cast<const float4*>(state[k] + base);
      }
    } else {
      for (int64_t j = 0; j < lanes; ++j) {
        g[j] = grad[base + j];
        if (param) p[j] = param[base + j];
        for (int k = 0; k < 3; ++k) {
          if (state[k]) s[k][j] = state[k][base + j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      g[j] = release_element(args, t.grad_weight, g[j] + t.std * z[j], p[j], s[0][j], s[1][j], s[2][j]);
    }
    if (vector) {
      *reinterpret_cast<float4*>(grad + base) = *reinterpret_cast<const float4*>(g);
      if (param) *reinterpret_cast<float4*>(param + base) = *reinterpret_cast<const float4*>(p);
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (state[k]) *reinterpret_cast<float4*>(state[k] + base) = *reinterpret_cast<const float4*>(s[k]);
      }
    } else {
      for (int64_t j = 0; j < lanes; ++j) {
        grad[base + j] = g[j];
        if (param) param[base + j] = p[j];
        for (int k = 0; k < 3; ++k) {
          if (state[k]) state[k][base + j] = s[k][j];
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
  if (is_release(args.update)) {
    if (kind != ScalarKind::kFloat32) return cudaErrorInvalidValue;
    release_kernel<<<grid, kThreads, 0, stream>>>(tensors, chunk_tensor, args);
    return cudaGetLastError();
  }
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
