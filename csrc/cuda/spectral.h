// Launcher of the CUDA batched power iteration: raw device pointers and a stream, no torch types.
#pragma once

#include <cuda_runtime.h>

#include "fastdp/spectral.h"

namespace fastdp {

// `iters` power-iteration steps (fastdp/spectral.h) on every matrix of `mats` (a device
// table of num_mats descriptors; matrices of any shapes and element types) in ONE launch:
// block l handles matrix l. iters >= 1. Returns the launch error (cudaSuccess if none).
cudaError_t launch_power_iteration_cuda(const PowerIterMatrix* mats, int64_t num_mats, int32_t iters,
                                        cudaStream_t stream);

// The same steps over the whole GPU (fastdp/spectral.h): 2 iters + 1 launches over every matrix of `mats` (a device
// table of num_mats descriptors) and its regions (`items`, a device table of num_items >= num_mats regions, the
// regions of each matrix). Scratch and counters as the descriptors say (counters zero). Returns the launch error.
cudaError_t launch_power_iteration_split_cuda(const PowerIterSplitMatrix* mats, int64_t num_mats,
                                              const PowerIterItem* items, int64_t num_items, int32_t iters,
                                              cudaStream_t stream);

}  // namespace fastdp
