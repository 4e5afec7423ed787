"""fastdp spectral ops: power iteration, certified spectral-norm bounds, conv operator norms."""

import pytest
import torch
import torch.nn.functional as F

import fastdp
import fastdp._ext
from fastdp._backend import available
from fastdp.ops import certified_spectral_norm, certified_spectral_norms, conv_operator_norm, power_iteration
from fastdp.ref import spectral as ref


def _random(m, n, dtype=torch.float32, seed=0):
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _with_singular_values(m, n, values, seed=0, dtype=torch.float64):
    """A matrix [m, n] with the given leading singular values (the rest: linspace below them)."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    q1, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    s = torch.linspace(0.1, 0.5, k, dtype=torch.float64).flip(0)
    s[: len(values)] = torch.tensor(values, dtype=torch.float64)
    return ((q1[:, :k] * s) @ q2[:k, :]).to(dtype)


def _top(w):
    return torch.linalg.svdvals(w.double())[0]


# ------------------------------------------------------------------------------ power iteration

SHAPES = [(33, 20), (5, 70), (1, 9), (9, 1), (1, 1), (64, 64)]


def test_power_iteration_matches_reference_and_converges(device_backend):
    device, _ = device_backend
    weights = [_random(m, n, seed=i).to(device) for i, (m, n) in enumerate(SHAPES)]
    sigma, us, vs = power_iteration(weights, iters=8)
    expected = ref.power_iteration([w.double().cpu() for w in weights], None, 8)
    assert sigma.dtype == torch.float32 and sigma.shape == (len(SHAPES),)
    torch.testing.assert_close(sigma.cpu().double(), expected[0], rtol=2e-5, atol=1e-6)
    for i, (u, v) in enumerate(zip(us, vs, strict=True)):
        assert u.shape == (SHAPES[i][1],) and v.shape == (SHAPES[i][0],)
        torch.testing.assert_close(u.cpu().double(), expected[1][i], rtol=1e-4, atol=1e-4, msg=f"u[{i}]")
        torch.testing.assert_close(v.cpu().double(), expected[2][i], rtol=1e-4, atol=1e-4, msg=f"v[{i}]")
        # sigma_hat = v^T W u with the returned vectors
        w = weights[i].double().cpu()
        torch.testing.assert_close(
            v.cpu().double() @ w @ u.cpu().double(), sigma[i].double().cpu(), rtol=1e-4, atol=1e-5
        )
    # Warm start from the returned vectors (the kernel path too).
    sigma, _, _ = power_iteration(weights, us, iters=3)
    expected = ref.power_iteration([w.double().cpu() for w in weights], [u.double().cpu() for u in us], 3)
    torch.testing.assert_close(sigma.cpu().double(), expected[0], rtol=2e-5, atol=1e-6)


def test_power_iteration_converges_to_svdvals():
    weights = [_random(m, n, seed=i) for i, (m, n) in enumerate(SHAPES)]
    sigma, _, _ = power_iteration(weights, iters=500)
    true = torch.stack([_top(w) for w in weights])
    torch.testing.assert_close(sigma.double(), true, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_power_iteration_never_exceeds_sigma_max(dtype, restore_backend):
    for seed in range(5):
        weights = [_random(20 + seed, 13, dtype, seed), _with_singular_values(8, 30, [1.0, 1 - 1e-6], seed).to(dtype)]
        for iters in (1, 3, 10):
            sigma, _, _ = power_iteration(weights, iters=iters)
            assert sigma.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            for i, w in enumerate(weights):
                assert sigma[i].double() <= _top(w) * (1 + 1e-5), (seed, iters, i)


def test_power_iteration_triton_bf16_and_mixed_dtypes(device_backend):
    device, _ = device_backend
    weights = [_random(17, 40, torch.bfloat16, 1).to(device), _random(40, 17, torch.float16, 2).to(device)]
    sigma, us, vs = power_iteration(weights, iters=5)
    expected = ref.power_iteration([w.double().cpu() for w in weights], None, 5)
    torch.testing.assert_close(sigma.cpu().double(), expected[0], rtol=1e-5, atol=1e-5)


def _triton_or_skip():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok, why = available("triton", device)
    if not ok:
        pytest.skip(why)
    fastdp.set_backend("triton")
    from fastdp.kernels import spectral as kernels

    return device, kernels


# The split path over several regions in both directions, ragged edges, 1-row and 1-column matrices, a zero matrix,
# low precision: the threshold and the regions per matrix are lowered to keep the interpreter quick.
SPLIT = [
    ((70, 300), torch.float32),
    ((300, 40), torch.float32),
    ((1, 700), torch.float32),
    ((700, 1), torch.float32),
    ((33, 20), torch.float32),  # one-program path beside the split ones
    ((90, 260), torch.bfloat16),
    ((64, 64), torch.float16),
    ((40, 150), None),  # zero matrix
]


def test_power_iteration_split_path_matches_reference(monkeypatch, restore_backend):
    device, kernels = _triton_or_skip()
    monkeypatch.setattr(kernels, "SPLIT_MIN_NUMEL", 1000)
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 6)
    assert kernels._regions(70, 300) == (64, 128)  # 2 x 3 regions, ragged in both directions
    weights = [(_random(*shape, dtype or torch.float32, seed=i) if dtype else torch.zeros(shape)).to(device)
               for i, (shape, dtype) in enumerate(SPLIT)]  # fmt: skip
    vectors = [_random(1, w.shape[1], seed=20 + i)[0].to(device) for i, w in enumerate(weights)]
    for iters in (1, 2, 7):
        sigma, us, vs = power_iteration(weights, vectors, iters=iters)
        expected = ref.power_iteration([w.double().cpu() for w in weights], [u.double().cpu() for u in vectors], iters)
        for i, w in enumerate(weights):
            tol = dict(rtol=2e-5, atol=1e-6) if w.dtype == torch.float32 else dict(rtol=1e-5, atol=1e-5)
            msg = f"{SPLIT[i]}, {iters} steps"
            torch.testing.assert_close(sigma[i].cpu().double(), expected[0][i], **tol, msg=msg)
            torch.testing.assert_close(us[i].cpu().double(), expected[1][i], rtol=1e-4, atol=1e-4, msg=msg)
            torch.testing.assert_close(vs[i].cpu().double(), expected[2][i], rtol=1e-4, atol=1e-4, msg=msg)
            alone = power_iteration([w], [vectors[i]], iters=iters)  # batched = alone, bit for bit
            assert torch.equal(alone[0][0], sigma[i]) and torch.equal(alone[1][0], us[i]), msg
            assert torch.equal(alone[2][0], vs[i]), msg
        assert sigma[-1] == 0 and torch.all(us[-1] == 0) and torch.all(vs[-1] == 0)
    again = power_iteration(weights, vectors, iters=7)  # deterministic: a fixed summation order
    assert all(torch.equal(a, b) for a, b in zip(again[1] + [again[0]], us + [sigma], strict=True))


def test_power_iteration_split_path_launches(monkeypatch, restore_backend):
    """A list of 2 small and 2 split matrices, 3 steps: 1 one-program launch, 2 per step, 1 finish."""
    device, kernels = _triton_or_skip()
    monkeypatch.setattr(kernels, "SPLIT_MIN_NUMEL", 1000)
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 3)
    counts: dict[str, int] = {}

    class Counting:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            counts[self.name] = counts.get(self.name, 0) + 1
            return self.kernel[grid]

    for name in ("_power_iteration_kernel", "_split_step_kernel", "_split_finish_kernel"):
        monkeypatch.setattr(kernels, name, Counting(getattr(kernels, name), name))
    weights = [_random(*shape, seed=i).to(device) for i, shape in enumerate([(50, 30), (20, 20), (30, 50), (9, 9)])]
    sigma, _, _ = power_iteration(weights, iters=3)
    assert counts == {"_power_iteration_kernel": 1, "_split_step_kernel": 6, "_split_finish_kernel": 1}, counts
    expected = ref.power_iteration([w.double().cpu() for w in weights], None, 3)[0]
    torch.testing.assert_close(sigma.cpu().double(), expected, rtol=2e-5, atol=1e-6)  # the list's order


def test_split_regions_depend_on_the_shape_only():
    from fastdp.kernels import spectral as kernels

    for m, n in [(4096, 4096), (1024, 1024), (50000, 16), (16, 50000), (1, 1), (129, 129), (768, 3072)]:
        rm, rn = kernels._regions(m, n)
        assert rm % kernels.BLOCK_M == 0 and rn % kernels.BLOCK_N == 0
        assert -(-m // rm) * -(-n // rn) <= kernels.TARGET_PROGRAMS
        assert rm == kernels.BLOCK_M or -(-m // (rm // 2)) * -(-n // rn) > kernels.TARGET_PROGRAMS or rn > rm
    assert kernels._regions(4096, 4096) == (256, 128)
    assert kernels._regions(1024, 1024) == (32, 128)


def test_warm_start_converges_faster_than_cold():
    w = _with_singular_values(60, 40, [1.0, 0.9], seed=3)
    true = _top(w)
    cold, _, _ = power_iteration([w], iters=3)
    _, us, _ = power_iteration([w], iters=100)
    w2 = w + 1e-3 * _random(60, 40, torch.float64, 9)  # a small optimiser step
    warm, _, _ = power_iteration([w2], us, iters=3)
    cold2, _, _ = power_iteration([w2], iters=3)
    true2 = _top(w2)
    assert true2 - warm[0] < 0.1 * (true2 - cold2[0])
    assert true - cold[0] > 0


def test_power_iteration_float64_and_zero_matrix(restore_backend):
    sigma, us, vs = power_iteration([torch.zeros(4, 3, dtype=torch.float64), _random(6, 5, torch.float64)], iters=4)
    assert sigma.dtype == torch.float64 and sigma[0] == 0 and torch.all(us[0] == 0)
    assert torch.isfinite(sigma).all()


def test_power_iteration_is_a_custom_op():
    weights = [_random(6, 4), _random(3, 8)]
    vectors = [torch.ones(4), torch.ones(8)]
    torch.library.opcheck(torch.ops.fastdp.power_iteration.default, (weights, vectors, 3))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: power_iteration([]), "empty list"),
        (lambda: power_iteration([torch.randn(3)]), "expected a 2-D matrix"),
        (lambda: power_iteration([torch.randn(2, 3, 4)]), "expected a 2-D matrix"),
        (lambda: power_iteration([torch.randn(3, 3)], iters=0), "must be >= 1"),
        (lambda: power_iteration([torch.full((3, 3), float("nan"))]), "NaN or Inf"),
        (lambda: power_iteration([torch.randn(3, 3)], [torch.ones(4)]), "columns"),
        (lambda: power_iteration([torch.randn(3, 3)], [torch.ones(3), torch.ones(3)]), "one per matrix"),
        (lambda: power_iteration([torch.zeros(0, 3)]), "non-empty"),
        (lambda: certified_spectral_norm(torch.randn(3)), "expected a 2-D matrix"),
        (lambda: certified_spectral_norm(torch.randn(3, 3), iters=0), "must be >= 1"),
        (lambda: certified_spectral_norm(torch.tensor([[float("inf")]])), "NaN or Inf"),
        (lambda: certified_spectral_norms([]), "empty list"),
        (lambda: conv_operator_norm(torch.randn(3, 3), (3, 4, 4)), "conv2d kernel"),
        (lambda: conv_operator_norm(torch.randn(2, 3, 3, 3), (2, 4, 4)), "channels"),
        (lambda: conv_operator_norm(torch.randn(2, 3, 3, 3), (3, 2, 2)), "empty output"),
        (lambda: conv_operator_norm(torch.randn(2, 3, 3, 3), (3, 4, 4), iters=0), "must be >= 1"),
    ],
)
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------ certified bound

CERT_SHAPES = [(30, 30), (50, 7), (7, 50), (1, 40), (40, 1), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", CERT_SHAPES)
def test_certified_bound_is_above_and_close(shape, dtype):
    for seed in range(3):
        w = _random(*shape, dtype, seed) * 10.0**seed
        bound = certified_spectral_norm(w)
        assert bound.dtype == dtype and bound.dim() == 0
        # against a float64 SVD: a float32 one is itself rounded (up, at times) and is no reference for a bound
        assert bound.double() >= _top(w), (shape, seed)
        assert bound.double() <= _top(w) * 1.03, (shape, seed, float(bound), float(_top(w)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_certified_bound_adversarial_spectra(dtype):
    cases = {
        "rank-1": (torch.arange(1, 9, dtype=torch.float64)[:, None] * torch.linspace(-1, 2, 13, dtype=torch.float64)),
        "near-degenerate top pair": _with_singular_values(24, 16, [1.0, 1 - 1e-6], seed=4),
        "flat spectrum": _with_singular_values(16, 16, [1.0] * 16, seed=5),
        "tiny": _random(5, 4, torch.float64, 6) * 1e-30,
        "huge": _random(5, 4, torch.float64, 7) * 1e30,
    }
    for name, w in cases.items():
        w = w.to(dtype)
        bound = certified_spectral_norm(w)
        assert bound.double() >= _top(w), name
    assert certified_spectral_norm(torch.zeros(3, 5)) == 0


def test_certified_bound_tightens_with_iterations():
    w = _random(40, 30, torch.float64, 11)
    bounds = [float(certified_spectral_norm(w, iters=t)) for t in (1, 2, 4, 8)]
    assert bounds == sorted(bounds, reverse=True)
    assert bounds[-1] >= float(_top(w)) and bounds[-1] <= float(_top(w)) * (1 + 1e-6)


def test_certified_spectral_norms_list():
    weights = [_random(5, 3), _random(2, 9, torch.float64, 1), _random(4, 4, torch.bfloat16, 2)]
    bounds = certified_spectral_norms(weights)
    assert bounds.shape == (3,) and bounds.dtype == torch.float64
    for i, w in enumerate(weights):
        assert bounds[i] == certified_spectral_norm(w).double()


# ------------------------------------------------------------------------------ conv operator norm


def _dense_conv_svd(weight, input_shape, stride, padding, dilation=1, groups=1):
    """(largest singular value, its right singular vector) of the dense matrix of x -> conv2d(x)."""
    numel = input_shape[0] * input_shape[1] * input_shape[2]
    basis = torch.eye(numel, dtype=torch.float64).reshape(numel, *input_shape)
    columns = F.conv2d(basis, weight.double(), None, stride, padding, dilation, groups).reshape(numel, -1)
    _, s, vh = torch.linalg.svd(columns.T)
    return s[0], vh[0].reshape(input_shape)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_operator_norm_matches_dense_svd(stride, padding, dtype):
    gen = torch.Generator().manual_seed(stride * 10 + padding)
    weight = torch.randn(4, 3, 3, 3, generator=gen, dtype=torch.float64).to(dtype)
    shape = (3, 7, 6)
    exact, top = _dense_conv_svd(weight, shape, stride, padding)
    sigma, x = conv_operator_norm(weight, shape, stride=stride, padding=padding, iters=60)
    assert x.shape == shape and sigma.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert sigma.double() <= exact * (1 + 1e-5)
    torch.testing.assert_close(sigma.double(), exact, rtol=1e-2, atol=0)  # cold start: gap-limited
    # Started from the exact top singular vector, the map and its adjoint reproduce sigma_max.
    warm, x = conv_operator_norm(weight, shape, stride=stride, padding=padding, iters=2, vector=top.to(dtype))
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(warm.double(), exact, rtol=rtol, atol=0)
    assert abs(float((x.double() * top).sum())) > 1 - 1e-4


def test_conv_operator_norm_dilation_groups():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(4, 2, 2, 3, generator=gen, dtype=torch.float64)
    shape = (4, 6, 7)
    exact, top = _dense_conv_svd(weight, shape, (2, 1), (1, 0), (2, 1), 2)
    kwargs = dict(stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)
    sigma, _ = conv_operator_norm(weight, shape, iters=2, vector=top, **kwargs)
    torch.testing.assert_close(sigma, exact, rtol=1e-10, atol=0)
    cold, _ = conv_operator_norm(weight, shape, iters=30, **kwargs)
    assert cold <= exact * (1 + 1e-12)


# ------------------------------------------------------------------------------ CUDA kernel (csrc/cuda/spectral.cu)

needs_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and fastdp._ext.has_cuda_kernels()),
    reason="needs a CUDA device and fastdp._C built with its CUDA kernels",
)

# (129, 257) and the last three take the whole-GPU path (more than kPowerSplitMinNumel elements; several regions).
CUDA_SHAPES = [(1, 1), (1, 300), (300, 1), (33, 20), (5, 70), (129, 257), (1000, 3), (3, 1000), (64, 64),
               (700, 1500), (5000, 40), (40, 5000)]  # fmt: skip


@pytest.mark.cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_power_iteration_cuda_kernel_matches_reference(dtype, restore_backend):
    fastdp.set_backend("cuda")
    weights = [_random(m, n, dtype, seed=i).cuda() for i, (m, n) in enumerate(CUDA_SHAPES)]
    gen = torch.Generator().manual_seed(7)
    warm = [3.0 * torch.randn(n, generator=gen) for _, n in CUDA_SHAPES]  # any scale: normalised first
    for vectors in (None, warm):
        for iters in (1, 7):
            given = None if vectors is None else [u.cuda() for u in vectors]
            sigma, us, vs = power_iteration(weights, given, iters=iters)
            expected = ref.power_iteration(
                [w.double().cpu() for w in weights], None if vectors is None else [u.double() for u in vectors], iters
            )
            assert sigma.dtype == torch.float32 and sigma.is_cuda
            torch.testing.assert_close(sigma.cpu().double(), expected[0], rtol=2e-5, atol=1e-6)
            for i, (u, v) in enumerate(zip(us, vs, strict=True)):
                assert u.shape == (CUDA_SHAPES[i][1],) and v.shape == (CUDA_SHAPES[i][0],)
                assert u.dtype == torch.float32 and v.dtype == torch.float32
                msg = f"shape {CUDA_SHAPES[i]}, iters {iters}, warm {vectors is not None}"
                torch.testing.assert_close(u.cpu().double(), expected[1][i], rtol=1e-4, atol=1e-4, msg=msg)
                torch.testing.assert_close(v.cpu().double(), expected[2][i], rtol=1e-4, atol=1e-4, msg=msg)
            if given is not None:  # the start vectors are read, never written
                for u, u0 in zip(given, vectors, strict=True):
                    assert torch.equal(u.cpu(), u0)


@pytest.mark.cuda
@needs_cuda_kernels
def test_power_iteration_cuda_split_path_is_deterministic_and_batch_independent(restore_backend):
    """The whole-GPU path sums its partials in a fixed order: the same bits run to run and alone or in a list."""
    fastdp.set_backend("cuda")
    weights = [_random(m, n, seed=i).cuda() for i, (m, n) in enumerate([(700, 1500), (33, 20), (2000, 2000)])]
    weights.append(torch.zeros(300, 200, device="cuda"))
    first = power_iteration(weights, iters=4)
    for _ in range(3):
        again = power_iteration(weights, iters=4)
        assert torch.equal(again[0], first[0])
        assert all(torch.equal(a, b) for a, b in zip(again[1], first[1], strict=True))
    for i, w in enumerate(weights):
        alone = power_iteration([w], iters=4)
        assert torch.equal(alone[0][0], first[0][i]) and torch.equal(alone[2][0], first[2][i]), i
    assert first[0][3] == 0 and torch.all(first[1][3] == 0) and torch.all(first[2][3] == 0)


@pytest.mark.cuda
@needs_cuda_kernels
def test_power_iteration_cuda_kernel_mixed_dtypes_zero_matrix_and_binding(restore_backend):
    fastdp.set_backend("cuda")
    weights = [
        _random(17, 40, torch.bfloat16, 1).cuda(),
        torch.zeros(4, 3, device="cuda"),
        _random(40, 17, torch.float16, 2).cuda(),
        _random(6, 5, torch.float32, 3).cuda(),
    ]
    sigma, us, vs = power_iteration(weights, iters=5)
    expected = ref.power_iteration([w.double().cpu() for w in weights], None, 5)
    torch.testing.assert_close(sigma.cpu().double(), expected[0], rtol=2e-5, atol=1e-6)
    assert sigma[1] == 0 and torch.all(us[1] == 0) and torch.all(vs[1] == 0)
    # The binding directly: one launch, same results; outputs are fresh tensors.
    starts = [ref.default_start(w.shape[1], torch.float32, w.device) for w in weights]
    direct = fastdp._ext._C.power_iteration_cuda(weights, starts, 5)
    assert torch.equal(direct[0], sigma)
    for a, b in zip(direct[1] + direct[2], us + vs, strict=True):
        assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.fastdp.power_iteration.default, (weights, starts, 3))
    with pytest.raises(RuntimeError, match="float32"):
        fastdp._ext._C.power_iteration_cuda(weights, [s.double() for s in starts], 5)
    with pytest.raises(RuntimeError, match="contiguous"):
        fastdp._ext._C.power_iteration_cuda([weights[0].T], [starts[0][:17].clone()], 5)
