"""The trainer and `fastdp train`: end to end runs, target epsilon, resume, JSON, errors."""

import json
import math

import pytest
import torch

from fastdp.train.cli import main
from fastdp.train.trainer import TrainConfig, Trainer, train

# a reproducible privacy seed (NOT FOR RELEASE) keeps the learning thresholds below deterministic; the default (OS
# entropy) is tested in tests/test_secure.py and tests/test_holes_keys.py
FAST = dict(
    dataset="breast_cancer",
    epochs=2,
    batch_size=64,
    lr=0.5,
    momentum=0.9,
    quiet=True,
    progress=False,
    reproducible_privacy_seed=0,
)


def test_dpsgd_run_reaches_target_epsilon_and_learns(tmp_path):
    out = tmp_path / "result.json"
    result = train(TrainConfig(variant="dpsgd", epsilon=3.0, delta=1e-5, out=str(out), **FAST))
    assert result["epsilon"] <= 3.0 and result["epsilon"] >= 0.97 * 3.0
    assert result["steps"] == 2 * 7  # round(455 / 64) steps per epoch
    assert len(result["history"]) == 2 and result["history"][-1]["epsilon"] == result["epsilon"]
    assert result["test_accuracy"] > 0.8 and result["test_auroc"] > 0.85
    saved = json.loads(out.read_text())
    assert saved["epsilon"] == result["epsilon"] and len(saved["history"]) == 2
    assert saved["sampling"] == "poisson" and "note" not in saved


def test_every_step_is_accounted_including_empty_batches():
    """q so small that most Poisson batches are empty: each step still adds noise and is accounted."""
    trainer = Trainer(TrainConfig(variant="dpsgd", noise_multiplier=5.0, **{**FAST, "batch_size": 1, "epochs": 1}))
    sizes = []
    original = trainer._batch
    trainer._batch = lambda indices: (sizes.append(indices.numel()), original(indices))[1]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.run()
    assert 0 in sizes, "expected empty batches at q = 1/455"
    assert trainer.accountant.steps == result["steps"] == len(sizes) == 455
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_nonprivate_reports_infinite_epsilon():
    result = train(TrainConfig(variant="nonprivate", **FAST))
    assert math.isinf(result["epsilon"]) and result["delta"] is None
    assert result["test_accuracy"] > 0.9


def test_fixed_sigma_stops_before_exceeding_target():
    result = train(TrainConfig(variant="dpsgd", noise_multiplier=0.8, epsilon=2.0, **{**FAST, "epochs": 50}))
    assert result["stopped_at_target_epsilon"] and result["epsilon"] <= 2.0
    assert result["steps"] < 50 * 7


def test_shuffling_needs_a_flag_and_the_report_says_so():
    result = train(TrainConfig(variant="dpsgd", noise_multiplier=1.0, shuffle=True, **FAST))
    assert result["sampling"] == "shuffle" and "assumes Poisson sampling" in result["note"]
    assert result["privacy_randomness"] == "reproducible (NOT FOR RELEASE)"


def test_padded_batches_train_like_unpadded():
    base = dict(variant="dpsgd", noise_multiplier=1.0, **FAST)
    plain, padded = Trainer(TrainConfig(**base)), Trainer(TrainConfig(pad=True, **base))
    plain.run(), padded.run()
    for a, b in zip(plain.model.parameters(), padded.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_resume_gives_the_same_run_as_training_straight(tmp_path):
    """2 epochs, checkpoint, resume to 4 = 4 straight epochs: same epsilon, steps and weights (a reproducible
    privacy seed: the same noise and batches as the straight run)."""
    base = dict(variant="dpsgd", noise_multiplier=1.2, **FAST)
    straight = Trainer(TrainConfig(**{**base, "epochs": 4}))
    straight_result = straight.run()
    ckpt = tmp_path / "run.pt"
    train(TrainConfig(**{**base, "epochs": 2}, checkpoint=str(ckpt)))
    resumed = Trainer(TrainConfig(**{**base, "epochs": 4}, checkpoint=str(ckpt), resume=True))
    resumed_result = resumed.run()
    assert resumed_result["steps"] == straight_result["steps"] == 28
    assert resumed_result["epsilon"] == straight_result["epsilon"]
    assert resumed.accountant.history == straight.accountant.history
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_refuses_a_different_run_and_a_corrupt_file(tmp_path):
    ckpt = tmp_path / "run.pt"
    train(TrainConfig(variant="dpsgd", noise_multiplier=1.0, checkpoint=str(ckpt), **FAST))
    with pytest.raises(ValueError, match="different run"):
        Trainer(TrainConfig(variant="dpsgd", noise_multiplier=2.0, checkpoint=str(ckpt), resume=True, **FAST)).run()
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupt"):
        Trainer(TrainConfig(variant="dpsgd", noise_multiplier=1.0, checkpoint=str(ckpt), resume=True, **FAST)).run()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        missing = str(tmp_path / "none.pt")
        Trainer(TrainConfig(variant="dpsgd", noise_multiplier=1.0, checkpoint=missing, resume=True, **FAST)).run()


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(variant="dpsgdx", noise_multiplier=1.0), ValueError, "unknown variant"),
        (dict(variant="dpsgd", noise_multiplier=1.0, dataset="nope"), ValueError, "unknown data set|unknown dataset"),
        (dict(variant="dpsgd", epsilon=1.0, delta=1.0), ValueError, "delta"),
        (dict(variant="dpsgd", epsilon=0.0), ValueError, "epsilon"),
        (dict(variant="dpsgd", epsilon=-1.0), ValueError, "epsilon"),
        (dict(variant="dpsgd"), ValueError, "--epsilon"),
        (dict(variant="dpsgd", epsilon=1e-4, epochs=200), ValueError, "unreachable"),
        (dict(variant="dpsgd", noise_multiplier=1.0, batch_size=10_000), ValueError, "batch size"),
        (dict(variant="dpsgd", noise_multiplier=1.0, dataset="yeast", data_dir="/nonexistent"), FileNotFoundError,
         "data-dir|FASTDP_DATA_DIR"),
    ],
)  # fmt: skip
def test_bad_configuration_is_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        train(TrainConfig(**{**FAST, **overrides}))


def test_cli_train_and_errors(capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main(["train", "--variant", "dpsgd", "--dataset", "breast_cancer", "--epsilon", "2", "--epochs", "1",
                 "--lr", "0.5", "--quiet", "--out", str(out)])  # fmt: skip
    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["epsilon"] <= 2.0 and json.loads(out.read_text())["variant"] == "dpsgd"
    assert main(["train", "--variant", "dpsgd", "--epsilon", "1", "--delta", "1.5", "--quiet"]) == 2
    assert "delta must be in (0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--dataset", "imagenet"])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_help_explains_units(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for phrase in ("EXPECTED batch size", "sigma * C", "add/remove-one", "NOT a proven guarantee"):
        assert phrase in text


def test_non_finite_parameters_stop_the_run_before_a_result():
    trainer = Trainer(TrainConfig(variant="dpsgd", noise_multiplier=1.0, out=None, **FAST))
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite parameters after epoch 1"):
        trainer.run()
    assert trainer.history == []
