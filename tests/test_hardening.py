"""Hardening against bad input and faults (issue 9); every case here is a row of docs/bad-inputs.md.

Data: NaN/Inf features, bad labels and empty data sets are refused when the data set is built, naming it and
counting the rows. Non-finite examples in a step: bf16/fp16 DP-SGD drops them (zero contribution, the step is
released and accounted); in fp32 (every variant) the step turns non-finite and the trainer stops the run at the end
of the epoch (FloatingPointError: no record, checkpoint, result or epsilon). Unsupported layers: every variant names
them, before anything is released or accounted. Corrupt checkpoints: a clear ValueError, nothing loaded from them."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import trainable_parameters
from fastdp.nn import UnsupportedLayerError
from fastdp.train import trainer as trainer_module
from fastdp.train.cli import main
from fastdp.train.data import load_dataset, split_and_standardise
from fastdp.train.trainer import TrainConfig, Trainer, train
from tests.variants import make_variant, small_model

FAST = dict(dataset="breast_cancer", epochs=1, batch_size=64, lr=0.1, hidden=16, noise_multiplier=1.0, quiet=True,
            progress=False)  # fmt: skip
MODELS = {"clipless": "lipschitz_mlp", "weightclip": "weightclip_mlp"}
EXTRA = {"jl": dict(accountant="pld", projections=10)}  # r = 3 at sigma = 1: refused (the noise's truncation bound)


def _config(variant: str, **overrides) -> TrainConfig:
    return TrainConfig(**{**FAST, "variant": variant, "model": MODELS.get(variant, "auto"), **EXTRA.get(variant, {}),
                          **overrides})  # fmt: skip


# ------------------------------------------------------------------------------------------- bad data files


def _yeast_dir(tmp_path, x, y):
    """A data directory whose adbench/47_yeast.npz holds (x, y): the path every ADBench set is read through."""
    (tmp_path / "adbench").mkdir(exist_ok=True)
    np.savez(tmp_path / "adbench" / "47_yeast.npz", X=x, y=y)
    return tmp_path


def _rows(n=40, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), np.arange(n) % 2


def _with(array, index, value):
    array = array.astype(np.float64 if isinstance(value, float) else array.dtype)
    array[index] = value
    return array


x40, y40 = _rows()
BAD_FILES = {
    "nan-inf-features": (_with(_with(_with(x40, (3, 1), np.nan), (8, 0), np.inf), (20, 7), -np.inf), y40,
                         r"yeast: 3 of the 40 rows have NaN or Inf features \(first: row 3\)"),
    "label-too-large": (x40, _with(y40, 7, 2), r"yeast: 1 of the 40 rows have labels outside \[0, 2\) \(first: row 7, "
                                               r"value 2\)"),
    "label-negative": (x40, _with(_with(y40, 5, -1), 6, -3), r"yeast: 2 of the 40 rows have labels outside \[0, 2\) "
                                                             r"\(first: row 5, value -1\)"),
    "label-non-integer": (x40, _with(y40, 4, 0.5), r"yeast: 1 of the 40 rows have a NaN or non-integer label "
                                                   r"\(first: row 4, value 0.5\)"),
    "label-nan": (x40, _with(y40, 9, np.nan), r"yeast: 1 of the 40 rows have a NaN or non-integer label"),
    "label-strings": (x40, np.array(["a", "b"] * 20), r"yeast: labels must be integer class indices 0..1"),
    "labels-wrong-count": (x40, y40[:39], r"yeast: labels must be a vector of 40 class indices"),
    "no-rows": (np.zeros((0, 8)), np.zeros(0, dtype=np.int64), r"yeast: the data set has no rows"),
    "no-features": (np.zeros((40, 0)), y40, r"yeast: features of shape \(40, 0\)"),
    "one-row": (x40[:1], y40[:1], r"yeast: 1 rows at test_fraction=0.2 leave 0 training rows"),
    "class-of-one": (x40, _with(np.zeros(40, dtype=np.int64), 0, 1), r"yeast: cannot make a stratified train/test "
                                                                     r"split"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_data_files_are_refused_at_load_naming_the_data_set_and_rows(case, tmp_path, capsys):
    x, y, message = BAD_FILES[case]
    data_dir = _yeast_dir(tmp_path, x, y)
    with pytest.raises(ValueError, match=message):
        load_dataset("yeast", data_dir=data_dir)
    # the trainer and the CLI stop there too: before a model, a step or an epsilon
    code = main(["train", "--dataset", "yeast", "--data-dir", str(data_dir), "--noise-multiplier", "1", "--quiet"])
    assert code == 2 and "fastdp: error: yeast:" in capsys.readouterr().err


def test_the_test_split_can_never_be_empty_and_a_good_file_loads(tmp_path):
    x, y = _rows(n=10)
    data = load_dataset("yeast", data_dir=_yeast_dir(tmp_path, x, y.astype(np.float64)))  # float 0./1. labels: fine
    assert data.x_test.shape[0] == 2 and data.x_train.shape[0] == 8 and data.y_train.dtype == torch.int64
    with pytest.raises(ValueError, match="test_fraction must be in"):
        split_and_standardise("toy", x, y, 2, "toy", test_fraction=0.0)


def _breast_cancer():
    return load_dataset("breast_cancer")


def _nan_row(x, row):
    x = x.clone()
    x[row, 2] = math.nan
    return x


BAD_SPLITS = {
    "empty-training-split": (lambda d: dict(x_train=d.x_train[:0], y_train=d.y_train[:0]),
                             r"breast_cancer: the training split has 0 rows"),
    "empty-test-split": (lambda d: dict(x_test=d.x_test[:0], y_test=d.y_test[:0]),
                         r"breast_cancer: the test split has 0 rows"),
    "nan-training-row": (lambda d: dict(x_train=_nan_row(d.x_train, 17)),
                         r"breast_cancer: 1 of the 455 training rows have NaN or Inf features \(first: row 17\)"),
    "inf-test-row": (lambda d: dict(x_test=d.x_test.index_fill(0, torch.tensor([3, 5]), math.inf)),
                     r"breast_cancer: 2 of the 114 test rows have NaN or Inf features \(first: row 3\)"),
    "label-out-of-range": (lambda d: dict(y_train=d.y_train.index_fill(0, torch.tensor([9]), 2)),
                           r"breast_cancer: 1 of the 455 training rows have labels outside \[0, 2\) \(first: row 9"),
    "float-labels": (lambda d: dict(y_test=d.y_test.float()), r"the test labels must be an int64 vector"),
    "wrong-shape": (lambda d: dict(input_shape=(31,)), r"input_shape is \(31,\)"),
    "one-class": (lambda d: dict(num_classes=1), r"num_classes must be an integer >= 2"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_SPLITS))
def test_a_dataset_object_refuses_bad_splits(case):
    change, message = BAD_SPLITS[case]
    data = _breast_cancer()
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(data, **change(data))


# ------------------------------------------------------------------------------------ non-finite examples


def _batch_with_bad_rows(b=12, d=5, k=3):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(b, d, generator=gen)
    x[2, 0], x[5, 1], x[9] = math.nan, math.inf, 1e38  # NaN, Inf, and an input whose forward overflows fp32
    y = torch.randint(0, k, (b,), generator=gen)
    return Batch(x, y, torch.ones(b, dtype=torch.bool)), [i for i in range(b) if i not in (2, 5, 9)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_dpsgd_drops_non_finite_examples_under_low_precision(precision):
    """Each non-finite example contributes exactly zero: the clipped sum (and the summed loss) equal those of the
    batch without it, the release is finite, and the examples are counted."""
    batch, good = _batch_with_bad_rows()
    clean = Batch(batch.x[good], batch.y[good], batch.mask[good])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))  # 1e38 inputs: inf logits, NaN loss
    results = []
    for b in (batch, clean):
        variant = DPSGD(1.0, 1.0, 0.1, 120, reproducible_seed=1)
        variant.set_precision(precision)
        sums, loss = variant.clipped_sum(model, b, 0)
        results.append((sums, loss, int(variant.nonfinite_examples)))
    (sums, loss, dropped), (clean_sums, clean_loss, clean_dropped) = results
    assert (dropped, clean_dropped) == (3, 0)
    for s, c in zip(sums, clean_sums, strict=True):  # the same rows, up to the rounding of a different GEMM shape
        torch.testing.assert_close(s, c, rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(loss, clean_loss, rtol=1e-2, atol=1e-3)
    variant = DPSGD(1.0, 1.0, 0.1, 120, reproducible_seed=1)
    variant.set_precision(precision)
    variant.gradient(model, batch, 0)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert variant.describe()["nonfinite_examples"] == 3


@pytest.mark.parametrize("name", ["dpsgd", "dpsgd-reference", "jl", "clipless", "weightclip", "backprop"])
def test_fp32_variants_release_a_non_finite_gradient_for_a_non_finite_example(name):
    """What a library user calling a variant directly in fp32 gets for a non-finite example: a non-finite gradient
    (no host check in the step); the trainer stops such a run (next test). Finite batches stay finite."""
    batch, good = _batch_with_bad_rows()
    for b, finite in ((Batch(batch.x[good], batch.y[good], batch.mask[good]), True), (batch, False)):
        model, variant = small_model(name, 5, 3), make_variant(name, 12, 120)
        variant.gradient(model, b, 0)
        grads = torch.cat([p.grad.reshape(-1) for p in trainable_parameters(model)])
        assert bool(torch.isfinite(grads).all()) == finite, (name, finite)


@pytest.mark.parametrize("variant, precision", [("dpsgd", "bf16"), ("dpsgd", "fp32"), ("jl", "fp32"),
                                               ("clipless", "fp32"), ("weightclip", "fp32"),
                                               ("backprop", "fp32")])  # fmt: skip
def test_non_finite_examples_are_dropped_by_low_precision_dpsgd_and_stop_every_fp32_run(variant, precision, tmp_path):
    """The data set is validated at load, so the non-finite rows are written into the loaded tensor: what an
    overflow in the model produces. bf16 DP-SGD: dropped, finite model, epsilon reported. fp32: FloatingPointError
    at the end of the epoch, and no record, checkpoint, result file or epsilon."""
    checkpoint, out = tmp_path / "run.pt", tmp_path / "result.json"
    trainer = Trainer(_config(variant, precision=precision, checkpoint=str(checkpoint), out=str(out)))
    trainer.data.x_train[:100, 0] = math.nan  # every Poisson batch of ~64 of 455 rows holds some
    if precision == "bf16":
        result = trainer.run()
        assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
        assert math.isfinite(result["epsilon"]) and result["variant_config"]["nonfinite_examples"] > 0
        assert checkpoint.exists() and out.exists()
    else:
        with pytest.raises(FloatingPointError, match="non-finite parameters after epoch 1"):
            trainer.run()
        assert trainer.history == [] and not checkpoint.exists() and not out.exists()


@pytest.mark.parametrize("args, error", [(["--variant", "dpsgd"], "non-finite parameters after epoch 1"),
                                         (["--variant", "backprop"], "non-finite parameters after epoch 1"),
                                         (["--variant", "nonprivate"], "non-finite parameters after epoch 1"),
                                         (["--variant", "dpsgd", "--precision", "bf16"],
                                          "the model's outputs are not finite on")], ids=str)  # fmt: skip
def test_a_diverging_learning_rate_never_gives_a_broken_model_with_an_epsilon(args, error, tmp_path, capsys):
    """lr 1e37: the weights reach ~1e35 in one step and the next forwards overflow. In fp32 the overflow reaches
    the weights. bf16 DP-SGD drops the overflowing examples and its update stays bounded by lr (C + noise): its
    weights stay finite, but its outputs on the test split are not. Either way the CLI stops with the error at the
    end of the epoch: no result, no checkpoint, no epsilon."""
    out, checkpoint = tmp_path / "result.json", tmp_path / "run.pt"
    code = main(["train", *args, "--dataset", "breast_cancer", "--noise-multiplier", "1", "--epochs", "1", "--lr",
                 "1e37", "--quiet", "--out", str(out), "--checkpoint", str(checkpoint)])  # fmt: skip
    assert code == 2 and f"fastdp: error: {error}" in capsys.readouterr().err
    assert not out.exists() and not checkpoint.exists()


def test_a_learning_rate_beyond_float32_is_refused():
    with pytest.raises(ValueError, match="learning rate must be finite and > 0 in float32"):
        Trainer(_config("dpsgd", lr=1e300))


# ----------------------------------------------------------------------------------------- unsupported layers


def _batchnorm_model(features=30, classes=2):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, classes))


UNSUPPORTED = {
    "dpsgd": (UnsupportedLayerError, r"1 \(BatchNorm1d\)"),
    "dpsgd-reference": (UnsupportedLayerError, r"batch statistics in training mode.*1 \(BatchNorm1d\)"),
    "jl": (UnsupportedLayerError, r"1 \(BatchNorm1d\)"),
    "clipless": (ValueError, r"no Lipschitz bound rule.*: 0 \(Linear\), 1 \(BatchNorm1d\), 3 \(Linear\)"),
    "weightclip": (ValueError, r"no Lipschitz bound rule.*: 0 \(Linear\), 1 \(BatchNorm1d\), 3 \(Linear\)"),
    "backprop": (UnsupportedLayerError, r"Linear and Conv2d layers only; freeze or replace: 1 \(BatchNorm1d\)"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_every_variant_names_unsupported_layers_before_releasing_anything(name):
    error, message = UNSUPPORTED[name]
    model, variant = _batchnorm_model(), make_variant(name, 8, 80)
    batch = Batch(torch.randn(8, 30), torch.randint(0, 2, (8,)), torch.ones(8, dtype=torch.bool))
    with pytest.raises(error, match=message):
        variant.gradient(model, batch, 0)
    assert all(p.grad is None for p in model.parameters())


def test_backprop_refuses_batch_statistics_even_when_frozen():
    model, variant = _batchnorm_model(), make_variant("backprop", 8, 80)
    model[1].requires_grad_(False)
    batch = Batch(torch.randn(8, 30), torch.randint(0, 2, (8,)), torch.ones(8, dtype=torch.bool))
    with pytest.raises(UnsupportedLayerError, match=r"batch statistics in training mode.*1 \(BatchNorm1d\)"):
        variant.gradient(model, batch, 0)
    model[1].eval()  # public running statistics: a per-example function again
    variant.gradient(model, batch, 0)
    assert all(torch.isfinite(p.grad).all() for p in trainable_parameters(model))


@pytest.mark.parametrize("variant", ["dpsgd", "jl", "clipless", "weightclip", "backprop"])
def test_the_trainer_stops_at_unsupported_layers_before_any_step_is_accounted(variant, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "build_model", lambda *args, **kwargs: _batchnorm_model())
    checkpoint = tmp_path / "run.pt"
    # the trainer trains through the front door: its model is refused when it is wrapped (as by make_private), with
    # every problem in one error (fastdp.nn.validate strict), before any step, release or checkpoint
    lipschitz = r".*0 \(Linear\): no Lipschitz bound rule" if variant in ("clipless", "weightclip") else ""
    message = rf"(?s)variant '{variant}' cannot train this model as it is{lipschitz}.*1 \(BatchNorm1d\)"
    with pytest.raises(UnsupportedLayerError, match=message):
        Trainer(_config(variant, checkpoint=str(checkpoint)))
    assert not checkpoint.exists()


# ---------------------------------------------------------------------------------------- corrupt checkpoints


class _NotAFastdpObject:
    """Pickled into a checkpoint file: ``torch.load(weights_only=True)`` refuses to build it (no code runs)."""


_DROP = object()  # a value for _edited: remove the field


def _edited(state: dict, **changes) -> dict:
    """A copy of the checkpoint ``state`` with ``changes`` applied (``_DROP`` removes a field)."""
    state = {**state, **changes}
    return {k: v for k, v in state.items() if v is not _DROP}


def _first_weight(state: dict, value: torch.Tensor) -> dict:
    """``state`` with its first Linear layer's weight (the mlp's "1.weight", [16, 30]) replaced by ``value``."""
    return _edited(state, model={**state["model"], "1.weight": value})


CORRUPT = {
    "truncated": (lambda raw, state: raw[: len(raw) // 2], r"is corrupt or not a fastdp checkpoint"),
    "random-bytes": (lambda raw, state: np.random.default_rng(0).bytes(4096), r"is corrupt or not a fastdp checkpoint"),
    "empty-file": (lambda raw, state: b"", r"is corrupt or not a fastdp checkpoint"),
    "pickled-object": (lambda raw, state: _NotAFastdpObject(), r"is corrupt or not a fastdp checkpoint"),
    "a-state-dict": (lambda raw, state: state["model"], r"not a fastdp checkpoint of version 1 \(found version None\)"),
    "a-list": (lambda raw, state: [1, 2, 3], r"not a fastdp checkpoint of version 1 \(found a list\)"),
    "wrong-version": (lambda raw, state: _edited(state, version=2), r"of version 1 \(found version 2\)"),
    "missing-field": (lambda raw, state: _edited(state, accountant=_DROP), r"wrong type: accountant"),
    "wrong-type": (lambda raw, state: _edited(state, step="7"), r"wrong type: step"),
    "nan-weights": (lambda raw, state: _first_weight(state, torch.full((16, 30), math.nan)),
                    r"non-finite or non-tensor model entries: 1.weight"),
    "wrong-shape": (lambda raw, state: _first_weight(state, torch.zeros(3, 3)),
                    r"its saved state does not load into this run"),
    "bad-accountant": (lambda raw, state: _edited(state, accountant={"history": "x"}),
                       r"its saved state does not load into this run"),
    "bad-sampler": (lambda raw, state: _edited(state, sampler={"kind": "shuffle"}),
                    r"its saved state does not load into this run"),
    "other-run": (lambda raw, state: _edited(state, identity={**state["identity"], "seed": 99}),
                  r"was written by a different run"),
}  # fmt: skip


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint") / "run.pt"
    train(_config("dpsgd", checkpoint=str(path)))
    return path.read_bytes(), torch.load(path, weights_only=True)


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_checkpoint_is_refused_with_a_clear_error(case, good_checkpoint, tmp_path):
    raw, state = good_checkpoint
    make, message = CORRUPT[case]
    bad, path = make(raw, state), tmp_path / "run.pt"
    if isinstance(bad, bytes):
        path.write_bytes(bad)
    else:
        torch.save(bad, path)
    trainer = Trainer(_config("dpsgd", checkpoint=str(path), resume=True, epochs=2))
    with pytest.raises(ValueError, match=message):
        trainer.run()
    assert trainer.step == 0 and trainer.history == []


def test_the_cli_reports_a_corrupt_checkpoint(tmp_path, capsys):
    path = tmp_path / "run.pt"
    path.write_bytes(b"\x80\x02 not a checkpoint")
    code = main(["train", "--variant", "dpsgd", "--noise-multiplier", "1", "--epochs", "1", "--quiet", "--checkpoint",
                 str(path), "--resume"])  # fmt: skip
    assert code == 2 and f"fastdp: error: checkpoint {path} is corrupt" in capsys.readouterr().err


# --------------------------------------------------------------- option and argument validation (docs table)

BAD_OPTIONS = {
    "unknown-variant": (dict(variant="x"), ValueError, "unknown variant 'x'; choose one of"),
    "unknown-accountant": (dict(accountant="x"), ValueError, "unknown accountant 'x'"),
    "delta-out-of-range": (dict(delta=1.0), ValueError, r"delta must be in \(0, 1\)"),
    "epsilon-not-positive": (dict(epsilon=0.0), ValueError, "epsilon must be finite and > 0"),
    "epsilon-infinite": (dict(epsilon=math.inf), ValueError, "epsilon must be finite and > 0"),
    "no-epsilon-no-sigma": (dict(noise_multiplier=None), ValueError, "is private: give --epsilon"),
    "epochs-zero": (dict(epochs=0), ValueError, "epochs and batch size must be >= 1"),
    "batch-size-zero": (dict(batch_size=0), ValueError, "epochs and batch size must be >= 1"),
    "batch-size-above-n": (dict(batch_size=10_000), ValueError, "batch size 10000 exceeds the 455 training examples"),
    "lr-not-positive": (dict(lr=0.0), ValueError, "learning rate must be finite and > 0"),
    "lr-nan": (dict(lr=math.nan), ValueError, "learning rate must be finite and > 0"),
    "lr-beyond-float32": (dict(lr=1e300), ValueError, "learning rate must be finite and > 0 in float32"),
    "unknown-optimizer": (dict(optimizer="rmsprop"), ValueError, "unknown optimizer 'rmsprop'"),
    "clip-norm-zero": (dict(clip_norm=0.0), ValueError, "clip norm C must be finite and > 0"),
    "clip-norm-nan-jl": (dict(variant="jl", accountant="pld", clip_norm=math.nan), ValueError,
                         "clip norm C must be finite and > 0"),
    "clip-norm-zero-backprop": (dict(variant="backprop", clip_norm=0.0), ValueError,
                                "gradient clip C2 must be finite and > 0"),
    "input-clip-negative": (dict(variant="backprop", input_clip=-1.0), ValueError, "input clip C1 must be finite"),
    "sigma-negative": (dict(noise_multiplier=-1.0), ValueError, "noise multiplier must be finite and >= 0"),
    "sigma-nan": (dict(noise_multiplier=math.nan), ValueError, "noise multiplier must be finite and >= 0"),
    "jl-with-rdp": (dict(variant="jl"), ValueError, "variant jl needs --accountant pld"),
    "projections-zero": (dict(variant="jl", accountant="pld", projections=0), ValueError,
                         r"projections \(JL dimension r\) must be an integer >= 1"),
    "micro-batch-zero": (dict(micro_batch=0), ValueError, "micro-batch size must be an integer >= 1"),
    "unknown-precision": (dict(precision="fp8"), ValueError, "unknown precision 'fp8'"),
    "bf16-clipless": (dict(variant="clipless", model="lipschitz_mlp", precision="bf16"), ValueError,
                      "variant 'clipless' cannot train in bf16"),
    "loss-scale-fp32": (dict(loss_scale=8.0), ValueError, r"a loss scale \(8.0\) is for fp16 only"),
    "loss-scale-not-power-of-two": (dict(precision="fp16", loss_scale=3.0), ValueError,
                                    "loss scale must be a power of two"),
    "unknown-compile-mode": (dict(compile="fast"), ValueError, "unknown torch.compile mode 'fast'"),
    "unknown-compile-backend": (dict(compile="default", compile_backend="cudagraphs"), ValueError,
                                "unsupported torch.compile backend 'cudagraphs'"),
    "resume-without-checkpoint": (dict(resume=True), ValueError, "--resume needs --checkpoint PATH"),
    "shuffle-with-default-keys": (dict(shuffle=True), ValueError, "--shuffle is not for a private release"),
    "secure-with-reproducible-seed": (dict(secure=True, reproducible_privacy_seed=1), ValueError,
                                      "--secure refuses what is not for release"),
    "reproducible-seed-negative": (dict(reproducible_privacy_seed=-1), ValueError,
                                   r"reproducible privacy seed must be None \(privacy draws from OS entropy"),
    "unknown-dataset": (dict(dataset="imagenet"), ValueError, "unknown dataset 'imagenet'"),
    "missing-data-dir": (dict(dataset="yeast", data_dir="/nonexistent"), FileNotFoundError, "FASTDP_DATA_DIR"),
    "unknown-model": (dict(model="resnet"), ValueError, "unknown model 'resnet'"),
    "hidden-zero": (dict(hidden=0), ValueError, "mlp needs hidden >= 1"),
    "clipless-without-lipschitz-model": (dict(variant="clipless", model="mlp"), ValueError,
                                         r"needs a Lipschitz model \(--model lipschitz_mlp\)"),
    "lipschitz-hidden-odd": (dict(variant="clipless", model="lipschitz_mlp", hidden=15), ValueError,
                             "lipschitz_mlp needs an even hidden width"),
    "max-weight-norm-zero": (dict(variant="weightclip", model="weightclip_mlp", max_weight_norm=0.0), ValueError,
                             "max_norm must be finite and > 0"),
    "tau-zero": (dict(variant="clipless", model="lipschitz_mlp", tau=0.0), ValueError, "tau must be finite and > 0"),
    "input-bound-negative": (dict(variant="clipless", model="lipschitz_mlp", input_bound=-1.0), ValueError,
                             "bound X_0 must be finite and > 0"),
    "unknown-noise-strategy": (dict(variant="clipless", model="lipschitz_mlp", noise_strategy="x"), ValueError,
                               "unknown noise strategy 'x'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_training_options_are_refused_before_any_step(case):
    overrides, error, message = BAD_OPTIONS[case]
    config = TrainConfig(**{**FAST, **overrides})
    with pytest.raises(error, match=message):
        Trainer(config).run()


def _library_calls():
    from fastdp.algorithms import JL, BackpropClip, Clipless
    from fastdp.privacy.accounting import PrivacyAccountant
    from fastdp.privacy.sampling import PoissonSampler, ShuffleSampler, micro_batches, pad_batch

    batch = Batch(torch.randn(4, 5), torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.bool))
    return {
        "dpsgd-sample-rate": (lambda: DPSGD(1.0, 1.0, 1.5, 10), r"sample rate must be in \(0, 1\]"),
        "dpsgd-unknown-mode": (lambda: DPSGD(1.0, 1.0, 0.1, 10, mode="x"), "unknown DP-SGD mode 'x'"),
        "dpsgd-per-layer-count": (lambda: DPSGD([1.0, 1.0], 1.0, 0.1, 40).gradient(small_model("dpsgd", 5, 3), batch,
                                                                                      0),
                                  "2 clip norms for 3 DP layers"),
        "dpsgd-per-layer-count-reference": (lambda: DPSGD([1.0, 1.0], 1.0, 0.1, 40, mode="reference").gradient(
                                                small_model("dpsgd", 5, 3), batch, 0),
                                            "2 clip norms for 0 DP layers.*fastdp.nn.convert"),
        "no-micro-batches": (lambda: DPSGD(1.0, 1.0, 0.1, 40).gradient(small_model("dpsgd", 5, 3), [], 0),
                             "needs at least one"),
        "reference-mode-bf16": (lambda: DPSGD(1.0, 1.0, 0.1, 10, mode="reference").set_precision("bf16"),
                                "runs in fp32 only"),
        "jl-projections-zero": (lambda: JL(1.0, 1.0, 0.1, 10, projections=0), "projections r must be an integer"),
        "jl-chunk-zero": (lambda: JL(1.0, 1.0, 0.1, 10, chunk=0), "chunk"),
        "clipless-loss-not-lipschitz": (lambda: Clipless(1.0, 0.1, 10, loss=nn.CrossEntropyLoss()),
                                        "needs a loss with a Lipschitz constant"),
        "backprop-input-clip-zero": (lambda: BackpropClip(0.0, 1.0, 1.0, 0.1, 10), "input clip C1 must be finite"),
        "poisson-no-examples": (lambda: PoissonSampler(0, 0.1), "at least one example"),
        "poisson-rate": (lambda: PoissonSampler(10, 0.0), r"q must be in \(0, 1\]"),
        "shuffle-batch-too-large": (lambda: ShuffleSampler(10, 11), r"batch size must be in \[1, 10\]"),
        "pad-multiple-zero": (lambda: pad_batch(torch.arange(3), 0), "physical batch size must be >= 1"),
        "micro-batch-size-zero": (lambda: micro_batches(torch.arange(3), torch.ones(3, dtype=torch.bool), 0),
                                  "micro-batch size must be an integer >= 1"),
        "accountant-unknown": (lambda: PrivacyAccountant("x"), "unknown accountant mechanism 'x'"),
        "accountant-sigma-negative": (lambda: PrivacyAccountant("rdp").step(-1.0, 0.1), "must be >= 0"),
        "accountant-rate": (lambda: PrivacyAccountant("rdp").step(1.0, 1.5), "sample_rate must be in"),
        "accountant-delta": (lambda: PrivacyAccountant("rdp").get_epsilon(0.0), "delta must satisfy 0 < delta < 1"),
        "accountant-jl-in-rdp": (lambda: PrivacyAccountant("rdp").step(1.0, 0.1, projections=4),
                                 "RDP cannot account DP-SGD-JL"),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(_library_calls()))
def test_library_objects_refuse_bad_arguments(case):
    call, message = _library_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()
