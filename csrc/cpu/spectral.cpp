// The carried certificates' Frobenius distance on CPU (fastdp.ref.spectral.frobenius_distance_up): one pass over
// the two tensors, float64 math, no float64 copies (the reference's two 8-byte-per-element temporaries cost more
// in page faults than the arithmetic on a 2-core machine).
#include "cpu/spectral.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fastdp {
namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per partial sum: fixed, so the sum's order is too
constexpr int kLanes = 8;            // independent accumulators per chunk (a reordering the bound covers)

template <typename T>
void chunk_sums(const T* a, const T* b, int64_t begin, int64_t end, double* sum, double* max) {
  double acc[kLanes] = {}, top[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double d = static_cast<double>(a[i + l]) - static_cast<double>(b[i + l]);
      acc[l] += d * d;
      const double m = std::fabs(d);
      top[l] = m > top[l] ? m : top[l];
    }
  }
  for (; i < end; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    acc[0] += d * d;
    const double m = std::fabs(d);
    top[0] = m > top[0] ? m : top[0];
  }
  double s = 0.0, t = 0.0;
  for (int l = 0; l < kLanes; ++l) {
    s += acc[l];
    t = top[l] > t ? top[l] : t;
  }
  *sum = s;
  *max = t;
}

template <typename T>
void distance_typed(const T* a, const T* b, int64_t n, double* out) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> sums(static_cast<size_t>(chunks)), maxes(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      chunk_sums(a, b, c * kChunk, std::min(n, (c + 1) * kChunk), &sums[c], &maxes[c]);
    }
  });
  double s = 0.0, t = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    s += sums[c];
    t = maxes[c] > t ? maxes[c] : t;
  }
  out[0] = s;
  out[1] = t;
}

}  // namespace

void frobenius_distance_sq_cpu(const void* a, const void* b, int64_t n, CertifiedKind kind, double* out) {
  switch (kind) {
    case CertifiedKind::kFloat32:
      distance_typed(static_cast<const float*>(a), static_cast<const float*>(b), n, out);
      break;
    case CertifiedKind::kFloat64:
      distance_typed(static_cast<const double*>(a), static_cast<const double*>(b), n, out);
      break;
    case CertifiedKind::kFloat16:
      distance_typed(static_cast<const c10::Half*>(a), static_cast<const c10::Half*>(b), n, out);
      break;
    case CertifiedKind::kBFloat16:
      distance_typed(static_cast<const c10::BFloat16*>(a), static_cast<const c10::BFloat16*>(b), n, out);
      break;
  }
}

}  // namespace fastdp
