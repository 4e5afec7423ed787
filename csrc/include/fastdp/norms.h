// Per-example gradient norms: the work description shared by the CPU and CUDA kernels.
// Plain C++ (no torch headers) so csrc/cuda/norms.cu compiles with nvcc alone.
//
// Ghost norm of example b, a: [B, T, D] layer inputs, g: [B, T, P] output gradients
// (contiguous, one dtype), fp32 math:
//   out[b] = ||a_b^T g_b||_F^2 = sum_{t,s} (a_bt . a_bs) (g_bt . g_bs)
// The [T, T] Gram matrices are made tile by tile (kGhostTile x kGhostTile) and never
// stored. Symmetry: t-block i meets only s-blocks j >= i, off-diagonal tiles counted
// twice. Balance: work item k of an example takes t-blocks k and n-1-k (n t-blocks), so
// every item computes n + 1 tiles. Items write partial sums; an example's partials are
// added in item order (deterministic, no atomics).
//
// Clip factors of sq: [L, B] fp32 squared norms per layer and example:
//   norms[i] = sqrt(sum_l sq[l, i])     (summed in order l = 0 .. L-1)
//   factors[i] = min(1, clip / (norms[i] + kClipEps)), NaN in, NaN out
// with IEEE sqrt and division.
#pragma once

#include <cstdint>

#include "fastdp/noise.h"  // ScalarKind: the element types the kernels take

namespace fastdp {

constexpr int64_t kGhostTile = 64;  // rows (t) and columns (s) of a Gram tile
constexpr float kClipEps = 1e-6f;

struct GhostNormShape {
  int64_t batch;  // B
  int64_t seq;    // T
  int64_t dim_a;  // D: columns of a
  int64_t dim_g;  // P: columns of g
};

// t-blocks of one example, and work items (pairs of t-blocks) per example.
inline int64_t ghost_num_t_blocks(int64_t seq) { return (seq + kGhostTile - 1) / kGhostTile; }
inline int64_t ghost_items_per_example(int64_t seq) { return (ghost_num_t_blocks(seq) + 1) / 2; }

}  // namespace fastdp
