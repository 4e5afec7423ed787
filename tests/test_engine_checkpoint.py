"""Front-door checkpoints (fastdp.engine.checkpoint): a resumed run equals the uninterrupted one; other privacy
settings, a used engine, another model or optimizer are refused; no OS-entropy key reaches the file."""

import io
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastdp.privacy.rng as rng
from fastdp import PrivacyEngine
from fastdp.engine import BatchMemoryManager
from fastdp.engine.checkpoint import load_checkpoint, save_checkpoint

SEED = 11
DELTA = 1e-3
OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
}


def _mlp(hidden=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def _data(n=40):
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def _engine(*, seed=SEED, optimizer="sgd-momentum", model=None, n=40, batch_size=10, accountant="rdp", **kwargs):
    model = model if model is not None else _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accountant="prv" says it is PLD
        engine = PrivacyEngine(accountant=accountant)
    kwargs.setdefault("noise_multiplier", 0.8)
    kwargs.setdefault("max_grad_norm", 0.5)
    loader = DataLoader(_data(n), batch_size=batch_size)
    private, opt, criterion, loader = engine.make_private(
        module=model, optimizer=OPTIMIZERS[optimizer](model.parameters()), data_loader=loader,
        reproducible_seed=seed, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost", **kwargs)  # fmt: skip
    return engine, private, opt, criterion, loader


def _batches(loader):
    while True:  # across epochs: the sampler's draws continue
        yield from loader


def _train(private, opt, criterion, batches, steps):
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        criterion(private(x), y).backward()
        opt.step()


def _params(private):
    return [p.detach().clone() for p in private.parameters()]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_checkpoint_and_resume_equal_an_uninterrupted_run(tmp_path, optimizer):
    k, m = 3, 4  # m crosses an epoch boundary (4 steps per epoch)
    engine, private, opt, criterion, loader = _engine(optimizer=optimizer)
    batches = _batches(loader)
    _train(private, opt, criterion, batches, k)
    path = tmp_path / "run.pt"
    save_checkpoint(engine, path, module=private, optimizer=opt, data_loader=loader, extra={"epoch": 0, "k": k})
    _train(private, opt, criterion, batches, m)  # the uninterrupted run goes on
    uninterrupted, epsilon = _params(private), engine.get_epsilon(DELTA)

    # a new process: make_private again, then load
    engine2, private2, opt2, criterion2, loader2 = _engine(optimizer=optimizer)
    extra = load_checkpoint(engine2, path, module=private2, optimizer=opt2, data_loader=loader2)
    assert extra == {"epoch": 0, "k": k}
    assert opt2.steps_taken == k and engine2.accountant.steps == k
    assert opt2.variant.keys.last_released == k - 1  # a reproducible key refuses the steps already released
    saved = torch.load(path, weights_only=True)["optimizer"]["optimizer"]["state"]
    restored = opt2.original_optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys() and len(saved) == 4
    for i in saved:  # momentum buffers / Adam's moments and step counts
        assert saved[i].keys() == restored[i].keys()
        for name in saved[i]:
            assert torch.equal(torch.as_tensor(saved[i][name]), torch.as_tensor(restored[i][name])), name
    _train(private2, opt2, criterion2, _batches(loader2), m)
    for a, b in zip(uninterrupted, _params(private2), strict=True):
        assert torch.equal(a, b)  # bitwise
    assert engine2.get_epsilon(DELTA) == epsilon
    assert engine2.accountant.history == engine.accountant.history


def _os_entropy_keys(monkeypatch) -> list[int]:
    drawn: list[int] = []
    original = rng.os_entropy_seed

    def recording() -> int:
        value = original()
        drawn.append(value)
        return value

    monkeypatch.setattr(rng, "os_entropy_seed", recording)
    return drawn


def _ints_and_tensors(value, ints: list, tensors: list) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _ints_and_tensors(k, ints, tensors)
            _ints_and_tensors(v, ints, tensors)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _ints_and_tensors(v, ints, tensors)
    elif isinstance(value, torch.Tensor):
        tensors.append(value)
    elif isinstance(value, int):
        ints.append(value)


@pytest.mark.parametrize("variant", ["dpsgd", "jl"])
def test_os_entropy_resume_continues_the_accountant_and_writes_no_key(tmp_path, monkeypatch, variant):
    drawn = _os_entropy_keys(monkeypatch)
    kwargs = {"variant": variant, "accountant": "pld", "projections": 10} if variant == "jl" else {}
    engine, private, opt, criterion, loader = _engine(seed=None, **kwargs)
    batches = _batches(loader)
    _train(private, opt, criterion, batches, 3)
    assert len(drawn) >= 6  # two noise key values per release (and JL's tangent keys)
    path = tmp_path / "run.pt"
    save_checkpoint(engine, path, module=private, optimizer=opt, data_loader=loader)
    at_save = _params(private)

    state = torch.load(path, weights_only=True)
    assert state["noise_keys"] == {"mode": "os-entropy", "last_released": 2}
    assert state["sampler"] == {"kind": "poisson"}  # OS-entropy sampling: nothing to save, fresh draws on resume
    ints, tensors = [], []
    _ints_and_tensors(state, ints, tensors)
    raw = path.read_bytes()
    for key in drawn:
        assert key not in ints
        assert key.to_bytes(8, "little") not in raw and str(key).encode() not in raw
        for t in tensors:
            assert key.to_bytes(8, "little") not in t.numpy().tobytes()

    engine2, private2, opt2, criterion2, loader2 = _engine(seed=None, **kwargs)
    load_checkpoint(engine2, path, module=private2, optimizer=opt2, data_loader=loader2)
    for a, b in zip(at_save, _params(private2), strict=True):
        assert torch.equal(a, b)
    assert opt2.steps_taken == 3 and engine2.accountant.steps == 3
    _train(private2, opt2, criterion2, _batches(loader2), 2)
    assert opt2.steps_taken == 5 and engine2.accountant.steps == 5

    uninterrupted, private3, opt3, criterion3, loader3 = _engine(seed=None, **kwargs)
    _train(private3, opt3, criterion3, _batches(loader3), 5)
    assert engine2.get_epsilon(DELTA) == uninterrupted.get_epsilon(DELTA)
    assert engine2.get_epsilon(DELTA) > engine.get_epsilon(DELTA)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    engine, private, opt, criterion, loader = _engine()
    _train(private, opt, criterion, _batches(loader), 2)
    path = tmp_path_factory.mktemp("ckpt") / "run.pt"
    save_checkpoint(engine, path, module=private, optimizer=opt, data_loader=loader)
    return path


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"noise_multiplier": 1.0}, "variant.noise_multiplier: 0.8 in the checkpoint, 1.0 here"),
        ({"max_grad_norm": 1.0}, "variant.clip_norm: 0.5 in the checkpoint, 1.0 here"),
        ({"batch_size": 20}, "variant.sample_rate: 0.25 in the checkpoint, 0.5 here"),
        ({"accountant": "pld"}, "accountant: 'rdp' in the checkpoint, 'pld' here"),
        ({"n": 50}, "num_examples: 40 in the checkpoint, 50 here"),
        ({"loss_reduction": "sum"}, "loss_reduction: 'mean' in the checkpoint, 'sum' here"),
        ({"clipping": "per_layer", "max_grad_norm": [0.5, 0.5]}, "clip_norm: 0.5 in the checkpoint, [0.5, 0.5] here"),
        ({"seed": None}, "privacy_randomness: 'reproducible (NOT FOR RELEASE)' in the checkpoint, 'os-entropy'"),
        ({"variant": "jl", "accountant": "pld"}, "variant: 'dpsgd' in the checkpoint, 'jl' here"),
    ],
)
def test_other_privacy_settings_are_refused_naming_each(saved, kwargs, named):
    engine, private, opt, _, loader = _engine(**kwargs)
    before = _params(private)
    with pytest.raises(ValueError, match="other privacy settings") as info:
        load_checkpoint(engine, saved, module=private, optimizer=opt, data_loader=loader)
    assert named in str(info.value) and "epsilon" in str(info.value) and "new engine and accountant" in str(info.value)
    assert engine.accountant.steps == 0 and opt.steps_taken == 0  # nothing loaded
    assert all(torch.equal(a, b) for a, b in zip(before, _params(private), strict=True))


def test_two_differences_are_both_named(saved):
    engine, private, opt, _, loader = _engine(noise_multiplier=1.5, n=60)
    with pytest.raises(ValueError) as info:
        load_checkpoint(engine, saved, module=private, optimizer=opt, data_loader=loader)
    assert "variant.noise_multiplier: 0.8 in the checkpoint, 1.5 here" in str(info.value)
    assert "num_examples: 40 in the checkpoint, 60 here" in str(info.value)


def test_an_engine_that_already_stepped_is_refused(saved):
    engine, private, opt, criterion, loader = _engine()
    _train(private, opt, criterion, _batches(loader), 1)
    with pytest.raises(ValueError, match=r"already released 1 step"):
        load_checkpoint(engine, saved, module=private, optimizer=opt, data_loader=loader)
    assert engine.accountant.steps == 1 and opt.steps_taken == 1


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (lambda: _mlp(hidden=9), r"0.weight: shape \(8, 6\) torch.float32 in the checkpoint, \(9, 6\)"),
        (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)),
         "entries only here: 4.weight, 4.bias"),
        (lambda: _mlp().double(), r"torch.float32 in the checkpoint, \(8, 6\) torch.float64 here"),
    ],
)  # fmt: skip
def test_another_model_is_refused(saved, model, named):
    engine, private, opt, _, loader = _engine(model=model())
    with pytest.raises(ValueError, match="of another model") as info:
        load_checkpoint(engine, saved, module=private, optimizer=opt, data_loader=loader)
    assert re.search(named, str(info.value)), str(info.value)
    assert engine.accountant.steps == 0


def test_a_frozen_parameter_makes_another_model(saved):
    model = _mlp()
    model[2].bias.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable parameters"):
        engine, private, opt, _, loader = _engine(model=model)
        load_checkpoint(engine, saved, module=private, optimizer=opt, data_loader=loader)


def test_another_optimizer_class_is_refused(saved):
    engine, private, opt, _, loader = _engine(optimizer="adam")
    with pytest.raises(ValueError, match="state of a SGD optimizer, but this optimizer is a Adam"):
        load_checkpoint(engine, saved, module=private, optimizer=opt, data_loader=loader)


def test_a_reproducible_run_needs_its_loader_and_another_engines_objects_are_refused(saved, tmp_path):
    engine, private, opt, _, loader = _engine()
    with pytest.raises(ValueError, match="pass data_loader="):
        save_checkpoint(engine, tmp_path / "x.pt", module=private, optimizer=opt)
    with pytest.raises(ValueError, match="pass data_loader="):
        load_checkpoint(engine, saved, module=private, optimizer=opt)
    other, private2, opt2, _, loader2 = _engine()
    with pytest.raises(ValueError, match="module is not the model"):
        save_checkpoint(engine, tmp_path / "x.pt", module=private2, optimizer=opt, data_loader=loader)
    with pytest.raises(ValueError, match="optimizer is not the one"):
        load_checkpoint(engine, saved, module=private, optimizer=opt2, data_loader=loader)
    with pytest.raises(ValueError, match="not the DPDataLoader"):
        save_checkpoint(engine, tmp_path / "x.pt", module=private, optimizer=opt, data_loader=DataLoader(_data()))
    assert not (tmp_path / "x.pt").exists()


def test_saving_between_the_physical_batches_of_a_logical_batch_is_refused(tmp_path):
    engine, private, opt, criterion, loader = _engine(seed=None, batch_size=20)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as physical:
        for x, y in physical:
            opt.zero_grad()
            criterion(private(x), y).backward()
            opt.step()
            if opt._sums is not None:  # a skipped (virtual) step: the logical batch is not released yet
                with pytest.raises(ValueError, match="logical batch not yet released"):
                    save_checkpoint(engine, tmp_path / "x.pt", module=private, optimizer=opt)
                break
        else:
            pytest.fail("no logical batch was split")


def test_extra_must_be_plain_and_goes_to_file_objects(tmp_path):
    engine, private, opt, _, loader = _engine()
    with pytest.raises(ValueError, match="plain containers"):
        save_checkpoint(engine, tmp_path / "x.pt", module=private, optimizer=opt, data_loader=loader,
                        extra={"model": nn.Linear(2, 2)})  # fmt: skip
    with pytest.raises(ValueError, match="both hold epoch"):
        save_checkpoint(engine, tmp_path / "x.pt", module=private, optimizer=opt, data_loader=loader,
                        extra={"epoch": 1}, checkpoint_dict={"epoch": 2})  # fmt: skip
    buffer = io.BytesIO()
    rng_state = torch.get_rng_state()
    save_checkpoint(engine, buffer, module=private, optimizer=opt, data_loader=loader,
                    checkpoint_dict={"epoch": 2}, extra={"rng": rng_state, "lr": [0.1, math.inf]})  # fmt: skip
    buffer.seek(0)
    engine2, private2, opt2, _, loader2 = _engine()
    extra = load_checkpoint(engine2, buffer, module=private2, optimizer=opt2, data_loader=loader2)
    assert extra["epoch"] == 2 and extra["lr"] == [0.1, math.inf] and torch.equal(extra["rng"], rng_state)


def test_a_foreign_file_is_refused(tmp_path):
    engine, private, opt, _, loader = _engine()
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a fastdp engine checkpoint"):
        load_checkpoint(engine, tmp_path / "foreign.pt", module=private, optimizer=opt, data_loader=loader)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(engine, tmp_path / "absent.pt", module=private, optimizer=opt, data_loader=loader)


@pytest.mark.parametrize("variant", ["clipless", "backprop"])
def test_the_engines_own_methods_resume_every_variant_bitwise_opacus_style(tmp_path, variant):
    """``engine.save_checkpoint(path=..., module=..., optimizer=...)`` as Opacus spells it, for the variants whose
    step is taken from the output's gradient too."""
    from fastdp.train.models import build_model

    def model():
        torch.manual_seed(0)
        if variant == "clipless":
            return build_model("lipschitz_mlp", (6,), 3, hidden=8, depth=2, input_bound=2.0)
        return _mlp()

    bounds = {"input_clip": 1.0, "grad_clip": 1.0} if variant == "backprop" else {}
    kwargs = dict(variant=variant, max_grad_norm=None, **bounds)
    engine, private, opt, criterion, loader = _engine(model=model(), **kwargs)
    batches = _batches(loader)
    _train(private, opt, criterion, batches, 2)
    engine.save_checkpoint(path=tmp_path / "run.pt", module=private, optimizer=opt, data_loader=loader)
    _train(private, opt, criterion, batches, 3)
    engine2, private2, opt2, criterion2, loader2 = _engine(model=model(), **kwargs)
    engine2.load_checkpoint(path=tmp_path / "run.pt", module=private2, optimizer=opt2, data_loader=loader2)
    _train(private2, opt2, criterion2, _batches(loader2), 3)
    for a, b in zip(_params(private), _params(private2), strict=True):
        assert torch.equal(a, b)
    assert engine2.get_epsilon(DELTA) == engine.get_epsilon(DELTA)
