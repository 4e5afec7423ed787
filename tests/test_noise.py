"""fastdp noise ops: distribution, reproducibility, agreement with the float64 reference, edge cases."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

import fastdp
from fastdp.ops import add_noise_, add_noise_at_, noisy_sgd_step_
from fastdp.ref import noise as ref
from tests.conftest import TOL

# Statistical tests run at fixed seeds and reject at p < 1e-6 (5-sigma bands): never flaky.
P_REJECT = 1e-6
SIGMAS = 5.0


def _reference(grads, stds, seed, offset, num_draws=1, params=None, step=0.0):
    """Expected tensors from the float64 reference, on clones."""
    g = [x.clone() for x in grads]
    p = [x.clone() for x in params] if params else []
    starts = ref.stream_starts([x.numel() for x in grads])
    ref.noise_([x.contiguous() for x in g] if not params else [x.contiguous() for x in g],
               [x.contiguous() for x in p], stds, starts, seed, offset, num_draws, step)  # fmt: skip
    return p if params else g


def _assert_close(actual, expected, msg):
    for t, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a.cpu(), e.cpu(), **TOL[a.dtype], msg=lambda m, t=t: f"{msg}, tensor {t}: {m}")


# ----------------------------------------------------------------------------------- the stream


def test_philox_known_answers():
    """Random123's published Philox4x32-10 test vectors."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((2**32 - 1,) * 4, (2**32 - 1,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        out = ref.philox4x32_10([torch.tensor([c]) for c in counter], key)
        assert tuple(int(o) for o in out) == expected


def test_stream_starts_pad_to_groups_of_four():
    assert ref.stream_starts([0, 1, 5, 4, 3]) == [0, 0, 4, 12, 16]


def test_reference_normals_are_standard():
    z = ref.standard_normal(seed=11, offset=0, start=0, numel=400_000).numpy()
    assert stats.kstest(z, "norm").pvalue > P_REJECT
    assert np.abs(z).max() < 6.77  # fast-mode tail bound sqrt(66 ln 2)


# ------------------------------------------------------------------------------ distribution


@pytest.mark.parametrize("secure", [False, True], ids=["fast", "secure"])
def test_noise_has_requested_per_tensor_std(device_backend, secure):
    """>= 10^6 draws: std within 5 standard errors, mean ~ 0, KS against N(0, s^2)."""
    device, backend = device_backend
    stds = [0.5, 3.0, 1e-3]
    sizes = [500_000, 400_003, 100_001]
    grads = [torch.zeros(n, device=device) for n in sizes]
    if secure:
        add_noise_(grads, stds, secure=True)
    else:
        add_noise_(grads, stds, seed=1234, offset=5)
    for g, s, n in zip(grads, stds, sizes, strict=True):
        x = g.double().cpu().numpy()
        sample_std = x.std()
        assert abs(sample_std - s) < SIGMAS * s / math.sqrt(2 * n), f"{backend}: std {sample_std} vs {s}"
        assert abs(x.mean()) < SIGMAS * s / math.sqrt(n), f"{backend}: mean {x.mean()}"
        if not secure:  # secure draws are not seeded: the KS p-value would not be fixed
            assert stats.kstest(x / s, "norm").pvalue > P_REJECT


def test_secure_noise_is_normal_and_fresh():
    """Secure mode (4-draw sum): normal at the requested std; two calls never repeat."""
    a, b = torch.zeros(200_000), torch.zeros(200_000)
    add_noise_([a], 2.0, secure=True)
    add_noise_([b], 2.0, secure=True)
    assert not torch.equal(a, b)
    # 4-draw sum from a fixed stream: KS at a fixed seed through the reference.
    z = ref.standard_normal(seed=3, offset=9, start=0, numel=400_000, num_draws=4).numpy()
    assert stats.kstest(z, "norm").pvalue > P_REJECT


def test_std_zero_is_exact_noop(device_backend):
    device, _ = device_backend
    g = torch.randn(1001, device=device)
    g[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    before = g.clone()
    add_noise_([g], 0.0, seed=1, offset=0)
    assert torch.equal(g.view(torch.int32), before.view(torch.int32))


def test_same_seed_and_offset_are_bitwise_reproducible(device_backend):
    device, _ = device_backend
    a, b = torch.zeros(70_001, device=device), torch.zeros(70_001, device=device)
    add_noise_([a], 1.0, seed=99, offset=17)
    add_noise_([b], 1.0, seed=99, offset=17)
    assert torch.equal(a, b)


def test_different_offsets_and_seeds_are_independent(device_backend):
    device, _ = device_backend
    n = 200_000
    draws = []
    for seed, offset in ((5, 0), (5, 1), (6, 0), (5, 2**40)):
        g = torch.zeros(n, device=device)
        add_noise_([g], 1.0, seed=seed, offset=offset)
        draws.append(g.double().cpu().numpy())
    bound = SIGMAS / math.sqrt(n)
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            corr = np.corrcoef(draws[i], draws[j])[0, 1]
            assert abs(corr) < bound, f"draws {i} and {j} correlate: {corr}"


# ------------------------------------------------------------------- agreement with the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_add_noise_matches_reference(device_backend, dtype):
    device, backend = device_backend
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 123, 129, 20_000, 3]
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes]
    stds = [0.7, 1.5, 0.0, 2.0, 0.3, 1.0]
    expected = _reference(grads, stds, seed=42, offset=7)
    add_noise_(grads, stds, seed=42, offset=7)
    _assert_close(grads, expected, f"{backend} add_noise_ {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noisy_sgd_step_matches_reference(device_backend, dtype):
    device, backend = device_backend
    gen = torch.Generator().manual_seed(1)
    sizes = [17, 4096, 1, 0, 33_333]
    params = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes]
    grads_before = [g.clone() for g in grads]
    stds, lr, scale = [1.0, 0.5, 2.0, 1.0, 0.0], 0.1, 64.0
    expected = _reference(grads, stds, seed=3, offset=11, params=params, step=lr / scale)
    noisy_sgd_step_(params, grads, stds, lr=lr, scale=scale, seed=3, offset=11)
    _assert_close(params, expected, f"{backend} noisy_sgd_step_ {dtype}")
    for g, before in zip(grads, grads_before, strict=True):
        assert torch.equal(g, before), "the fused step must not modify grads"


def test_fused_step_equals_add_noise_then_update(device_backend):
    """p - lr (g + noise) / scale with the same draw as add_noise_ (fp32 tolerance)."""
    device, _ = device_backend
    p = torch.randn(5000, device=device)
    g = torch.randn(5000, device=device)
    noisy = g.clone()
    add_noise_([noisy], 0.8, seed=8, offset=2)
    expected = p - 0.5 * noisy / 10.0
    noisy_sgd_step_([p], [g], 0.8, lr=0.5, scale=10.0, seed=8, offset=2)
    torch.testing.assert_close(p, expected, **TOL[torch.float32])


def test_backends_draw_the_same_stream(device_backend):
    """Every backend reproduces the reference stream (not just its distribution)."""
    device, backend = device_backend
    g = torch.zeros(10_007, device=device)
    add_noise_([g], 1.0, seed=2**62 + 12345, offset=2**33 + 5)
    expected = ref.standard_normal(2**62 + 12345, 2**33 + 5, 0, 10_007).float()
    torch.testing.assert_close(g.cpu(), expected, **TOL[torch.float32])


def test_noise_independent_of_launch_split(device_backend):
    """A tensor's noise depends on its place in the list, not on dtype groups, chunks or launches."""
    device, _ = device_backend
    sizes = [70_001, 5, 16_385]
    all_fp32 = [torch.zeros(n, device=device) for n in sizes]
    add_noise_(all_fp32, [1.0, 1.0, 1.0], seed=4, offset=4)
    mixed = [torch.zeros(70_001, device=device), torch.zeros(5, device=device, dtype=torch.float64),
             torch.zeros(16_385, device=device)]  # fmt: skip
    add_noise_(mixed, [1.0, 1.0, 1.0], seed=4, offset=4)
    assert torch.equal(all_fp32[0], mixed[0]) and torch.equal(all_fp32[2], mixed[2])
    torch.testing.assert_close(mixed[1].float(), all_fp32[1], **TOL[torch.float32])


def test_add_noise_at_draws_the_whole_lists_values(device_backend):
    """add_noise_at_ at a tensor's stream start, or at a multiple of 4 inside it, gives add_noise_'s values for that
    tensor or piece, bit for bit, whatever the other tensors of the call."""
    device, _ = device_backend
    sizes, stds = [70_001, 5, 16_385, 3], [1.0, 0.5, 2.0, 0.25]
    whole = [torch.zeros(n, device=device) for n in sizes]
    add_noise_(whole, stds, seed=9, offset=2**33 + 1, num_draws=4)
    starts = ref.stream_starts(sizes)
    parts = [torch.zeros(n, device=device) for n in sizes]
    add_noise_at_([parts[2], parts[0]], [stds[2], stds[0]], [starts[2], starts[0]], 9, 2**33 + 1)
    add_noise_at_(parts[1], stds[1], [starts[1]], 9, 2**33 + 1)
    pieces = [parts[3][:0], parts[3]]  # an empty piece is a no-op
    add_noise_at_(pieces, [stds[3], stds[3]], [starts[3], starts[3]], 9, 2**33 + 1)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    inside = torch.zeros(1000, device=device)
    add_noise_at_([inside[:400], inside[400:]], stds[0], [starts[0] + 40_000, starts[0] + 40_400], 9, 2**33 + 1)
    assert torch.equal(inside, whole[0][40_000:41_000])


@pytest.mark.parametrize(
    ("starts", "match"),
    [([2], "multiple of 4"), ([-4], "int >= 0"), ([4.0], "int >= 0"), ([True], "int >= 0"), ([0, 4], "one start"),
     ([2**62], "2\\*\\*62")],
)  # fmt: skip
def test_add_noise_at_refuses_bad_starts(starts, match):
    g = torch.zeros(8)
    with pytest.raises(ValueError, match=match):
        add_noise_at_([g], 1.0, starts, 1, 1)
    assert not g.any()


def test_single_one_element_tensor(device_backend):
    device, _ = device_backend
    g = torch.full((1,), 0.25, device=device)
    add_noise_(g, 3.0, seed=77, offset=1)  # a bare tensor is a list of one
    expected = 0.25 + 3.0 * ref.standard_normal(77, 1, 0, 1).float()
    torch.testing.assert_close(g.cpu(), expected, **TOL[torch.float32])


def test_many_odd_tensors(device_backend):
    device, backend = device_backend
    sizes = np.random.default_rng(0).integers(1, 300, size=500).tolist()
    grads = [torch.zeros(n, device=device) for n in sizes]
    stds = [0.5 + (t % 7) for t in range(500)]
    expected = _reference(grads, stds, seed=10, offset=1)
    add_noise_(grads, stds, seed=10, offset=1)
    _assert_close(grads, expected, f"{backend} 500 tensors")


def test_non_contiguous_tensors(device_backend):
    """Strided and transposed views get the noise of their logical (row-major) order, in place."""
    device, _ = device_backend
    wide = torch.zeros(64, 130, device=device)
    other = torch.zeros(9, 5, device=device)
    views = [wide[:, 1:128:2], other.t()]
    starts = ref.stream_starts([v.numel() for v in views])
    add_noise_(views, [1.0, 2.0], seed=21, offset=3)
    for view, start, std in zip(views, starts, (1.0, 2.0), strict=True):
        expected = std * ref.standard_normal(21, 3, start, view.numel()).float().reshape(view.shape)
        torch.testing.assert_close(view.cpu(), expected, **TOL[torch.float32])
    assert torch.count_nonzero(wide[:, 0::2]) == 0, "elements outside the view must not change"


def test_float64_runs_the_reference(device_backend):
    device, _ = device_backend
    g = torch.zeros(1000, device=device, dtype=torch.float64)
    add_noise_([g], 2.0, seed=5, offset=6)
    torch.testing.assert_close(g.cpu(), 2.0 * ref.standard_normal(5, 6, 0, 1000), rtol=0, atol=0)


def test_parameters_requiring_grad(device_backend):
    device, _ = device_backend
    model = torch.nn.Linear(7, 3).to(device)
    params = list(model.parameters())
    grads = [torch.ones_like(p) for p in params]
    before = [p.detach().clone() for p in params]
    noisy_sgd_step_(params, grads, 0.0, lr=1.0, scale=2.0, seed=0, offset=0)
    for p, b in zip(params, before, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.5)


# -------------------------------------------------------------------------------- bad input


def _same_tensor_twice():
    x = torch.zeros(4)
    add_noise_([x, x], 1.0, seed=0)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: add_noise_([torch.zeros(3), torch.zeros(2)], [1.0], seed=0), ValueError, "one std per tensor"),
        (lambda: add_noise_([torch.zeros(3)], [-1.0], seed=0), ValueError, "finite and >= 0"),
        (lambda: add_noise_([torch.zeros(3)], [float("nan")], seed=0), ValueError, "finite and >= 0"),
        (lambda: add_noise_([torch.zeros(3)], [float("inf")], seed=0), ValueError, "finite and >= 0"),
        (lambda: add_noise_([torch.zeros(3, dtype=torch.int32)], 1.0, seed=0), TypeError, "floating-point"),
        (lambda: add_noise_([torch.zeros(3), torch.zeros(3, device="meta")], 1.0, seed=0), ValueError, "one device"),
        (lambda: add_noise_([torch.zeros(3), 3.0], 1.0, seed=0), TypeError, "expected a torch.Tensor"),
        (lambda: add_noise_([torch.zeros(3)], 1.0, seed=-1), ValueError, r"\[0, 2\*\*63\)"),
        (lambda: add_noise_([torch.zeros(3)], 1.0, seed=2**63), ValueError, r"\[0, 2\*\*63\)"),
        (lambda: add_noise_([torch.zeros(3)], 1.0, seed=1.5), TypeError, "seed must be an int"),
        (lambda: add_noise_([torch.zeros(3)], 1.0, seed=0, offset=-3), ValueError, r"\[0, 2\*\*63\)"),
        (lambda: add_noise_([torch.zeros(3)], 1.0, seed=3, secure=True), ValueError, "do not pass a seed"),
        (lambda: add_noise_([torch.zeros(3)], torch.ones(2, 2), seed=0), ValueError, "1-D"),
        (lambda: _same_tensor_twice(), ValueError, "shares memory"),
        (lambda: noisy_sgd_step_([torch.zeros(3)], [torch.zeros(4)], 1.0, lr=0.1, seed=0), ValueError, "match"),
        (lambda: noisy_sgd_step_([torch.zeros(3)], [torch.zeros(3).half()], 1.0, 0.1, seed=0), ValueError, "match"),
        (lambda: noisy_sgd_step_([torch.zeros(3)], [], 1.0, lr=0.1, seed=0), ValueError, "one"),
        (lambda: noisy_sgd_step_([torch.zeros(3)], [torch.zeros(3)], 1.0, lr=float("nan"), seed=0), ValueError, "lr"),
        (lambda: noisy_sgd_step_([torch.zeros(3)], [torch.zeros(3)], 1.0, lr=0.1, scale=0.0, seed=0), ValueError,
         "scale"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bad_input_leaves_tensors_untouched():
    a, b = torch.zeros(5), torch.zeros(5)
    with pytest.raises(ValueError):
        add_noise_([a, b], [1.0, -1.0], seed=0)
    assert torch.count_nonzero(a) == 0


def test_empty_list_and_empty_tensors_are_noops():
    add_noise_([], [], seed=0)
    empty = torch.zeros(0)
    add_noise_([empty], 1.0, seed=0)
    noisy_sgd_step_([torch.zeros(0)], [torch.zeros(0)], 1.0, lr=0.1, seed=0)


# ----------------------------------------------------------------------------------- opcheck


def test_opcheck(device_backend):
    device, _ = device_backend
    grads = [torch.randn(37, device=device), torch.randn(4, 5, device=device)]
    params = [torch.randn(37, device=device), torch.randn(4, 5, device=device)]
    torch.library.opcheck(torch.ops.fastdp.add_noise_.default, ([g.clone() for g in grads], [1.0, 2.0], 3, 4, 1))
    torch.library.opcheck(
        torch.ops.fastdp.noisy_sgd_step_.default, ([p.clone() for p in params], grads, [1.0, 0.5], 0.01, 3, 4, 1)
    )


def test_eager_entry_point_equals_the_op(device_backend):
    """Eager calls skip the dispatcher (fastdp._backend.eager) and must draw exactly what the registered op draws."""
    device, _ = device_backend
    grads = [torch.randn(37, device=device), torch.randn(4, 5, device=device)]
    direct, via_op = [g.clone() for g in grads], [g.clone() for g in grads]
    add_noise_(direct, [1.0, 2.0], seed=3, offset=4)
    torch.ops.fastdp.add_noise_(via_op, [1.0, 2.0], 3, 4, 1)
    for a, b in zip(direct, via_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiles_fullgraph(restore_backend):
    """The op traces into a torch.compile graph (no graph break) and draws the same noise."""
    fastdp.set_backend("cuda")

    def step(p, g):
        noisy_sgd_step_([p], [g], 1.0, lr=0.1, scale=4.0, seed=1, offset=2)
        return p

    p, g = torch.zeros(100), torch.ones(100)
    eager = step(p.clone(), g)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(p.clone(), g)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# --------------------------------------------------------------------------- Triton list kernel


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused, num_draws", [(False, 1), (True, 1), (False, 4)])
def test_triton_list_kernel_matches_reference(dtype, fused, num_draws):
    """The one-launch list kernel (the GPU path; under the interpreter on CPU) against the reference."""
    if not torch.cuda.is_available() and not fastdp._backend.available("triton", "cpu")[0]:
        pytest.skip("Triton cannot run here")
    from fastdp.kernels import noise as triton_noise

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(2)
    sizes = [5, 16_385, 1, 40_000]
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes]
    params = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes] if fused else []
    stds, starts = [1.0, 0.5, 2.0, 0.25], ref.stream_starts(sizes)
    expected = _reference(grads, stds, 2**40 + 3, 9, num_draws, params=params, step=0.01)
    triton_noise._launch_list(grads, params, stds, starts, 2**40 + 3, 9, num_draws, 0.01)
    _assert_close(params if fused else grads, expected, f"list kernel {dtype} fused={fused} draws={num_draws}")


def test_device_table_gives_the_launch_metadata_on_the_device():
    """``fastdp.kernels.device_table``: a nested list or a host tensor as a tensor of the dtype on the device (pinned
    and copied asynchronously for CUDA, checked there by the CUDA tests that launch the kernels)."""
    pytest.importorskip("triton")
    from fastdp.kernels import device_table

    table = device_table([[1, 2**40], [3, 4]], torch.int64, torch.device("cpu"))
    assert table.dtype == torch.int64 and table.tolist() == [[1, 2**40], [3, 4]]
    ids = device_table(torch.tensor([0, 0, 1], dtype=torch.int64), torch.int32, torch.device("cpu"))
    assert ids.dtype == torch.int32 and ids.tolist() == [0, 0, 1]
    assert device_table([0.5], torch.float32, torch.device("cpu")).tolist() == [0.5]
