// Python bindings of fastdp._C: check every input, pick the stream, call the launcher.
// Torch types live here only; kernels take raw pointers (csrc/cpu, csrc/cuda).
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "cpu/noise.h"
#include "fastdp/noise.h"

#ifdef FASTDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/noise.h"
#endif

namespace fastdp {
namespace {

ScalarKind scalar_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK(false, "fastdp noise: tensors must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

// Adds N(0, stds[t]^2) noise to grads[t] in place, or (params non-empty) applies
// params[t] -= step * (grads[t] + noise). All tensors: one device, one dtype, contiguous.
// stream_starts[t] is tensor t's first index in the noise stream (multiple of 4).
void noise_(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
            const std::vector<double>& stds, const std::vector<int64_t>& stream_starts,
            int64_t seed, int64_t offset, int64_t num_draws, double step) {
  const size_t n = grads.size();
  const bool fused = !params.empty();
  TORCH_CHECK(stds.size() == n && stream_starts.size() == n,
              "fastdp noise: need one std and one stream start per tensor");
  TORCH_CHECK(!fused || params.size() == n, "fastdp noise: need one param per grad");
  TORCH_CHECK(num_draws == 1 || num_draws == 4, "fastdp noise: num_draws must be 1 or 4");
  if (n == 0) return;
  const at::Device device = grads[0].device();
  const ScalarKind kind = scalar_kind(grads[0]);

  std::vector<NoiseTensor> table(n);
  std::vector<int32_t> chunk_tensor;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& g = grads[t];
    TORCH_CHECK(g.device() == device, "fastdp noise: all tensors must be on ", device,
                ", tensor ", t, " is on ", g.device());
    TORCH_CHECK(g.scalar_type() == grads[0].scalar_type(),
                "fastdp noise: one dtype per call, tensor ", t, " is ", g.scalar_type());
    TORCH_CHECK(g.is_contiguous(), "fastdp noise: tensor ", t, " is not contiguous");
    TORCH_CHECK(stream_starts[t] >= 0 && stream_starts[t] % 4 == 0,
                "fastdp noise: stream starts must be non-negative multiples of 4");
    void* param = nullptr;
    if (fused) {
      const at::Tensor& p = params[t];
      TORCH_CHECK(p.device() == device && p.scalar_type() == g.scalar_type() &&
                      p.sizes() == g.sizes() && p.is_contiguous(),
                  "fastdp noise: param ", t, " must match its grad in device, dtype and shape",
                  " and be contiguous");
      param = p.data_ptr();
    }
    table[t] = NoiseTensor{g.data_ptr(), param, g.numel(),
                           static_cast<uint64_t>(stream_starts[t]),
                           static_cast<int64_t>(chunk_tensor.size()), static_cast<float>(stds[t])};
    const int64_t chunks = (g.numel() + kNoiseChunk - 1) / kNoiseChunk;
    chunk_tensor.insert(chunk_tensor.end(), chunks, static_cast<int32_t>(t));
  }
  const NoiseArgs args{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                       static_cast<uint32_t>(num_draws), fused, static_cast<float>(step)};
  const int64_t num_chunks = static_cast<int64_t>(chunk_tensor.size());

  if (device.is_cpu()) {
    noise_cpu(table.data(), chunk_tensor.data(), num_chunks, kind, args);
    return;
  }
#ifdef FASTDP_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "fastdp noise: unsupported device ", device);
  const c10::cuda::CUDAGuard guard(device);
  const size_t table_bytes = n * sizeof(NoiseTensor);
  const size_t chunk_bytes = chunk_tensor.size() * sizeof(int32_t);
  at::Tensor host = at::empty({static_cast<int64_t>(table_bytes + chunk_bytes)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), table_bytes);
  std::memcpy(static_cast<uint8_t*>(host.data_ptr()) + table_bytes, chunk_tensor.data(),
              chunk_bytes);
  at::Tensor dev = host.to(device, /*non_blocking=*/true);
  const auto* d_table = reinterpret_cast<const NoiseTensor*>(dev.data_ptr());
  const auto* d_chunks =
      reinterpret_cast<const int32_t*>(static_cast<uint8_t*>(dev.data_ptr()) + table_bytes);
  const cudaError_t err = launch_noise_cuda(d_table, d_chunks, num_chunks, kind, args,
                                            at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp noise: CUDA launch failed: ", cudaGetErrorString(err));
#else
  TORCH_CHECK(false, "fastdp noise: fastdp._C was built without CUDA; tensors are on ", device);
#endif
}

bool has_cuda() {
#ifdef FASTDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace fastdp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastdp C++/CUDA kernels (raw launchers behind fastdp.ops)";
  m.def("noise_", &fastdp::noise_, "Fused per-tensor Gaussian noise / noisy SGD step",
        py::arg("grads"), py::arg("params"), py::arg("stds"), py::arg("stream_starts"),
        py::arg("seed"), py::arg("offset"), py::arg("num_draws"), py::arg("step"));
  m.def("has_cuda", &fastdp::has_cuda, "Whether this build has the CUDA kernels");
}
