"""The fused release (``fastdp.ops.release_``, ``fastdp.engine.fused``): noise, the division by q N and the user's
torch.optim.SGD / Adam / AdamW update in one pass, against the unfused release followed by torch's own step."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastdp
from fastdp import PrivacyEngine
from fastdp.engine.fused import TorchOptimizerStep, fusable
from fastdp.ops import OptimizerUpdate, release_
from fastdp.ref import noise as ref

SIZES = (1, 5, 1000, 20000, 33)  # tails, several chunks (16384 elements a chunk)
CPU_BACKENDS = ["torch", pytest.param("cuda", marks=pytest.mark.skipif(not (fastdp._ext._C is not None),
                                                                      reason="fastdp._C not built"))]  # fmt: skip


@pytest.fixture
def backend(request):
    before = fastdp._backend.get_backend()
    fastdp.set_backend(request.param)
    yield request.param
    fastdp.set_backend(before)


def _tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    params = [torch.randn(n, generator=gen) for n in SIZES]
    states = [[torch.randn(n, generator=gen).abs() for n in SIZES] for _ in range(3)]
    return grads, params, states


UPDATES = {
    "sgd": ("sgd", {"lr": 0.1}, 0),
    "sgd-momentum": ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, 1),
    "sgd-nesterov-maximize": ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "maximize": True}, 1),
    "adam": (
        "adam",
        {
            "lr": 1e-3,
            "beta1_weight": 0.1,
            "beta2": 0.999,
            "beta2_weight": 1e-3,
            "eps": 1e-8,
            "step_size": 1e-2,
            "bc2_sqrt": 0.0316,
            "weight_decay": 0.01,
        },
        2,
    ),  # fmt: skip
    "adamw-amsgrad": (
        "adam",
        {
            "lr": 1e-3,
            "beta1_weight": 0.1,
            "beta2": 0.99,
            "beta2_weight": 0.01,
            "eps": 1e-6,
            "step_size": 2e-3,
            "bc2_sqrt": 0.3,
            "decay": 0.999,
            "amsgrad": True,
        },
        3,
    ),  # fmt: skip
}


def _release_args(name):
    kind, hyper, states_used = UPDATES[name]
    grads, params, states = _tensors()
    states = tuple(states[k] if k < states_used else [] for k in range(3))
    weights = [1.0, 0.9, 0.9, 1.0, 0.5] if kind == "sgd" and states[0] else None
    return kind, hyper, grads, params, states, weights


@pytest.mark.parametrize("name", list(UPDATES))
@pytest.mark.parametrize("num_draws", [1, 4])
def test_every_backend_releases_what_the_reference_does(device_backend, name, num_draws):
    """Each backend on each device (the CUDA ones under ``pytest -m cuda``) against the float64 reference on CPU."""
    device, _ = device_backend
    kind, hyper, grads, params, states, weights = _release_args(name)
    want = [[x.clone() for x in tensors] for tensors in (grads, params, *states)]
    stds, scale, seed, offset = [0.5, 0.0, 2.0, 1.0, 3.0], 4.0, 11, 2**40 + 3
    update = OptimizerUpdate(kind, list(range(len(SIZES))), want[1], tuple(want[2:]), weights, hyper)
    ref.release_(want[0], want[1], want[2:], stds, ref.stream_starts(SIZES), weights or [1.0] * len(SIZES), seed,
                 offset, num_draws, {"sgd": ref.RELEASE_SGD, "adam": ref.RELEASE_ADAM}[kind],
                 update.hyper_values(scale))  # fmt: skip
    have = [[x.to(device) for x in tensors] for tensors in (grads, params, *states)]
    update = OptimizerUpdate(kind, list(range(len(SIZES))), have[1], tuple(have[2:]), weights, hyper)
    release_(have[0], stds, scale, seed, offset, num_draws, [update])
    for expected, got in zip(want, have, strict=True):
        for a, b in zip(expected, got, strict=True):
            torch.testing.assert_close(b.cpu(), a, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS, indirect=True)
def test_the_released_gradient_does_not_depend_on_the_update(backend):
    """The noise and the division are the same whatever update follows (same backend: bitwise)."""
    plain, _, _ = _tensors()
    release_(plain, [0.5, 0.0, 2.0, 1.0, 3.0], 4.0, 11, 2**40 + 3, 4)
    for name in UPDATES:
        kind, hyper, grads, params, states, weights = _release_args(name)
        update = OptimizerUpdate(kind, list(range(len(SIZES))), params, states, weights, hyper)
        release_(grads, [0.5, 0.0, 2.0, 1.0, 3.0], 4.0, 11, 2**40 + 3, 4, [update])
        for a, b in zip(plain, grads, strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", CPU_BACKENDS, indirect=True)
def test_the_noise_actually_added_has_the_requested_std(backend):
    """A DP-relevant number: (released * scale - sum) / std is N(0, 1) per tensor, for every update kind."""
    n = 200_000
    for name in ("sgd-momentum", "adam"):
        kind, hyper, states_used = UPDATES[name]
        grads = [torch.full((n,), 3.0), torch.zeros(n)]
        params = [torch.zeros(n), torch.zeros(n)]
        states = tuple([torch.zeros(n), torch.zeros(n)] if k < states_used else [] for k in range(3))
        weights = [1.0, 1.0] if kind == "sgd" else None
        update = OptimizerUpdate(kind, [0, 1], params, states, weights, hyper)
        release_(grads, [0.25, 4.0], 8.0, 5, 9, 4, [update])
        for g, total, std in zip(grads, (3.0, 0.0), (0.25, 4.0), strict=True):
            z = (g.double() * 8.0 - total) / std
            assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1.0) < 0.01, (name, z.mean(), z.std())


def test_release_refuses_what_it_cannot_do():
    g = [torch.zeros(4)]
    with pytest.raises(ValueError, match="scale"):
        release_(g, [1.0], 0.0, 1, 0, 4)
    with pytest.raises(ValueError, match="match"):
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("sgd", [0], [torch.zeros(5)], hyper={"lr": 0.1})])
    with pytest.raises(ValueError, match="kind"):
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("lion", [0], [torch.zeros(4)])])
    with pytest.raises(ValueError, match="finite"):
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("sgd", [0], [torch.zeros(4)], hyper={"lr": float("nan")})])
    with pytest.raises(ValueError, match="twice"):
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("sgd", [0], [torch.zeros(4)]),
                                           OptimizerUpdate("sgd", [0], [torch.zeros(4)])])  # fmt: skip
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="overlaps|shares memory"):  # a state aliasing its parameter
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("sgd", [0], [p], ([p], [], []), [1.0], {"momentum": 0.9})])
    with pytest.raises(TypeError, match="float32 or float64"):
        release_([torch.zeros(4, dtype=torch.bfloat16)], [1.0], 1.0, 1, 0, 4)


# -- the front door: fused (default) against the release followed by torch's own step


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(make_optimizer, fuse: bool, steps=4, scheduler=False):
    """float64 parameters: the release's sums are float64 (``fastdp.ops.summation``) and the fused kernels take
    parameters of the sums' dtype (float32 parameters get the release, then torch's step)."""
    model = _model().double()
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (64,), generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, criterion, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.7, max_grad_norm=0.5, reproducible_seed=5,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost")  # fmt: skip
    opt.fuse_step = fuse
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    grads = []
    for i in range(steps):
        xb, yb = x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)]
        opt.zero_grad()
        criterion(model(xb), yb).backward()
        opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        if sched is not None:
            sched.step()
    return model, opt, grads


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
    "sgd-momentum-dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9, dampening=0.2,
                                                        weight_decay=1e-3),  # fmt: skip
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9, nesterov=True, maximize=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3),
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True),
    "adam-groups": lambda m: torch.optim.Adam([{"params": m[0].parameters(), "lr": 1e-2},
                                               {"params": m[2].parameters(), "lr": 3e-3, "betas": (0.8, 0.99)}]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_fused_step_equals_the_release_then_torchs_step(name, monkeypatch):
    applied = []
    original = TorchOptimizerStep.updates

    def spy(self, params, sums):
        out = original(self, params, sums)
        applied.append(out is not None)
        return out

    monkeypatch.setattr(TorchOptimizerStep, "updates", spy)
    fused_model, fused_opt, fused_grads = _train(OPTIMIZERS[name], fuse=True)
    assert applied and all(applied), "the fused path did not run"
    plain_model, plain_opt, plain_grads = _train(OPTIMIZERS[name], fuse=False)
    for x, y in zip(fused_grads[0], plain_grads[0], strict=True):  # the first released gradient: bitwise
        assert torch.equal(x, y)
    for a, b in zip(fused_grads, plain_grads, strict=True):  # later: the parameters differ by rounding
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    for p, q in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    fused_state, plain_state = fused_opt.state_dict()["optimizer"], plain_opt.state_dict()["optimizer"]
    assert fused_state["param_groups"] == plain_state["param_groups"]
    assert fused_state["state"].keys() == plain_state["state"].keys()
    for i, state in plain_state["state"].items():
        assert state.keys() == fused_state["state"][i].keys()
        for key, value in state.items():
            have = fused_state["state"][i][key]
            if key == "step":
                assert have.dtype == value.dtype and have.device == value.device and have == value
            else:
                torch.testing.assert_close(have, value, rtol=1e-5, atol=1e-6)


def test_a_scheduler_and_a_resumed_unfused_step_continue_the_fused_state():
    make = OPTIMIZERS["adam"]
    fused_model, _, _ = _train(make, fuse=True, scheduler=True, steps=5)
    plain_model, _, _ = _train(make, fuse=False, scheduler=True, steps=5)
    for p, q in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_what_the_kernel_does_not_implement_runs_torchs_step():
    model = _model()

    class MySGD(torch.optim.SGD):
        pass

    assert fusable(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not fusable(MySGD(model.parameters(), lr=0.1))  # a subclass may change step()
    assert not fusable(torch.optim.RMSprop(model.parameters()))
    assert not fusable(torch.optim.Adam(model.parameters(), differentiable=True))
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *args: None)
    assert not fusable(hooked)
    patched = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(patched, step_size=1)  # wraps patched.step
    assert not fusable(patched)
    # bf16 parameters: no fused update, torch's step after the release
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    opt16 = torch.optim.SGD(model16.parameters(), lr=0.1)
    params = list(model16.parameters())
    assert TorchOptimizerStep(opt16).updates(params, [torch.zeros_like(p, dtype=torch.float32) for p in params]) is None
    assert not opt16.state  # refused before touching the optimizer's state


def test_rmsprop_through_the_front_door_still_steps():
    before = [p.detach().clone() for p in _model().parameters()]
    model, opt, _ = _train(lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2), fuse=True, steps=1)
    assert opt.original_optimizer.state  # torch's own step ran
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_the_reference_hyperparameter_order_is_the_kernels():
    assert ref.HYPER_FIELDS[0] == "scale" and len(ref.HYPER_FIELDS) == 14


def test_non_contiguous_parameters_and_state_are_updated_in_place():
    """A channels-last or transposed parameter (and its state) runs on contiguous copies written back."""
    gen = torch.Generator().manual_seed(4)
    sums = [torch.randn(6, 5, generator=gen)]
    param, buffer = torch.randn(5, 6, generator=gen).T, torch.randn(5, 6, generator=gen).T  # non-contiguous views
    want_sums, want_param, want_buffer = sums[0].clone(), param.contiguous(), buffer.contiguous()
    hyper = {"lr": 0.1, "momentum": 0.9}
    release_([want_sums], [0.5], 2.0, 3, 4, 4, [OptimizerUpdate("sgd", [0], [want_param], ([want_buffer], [], []),
                                                                [0.9], hyper)])  # fmt: skip
    release_(sums, [0.5], 2.0, 3, 4, 4, [OptimizerUpdate("sgd", [0], [param], ([buffer], [], []), [0.9], hyper)])
    assert torch.equal(sums[0], want_sums) and torch.equal(param, want_param) and torch.equal(buffer, want_buffer)


@pytest.mark.parametrize("backend", CPU_BACKENDS, indirect=True)
def test_a_missing_optimizer_state_is_refused_and_an_unused_one_untouched(backend):
    g, p = [torch.zeros(8)], [torch.zeros(8)]
    with pytest.raises(ValueError, match=r"optimizer states \[0\]"):  # momentum without its buffer
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("sgd", [0], p, hyper={"lr": 0.1, "momentum": 0.9})])
    adam = {"lr": 1e-3, "beta1_weight": 0.1, "beta2": 0.999, "beta2_weight": 1e-3, "eps": 1e-8, "amsgrad": True}
    with pytest.raises(ValueError, match=r"optimizer states \[2\]"):  # amsgrad without max_exp_avg_sq
        release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("adam", [0], p, ([torch.zeros(8)], [torch.zeros(8)], []),
                                                          hyper=adam)])  # fmt: skip
    unused = torch.full((8,), 7.0)  # a buffer given to SGD without momentum is neither read nor written
    release_(g, [1.0], 1.0, 1, 0, 4, [OptimizerUpdate("sgd", [0], p, ([unused], [], []), [1.0], {"lr": 0.1})])
    assert torch.equal(unused, torch.full((8,), 7.0))


@pytest.mark.skipif(fastdp._ext._C is None, reason="fastdp._C not built")
def test_the_extension_refuses_a_missing_state_itself():
    hyper = [1.0, 0.1, 0.0, 1.0, 0.9, 0, 0, 0, 0, 0, 1.0, 0, 0, 0]  # SGD, momentum 0.9
    with pytest.raises(RuntimeError, match="optimizer state 0"):
        fastdp._ext._C.release_([torch.zeros(8)], [torch.zeros(8)], [[], [], []], [1.0], [0], [1.0], 1, 0, 4, 3,
                                hyper)  # fmt: skip
