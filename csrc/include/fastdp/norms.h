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

#include <algorithm>
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

// GPU only (csrc/cuda/norms.cu): few examples of short sequences (fewer than kGhostSplitTarget work items, e.g.
// 32 examples of T <= 64: one block each) would leave most of the GPU idle, so the column sums split too: block
// (b, pair, slice) makes tile pair (t-block, s-block), t <= s, of example b's Gram of a over one column slice (or
// of g's) into an fp32 scratch tile; block (b, pair) sums the slices in slice order, multiplies the two Grams,
// sums the tile and writes the pair's partial (off-diagonal pairs twice); the partials of an example are added
// in pair order. Slices are multiples of kGhostSliceStep columns, at least kGhostSplitMinCols wide. The shape
// alone decides (results do not depend on the GPU); the rule of kernels/norms.py.
constexpr int64_t kGhostSplitTarget = 256;
constexpr int64_t kGhostSplitMinCols = 256;
constexpr int64_t kGhostSliceStep = 32;

struct GhostPlan {
  bool split;        // the column sums split over blocks
  int64_t t_blocks;  // ghost_num_t_blocks(seq)
  int64_t items;     // partials per example: work items, or tile pairs when split
  int64_t slices_a;  // column slices of a (split)
  int64_t cols_a;    // columns per slice of a
  int64_t slices_g;
  int64_t cols_g;
  int64_t scratch;  // floats of scratch tiles (0 without a split)
};

// At most `pieces` slices of `width` columns, each a multiple of kGhostSliceStep and >= kGhostSplitMinCols wide.
inline void ghost_slices(int64_t width, int64_t pieces, int64_t& slices, int64_t& cols) {
  pieces = std::max<int64_t>(1, std::min(pieces, width / kGhostSplitMinCols));
  const int64_t per = (width + pieces - 1) / pieces;
  cols = (per + kGhostSliceStep - 1) / kGhostSliceStep * kGhostSliceStep;
  slices = (width + cols - 1) / cols;
}

// The launch plan of a ghost norm (the binding sizes the workspaces from it, the launcher launches it).
inline GhostPlan ghost_plan(const GhostNormShape& s) {
  GhostPlan p{false, ghost_num_t_blocks(s.seq), ghost_items_per_example(s.seq), 0, 0, 0, 0, 0};
  if (s.batch * p.items >= kGhostSplitTarget || std::max(s.dim_a, s.dim_g) < 2 * kGhostSplitMinCols) return p;
  p.split = true;
  p.items = p.t_blocks * (p.t_blocks + 1) / 2;
  const int64_t pieces = (kGhostSplitTarget + s.batch * p.items - 1) / (s.batch * p.items);
  const int64_t width = s.dim_a + s.dim_g;
  ghost_slices(s.dim_a, (pieces * s.dim_a + width - 1) / width, p.slices_a, p.cols_a);
  ghost_slices(s.dim_g, (pieces * s.dim_g + width - 1) / width, p.slices_g, p.cols_g);
  p.scratch = s.batch * p.items * (p.slices_a + p.slices_g) * kGhostTile * kGhostTile;
  return p;
}

}  // namespace fastdp
