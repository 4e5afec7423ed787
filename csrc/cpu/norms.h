#pragma once

#include "fastdp/norms.h"

namespace fastdp {

// out[b] (fp32, B values) = ghost norm of example b (see fastdp/norms.h); parallel over
// work items. a and g: contiguous, of `kind`; shape.seq, dim_a and dim_g may be 0.
void ghost_norm_sq_cpu(const void* a, const void* g, const GhostNormShape& shape, ScalarKind kind, float* out);

// Element strides of the certified norms' inputs (the last dimension is contiguous).
struct GhostStrides {
  int64_t batch_a, row_a, batch_g, row_g;
};

enum class CertifiedKind { kFloat32, kFloat64, kFloat16, kBFloat16 };

// Certified ghost norms (fastdp.ref.norms.certified_ghost_norm_sq without its rounding bound, which the caller
// adds), float64 math: dot[b] = sum_{t,s} (a_t . a_s)(g_t . g_s), mass[b] = sum_t |a_t| |g_t| (B values each).
void certified_ghost_norm_sq_cpu(const void* a, const void* g, const GhostNormShape& shape,
                                 const GhostStrides& strides, CertifiedKind kind, double* dot, double* mass);

// Element strides of a batch of row sets [B, T, K] (any layout).
struct GramStrides {
  int64_t batch, row, col;
};

// Float64 Grams out[b] = X_b X_b^T ([B, T, T], both triangles, the certified norms' dot products: any summation
// order, float64 FMAs) of rows x [B, T, K] in any layout.
void certified_gram_cpu(const void* x, int64_t batch, int64_t seq, int64_t k, const GramStrides& strides,
                        CertifiedKind kind, double* out);

// norms and factors (B values each) of sq [L, B] (contiguous fp32); see fastdp/norms.h.
void clip_factors_cpu(const float* sq, int64_t layers, int64_t batch, float clip, float* norms, float* factors);

}  // namespace fastdp
