"""One training path: the trainer's private steps go through the front door (``fastdp.engine``).

Each private variant's step in ``Trainer.run`` is the ordinary loop over ``PrivateModule`` and ``DPOptimizer`` (built
by ``private_training``, as ``PrivacyEngine.make_private`` builds them), never the variant API's ``gradient``; its
release equals the variant API's bitwise for the same batch and key (padding, micro-batches and fp16's loss scale
included), compiled (``--compile``) or not; the non-private baseline keeps the variant API's step."""

import pytest
import torch

from fastdp.algorithms.base import Variant, trainable_parameters
from fastdp.engine import DPDataLoader, DPOptimizer, PrivateModule
from fastdp.engine.privacy_engine import private_training
from fastdp.train.trainer import TrainConfig, Trainer

BASE = dict(dataset="breast_cancer", epochs=1, batch_size=32, noise_multiplier=1.0, quiet=True, progress=False,
            reproducible_privacy_seed=5)  # fmt: skip
PRIVATE = {
    "dpsgd": dict(variant="dpsgd"),
    "dpsgd-fp16-pad-micro": dict(variant="dpsgd", precision="fp16", pad=True, micro_batch=8),
    "dpsgd-bf16": dict(variant="dpsgd", precision="bf16"),
    "jl": dict(variant="jl", accountant="pld", micro_batch=8),
    "clipless": dict(variant="clipless", model="lipschitz_mlp", noise_strategy="global", pad=True),
    "weightclip": dict(variant="weightclip", model="weightclip_mlp", micro_batch=8),
    "backprop": dict(variant="backprop", pad=True, micro_batch=8),
}


@pytest.mark.parametrize("name", list(PRIVATE))
def test_private_steps_go_through_the_front_door(name, monkeypatch):
    """Every step is DPOptimizer.step on the PrivateModule's recordings: the variant API's gradient is never called;
    one release and one accounting event per logical batch (micro-batches are skipped steps)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the trainer took a step through the variant API, not the front door")

    monkeypatch.setattr(Variant, "gradient", refuse)
    releases = []
    step = DPOptimizer.step

    def counted(self, closure=None):
        skipped = self._skip_next
        result = step(self, closure)
        releases.append(not skipped)
        return result

    monkeypatch.setattr(DPOptimizer, "step", counted)
    trainer = Trainer(TrainConfig(**{**BASE, **PRIVATE[name]}))
    assert isinstance(trainer.private_model, PrivateModule) and trainer.private_model._module is trainer.model
    assert isinstance(trainer.dp_optimizer, DPOptimizer)
    assert trainer.dp_optimizer.original_optimizer is trainer.optimizer
    assert trainer.dp_optimizer.accountant is trainer.accountant  # the RunAccountant (preprocessing counted)
    assert isinstance(trainer.loader, DPDataLoader)  # Poisson batches from the front door's loader and its sampler
    assert trainer.sampler is trainer.loader.batch_sampler.sampler
    assert trainer.loader.sample_rate == trainer.variant.sample_rate == BASE["batch_size"] / len(trainer.loader.dataset)
    result = trainer.run()
    assert result["steps"] == trainer.step == len(trainer.sampler) > 0
    assert sum(releases) == trainer.step == trainer.dp_optimizer.steps_taken == trainer.accountant.steps
    if PRIVATE[name].get("micro_batch"):
        assert len(releases) > trainer.step  # micro-batches: skipped steps before each release
    assert trainer.accountant.preprocessing  # the standardisation's releases are in the same accountant's epsilon


@pytest.mark.parametrize("name", list(PRIVATE))
def test_front_door_release_equals_the_variant_api(name):
    """The trainer's front-door step releases, bitwise, the gradient the variant API releases for the same logical
    batch (padded rows, micro-batches, fp16 loss scale) and key."""
    config = {**BASE, **PRIVATE[name]}
    door, api = Trainer(TrainConfig(**config)), Trainer(TrainConfig(**config))
    api.model.load_state_dict(door.model.state_dict())
    indices = torch.tensor([3, 17, 4, 250, 99, 8, 1, 400, 42, 7, 300, 11, 12])
    door._front_door_step(door._batch(indices))
    api.variant.gradient(api.model, api._batch(indices), 0)
    released = [p.grad for p in trainable_parameters(door.model)]
    expected = [p.grad for p in trainable_parameters(api.model)]
    assert len(released) == len(expected) > 0
    for got, want in zip(released, expected, strict=True):
        assert torch.equal(got, want)
    assert door.dp_optimizer.steps_taken == 1 and door.accountant.steps == 1


def test_the_front_door_step_is_not_the_noiseless_sum():
    """A sanity check of the comparison above: another key (step index) releases a different gradient."""
    config = {**BASE, **PRIVATE["dpsgd"]}
    door, api = Trainer(TrainConfig(**config)), Trainer(TrainConfig(**config))
    api.model.load_state_dict(door.model.state_dict())
    indices = torch.arange(20)
    door._front_door_step(door._batch(indices))
    api.variant.gradient(api.model, api._batch(indices), 1)
    pairs = zip(trainable_parameters(door.model), trainable_parameters(api.model), strict=True)
    assert not all(torch.equal(p.grad, q.grad) for p, q in pairs)


def test_the_nonprivate_baseline_keeps_the_variant_step():
    trainer = Trainer(TrainConfig(**{**BASE, "variant": "nonprivate"}))
    assert trainer.private_model is None and trainer.dp_optimizer is None and trainer.loader is None


@pytest.mark.parametrize("variant", ["dpsgd", "backprop"])
def test_compiled_runs_go_through_the_front_door_and_give_the_eager_run(variant, monkeypatch):
    """--compile: the model's forward and backward compiled (graphs were made), the release compiled, the step still
    the front door's (the variant API's gradient never called), and the run ends with the eager run's weights."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    states = []
    for compile_mode in (None, "default"):
        torch._dynamo.reset()
        counters.clear()
        if compile_mode is not None:
            monkeypatch.setattr(Variant, "gradient", lambda *a, **k: pytest.fail("the variant API's step was taken"))
        trainer = Trainer(TrainConfig(**{**BASE, "variant": variant, "pad": True, "compile": compile_mode,
                                         "compile_backend": "aot_eager"}))  # fmt: skip
        assert isinstance(trainer.dp_optimizer, DPOptimizer)
        trainer.run()
        if compile_mode is not None:
            assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
        states.append(trainer.model.state_dict())
    torch._dynamo.reset()
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_grad_reduction_is_checked_and_the_user_facing_mean_needs_the_dp_criterion():
    """``private_training(..., loss_reduction="sum", grad_reduction="mean")`` is what the trainer uses (with the DP
    criterion's sum; a plain sum is refused there too); the user's ``loss_reduction="mean"`` refuses a plain mean (its
    1/n re-rounds every example when n changes), under autocast as in fp32, and trains with the DP criterion under
    autocast too (no 1/n reaches the backward)."""
    from fastdp.algorithms import DPSGD
    from fastdp.engine import DPLoss
    from fastdp.privacy.accounting import PrivacyAccountant

    def build(**kwargs):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        variant = DPSGD(1.0, 1.0, 0.5, 8, reproducible_seed=1)
        return private_training(model, torch.optim.SGD(model.parameters(), lr=0.1), variant, PrivacyAccountant(),
                                **kwargs)  # fmt: skip

    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        build(grad_reduction="max")
    model, optimizer = build(loss_reduction="sum", grad_reduction="mean")
    torch.nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]), reduction="sum").backward()
    with pytest.raises(ValueError, match="loss must come from fastdp's DP criterion .*loss_reduction='sum'"):
        optimizer.step()
    model, optimizer = build()
    y = torch.tensor([0, 1, 2, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 4))
    torch.nn.functional.cross_entropy(out.float(), y).backward()
    with pytest.raises(ValueError, match="loss must come from fastdp's DP criterion"):
        optimizer.step()
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 4))
    DPLoss(torch.nn.functional.cross_entropy, model)(out.float(), y).backward()
    optimizer.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
