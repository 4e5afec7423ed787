"""The front door (fastdp.PrivacyEngine): Opacus' API over the variants, with the user's own model, data and loop."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fastdp import PrivacyEngine
from fastdp.algorithms import DPSGD, JL, Batch
from fastdp.algorithms.base import trainable_parameters
from fastdp.engine import DPLoss
from fastdp.engine.data import empty_like_batch
from fastdp.nn import UnsupportedLayerError

SEED = 7
DERIVED = (SEED * 0x9E3779B97F4A7C15 + 1) % 2**63  # the noise key the engine derives from reproducible_seed


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n=40, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _private(model, x, y, batch_size=10, lr=1.0, **kwargs):
    """(engine, model, optimizer, loader), or with ``grad_sample_mode="ghost"`` (engine, model, optimizer, criterion,
    loader): the engine, then what make_private returned."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    engine = PrivacyEngine(accountant=kwargs.pop("accountant", "rdp"))
    kwargs.setdefault("noise_multiplier", 0.8)
    kwargs.setdefault("max_grad_norm", 0.5)
    made = engine.make_private(module=model, optimizer=opt, data_loader=loader, reproducible_seed=SEED, **kwargs)
    return (engine, *made)


def _step(model, opt, x, y):
    """One step, its loss from fastdp's DP criterion (the user's own loss is refused), under the optimizer's
    loss_reduction."""
    opt.zero_grad()
    DPLoss(nn.functional.cross_entropy, model, opt.loss_reduction)(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_released_update_equals_the_variant_apis_for_the_same_batch_and_key(reduction):
    """Opacus' ghost-clipping idiom (make_private returns the criterion), its loss the mean or the sum."""
    x, y = _data()
    xb, yb = x[:9], y[:9]
    _, model, opt, criterion, _ = _private(_mlp(), x, y, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
                                           loss_reduction=reduction)  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = criterion(model(xb), yb)
    loss.backward()
    assert all(p.grad is None for p in model.parameters())  # one backward, no weight gradient formed by it
    opt.step()
    released = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]  # lr 1: the gradient
    reference = _mlp()
    variant = DPSGD(0.5, 0.8, 10 / 40, 40, reproducible_seed=DERIVED)
    variant.gradient(reference, Batch(xb, yb, torch.ones(9, dtype=torch.bool)), 0)
    scale = 10.0 if reduction == "sum" else 1.0  # "sum": the noisy sum (Opacus), not divided by q N
    for got, p in zip(released, reference.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad * scale, rtol=1e-5, atol=1e-6)
    assert opt.steps_taken == 1 and opt.accountant.steps == 1


def test_jl_through_the_front_door_equals_its_variant_api():
    x, y = _data()
    xb, yb = x[:8], y[:8]
    _, model, opt, _ = _private(_mlp(), x, y, variant="jl", projections=4, accountant="pld")
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, xb, yb)
    reference = _mlp()
    JL(0.5, 0.8, 10 / 40, 40, projections=4, reproducible_seed=DERIVED).gradient(
        reference, Batch(xb, yb, torch.ones(8, dtype=torch.bool)), 0
    )
    for b, p, r in zip(before, model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(b - p.detach(), r.grad, rtol=1e-5, atol=1e-6)
    assert opt.accountant.history == [(0.8, 0.25, 1, 4.0)]


def test_per_layer_clipping_equals_the_variant_api():
    x, y = _data()
    _, model, opt, _ = _private(_mlp(), x, y, clipping="per_layer", max_grad_norm=[0.3, 0.6])
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, x[:7], y[:7])
    reference = _mlp()
    DPSGD([0.3, 0.6], 0.8, 0.25, 40, reproducible_seed=DERIVED).gradient(
        reference, Batch(x[:7], y[:7], torch.ones(7, dtype=torch.bool)), 0
    )
    for b, p, r in zip(before, model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(b - p.detach(), r.grad, rtol=1e-5, atol=1e-6)


def test_an_opacus_style_script_trains_and_reports_epsilon_within_its_target():
    torch.manual_seed(0)
    x = torch.randn(600, 10)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(x, y), batch_size=60)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=4.0, target_delta=1e-4, epochs=4,
        max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
    )  # fmt: skip
    for _ in range(4):
        for xb, yb in loader:
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    epsilon = engine.get_epsilon(1e-4)
    assert optimizer.steps_taken == 40 and 3.5 < epsilon <= 4.0
    assert accuracy > 0.8, accuracy


class _Tokens(Dataset):
    """Hugging Face-style examples: dicts of input_ids, attention_mask and labels (-100 on padding)."""

    def __init__(self, n=30, seq=6, vocab=11, seed=2):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq), generator=gen)
        lengths = torch.randint(2, seq + 1, (n,), generator=gen)
        self.mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = torch.where(self.mask.bool(), self.ids, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class _TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.norm, self.head = nn.Embedding(vocab, dim), nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask):
        return self.head(self.norm(self.embed(input_ids)) * attention_mask.unsqueeze(-1))


def _token_losses(logits, labels):
    """Per-example loss: the mean over the example's own tokens (ignore_index -100), never over the batch's."""
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def test_dict_batches_with_padding_and_ignore_index_equal_the_variant_api():
    data = _Tokens()
    model = _TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, criterion, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=6), noise_multiplier=0.5,
        max_grad_norm=0.7, reproducible_seed=SEED, criterion=_token_losses, grad_sample_mode="ghost",
    )  # fmt: skip
    batch = next(b for b in loader if len(b["input_ids"]) >= 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    criterion(logits, batch["labels"]).backward()  # one loss per example: the mean over its own tokens
    opt.step()
    reference = _TinyLM()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    rows = torch.cat([ids, mask, labels], dim=1)  # the variant API's Batch.x is one tensor

    def loss_fn(out, idx):
        return _token_losses(out, labels[idx])

    class Packed(nn.Module):
        def forward(self, packed):
            t = ids.shape[1]
            return reference(packed[:, :t], packed[:, t : 2 * t])

    variant = DPSGD(0.7, 0.5, 6 / 30, 30, reproducible_seed=DERIVED, loss_fn=loss_fn)
    wrapped = Packed()
    wrapped.inner = reference
    variant.gradient(wrapped, Batch(rows, torch.arange(len(ids)), torch.ones(len(ids), dtype=torch.bool)), 0)
    for b, p, r in zip(before, model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(b - p.detach(), r.grad, rtol=1e-5, atol=1e-6)


def test_empty_poisson_batches_are_well_formed_and_still_release_noise():
    x, y = _data(n=200)
    engine, model, opt, loader = _private(_mlp(), x, y, batch_size=1)  # q = 0.005: most batches are empty
    sizes = []
    for xb, yb in loader:
        sizes.append(len(xb))
        assert xb.shape[1:] == (6,) and xb.dtype == torch.float32 and yb.dtype == torch.int64
        before = [p.detach().clone() for p in model.parameters()]
        _step(model, opt, xb, yb)
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))  # noise
    assert 0 in sizes and len(sizes) == 200 and opt.steps_taken == 200
    assert math.isfinite(engine.get_epsilon(1e-3))
    assert empty_like_batch({"a": torch.ones(3, 2), "s": ["x", "y", "z"]})["s"] == []


def test_the_loader_keeps_the_users_collate_fn_and_samples_with_the_batch_size_as_expectation():
    x, y = _data(n=400)
    calls = []

    def collate(examples):
        calls.append(len(examples))
        return torch.stack([e[0] for e in examples]), torch.stack([e[1] for e in examples])

    loader = DataLoader(TensorDataset(x, y), batch_size=40, collate_fn=collate)
    engine, model = PrivacyEngine(accountant="rdp"), _mlp()
    _, _, dp_loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)  # fmt: skip
    sizes = [len(b[0]) for _ in range(5) for b in dp_loader]
    assert dp_loader.sample_rate == 0.1 and len(dp_loader) == 10 and calls
    assert abs(sum(sizes) / len(sizes) - 40) < 4 * math.sqrt(40 * 0.9 / len(sizes))


def test_refusals():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=10)

    def make(engine=None, model=None, **kwargs):
        model = model or _mlp()
        args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                    noise_multiplier=1.0, max_grad_norm=1.0)  # fmt: skip
        args.update(kwargs)
        return (engine or PrivacyEngine(accountant="rdp")).make_private(**args)

    with pytest.raises(ValueError, match="noise_generator is refused"):
        make(noise_generator=torch.Generator())
    with pytest.raises(ValueError, match="poisson_sampling=False is refused"):
        make(poisson_sampling=False)
    with pytest.raises(ValueError, match="clipping must be one of"):
        make(clipping="adaptive")
    with pytest.raises(ValueError, match="does not clip per-example gradients"):
        make(variant="clipless")
    with pytest.raises(ValueError, match="variant must be one of"):
        make(variant="adaptive")

    class DifferentiallyPrivateDistributedDataParallel(nn.Module):  # Opacus' DPDDP, by name
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    with pytest.raises(ValueError, match="wrapped in DifferentiallyPrivateDistributedDataParallel"):
        make(model=DifferentiallyPrivateDistributedDataParallel(_mlp()))
    with pytest.raises(ValueError, match="accounted by PLD only"):
        make(variant="jl")
    with pytest.raises(ValueError, match="clipping='per_layer' is for variant 'dpsgd'"):
        make(engine=PrivacyEngine(accountant="pld"), variant="jl", clipping="per_layer", max_grad_norm=[1.0, 1.0])
    with pytest.raises(ValueError, match="secure_mode refuses reproducible_seed"):
        make(engine=PrivacyEngine(accountant="rdp", secure_mode=True), reproducible_seed=3)
    with pytest.raises(UnsupportedLayerError, match="BatchNorm1d"):
        make(model=nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
    model = _mlp()
    with pytest.raises(ValueError, match="delta=0.1 is >= 1/N"):
        PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            target_epsilon=1.0, target_delta=0.1, epochs=1, max_grad_norm=1.0)  # fmt: skip
    model = _mlp()
    with pytest.raises(ValueError, match="not in the optimizer"):
        PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0)  # fmt: skip
    with pytest.warns(UserWarning, match="PLD accountant"):
        assert PrivacyEngine().accountant_mechanism == "pld"


class _Centred(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        return self.inner(x - x.mean(0))  # one example moves every other's input


def test_a_model_that_mixes_examples_is_refused_before_anything_is_released():
    x, y = _data()
    _, model, opt, _ = _private(_Centred(), x, y)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedLayerError, match="one example"):
        _step(model, opt, x[:6], y[:6])
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert opt.accountant.steps == 0


class _DictModel(nn.Module):
    """``model(features=..., mask=...)``, Hugging Face style; ``mix`` makes one example move the others' outputs
    through the keyword argument that is not the first tensor."""

    def __init__(self, mix: bool):
        super().__init__()
        self.inner, self.mix = _mlp(), mix

    def forward(self, features, mask):
        scale = mask.float().mean(0) if self.mix else mask.float()
        return self.inner(features * scale.unsqueeze(-1) if not self.mix else features * scale)


@pytest.mark.parametrize("variant", ["dpsgd", "backprop"])
def test_keyword_inputs_are_probed_too(variant):
    x, y = _data()
    mask = torch.ones(len(x), dtype=torch.long)
    mask[1::3] = 0
    bounds = (
        {"max_grad_norm": 0.5} if variant == "dpsgd" else {"max_grad_norm": None, "input_clip": 1.0, "grad_clip": 1.0}
    )
    for mix in (False, True):
        _, model, opt, _ = _private(_DictModel(mix), x, y, variant=variant, **bounds)
        opt.zero_grad()
        DPLoss(nn.functional.cross_entropy, model)(model(features=x[:6], mask=mask[:6]), y[:6]).backward()
        if not mix:
            opt.step()
            assert opt.accountant.steps == 1
            continue
        with pytest.raises(UnsupportedLayerError, match="one example"):
            opt.step()
        assert opt.accountant.steps == 0


def test_leave_one_out_change_of_the_noiseless_release_is_within_c_for_adversarial_examples():
    """The bound through the front door: noiseless (sigma 0) releases of a batch with and without one adversarial
    example (huge, cancelling at large magnitude) differ by at most C / b, in each reduction."""
    clip = 0.5
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(8, 6, generator=gen)
    labels = torch.randint(0, 3, (8,), generator=gen)
    for attack in (1e6 * base[0], torch.zeros(6), 3e5 * torch.ones(6)):
        x = base.clone()
        x[0] = attack
        updates = []
        for rows in (slice(0, 8), slice(1, 8)):
            _, model, opt, _ = _private(_mlp(), base, labels, batch_size=8, noise_multiplier=0.0, max_grad_norm=clip)
            before = [p.detach().clone() for p in model.parameters()]
            _step(model, opt, x[rows], labels[rows])
            updates.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(),
                                                                                  strict=True)]))  # fmt: skip
        change = (updates[0] - updates[1]).norm().item() * 8  # times the expected batch size
        assert change <= clip * (1 + 1e-5), (attack[:2], change)


def test_virtual_steps_accumulate_and_release_once():
    """signal_skip_step (Opacus' BatchMemoryManager protocol): two physical batches, one release equal to the
    unsplit batch's."""
    x, y = _data()
    _, model, opt, _ = _private(_mlp(), x, y)
    before = [p.detach().clone() for p in model.parameters()]
    opt.signal_skip_step(True)
    _step(model, opt, x[:5], y[:5])
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)) and opt.steps_taken == 0
    _step(model, opt, x[5:9], y[5:9])
    _, whole, whole_opt, _ = _private(_mlp(), x, y)
    _step(whole, whole_opt, x[:9], y[:9])
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert trainable_parameters(model._module)


def test_the_readme_quick_start_runs():
    """The README's front-door example, as printed there."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## Quick start.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the documented example itself
    assert 0 < namespace["engine"].get_epsilon(1e-5) <= 3.0


def test_the_batch_memory_manager_gives_the_update_of_the_unsplit_logical_batch():
    from fastdp.engine import BatchMemoryManager

    x, y = _data(n=60)
    _, model, opt, loader = _private(_mlp(), x, y, batch_size=30)
    _, whole, whole_opt, _ = _private(_mlp(), x, y, batch_size=30)
    batch = next(iter(loader))
    loader_once = [batch]
    with BatchMemoryManager(data_loader=loader_once, max_physical_batch_size=7, optimizer=opt) as batches:
        chunks = 0
        for xb, yb in batches:
            assert len(xb) <= 7
            chunks += 1
            _step(model, opt, xb, yb)
    _step(whole, whole_opt, *batch)
    assert chunks == max(1, -(-len(batch[0]) // 7)) and opt.steps_taken == 1 and opt.accountant.steps == 1
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_plain_mean_loss_is_refused_and_the_dp_criterions_mean_trains_under_autocast_too():
    """A plain batch mean rounds the 1/n into every example's output gradient (in bf16 under autocast: ~2^-8 each), and
    n depends on every example: refused under either loss_reduction, in fp32 and in bf16, before anything is
    released. The DP criterion seeds each example's loss with 1 (no 1/n), so its bf16 backward is the summed loss's: it
    trains, and under "mean" p.grad is the noisy sum of "sum" divided by the expected batch size (10), the same key."""
    x, y = _data()
    for autocast, reduction in ((False, "mean"), (True, "mean"), (True, "sum")):
        _, model, opt, _ = _private(_mlp(), x, y, loss_reduction=reduction)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x[:6])
        nn.functional.cross_entropy(out.float(), y[:6]).backward()
        with pytest.raises(ValueError, match="loss must come from fastdp's DP criterion"):
            opt.step()
        assert opt.accountant.steps == 0
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    grads = {}
    for reduction in ("mean", "sum"):
        _, model, opt, _ = _private(_mlp(), x, y, loss_reduction=reduction)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[:6])
        DPLoss(nn.functional.cross_entropy, model, reduction)(out.float(), y[:6]).backward()
        opt.step()
        assert opt.accountant.steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())
        grads[reduction] = [p.grad.detach().clone() for p in model.parameters()]
    for mean, total in zip(grads["mean"], grads["sum"], strict=True):
        torch.testing.assert_close(mean * 10, total)


def test_a_learning_rate_scheduler_drives_the_private_optimizer():
    x, y = _data()
    _, model, opt, loader = _private(_mlp(), x, y, lr=0.8)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for xb, yb in loader:
        _step(model, opt, xb, yb)
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.8 * 0.5 ** len(loader)) and opt.steps_taken == len(loader)


class _ModelWithLoss(nn.Module):
    """Hugging Face style: ``model(features=..., labels=...)`` returns a dict with its own loss, a mean over the whole
    batch's tokens (labels -100 ignored), which is not a sum of per-example losses."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, features, labels=None):
        logits = self.inner(features)  # [B, T, 3]: T "tokens" per example
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def test_a_loss_the_model_computed_itself_is_refused_and_one_from_its_logits_trains():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 4, 6, generator=gen), torch.randint(0, 3, (40, 4), generator=gen)
    y[::3, 1:] = -100  # padding: examples with fewer tokens
    _, model, opt, _ = _private(_ModelWithLoss(), x, y)
    opt.zero_grad()
    model(features=x[:8], labels=y[:8])["loss"].backward()
    with pytest.raises(ValueError, match="computed by the model itself"):
        opt.step()
    assert opt.accountant.steps == 0
    opt.zero_grad()
    out = model(features=x[:8], labels=y[:8])  # labels passed, its loss only logged: fine
    loss = DPLoss(_token_losses, model)(out["logits"], y[:8])  # each example's own token mean, then the mean
    loss.backward()
    opt.step()
    assert opt.accountant.steps == 1 and out["loss"].item() > 0


def test_opacus_get_privacy_spent_reports_the_engines_epsilon_with_the_truncation_bound():
    engine, model, opt, _ = _private(_mlp(), *_data())
    x, y = _data()
    for _ in range(3):
        _step(model, opt, x[:8], y[:8])
    epsilon, best_alpha = engine.accountant.get_privacy_spent(delta=1e-3)
    assert best_alpha is None and epsilon == engine.get_epsilon(1e-3) == engine.accountant.get_epsilon(1e-3)
    spent = engine.accountant.truncation(3)
    assert spent > 0  # the truncation bound is taken off delta, whichever way epsilon is asked for
    from fastdp.privacy.accounting import PrivacyAccountant

    plain = PrivacyAccountant("rdp")
    plain.load_state_dict(engine.accountant.state_dict())
    assert epsilon == plain.get_epsilon(1e-3 - spent) >= plain.get_epsilon(1e-3)
