"""torch.compile of the private step: for every variant the compiled step (clipped sums of each micro-batch, then
the release) gives the eager step's update, noise included; CUDA graphs (mode reduce-overhead) run the step with no
host synchronisation (GPU only)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import COMPILE_BACKENDS, COMPILE_MODES, check_compile
from fastdp.train.trainer import TrainConfig, Trainer
from tests.variants import VARIANT_NAMES, make_variant, small_model

N, FEATURES, CLASSES = 1000, 6, 3


def _variant(name: str):
    return make_variant(name, 64, N)


def _model(name: str, device: str = "cpu") -> nn.Module:
    return small_model(name, FEATURES, CLASSES, hidden=8).to(device)


def _micro_batches(step: int, device: str = "cpu", size: int = 16, count: int = 2) -> list[Batch]:
    """A padded logical batch of a step as ``count`` fixed-size micro-batches (the last rows are padding)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size * count, FEATURES, generator=gen) * 2
    y = torch.randint(0, CLASSES, (size * count,), generator=gen)
    mask = torch.arange(size * count) < size * count - 5
    return [Batch(x[i : i + size].to(device), y[i : i + size].to(device), mask[i : i + size].to(device))
            for i in range(0, size * count, size)]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (no recompilation limit carried over, graph counters from zero)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _steps(name: str, compiled: bool, steps: int = 3, backend: str = "aot_eager", precision: str = "fp32"):
    model, variant = _model(name), _variant(name)
    variant.set_precision(precision)
    if compiled:
        variant.compile(backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        loss = variant.gradient(model, _micro_batches(step), step)
        out.append(([p.grad.clone() for p in model.parameters()], loss.clone()))
        optimizer.step()
        variant.after_step(model)
    return out


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_compiled_step_matches_eager(name):
    """Three steps (two micro-batches each, optimizer and projection in between): the compiled step's gradient,
    noise included (same seed and step), and loss equal the eager step's to fp32 tolerance; graphs were compiled."""
    eager = _steps(name, compiled=False)
    compiled = _steps(name, compiled=True)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    for step, ((grads, loss), (grads_c, loss_c)) in enumerate(zip(eager, compiled, strict=True)):
        for i, (a, b) in enumerate(zip(grads, grads_c, strict=True)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{name} step {step} parameter {i}")
        torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5, msg=f"{name} step {step} loss")
    noise = [grads[0] for grads, _ in compiled]
    assert not torch.equal(noise[0], noise[1]), "the compiled release repeated a step's noise"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_low_precision_step_matches_eager(precision):
    """Autocast inside the compiled forward, fp32 norms and sums after it: the compiled bf16/fp16 DP-SGD step gives
    the eager one."""
    eager = _steps("dpsgd", compiled=False, steps=2, precision=precision)
    compiled = _steps("dpsgd", compiled=True, steps=2, precision=precision)
    for (grads, loss), (grads_c, loss_c) in zip(eager, compiled, strict=True):
        for a, b in zip(grads, grads_c, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpsgd", "nonprivate"])
def test_inductor_step_matches_eager(name):
    """Inductor-generated kernels (about 15-25 s of compilation per variant on 2 CPU cores; the aot_eager test above
    covers the same code): the same update to fp32 tolerance."""
    eager = _steps(name, compiled=False, steps=2)
    compiled = _steps(name, compiled=True, steps=2, backend="inductor")
    for (grads, loss), (grads_c, loss_c) in zip(eager, compiled, strict=True):
        for a, b in zip(grads, grads_c, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-4)


def test_trainer_compile_gives_the_eager_run():
    """--compile wires through the trainer: a padded (fixed-shape) DP-SGD run, compiled, ends with the eager run's
    weights and log."""
    runs = []
    for compile_mode in (None, "default"):
        config = TrainConfig(variant="dpsgd", dataset="breast_cancer", epochs=1, batch_size=64, epsilon=3.0, pad=True,
                             compile=compile_mode, compile_backend="aot_eager", quiet=True, progress=False,
                             reproducible_privacy_seed=0)  # compared run against run  # fmt: skip
        trainer = Trainer(config)
        result = trainer.run()
        runs.append((trainer.model.state_dict(), result))
    (eager_state, eager), (compiled_state, compiled) = runs
    for key in eager_state:
        torch.testing.assert_close(compiled_state[key], eager_state[key], rtol=1e-5, atol=1e-6, msg=key)
    assert compiled["epsilon"] == eager["epsilon"]
    assert compiled["config"]["compile"] == "default"
    assert compiled["history"][0]["train_loss"] == pytest.approx(eager["history"][0]["train_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "mode, backend, match",
    [("fast", "inductor", "unknown torch.compile mode"), (None, "cudagraphs", "unsupported torch.compile backend"),
     ("reduce-overhead", "aot_eager", "is inductor's")],
)  # fmt: skip
def test_bad_compile_settings_are_refused(mode, backend, match):
    with pytest.raises(ValueError, match=match):
        check_compile(mode, backend)
    with pytest.raises(ValueError, match=match):
        DPSGD(1.0, 1.0, 0.1, 100).compile(mode, backend)
    with pytest.raises(ValueError, match=match):
        TrainConfig(noise_multiplier=1.0, compile=mode or "default", compile_backend=backend).validate()
    for ok_mode in COMPILE_MODES:
        check_compile(ok_mode, "inductor")
    for ok_backend in COMPILE_BACKENDS:
        check_compile(None, ok_backend)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["dpsgd", "dpsgd-per-layer", "jl", "clipless", "weightclip", "backprop",
                                  "nonprivate"])  # fmt: skip
def test_cuda_graph_step_has_no_host_synchronisation(name):
    """mode="reduce-overhead" on CUDA with fixed shapes: after warm-up (compilation and CUDA-graph recording) a whole
    step — clipped sums of two micro-batches replayed from CUDA graphs, release with eagerly drawn noise, optimizer
    step, projection — runs with torch.cuda.set_sync_debug_mode("error") (any host synchronisation raises), gives
    the eager step's update, and draws new noise every step."""
    device = "cuda"
    eager_model, eager_variant = _model(name, device), _variant(name)
    model, variant = _model(name, device), _variant(name)
    variant.compile("reduce-overhead")
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = [_micro_batches(step, device) for step in range(8)]
    previous = None
    for step in range(8):
        eager_variant.gradient(eager_model, batches[step], step)
        eager_opt.step()
        eager_variant.after_step(eager_model)
        torch.cuda.synchronize()
        if step >= 4:  # warmed up: steps 0-3 compiled, recorded and replayed the graphs
            torch.cuda.set_sync_debug_mode("error")
        try:
            variant.gradient(model, batches[step], step)
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            variant.after_step(model)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for a, b in zip(eager_model.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{name} step {step}")
        if previous is not None:
            assert not torch.equal(previous[0], grads[0]), "a CUDA-graph replay repeated a step's noise"
        previous = grads
