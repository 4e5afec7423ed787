#pragma once

#include <cstdint>

#include "cpu/norms.h"

namespace fastdp {

// out[0] = sum_i d_i^2 and out[1] = max_i |d_i| (float64) of d_i = fl64(a_i - b_i) over n contiguous elements of
// `kind` (the raw sums of fastdp.ref.spectral.frobenius_distance_up, before its rounding bound): any summation
// order, so the bound gamma_{n+1} covers it; fixed chunks, so the result does not depend on the thread count.
// A NaN or Inf in a or b makes out[0] NaN or Inf (out[1] may miss it); n may be 0.
void frobenius_distance_sq_cpu(const void* a, const void* b, int64_t n, CertifiedKind kind, double* out);

}  // namespace fastdp
