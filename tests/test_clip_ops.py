"""fastdp clip ops: per-example row clipping (forward) and gradient clipping (backward) on every backend."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, vmap

import fastdp
from fastdp._backend import available
from fastdp.ops import clip_gradient, clip_rows
from fastdp.ref import clip as ref
from tests.conftest import TOL

LOW_PRECISION = (torch.float16, torch.bfloat16)
NORMS = ["l2", "l15"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Output rounding can raise a clipped row's norm by half an ulp of the dtype (relative); fp32 adds the rounding
# of the fp32-accumulated norm (the privacy slack the issue allows: relative 1e-6).
NORM_SLACK = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2.0**-11 + 1e-6, torch.bfloat16: 2.0**-8 + 1e-6}
# The device_backend fixture only selects a backend: safe to share across hypothesis examples.
HYPOTHESIS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _input(shape, dtype, device="cpu", seed=0, spread=(1e-2, 1e2)):
    """Rows with norms spread over ``spread`` (log-uniform): some inside the ball, some far out."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if shape[0] and math.prod(shape[1:]):
        rows = x.reshape(shape[0], -1)
        target = torch.exp(torch.empty(shape[0], dtype=torch.float64).uniform_(*map(math.log, spread), generator=gen))
        x = (rows * (target / rows.norm(dim=1).clamp(min=1e-30)).unsqueeze(1)).reshape(shape)
    return x.to(device=device, dtype=dtype)


def _norms64(x: torch.Tensor, norm: str) -> torch.Tensor:
    """float64 row norms of x as stored (low-precision values upcast exactly)."""
    return ref.row_norms(x.detach().double().cpu(), norm)


def _brute_l15(x: torch.Tensor) -> list[float]:
    """The l15 norm of every row by Python loops: sqrt(sum_c (sum_p |x_cp|)^2)."""
    out = []
    for row in x.double().cpu().reshape(x.shape[0], x.shape[1], -1).tolist():
        out.append(math.sqrt(sum(sum(abs(v) for v in channel) ** 2 for channel in row)))
    return out


def _assert_clip_ok(y, x, bound, norm, msg):
    """Shape, dtype, agreement with the reference, the norm bound (privacy), unchanged rows inside the ball."""
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device, msg
    if x.dtype in LOW_PRECISION:  # the reference's fp32 math from the same input, then one rounding
        expected = ref.clip_rows(x.cpu(), bound, norm).double()
    else:
        expected = ref.clip_rows(x.double().cpu(), bound, norm)
    torch.testing.assert_close(y.double().cpu(), expected, **TOL[x.dtype], msg=lambda m: f"{msg}: {m}")
    if x.shape[0] == 0:
        return
    out_norms = _norms64(y, norm)
    worst = float((out_norms / bound).max()) if out_norms.numel() else 0.0
    assert worst <= 1 + NORM_SLACK[x.dtype], f"{msg}: a clipped row has norm {worst} x the bound"
    inside = _norms64(x, norm) < bound * (1 - 1e-4)
    assert torch.equal(y.cpu()[inside], x.cpu()[inside]), f"{msg}: rows inside the ball changed"


SHAPES = st.one_of(
    st.tuples(st.integers(0, 4), st.integers(0, 300)).map(lambda s: ((s[0], s[1]), "l2")),  # [B, d]
    st.tuples(st.integers(0, 4), st.integers(1, 5), st.integers(1, 40)).map(lambda s: ((s[0], s[1], s[2]), "l2")),
    st.tuples(st.integers(0, 4), st.integers(1, 8), st.integers(1, 6), st.integers(1, 6), st.sampled_from(NORMS))
    .map(lambda s: ((s[0], s[1], s[2], s[3]), s[4])),  # conv tensors [B, C, H, W]
    st.tuples(st.integers(0, 3), st.integers(1, 70)).map(lambda s: ((s[0], s[1]), "l15")),  # [B, C]: P = 1
    st.integers(0, 5).map(lambda b: ((b,), "l2")),  # [B]: one entry per example
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- forward


@HYPOTHESIS
@given(shape_norm=SHAPES, dtype=st.sampled_from(DTYPES), bound=st.floats(0.05, 50.0), seed=st.integers(0, 99))
def test_clip_rows_matches_reference_and_bounds_every_row(device_backend, shape_norm, dtype, bound, seed):
    device, backend = device_backend
    shape, norm = shape_norm
    x = _input(shape, dtype, device, seed)
    y = clip_rows(x, bound, norm)
    _assert_clip_ok(y, x, bound, norm, f"{backend} clip_rows {shape} {norm} {dtype} C={bound}")


@pytest.mark.parametrize(
    "shape, norm",
    [((3, 20000), "l2"), ((1, 40000), "l2"), ((2, 7, 3000), "l15"), ((1, 5, 10000), "l15"), ((1, 3, 200, 100), "l15"),
     ((2, 64, 129), "l15"), ((1, 2, 40000), "l15"), ((5, 123, 129), "l2")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_rows_long_rows(device_backend, shape, norm, dtype):
    """Rows over a block / a chunk: the looping and row-splitting paths of the kernels, odd sizes."""
    device, backend = device_backend
    x = _input(shape, dtype, device, seed=shape[-1], spread=(0.5, 2.0))
    _assert_clip_ok(clip_rows(x, 1.0, norm), x, 1.0, norm, f"{backend} {shape} {norm} {dtype}")


def test_l15_norm_matches_a_python_loop(device_backend):
    device, backend = device_backend
    x = _input((4, 3, 5, 2), torch.float64, seed=1, spread=(0.1, 10.0))
    torch.testing.assert_close(ref.row_norms(x, "l15"), torch.tensor(_brute_l15(x), dtype=torch.float64))
    x32 = x.float().to(device)
    y = clip_rows(x32, 1.0, "l15").double().cpu()
    for b, n in enumerate(_brute_l15(x32)):
        scale = min(1.0, 1.0 / n)
        torch.testing.assert_close(y[b], x[b].float().double() * scale, **TOL[torch.float32],
                                   msg=lambda m, b=b: f"{backend} row {b}: {m}")  # fmt: skip
        assert _brute_l15(y[b : b + 1])[0] <= 1.0 + 1e-6


def test_nan_rows_stay_nan(device_backend):
    """A NaN row must never come out unclipped: its whole output row is NaN, and so is its gradient."""
    device, backend = device_backend
    for shape, norm, nan_at in (((5, 3000), "l2", (2, 17)), ((5, 4, 3, 3), "l15", (1, 3, 2, 0)),
                                ((3, 40000), "l2", (1, 39999)), ((4, 3, 9000), "l15", (3, 2, 8999))):  # fmt: skip
        x = _input(shape, torch.float32, device, seed=3)
        x[nan_at] = float("nan")
        xr = x.clone().requires_grad_(True)
        y = clip_rows(xr, 1.0, norm)
        (dx,) = torch.autograd.grad(y, xr, torch.ones_like(y))
        row = nan_at[0]
        assert torch.isnan(y[row]).all() and torch.isnan(dx[row]).all(), f"{backend} {shape}: NaN row lost its NaN"
        others = [b for b in range(shape[0]) if b != row]
        assert torch.isfinite(y[others]).all() and torch.isfinite(dx[others]).all(), f"{backend}: NaN leaked"
        g = torch.zeros_like(x)
        g[nan_at] = float("nan")
        clipped = torch.ops.fastdp.clip_rows(g, 1.0, norm)  # clip_gradient's backward on a NaN gradient
        assert torch.isnan(clipped[row]).all() and torch.count_nonzero(clipped[others]) == 0


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
def test_zero_rows_and_edge_values(device_backend):
    device, backend = device_backend
    x = torch.zeros(3, 4, 5, device=device)
    x[1] = 1e-30  # below TINY in norm: scale 1, unchanged
    x[2, 0, 0] = float("inf")  # infinite norm: scale 0 (inf * 0 = NaN at the inf, 0 elsewhere)
    for norm in ("l2", "l15"):
        y = clip_rows(x, 0.5, norm).cpu()
        assert torch.equal(y[:2], x[:2].cpu()), f"{backend} {norm}"
        assert torch.isnan(y[2, 0, 0]) and torch.count_nonzero(y[2].flatten()[1:]) == 0, f"{backend} {norm}"


def test_empty_and_single_shapes(device_backend):
    device, _ = device_backend
    for shape, norm in (((0, 5), "l2"), ((3, 0), "l2"), ((0, 3, 4), "l15"), ((2, 0, 4), "l15"), ((2, 3, 0), "l15"),
                        ((0,), "l2"), ((1, 1), "l15"), ((1,), "l2")):  # fmt: skip
        x = torch.full(shape, 2.0, device=device)
        y = clip_rows(x, 1.0, norm)
        assert y.shape == x.shape and y.device.type == device
        if x.numel():
            assert float(_norms64(y, norm).max()) == pytest.approx(1.0, rel=1e-6)
        xr = x.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(clip_rows(xr, 1.0, norm).sum(), xr, allow_unused=True)
        assert dx.shape == x.shape


def test_non_contiguous_inputs(device_backend):
    device, backend = device_backend
    wide = _input((6, 8, 10, 12), torch.float32, device, seed=5)
    for x, norm in ((wide[::2, 1:7, ::3], "l15"), (wide.transpose(1, 3), "l15"), (wide[:, 2, :, 1:], "l2")):
        assert not x.is_contiguous()
        y = clip_rows(x, 1.0, norm)
        _assert_clip_ok(y, x, 1.0, norm, f"{backend} non-contiguous {tuple(x.shape)} {norm}")
        torch.testing.assert_close(y, clip_rows(x.contiguous(), 1.0, norm), rtol=0, atol=0)


def test_is_deterministic(device_backend):
    device, _ = device_backend
    for shape, norm in (((3, 50000), "l2"), ((2, 9, 7000), "l15"), ((7, 3, 5, 5), "l15")):
        x = _input(shape, torch.float32, device, seed=7)
        assert torch.equal(clip_rows(x, 1.0, norm), clip_rows(x, 1.0, norm))


# --------------------------------------------------------------------------------------------- backward


def _reference_grad(x, g, bound, norm):
    """torch autograd of the float64 reference (differentiating through the norm)."""
    x64 = x.detach().double().cpu().requires_grad_(True)
    (dx,) = torch.autograd.grad(ref.clip_rows(x64, bound, norm), x64, g.double().cpu())
    return dx


def _assert_grad_close(dx, x, g, bound, norm, msg):
    assert dx.shape == x.shape and dx.dtype == x.dtype, msg
    if x.dtype in LOW_PRECISION:  # fp32 math from the same inputs, one rounding
        expected = ref.clip_rows_backward(g.cpu(), x.cpu(), bound, norm).double()
        tol = TOL[x.dtype]
    else:
        expected = _reference_grad(x, g, bound, norm)
        tol = TOL[x.dtype]
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(dx.double().cpu(), expected, rtol=tol["rtol"], atol=tol["atol"] * max(scale, 1.0),
                               msg=lambda m: f"{msg}: {m}")  # fmt: skip


@HYPOTHESIS
@given(shape_norm=SHAPES, dtype=st.sampled_from(DTYPES), bound=st.floats(0.05, 50.0), seed=st.integers(0, 99))
def test_clip_rows_backward_matches_torch_autograd_of_the_reference(device_backend, shape_norm, dtype, bound, seed):
    device, backend = device_backend
    shape, norm = shape_norm
    x = _input(shape, dtype, device, seed).requires_grad_(True)
    g = _input(shape, dtype, device, seed + 1, spread=(0.1, 10.0))
    (dx,) = torch.autograd.grad(clip_rows(x, bound, norm), x, g)
    _assert_grad_close(dx, x.detach(), g, bound, norm, f"{backend} backward {shape} {norm} {dtype} C={bound}")


@pytest.mark.parametrize(
    "shape, norm", [((3, 20000), "l2"), ((1, 40000), "l2"), ((2, 7, 3000), "l15"), ((1, 5, 10000), "l15"),
                    ((2, 64, 129), "l15"), ((1, 2, 40000), "l15")],
)  # fmt: skip
def test_clip_rows_backward_long_rows(device_backend, shape, norm):
    device, backend = device_backend
    x = _input(shape, torch.float32, device, seed=shape[-1], spread=(0.5, 2.0))
    g = _input(shape, torch.float32, device, seed=1, spread=(0.5, 2.0))
    dx = torch.ops.fastdp.clip_rows_backward(g, x, 1.0, norm)
    _assert_grad_close(dx, x, g, 1.0, norm, f"{backend} backward {shape} {norm}")


@pytest.mark.parametrize("norm, shape", [("l2", (5, 7)), ("l2", (4, 2, 3)), ("l15", (5, 3, 4)), ("l15", (4, 2, 3, 2))])
def test_gradcheck_float64(restore_backend, norm, shape):
    """The registered backward of the op (float64: the reference's explicit formula) vs finite differences."""
    fastdp.set_backend("torch")
    x = _input(shape, torch.float64, seed=11, spread=(0.2, 5.0))  # norms far from the kinks at 1 and 0
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.fastdp.clip_rows(t, 1.0, norm), (x,))
    assert torch.autograd.gradcheck(lambda t: clip_rows(t * 2.0, 0.7, norm), (x,))


def test_reference_backward_is_torch_autograd_of_the_reference():
    for shape, norm in (((6, 9), "l2"), ((6, 3, 4), "l15"), ((6, 3), "l15"), ((6,), "l2")):
        x = _input(shape, torch.float64, seed=2)
        x[0] = 0.0  # a zero row: gradient g (no NaN from the norm)
        g = _input(shape, torch.float64, seed=3)
        torch.testing.assert_close(ref.clip_rows_backward(g, x, 1.0, norm), _reference_grad(x, g, 1.0, norm),
                                   rtol=1e-12, atol=1e-14)  # fmt: skip


def test_clip_gradient_is_identity_forward_and_clips_the_backward(device_backend):
    device, backend = device_backend
    for shape, norm in (((4, 10), "l2"), ((4, 3, 5, 5), "l15"), ((2, 30000), "l2")):
        x = _input(shape, torch.float32, device, seed=4).requires_grad_(True)
        y = clip_gradient(x, 0.3, norm)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
        g = _input(shape, torch.float32, device, seed=5, spread=(0.01, 10.0))
        (dx,) = torch.autograd.grad(y, x, g)
        _assert_clip_ok(dx, g, 0.3, norm, f"{backend} clip_gradient backward {shape} {norm}")


# ------------------------------------------------------------------------------------------ torch.func


def test_vmap_folds_into_rows(device_backend):
    device, backend = device_backend
    x = _input((3, 4, 2, 5, 5), torch.float32, device, seed=6)
    for norm in ("l2", "l15"):
        expected = clip_rows(x.flatten(0, 1), 1.0, norm).unflatten(0, (3, 4))
        torch.testing.assert_close(vmap(lambda t, n=norm: clip_rows(t, 1.0, n))(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(vmap(lambda t, n=norm: clip_rows(t, 1.0, n), in_dims=1, out_dims=1)(x),
                                   clip_rows(x.transpose(0, 1).flatten(0, 1), 1.0, norm).unflatten(0, (4, 3))
                                   .transpose(0, 1), rtol=0, atol=0)  # fmt: skip
        g = _input(x.shape, torch.float32, device, seed=7)
        dx = vmap(lambda gi, xi, n=norm: torch.ops.fastdp.clip_rows_backward(gi, xi, 1.0, n), in_dims=(0, None))(
            g, x[0]
        )
        for i in range(3):
            torch.testing.assert_close(dx[i], torch.ops.fastdp.clip_rows_backward(g[i], x[0], 1.0, norm))
        same = vmap(lambda t, n=norm: torch.ops.fastdp.clip_gradient(t, 1.0, n), in_dims=2, out_dims=2)(x)
        assert torch.equal(same, x)


class _Net(torch.nn.Module):
    """Conv (input clip, l15 gradient clip) then Linear (input clip, l2 gradient clip), as backprop clipping."""

    def __init__(self, rows=clip_rows, grads=clip_gradient):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.lin = torch.nn.Linear(3 * 5 * 5, 4)
        self.rows, self.grads = rows, grads

    def forward(self, x):
        h = self.grads(self.conv(self.rows(x, 2.0, "l2")), 0.2, "l15")
        return self.grads(self.lin(self.rows(torch.relu(h).flatten(1), 1.5, "l2")), 0.5, "l2")


def _reference_clip_gradient(x, bound, norm):
    from fastdp.ops.clip import _ClipUpstreamReference

    return _ClipUpstreamReference.apply(x, bound, norm)


def test_per_example_gradients_under_vmap_grad(device_backend):
    """torch.func.vmap(grad) through the ops (fused kernels under the transforms) equals one example at a time
    (plain autograd through the ops) and the float64 reference."""
    device, backend = device_backend
    model = _Net().to(device)
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = _input((6, 2, 5, 5), torch.float32, device, seed=8, spread=(0.5, 8.0))
    y = torch.randint(0, 4, (6,), device=device)

    def loss(net, ps, xi, yi):
        logits = functional_call(net, ps, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, yi.unsqueeze(0), reduction="sum")

    per_example = vmap(grad(lambda ps, xi, yi: loss(model, ps, xi, yi)), in_dims=(None, 0, 0))(params, x, y)
    model64 = _Net(ref.clip_rows, _reference_clip_gradient).double()
    for i in range(6):
        ps = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        loop = torch.autograd.grad(loss(model, ps, x[i], y[i]), list(ps.values()))
        ps64 = {n: p.double().cpu().requires_grad_(True) for n, p in params.items()}
        exact = torch.autograd.grad(loss(model64, ps64, x[i].double().cpu(), y[i].cpu()), list(ps64.values()))
        for (name, got), want, truth in zip(per_example.items(), loop, exact, strict=True):
            torch.testing.assert_close(got[i], want, **TOL[torch.float32], msg=lambda m, n=name: f"{backend} {n}: {m}")
            torch.testing.assert_close(got[i].double().cpu(), truth, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{backend} {n} vs float64: {m}")  # fmt: skip


def test_higher_order_derivatives_use_the_reference():
    """Nested grad (second derivatives) runs the differentiable torch path: no silently dropped terms."""
    x = _input((1, 6), torch.float64, seed=9, spread=(3.0, 3.0)).squeeze(0)

    def f(t):
        return (clip_rows(t.unsqueeze(0), 1.0, "l2") ** 3).sum()

    def f_ref(t):
        return (ref.clip_rows(t.unsqueeze(0), 1.0, "l2") ** 3).sum()

    hess = torch.func.jacrev(grad(f))(x)
    torch.testing.assert_close(hess, torch.autograd.functional.hessian(f_ref, x))
    assert hess.abs().max() > 1e-3
    xr = x.clone().requires_grad_(True)
    (g1,) = torch.autograd.grad(f(xr), xr, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g1.sum(), xr)


# -------------------------------------------------------------------------------- kernel paths, backends


def test_triton_modes(restore_backend):
    """Every launch mode of the Triton kernels (one block, looping rows, split rows) on small tensors."""
    if not available("triton", "cpu")[0] and not torch.cuda.is_available():
        pytest.skip("Triton cannot run here")
    from fastdp.kernels import clip as kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [((5, 3, 7), True, {}), ((5, 1, 37), False, {}), ((5, 3, 700), True, dict(one_block_max=64)),
             ((5, 1, 3000), False, dict(one_block_max=64)),
             ((3, 13, 70), True, dict(one_block_max=64, chunk=150, split_rows=8)),
             ((3, 1, 3000), False, dict(one_block_max=64, chunk=1500, split_rows=8)),
             ((2, 5, 1500), True, dict(one_block_max=64, chunk=150, split_rows=8))]  # fmt: skip
    modes = set()
    for shape, l15, overrides in cases:
        modes.add(kernels.plan(shape, l15, torch.device(device), **overrides)["mode"])
        norm = "l15" if l15 else "l2"
        for dtype in (torch.float32, torch.bfloat16):
            x = _input(shape, dtype, device, seed=shape[-1], spread=(0.3, 3.0))
            g = _input(shape, dtype, device, seed=1)
            y = kernels.clip_rows(x, 1.0, l15, **overrides)
            _assert_clip_ok(y, x, 1.0, norm, f"triton {shape} {norm} {overrides} {dtype}")
            dx = kernels.clip_rows_backward(g, x, 1.0, l15, **overrides)
            _assert_grad_close(dx, x, g, 1.0, norm, f"triton backward {shape} {norm} {overrides} {dtype}")
    assert modes == {kernels.MODE_ONE_BLOCK, kernels.MODE_ROW, kernels.MODE_SPLIT}


def test_cpu_kernel_row_and_chunk_parallel_paths_agree(restore_backend):
    """csrc/cpu: with fewer rows than threads a row is split over threads; the bits must not change."""
    if not available("cuda", "cpu")[0]:
        pytest.skip("fastdp._C is not built")
    fastdp.set_backend("cuda")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for shape, norm in (((2, 50000), "l2"), ((2, 6, 9000), "l15")):
            x = _input(shape, torch.float32, seed=12, spread=(0.5, 2.0))
            g = _input(shape, torch.float32, seed=13)
            both = (torch.ops.fastdp.clip_rows(x, 1.0, norm), torch.ops.fastdp.clip_rows_backward(g, x, 1.0, norm))
            for b in range(2):  # one row: fewer rows than threads, chunks in parallel
                one = (torch.ops.fastdp.clip_rows(x[b : b + 1], 1.0, norm),
                       torch.ops.fastdp.clip_rows_backward(g[b : b + 1], x[b : b + 1], 1.0, norm))  # fmt: skip
                assert torch.equal(one[0][0], both[0][b]) and torch.equal(one[1][0], both[1][b]), f"{shape} {b}"
    finally:
        torch.set_num_threads(threads)


def test_backend_info_lists_clip(restore_backend):
    fastdp.set_backend("auto")
    info = fastdp.backend_info()["ops"]["clip"]
    assert info["cpu"]["backend"] == ("cuda" if available("cuda", "cpu")[0] else "torch")
    assert info["cuda"]["backend"] == "torch"  # no GPU validation recorded yet


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: clip_rows(torch.zeros(3, 4), 1.0, "l1"), ValueError, "expected 'l2'"),
        (lambda: clip_rows(torch.zeros(3, 4), 1.0, None), ValueError, "expected 'l2'"),
        (lambda: clip_rows(torch.zeros(3), 1.0, "l15"), ValueError, r"\[B, C, \.\.\.\]"),
        (lambda: clip_rows(torch.zeros(()), 1.0, "l2"), ValueError, r"\[B, \.\.\.\]"),
        (lambda: clip_rows(torch.zeros(3, 4, dtype=torch.int64), 1.0), TypeError, "dtype"),
        (lambda: clip_rows([[1.0]], 1.0), TypeError, "expected a torch.Tensor"),
        (lambda: clip_rows(torch.zeros(3, 4), 0.0), ValueError, "finite and > 0"),
        (lambda: clip_rows(torch.zeros(3, 4), -1.0), ValueError, "finite and > 0"),
        (lambda: clip_rows(torch.zeros(3, 4), float("nan")), ValueError, "finite and > 0"),
        (lambda: clip_rows(torch.zeros(3, 4), float("inf")), ValueError, "finite and > 0"),
        (lambda: clip_rows(torch.zeros(3, 4), True), TypeError, "must be a float"),
        (lambda: clip_rows(torch.zeros(3, 4), "1"), TypeError, "must be a float"),
        (lambda: clip_gradient(torch.zeros(3), 1.0, "l15"), ValueError, r"\[B, C, \.\.\.\]"),
        (lambda: clip_gradient(torch.zeros(3, 4), -2.0), ValueError, "finite and > 0"),
        (lambda: torch.ops.fastdp.clip_rows(torch.zeros(3, 4), -1.0, "l2"), ValueError, "finite and > 0"),
        (lambda: torch.ops.fastdp.clip_rows(torch.zeros(3, 4, device="meta"), 1.0, "lx"), ValueError, "expected"),
        (lambda: torch.ops.fastdp.clip_rows_backward(torch.zeros(3, 5), torch.zeros(3, 4), 1.0, "l2"), ValueError,
         "must match"),
        (lambda: torch.ops.fastdp.clip_rows_backward(torch.zeros(3, 4).half(), torch.zeros(3, 4), 1.0, "l2"),
         ValueError, "must match"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_fake_tensors():
    y = torch.ops.fastdp.clip_rows(torch.zeros(5, 3, 4, device="meta", dtype=torch.bfloat16), 1.0, "l15")
    assert y.shape == (5, 3, 4) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    dx = torch.ops.fastdp.clip_rows_backward(torch.zeros(2, 7, device="meta"), torch.zeros(2, 7, device="meta"), 1.0,
                                             "l2")  # fmt: skip
    assert dx.shape == (2, 7)


# ---------------------------------------------------------------------------------- opcheck, compile


def test_opcheck(device_backend):
    device, _ = device_backend
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for shape, norm in (((3, 7), "l2"), ((3, 2, 4, 4), "l15"), ((3, 2, 9), "l2")):
            x = _input(shape, dtype, device, seed=1)
            g = _input(shape, dtype, device, seed=2)
            torch.library.opcheck(torch.ops.fastdp.clip_rows.default, (x.clone().requires_grad_(True), 0.5, norm))
            torch.library.opcheck(torch.ops.fastdp.clip_rows.default, (x, 0.5, norm))
            torch.library.opcheck(torch.ops.fastdp.clip_rows_backward.default, (g, x, 0.5, norm))
            torch.library.opcheck(torch.ops.fastdp.clip_gradient.default, (x.clone().requires_grad_(True), 0.5, norm))


def test_compiles_fullgraph(restore_backend):
    """Forward and backward through both ops trace into torch.compile graphs (no graph break), as in eager."""
    fastdp.set_backend("cuda" if available("cuda", "cpu")[0] else "torch")

    def step(x, w):
        h = clip_rows(x, 1.0) @ w
        h = clip_gradient(h, 0.1, "l2")
        return (h**2).sum()

    x = _input((4, 6), torch.float32, seed=3)
    w = torch.randn(6, 5, requires_grad=True)
    (eager,) = torch.autograd.grad(step(x, w), w)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    (got,) = torch.autograd.grad(compiled(x, w), w)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_nn_modules_compile_fullgraph(restore_backend):
    from fastdp.nn.backprop import convert_backprop
    from fastdp.nn.lipschitz import BoundedInput, ClipGradient

    fastdp.set_backend("cuda" if available("cuda", "cpu")[0] else "torch")
    torch.manual_seed(0)
    model = convert_backprop(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(),
                                                 torch.nn.Linear(12, 4)), 1.0, 0.5)  # fmt: skip
    x = _input((3, 2, 4, 4), torch.float32, seed=4)
    for module, inp in ((model, x), (BoundedInput(1.5), x), (ClipGradient(0.3), x.flatten(1))):
        torch.testing.assert_close(torch.compile(module, fullgraph=True, backend="aot_eager")(inp), module(inp))
