// Launchers of the CUDA per-example norm kernels: raw device pointers and a stream, no torch types.
#pragma once

#include <cuda_runtime.h>

#include "fastdp/norms.h"

namespace fastdp {

// out[b] (fp32) = ghost norm of example b (fastdp/norms.h). a, g: contiguous device
// buffers of `kind`; with plan = ghost_plan(shape), partial: device workspace of
// batch * plan.items floats, scratch: of plan.scratch floats (unused without a split).
// Two launches (tiles, then per-example sums in item order), three when split. Returns the
// first launch error (cudaSuccess if none). shape.seq, dim_a, dim_g must be > 0.
cudaError_t launch_ghost_norm_sq_cuda(const void* a, const void* g, GhostNormShape shape, ScalarKind kind,
                                      float* partial, float* scratch, float* out, cudaStream_t stream);

// norms, factors [batch] of sq [layers, batch] (fp32, contiguous, device); one launch.
cudaError_t launch_clip_factors_cuda(const float* sq, int64_t layers, int64_t batch, float clip, float* norms,
                                     float* factors, cudaStream_t stream);

}  // namespace fastdp
