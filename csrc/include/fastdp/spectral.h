// Batched power iteration: the work description of the CUDA kernel (csrc/cuda/spectral.cu).
// Plain C++ (no torch headers) so the .cu compiles with nvcc alone.
//
// Math (fastdp/ref/spectral.py, power_iteration): for each matrix W [m, n] (row-major,
// fp32, fp16 or bf16 elements, fp32 math) and start vector u0 [n] (fp32, any scale):
//   u <- u0 / max(||u0||, kPowerEps)
//   repeat iters times:
//     v <- W u;    v <- v / max(||v||, kPowerEps)
//     u <- W^T v;  sigma <- ||u||;  u <- u / max(sigma, kPowerEps)
// sigma_hat = sigma of the last step (= v^T W u with the returned vectors; 0 for a zero W,
// with u = v = 0). A fixed step count: no data-dependent stopping, no host sync.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fastdp/noise.h"  // ScalarKind: the element types the kernels take

namespace fastdp {

constexpr float kPowerEps = 1e-12f;  // normalize(x) = x / max(||x||, kPowerEps), as the reference

// One matrix of a batched power iteration (one CUDA block). All pointers are device memory.
struct PowerIterMatrix {
  const void* w;      // W [m, n], row-major contiguous, element type `kind`
  const float* u_in;  // start vector [n] (read; any scale, normalised first)
  float* u;           // right vector [n] (written: the final unit u)
  float* v;           // left vector [m] (written: the final unit v)
  float* sigma;       // one float (written: sigma_hat)
  int64_t m;          // rows (> 0)
  int64_t n;          // columns (> 0)
  ScalarKind kind;    // element type of w
};

// The whole-GPU path for matrices of more than kPowerSplitMinNumel elements (the one-block kernel gets one SM's
// bandwidth): W is cut into regions of [rows, cols] (PowerRegions: from the tile, doubled on the smaller side,
// never past the matrix, until at most kPowerTargetRegions regions cover it; the shape alone decides, so results
// do not depend on the GPU; the rule of kernels/spectral.py's _regions), one block per region, two launches per
// step over every split matrix. A block multiplies its region into a partial buffer (v: part[j, m]; u: part[i, n]),
// then arrives at its row (column) region's counter; the last block to arrive sums the partials in the order
// j = 0, 1, ... (deterministic), writes the vector's block and the block's sum of squares, and resets the counter.
constexpr int64_t kPowerSplitMinNumel = 128 * 128;
constexpr int64_t kPowerTargetRegions = 512;
constexpr int64_t kPowerTileRows = 32;
constexpr int64_t kPowerTileCols = 128;

struct PowerRegions {
  int64_t rows;
  int64_t cols;
};

inline PowerRegions power_regions(int64_t m, int64_t n) {
  int64_t rows = kPowerTileRows, cols = kPowerTileCols;
  auto regions = [&] { return ((m + rows - 1) / rows) * ((n + cols - 1) / cols); };
  while (regions() > kPowerTargetRegions) {
    if ((cols < rows || rows >= m) && cols < n) {
      cols *= 2;
    } else {
      rows *= 2;
    }
  }
  return {rows, cols};
}

// One matrix of the whole-GPU path. All pointers are device memory.
struct PowerIterSplitMatrix {
  const void* w;      // W [m, n], row-major contiguous, element type `kind`
  const float* u_in;  // start vector [n] (read on the first step; any scale, normalised first)
  float* u;           // right vector [n] (unscaled between launches; the final unit u)
  float* v;           // left vector [m] (unscaled between launches; the final unit v)
  float* sigma;       // one float (written: sigma_hat)
  float* part;        // scratch: max(n_j m, n_i n) floats of partial products
  float* sq;          // scratch: the blocks' sums of squares, u's n_j then v's n_i
  int32_t* counts;    // n_i + n_j arrival counters (rows, then columns), zero before the first launch
  int64_t m, n;       // shape (> 0)
  int64_t rows, cols;  // region shape (power_regions)
  int64_t n_i, n_j;    // row regions, column regions
  ScalarKind kind;     // element type of w
};

// Block b of a split launch: region (i, j) of matrix `matrix`.
struct PowerIterItem {
  int32_t matrix;
  int32_t i;
  int32_t j;
};

}  // namespace fastdp
