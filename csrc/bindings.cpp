// Python bindings of fastdp._C: check every input, pick the stream, call the launcher.
// Torch types live here only; kernels take raw pointers (csrc/cpu, csrc/cuda).
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu/clip.h"
#include "cpu/noise.h"
#include "cpu/norms.h"
#include "cpu/recurrence.h"
#include "cpu/recurrence_loop.h"
#include "cpu/spectral.h"
#include "fastdp/clip.h"
#include "fastdp/noise.h"
#include "fastdp/norms.h"

#ifdef FASTDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/clip.h"
#include "cuda/noise.h"
#include "cuda/norms.h"
#include "cuda/orthogonal.h"
#include "cuda/spectral.h"
#endif

namespace fastdp {
namespace {

#ifdef FASTDP_WITH_CUDA
// Host arrays copied to `device` in ONE pinned, stream-ordered copy (no host synchronisation; capturable in a CUDA
// graph): parts[k] = (data, bytes) lands 16-byte aligned at the returned device pointer ptrs[k]. The returned tensor
// owns the device memory (the caching allocators keep it and the pinned buffer until the stream has used them).
at::Tensor device_tables(std::initializer_list<std::pair<const void*, size_t>> parts, const at::Device& device,
                         std::vector<const uint8_t*>& ptrs) {
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const auto& part : parts) {
    offsets.push_back(total);
    total += (part.second + 15) / 16 * 16;
  }
  at::Tensor host = at::empty({static_cast<int64_t>(std::max<size_t>(total, 16))},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  size_t k = 0;
  for (const auto& part : parts) {
    if (part.second > 0) std::memcpy(static_cast<uint8_t*>(host.data_ptr()) + offsets[k], part.first, part.second);
    ++k;
  }
  at::Tensor dev = host.to(device, /*non_blocking=*/true);
  ptrs.clear();
  for (const size_t offset : offsets) ptrs.push_back(static_cast<const uint8_t*>(dev.data_ptr()) + offset);
  return dev;
}
#endif


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

// The per-tensor table of the noise kernels and its launch on grads' device. All tensors: one
// device, one dtype, contiguous; params (and each non-empty state list) one per grad, of its
// shape. stream_starts[t] is tensor t's first index in the noise stream (multiple of 4).
void launch_noise(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                  const std::vector<std::vector<at::Tensor>>& states, const std::vector<double>& stds,
                  const std::vector<int64_t>& stream_starts, const std::vector<double>& grad_weights,
                  const NoiseArgs& args) {
  const size_t n = grads.size();
  const bool with_params = args.update != NoiseUpdate::kAdd && args.update != NoiseUpdate::kRelease;
  TORCH_CHECK(stds.size() == n && stream_starts.size() == n && grad_weights.size() == n,
              "fastdp noise: need one std, one stream start and one gradient weight per tensor");
  TORCH_CHECK(with_params ? params.size() == n : params.empty(),
              with_params ? "fastdp noise: need one param per grad" : "fastdp noise: no params here");
  TORCH_CHECK(args.num_draws == 1 || args.num_draws == 4, "fastdp noise: num_draws must be 1 or 4");
  TORCH_CHECK(states.size() == 3, "fastdp noise: three state lists (empty where unused)");
  for (const auto& list : states) {
    TORCH_CHECK(list.empty() || list.size() == n, "fastdp noise: a state list needs one tensor per grad");
  }
  if (n == 0) return;
  const at::Device device = grads[0].device();
  const ScalarKind kind = scalar_kind(grads[0]);
  TORCH_CHECK(!is_release(args.update) || kind == ScalarKind::kFloat32,
              "fastdp noise: the release kinds take float32 tensors, got ", grads[0].scalar_type());
  auto check_like = [&](const at::Tensor& x, const at::Tensor& g, size_t t, const char* what) {
    TORCH_CHECK(x.device() == device && x.scalar_type() == g.scalar_type() && x.sizes() == g.sizes() &&
                    x.is_contiguous(),
                "fastdp noise: ", what, " ", t, " must match its grad in device, dtype and shape and be contiguous");
  };

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
    NoiseTensor entry{};
    entry.grad = g.data_ptr();
    if (with_params) {
      check_like(params[t], g, t, "param");
      entry.param = params[t].data_ptr();
    }
    for (int k = 0; k < 3; ++k) {
      if (states[k].empty()) continue;
      check_like(states[k][t], g, t, "optimizer state");
      entry.state[k] = states[k][t].data_ptr();
    }
    entry.numel = g.numel();
    entry.stream_start = static_cast<uint64_t>(stream_starts[t]);
    entry.first_chunk = static_cast<int64_t>(chunk_tensor.size());
    entry.std = static_cast<float>(stds[t]);
    entry.grad_weight = static_cast<float>(grad_weights[t]);
    table[t] = entry;
    const int64_t chunks = (g.numel() + kNoiseChunk - 1) / kNoiseChunk;
    chunk_tensor.insert(chunk_tensor.end(), chunks, static_cast<int32_t>(t));
  }
  const int64_t num_chunks = static_cast<int64_t>(chunk_tensor.size());

  if (device.is_cpu()) {
    noise_cpu(table.data(), chunk_tensor.data(), num_chunks, kind, args);
    return;
  }
#ifdef FASTDP_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "fastdp noise: unsupported device ", device);
  const c10::cuda::CUDAGuard guard(device);
  std::vector<const uint8_t*> ptrs;
  const at::Tensor tables = device_tables(
      {{table.data(), n * sizeof(NoiseTensor)}, {chunk_tensor.data(), chunk_tensor.size() * sizeof(int32_t)}}, device,
      ptrs);
  const auto* d_table = reinterpret_cast<const NoiseTensor*>(ptrs[0]);
  const auto* d_chunks = reinterpret_cast<const int32_t*>(ptrs[1]);
  const cudaError_t err = launch_noise_cuda(d_table, d_chunks, num_chunks, kind, args,
                                            at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp noise: CUDA launch failed: ", cudaGetErrorString(err));
#else
  TORCH_CHECK(false, "fastdp noise: fastdp._C was built without CUDA; tensors are on ", device);
#endif
}

NoiseArgs noise_args(int64_t seed, int64_t offset, int64_t num_draws, NoiseUpdate update) {
  NoiseArgs args{};
  args.seed = static_cast<uint64_t>(seed);
  args.offset = static_cast<uint64_t>(offset);
  args.num_draws = static_cast<uint32_t>(num_draws);
  args.update = update;
  return args;
}

// Adds N(0, stds[t]^2) noise to grads[t] in place, or (params non-empty) applies
// params[t] -= step * (grads[t] + noise). See launch_noise.
void noise_(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
            const std::vector<double>& stds, const std::vector<int64_t>& stream_starts,
            int64_t seed, int64_t offset, int64_t num_draws, double step) {
  NoiseArgs args = noise_args(seed, offset, num_draws, params.empty() ? NoiseUpdate::kAdd : NoiseUpdate::kSgdStep);
  args.step = static_cast<float>(step);
  launch_noise(grads, params, {{}, {}, {}}, stds, stream_starts, std::vector<double>(grads.size(), 1.0), args);
}

// The release kinds of csrc/include/fastdp/noise.h: grads[t] <- (grads[t] + noise) / scale, then
// (update 3, 4) the optimizer's update of params[t] and states[k][t]. hyper: the fields of
// UpdateArgs in order (scale, lr, weight_decay, decay, momentum, beta1_weight, beta2,
// beta2_weight, eps, step_size, bc2_sqrt, nesterov, maximize, amsgrad).
void release_(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
              const std::vector<std::vector<at::Tensor>>& states, const std::vector<double>& stds,
              const std::vector<int64_t>& stream_starts, const std::vector<double>& grad_weights,
              int64_t seed, int64_t offset, int64_t num_draws, int64_t update, const std::vector<double>& hyper) {
  TORCH_CHECK(update >= 2 && update <= 4, "fastdp release: update must be 2 (release), 3 (SGD) or 4 (Adam)");
  TORCH_CHECK(hyper.size() == 14, "fastdp release: 14 hyperparameters, got ", hyper.size());
  NoiseArgs args = noise_args(seed, offset, num_draws, static_cast<NoiseUpdate>(update));
  TORCH_CHECK(std::isfinite(hyper[0]) && hyper[0] > 0, "fastdp release: scale must be finite and > 0");
  auto f = [&](int i) { return static_cast<float>(hyper[i]); };
  args.opt = UpdateArgs{f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), f(8), f(9), f(10),
                        hyper[11] != 0, hyper[12] != 0, hyper[13] != 0};
  // The states the update reads and writes (release_element); only those reach the kernels.
  const bool sgd = update == 3, adam = update == 4;
  const bool needed[3] = {(sgd && args.opt.momentum != 0.0f) || adam, adam, adam && args.opt.amsgrad};
  TORCH_CHECK(states.size() == 3, "fastdp release: three state lists (empty where unused)");
  std::vector<std::vector<at::Tensor>> used(3);
  for (int k = 0; k < 3; ++k) {
    TORCH_CHECK(!needed[k] || grads.empty() || !states[k].empty(), "fastdp release: update ", update,
                " with these hyperparameters reads and writes optimizer state ", k, "; pass one tensor per grad");
    if (needed[k]) used[k] = states[k];
  }
  launch_noise(grads, params, used, stds, stream_starts, grad_weights, args);
}

// Element kind of a ghost-norm input (fp32, fp16, bf16; float64 runs the torch reference).
ScalarKind norms_scalar_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK(false, "fastdp ghost_norm_sq: inputs must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

// out[b] = ||a_b^T g_b||_F^2 (fp32 [B]) for a [B, T, D], g [B, T, P]: one device, one dtype,
// contiguous. See csrc/include/fastdp/norms.h.
at::Tensor ghost_norm_sq(const at::Tensor& a, const at::Tensor& g) {
  TORCH_CHECK(a.dim() == 3 && g.dim() == 3, "fastdp ghost_norm_sq: a and g must be [B, T, features], got ",
              a.sizes(), " and ", g.sizes());
  TORCH_CHECK(a.size(0) == g.size(0) && a.size(1) == g.size(1),
              "fastdp ghost_norm_sq: a and g must match in B and T, got ", a.sizes(), " and ", g.sizes());
  TORCH_CHECK(a.scalar_type() == g.scalar_type(), "fastdp ghost_norm_sq: a is ", a.scalar_type(), " but g is ",
              g.scalar_type());
  TORCH_CHECK(a.device() == g.device(), "fastdp ghost_norm_sq: a is on ", a.device(), " but g is on ",
              g.device());
  TORCH_CHECK(a.is_contiguous() && g.is_contiguous(), "fastdp ghost_norm_sq: a and g must be contiguous");
  const ScalarKind kind = norms_scalar_kind(a);
  const GhostNormShape shape{a.size(0), a.size(1), a.size(2), g.size(2)};
  at::Tensor out = at::empty({shape.batch}, a.options().dtype(at::kFloat));
  if (shape.batch == 0) return out;
  if (shape.seq == 0 || shape.dim_a == 0 || shape.dim_g == 0) return out.zero_();
  if (a.device().is_cpu()) {
    ghost_norm_sq_cpu(a.data_ptr(), g.data_ptr(), shape, kind, out.data_ptr<float>());
    return out;
  }
#ifdef FASTDP_WITH_CUDA
  TORCH_CHECK(a.device().is_cuda(), "fastdp ghost_norm_sq: unsupported device ", a.device());
  const c10::cuda::CUDAGuard guard(a.device());
  const GhostPlan plan = ghost_plan(shape);
  at::Tensor partial = at::empty({shape.batch * plan.items}, out.options());
  at::Tensor scratch = at::empty({plan.scratch}, out.options());
  const cudaError_t err = launch_ghost_norm_sq_cuda(a.data_ptr(), g.data_ptr(), shape, kind,
                                                    partial.data_ptr<float>(), scratch.data_ptr<float>(),
                                                    out.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp ghost_norm_sq: CUDA launch failed: ", cudaGetErrorString(err));
  return out;
#else
  TORCH_CHECK(false, "fastdp ghost_norm_sq: fastdp._C was built without CUDA; tensors are on ", a.device());
#endif
}

// Element kind of a certified-norm input (float32, float64, float16, bfloat16).
CertifiedKind certified_kind(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return CertifiedKind::kFloat32;
    case at::kDouble: return CertifiedKind::kFloat64;
    case at::kHalf: return CertifiedKind::kFloat16;
    case at::kBFloat16: return CertifiedKind::kBFloat16;
    default:
      TORCH_CHECK(false, "fastdp ", op, ": inputs must be float32, float64, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

// Float64 Grams [B, T, T] of rows x [B, T, K] on CPU, any strides (the certified norms' Grams).
at::Tensor certified_gram(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3, "fastdp certified_gram: x must be [B, T, K], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "fastdp certified_gram: CPU tensors only, got ", x.device());
  const CertifiedKind kind = certified_kind(x, "certified_gram");
  const int64_t batch = x.size(0), seq = x.size(1), k = x.size(2);
  at::Tensor out = at::empty({batch, seq, seq}, x.options().dtype(at::kDouble));
  if (batch > 0) {
    certified_gram_cpu(x.data_ptr(), batch, seq, k, GramStrides{x.stride(0), x.stride(1), x.stride(2)}, kind,
                       out.data_ptr<double>());
  }
  return out;
}

// (sum of squares, max abs), float64 [2], of fl64(a - b) over two CPU tensors of one shape and dtype, any layout
// (the raw sums of fastdp.ref.spectral.frobenius_distance_up, before its rounding bound).
at::Tensor frobenius_distance_sq(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes(), "fastdp frobenius_distance_sq: shapes differ, ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "fastdp frobenius_distance_sq: a is ", a.scalar_type(),
              " but b is ", b.scalar_type());
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "fastdp frobenius_distance_sq: CPU tensors only, got ",
              a.device(), " and ", b.device());
  const CertifiedKind kind = certified_kind(a, "frobenius_distance_sq");
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  at::Tensor out = at::empty({2}, a.options().dtype(at::kDouble));
  frobenius_distance_sq_cpu(x.data_ptr(), y.data_ptr(), x.numel(), kind, out.data_ptr<double>());
  return out;
}

// (dot, mass), float64 [B], of a [B, T, D] and g [B, T, P] on CPU (one dtype, last dimension contiguous): the
// float64 Gram products and the mass of fastdp.ref.norms.certified_ghost_norm_sq, before its rounding bound.
std::tuple<at::Tensor, at::Tensor> certified_ghost_norm_sq(const at::Tensor& a, const at::Tensor& g) {
  TORCH_CHECK(a.dim() == 3 && g.dim() == 3, "fastdp certified_ghost_norm_sq: a and g must be [B, T, features], got ",
              a.sizes(), " and ", g.sizes());
  TORCH_CHECK(a.size(0) == g.size(0) && a.size(1) == g.size(1),
              "fastdp certified_ghost_norm_sq: a and g must match in B and T, got ", a.sizes(), " and ", g.sizes());
  TORCH_CHECK(a.scalar_type() == g.scalar_type(), "fastdp certified_ghost_norm_sq: a is ", a.scalar_type(),
              " but g is ", g.scalar_type());
  TORCH_CHECK(a.device().is_cpu() && g.device().is_cpu(), "fastdp certified_ghost_norm_sq: CPU tensors only, got ",
              a.device(), " and ", g.device());
  const CertifiedKind kind = certified_kind(a, "certified_ghost_norm_sq");
  const at::Tensor x = a.stride(2) == 1 || a.size(2) <= 1 ? a : a.contiguous();
  const at::Tensor y = g.stride(2) == 1 || g.size(2) <= 1 ? g : g.contiguous();
  const GhostNormShape shape{a.size(0), a.size(1), a.size(2), g.size(2)};
  const GhostStrides strides{x.stride(0), x.stride(1), y.stride(0), y.stride(1)};
  const auto options = a.options().dtype(at::kDouble);
  at::Tensor dot = at::empty({shape.batch}, options), mass = at::empty({shape.batch}, options);
  if (shape.batch > 0) {
    certified_ghost_norm_sq_cpu(x.data_ptr(), y.data_ptr(), shape, strides, kind, dot.data_ptr<double>(),
                                mass.data_ptr<double>());
  }
  return {dot, mass};
}

// (norms, factors), fp32 [B], of sq_norms [L, B] (fp32, contiguous): norms = sqrt of the
// column sums, factors = min(1, clip_norm / (norms + 1e-6)); NaN propagates.
std::tuple<at::Tensor, at::Tensor> clip_factors(const at::Tensor& sq_norms, double clip_norm) {
  TORCH_CHECK(sq_norms.dim() == 2, "fastdp clip_factors: sq_norms must be [L, B], got ", sq_norms.sizes());
  TORCH_CHECK(sq_norms.scalar_type() == at::kFloat, "fastdp clip_factors: sq_norms must be float32, got ",
              sq_norms.scalar_type());
  TORCH_CHECK(sq_norms.is_contiguous(), "fastdp clip_factors: sq_norms must be contiguous");
  TORCH_CHECK(std::isfinite(clip_norm) && clip_norm > 0, "fastdp clip_factors: clip_norm must be finite and > 0, got ",
              clip_norm);
  const int64_t layers = sq_norms.size(0), batch = sq_norms.size(1);
  at::Tensor norms = at::empty({batch}, sq_norms.options());
  at::Tensor factors = at::empty({batch}, sq_norms.options());
  if (batch == 0) return {norms, factors};
  const float clip = static_cast<float>(clip_norm);
  if (sq_norms.device().is_cpu()) {
    clip_factors_cpu(sq_norms.data_ptr<float>(), layers, batch, clip, norms.data_ptr<float>(),
                     factors.data_ptr<float>());
    return {norms, factors};
  }
#ifdef FASTDP_WITH_CUDA
  TORCH_CHECK(sq_norms.device().is_cuda(), "fastdp clip_factors: unsupported device ", sq_norms.device());
  const c10::cuda::CUDAGuard guard(sq_norms.device());
  const cudaError_t err =
      launch_clip_factors_cuda(sq_norms.data_ptr<float>(), layers, batch, clip, norms.data_ptr<float>(),
                               factors.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp clip_factors: CUDA launch failed: ", cudaGetErrorString(err));
  return {norms, factors};
#else
  TORCH_CHECK(false, "fastdp clip_factors: fastdp._C was built without CUDA; tensors are on ", sq_norms.device());
#endif
}

// The [B, C, P] work description of a clip input: 3-D, contiguous, fp32/fp16/bf16 (float64 runs the reference).
ClipShape clip_shape(const char* op, const at::Tensor& x, bool l15) {
  TORCH_CHECK(x.dim() == 3, "fastdp ", op, ": x must be [B, C, P] (rows, channels, positions), got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "fastdp ", op, ": x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "fastdp ", op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type(),
              " (float64 runs the torch reference)");
  return ClipShape{x.size(0), x.size(1), x.size(2), l15 ? ClipNorm::kL15 : ClipNorm::kL2};
}

void check_bound(const char* op, double bound) {
  TORCH_CHECK(std::isfinite(bound) && bound > 0, "fastdp ", op, ": bound must be finite and > 0, got ", bound);
}

#ifdef FASTDP_WITH_CUDA
// Blocks per row on CUDA: 1 (a block per row), or every chunk of the row when long rows are too few to fill
// the GPU (fewer than 4 per SM).
int64_t clip_cuda_chunks(const ClipShape& s, const at::Device& device) {
  const int64_t chunks = clip_chunks_per_row(s);
  const int64_t sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  return chunks > 1 && s.rows < 4 * sms ? chunks : 1;
}
#endif

// y [B, C, P] = x with each row b scaled to norm <= bound: y_b = min(1, bound / max(n_b, 1e-12)) x_b, n_b the l2
// norm of the row (l15 = false) or the l15 norm sqrt(sum_c (sum_p |x_bcp|)^2). See csrc/include/fastdp/clip.h.
at::Tensor clip_rows(const at::Tensor& x, double bound, bool l15) {
  const ClipShape shape = clip_shape("clip_rows", x, l15);
  check_bound("clip_rows", bound);
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  const ScalarKind kind = scalar_kind(x);
  if (x.device().is_cpu()) {
    clip_rows_cpu(x.data_ptr(), y.data_ptr(), shape, static_cast<float>(bound), kind);
    return y;
  }
#ifdef FASTDP_WITH_CUDA
  TORCH_CHECK(x.device().is_cuda(), "fastdp clip_rows: unsupported device ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t chunks = clip_cuda_chunks(shape, x.device());
  at::Tensor partial = at::empty({chunks > 1 ? shape.rows * chunks : 0}, x.options().dtype(at::kFloat));
  const cudaError_t err =
      launch_clip_rows_cuda(x.data_ptr(), y.data_ptr(), shape, static_cast<float>(bound), kind, chunks,
                            chunks > 1 ? partial.data_ptr<float>() : nullptr, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp clip_rows: CUDA launch failed: ", cudaGetErrorString(err));
  return y;
#else
  TORCH_CHECK(false, "fastdp clip_rows: fastdp._C was built without CUDA; tensors are on ", x.device());
#endif
}

// dx [B, C, P]: the gradient w.r.t. x of clip_rows(x, bound, l15) for the upstream gradient grad (same shape,
// dtype and device as x, contiguous). See csrc/include/fastdp/clip.h.
at::Tensor clip_rows_backward(const at::Tensor& grad, const at::Tensor& x, double bound, bool l15) {
  const ClipShape shape = clip_shape("clip_rows_backward", x, l15);
  check_bound("clip_rows_backward", bound);
  TORCH_CHECK(grad.sizes() == x.sizes(), "fastdp clip_rows_backward: grad is ", grad.sizes(), " but x is ",
              x.sizes());
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), "fastdp clip_rows_backward: grad is ", grad.scalar_type(),
              " but x is ", x.scalar_type());
  TORCH_CHECK(grad.device() == x.device(), "fastdp clip_rows_backward: grad is on ", grad.device(), " but x on ",
              x.device());
  TORCH_CHECK(grad.is_contiguous(), "fastdp clip_rows_backward: grad must be contiguous");
  at::Tensor dx = at::empty_like(x);
  if (x.numel() == 0) return dx;
  const ScalarKind kind = scalar_kind(x);
  if (x.device().is_cpu()) {
    clip_rows_backward_cpu(grad.data_ptr(), x.data_ptr(), dx.data_ptr(), shape, static_cast<float>(bound), kind);
    return dx;
  }
#ifdef FASTDP_WITH_CUDA
  TORCH_CHECK(x.device().is_cuda(), "fastdp clip_rows_backward: unsupported device ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t chunks = clip_cuda_chunks(shape, x.device());
  at::Tensor partial = at::empty({chunks > 1 ? 2 * shape.rows * chunks : 0}, x.options().dtype(at::kFloat));
  const cudaError_t err = launch_clip_rows_backward_cuda(
      grad.data_ptr(), x.data_ptr(), dx.data_ptr(), shape, static_cast<float>(bound), kind, chunks,
      chunks > 1 ? partial.data_ptr<float>() : nullptr, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp clip_rows_backward: CUDA launch failed: ", cudaGetErrorString(err));
  return dx;
#else
  TORCH_CHECK(false, "fastdp clip_rows_backward: fastdp._C was built without CUDA; tensors are on ", x.device());
#endif
}

#ifdef FASTDP_WITH_CUDA
// Element kind of a spectral/orthogonal kernel input (fp32, fp16, bf16; float64 runs the reference).
ScalarKind matrix_scalar_kind(const char* op, const at::Tensor& t, size_t index) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK(false, "fastdp ", op, ": matrix ", index, " must be float32, float16 or bfloat16, got ",
                  t.scalar_type(), " (float64 runs the torch reference)");
  }
}

// `iters` power-iteration steps on every weights[l] [m_l, n_l] (CUDA, one device, contiguous,
// fp32/fp16/bf16, mixed allowed) from vectors[l] [n_l] (fp32, contiguous, any scale): one launch over the
// matrices of at most kPowerSplitMinNumel elements, and 2 iters + 1 launches over the whole GPU for the larger
// ones (csrc/include/fastdp/spectral.h). Returns (sigma_hat fp32 [L], u list [n_l], v list [m_l]).
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> power_iteration_cuda(
    const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& vectors, int64_t iters) {
  const size_t count = weights.size();
  TORCH_CHECK(count > 0, "fastdp power_iteration_cuda: weights is empty; pass at least one matrix");
  TORCH_CHECK(vectors.size() == count, "fastdp power_iteration_cuda: ", vectors.size(), " vectors for ", count,
              " weights; pass one start vector per matrix");
  TORCH_CHECK(iters >= 1 && iters <= 0x7fffffffLL, "fastdp power_iteration_cuda: iters must be in [1, 2^31), got ",
              iters);
  const at::Device device = weights[0].device();
  TORCH_CHECK(device.is_cuda(), "fastdp power_iteration_cuda: weights must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const at::TensorOptions f32 = weights[0].options().dtype(at::kFloat);
  std::vector<PowerIterMatrix> table;
  std::vector<PowerIterSplitMatrix> split;
  std::vector<PowerIterItem> items;
  std::vector<at::Tensor> us, vs;
  us.reserve(count);
  vs.reserve(count);
  at::Tensor sigma = at::empty({static_cast<int64_t>(count)}, f32);
  int64_t part_size = 0, sq_size = 0, count_size = 0;
  for (size_t l = 0; l < count; ++l) {
    const at::Tensor& w = weights[l];
    const at::Tensor& u = vectors[l];
    TORCH_CHECK(w.dim() == 2 && w.numel() > 0, "fastdp power_iteration_cuda: weights[", l,
                "] must be a non-empty 2-D matrix, got shape ", w.sizes());
    TORCH_CHECK(w.device() == device, "fastdp power_iteration_cuda: weights[", l, "] is on ", w.device(),
                " but weights[0] on ", device);
    TORCH_CHECK(w.is_contiguous(), "fastdp power_iteration_cuda: weights[", l, "] is not contiguous");
    const ScalarKind kind = matrix_scalar_kind("power_iteration_cuda", w, l);
    const int64_t m = w.size(0), n = w.size(1);
    TORCH_CHECK(u.device() == device, "fastdp power_iteration_cuda: vectors[", l, "] is on ", u.device(),
                " but weights[", l, "] on ", device);
    TORCH_CHECK(u.scalar_type() == at::kFloat, "fastdp power_iteration_cuda: vectors[", l,
                "] must be float32, got ", u.scalar_type());
    TORCH_CHECK(u.is_contiguous() && u.numel() == n, "fastdp power_iteration_cuda: vectors[", l,
                "] must be contiguous with ", n, " elements (the columns of weights[", l, "]), got ", u.sizes());
    us.push_back(at::empty({n}, f32));
    vs.push_back(at::empty({m}, f32));
    float* sigma_l = sigma.data_ptr<float>() + l;
    if (m * n <= kPowerSplitMinNumel) {
      table.push_back(PowerIterMatrix{w.data_ptr(), u.data_ptr<float>(), us.back().data_ptr<float>(),
                                      vs.back().data_ptr<float>(), sigma_l, m, n, kind});
      continue;
    }
    const PowerRegions regions = power_regions(m, n);
    const int64_t n_i = (m + regions.rows - 1) / regions.rows, n_j = (n + regions.cols - 1) / regions.cols;
    const auto index = static_cast<int32_t>(split.size());
    for (int64_t i = 0; i < n_i; ++i) {
      for (int64_t j = 0; j < n_j; ++j) items.push_back({index, static_cast<int32_t>(i), static_cast<int32_t>(j)});
    }
    // Scratch pointers are offsets until the buffers exist (below).
    split.push_back(PowerIterSplitMatrix{w.data_ptr(), u.data_ptr<float>(), us.back().data_ptr<float>(),
                                         vs.back().data_ptr<float>(), sigma_l,
                                         reinterpret_cast<float*>(part_size), reinterpret_cast<float*>(sq_size),
                                         reinterpret_cast<int32_t*>(count_size), m, n, regions.rows, regions.cols,
                                         n_i, n_j, kind});
    part_size += std::max(n_j * m, n_i * n);
    sq_size += n_i + n_j;
    count_size += n_i + n_j;
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  std::vector<const uint8_t*> ptrs;
  if (!table.empty()) {
    const at::Tensor tables = device_tables({{table.data(), table.size() * sizeof(PowerIterMatrix)}}, device, ptrs);
    const cudaError_t err = launch_power_iteration_cuda(reinterpret_cast<const PowerIterMatrix*>(ptrs[0]),
                                                        static_cast<int64_t>(table.size()),
                                                        static_cast<int32_t>(iters), stream);
    TORCH_CHECK(err == cudaSuccess, "fastdp power_iteration_cuda: CUDA launch failed: ", cudaGetErrorString(err));
  }
  if (!split.empty()) {
    at::Tensor part = at::empty({part_size}, f32);
    at::Tensor sq = at::empty({sq_size}, f32);
    at::Tensor counts = at::zeros({count_size}, f32.dtype(at::kInt));
    for (PowerIterSplitMatrix& d : split) {
      d.part = part.data_ptr<float>() + reinterpret_cast<intptr_t>(d.part);
      d.sq = sq.data_ptr<float>() + reinterpret_cast<intptr_t>(d.sq);
      d.counts = counts.data_ptr<int32_t>() + reinterpret_cast<intptr_t>(d.counts);
    }
    TORCH_CHECK(items.size() <= 0x7fffffffULL, "fastdp power_iteration_cuda: ", items.size(),
                " regions exceed the grid; split the list");
    const at::Tensor tables = device_tables({{split.data(), split.size() * sizeof(PowerIterSplitMatrix)},
                                             {items.data(), items.size() * sizeof(PowerIterItem)}},
                                            device, ptrs);
    const cudaError_t err = launch_power_iteration_split_cuda(
        reinterpret_cast<const PowerIterSplitMatrix*>(ptrs[0]), static_cast<int64_t>(split.size()),
        reinterpret_cast<const PowerIterItem*>(ptrs[1]), static_cast<int64_t>(items.size()),
        static_cast<int32_t>(iters), stream);
    TORCH_CHECK(err == cudaSuccess, "fastdp power_iteration_cuda: CUDA launch failed: ", cudaGetErrorString(err));
  }
  return {sigma, us, vs};
}

// `iters` Björck steps W <- (1 + beta) W - beta W (W^T W) on every matrix of `weights` (CUDA, one device,
// contiguous, non-empty, fp32/fp16/bf16, mixed allowed), fp32 math, with the smaller Gram matrix (a wide w is
// transposed first, as the reference and the Triton path), in 2 iters launches over the whole list
// (csrc/cuda/orthogonal.h). Returns new contiguous matrices of the inputs' shapes and dtypes.
std::vector<at::Tensor> bjorck_cuda(const std::vector<at::Tensor>& weights, int64_t iters, double beta) {
  const size_t count = weights.size();
  TORCH_CHECK(count > 0 && count <= 65535, "fastdp bjorck_cuda: pass 1 to 65535 matrices, got ", count);
  TORCH_CHECK(iters >= 1 && iters <= 0x7fffffffLL, "fastdp bjorck_cuda: iters must be in [1, 2^31), got ", iters);
  TORCH_CHECK(std::isfinite(beta) && beta > 0 && beta <= 1, "fastdp bjorck_cuda: beta must be in (0, 1], got ", beta);
  const at::Device device = weights[0].device();
  TORCH_CHECK(device.is_cuda(), "fastdp bjorck_cuda: weights must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  std::vector<int64_t> offsets(count), gram_offsets(count);
  int64_t total = 0, gram_total = 0, max_row_tiles = 0, max_col_tiles = 0;
  for (size_t l = 0; l < count; ++l) {
    const at::Tensor& w = weights[l];
    TORCH_CHECK(w.dim() == 2 && w.numel() > 0, "fastdp bjorck_cuda: weights[", l,
                "] must be a non-empty 2-D matrix, got shape ", w.sizes());
    TORCH_CHECK(w.device() == device, "fastdp bjorck_cuda: weights[", l, "] is on ", w.device(), " but weights[0] on ",
                device);
    TORCH_CHECK(w.is_contiguous(), "fastdp bjorck_cuda: weights[", l, "] is not contiguous");
    matrix_scalar_kind("bjorck_cuda", w, l);
    const int64_t m = std::max(w.size(0), w.size(1)), n = std::min(w.size(0), w.size(1));  // X = w or w^T
    offsets[l] = total;
    gram_offsets[l] = gram_total;
    total += 2 * m * n;  // ping-pong pair [2, m, n]
    gram_total += n * n;
    max_row_tiles = std::max(max_row_tiles, (m + kBjorckTile - 1) / kBjorckTile);
    max_col_tiles = std::max(max_col_tiles, (n + kBjorckTile - 1) / kBjorckTile);
  }
  TORCH_CHECK(max_col_tiles <= 65535, "fastdp bjorck_cuda: a matrix has ", max_col_tiles * kBjorckTile,
              " or more columns (after transposing wide ones); the grid allows at most ", 65535 * kBjorckTile);
  const at::TensorOptions f32 = weights[0].options().dtype(at::kFloat);
  at::Tensor buf = at::empty({total}, f32);
  at::Tensor gram = at::empty({gram_total}, f32);  // workspace
  std::vector<BjorckMatrix> table(count);
  for (size_t l = 0; l < count; ++l) {
    const at::Tensor& w = weights[l];
    const bool wide = w.size(0) < w.size(1);
    const at::Tensor x = wide ? w.t() : w;  // [m, n], m >= n
    const int64_t m = x.size(0), n = x.size(1);
    buf.narrow(0, offsets[l], m * n).view({m, n}).copy_(x);
    table[l] = BjorckMatrix{buf.data_ptr<float>() + offsets[l], gram.data_ptr<float>() + gram_offsets[l], m, n};
  }
  std::vector<const uint8_t*> ptrs;
  const at::Tensor tables = device_tables({{table.data(), count * sizeof(BjorckMatrix)}}, device, ptrs);
  const cudaError_t err = launch_bjorck_cuda(reinterpret_cast<const BjorckMatrix*>(ptrs[0]),
                                             static_cast<int64_t>(count), max_row_tiles, max_col_tiles,
                                             static_cast<int32_t>(iters), static_cast<float>(beta),
                                             at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fastdp bjorck_cuda: CUDA launch failed: ", cudaGetErrorString(err));
  std::vector<at::Tensor> out;
  out.reserve(count);
  for (size_t l = 0; l < count; ++l) {
    const at::Tensor& w = weights[l];
    const bool wide = w.size(0) < w.size(1);
    const int64_t m = wide ? w.size(1) : w.size(0), n = wide ? w.size(0) : w.size(1);
    const at::Tensor result = buf.narrow(0, offsets[l] + (iters % 2) * m * n, m * n).view({m, n});
    at::Tensor o = at::empty(w.sizes(), w.options());
    o.copy_(wide ? result.t() : result);
    out.push_back(o);
  }
  return out;
}
#endif

// ------------------------------------------------------------------------------------------ recurrences
// One layer and direction of fastdp.nn's RNN/LSTM/GRU on CPU (csrc/cpu/recurrence_loop.h): every tensor on the CPU
// in one dtype (float32 or float64); sequences time-major [T, B, *] with a unit last stride (copied otherwise);
// a mask [T, B] bool (copied contiguous). Shapes checked here; the loops trust them.

struct RecurrenceCheck {
  const char* op;
  at::ScalarType dtype;

  void tensor(const at::Tensor& t, const char* name, std::initializer_list<int64_t> shape) const {
    TORCH_CHECK(t.device().is_cpu(), "fastdp ", op, ": ", name, " must be a CPU tensor, got one on ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, "fastdp ", op, ": ", name, " is ", t.scalar_type(), "; every tensor must be ",
                dtype, " (float32 or float64)");
    TORCH_CHECK(t.sizes().equals(shape), "fastdp ", op, ": ", name, " must have shape ", at::IntArrayRef(shape),
                ", got ", t.sizes());
  }

  void optional(const c10::optional<at::Tensor>& t, const char* name, std::initializer_list<int64_t> shape) const {
    if (t.has_value() && t->defined()) tensor(*t, name, shape);
  }

  // a sequence [T, B, n] with a unit last stride (rows addressed by stride(0) and stride(1))
  at::Tensor sequence(const at::Tensor& t, const char* name, std::initializer_list<int64_t> shape) const {
    tensor(t, name, shape);
    return t.stride(2) == 1 || t.size(2) <= 1 ? t : t.contiguous();
  }

  at::Tensor mask(const c10::optional<at::Tensor>& m, int64_t steps, int64_t batch) const {
    if (!m.has_value() || !m->defined()) return at::Tensor();
    TORCH_CHECK(m->device().is_cpu() && m->scalar_type() == at::kBool, "fastdp ", op,
                ": mask must be a CPU bool tensor, got ", m->scalar_type(), " on ", m->device());
    TORCH_CHECK(m->sizes().equals({steps, batch}), "fastdp ", op, ": mask must have shape [", steps, ", ", batch,
                "], got ", m->sizes());
    return m->contiguous();
  }
};

at::ScalarType recurrence_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "fastdp ", op,
              ": tensors must be float32 or float64, got ", t.scalar_type());
  return t.scalar_type();
}

at::Tensor defined_or_empty(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

std::vector<at::Tensor> lstm_forward(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& c0,
                                     const at::Tensor& w_hh, const c10::optional<at::Tensor>& w_hr,
                                     const c10::optional<at::Tensor>& mask, bool reverse) {
  const RecurrenceCheck check{"lstm_forward", recurrence_dtype(gx, "lstm_forward")};
  TORCH_CHECK(gx.dim() == 3 && gx.size(2) % 4 == 0 && gx.size(2) > 0,
              "fastdp lstm_forward: gx must be [T, B, 4 * hidden], got ", gx.sizes());
  const int64_t t = gx.size(0), b = gx.size(1), hidden = gx.size(2) / 4;
  const int64_t out = w_hr.has_value() && w_hr->defined() ? w_hr->size(0) : hidden;
  const at::Tensor x = check.sequence(gx, "gx", {t, b, 4 * hidden});
  check.tensor(h0, "h0", {b, out});
  check.tensor(c0, "c0", {b, hidden});
  check.tensor(w_hh, "w_hh", {4 * hidden, out});
  check.optional(w_hr, "w_hr", {out, hidden});
  return lstm_forward_cpu(x, h0, c0, w_hh, defined_or_empty(w_hr), check.mask(mask, t, b), reverse);
}

std::vector<at::Tensor> lstm_backward(const c10::optional<at::Tensor>& d_out, const at::Tensor& d_h,
                                      const at::Tensor& d_c, const at::Tensor& acts, const at::Tensor& cs,
                                      const at::Tensor& tanh_c, const c10::optional<at::Tensor>& ms,
                                      const at::Tensor& w_hh, const c10::optional<at::Tensor>& w_hr,
                                      const c10::optional<at::Tensor>& mask, bool reverse) {
  const RecurrenceCheck check{"lstm_backward", recurrence_dtype(acts, "lstm_backward")};
  TORCH_CHECK(acts.dim() == 3 && acts.size(2) % 4 == 0 && acts.size(2) > 0,
              "fastdp lstm_backward: acts must be [T, B, 4 * hidden], got ", acts.sizes());
  const int64_t t = acts.size(0), b = acts.size(1), hidden = acts.size(2) / 4;
  const int64_t out = w_hr.has_value() && w_hr->defined() ? w_hr->size(0) : hidden;
  check.tensor(acts, "acts", {t, b, 4 * hidden});
  TORCH_CHECK(acts.is_contiguous() && cs.is_contiguous() && tanh_c.is_contiguous(),
              "fastdp lstm_backward: acts, cs and tanh_c must be contiguous (as lstm_forward returns them)");
  check.tensor(cs, "cs", {t + 1, b, hidden});
  check.tensor(tanh_c, "tanh_c", {t, b, hidden});
  check.optional(ms, "ms", {t, b, hidden});
  check.tensor(d_h, "d_h", {b, out});
  check.tensor(d_c, "d_c", {b, hidden});
  check.tensor(w_hh, "w_hh", {4 * hidden, out});
  check.optional(w_hr, "w_hr", {out, hidden});
  at::Tensor d_seq;
  if (d_out.has_value() && d_out->defined()) d_seq = check.sequence(*d_out, "d_out", {t, b, out});
  return lstm_backward_cpu(d_seq, d_h, d_c, acts, cs, tanh_c, defined_or_empty(ms), w_hh, defined_or_empty(w_hr),
                           check.mask(mask, t, b), reverse);
}

std::vector<at::Tensor> gru_forward(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh,
                                    const c10::optional<at::Tensor>& b_hh, const c10::optional<at::Tensor>& mask,
                                    bool reverse) {
  const RecurrenceCheck check{"gru_forward", recurrence_dtype(gx, "gru_forward")};
  TORCH_CHECK(gx.dim() == 3 && gx.size(2) % 3 == 0 && gx.size(2) > 0,
              "fastdp gru_forward: gx must be [T, B, 3 * hidden], got ", gx.sizes());
  const int64_t t = gx.size(0), b = gx.size(1), hidden = gx.size(2) / 3;
  const at::Tensor x = check.sequence(gx, "gx", {t, b, 3 * hidden});
  check.tensor(h0, "h0", {b, hidden});
  check.tensor(w_hh, "w_hh", {3 * hidden, hidden});
  check.optional(b_hh, "b_hh", {3 * hidden});
  const at::Tensor bias = b_hh.has_value() && b_hh->defined() ? b_hh->contiguous() : at::Tensor();
  return gru_forward_cpu(x, h0, w_hh, bias, check.mask(mask, t, b), reverse);
}

std::vector<at::Tensor> gru_backward(const c10::optional<at::Tensor>& d_out, const at::Tensor& d_h,
                                     const at::Tensor& rz, const at::Tensor& ns, const at::Tensor& gh_n,
                                     const at::Tensor& states, const at::Tensor& w_hh,
                                     const c10::optional<at::Tensor>& mask, bool reverse) {
  const RecurrenceCheck check{"gru_backward", recurrence_dtype(ns, "gru_backward")};
  TORCH_CHECK(ns.dim() == 3 && ns.size(2) > 0, "fastdp gru_backward: ns must be [T, B, hidden], got ", ns.sizes());
  const int64_t t = ns.size(0), b = ns.size(1), hidden = ns.size(2);
  check.tensor(ns, "ns", {t, b, hidden});
  check.tensor(rz, "rz", {t, b, 2 * hidden});
  check.tensor(gh_n, "gh_n", {t, b, hidden});
  check.tensor(states, "states", {t + 1, b, hidden});
  TORCH_CHECK(rz.is_contiguous() && ns.is_contiguous() && gh_n.is_contiguous() && states.is_contiguous(),
              "fastdp gru_backward: rz, ns, gh_n and states must be contiguous (as gru_forward returns them)");
  check.tensor(d_h, "d_h", {b, hidden});
  check.tensor(w_hh, "w_hh", {3 * hidden, hidden});
  at::Tensor d_seq;
  if (d_out.has_value() && d_out->defined()) d_seq = check.sequence(*d_out, "d_out", {t, b, hidden});
  return gru_backward_cpu(d_seq, d_h, rz, ns, gh_n, states, w_hh, check.mask(mask, t, b), reverse);
}

std::vector<at::Tensor> rnn_forward(const at::Tensor& gx, const at::Tensor& h0, const at::Tensor& w_hh, bool relu,
                                    const c10::optional<at::Tensor>& mask, bool reverse) {
  const RecurrenceCheck check{"rnn_forward", recurrence_dtype(gx, "rnn_forward")};
  TORCH_CHECK(gx.dim() == 3 && gx.size(2) > 0, "fastdp rnn_forward: gx must be [T, B, hidden], got ", gx.sizes());
  const int64_t t = gx.size(0), b = gx.size(1), hidden = gx.size(2);
  const at::Tensor x = check.sequence(gx, "gx", {t, b, hidden});
  check.tensor(h0, "h0", {b, hidden});
  check.tensor(w_hh, "w_hh", {hidden, hidden});
  return rnn_forward_cpu(x, h0, w_hh, relu, check.mask(mask, t, b), reverse);
}

std::vector<at::Tensor> rnn_backward(const c10::optional<at::Tensor>& d_out, const at::Tensor& d_h,
                                     const at::Tensor& states, const at::Tensor& w_hh, bool relu,
                                     const c10::optional<at::Tensor>& mask, bool reverse) {
  const RecurrenceCheck check{"rnn_backward", recurrence_dtype(states, "rnn_backward")};
  TORCH_CHECK(states.dim() == 3 && states.size(0) > 0 && states.size(2) > 0,
              "fastdp rnn_backward: states must be [T + 1, B, hidden], got ", states.sizes());
  const int64_t t = states.size(0) - 1, b = states.size(1), hidden = states.size(2);
  TORCH_CHECK(states.is_contiguous(), "fastdp rnn_backward: states must be contiguous (as rnn_forward returns them)");
  check.tensor(d_h, "d_h", {b, hidden});
  check.tensor(w_hh, "w_hh", {hidden, hidden});
  at::Tensor d_seq;
  if (d_out.has_value() && d_out->defined()) d_seq = check.sequence(*d_out, "d_out", {t, b, hidden});
  return rnn_backward_cpu(d_seq, d_h, states, w_hh, relu, check.mask(mask, t, b), reverse);
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
  m.def("release_", &fastdp::release_, "Fused noise, division and optimizer update (the release kinds)");
  m.def("noise_", &fastdp::noise_, "Fused per-tensor Gaussian noise / noisy SGD step",
        py::arg("grads"), py::arg("params"), py::arg("stds"), py::arg("stream_starts"),
        py::arg("seed"), py::arg("offset"), py::arg("num_draws"), py::arg("step"));
  m.def("ghost_norm_sq", &fastdp::ghost_norm_sq, "Per-example ghost norms ||a_b^T g_b||_F^2 of a Linear layer",
        py::arg("a"), py::arg("g"));
  m.def("certified_ghost_norm_sq", &fastdp::certified_ghost_norm_sq,
        "Float64 Gram products and masses (dot, mass) of the certified ghost norms on CPU", py::arg("a"),
        py::arg("g"));
  m.def("certified_gram", &fastdp::certified_gram, "Float64 Grams [B, T, T] of rows [B, T, K] on CPU, any strides",
        py::arg("x"));
  m.def("frobenius_distance_sq", &fastdp::frobenius_distance_sq,
        "(sum of squares, max abs), float64 [2], of fl64(a - b) on CPU: the carried certificates' distance",
        py::arg("a"), py::arg("b"));
  m.def("clip_factors", &fastdp::clip_factors, "Per-example norms and DP-SGD clip factors from [L, B] squared norms",
        py::arg("sq_norms"), py::arg("clip_norm"));
  m.def("clip_rows", &fastdp::clip_rows, "Per-example row clipping of [B, C, P] to l2 (or l15) norm <= bound",
        py::arg("x"), py::arg("bound"), py::arg("l15"));
  m.def("clip_rows_backward", &fastdp::clip_rows_backward, "Gradient of clip_rows w.r.t. x for an upstream grad",
        py::arg("grad"), py::arg("x"), py::arg("bound"), py::arg("l15"));
#ifdef FASTDP_WITH_CUDA
  m.def("power_iteration_cuda", &fastdp::power_iteration_cuda,
        "Batched power iteration on CUDA matrices in one launch: (sigma_hat, u list, v list)",
        py::arg("weights"), py::arg("vectors"), py::arg("iters"));
  m.def("bjorck_cuda", &fastdp::bjorck_cuda,
        "Batched Bjorck orthonormalisation of a list of CUDA matrices (fp32 math, 2 launches per step)",
        py::arg("weights"), py::arg("iters"), py::arg("beta"));
#endif
  m.def("has_cuda", &fastdp::has_cuda, "Whether this build has the CUDA kernels");
  m.def("lstm_forward", &fastdp::lstm_forward,
        "One LSTM layer and direction on CPU, time loop in C++: (states, cs, acts, tanh_c, ms)", py::arg("gx"),
        py::arg("h0"), py::arg("c0"), py::arg("w_hh"), py::arg("w_hr"), py::arg("mask"), py::arg("reverse"));
  m.def("lstm_backward", &fastdp::lstm_backward, "Backward through time of lstm_forward: (grad, d_h0, d_c0)",
        py::arg("d_out"), py::arg("d_h"), py::arg("d_c"), py::arg("acts"), py::arg("cs"), py::arg("tanh_c"),
        py::arg("ms"), py::arg("w_hh"), py::arg("w_hr"), py::arg("mask"), py::arg("reverse"));
  m.def("gru_forward", &fastdp::gru_forward, "One GRU layer and direction on CPU: (states, rz, ns, gh_n)",
        py::arg("gx"), py::arg("h0"), py::arg("w_hh"), py::arg("b_hh"), py::arg("mask"), py::arg("reverse"));
  m.def("gru_backward", &fastdp::gru_backward, "Backward through time of gru_forward: (grad [gx | gh], d_h0)",
        py::arg("d_out"), py::arg("d_h"), py::arg("rz"), py::arg("ns"), py::arg("gh_n"), py::arg("states"),
        py::arg("w_hh"), py::arg("mask"), py::arg("reverse"));
  m.def("rnn_forward", &fastdp::rnn_forward, "One tanh/relu RNN layer and direction on CPU: (states,)",
        py::arg("gx"), py::arg("h0"), py::arg("w_hh"), py::arg("relu"), py::arg("mask"), py::arg("reverse"));
  m.def("rnn_backward", &fastdp::rnn_backward, "Backward through time of rnn_forward: (grad, d_h0)",
        py::arg("d_out"), py::arg("d_h"), py::arg("states"), py::arg("w_hh"), py::arg("relu"), py::arg("mask"),
        py::arg("reverse"));
  m.def("recurrence_isa", &fastdp::recurrence_float_isa,
        "Which float gate kernels the recurrences run here: avx512, avx2 or baseline");
  m.def("set_recurrence_isa", &fastdp::set_recurrence_float_isa,
        "Run the recurrences' float gate kernels of this ISA (avx512, avx2, baseline; '' for the CPU's best); "
        "False if the CPU cannot", py::arg("name"));
  m.def("recurrence_gemm", &fastdp::recurrence_gemm,
        "Which GEMM the recurrences' float32 steps run: onednn (torch's mkldnn linear) or aten (at::mm)");
  m.def("set_recurrence_gemm", &fastdp::set_recurrence_gemm,
        "Run the recurrences' float32 step GEMMs with onednn or aten ('' for the default); False if unavailable",
        py::arg("name"));
}
