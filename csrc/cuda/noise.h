// Launcher of the CUDA noise kernel: raw device pointers and a stream, no torch types.
#pragma once

#include <cuda_runtime.h>

#include "fastdp/noise.h"

namespace fastdp {

// tensors and chunk_tensor live in device memory; one launch covers every chunk
// of every tensor of one dtype. Returns the launch error (cudaSuccess if none).
cudaError_t launch_noise_cuda(const NoiseTensor* tensors, const int32_t* chunk_tensor,
                              int64_t num_chunks, ScalarKind kind, NoiseArgs args,
                              cudaStream_t stream);

}  // namespace fastdp
