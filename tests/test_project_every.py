"""Clipless and weight clipping projecting after every k-th step only (``project_every``): the projection runs on
those steps alone, each example's gradient stays within the bound the noise is calibrated to on the steps between
(where the weights have drifted off the constraint), the bounds grow with the drift, and the step count survives a
checkpoint in the trainer and the front door."""

import pytest
import torch
from torch import nn

from fastdp.algorithms import Batch, Clipless, WeightClip
from fastdp.audit.bounds import sigma_max
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear

VARIANTS = {"clipless": (Clipless, "orthogonal"), "weightclip": (WeightClip, "clip")}


def mlp(projection: str) -> nn.Module:
    torch.manual_seed(0)
    bias = projection != "orthogonal"
    return nn.Sequential(BoundedInput(3.0), LipschitzLinear(10, 16, bias=bias, projection=projection), GroupSort2(),
                         LipschitzLinear(16, 3, bias=bias, projection=projection))  # fmt: skip


def batch(rows: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    x = 5.0 * torch.randn(rows, 10, generator=gen)
    return Batch(x, torch.randint(0, 3, (rows,), generator=gen), torch.ones(rows, dtype=torch.bool))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_projection_only_every_kth_step_and_each_example_within_its_bound(name):
    cls, projection = VARIANTS[name]
    model = mlp(projection)
    variant = cls(1.0, 0.5, 64, reproducible_seed=0, project_every=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # large steps: the weights drift far off the constraint
    layers = [m for m in model.modules() if isinstance(m, LipschitzLinear)]
    params = [p for p in model.parameters() if p.requires_grad]
    drifted = 0.0
    for step in range(9):
        # what the release reads: each layer's certified bound, and each example's gradient against its bound
        for layer in layers:
            assert float(layer.lipschitz()) >= float(sigma_max(layer.weight))
        stds = variant.noise_stds(model)
        bounds = variant.last_bounds.clone()
        assert torch.all(stds > 0)
        drifted = max(drifted, max(float(sigma_max(layer.weight)) for layer in layers))
        for i in range(4):
            sums, _ = variant.clipped_sum(model, batch(1, seed=100 * step + i), step)
            for s, bound in zip(sums, bounds, strict=True):
                assert float(s.norm()) <= float(bound)
        variant.gradient(model, batch(32, seed=step), step)
        optimizer.step()
        before = [p.detach().clone() for p in params]
        variant.after_step(model)
        projected = any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))
        assert projected == (step % 3 == 2), step  # only after the 3rd, 6th, 9th step
        assert variant.steps_since_projection == (step + 1) % 3
        if projected:  # back on the constraint
            assert max(float(sigma_max(layer.weight)) for layer in layers) <= 1 + 1e-5
    assert drifted > 1.05  # the test did exercise weights off the constraint


def test_the_bounds_grow_with_the_drift_and_return_at_the_projection():
    model = mlp("orthogonal")
    variant = Clipless(1.0, 0.5, 64, reproducible_seed=0, project_every=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    totals = []
    for step in range(8):
        variant.noise_stds(model)
        totals.append(float(variant.last_bounds.sum()))
        variant.gradient(model, batch(32, seed=step), step)
        optimizer.step()
        variant.after_step(model)
    assert totals[0] < totals[1] < totals[2] < totals[3]  # carried bounds: certificate + ||W - W_certified||_F
    assert totals[4] == pytest.approx(totals[0], rel=0.05)  # projected after the 4th step


def test_bad_project_every_is_refused():
    from fastdp.train.trainer import TrainConfig

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="project_every"):
            Clipless(1.0, 0.1, 100, project_every=bad)
    with pytest.raises(ValueError, match="--project-every is for the clipless and weightclip"):
        TrainConfig(variant="dpsgd", epsilon=1.0, project_every=2).validate()
    with pytest.raises(ValueError, match="--project-every must be an int"):
        TrainConfig(variant="clipless", model="lipschitz_mlp", epsilon=1.0, project_every=0).validate()
    variant = Clipless(1.0, 0.1, 100, project_every=3)
    for bad in (3, -1, 1.0, None):
        with pytest.raises(ValueError, match="steps since the last projection"):
            variant.restore_checkpoint_state({"steps_since_projection": bad})


def test_the_trainer_resumes_mid_cycle_like_an_uninterrupted_run(tmp_path):
    """Checkpoint after an epoch that ends between projections: the resumed run projects on the same steps and ends
    with the same weights, bit for bit, as the uninterrupted one."""
    from fastdp.train.trainer import TrainConfig, Trainer, train

    def config(epochs: int, path: str, resume: bool = False) -> TrainConfig:
        return TrainConfig(variant="clipless", model="lipschitz_mlp", dataset="breast_cancer", noise_multiplier=1.0,
                           epochs=epochs, batch_size=128, lr=0.03, hidden=16, quiet=True, progress=False,
                           project_every=3, reproducible_privacy_seed=0, checkpoint=str(tmp_path / path),
                           resume=resume)  # fmt: skip

    train(config(2, "a.pt"))
    saved = torch.load(tmp_path / "a.pt", weights_only=False)
    steps = saved["variant_state"]["steps_since_projection"]
    assert 0 <= steps < 3
    resumed = train(config(3, "a.pt", resume=True))
    whole = train(config(3, "b.pt"))
    assert resumed["variant_config"]["project_every"] == 3
    a = Trainer(config(3, "a.pt", resume=True))
    a.load_checkpoint(tmp_path / "a.pt")
    b = Trainer(config(3, "b.pt", resume=True))
    b.load_checkpoint(tmp_path / "b.pt")
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert a.variant.steps_since_projection == b.variant.steps_since_projection
    assert resumed["test_accuracy"] == whole["test_accuracy"]


def _front_door_data():
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(40, 10, generator=gen), torch.randint(0, 3, (40,), generator=gen))


def _front_door_run(lr: float, **kwargs):
    """(engine, model, optimizer, criterion, loader) of a reproducible clipless front-door run on the test MLP."""
    from torch.utils.data import DataLoader

    from fastdp import PrivacyEngine

    model = mlp("orthogonal")
    engine = PrivacyEngine()
    loader = DataLoader(_front_door_data(), 10)
    private, opt, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data_loader=loader, noise_multiplier=1.0,
        variant="clipless", reproducible_seed=5, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
        **kwargs)  # fmt: skip
    return engine, private, opt, criterion, loader


def _front_door_steps(private, opt, criterion, loader, steps: int) -> None:
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        criterion(private(x), y).backward()
        opt.step()


def test_the_front_door_projects_every_kth_step_and_checkpoints_the_count(tmp_path):
    from torch.utils.data import DataLoader

    from fastdp import PrivacyEngine
    from fastdp.engine.checkpoint import load_checkpoint, save_checkpoint

    engine, private, opt, criterion, loader = _front_door_run(0.5, project_every=3)
    assert opt.variant.project_every == 3
    _front_door_steps(private, opt, criterion, loader, 2)
    assert opt.variant.steps_since_projection == 2
    save_checkpoint(engine, tmp_path / "c.pt", module=private, optimizer=opt, data_loader=loader)
    engine2, private2, opt2, _, loader2 = _front_door_run(0.5, project_every=3)
    load_checkpoint(engine2, tmp_path / "c.pt", module=private2, optimizer=opt2, data_loader=loader2)
    assert opt2.variant.steps_since_projection == 2
    with pytest.raises(ValueError, match="project_every"):
        model = nn.Sequential(nn.Linear(10, 3))
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(_front_door_data(), 10), noise_multiplier=1.0,
                                     max_grad_norm=1.0, project_every=2)  # fmt: skip


def test_a_front_door_checkpoint_from_before_project_every_still_loads(tmp_path):
    """Written before ``project_every`` and the certified snapshot existed: no ``variant.project_every`` setting, no
    ``_certified_weight`` entries. It loads (the loaded weights stand in for the snapshot, re-proven)."""
    from fastdp.engine.checkpoint import load_checkpoint, save_checkpoint

    engine, private, opt, criterion, loader = _front_door_run(0.1)
    _front_door_steps(private, opt, criterion, loader, 1)
    save_checkpoint(engine, tmp_path / "c.pt", module=private, optimizer=opt, data_loader=loader)
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    state["settings"].pop("variant.project_every", None)
    for entries in (state["model"], state["model_signature"]["tensors"]):
        for key in [k for k in entries if k.endswith("_certified_weight")]:
            del entries[key]
    torch.save(state, tmp_path / "old.pt")
    engine2, private2, opt2, _, loader2 = _front_door_run(0.1)
    load_checkpoint(engine2, tmp_path / "old.pt", module=private2, optimizer=opt2, data_loader=loader2)
    for a, b in zip(private.parameters(), private2.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="project_every"):  # a changed setting is still refused
        state["settings"]["variant.project_every"] = 3
        torch.save(state, tmp_path / "other.pt")
        engine3, private3, opt3, _, loader3 = _front_door_run(0.1)
        load_checkpoint(engine3, tmp_path / "other.pt", module=private3, optimizer=opt3, data_loader=loader3)
