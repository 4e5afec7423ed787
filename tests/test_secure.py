"""Privacy randomness end to end: by default every privacy draw of a run (noise, Poisson sampling, JL tangents) comes
from the OS entropy source and never from a seeded generator; two default runs with one seed release different noise
and sample different batches; only --reproducible-privacy-seed makes them repeat (labelled NOT FOR RELEASE); the
split and the initialisation stay seeded by --seed (not privacy draws); --secure refuses anything not for release."""

import os
import random

import numpy as np
import pytest
import torch

from fastdp.algorithms.base import trainable_parameters
from fastdp.ops.noise import SECURE_DRAWS
from fastdp.train.trainer import TrainConfig, Trainer

PRIVATE = {
    "dpsgd": dict(),
    "jl": dict(accountant="pld", projections=10),
    "clipless": dict(model="lipschitz_mlp"),
    "weightclip": dict(model="weightclip_mlp"),
    "backprop": dict(),
}
BASE = dict(dataset="breast_cancer", epochs=1, batch_size=64, lr=0.1, hidden=16, noise_multiplier=1.0, quiet=True,
            progress=False)  # fmt: skip


def _config(variant: str, **overrides) -> TrainConfig:
    return TrainConfig(**{**BASE, "variant": variant, **PRIVATE[variant], **overrides})


def _released_noise(trainer: Trainer) -> list[torch.Tensor]:
    """The gradient one release puts on zero sums at step 0: pure noise (what the step would publish)."""
    params = trainable_parameters(trainer.model)
    trainer.variant.prepare(trainer.model)
    trainer.variant.release(trainer.model, [torch.zeros_like(p) for p in params], 0)
    return [p.grad.clone() for p in trainable_parameters(trainer.model)]


@pytest.mark.parametrize("variant", list(PRIVATE))
def test_one_seed_gives_different_noise_and_batches_unless_a_reproducible_privacy_seed_is_given(variant):
    for key in (None, 5):
        a = Trainer(_config(variant, reproducible_privacy_seed=key))
        b = Trainer(_config(variant, reproducible_privacy_seed=key))
        for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):  # init: seeded in both modes
            assert torch.equal(p, q)
        assert torch.equal(a.data.x_train, b.data.x_train)  # split: seeded in both modes
        noise_a, noise_b = _released_noise(a), _released_noise(b)
        same_noise = all(torch.equal(x, y) for x, y in zip(noise_a, noise_b, strict=True))
        same_batches = all(torch.equal(a.sampler.sample(), b.sampler.sample()) for _ in range(3))
        assert same_noise == same_batches == (key is not None), (variant, key)
        label = "os-entropy" if key is None else "reproducible (NOT FOR RELEASE)"
        assert a.variant.describe()["privacy_randomness"] == label


class _Forbidden:
    """Stands in for a seeded generator or a seeded draw function: any use fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"secure mode used the seeded draw {self.name}")

    def __getattr__(self, attr):
        raise AssertionError(f"secure mode used the seeded generator {self.name} (.{attr})")


_SEEDED_DRAWS = {
    torch: ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", "rand_like",
            "randn_like", "randint_like"),
    torch.Tensor: ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_",
                   "cauchy_"),
    np.random: ("rand", "randn", "random", "default_rng", "permutation", "choice", "binomial", "normal"),
    random: ("random", "randrange", "randint", "getrandbits", "shuffle", "sample", "gauss", "normalvariate"),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(PRIVATE))
def test_default_privacy_draws_come_from_os_urandom_and_never_from_seeded_generators(variant, monkeypatch, noise_draws):
    trainer = Trainer(_config(variant))
    # the seeded paths raise: torch/numpy/random draw functions, and the sampler's own seeded generator
    for owner, names in _SEEDED_DRAWS.items():
        for name in names:
            monkeypatch.setattr(owner, name, _Forbidden(f"{getattr(owner, '__name__', owner)}.{name}"))
    trainer.sampler.generator = _Forbidden("PoissonSampler.generator")
    # the OS entropy source, recorded: os.urandom (the sampler) and random's _urandom, behind secrets.randbits
    # (every noise key and counter: fastdp.privacy.rng.os_entropy_seed)
    sampler_bytes, key_bytes = [], []
    real_urandom, real_random_urandom = os.urandom, random._urandom
    monkeypatch.setattr(os, "urandom", lambda n: sampler_bytes.append(real_urandom(n)) or sampler_bytes[-1])
    monkeypatch.setattr(random, "_urandom", lambda n: key_bytes.append(real_random_urandom(n)) or key_bytes[-1])
    # every noise kernel call (noise and JL tangents), recorded
    draws = noise_draws
    draws.clear()  # from here on (building the trainer may draw, before the OS entropy source is recorded)
    global_state = torch.get_rng_state()
    result = trainer.run()

    steps = result["steps"]
    assert steps == len(trainer.sampler) and trainer.accountant.steps == steps
    # sampling: one os.urandom call of 8 bytes per example per step
    assert [len(b) for b in sampler_bytes] == [8 * trainer.data.x_train.shape[0]] * steps
    # noise: every kernel call keyed by two 63-bit values read from the OS entropy source, 4-draw sums; JL tangents:
    # one OS-entropy key per step (shared by the step's micro-batches), tangent j at counter j, 4-draw sums
    os_values = {int.from_bytes(b, "big") >> 1 for b in key_bytes if len(b) == 8}  # secrets.randbits(63)
    r = PRIVATE.get(variant, {}).get("projections", 0)
    noise = [(seed, offset) for seed, offset, _ in draws if offset in os_values]
    tangents = [(seed, offset) for seed, offset, _ in draws if offset not in os_values]
    assert all(num_draws == SECURE_DRAWS for *_, num_draws in draws)
    assert len(noise) == steps and all(seed in os_values for seed, _ in noise)
    assert len(set(noise)) == len(noise)  # never a key twice
    if variant == "jl":  # r tangents per step, one key per step; each drawn layer by layer, at its parameters' place
        # in the tangent's stream (tests/test_jl_memory.py: the values of the whole-model draw), so every (key, j)
        # comes once per layer
        per_tangent = {pair: tangents.count(pair) for pair in set(tangents)}
        assert len(per_tangent) == steps * r and len(set(per_tangent.values())) == 1
        assert {offset for _, offset in tangents} == set(range(r))
        assert len({seed for seed, _ in tangents}) == steps and all(seed in os_values for seed, _ in tangents)
    else:
        assert not tangents
    # nothing was drawn from the seeded global generator during training
    assert torch.equal(torch.get_rng_state(), global_state)
    assert result["privacy_randomness"] == "os-entropy"
    assert "OS entropy" in result["note_privacy_randomness"] and "seeded" in result["note_privacy_randomness"]


def test_shuffled_batches_need_a_reproducible_key_and_secure_refuses_it():
    with pytest.raises(ValueError, match="--shuffle is not for a private release"):
        Trainer(_config("dpsgd", shuffle=True))
    with pytest.raises(ValueError, match="--secure refuses what is not for release"):
        Trainer(_config("dpsgd", secure=True, reproducible_privacy_seed=1))
    with pytest.raises(ValueError, match="--secure refuses what is not for release"):
        Trainer(_config("dpsgd", secure=True, shuffle=True, reproducible_privacy_seed=1))
    result = Trainer(_config("dpsgd", shuffle=True, reproducible_privacy_seed=1)).run()  # an experiment: labelled
    assert (
        result["privacy_randomness"] == "reproducible (NOT FOR RELEASE)"
        and "NOT FOR RELEASE" in result["note_privacy_randomness"]
    )
    assert Trainer(_config("dpsgd", secure=True)).run()["privacy_randomness"] == "os-entropy"
