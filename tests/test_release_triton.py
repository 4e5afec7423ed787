"""The Triton release kinds (``fastdp.kernels.noise.release_``) against the float64 reference (``fastdp.ref.noise``).

Both launch paths: one launch per tensor (the interpreter's path) and the one-launch list kernel (the GPU path, run
here on CPU tensors in the interpreter), the latter with 16-byte aligned tensors (unmasked full blocks) and unaligned
ones. Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``).
"""

import pytest
import torch

import fastdp
from fastdp.ref import noise as ref

pytestmark = pytest.mark.interpret

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 0, 5, 1000, 20_000]  # a tail-only tensor, an empty one, a multi-block one, two chunks (CHUNK = 16384)
STDS = [1.0, 0.7, 2.0, 0.5, 3.0]
SEED, OFFSET = 2**40 + 7, 13
TOL = dict(rtol=1e-5, atol=1e-6)

# Per case: update kind, hyperparameters (missing ones 0; decay and bc2_sqrt 1), and whether each tensor's SGD
# buffer is new (gradient weight 1: torch's buf = grad) or not (1 - dampening).
CASES = {
    "release": (ref.RELEASE, {}),
    "sgd": (ref.RELEASE_SGD, {"lr": 0.1}),
    "sgd-l2-maximize": (ref.RELEASE_SGD, {"lr": 0.1, "weight_decay": 0.01, "maximize": 1}),
    "sgd-momentum-dampening": (ref.RELEASE_SGD, {"lr": 0.1, "momentum": 0.9}),
    "sgd-nesterov-l2": (ref.RELEASE_SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": 1, "weight_decay": 1e-3}),
    "sgd-momentum-maximize": (ref.RELEASE_SGD, {"lr": 0.1, "momentum": 0.5, "maximize": 1}),
    "adam": (ref.RELEASE_ADAM, {"beta1_weight": 0.1, "beta2": 0.999, "beta2_weight": 0.001, "eps": 1e-8,
                                "step_size": 0.01 / (1 - 0.9**3), "bc2_sqrt": (1 - 0.999**3) ** 0.5}),
    "adam-l2-maximize": (ref.RELEASE_ADAM, {"beta1_weight": 0.1, "beta2": 0.99, "beta2_weight": 0.01, "eps": 1e-6,
                                            "step_size": 0.02, "bc2_sqrt": 0.2, "weight_decay": 0.01, "maximize": 1}),
    "adamw": (ref.RELEASE_ADAM, {"beta1_weight": 0.1, "beta2": 0.999, "beta2_weight": 0.001, "eps": 1e-8,
                                 "step_size": 0.01, "bc2_sqrt": 0.05, "decay": 1 - 0.01 * 0.1}),
    "adamw-amsgrad": (ref.RELEASE_ADAM, {"beta1_weight": 0.1, "beta2": 0.999, "beta2_weight": 0.001, "eps": 1e-8,
                                         "step_size": 0.01, "bc2_sqrt": 0.05, "decay": 0.999, "amsgrad": 1}),
}  # fmt: skip


@pytest.fixture
def triton_noise():
    if not torch.cuda.is_available() and not fastdp._backend.available("triton", "cpu")[0]:
        pytest.skip("Triton cannot run here")
    from fastdp.kernels import noise

    return noise


def _hyper(values: dict, scale: float = 8.0) -> list[float]:
    h = {"decay": 1.0, "bc2_sqrt": 1.0, **values, "scale": scale}
    return [float(h.get(name, 0.0)) for name in ref.HYPER_FIELDS]


def _tensor(values: torch.Tensor, aligned: bool) -> torch.Tensor:
    """values on DEVICE, contiguous, its data 16-byte aligned or (a view one element into a buffer) not."""
    if aligned:
        return values.to(DEVICE).clone()
    buffer = torch.empty(values.numel() + 1, dtype=values.dtype, device=DEVICE)
    view = buffer[1:]
    view.copy_(values)
    assert view.is_contiguous() and (view.numel() == 0 or view.data_ptr() % 16 != 0)
    return view


def _problem(update: int, hyper: list[float], seed: int = 0, aligned: bool = True):
    """(grads, params, states, grad_weights) for the update: the states it reads, optimizer state of a step > 1."""
    gen = torch.Generator().manual_seed(seed)
    h = dict(zip(ref.HYPER_FIELDS, hyper, strict=True))

    def make(positive=False):
        xs = [torch.randn(n, generator=gen) for n in SIZES]
        return [_tensor(x.abs() * 0.01 if positive else x, aligned) for x in xs]

    grads = [_tensor(x * 4.0, aligned) for x in (torch.randn(n, generator=gen) for n in SIZES)]
    params = make() if update != ref.RELEASE else []
    states = [[], [], []]
    if update == ref.RELEASE_SGD and h["momentum"]:
        states[0] = make()
    if update == ref.RELEASE_ADAM:
        states[0], states[1] = make(), make(positive=True)
        if h["amsgrad"]:
            states[2] = [x + 0.005 * (t % 2) for t, x in enumerate(make(positive=True))]  # some above exp_avg_sq
    grad_weights = [1.0 if t % 2 else 0.9 for t in range(len(SIZES))]  # new buffers (1) and dampening 0.1
    return grads, params, states, grad_weights


def _clone(problem):
    grads, params, states, grad_weights = problem
    copies = [[x.clone() for x in tensors] for tensors in (grads, params, *states)]
    return copies[0], copies[1], copies[2:], grad_weights


def _run(release, problem, update, hyper, num_draws):
    grads, params, states, grad_weights = problem
    release(grads, params, states, STDS, ref.stream_starts(SIZES), grad_weights, SEED, OFFSET, num_draws, update, hyper)


def _launch(monkeypatch, triton_noise, path: str) -> None:
    """Make ``release_`` take the launch path: per tensor or (for more than one tensor) the list kernel."""
    monkeypatch.setattr(triton_noise, "INTERPRET", path == "tensor")


def _assert_close(actual, expected, what):
    for t, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a.cpu(), e.cpu(), **TOL, msg=lambda m, t=t: f"{what}, tensor {t}: {m}")


@pytest.mark.parametrize("num_draws", [1, 4])
@pytest.mark.parametrize("path", ["tensor", "list", "list-unaligned"])
@pytest.mark.parametrize("case", list(CASES))
def test_release_matches_reference(triton_noise, monkeypatch, case, path, num_draws):
    update, values = CASES[case]
    hyper = _hyper(values)
    problem = _problem(update, hyper, aligned=path != "list-unaligned")
    expected = _clone(problem)
    _run(ref.release_, expected, update, hyper, num_draws)
    _launch(monkeypatch, triton_noise, path)
    _run(triton_noise.release_, problem, update, hyper, num_draws)
    what = f"{case} {path} draws={num_draws}"
    _assert_close(problem[0], expected[0], f"{what}: released gradient")
    _assert_close(problem[1], expected[1], f"{what}: params")
    for k in range(3):
        _assert_close(problem[2][k], expected[2][k], f"{what}: state {k}")
    if update == ref.RELEASE_SGD and not values.get("momentum"):
        assert not problem[2][0], "SGD without momentum has no buffer"


@pytest.mark.parametrize("path", ["tensor", "list"])
@pytest.mark.parametrize("num_draws", [1, 4])
def test_optimizer_kinds_release_the_released_gradient(triton_noise, monkeypatch, path, num_draws):
    """Kinds 3 and 4 write the very gradient kind 2 releases (same noise, same fp32 operations): bitwise."""
    _launch(monkeypatch, triton_noise, path)
    released = None
    for case in ("release", "sgd-nesterov-l2", "sgd", "adam-l2-maximize", "adamw-amsgrad"):
        update, values = CASES[case]
        hyper = _hyper(values)
        problem = _problem(update, hyper, seed=5)
        _run(triton_noise.release_, problem, update, hyper, num_draws)
        if released is None:
            released = problem[0]
            continue
        for t, (a, b) in enumerate(zip(problem[0], released, strict=True)):
            assert torch.equal(a, b), f"{case} {path}: tensor {t}'s released gradient differs from kind 2's"


def test_list_and_per_tensor_paths_agree(triton_noise, monkeypatch):
    """The list kernel (aligned: unmasked full blocks, masked tail; unaligned: masked) and the per-tensor kernel draw
    the same noise and do the same fp32 operations."""
    update, values = CASES["adamw-amsgrad"]
    hyper = _hyper(values)
    results = []
    for path, aligned in (("tensor", True), ("list", True), ("list", False)):
        _launch(monkeypatch, triton_noise, path)
        problem = _problem(update, hyper, seed=3, aligned=aligned)
        _run(triton_noise.release_, problem, update, hyper, 4)
        results.append([x.cpu() for x in (*problem[0], *problem[1], *(x for s in problem[2] for x in s))])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_noise_list_kernel_unaligned_equals_aligned(triton_noise, fused):
    """The add-noise and fused-step list kernel: unaligned tensors (masked blocks) get the aligned result."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(n, generator=gen) for n in SIZES if n]
    params = [torch.randn(n, generator=gen) for n in SIZES if n] if fused else []
    starts = ref.stream_starts([g.numel() for g in grads])
    outputs = []
    for aligned in (True, False):
        g = [_tensor(x, aligned) for x in grads]
        p = [_tensor(x, aligned) for x in params]
        triton_noise._launch_list(g, p, STDS[: len(g)], starts, SEED, OFFSET, 4, 0.01)
        outputs.append([x.cpu() for x in (p if fused else g)])
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_compile_specs_cover_every_launch_configuration(triton_noise):
    """Every constexpr configuration ``release_`` can launch is in ``hopper_compile_specs()`` (the sm_90 check)."""
    listed = {(fn.__name__, tuple(sorted(cx.items()))) for fn, _, cx, *_ in triton_noise.hopper_compile_specs()}
    seen = 0
    for update, values in CASES.values():
        for extra in ({}, {"maximize": 1}, {"weight_decay": 0.1}, {"momentum": 0.9}, {"nesterov": 1},
                      {"momentum": 0.9, "nesterov": 1}, {"amsgrad": 1}, {"momentum": 1e-50}):  # fmt: skip
            h = dict(zip(ref.HYPER_FIELDS, _hyper({**values, **extra}), strict=True))
            flags = triton_noise._release_flags(update, h)
            for draws in (1, 4):
                common = {"BLOCK": triton_noise.RELEASE_BLOCK, "NUM_DRAWS": draws, **flags}
                assert ("_release_tensor_kernel", tuple(sorted(common.items()))) in listed, common
                for aligned in (False, True):
                    full = {"CHUNK": triton_noise.CHUNK, **common, "ALIGNED": aligned}
                    assert ("_release_list_kernel", tuple(sorted(full.items()))) in listed, full
                    seen += 1
    assert seen
    # Flags a kind does not read are canonical (False): one compiled variant per behaviour.
    h = dict(zip(ref.HYPER_FIELDS, _hyper({"momentum": 0.9, "nesterov": 1, "amsgrad": 1, "maximize": 1}), strict=True))
    assert triton_noise._release_flags(ref.RELEASE, h) == triton_noise._release_flags(ref.RELEASE, {**h, "maximize": 0})
    assert not triton_noise._release_flags(ref.RELEASE_ADAM, h)["MOMENTUM"]
    assert not triton_noise._release_flags(ref.RELEASE_SGD, h)["AMSGRAD"]
    assert not triton_noise._release_flags(ref.RELEASE_SGD, {**h, "momentum": 1e-50})["NESTEROV"]  # 0 in fp32


def test_empty_tensors_and_bad_input(triton_noise):
    empty = torch.zeros(0, device=DEVICE)
    triton_noise.release_([empty], [], [[], [], []], [1.0], [0], [1.0], 0, 0, 4, ref.RELEASE, _hyper({}))
    triton_noise.release_([], [], [[], [], []], [], [], [], 0, 0, 4, ref.RELEASE, _hyper({}))
    g, p = torch.zeros(3, device=DEVICE), torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match="update must be"):
        triton_noise.release_([g], [p], [[], [], []], [1.0], [0], [1.0], 0, 0, 4, 5, _hyper({}))
    with pytest.raises(ValueError, match="states"):  # momentum without buffers
        triton_noise.release_([g], [p], [[], [], []], [1.0], [0], [1.0], 0, 0, 4, ref.RELEASE_SGD,
                              _hyper({"momentum": 0.9}))  # fmt: skip
    with pytest.raises(ValueError, match="states"):  # amsgrad without max_exp_avg_sq
        triton_noise.release_([g], [p], [[g.clone()], [g.clone()], []], [1.0], [0], [1.0], 0, 0, 4,
                              ref.RELEASE_ADAM, _hyper({"amsgrad": 1}))  # fmt: skip
    with pytest.raises(ValueError, match="param"):
        triton_noise.release_([g], [], [[], [], []], [1.0], [0], [1.0], 0, 0, 4, ref.RELEASE_SGD, _hyper({}))
    with pytest.raises(TypeError, match="float32"):
        triton_noise.release_([g.double()], [], [[], [], []], [1.0], [0], [1.0], 0, 0, 4, ref.RELEASE, _hyper({}))
