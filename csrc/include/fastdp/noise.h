// Fused per-tensor Gaussian noise: the work description shared by the CPU and
// CUDA kernels. Plain C++ (no torch headers) so csrc/cuda/noise.cu compiles with nvcc alone.
//
// For every element i of tensor t, with z the fastdp noise stream (philox.h)
// averaged over `num_draws` independent draws (sum / sqrt(num_draws), still N(0, 1)):
//   kAdd:         g[i] <- g[i] + std_t * z
//   kSgdStep:     p[i] <- p[i] - step * (g[i] + std_t * z)      (g is read only)
//   kRelease:     g[i] <- (g[i] + std_t * z) / scale             (the released mean)
//   kReleaseSgd:  kRelease, then torch.optim.SGD's update of p[i] from g[i] (momentum buffer: state 0)
//   kReleaseAdam: kRelease, then torch.optim.Adam's / AdamW's update (exp_avg, exp_avg_sq,
//                 max_exp_avg_sq: states 0, 1, 2)
// All arithmetic is fp32; the result is rounded once to the tensor's dtype. The release
// kinds take float32 tensors only (gradient sums, parameters and optimizer state).
#pragma once

#include <cmath>
#include <cstdint>

#include "fastdp/philox.h"  // FASTDP_HD

namespace fastdp {

enum class ScalarKind : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

enum class NoiseUpdate : int32_t { kAdd = 0, kSgdStep = 1, kRelease = 2, kReleaseSgd = 3, kReleaseAdam = 4 };

struct NoiseTensor {
  void* grad;             // gradient buffer (read-write, read only for kSgdStep)
  void* param;            // parameter buffer (kSgdStep and the optimizer kinds, else nullptr)
  void* state[3];         // optimizer state buffers (see NoiseUpdate), nullptr where unused
  int64_t numel;          // elements in this tensor
  uint64_t stream_start;  // index of element 0 in the noise stream (multiple of 4)
  int64_t first_chunk;    // index of this tensor's first chunk in the chunk list
  float std;              // noise standard deviation for this tensor
  float grad_weight;      // SGD momentum: weight of the gradient in the buffer's update
                          // (1 - dampening; 1 for a new, zeroed buffer: torch's buf = grad)
};

// Optimizer hyperparameters (host-computed scalars of this step).
struct UpdateArgs {
  float scale;         // divisor of the noisy sum (the expected batch size q N)
  float lr;
  float weight_decay;  // L2 term added to the gradient (SGD, Adam); 0 for AdamW
  float decay;         // AdamW: p <- p * decay (1 - lr * weight_decay) before the update; else 1
  float momentum;      // SGD
  float beta1_weight;  // Adam: 1 - beta1 (torch's lerp weight)
  float beta2;
  float beta2_weight;  // 1 - beta2
  float eps;
  float step_size;     // lr / (1 - beta1^t)
  float bc2_sqrt;      // sqrt(1 - beta2^t)
  uint32_t nesterov;
  uint32_t maximize;
  uint32_t amsgrad;
};

struct NoiseArgs {
  uint64_t seed;
  uint64_t offset;
  uint32_t num_draws;  // 1 (fast) or 4 (secure)
  NoiseUpdate update;
  float step;          // lr / scale, kSgdStep only
  UpdateArgs opt;      // the release kinds only
};

// Elements handled by one chunk (a CUDA block, a CPU task). Multiple of 4.
constexpr int64_t kNoiseChunk = 16384;

FASTDP_HD bool is_release(NoiseUpdate u) { return static_cast<int32_t>(u) >= 2; }

// The release kinds on one element: noisy is g + std * z (fp32). Returns the released gradient
// noisy / scale; applies the optimizer's update to p and the state, in torch.optim's order of
// operations (results agree with it to fp32 rounding: the update is post-processing).
FASTDP_HD float release_element(const NoiseArgs& a, float grad_weight, float noisy, float& p, float& s0,
                                float& s1, float& s2) {
  const UpdateArgs& o = a.opt;
  const float g = noisy / o.scale;
  if (a.update == NoiseUpdate::kRelease) return g;
  float d = o.maximize ? -g : g;
  if (a.update == NoiseUpdate::kReleaseSgd) {
    if (o.weight_decay != 0.0f) d = d + o.weight_decay * p;
    if (o.momentum != 0.0f) {
      s0 = o.momentum * s0 + grad_weight * d;
      d = o.nesterov ? d + o.momentum * s0 : s0;
    }
    p = p - o.lr * d;
    return g;
  }
  if (o.weight_decay != 0.0f) d = d + o.weight_decay * p;
  p = p * o.decay;
  s0 = s0 + o.beta1_weight * (d - s0);
  s1 = s1 * o.beta2 + o.beta2_weight * d * d;
  float second = s1;
  if (o.amsgrad) {
    s2 = s2 > s1 ? s2 : s1;
    second = s2;
  }
  const float denom = sqrtf(second) / o.bc2_sqrt + o.eps;
  p = p - o.step_size * (s0 / denom);
  return g;
}

}  // namespace fastdp
