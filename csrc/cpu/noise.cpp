// CPU kernel of the fused per-tensor Gaussian noise (see csrc/include/fastdp/noise.h).
#include "cpu/noise.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

#include "fastdp/philox.h"

namespace fastdp {
namespace {

template <typename T>
void noise_chunk(const NoiseTensor& t, int64_t begin, int64_t end, const NoiseArgs& args) {
  T* grad = static_cast<T*>(t.grad);
  T* param = static_cast<T*>(t.param);
  const float inv_sqrt_draws = 1.0f / std::sqrt(static_cast<float>(args.num_draws));
  float z[4], n[4];
  for (int64_t base = begin; base < end; base += 4) {
    const uint64_t group = (t.stream_start + static_cast<uint64_t>(base)) >> 2;
    normal4(group, 0, args.offset, args.seed, z);
    for (uint32_t k = 1; k < args.num_draws; ++k) {
      normal4(group, k, args.offset, args.seed, n);
      for (int j = 0; j < 4; ++j) z[j] += n[j];
    }
    const int64_t lanes = std::min<int64_t>(4, end - base);
    for (int64_t j = 0; j < lanes; ++j) {
      const float noise = args.num_draws == 1 ? z[j] : z[j] * inv_sqrt_draws;
      const float g = static_cast<float>(grad[base + j]) + t.std * noise;
      if (args.fused) {
        param[base + j] = static_cast<T>(static_cast<float>(param[base + j]) - args.step * g);
      } else {
        grad[base + j] = static_cast<T>(g);
      }
    }
  }
}

}  // namespace

void noise_cpu(const NoiseTensor* tensors, const int32_t* chunk_tensor, int64_t num_chunks,
               ScalarKind kind, const NoiseArgs& args) {
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const NoiseTensor& t = tensors[chunk_tensor[c]];
      const int64_t begin = (c - t.first_chunk) * kNoiseChunk;
      const int64_t end = std::min(t.numel, begin + kNoiseChunk);
      switch (kind) {
        case ScalarKind::kFloat32: noise_chunk<float>(t, begin, end, args); break;
        case ScalarKind::kFloat16: noise_chunk<c10::Half>(t, begin, end, args); break;
        case ScalarKind::kBFloat16: noise_chunk<c10::BFloat16>(t, begin, end, args); break;
      }
    }
  });
}

}  // namespace fastdp
