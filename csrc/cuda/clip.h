// Launchers of the CUDA per-example row clipping kernels: raw device pointers and a stream, no torch types.
#pragma once

#include <cuda_runtime.h>

#include "fastdp/clip.h"

namespace fastdp {

// y = the clipped rows of x (fastdp/clip.h); x, y: contiguous device buffers [rows, channels, positions] of
// `kind`. chunks == 1: one block per row (two sweeps over the row, no workspace; partial may be nullptr).
// chunks == clip_chunks_per_row(shape) > 1: blocks per row chunk, with a partial workspace of
// rows * chunks floats (two launches). Returns the first launch error (cudaSuccess if none).
cudaError_t launch_clip_rows_cuda(const void* x, void* y, ClipShape shape, float bound, ScalarKind kind,
                                  int64_t chunks, float* partial, cudaStream_t stream);

// dx = the gradient w.r.t. x of the clip for the upstream gradient `grad` (fastdp/clip.h); grad, x, dx as x
// above. The partial workspace (chunks > 1) holds rows * chunks * 2 floats.
cudaError_t launch_clip_rows_backward_cuda(const void* grad, const void* x, void* dx, ClipShape shape, float bound,
                                           ScalarKind kind, int64_t chunks, float* partial, cudaStream_t stream);

}  // namespace fastdp
