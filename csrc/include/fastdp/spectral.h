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

}  // namespace fastdp
