"""fastdp orthogonal ops: Björck orthonormalisation, the deel-lip projection, RKO and its lip factor."""

import copy
import math

import pytest
import torch
from torch import nn

import fastdp
import fastdp._ext
import fastdp.ops.orthogonal as orthogonal_ops
from fastdp._backend import available
from fastdp.nn import lipschitz
from fastdp.ops import bjorck_orthonormalize, conv_lip_factor, rko_orthonormalize, spectral_normalize_and_orthonormalize
from fastdp.ops.orthogonal import lipschitz_projection
from fastdp.ref import orthogonal as ref
from tests.conftest import TOL


def _conditioned(m, n, low=0.3, high=1.0, seed=0, dtype=torch.float32):
    """A matrix [m, n] with singular values spread over [low, high]."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    q1, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    s = torch.linspace(low, high, k, dtype=torch.float64)
    return ((q1[:, :k] * s) @ q2[:k, :]).to(dtype)


def _max_deviation_from_one(w):
    return float((torch.linalg.svdvals(w.double()) - 1).abs().max())


SHAPES = [(24, 24), (40, 17), (17, 40), (1, 9), (9, 1), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bjorck_orthonormalizes(device_backend, dtype):
    device, _ = device_backend
    weights = [_conditioned(m, n, seed=i, dtype=dtype).to(device) for i, (m, n) in enumerate(SHAPES)]
    out = bjorck_orthonormalize(weights)
    expected = ref.bjorck_orthonormalize([w.double().cpu() for w in weights])
    for i, (o, w) in enumerate(zip(out, weights, strict=True)):
        assert o.shape == w.shape and o.dtype == w.dtype and o.is_contiguous(), i
        assert _max_deviation_from_one(o.cpu()) < 1e-3, (i, SHAPES[i])
        tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(o.cpu().double(), expected[i], **tol, msg=lambda m, i=i: f"matrix {i}: {m}")
        # The polar factor keeps the singular vectors: o = U V^T of w.
        u, _, vh = torch.linalg.svd(w.cpu().double(), full_matrices=False)
        torch.testing.assert_close(o.cpu().double(), u @ vh, rtol=0, atol=2e-3)


def test_bjorck_tiled_triton_path(device_backend, monkeypatch):
    """The multi-program path (two launches per step) on a matrix above the fused threshold."""
    device, backend = device_backend
    if backend == "triton":
        from fastdp.kernels import orthogonal as kernels

        monkeypatch.setattr(kernels, "FUSED_MAX_NUMEL", 0)
    weights = [_conditioned(45, 33, seed=3).to(device), _conditioned(20, 70, seed=4).to(device)]
    out = bjorck_orthonormalize(weights, iters=12, beta=0.5)
    expected = ref.bjorck_orthonormalize([w.double().cpu() for w in weights], iters=12, beta=0.5)
    for o, e in zip(out, expected, strict=True):
        torch.testing.assert_close(o.cpu().double(), e, rtol=1e-5, atol=2e-5)
        assert _max_deviation_from_one(o.cpu()) < 1e-3


# A list that mixes the fused path and the tiled path (the Triton threshold is lowered to 2048 elements to keep the
# interpreter quick), tall, wide and square shapes, and every dtype (float64 runs the reference beside the batched
# kernel call).
MIXED = [
    ((24, 24), torch.float32),
    ((70, 33), torch.float32),  # tiled
    ((40, 17), torch.float16),
    ((17, 40), torch.bfloat16),
    ((30, 90), torch.float32),  # wide, tiled
    ((1, 9), torch.float32),
    ((33, 5), torch.float64),
    ((100, 45), torch.bfloat16),  # tiled
]


def test_bjorck_batched_list_equals_per_matrix_calls(device_backend, monkeypatch):
    """One call over a mixed list gives, bit for bit, what a call per matrix gives, and the reference's result."""
    device, backend = device_backend
    if backend == "triton":
        from fastdp.kernels import orthogonal as kernels

        monkeypatch.setattr(kernels, "FUSED_MAX_NUMEL", 2048)
    weights = [_conditioned(*shape, seed=i, dtype=dtype).to(device) for i, (shape, dtype) in enumerate(MIXED)]
    iters = 15
    batched = bjorck_orthonormalize(weights, iters=iters)
    for i, (o, w) in enumerate(zip(batched, weights, strict=True)):
        assert o.shape == w.shape and o.dtype == w.dtype and o.device == w.device and o.is_contiguous(), i
        alone = bjorck_orthonormalize([w], iters=iters)[0]
        assert torch.equal(o, alone), f"matrix {i} {MIXED[i]}: batched result differs from its own call"
        acc = ref.accumulation_dtype(w.dtype)
        expected = ref.bjorck_orthonormalize([w.cpu().to(acc)], iters=iters)[0]
        if w.dtype in (torch.float32, torch.float64):
            tol = dict(rtol=1e-10, atol=1e-10) if w.dtype == torch.float64 else TOL[torch.float32]
            torch.testing.assert_close(o.cpu().to(acc), expected, **tol, msg=lambda m, i=i: f"matrix {i}: {m}")
            assert _max_deviation_from_one(o.cpu()) < 1e-3, (i, MIXED[i])
        else:  # fp32 math, one rounding to the dtype
            torch.testing.assert_close(o.cpu().float(), expected.to(w.dtype).float(), **TOL[w.dtype],
                                       msg=lambda m, i=i: f"matrix {i}: {m}")  # fmt: skip
            assert _max_deviation_from_one(o.cpu()) < 2e-2, (i, MIXED[i])


class _CountingKernel:
    """Stands in for a Triton kernel object: counts ``kernel[grid](...)`` launches, then launches."""

    def __init__(self, kernel, counts: dict, name: str) -> None:
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.kernel[grid]


def test_bjorck_triton_launches_at_most_one_plus_two_per_step(monkeypatch, restore_backend):
    """6 matrices (3 fused, 3 tiled), 5 steps: 1 fused launch + 5 Gram + 5 update launches (per-matrix launches
    would be 3 + 3 * 2 * 5 = 33)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok, why = available("triton", device)
    if not ok:
        pytest.skip(why)
    fastdp.set_backend("triton")
    from fastdp.kernels import orthogonal as kernels

    monkeypatch.setattr(kernels, "FUSED_MAX_NUMEL", 700)  # small matrices keep the interpreter quick
    counts: dict[str, int] = {}
    for name in ("_bjorck_fused_kernel", "_gram_kernel", "_bjorck_update_kernel"):
        monkeypatch.setattr(kernels, name, _CountingKernel(getattr(kernels, name), counts, name))
    shapes = [(24, 24), (45, 33), (40, 17), (20, 70), (17, 40), (64, 30)]  # 576, 1485, 680, 1400, 680, 1920
    weights = [_conditioned(*shape, seed=i).to(device) for i, shape in enumerate(shapes)]
    iters = 5
    out = bjorck_orthonormalize(weights, iters=iters)
    assert counts == {"_bjorck_fused_kernel": 1, "_gram_kernel": iters, "_bjorck_update_kernel": iters}, counts
    assert sum(counts.values()) <= 1 + 2 * iters
    expected = ref.bjorck_orthonormalize([w.double().cpu() for w in weights], iters=iters)
    for i, (o, e) in enumerate(zip(out, expected, strict=True)):
        torch.testing.assert_close(o.cpu().double(), e, **TOL[torch.float32], msg=lambda m, i=i: f"matrix {i}: {m}")
    counts.clear()
    bjorck_orthonormalize(weights[1::2], iters=iters)  # tiled matrices only: no fused launch
    assert counts == {"_gram_kernel": iters, "_bjorck_update_kernel": iters}, counts


def test_bjorck_low_precision_and_beta(device_backend):
    device, _ = device_backend
    w = _conditioned(30, 20, seed=5, dtype=torch.bfloat16).to(device)
    out = bjorck_orthonormalize([w], iters=20, beta=0.4)[0]
    assert out.dtype == torch.bfloat16
    expected = ref.bjorck_orthonormalize([w.float().cpu()], iters=20, beta=0.4)[0]
    torch.testing.assert_close(out.cpu().float(), expected.bfloat16().float(), rtol=1.6e-2, atol=1.6e-2)
    assert _max_deviation_from_one(out.cpu()) < 2e-2


def test_bjorck_is_a_custom_op():
    torch.library.opcheck(
        torch.ops.fastdp.bjorck_orthonormalize.default, ([_conditioned(6, 4), _conditioned(3, 5)], 3, 0.5)
    )


def test_projection_makes_any_matrix_orthonormal():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(32, 20, generator=gen) * 7, torch.randn(10, 30, generator=gen) * 0.01]
    projected, us = spectral_normalize_and_orthonormalize(weights, power_iters=30, bjorck_iters=25)
    for p, w, u in zip(projected, weights, us, strict=True):
        assert p.shape == w.shape and u.shape == (w.shape[1],)
        assert _max_deviation_from_one(p) < 1e-3
    # Warm start with the returned vectors, deel-lip defaults; the top singular value is at most 1.
    projected, _ = spectral_normalize_and_orthonormalize(weights, us)
    for p in projected:
        assert torch.linalg.svdvals(p.double())[0] <= 1 + 1e-4


def _lipschitz_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        lipschitz.BoundedInput(2.0),
        lipschitz.LipschitzConv2d(2, 4, 3, input_hw=(8, 8), padding=1),
        lipschitz.GroupSort2(),
        lipschitz.LipschitzConv2d(4, 4, 3, input_hw=(8, 8), stride=2, padding=1),
        nn.Flatten(),
        lipschitz.LipschitzLinear(64, 24, max_norm=2.0),
        lipschitz.AddBias(24, 0.5),
        lipschitz.Residual(lipschitz.LipschitzLinear(24, 24), lipschitz.GroupSort2()),
        lipschitz.LipschitzLinear(24, 10, projection="clip", max_norm=1.5),
        lipschitz.LipschitzLinear(10, 3),
    )
    with torch.no_grad():  # as after an optimiser step: off the constraint set
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_project_model_is_one_bjorck_call_with_per_layer_results(device_backend, monkeypatch):
    """``project_(model)``: one Björck call over every conv matrix (the dense layers take their own certified Björck
    steps), same results as layer by layer."""
    device, _ = device_backend
    model = _lipschitz_model().to(device)
    by_layer = copy.deepcopy(model)
    calls = []
    bjorck = orthogonal_ops.bjorck_orthonormalize
    monkeypatch.setattr(
        orthogonal_ops, "bjorck_orthonormalize", lambda ws, *a, **k: calls.append(len(ws)) or bjorck(ws, *a, **k)
    )
    lipschitz.project_(model)
    assert calls == [2], f"expected one Björck call over the 2 conv matrices, got calls over {calls}"
    for module in by_layer.modules():
        if isinstance(module, lipschitz.LipschitzModule):
            module.project_()
    for (name, a), b in zip(model.state_dict().items(), by_layer.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: batched projection differs from the per-layer one"
    dense = [m for m in model.modules() if isinstance(m, lipschitz.LipschitzLinear) and m.projection == "orthogonal"]
    for m in dense:
        s = torch.linalg.svdvals(m.weight.detach().double().cpu())
        assert (s - m.max_norm).abs().max() < 1e-3 * m.max_norm


def test_project_with_a_shared_weight_projects_layer_by_layer():
    torch.manual_seed(1)
    first, second = lipschitz.LipschitzLinear(6, 6), lipschitz.LipschitzLinear(6, 6)
    second.weight = first.weight  # tied: the two projections compose
    model = nn.Sequential(first, second, lipschitz.LipschitzLinear(6, 3))
    with torch.no_grad():
        first.weight.mul_(3.0)
    by_layer = copy.deepcopy(model)
    lipschitz.project_(model)
    for module in by_layer:
        module.project_()
    for (name, a), b in zip(model.state_dict().items(), by_layer.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_lipschitz_projection_matches_the_single_ops():
    gen = torch.Generator().manual_seed(2)
    dense = [torch.randn(20, 12, generator=gen) * 3, torch.randn(5, 30, generator=gen, dtype=torch.float64)]
    kernels = [torch.randn(8, 3, 3, 3, generator=gen), torch.randn(4, 8, 1, 1, generator=gen)]
    hws, strides = [(16, 16), (8, 8)], [(1, 1), 2]
    ws, us, ks = lipschitz_projection(dense, None, kernels, hws, strides, power_iters=7, iters=12)
    for i, w in enumerate(dense):
        (alone,), (u,) = spectral_normalize_and_orthonormalize([w], power_iters=7, bjorck_iters=12)
        assert torch.equal(ws[i], alone) and torch.equal(us[i], u), i
    for k, hw, st, out in zip(kernels, hws, strides, ks, strict=True):
        assert torch.equal(out, rko_orthonormalize(k, hw, st, iters=12))
    assert lipschitz_projection([]) == ([], [], [])
    with pytest.raises(ValueError, match="one input size and one stride per kernel"):
        lipschitz_projection([], None, kernels, hws[:1], strides)
    with pytest.raises(ValueError, match="kernel"):
        lipschitz_projection([], None, [torch.randn(3, 3)], [(8, 8)], [1])


def test_conv_lip_factor_matches_deel_lip():
    # paper 00 section 1.9: coef * sqrt(kh kw) = 1.02128 for 3x3 on 32x32
    assert conv_lip_factor((3, 3), (32, 32), (1, 1)) * 3 == pytest.approx(1.0212765957, rel=1e-9)
    assert conv_lip_factor(3, 32) == conv_lip_factor((3, 3), (32, 32), (1, 1))
    assert conv_lip_factor((1, 1), (8, 8), (1, 1)) == 1.0
    a, b = 2.0, 1.0  # 5x3 kernel on 10x12
    expected = math.sqrt(10 * 12 / ((5 * 10 - a * (a + 1)) * (3 * 12 - b * (b + 1))))
    assert conv_lip_factor((5, 3), (10, 12), (1, 1)) == pytest.approx(expected, rel=1e-12)
    assert conv_lip_factor((3, 3), (32, 32), (2, 2)) == pytest.approx(0.5, rel=1e-12)  # 1/sqrt(2*2)
    assert conv_lip_factor((3, 5), (32, 32), (2, 3)) == pytest.approx(math.sqrt(1 / (2 * 2)), rel=1e-12)
    with pytest.raises(ValueError, match="positive"):
        conv_lip_factor((0, 3), (8, 8), (1, 1))


@pytest.mark.parametrize("shape", [(8, 3, 3, 3), (32, 2, 3, 3), (4, 4, 1, 1)])
@pytest.mark.parametrize("stride", [(1, 1), (2, 2)])
def test_rko_reshaped_kernel_is_scaled_orthonormal(shape, stride):
    gen = torch.Generator().manual_seed(sum(shape))
    kernel = torch.randn(*shape, generator=gen)
    out = rko_orthonormalize(kernel, (16, 12), stride, iters=25)
    assert out.shape == kernel.shape and out.dtype == kernel.dtype
    coef = conv_lip_factor(shape[2:], (16, 12), stride)
    matrix = out.reshape(shape[0], -1).double() / coef
    if matrix.shape[0] <= matrix.shape[1]:
        gram = matrix @ matrix.T  # orthonormal rows
    else:
        gram = matrix.T @ matrix  # orthonormal columns
    torch.testing.assert_close(gram, torch.eye(gram.shape[0], dtype=torch.float64), rtol=0, atol=2e-3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: bjorck_orthonormalize([]), "empty list"),
        (lambda: bjorck_orthonormalize([torch.randn(3)]), "expected a 2-D matrix"),
        (lambda: bjorck_orthonormalize([torch.randn(3, 3)], iters=0), "must be >= 1"),
        (lambda: bjorck_orthonormalize([torch.randn(3, 3)], beta=0.0), "beta"),
        (lambda: bjorck_orthonormalize([torch.tensor([[1.0, float("nan")]])]), "NaN or Inf"),
        (lambda: spectral_normalize_and_orthonormalize([]), "empty list"),
        (lambda: spectral_normalize_and_orthonormalize([torch.randn(3, 3)], bjorck_iters=0), "must be >= 1"),
        (lambda: spectral_normalize_and_orthonormalize([torch.randn(3, 3)], power_iters=0), "must be >= 1"),
        (lambda: rko_orthonormalize(torch.randn(3, 3), (8, 8)), "kernel"),
        (lambda: rko_orthonormalize(torch.randn(2, 2, 3, 3), (8, 8), iters=0), "must be >= 1"),
        (lambda: rko_orthonormalize(torch.full((2, 2, 3, 3), float("inf")), (8, 8)), "NaN or Inf"),
    ],
)
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------ CUDA kernel (csrc/cuda/orthogonal.cu)

needs_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and fastdp._ext.has_cuda_kernels()),
    reason="needs a CUDA device and fastdp._C built with its CUDA kernels",
)

CUDA_SHAPES = [(1, 1), (1, 9), (9, 1), (64, 64), (65, 63), (130, 70), (70, 130), (300, 17), (17, 300)]


@pytest.mark.cuda
@needs_cuda_kernels
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_bjorck_cuda_kernel_matches_reference(shape, restore_backend):
    fastdp.set_backend("cuda")
    w = _conditioned(*shape, seed=sum(shape)).cuda()
    for iters in (1, 2, 15):  # odd and even step counts: the result lies in either ping-pong buffer
        out = bjorck_orthonormalize([w], iters=iters)[0]
        assert out.shape == w.shape and out.dtype == w.dtype and out.is_cuda and out.is_contiguous()
        expected = ref.bjorck_orthonormalize([w.double().cpu()], iters=iters)[0]
        torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=2e-5, msg=f"{shape}, {iters} steps")
        assert torch.equal(fastdp._ext._C.bjorck_cuda([w], iters, 0.5)[0], out)
    assert _max_deviation_from_one(out.cpu()) < 1e-3


@pytest.mark.cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bjorck_cuda_kernel_low_precision_non_contiguous_and_list(dtype, restore_backend):
    fastdp.set_backend("cuda")
    wide = torch.zeros(40, 90, device="cuda", dtype=dtype)
    wide[:, 5:35] = _conditioned(40, 30, seed=1).to(dtype).cuda()
    sliced = wide[:, 5:35]  # a non-contiguous slice of a wider buffer
    weights = [sliced, _conditioned(20, 70, seed=2, dtype=dtype).cuda(), _conditioned(5, 3, seed=3).double().cuda()]
    out = bjorck_orthonormalize(weights, iters=20, beta=0.4)
    for o, w in zip(out, weights, strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype
        expected = ref.bjorck_orthonormalize([w.cpu().to(ref.accumulation_dtype(w.dtype))], iters=20, beta=0.4)[0]
        tol = dict(rtol=1e-10, atol=1e-10) if w.dtype == torch.float64 else dict(rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(o.cpu().to(expected.dtype), expected.to(w.dtype).to(expected.dtype), **tol)
    torch.library.opcheck(torch.ops.fastdp.bjorck_orthonormalize.default, ([w.contiguous() for w in weights], 3, 0.5))
    with pytest.raises(RuntimeError, match="contiguous"):
        fastdp._ext._C.bjorck_cuda([weights[1], sliced], 3, 0.5)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        fastdp._ext._C.bjorck_cuda([weights[2]], 3, 0.5)
    with pytest.raises(RuntimeError, match="1 to 65535 matrices"):
        fastdp._ext._C.bjorck_cuda([], 3, 0.5)


@pytest.mark.cuda
@needs_cuda_kernels
def test_bjorck_cuda_kernel_batched_over_all_shapes(restore_backend):
    """One binding call over matrices of every CUDA_SHAPES shape (2 iters launches) equals a call per matrix."""
    weights = [_conditioned(*shape, seed=sum(shape)).cuda() for shape in CUDA_SHAPES]
    for iters in (1, 2, 15):
        batched = fastdp._ext._C.bjorck_cuda(weights, iters, 0.5)
        for shape, w, o in zip(CUDA_SHAPES, weights, batched, strict=True):
            assert o.shape == w.shape and o.is_contiguous()
            assert torch.equal(o, fastdp._ext._C.bjorck_cuda([w], iters, 0.5)[0]), (shape, iters)
