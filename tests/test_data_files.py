"""Training on the user's own file (``fastdp train --data FILE --target COLUMN``) and the standardisation's privacy:
every format (CSV, TSV, gzip'd CSV, Parquet, .npz tabular and images), every refusal with its message, the DP
standardisation's sensitivity (leave-one-out, adversarial rows), its releases in the reported epsilon, ``--standardize
off`` without them, resume with another standardisation refused, and the CLI end to end on a small CSV.

Every file is written here (tmp_path); nothing is downloaded."""

from __future__ import annotations

import builtins
import csv
import gzip
import hashlib
import json
import math

import numpy as np
import pytest
import torch

from fastdp.privacy.accounting import PrivacyAccountant
from fastdp.train import data as data_module
from fastdp.train import trainer as trainer_module
from fastdp.train.cli import main
from fastdp.train.data import (
    OCTAVE_HIGH,
    OCTAVE_LOW,
    Standardisation,
    fit_dp,
    fit_exact,
    image_moment_sums,
    load_file,
    moment_sensitivity,
    moment_sums,
    precision_noise_multiplier,
    range_from_histogram,
    range_histogram,
    range_sensitivity,
    release_noise_multipliers,
    split,
)
from fastdp.train.trainer import RunAccountant, TrainConfig, Trainer

ROWS, FEATURES = 120, 4
# privacy draws keyed reproducibly (NOT FOR RELEASE): deterministic thresholds; OS entropy is the default elsewhere
FAST = dict(epochs=1, batch_size=24, lr=0.2, hidden=8, quiet=True, progress=False, reproducible_privacy_seed=0)


def _table(n: int = ROWS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features on very different scales (as in real tables) and a label that depends on them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)) * np.array([1.0, 100.0, 0.01, 5000.0]) + np.array([0.0, 500.0, 0.1, 0.0])
    y = (x[:, 0] + (x[:, 1] - 500.0) / 100.0 > 0).astype(np.int64)
    return x, y


def _write_csv(path, header, rows, delimiter=","):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _csv(tmp_path, name="data.csv", labels=None, n=ROWS, delimiter=","):
    x, y = _table(n)
    labels = y if labels is None else labels
    header = ["a", "b", "c", "d", "label"]
    rows = [[*map(repr, row.tolist()), label] for row, label in zip(x, labels, strict=True)]
    return _write_csv(tmp_path / name, header, rows, delimiter), x, y


# ------------------------------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("name, delimiter", [("data.csv", ","), ("data.tsv", "\t"), ("data.csv.gz", ",")])
def test_text_tables_load_with_the_bundled_sets_split_and_their_provenance(tmp_path, name, delimiter):
    path, x, y = _csv(tmp_path, name, delimiter=delimiter)
    raw = load_file(path, "label", seed=3)
    # the same seeded stratified split as a bundled set (fastdp.train.data.split) of the same rows
    expected = split(name, x, y, 2, "same", seed=3)
    np.testing.assert_array_equal(raw.x_train, expected.x_train)
    np.testing.assert_array_equal(raw.y_test, expected.y_test)
    assert raw.input_shape == (FEATURES,) and not raw.image and raw.num_classes == 2 and raw.notes == ()
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert raw.provenance["sha256"] == sha and raw.provenance["path"] == str(path.resolve())
    assert raw.provenance["features"] == ["a", "b", "c", "d"] and raw.provenance["target"] == "label"
    assert str(path.resolve()) in raw.source and sha in raw.source


def test_string_labels_map_to_classes_in_sorted_order_and_say_so(tmp_path):
    labels = np.array(["versicolor", "setosa", "virginica"])[np.arange(ROWS) % 3]
    path, _, _ = _csv(tmp_path, labels=labels)
    raw = load_file(path, "label")
    assert raw.classes == ("setosa", "versicolor", "virginica") and raw.num_classes == 3
    y = np.concatenate([raw.y_train, raw.y_test])
    assert sorted(np.bincount(y).tolist()) == [40, 40, 40]
    assert "sorted order" in raw.notes[0] and "'setosa' -> 0" in raw.notes[0]


def test_integer_labels_other_than_0_to_k_map_in_sorted_order(tmp_path):
    path, _, y = _csv(tmp_path, labels=np.where(_table()[1] == 1, 7, -1))
    raw = load_file(path, "label")
    assert raw.classes == ("-1", "7") and "'-1' -> 0, '7' -> 1" in raw.notes[0]
    path, _, _ = _csv(tmp_path, "floats.csv", labels=[f"{v}.0" for v in y])  # 0.0 / 1.0: integers, kept
    assert load_file(path, "label").notes == ()


def test_npz_tabular_and_images(tmp_path):
    x, y = _table()
    np.savez(tmp_path / "t.npz", x=x, y=y)
    raw = load_file(tmp_path / "t.npz")
    assert raw.input_shape == (FEATURES,) and not raw.image and raw.provenance["format"] == "npz"
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(60, 8, 8), dtype=np.uint8)  # [n, H, W]: a channel axis is added
    np.savez(tmp_path / "i.npz", x=images, y=np.arange(60) % 3)
    raw = load_file(tmp_path / "i.npz")
    assert raw.image and raw.input_shape == (1, 8, 8) and raw.num_classes == 3
    assert raw.x_train.min() >= 0 and raw.x_train.max() <= 1  # scaled by the public constant 1/255
    np.testing.assert_array_equal(np.sort(np.concatenate([raw.x_train, raw.x_test]).ravel()),
                                  np.sort(images.astype(np.float64).ravel() / 255))  # fmt: skip
    np.savez(tmp_path / "f.npz", x=rng.uniform(size=(60, 3, 8, 8)), y=np.array(["a", "b"] * 30))
    raw = load_file(tmp_path / "f.npz")
    assert raw.image and raw.input_shape == (3, 8, 8) and raw.classes == ("a", "b")


def test_parquet_reads_with_pyarrow_when_installed(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    x, y = _table()
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "d": x[:, 3], "label": [str(v) for v in y],
                      "flag": [bool(v % 2) for v in range(ROWS)]})  # fmt: skip
    pq.write_table(table, tmp_path / "d.parquet")
    raw = load_file(tmp_path / "d.parquet", "label")
    assert raw.input_shape == (5,) and raw.provenance["features"] == ["a", "b", "c", "d", "flag"]
    np.testing.assert_array_equal(raw.x_train[:, :4], split("d", x, y, 2, "", seed=0).x_train)


def test_parquet_without_pyarrow_or_pandas_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    real_import = builtins.__import__

    def no_parquet(name, *args, **kwargs):
        if name.split(".")[0] in ("pyarrow", "pandas"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_parquet)
    with pytest.raises(ValueError, match=r"d.parquet: reading Parquet needs pyarrow \(pip install pyarrow\) or pandas"):
        load_file(tmp_path / "d.parquet", "label")


# ------------------------------------------------------------------------------------------------------ refusals


def _bad_csv(tmp_path, header, rows, name="bad.csv"):
    return _write_csv(tmp_path / name, header, rows)


GOOD = [[str(i), str(i * 2.5), str(i % 2)] for i in range(20)]
HEADER = ["x1", "x2", "y"]


def _with(rows, row, column, value):
    rows = [list(r) for r in rows]
    rows[row][column] = value
    return rows


# case -> (header, rows, target, error regex)
BAD_TABLES = {
    "no-target-given": (HEADER, GOOD, None, r"bad.csv: give the label column with --target COLUMN \(columns: 'x1'"),
    "target-missing": (HEADER, GOOD, "label", r"bad.csv: no column 'label' for --target \(columns: 'x1', 'x2', 'y'\)"),
    "non-numeric-features": (["city", "x2", "colour", "y"], [["Paris", "1", "red", str(i % 2)] for i in range(20)],
                             "y", r"bad.csv: 2 feature columns are not numeric: 'city' \(row 0 \(file line 2\): "
                                  r"'Paris'\), 'colour' \(.*'red'\)\. fastdp encodes no categorical features"),
    "missing-cells": (HEADER, _with(_with(GOOD, 3, 0, ""), 7, 1, "NA"), "y",
                      r"bad.csv: 2 of the 20 rows have missing, NaN or Inf features \(rows 3, 7 \(file lines 5, 9\); "
                      r"columns 'x1', 'x2'\); remove or impute them"),
    "inf": (HEADER, _with(GOOD, 4, 1, "inf"), "y", r"1 of the 20 rows have missing, NaN or Inf features \(row 4 "),
    "non-integer-labels": (HEADER, _with(GOOD, 5, 2, "0.5"), "y",
                           r"bad.csv: 1 of the 20 rows have a label in column 'y' that is not an integer \(row 5 "
                           r".*'0.5'\); fastdp trains classifiers"),
    "missing-labels": (HEADER, _with(GOOD, 2, 2, ""), "y", r"bad.csv: 1 of the 20 rows have no label \(row 2 \(file "
                                                           r"line 4\)\) in column 'y'"),
    "single-class": (HEADER, [r[:2] + ["yes"] for r in GOOD], "y", r"bad.csv: all 20 rows have the label 'yes': a "
                                                                   r"classifier needs at least 2 classes"),
    "class-of-one-row": (HEADER, _with(GOOD, 0, 2, "7"), "y", r"bad.csv: 1 class has a single row: '7' \(1 row\); "
                                                              r"the seeded stratified split needs at least 2 rows"),
    "too-few-rows": (HEADER, GOOD[:4], "y", r"bad.csv: too few rows: 4 rows give 3 training and 1 test rows"),
    "wrong-field-count": (HEADER, GOOD[:5] + [["1", "2"]] + GOOD[5:], "y", r"bad.csv: 1 rows do not have the header's "
                                                                           r"3 fields \(first: row 5 \(file line 7\)"),
    "duplicated-columns": (["x", "x", "y"], GOOD, "y", r"bad.csv: duplicated column names 'x'"),
    "header-only": (HEADER, [], "y", r"bad.csv: the data set has no rows \(a header only\)"),
    "target-only": (["y"], [[str(i % 2)] for i in range(20)], "y", r"the label column 'y' is the only column"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_bad_tables_are_refused_saying_what_to_do(case, tmp_path, capsys):
    header, rows, target, message = BAD_TABLES[case]
    path = _bad_csv(tmp_path, header, rows)
    with pytest.raises(ValueError, match=message):
        load_file(path, target)
    # the CLI stops there too, before a model, a release or a step
    code = main(["train", "--data", str(path), *(["--target", target] if target else []), "--noise-multiplier", "1",
                 "--quiet"])  # fmt: skip
    assert code == 2 and "fastdp: error: bad.csv:" in capsys.readouterr().err


def _npz(tmp_path, **arrays):
    np.savez(tmp_path / "bad.npz", **arrays)
    return tmp_path / "bad.npz"


BAD_NPZ = {
    "no-y": (dict(x=np.zeros((20, 3))), None, r"bad.npz: an .npz data file needs arrays x \(features\) and y "
                                              r"\(labels\); it has 'x'"),
    "target-given": (dict(x=np.zeros((20, 3)), y=np.arange(20) % 2), "y", r"bad.npz: an .npz file holds its labels in "
                                                                           r"array y; leave --target out"),
    "string-features": (dict(x=np.full((20, 3), "a"), y=np.arange(20) % 2), None, r"bad.npz: x has dtype <U1: features "
                                                                                  r"must be numbers"),
    "object-arrays": (dict(x=np.array([[1, "a"]] * 20, dtype=object), y=np.arange(20) % 2), None,
                      r"bad.npz: cannot read its arrays .*object arrays are refused"),
    "images-out-of-range": (dict(x=np.full((20, 1, 4, 4), 2.0), y=np.arange(20) % 2), None,
                            r"bad.npz: 20 of the 20 images have pixels outside \[0, 1\] .*saved as uint8"),
    "images-int16": (dict(x=np.zeros((20, 4, 4), dtype=np.int16), y=np.arange(20) % 2), None,
                     r"bad.npz: images of dtype int16: save them as uint8"),
    "nan-rows": (dict(x=np.where(np.arange(60).reshape(20, 3) % 31 == 0, np.nan, 1.0), y=np.arange(20) % 2), None,
                 r"bad.npz: 2 of the 20 rows have missing, NaN or Inf features \(rows 0, 10\); remove or impute them"),
    "nan-images": (dict(x=np.where(np.arange(320).reshape(20, 1, 4, 4) == 37, np.inf, 0.5), y=np.arange(20) % 2), None,
                   r"bad.npz: 1 of the 20 rows have missing, NaN or Inf features \(row 2\)"),
    "rows-mismatch": (dict(x=np.zeros((20, 3)), y=np.arange(19) % 2), None, r"bad.npz: x has 20 rows but y has 19"),
    "five-dims": (dict(x=np.zeros((20, 1, 1, 2, 2)), y=np.arange(20) % 2), None, r"bad.npz: x has shape "
                                                                                  r"\(20, 1, 1, 2, 2\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_NPZ))
def test_bad_npz_files_are_refused(case, tmp_path):
    arrays, target, message = BAD_NPZ[case]
    with pytest.raises(ValueError, match=message):
        load_file(_npz(tmp_path, **arrays), target)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data file .*nope.csv does not exist"):
        load_file(tmp_path / "nope.csv", "y")
    with pytest.raises(ValueError, match=r"data.xlsx: unknown data file format; fastdp reads .csv, .csv.gz"):
        load_file(tmp_path / "data.xlsx", "y")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ValueError, match="empty.csv: the file is empty"):
        load_file(tmp_path / "empty.csv", "y")
    (tmp_path / "broken.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match=r"broken.npz: not an .npz archive \(a zip of .npy arrays"):
        load_file(tmp_path / "broken.npz")


BAD_OPTIONS = {
    "target-without-data": (dict(target="y"), r"--target names the label column of a data file"),
    "exact-private": (dict(standardize="exact", noise_multiplier=1.0),
                      r"--standardize exact fits the mean and std of the training split without noise"),
    "unknown-mode": (dict(standardize="robust", noise_multiplier=1.0), r"unknown standardisation 'robust'"),
    "bad-noise": (dict(standardize_noise=0.0, noise_multiplier=1.0), r"--standardize-noise must be a finite noise"),
    "missing-file": (dict(data="/nonexistent/x.csv", noise_multiplier=1.0), r"data file /nonexistent/x.csv does not"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_data_and_standardisation_options_are_refused(case):
    options, message = BAD_OPTIONS[case]
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        TrainConfig(**{"variant": "dpsgd", **options}).validate()


def test_cli_refuses_both_a_bundled_set_and_a_file(tmp_path, capsys):
    path, _, _ = _csv(tmp_path)
    code = main(["train", "--dataset", "yeast", "--data", str(path), "--target", "label", "--noise-multiplier", "1"])
    assert code == 2 and "--dataset) or your own file (--data FILE), not both" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the DP standardisation's sensitivity


def _adversarial_rows(bound: np.ndarray) -> np.ndarray:
    """Rows at and around every edge the mechanism has: huge, tiny, zero, exactly +-bound, one ulp beyond it, octave
    edges, subnormals."""
    b = np.asarray(bound, dtype=np.float64)
    tiny = np.full_like(b, 5e-324)
    return np.stack([b, -b, np.nextafter(b, np.inf), -np.nextafter(b, np.inf), np.zeros_like(b), tiny, -tiny,
                     np.full_like(b, 1e300), np.full_like(b, -1e300), b / 2, np.nextafter(b / 2, 0), b * 0.7071,
                     np.full_like(b, 2.0**OCTAVE_HIGH), np.full_like(b, 2.0 ** (OCTAVE_LOW - 3)),
                     np.where(np.arange(len(b)) % 2 == 0, b, 0.0)])  # fmt: skip


def _leave_one_out(release, x: np.ndarray) -> float:
    """The largest L2 change of the noiseless release when one row of ``x`` is removed (add/remove adjacency)."""
    full = release(x)
    return max(float(np.linalg.norm(full - release(np.delete(x, i, axis=0)))) for i in range(len(x)))


def test_range_histogram_leave_one_out_is_exactly_its_sensitivity():
    x, _ = _table(40)
    bound = np.array([4.0, 1024.0, 0.25, 16384.0])
    x = np.concatenate([x, _adversarial_rows(bound)])
    change = _leave_one_out(range_histogram, x)
    assert change == range_sensitivity(FEATURES) == math.sqrt(FEATURES)  # d ones, exactly
    assert range_histogram(x).sum() == len(x) * FEATURES and range_histogram(x).shape == (FEATURES, 61)


def test_moment_sums_leave_one_out_is_within_the_claimed_sensitivity_and_attains_it():
    x, _ = _table(40)
    bound = np.array([4.0, 1024.0, 0.25, 16384.0])
    x = np.concatenate([x, _adversarial_rows(bound)])
    claim = moment_sensitivity(FEATURES, len(x))
    change = _leave_one_out(lambda rows: moment_sums(rows, bound), x)
    assert change <= claim
    assert change >= math.sqrt(FEATURES) * (1 - 1e-12)  # a row at +-bound (or 0) in every feature attains it
    # random rows at every scale, large n: the rounding of the sums stays within the margin
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3000, FEATURES)) * 10.0 ** rng.integers(-8, 8, size=(1, FEATURES))
    x[::7] = _adversarial_rows(bound)[rng.integers(0, 15, size=len(x[::7]))]
    full = moment_sums(x, bound)
    for i in range(0, len(x), 97):
        assert np.linalg.norm(full - moment_sums(np.delete(x, i, axis=0), bound)) <= moment_sensitivity(FEATURES, 3000)
    np.testing.assert_array_equal(full, moment_sums(x[rng.permutation(len(x))], bound))  # correctly rounded sums


def test_image_moment_sums_leave_one_out_is_within_the_claimed_sensitivity():
    rng = np.random.default_rng(2)
    images = rng.uniform(size=(30, 1, 5, 5))
    checker = (np.indices((5, 5)).sum(0) % 2).astype(np.float64)[None]
    adversarial = [np.zeros((1, 5, 5)), np.ones((1, 5, 5)), checker, 1 - checker, np.full((1, 5, 5), 0.5),
                   np.full((1, 5, 5), 1e-300), np.full((1, 5, 5), 1 - 2**-53)]  # fmt: skip
    x = np.concatenate([images, np.stack(adversarial)])
    change = _leave_one_out(image_moment_sums, x)
    assert change <= moment_sensitivity(1, len(x)) and change >= 1 - 1e-12  # an all-0 or all-1 image attains 1


def test_range_from_the_histogram_covers_the_populated_octaves():
    x, _ = _table(2000)
    histogram = range_histogram(x)
    bound = range_from_histogram(histogram, noise_std=0.0)  # no noise: one octave above the largest |x|
    assert np.all(np.abs(x).max(0) < bound) and np.all(np.abs(x).max(0) >= bound / 4)
    assert np.all(np.log2(bound) == np.round(np.log2(bound)))  # powers of 2
    bound = range_from_histogram(histogram, noise_std=20.0)  # octaves of < 100 rows are noise: ignored
    assert np.all(bound <= range_from_histogram(histogram, 0.0))


def test_fit_dp_with_small_noise_is_close_to_the_exact_statistics_and_records_its_releases():
    x, _ = _table(4000)
    exact = fit_exact(x)
    dp = fit_dp(x, image=False, noise_multiplier=1e-3)
    assert dp.mode == "dp" and dp.releases == ("range", "moments")
    assert dp.noise_multipliers == tuple(release_noise_multipliers(False, 1e-3)) == (1e-3 * math.sqrt(2),) * 2
    assert np.abs((dp.mean - exact.mean) / exact.std).max() < 0.05
    np.testing.assert_allclose(dp.std, exact.std, rtol=0.05)
    standardised = dp.apply(x)
    assert np.abs(standardised.mean(0)).max() < 0.05 and np.abs(standardised.std(0) - 1).max() < 0.05
    # zero noise through the noise hook: the release is the noiseless sums
    calls = []
    zero = fit_dp(
        x, False, 1.0, noise=lambda release, shape, std: calls.append((release, shape, std)) or np.zeros(shape)
    )
    assert [(r, s) for r, s, _ in calls] == [(0, (FEATURES, 61)), (1, (2, FEATURES))]
    assert calls[0][2] == math.sqrt(2) * range_sensitivity(FEATURES)
    assert calls[1][2] == math.sqrt(2) * moment_sensitivity(FEATURES, len(x))
    assert np.abs((zero.mean - exact.mean) / exact.std).max() < 0.05
    image = fit_dp(np.random.default_rng(0).uniform(size=(500, 1, 4, 4)), True, 1e-3)
    assert image.releases == ("moments",) and image.bound is None
    assert abs(image.mean - 0.5) < 0.02 and abs(image.std - math.sqrt(1 / 12)) < 0.02
    restored = Standardisation.from_state_dict(json.loads(json.dumps(dp.state_dict())))
    np.testing.assert_array_equal(restored.apply(x), dp.apply(x))


# ------------------------------------------------------------------------------ the trainer: accounting and resume


def _config(tmp_path, **overrides) -> TrainConfig:
    path, _, _ = _csv(tmp_path)
    return TrainConfig(**{"variant": "dpsgd", "data": str(path), "target": "label", **FAST, **overrides})


def _epsilon_of(history, preprocessing, delta, mechanism="rdp") -> float:
    accountant = PrivacyAccountant(mechanism)
    accountant.load_state_dict({"mechanism": mechanism, "version": 1,
                                "history": [[s, 1.0, 1] for s in preprocessing] + history})  # fmt: skip
    return accountant.get_epsilon(delta)


def test_the_dp_standardisation_is_in_the_reported_epsilon(tmp_path):
    trainer = Trainer(_config(tmp_path, noise_multiplier=1.0, epochs=2))
    result = trainer.run()
    record = result["standardization"]
    sigmas = release_noise_multipliers(False, trainer.standardize_noise)
    assert record["mode"] == "dp" and trainer.accountant.preprocessing == sigmas == record["noise_multipliers"]
    assert trainer.accountant.steps == result["steps"] == 2 * 4  # the steps; the releases are kept apart
    delta = 1e-5 - result["delta_truncation"]
    history = trainer.accountant.state_dict()["history"]
    assert result["epsilon"] == pytest.approx(_epsilon_of(history, sigmas, delta), rel=1e-12)
    steps_alone = _epsilon_of(history, [], delta)
    assert result["epsilon"] > steps_alone
    assert record["epsilon"] == pytest.approx(result["epsilon"] - steps_alone, rel=1e-9)
    assert record["epsilon_alone"] == pytest.approx(_epsilon_of([], sigmas, delta), rel=1e-9)
    # the default noise: the larger of the steps' (1.0) and the one for estimates of noise std 5% of the clip range
    assert trainer.standardize_noise == max(1.0, 0.05 * 96 / math.sqrt(2 * FEATURES)) == 0.05 * 96 / math.sqrt(8)
    assert "the larger of the steps' noise multiplier 1" in record["noise_multiplier_rule"]
    assert len(record["mean"]) == len(record["std"]) == len(record["bound"]) == FEATURES
    assert result["data_file"]["sha256"] == hashlib.sha256((tmp_path / "data.csv").read_bytes()).hexdigest()


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_a_target_epsilon_covers_the_standardisation_and_the_steps(tmp_path, accountant):
    trainer = Trainer(_config(tmp_path, epsilon=2.0, epochs=3, accountant=accountant))
    result = trainer.run()
    assert 0.97 * 2.0 <= result["epsilon"] <= 2.0
    sigma = result["variant_config"]["noise_multiplier"]
    assert trainer.standardize_noise == max(sigma, precision_noise_multiplier(96, (FEATURES,), False))
    # the steps were calibrated with the releases: alone they spend less than the target, by the releases' share
    delta = 1e-5 - result["delta_truncation"]
    share = result["standardization"]["epsilon"]
    assert share == pytest.approx(result["epsilon"] - trainer.accountant.training_epsilon(delta), rel=1e-9)
    assert 0.05 < share < 1.0
    explicit = Trainer(_config(tmp_path, epsilon=2.0, epochs=3, accountant=accountant, standardize_noise=8.0)).run()
    assert 0.97 * 2.0 <= explicit["epsilon"] <= 2.0 and explicit["standardization"]["noise_multiplier"] == 8.0
    assert explicit["standardization"]["noise_multiplier_rule"] is None
    assert 0 < explicit["standardization"]["epsilon"] < share
    with pytest.raises(ValueError, match=r"the standardisation alone .* spends epsilon .*, not below the target"):
        Trainer(_config(tmp_path, epsilon=2.0, accountant=accountant, standardize_noise=0.5))


def test_standardize_off_has_no_release_and_no_epsilon_share(tmp_path):
    trainer = Trainer(_config(tmp_path, noise_multiplier=1.0, standardize="off"))
    result = trainer.run()
    assert trainer.accountant.preprocessing == [] and trainer.standardize_noise is None
    record = result["standardization"]
    assert record["mode"] == "off" and record["epsilon"] == 0.0 and record["mean"] is None
    history = trainer.accountant.state_dict()["history"]
    assert result["epsilon"] == _epsilon_of(history, [], 1e-5 - result["delta_truncation"])
    # the features reach the model as they are in the file
    torch.testing.assert_close(trainer._transform(trainer.data.x_train), trainer.data.x_train.float())


def test_standardisation_defaults(tmp_path):
    private = Trainer(_config(tmp_path, noise_multiplier=1.0))
    assert private.standardize == "dp" and isinstance(private.accountant, RunAccountant)
    nonprivate = Trainer(_config(tmp_path, variant="nonprivate"))
    assert nonprivate.standardize == "exact" and nonprivate.standardize_noise is None
    compared = Trainer(_config(tmp_path, variant="nonprivate", standardize="dp"))  # e.g. to compare with a private run
    assert compared.standardize_noise == precision_noise_multiplier(96, (FEATURES,), False)
    assert compared.standardisation.mode == "dp" and compared.result()["standardization"]["epsilon"] is None
    x = nonprivate.test_data.x_test.double()
    assert nonprivate.result()["standardization"]["epsilon"] is None
    raw = nonprivate.raw
    exact = fit_exact(raw.x_train)
    torch.testing.assert_close(x, torch.from_numpy(exact.apply(raw.x_test)).float().double())
    # images: dp too, one release of 2 sums (noise multiplier 0.05 N: estimates within 5% of the pixel range)
    np.savez(tmp_path / "i.npz", x=np.random.default_rng(0).integers(0, 256, (80, 8, 8), dtype=np.uint8),
             y=np.arange(80) % 2)  # fmt: skip
    images = Trainer(TrainConfig(variant="dpsgd", data=str(tmp_path / "i.npz"), noise_multiplier=1.0, **FAST))
    assert images.standardize == "dp" and images.accountant.preprocessing == [0.05 * 64]
    off = Trainer(TrainConfig(variant="dpsgd", data=str(tmp_path / "i.npz"), noise_multiplier=1.0, standardize="off",
                              **FAST))  # fmt: skip
    assert off.accountant.preprocessing == [] and off.result()["standardization"]["epsilon"] == 0.0
    assert float(off.test_data.x_test.min()) >= 0 and float(off.test_data.x_test.max()) <= 1  # pixels in [0, 1]


def test_resume_with_another_standardisation_is_refused_and_the_same_one_releases_nothing_new(tmp_path, monkeypatch):
    checkpoint = tmp_path / "run.pt"
    first = Trainer(_config(tmp_path, noise_multiplier=1.0, checkpoint=str(checkpoint)))
    first.run()
    for other in (dict(standardize="off"), dict(standardize_noise=9.0)):
        with pytest.raises(ValueError, match=r"written by a different run: .*standardize"):
            Trainer(_config(tmp_path, noise_multiplier=1.0, checkpoint=str(checkpoint), resume=True, **other)).run()
    # the same settings, more epochs: the checkpoint's standardisation, no new release
    monkeypatch.setattr(trainer_module, "fit_dp", lambda *a, **k: pytest.fail("a resumed run released anew"))
    resumed = Trainer(_config(tmp_path, noise_multiplier=1.0, checkpoint=str(checkpoint), resume=True, epochs=2))
    result = resumed.run()
    assert result["steps"] == 8 and resumed.accountant.preprocessing == first.accountant.preprocessing
    np.testing.assert_array_equal(resumed.standardisation.mean, first.standardisation.mean)


# ------------------------------------------------------------------------------------------------------ end to end


def test_cli_trains_on_a_small_csv_end_to_end(tmp_path, capsys):
    labels = np.array(["no", "yes"])[_table(400)[1]]
    path, _, _ = _csv(tmp_path, labels=labels, n=400)
    out = tmp_path / "result.json"
    code = main(["train", "--data", str(path), "--target", "label", "--epsilon", "3", "--epochs", "3",
                 "--batch-size", "24", "--lr", "0.2", "--hidden", "8", "--quiet", "--out", str(out),
                 "--reproducible-privacy-seed", "0"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed, saved = json.loads(captured.out.strip().splitlines()[-1]), json.loads(out.read_text())
    assert printed["dataset"] == "data.csv" and 0.97 * 3 <= printed["epsilon"] <= 3.0
    assert saved["data_file"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert saved["data_file"]["classes"] == ["no", "yes"] and "sorted order" in saved["note_labels"]
    assert "note: data.csv: the labels in column 'label' are not class indices" in captured.err
    assert saved["standardization"]["mode"] == "dp" and saved["standardization"]["epsilon"] > 0
    assert saved["test_accuracy"] > 0.7


@pytest.mark.parametrize("variant, extra", [
    ("dpsgd", {}), ("jl", dict(accountant="pld", projections=10)), ("clipless", dict(model="lipschitz_mlp")),
    ("weightclip", dict(model="weightclip_mlp")), ("backprop", {}), ("nonprivate", {}),
])  # fmt: skip
def test_every_variant_trains_on_a_file(tmp_path, variant, extra):
    noise = {} if variant == "nonprivate" else dict(noise_multiplier=1.0)
    result = Trainer(_config(tmp_path, variant=variant, **noise, **extra)).run()
    assert result["steps"] == 4 and math.isfinite(result["test_accuracy"])
    assert result["standardization"]["mode"] == ("exact" if variant == "nonprivate" else "dp")


@pytest.mark.parametrize("standardize", ["off", "dp"])
def test_images_train_with_the_cnn(tmp_path, standardize):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "i.npz", x=rng.integers(0, 256, (80, 8, 8), dtype=np.uint8), y=np.arange(80) % 2)
    result = Trainer(TrainConfig(variant="dpsgd", data=str(tmp_path / "i.npz"), noise_multiplier=1.0,
                                 standardize=standardize, **FAST)).run()  # fmt: skip
    assert result["config"]["model"] == "auto" and result["steps"] == 3  # round(64 / 24) steps
    assert result["standardization"]["releases"] == ([] if standardize == "off" else ["moments"])
    assert (result["standardization"]["epsilon"] > 0) == (standardize == "dp")


def test_a_bundled_set_is_standardised_privately_by_default():
    """breast_cancer, as the README runs it: the steps' sigma leaves room for the standardisation's share."""
    trainer = Trainer(TrainConfig(variant="dpsgd", dataset="breast_cancer", epsilon=3.0, epochs=2, quiet=True,
                                  reproducible_privacy_seed=0))  # fmt: skip
    assert trainer.standardize == "dp" and len(trainer.accountant.preprocessing) == 2
    result = trainer.run()
    assert result["epsilon"] <= 3.0 and result["standardization"]["epsilon"] > 0.2
    assert result["data_file"] is None and result["dataset"] == "breast_cancer"
    # the features the model sees: standardised by the DP estimate, not by the exact statistics
    exact = fit_exact(trainer.raw.x_train)
    assert not np.allclose(trainer.standardisation.mean, exact.mean)


def test_data_module_exports():
    assert set(data_module.__all__) <= set(dir(data_module))


def test_features_beyond_float32_are_refused_without_standardisation_and_clipped_with_dp(tmp_path):
    x, y = _table()
    x[5, 3] = 1e300  # a float64 value float32 cannot hold
    rows = [[*map(repr, row.tolist()), label] for row, label in zip(x, y, strict=True)]
    path = _write_csv(tmp_path / "big.csv", ["a", "b", "c", "d", "label"], rows)
    config = dict(variant="dpsgd", data=str(path), target="label", noise_multiplier=1.0, **FAST)
    with pytest.raises(ValueError, match=r"big.csv: 1 of the \d+ (training|test) rows have features beyond float32's "
                                         r"range \(3.4e\+38\) after --standardize off"):  # fmt: skip
        Trainer(TrainConfig(**config, standardize="off"))
    trainer = Trainer(TrainConfig(**config))  # dp: clipped to the estimated range, then standardised
    assert torch.isfinite(trainer._transform(trainer.data.x_train)).all()


@pytest.mark.parametrize("damage", ["negative-std", "short-mean", "missing"])
def test_a_checkpoint_with_a_broken_standardisation_is_refused(tmp_path, damage):
    """A resumed run takes the checkpoint's standardisation (its model learned on it); one that cannot be used is not
    replaced by a new release: the checkpoint is refused."""
    checkpoint = tmp_path / "run.pt"
    Trainer(_config(tmp_path, noise_multiplier=1.0, checkpoint=str(checkpoint))).run()
    state = torch.load(checkpoint, weights_only=True)
    if damage == "negative-std":
        state["standardization"]["std"][0] = -1.0
    elif damage == "short-mean":
        state["standardization"]["mean"] = state["standardization"]["mean"][:2]
    else:
        del state["standardization"]
    torch.save(state, checkpoint)
    with pytest.raises(ValueError, match=r"run.pt is corrupt: its standardisation \(the inputs its model learned on\)"):
        Trainer(_config(tmp_path, noise_multiplier=1.0, checkpoint=str(checkpoint), resume=True, epochs=2)).run()
