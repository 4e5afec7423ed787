"""fastdp norms ops: ghost norms and clip factors against the float64 reference, on every backend."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastdp
from fastdp._backend import available
from fastdp.ops import clip_factors, ghost_norm_sq
from fastdp.ops import norms as norms_op
from fastdp.ref import norms as ref
from tests.conftest import TOL

LOW_PRECISION = (torch.float16, torch.bfloat16)
real_ghost = ref.ghost_norm_sq
# The device_backend fixture only selects a backend: safe to share across hypothesis examples.
HYPOTHESIS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _inputs(batch, seq, dim_a, dim_g, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, seq, dim_a, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(batch, seq, dim_g, generator=gen).to(device=device, dtype=dtype)
    return a, g


def _reference(a, g):
    """float64 ghost norms of the inputs as given (low-precision values upcast exactly)."""
    return ref.ghost_norm_sq(a.double().cpu(), g.double().cpu())


def _assert_ghost_close(out, a, g, msg):
    expected = _reference(a, g)
    assert out.dtype == (torch.float64 if a.dtype == torch.float64 else torch.float32), msg
    assert out.shape == (a.shape[0],), msg
    if a.dtype in LOW_PRECISION:
        # STYLE rule: at most twice torch's own error in that dtype (bmm Gram matrices in
        # the dtype, as eager ghost clipping computes them), plus a small atol.
        gram_a = torch.bmm(a, a.transpose(1, 2)).double()
        gram_g = torch.bmm(g, g.transpose(1, 2)).double()
        torch_err = ((gram_a * gram_g).sum(dim=(1, 2)).cpu() - expected).abs()
        err = (out.double().cpu() - expected).abs()
        atol = 1e-5 * float(expected.abs().max()) if expected.numel() else 0.0
        bad = err > 2 * torch_err + atol
        assert not bad.any(), f"{msg}: errors {err[bad].tolist()} vs torch's {torch_err[bad].tolist()}"
    else:
        torch.testing.assert_close(out.cpu().double(), expected, **TOL[a.dtype], msg=lambda m: f"{msg}: {m}")


# ----------------------------------------------------------------------------------- ghost norms


@pytest.fixture(autouse=True)
def _kernels_at_every_length(monkeypatch):
    """The op sends short CPU sequences to batched GEMMs (faster there); these tests check the kernels, at every
    length, so that routing is switched off here and tested on its own below."""
    monkeypatch.setattr(norms_op, "CPU_GEMM_MAX_SEQ", 0)


def test_short_cpu_sequences_use_batched_gemms(restore_backend, monkeypatch):
    monkeypatch.setattr(norms_op, "CPU_GEMM_MAX_SEQ", 64)
    calls = []
    monkeypatch.setattr(ref, "ghost_norm_sq", lambda a, g: calls.append(a.shape[1]) or real_ghost(a, g))
    fastdp.set_backend("auto")
    for seq in (1, 64, 65):
        a, g = _inputs(3, seq, 5, 7, torch.float32)
        torch.testing.assert_close(ghost_norm_sq(a, g).double(), real_ghost(a.double(), g.double()), **TOL[a.dtype])
    assert calls == [1, 64] + ([65] if fastdp.backend_info()["ops"]["norms"]["cpu"]["backend"] == "torch" else [])


def test_reference_chunks_examples_exactly(monkeypatch):
    a, g = _inputs(7, 9, 4, 3, torch.float64)
    whole = ref.ghost_norm_sq(a, g)
    monkeypatch.setattr(ref, "GRAM_CHUNK_ELEMENTS", 2 * 81)  # two examples per pass
    torch.testing.assert_close(ref.ghost_norm_sq(a, g), whole, rtol=0, atol=0)
    torch.testing.assert_close(whole, ref.per_example_grad_norm_sq(a, g), rtol=1e-12, atol=0)


@pytest.fixture
def certified_kernel(restore_backend):
    """``fastdp._C``'s certified ghost-norm kernel with the extension selected (a failure when FASTDP_REQUIRE_EXT=1
    and it was not built, else a skip)."""
    import os

    from fastdp import _ext

    kernel = getattr(_ext._C, "certified_ghost_norm_sq", None)
    if kernel is None:
        if os.environ.get("FASTDP_REQUIRE_EXT") == "1":
            pytest.fail("fastdp._C must be built with certified_ghost_norm_sq for this run")
        pytest.skip("fastdp._C without the certified ghost-norm kernel")
    fastdp.set_backend("cuda")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch, seq, dim_a, dim_g",
    [(5, 32, 19, 40), (3, 1, 5, 7), (4, 17, 3, 130), (2, 70, 9, 8), (3, 129, 6, 5), (2, 200, 33, 70), (0, 4, 2, 2)],
)
def test_certified_kernel_is_the_reference_to_rounding(certified_kernel, dtype, batch, seq, dim_a, dim_g):
    """The tiled float64 kernel (upper triangles, several t-blocks from T 65 on, T not a multiple of its 16-row
    panels) gives the reference's Gram products and masses to float64 rounding, in every input dtype, and the
    certified bound of ops.certified_ghost_norm_sq that the reference's bound does."""
    a, g = _inputs(batch, seq, dim_a, dim_g, dtype, seed=seq)
    dot, mass = certified_kernel(a, g)
    assert dot.dtype == mass.dtype == torch.float64 and dot.shape == mass.shape == (batch,)
    exact = ref.per_example_grad_norm_sq(a.double(), g.double())
    torch.testing.assert_close(dot, exact, rtol=1e-12, atol=0)
    rows = (torch.linalg.vector_norm(a.double(), dim=2) * torch.linalg.vector_norm(g.double(), dim=2)).sum(1)
    torch.testing.assert_close(mass, rows, rtol=1e-13, atol=0)
    bound, rounded_mass = norms_op.certified_ghost_norm_sq(a, g)
    expected = ref.certified_ghost_norm_sq(a, g)
    torch.testing.assert_close(bound, expected[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(rounded_mass, expected[1], rtol=1e-13, atol=0)
    assert (bound >= exact).all() and (rounded_mass >= rows).all()


def test_certified_kernel_reads_strided_rows_and_ignores_the_thread_count(certified_kernel):
    """Inputs whose rows are slices of wider tensors (a GRU's gate gradients) are read in place, with the bits of
    their contiguous copies; 1 and 2 threads give the same bits (a fixed order per example)."""
    gen = torch.Generator().manual_seed(3)
    wide_a, wide_g = torch.randn(6, 40, 30, generator=gen), torch.randn(6, 40, 90, generator=gen)
    a, g = wide_a[:, :, 5:25], wide_g[:, :, :64]
    contiguous = certified_kernel(a.contiguous(), g.contiguous())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = certified_kernel(a, g)
        torch.set_num_threads(2)
        two = certified_kernel(a, g)
    finally:
        torch.set_num_threads(threads)
    for x, y, z in zip(contiguous, one, two, strict=True):
        assert torch.equal(x, y) and torch.equal(y, z)


def test_certified_kernel_bounds_cancelling_positions(certified_kernel):
    """Positions that cancel at large magnitude: the products are tiny against the terms, the bound still holds
    (the exact norm in float64 of fp32 values is exact to 1e-16 here: d = p = 2)."""
    a = torch.tensor([[[3e5, 1.0], [-3e5, 0.0], [1.0, 2.0]]])
    g = torch.tensor([[[1.0, -2.0], [1.0, -2.0], [0.5, 0.25]]])
    bound, mass = norms_op.certified_ghost_norm_sq(a, g)
    exact = ref.per_example_grad_norm_sq(a.double(), g.double())
    assert (bound >= exact).all() and bound.item() <= exact.item() + 1e-9 * mass.item() ** 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("batch, seq, k", [(3, 37, 5), (2, 130, 9), (4, 1, 3), (2, 16, 0), (0, 5, 3)])
def test_certified_gram_kernel_is_the_float64_gram_in_any_layout(certified_kernel, dtype, batch, seq, k):
    """``fastdp._C.certified_gram``: the float64 Gram of rows read in any layout (rows contiguous, or columns
    contiguous as a convolution's pixels), symmetric, to float64 rounding."""
    from fastdp import _ext

    gen = torch.Generator().manual_seed(seq)
    for x in (torch.randn(batch, seq, k, generator=gen), torch.randn(batch, k, seq, generator=gen).transpose(1, 2)):
        x = x.to(dtype)
        out = _ext._C.certified_gram(x)
        expected = torch.bmm(x.double(), x.double().transpose(1, 2))
        assert out.dtype == torch.float64 and out.shape == (batch, seq, seq) and torch.equal(out, out.transpose(1, 2))
        torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape, kernel, stride, padding, dilation",
    [((3, 4, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1)), ((2, 5, 9, 7), (2, 3), (1, 1), (0, 2), (2, 1)),
     ((2, 3, 20, 20), (3, 3), (1, 1), (1, 1), (1, 1))],
)  # fmt: skip
def test_certified_conv_norms_with_the_gram_kernel_are_the_references(
    certified_kernel, dtype, shape, kernel, stride, padding, dilation
):
    """The pixel-Gram certified bound with ``fastdp._C``'s Grams (20 x 20 pixels: 400-row Grams, several tiles)
    equals the reference's (float64 copies and batched GEMMs) to rounding, channels-last input included."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen).to(dtype)
    h_out = (shape[2] + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    w_out = (shape[3] + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    g = torch.randn(shape[0], 6, h_out, w_out, generator=gen).to(dtype)
    expected = ref.certified_conv_ghost_norm_sq(x, g, kernel, stride, padding, dilation)
    for xi in (x, x.contiguous(memory_format=torch.channels_last)):
        bound, mass = norms_op.certified_conv_ghost_norm_sq(xi, g, kernel, stride, padding, dilation)
        torch.testing.assert_close(bound, expected[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(mass, expected[1], rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_certified_token_match_norms_with_the_gram_kernel_are_the_references(certified_kernel, dtype):
    """The embedding's certified bound with ``fastdp._C``'s Gram equals the reference's to rounding (repeated tokens,
    cancelling rows, T of several tiles)."""
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 5, (4, 70), generator=gen)
    g = torch.randn(4, 70, 9, generator=gen)
    idx[0] = 3
    g[0, 1::2] = -g[0, 0::2]  # one token, rows cancelling in pairs
    g = g.to(dtype)
    expected = ref.certified_token_match_norm_sq(idx, g)
    bound, mass = norms_op.certified_token_match_norm_sq(idx, g)
    torch.testing.assert_close(bound, expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mass, expected[1], rtol=1e-13, atol=0)
    exact = torch.zeros(4, 5, 9, dtype=torch.float64).index_put_(
        (torch.arange(4).unsqueeze(1).expand(4, 70), idx), g.double(), accumulate=True
    )
    assert (bound >= exact.pow(2).sum((1, 2))).all()


def test_certified_norms_run_the_reference_without_the_extension(restore_backend, monkeypatch):
    """FASTDP_BACKEND=torch (and examples too large for a thread's panels) run the reference."""
    calls = []
    monkeypatch.setattr(ref, "certified_ghost_norm_sq", lambda a, g: calls.append(1) or (a, g))
    a, g = _inputs(2, 8, 3, 4, torch.float32)
    fastdp.set_backend("torch")
    norms_op.certified_ghost_norm_sq(a, g)
    assert calls == [1]
    if getattr(fastdp._ext._C, "certified_ghost_norm_sq", None) is not None:
        fastdp.set_backend("cuda")
        monkeypatch.setattr(norms_op, "CERTIFIED_PACK_BYTES", 16 * 7 * 8 - 1)
        norms_op.certified_ghost_norm_sq(a, g)
        assert calls == [1, 1]
        monkeypatch.setattr(norms_op, "CERTIFIED_PACK_BYTES", 16 * 7 * 8)
        norms_op.certified_ghost_norm_sq(a, g)
        assert calls == [1, 1]


def test_certified_grams_copy_a_few_examples_at_a_time_exactly(monkeypatch):
    """The certified Grams convert their inputs to float64 a few examples per pass (COPY_CHUNK_ELEMENTS): same bits,
    whatever the pass size; a copy of the whole batch was the largest tensor of an attention classifier's step."""
    a, g = _inputs(7, 9, 4, 3, torch.float32)
    x, gx = torch.randn(7, 3, 6, 6), torch.randn(7, 5, 6, 6)
    whole = ref.certified_ghost_norm_sq(a, g), ref.certified_conv_ghost_norm_sq(x, gx, (3, 3), (1, 1), (1, 1), (1, 1))
    assert ref._certified_pass(81, 9 * 7) >= 7  # the whole batch in one pass
    monkeypatch.setattr(ref, "COPY_CHUNK_ELEMENTS", 2 * 9 * 7)  # two examples per pass
    assert ref._certified_pass(81, 9 * 7) == 2 and ref._certified_pass(1, 10**9) == 1
    chunked = ref.certified_ghost_norm_sq(a, g), ref.certified_conv_ghost_norm_sq(x, gx, (3, 3), (1, 1), (1, 1), (1, 1))
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@HYPOTHESIS
@given(
    batch=st.integers(0, 3),
    seq=st.integers(0, 100),
    dim_a=st.integers(1, 40),
    dim_g=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_ghost_norm_sq_matches_reference(device_backend, batch, seq, dim_a, dim_g, dtype):
    device, backend = device_backend
    a, g = _inputs(batch, seq, dim_a, dim_g, dtype, device, seed=batch * 1000 + seq)
    out = ghost_norm_sq(a, g)
    _assert_ghost_close(out, a, g, f"{backend} ghost_norm_sq B={batch} T={seq} d={dim_a} p={dim_g} {dtype}")


@pytest.mark.parametrize(
    "batch, seq, dim_a, dim_g",
    [(2, 65, 3, 17), (1, 129, 33, 1), (2, 200, 16, 20), (1, 1, 129, 123), (3, 64, 1, 1), (1, 130, 70, 66)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ghost_norm_sq_several_tiles(device_backend, batch, seq, dim_a, dim_g, dtype):
    """Several t-blocks (odd and even counts: the paired work items), odd widths, d or p = 1."""
    device, backend = device_backend
    a, g = _inputs(batch, seq, dim_a, dim_g, dtype, device, seed=seq)
    _assert_ghost_close(ghost_norm_sq(a, g), a, g, f"{backend} B={batch} T={seq} d={dim_a} p={dim_g} {dtype}")


@pytest.mark.parametrize(
    "batch, seq, dim_a, dim_g", [(2, 5, 70, 33), (1, 64, 100, 100), (3, 100, 64, 20), (1, 130, 50, 90)]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ghost_norm_sq_split_over_column_slices(batch, seq, dim_a, dim_g, dtype, monkeypatch, restore_backend):
    """Few examples of short sequences: the Triton path splits each Gram's columns over programs (lowered
    thresholds: ragged slices, several tile pairs); the result is the reference's, and the same run to run."""
    triton_norms = pytest.importorskip("fastdp.kernels.norms")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok, why = available("triton", device)
    if not ok:
        pytest.skip(why)
    fastdp.set_backend("triton")
    monkeypatch.setattr(triton_norms, "SPLIT_MIN_COLS", 16)
    monkeypatch.setattr(triton_norms, "SPLIT_TARGET", 64)
    launches = []
    kernel = triton_norms._gram_slice_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_norms, "_gram_slice_kernel", Counting())
    a, g = _inputs(batch, seq, dim_a, dim_g, dtype, device, seed=seq)
    out = ghost_norm_sq(a, g)
    assert len(launches) == 1 and launches[0][0] > batch, launches  # more programs than examples
    _assert_ghost_close(out, a, g, f"split B={batch} T={seq} d={dim_a} p={dim_g} {dtype}")
    assert torch.equal(ghost_norm_sq(a, g), out)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    "batch, seq, dim_a, dim_g", [(2, 50, 700, 600), (3, 130, 1024, 520), (1, 200, 512, 8), (300, 10, 600, 600)]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ghost_norm_sq_cuda_split_over_column_slices(batch, seq, dim_a, dim_g, dtype, restore_backend):
    """The CUDA kernels' split of the column sums (few examples of short sequences: the first three shapes; the
    last one has enough examples not to split): the reference's result, the same bits run to run."""
    ok, why = available("cuda", "cuda")
    if not ok:
        pytest.skip(why)
    fastdp.set_backend("cuda")
    a, g = _inputs(batch, seq, dim_a, dim_g, dtype, "cuda", seed=seq)
    out = ghost_norm_sq(a, g)
    _assert_ghost_close(out, a, g, f"cuda split B={batch} T={seq} d={dim_a} p={dim_g} {dtype}")
    assert torch.equal(ghost_norm_sq(a, g), out)


def test_ghost_norm_sq_equals_explicit_per_example_gradient_norms(device_backend):
    """||a_i^T g_i||_F^2 with the per-example gradients formed by einsum('btd,btp->bdp')."""
    device, backend = device_backend
    a, g = _inputs(4, 37, 19, 11, torch.float64, seed=3)
    grads = torch.einsum("btd,btp->bdp", a, g)
    expected = grads.pow(2).sum(dim=(1, 2))
    out = ghost_norm_sq(a.float().to(device), g.float().to(device))
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32], msg=f"{backend} vs einsum")
    torch.testing.assert_close(ref.per_example_grad_norm_sq(a, g), expected, **TOL[torch.float64])


def test_ghost_norm_sq_equals_vmap_grad_norms_of_a_linear_layer(device_backend):
    """A Linear layer on sequences: the weight's per-example gradient norms from torch.func.vmap(grad)."""
    device, backend = device_backend
    torch.manual_seed(0)
    layer = torch.nn.Linear(9, 5, bias=False).double()
    x = torch.randn(6, 13, 9, dtype=torch.float64)
    target = torch.randn(6, 13, 5, dtype=torch.float64)

    def loss_one(weight, xi, ti):
        return ((torch.func.functional_call(layer, {"weight": weight}, (xi,)) - ti) ** 2).sum() / 3

    per_example = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(layer.weight, x, target)
    expected = per_example.pow(2).sum(dim=(1, 2))
    out_act = layer(x)
    (g,) = torch.autograd.grad(((out_act - target) ** 2).sum() / 3, out_act)  # sum of per-example losses
    out = ghost_norm_sq(x.float().to(device), g.float().to(device))
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32], msg=f"{backend} vs vmap(grad)")


def test_ghost_norm_sq_non_contiguous_inputs(device_backend):
    device, backend = device_backend
    wide_a, wide_g = _inputs(3, 70, 40, 30, torch.float32, device, seed=5)
    a = wide_a[:, 1:69, ::2]  # strided last dim
    g = wide_g.transpose(0, 1).contiguous().transpose(0, 1)[:, 1:69, 3:20]  # permuted storage
    assert not a.is_contiguous() and not g.is_contiguous()
    _assert_ghost_close(ghost_norm_sq(a, g), a, g, f"{backend} non-contiguous")
    expected = ghost_norm_sq(a.contiguous(), g.contiguous())
    torch.testing.assert_close(ghost_norm_sq(a, g), expected, rtol=0, atol=0)


def test_ghost_norm_sq_empty_shapes(device_backend):
    device, _ = device_backend
    for batch, seq in ((0, 5), (3, 0), (0, 0)):
        a, g = _inputs(batch, seq, 4, 6, torch.float32, device)
        out = ghost_norm_sq(a, g)
        assert out.shape == (batch,) and out.dtype == torch.float32 and out.device.type == device
        assert torch.count_nonzero(out) == 0


def test_ghost_norm_sq_is_deterministic(device_backend):
    device, _ = device_backend
    a, g = _inputs(3, 150, 24, 40, torch.float32, device, seed=9)
    assert torch.equal(ghost_norm_sq(a, g), ghost_norm_sq(a, g))


def test_ghost_norm_sq_on_tensors_requiring_grad(device_backend):
    device, _ = device_backend
    a, g = _inputs(2, 5, 3, 4, torch.float32, device)
    a.requires_grad_(True)
    out = ghost_norm_sq(a * 1.0, g)  # a graph node, not only a leaf
    assert not out.requires_grad
    _assert_ghost_close(out, a.detach(), g, "requires_grad input")


# ---------------------------------------------------------------------------------- clip factors


def _assert_clip_close(got, sq, clip_norm, msg):
    norms, factors = got
    exp_norms, exp_factors = ref.clip_factors(sq.double().cpu(), clip_norm)
    assert norms.dtype == sq.dtype and factors.dtype == sq.dtype, msg
    for name, actual, expected in (("norms", norms, exp_norms), ("factors", factors, exp_factors)):
        torch.testing.assert_close(actual.cpu().double(), expected, **TOL[sq.dtype], equal_nan=True,
                                   msg=lambda m, name=name: f"{msg} {name}: {m}")  # fmt: skip


@HYPOTHESIS
@given(
    layers=st.integers(0, 5),
    batch=st.integers(0, 2100),
    clip_norm=st.floats(1e-3, 1e3),
    scale=st.sampled_from([1e-6, 1.0, 1e4]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_clip_factors_match_reference(device_backend, layers, batch, clip_norm, scale, dtype):
    device, backend = device_backend
    gen = torch.Generator().manual_seed(layers * 10_000 + batch)
    sq = (torch.rand(layers, batch, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    _assert_clip_close(clip_factors(sq, clip_norm), sq, clip_norm, f"{backend} L={layers} B={batch} {dtype}")


def test_clip_factors_values(device_backend):
    """Norms add over layers; small norms are not scaled up; large ones scale to the bound."""
    device, _ = device_backend
    sq = torch.tensor([[9.0, 0.0, 1e-4, 100.0], [16.0, 0.0, 0.0, 300.0]], device=device)
    norms, factors = clip_factors(sq, 2.0)
    torch.testing.assert_close(norms.cpu(), torch.tensor([5.0, 0.0, 1e-2, 20.0]))
    torch.testing.assert_close(factors.cpu(), torch.tensor([2.0 / (5.0 + 1e-6), 1.0, 1.0, 2.0 / (20.0 + 1e-6)]))
    assert float((norms * factors).max()) <= 2.0


def test_clip_factors_propagate_nan(device_backend):
    """A NaN squared norm must never become factor 1 (that would pass the gradient unclipped)."""
    device, backend = device_backend
    sq = torch.rand(3, 2049, device=device)
    sq[1, 7] = float("nan")
    sq[2, 2048] = float("nan")
    sq[0, 100] = float("inf")
    norms, factors = clip_factors(sq, 1.0)
    for i in (7, 2048):
        assert math.isnan(norms[i]) and math.isnan(factors[i]), f"{backend}: column {i} lost its NaN"
    assert math.isinf(norms[100]) and factors[100] == 0.0
    finite = torch.ones(2049, dtype=torch.bool)
    finite[[7, 100, 2048]] = False
    assert torch.isfinite(factors.cpu()[finite]).all()


def test_clip_factors_empty(device_backend):
    device, _ = device_backend
    norms, factors = clip_factors(torch.zeros(3, 0, device=device), 1.0)
    assert norms.shape == factors.shape == (0,)
    norms, factors = clip_factors(torch.zeros(0, 4, device=device), 1.0)  # no layers: norm 0, factor 1
    assert torch.equal(norms.cpu(), torch.zeros(4)) and torch.equal(factors.cpu(), torch.ones(4))


def test_clip_factors_non_contiguous_and_requires_grad(device_backend):
    device, backend = device_backend
    wide = torch.rand(6, 300, device=device)
    sq = wide[::2, 1::3].t().contiguous().t()  # [3, 100] column-major view
    sq.requires_grad_(True)
    norms, factors = clip_factors(sq, 0.7)
    assert not norms.requires_grad and not factors.requires_grad
    _assert_clip_close((norms, factors), sq.detach(), 0.7, f"{backend} non-contiguous")


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ghost_norm_sq(torch.zeros(2, 3), torch.zeros(2, 3, 4)), ValueError, r"expected \[B, T, features\]"),
        (lambda: ghost_norm_sq(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4)), ValueError, "must match"),
        (lambda: ghost_norm_sq(torch.zeros(2, 3, 4), torch.zeros(3, 3, 4)), ValueError, "must match"),
        (lambda: ghost_norm_sq(torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3, 4)), TypeError, "dtype"),
        (lambda: ghost_norm_sq(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4).half()), TypeError, "one dtype"),
        (lambda: ghost_norm_sq(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, device="meta")), ValueError, "one device"),
        (lambda: ghost_norm_sq([[[1.0]]], torch.zeros(1, 1, 1)), TypeError, "expected a torch.Tensor"),
        (lambda: clip_factors(torch.zeros(4), 1.0), ValueError, r"expected \[L, B\]"),
        (lambda: clip_factors(torch.zeros(2, 4, dtype=torch.float16), 1.0), TypeError, "float32 or float64"),
        (lambda: clip_factors(torch.zeros(2, 4), 0.0), ValueError, "finite and > 0"),
        (lambda: clip_factors(torch.zeros(2, 4), -1.0), ValueError, "finite and > 0"),
        (lambda: clip_factors(torch.zeros(2, 4), float("nan")), ValueError, "finite and > 0"),
        (lambda: clip_factors(torch.zeros(2, 4), float("inf")), ValueError, "finite and > 0"),
        (lambda: clip_factors(torch.zeros(2, 4), True), TypeError, "must be a float"),
        (lambda: clip_factors(torch.zeros(2, 4), "1.0"), TypeError, "must be a float"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_raw_ops_validate_too():
    """The torch.ops entry points (and their fake kernels) check like the Python wrappers."""
    with pytest.raises(ValueError, match="must match"):
        torch.ops.fastdp.ghost_norm_sq(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="finite and > 0"):
        torch.ops.fastdp.clip_factors(torch.zeros(2, 4), -2.0)
    with pytest.raises(ValueError, match="must match"):
        torch.ops.fastdp.ghost_norm_sq(torch.zeros(2, 3, 4, device="meta"), torch.zeros(2, 4, 4, device="meta"))
    out = torch.ops.fastdp.ghost_norm_sq(torch.zeros(5, 3, 4, device="meta"), torch.zeros(5, 3, 2, device="meta"))
    assert out.shape == (5,) and out.dtype == torch.float32


# --------------------------------------------------------------------------- opcheck, compile


def test_opcheck(device_backend):
    device, _ = device_backend
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        a, g = _inputs(3, 7, 5, 4, dtype, device)
        torch.library.opcheck(torch.ops.fastdp.ghost_norm_sq.default, (a, g))
    for dtype in (torch.float32, torch.float64):
        sq = torch.rand(4, 9, device=device, dtype=dtype)
        torch.library.opcheck(torch.ops.fastdp.clip_factors.default, (sq, 1.5))


def test_compiles_fullgraph(restore_backend):
    """Both ops trace into one torch.compile graph (no graph break) and give the eager result."""
    fastdp.set_backend("cuda")

    def clip(a1, g1, a2, g2):
        sq = torch.stack([ghost_norm_sq(a1, g1), ghost_norm_sq(a2, g2)])
        return clip_factors(sq, 1.0)

    args = (*_inputs(4, 6, 3, 5, torch.float32, seed=1), *_inputs(4, 6, 7, 2, torch.float32, seed=2))
    eager = clip(*args)
    compiled = torch.compile(clip, fullgraph=True, backend="aot_eager")(*args)
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


def test_every_triton_tile_the_launcher_chooses_is_compile_checked():
    """The sm_90 compile check (tests/hopper_compile.py) covers each (BLOCK_T, BLOCK_K) that ghost_norm_sq launches."""
    triton_norms = pytest.importorskip("fastdp.kernels.norms")
    specs = triton_norms.hopper_compile_specs()
    launched = {(triton_norms._block_t(t), triton_norms._block_k(w)) for t in range(1, 300) for w in range(1, 300)}
    for kernel in (triton_norms._ghost_norm_sq_kernel, triton_norms._gram_slice_kernel):
        checked = {(c["BLOCK_T"], c["BLOCK_K"]) for fn, _, c, *_ in specs if fn is kernel}
        assert launched <= checked, (kernel, sorted(launched - checked))
    products = {c["BLOCK_T"] for fn, _, c, *_ in specs if fn is triton_norms._gram_slices_product_kernel}
    assert {t for t, _ in launched} <= products
