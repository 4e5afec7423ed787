"""fastdp orthogonal ops: Björck orthonormalisation, the deel-lip projection, RKO and its lip factor."""

import math

import pytest
import torch

import fastdp
import fastdp._ext
from fastdp.ops import bjorck_orthonormalize, conv_lip_factor, rko_orthonormalize, spectral_normalize_and_orthonormalize
from fastdp.ref import orthogonal as ref


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
        assert torch.equal(fastdp._ext._C.bjorck_cuda(w, iters, 0.5), out)
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
        fastdp._ext._C.bjorck_cuda(sliced, 3, 0.5)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        fastdp._ext._C.bjorck_cuda(weights[2], 3, 0.5)
