#pragma once

#include "fastdp/norms.h"

namespace fastdp {

// out[b] (fp32, B values) = ghost norm of example b (see fastdp/norms.h); parallel over
// work items. a and g: contiguous, of `kind`; shape.seq, dim_a and dim_g may be 0.
void ghost_norm_sq_cpu(const void* a, const void* g, const GhostNormShape& shape, ScalarKind kind, float* out);

// norms and factors (B values each) of sq [L, B] (contiguous fp32); see fastdp/norms.h.
void clip_factors_cpu(const float* sq, int64_t layers, int64_t batch, float clip, float* norms, float* factors);

}  // namespace fastdp
