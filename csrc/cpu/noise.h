#pragma once

#include "fastdp/noise.h"

namespace fastdp {

// Applies the noise (or the fused step) to every chunk; parallel over chunks.
void noise_cpu(const NoiseTensor* tensors, const int32_t* chunk_tensor, int64_t num_chunks,
               ScalarKind kind, const NoiseArgs& args);

}  // namespace fastdp
