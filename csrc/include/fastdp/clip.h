// Per-example row clipping: the work description shared by the CPU and CUDA kernels.
// Plain C++ (no torch headers) so csrc/cuda/clip.cu compiles with nvcc alone. Math: fastdp/ref/clip.py.
//
// x: [B, C, P] contiguous (B rows = examples). Norm of row b:
//   l2:  n_b = sqrt(sum_{c,p} x_bcp^2)
//   l15: n_b = sqrt(sum_c (sum_p |x_bcp|)^2)
// Forward:  y_b = s_b x_b, s_b = min(1, bound / max(n_b, kClipTiny)) (NaN in, NaN out).
// Backward, upstream gradient g:
//   dx_b = s_b g_b - coef_b d_b,  coef_b = active_b ? (s_b / n_b) (<g_b, x_b> / n_b) : 0,
//   d_b = x_b (l2) or (sum_p |x_bcp|) sign(x_bcp) (l15),
//   active_b = bound / max(n_b, kClipTiny) <= 1 and n_b >= kClipTiny.
// fp32 math, one rounding to the output dtype.
//
// Work split: a row is `units` units of `unit_len` contiguous elements (l2: elements; l15: channels of P
// positions, so a channel is never split). A chunk is up to clip_units_per_chunk() units (about kClipChunk
// elements); a row's chunk partials (norm^2, <g, x>) are added in chunk order, so the result does not depend on
// how chunks are spread over threads or blocks.
#pragma once

#include <math.h>

#include <cstdint>

#include "fastdp/noise.h"  // ScalarKind: the element types the kernels take

#if defined(__CUDACC__)
#define FASTDP_HOST_DEVICE __host__ __device__
#else
#define FASTDP_HOST_DEVICE
#endif

namespace fastdp {

constexpr float kClipTiny = 1e-12f;
constexpr int64_t kClipChunk = 16384;  // elements per chunk (about: whole l15 channels)

enum class ClipNorm : int32_t { kL2 = 0, kL15 = 1 };

struct ClipShape {
  int64_t rows;       // B
  int64_t channels;   // C
  int64_t positions;  // P
  ClipNorm norm;
};

FASTDP_HOST_DEVICE inline int64_t clip_row_len(const ClipShape& s) { return s.channels * s.positions; }
FASTDP_HOST_DEVICE inline int64_t clip_unit_len(const ClipShape& s) {
  return s.norm == ClipNorm::kL15 ? s.positions : 1;
}
FASTDP_HOST_DEVICE inline int64_t clip_units(const ClipShape& s) {
  return s.norm == ClipNorm::kL15 ? s.channels : s.channels * s.positions;
}
FASTDP_HOST_DEVICE inline int64_t clip_units_per_chunk(const ClipShape& s) {
  const int64_t per = kClipChunk / (clip_unit_len(s) > 0 ? clip_unit_len(s) : 1);
  return per > 0 ? per : 1;
}
FASTDP_HOST_DEVICE inline int64_t clip_chunks_per_row(const ClipShape& s) {
  const int64_t per = clip_units_per_chunk(s);
  const int64_t units = clip_units(s);
  return units > 0 ? (units + per - 1) / per : 1;
}

struct ClipScale {
  float norm;   // n_b
  float scale;  // s_b
  bool active;  // whether s_b depends on n_b (the backward's second term)
};

// s_b and friends from the squared norm; IEEE sqrt and division (no fast-math), NaN propagates.
FASTDP_HOST_DEVICE inline ClipScale clip_scale(float norm_sq, float bound) {
  const float norm = sqrtf(norm_sq);
  const float clamped = norm < kClipTiny ? kClipTiny : norm;  // NaN < tiny is false: NaN stays NaN
  const float ratio = bound / clamped;
  return ClipScale{norm, ratio > 1.0f ? 1.0f : ratio, ratio <= 1.0f && norm >= kClipTiny};  // not fminf (NaN)
}

// coef_b of the backward.
FASTDP_HOST_DEVICE inline float clip_backward_coef(const ClipScale& s, float dot) {
  return s.active ? (s.scale / s.norm) * (dot / s.norm) : 0.0f;
}

}  // namespace fastdp
