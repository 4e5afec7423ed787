"""Data-parallel DP training (``fastdp.engine.distributed``) on 2 CPU processes with gloo: the same update as one
process (every variant), the noise added once (std sigma C / (qN), OS-entropy keys included), bad configurations
refused, and ``fastdp train --nproc 2`` end to end.

One group of 2 processes (``torch.multiprocessing.spawn``) runs every scenario once (module fixture); the tests check
what each rank recorded against single-process runs made here."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastdp.algorithms import DPSGD, Batch
from fastdp.engine.distributed import DataParallel
from fastdp.privacy.sampling import micro_batches
from fastdp.train.cli import _without_nproc, main
from fastdp.train.trainer import TrainConfig, Trainer
from tests.test_trainer import FAST as TRAINER_FAST
from tests.variants import make_variant, small_model

WORLD = 2
N, FEATURES, CLASSES, ROWS = 20_000, 12, 3, 96
# runs are compared with one process: privacy draws keyed by a reproducible seed (NOT FOR RELEASE, as the trainer
# tests' settings); the default, OS entropy, is the os_entropy_run scenario
FAST = {**TRAINER_FAST, "epochs": 1}
RUNS = {  # trainer scenarios, each also run in one process here
    "dpsgd": dict(variant="dpsgd", noise_multiplier=1.0, **FAST),
    "dpsgd_padded": dict(variant="dpsgd", noise_multiplier=1.0, pad=True, micro_batch=16, **FAST),
    "nonprivate": dict(variant="nonprivate", micro_batch=16, **FAST),
    # the ranks count the steps since the last projection alike: projected after the 3rd and 6th of 7 steps
    # (a small learning rate: between projections the noise follows the drift, which follows the noise)
    "clipless_every3": dict(
        {**FAST, "lr": 0.01}, variant="clipless", model="lipschitz_mlp", noise_multiplier=1.0, project_every=3
    ),
}
VARIANT_NAMES = ["dpsgd", "dpsgd-reference", "jl", "clipless", "weightclip", "backprop", "nonprivate"]
SIGMA, Q, NOISE_N = 2.0, 0.1, 10_000  # the noise scenario: std sigma * C / (q N) = 0.002


def _variant(name: str):
    return make_variant(name, 200, N)


def _model(name: str) -> nn.Module:
    return small_model(name, FEATURES, CLASSES)


def _batch(rows: int) -> Batch:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, FEATURES, generator=gen) * 2
    return Batch(x, torch.randint(0, CLASSES, (rows,), generator=gen), torch.ones(rows, dtype=torch.bool))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------- the 2-process group


def _scenario_trainers(rank: int, tmp: Path) -> dict:
    out = {}
    for name, config in RUNS.items():
        trainer = Trainer(
            TrainConfig(**config, checkpoint=str(tmp / f"{name}.pt"), out=str(tmp / f"{name}{rank}.json"))
        )
        result = trainer.run()
        out[name] = {"params": [p.detach().clone() for p in trainer.model.parameters()], "epsilon": result["epsilon"],
                     "steps": result["steps"], "history": result["history"]}  # fmt: skip
    return out


def _scenario_resume(rank: int, tmp: Path) -> dict:
    """A 2-process run resumed from its own checkpoint (rank 0 reads it and sends it) to a second epoch."""
    trainer = Trainer(TrainConfig(**{**RUNS["dpsgd"], "epochs": 2}, checkpoint=str(tmp / "dpsgd.pt"), resume=True))
    result = trainer.run()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "epsilon": result["epsilon"],
            "steps": result["steps"]}  # fmt: skip


def _scenario_variants(rank: int, tmp: Path) -> dict:
    """Direct calls: the full batch in one process vs its shards (strided in micro-batches of 16, or all on rank 0 and
    none on rank 1) with the sums all-reduced before the release."""
    parallel, full, out = DataParallel(), _batch(ROWS), {}
    for name in VARIANT_NAMES:
        reference_model = _model(name)
        reference_loss = _variant(name).gradient(reference_model, full, step=3)
        for split in ("strided", "all_on_rank0"):
            if split == "strided":
                rows = torch.arange(ROWS)[rank::WORLD]
                shard = [Batch(full.x[i], full.y[i], m) for i, m in micro_batches(rows, full.mask[rows], 16)]
            else:
                rows = torch.arange(ROWS) if rank == 0 else torch.arange(0)
                shard = Batch(full.x[rows], full.y[rows], full.mask[rows])
            model = _model(name)
            loss = parallel.gradient(_variant(name), model, shard, 3, os_entropy=False)
            out[name, split] = (_grads(reference_model), reference_loss, _grads(model), loss)
    return out


def _scenario_noise(rank: int, tmp: Path) -> dict:
    """All rows padding on both ranks: the released gradient is pure noise."""
    parallel, out = DataParallel(), {}
    empty = Batch(torch.zeros(64, 200), torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.bool))
    for case, key, broadcast in (("seeded", 3, False), ("secure", None, True), ("secure_unshared", None, False)):
        torch.manual_seed(0)
        model = nn.Linear(200, 250)
        parallel.gradient(DPSGD(1.0, SIGMA, Q, NOISE_N, reproducible_seed=key), model, empty, 5, os_entropy=broadcast)
        out[case] = torch.cat([g.flatten() for g in _grads(model)])
    torch.manual_seed(0)
    model = nn.Linear(200, 250)
    DPSGD(1.0, SIGMA, Q, NOISE_N, reproducible_seed=3).gradient(model, empty, 5)  # one process, same key and step
    out["single"] = torch.cat([g.flatten() for g in _grads(model)])
    return out


def _scenario_jl_tangents(rank: int, tmp: Path) -> dict:
    """OS-entropy JL on two ranks' shards (micro-batches of 16): the tangent keys every rank used, per step."""
    parallel, full = DataParallel(), _batch(ROWS)
    variant, model, used = make_variant("jl", 200, N, reproducible_seed=None), _model("jl"), []
    real = variant.keys.tangent_key
    variant.keys.tangent_key = lambda step, r: used.append((step, *real(step, r))) or used[-1][1:]
    rows = torch.arange(ROWS)[rank::WORLD]
    for step in (0, 1):
        shard = [Batch(full.x[i], full.y[i], m) for i, m in micro_batches(rows, full.mask[rows], 16)]
        parallel.gradient(variant, model, shard, step, os_entropy=True)
    return {"used": used}


def _scenario_secure_run(rank: int, tmp: Path) -> dict:
    """Default keys (OS entropy) end to end: rank 0's samples and released gradients are shared, so the ranks stay
    identical (the trainer checks that bitwise every epoch)."""
    trainer = Trainer(TrainConfig(**{**RUNS["dpsgd"], "reproducible_privacy_seed": None}))
    result = trainer.run()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "steps": result["steps"],
            "epsilon": result["epsilon"]}  # fmt: skip


def _scenario_epsilon_resume(rank: int, tmp: Path) -> dict:
    """An --epsilon run resumed with more epochs on 2 processes: rank 0 reads the checkpoint's sigma and sends it."""
    base = {**RUNS["dpsgd"], "noise_multiplier": None, "epsilon": 3.0}
    Trainer(TrainConfig(**base, checkpoint=str(tmp / "epsilon.pt"))).run()
    result = Trainer(TrainConfig(**{**base, "epochs": 2}, checkpoint=str(tmp / "epsilon.pt"), resume=True)).run()
    return {"steps": result["steps"], "epsilon": result["epsilon"],
            "sigma": result["variant_config"]["noise_multiplier"]}  # fmt: skip


def _scenario_mismatched_seed(rank: int, tmp: Path) -> dict:
    Trainer(TrainConfig(**{**RUNS["dpsgd"], "seed": rank}))
    return {}


def _scenario_resume_other_world(rank: int, tmp: Path) -> dict:
    """A checkpoint written by one process (made by the fixture) resumed on 2."""
    Trainer(TrainConfig(**{**RUNS["dpsgd"], "epochs": 2}, checkpoint=str(tmp / "single.pt"), resume=True)).run()
    return {}


SCENARIOS = {
    "trainers": _scenario_trainers,
    "resume": _scenario_resume,
    "variants": _scenario_variants,
    "noise": _scenario_noise,
    "secure_run": _scenario_secure_run,
    "jl_tangents": _scenario_jl_tangents,
    "epsilon_resume": _scenario_epsilon_resume,
    "mismatched_seed": _scenario_mismatched_seed,
    "resume_other_world": _scenario_resume_other_world,
}


def _worker(rank: int, tmp: str) -> None:
    tmp = Path(tmp)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    results = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = ("ok", scenario(rank, tmp))
            except Exception as exc:  # noqa: BLE001 - recorded for the test that checks this scenario
                results[name] = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    finally:
        torch.save(results, tmp / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """{rank: {scenario: ("ok", result) or ("error", message, traceback)}} from one 2-process gloo group."""
    tmp = tmp_path_factory.mktemp("distributed")
    Trainer(TrainConfig(**RUNS["dpsgd"], checkpoint=str(tmp / "single.pt"))).run()
    torch.multiprocessing.spawn(_worker, args=(str(tmp),), nprocs=WORLD, join=True)
    return tmp, {rank: torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)}


def _ok(group, scenario: str) -> list:
    _, results = group
    outcomes = [results[rank][scenario] for rank in range(WORLD)]
    for rank, outcome in enumerate(outcomes):
        assert outcome[0] == "ok", f"rank {rank}, scenario {scenario}: {outcome[2]}"
    return [outcome[1] for outcome in outcomes]


def _error(group, scenario: str) -> list[str]:
    _, results = group
    outcomes = [results[rank][scenario] for rank in range(WORLD)]
    assert all(outcome[0] == "error" for outcome in outcomes), f"{scenario} was not refused on every rank"
    return [outcome[1] for outcome in outcomes]


# ------------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("run", list(RUNS))
def test_two_processes_train_like_one(group, run):
    """Acceptance: same seed, the 2-process run ends where the 1-process run does (float reassociation only), with
    the same steps and epsilon; both ranks hold bitwise the same model; only rank 0 wrote the result."""
    tmp, _ = group
    ranks = [r[run] for r in _ok(group, "trainers")]
    single = Trainer(TrainConfig(**RUNS[run]))
    expected = single.run()
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b), "the ranks' models differ"
    for p, q in zip(single.model.parameters(), ranks[0]["params"], strict=True):
        torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6, msg=f"{run}: 2 processes vs 1")
    assert ranks[0]["steps"] == ranks[1]["steps"] == expected["steps"] == 7
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == expected["epsilon"]
    assert math.isclose(ranks[0]["history"][-1]["train_loss"], expected["history"][-1]["train_loss"], rel_tol=1e-5)
    assert (tmp / f"{run}0.json").exists() and not (tmp / f"{run}1.json").exists()


def test_two_processes_resume_like_one(group):
    """A 2-process checkpoint (written by rank 0 only, read by rank 0 and sent) resumed on 2 processes continues
    the same run: it ends where one process training 2 epochs straight does."""
    ranks = _ok(group, "resume")
    single = Trainer(TrainConfig(**{**RUNS["dpsgd"], "epochs": 2}))
    expected = single.run()
    assert ranks[0]["steps"] == expected["steps"] == 14 and ranks[0]["epsilon"] == expected["epsilon"]
    for p, q in zip(single.model.parameters(), ranks[0]["params"], strict=True):
        torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_every_variant_all_reduced_equals_one_process(group, name):
    """clipped_sum on each rank's shard, all-reduce, one release == one process on the whole batch (noise
    included), also when one rank has no examples at all."""
    for rank, out in enumerate(_ok(group, "variants")):
        for split in ("strided", "all_on_rank0"):
            reference, reference_loss, grads, loss = out[name, split]
            for a, b in zip(reference, grads, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=f"{name}, {split}, rank {rank}")
            torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-5)


def test_the_noise_is_added_once_with_the_right_std(group):
    """All rows padding: the released gradient is pure noise of std sigma C / (qN) (not sqrt(2) times that, as two
    ranks' draws summed would give, nor divided), identical on both ranks, and bitwise the one-process draw."""
    ranks = _ok(group, "noise")
    expected = SIGMA * 1.0 / (Q * NOISE_N)
    for case in ("seeded", "secure"):
        noise = ranks[0][case]
        assert torch.equal(noise, ranks[1][case]), f"{case}: the ranks released different gradients"
        assert abs(noise.std().item() / expected - 1) < 0.03, (case, noise.std().item(), expected)  # 50k draws
    assert torch.equal(ranks[0]["seeded"], ranks[0]["single"])
    # secure draws come from OS entropy: without rank 0's broadcast every rank would release its own noise
    assert not torch.equal(ranks[0]["secure_unshared"], ranks[1]["secure_unshared"])


def test_secure_mode_keeps_the_ranks_identical(group):
    ranks = _ok(group, "secure_run")
    assert ranks[0]["steps"] == ranks[1]["steps"] == 7 and ranks[0]["epsilon"] == ranks[1]["epsilon"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b), "the ranks' models differ"


def test_os_entropy_jl_ranks_and_micro_batches_share_each_steps_tangents(group):
    """Hole 8(b), data-parallel: with OS-entropy keys rank 0 draws each step's tangent key and the other rank uses it:
    every micro-batch on every rank of a step projects on the same tangents; steps get different keys."""
    used = [r["used"] for r in _ok(group, "jl_tangents")]
    keys = [{step: {seed for s, seed, _ in rank if s == step} for step in (0, 1)} for rank in used]
    assert keys[0] == keys[1] and len(used[1]) >= 2 * 3  # 3 micro-batches a step on rank 1, each drawing tangents
    assert all(len(k) == 1 for k in keys[0].values()) and keys[0][0] != keys[0][1]


def test_an_epsilon_run_resumes_with_its_sigma_on_two_processes(group):
    ranks = _ok(group, "epsilon_resume")
    assert ranks[0] == ranks[1] and ranks[0]["steps"] == 14 and ranks[0]["epsilon"] > 3.0


def test_mismatched_seeds_are_refused(group):
    for message in _error(group, "mismatched_seed"):
        assert message.startswith("ValueError") and "different settings" in message
        assert "seed: rank 0 = 0, rank 1 = 1" in message


def test_world_size_change_on_resume_is_refused(group):
    tmp, _ = group
    for message in _error(group, "resume_other_world"):
        assert "written by a run on 1 process(es), but this run has 2" in message
    # and the other way: the 2-process checkpoint resumed by one process
    with pytest.raises(ValueError, match=r"run on 2 process\(es\), but this run has 1.*--nproc 2"):
        Trainer(TrainConfig(**{**RUNS["dpsgd"], "epochs": 2}, checkpoint=str(tmp / "dpsgd.pt"), resume=True)).run()


def test_cli_nproc_runs_torchrun_and_prints_one_result(tmp_path):
    """``fastdp train --nproc 2``: torchrun, 2 gloo workers, one JSON line and one result file, equal to one process."""
    out = tmp_path / "result.json"
    args = [
        "train",
        "--variant",
        "dpsgd",
        "--noise-multiplier",
        "1",
        "--epochs",
        "1",
        "--quiet",
        "--reproducible-privacy-seed",
        "0",
    ]  # compared with one process below
    proc = subprocess.run([sys.executable, "-m", "fastdp.train.cli", *args, "--nproc", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    printed, saved = json.loads(lines[0]), json.loads(out.read_text())
    expected = Trainer(TrainConfig(variant="dpsgd", noise_multiplier=1.0, epochs=1, quiet=True,
                                   reproducible_privacy_seed=0)).run()  # fmt: skip
    assert printed["steps"] == saved["steps"] == expected["steps"]
    assert printed["epsilon"] == expected["epsilon"]
    assert math.isclose(saved["history"][-1]["train_loss"], expected["history"][-1]["train_loss"], rel_tol=1e-5)


def test_cli_nproc_arguments(capsys):
    assert _without_nproc(["train", "--nproc", "2", "--seed", "1", "--nproc=3", "--npr", "4"]) == ["train", "--seed",
                                                                                                   "1"]  # fmt: skip
    assert main(["train", "--nproc", "0", "--variant", "nonprivate"]) == 2
    assert "--nproc must be an integer >= 1" in capsys.readouterr().err
