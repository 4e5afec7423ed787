// Fused per-tensor Gaussian noise: the work description shared by the CPU and
// CUDA kernels. Plain C++ (no torch headers) so csrc/cuda/noise.cu compiles with nvcc alone.
//
// For every element i of tensor t, with z the fastdp noise stream (philox.h)
// averaged over `num_draws` independent draws (sum / sqrt(num_draws), still N(0, 1)):
//   add_noise:  g[i] <- g[i] + std_t * z
//   fused step: p[i] <- p[i] - step * (g[i] + std_t * z)      (g is read only)
// All arithmetic is fp32; the result is rounded once to the tensor's dtype.
#pragma once

#include <cstdint>

namespace fastdp {

enum class ScalarKind : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct NoiseTensor {
  void* grad;             // gradient buffer (read-write for add_noise, read for the step)
  void* param;            // parameter buffer (fused step only, else nullptr)
  int64_t numel;          // elements in this tensor
  uint64_t stream_start;  // index of element 0 in the noise stream (multiple of 4)
  int64_t first_chunk;    // index of this tensor's first chunk in the chunk list
  float std;              // noise standard deviation for this tensor
};

struct NoiseArgs {
  uint64_t seed;
  uint64_t offset;
  uint32_t num_draws;  // 1 (fast) or 4 (secure)
  bool fused;          // apply the SGD step instead of writing g + noise
  float step;          // lr / scale, fused step only
};

// Elements handled by one chunk (a CUDA block, a CPU task). Multiple of 4.
constexpr int64_t kNoiseChunk = 16384;

}  // namespace fastdp
