"""fastdp.train.data: every data set loads from the shared files, splits are seeded/stratified/disjoint, and
standardisation is fitted on the training split only."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdp.train.data import DATASETS, default_data_dir, load_dataset, read_idx, split_and_standardise

DATA_DIR = default_data_dir()
needs_files = pytest.mark.skipif(
    DATA_DIR is None or not DATA_DIR.is_dir(),
    reason="shared data directory not found (<repo>/../shared/data, or set FASTDP_DATA_DIR)",
)

# name -> (rows in total, input_shape, num_classes, task, reads files)
EXPECTED = {
    "breast_cancer": (569, (30,), 2, "binary", False),
    "digits": (1797, (1, 8, 8), 10, "multiclass", False),
    "yeast": (1484, (8,), 2, "binary", True),
    "magic": (19020, (10,), 2, "binary", True),
    "shuttle": (49097, (9,), 2, "binary", True),
    "campaign": (41188, (62,), 2, "binary", True),
    "german_credit": (1000, (61,), 2, "binary", True),
    "nursery": (12960, (27,), 5, "multiclass", True),
    "adult": (48842, (108,), 2, "binary", True),
    "default_credit": (30000, (33,), 2, "binary", True),
    "dropout": (4424, (247,), 3, "multiclass", True),
    "mnist": (10000, (1, 28, 28), 10, "multiclass", True),
}
PARAMS = [pytest.param(name, marks=[needs_files] if EXPECTED[name][4] else [], id=name) for name in EXPECTED]

_cache: dict = {}


def load(name: str, seed: int = 0):
    """load_dataset with the default split, cached across tests (loading is deterministic)."""
    if (name, seed) not in _cache:
        _cache[name, seed] = load_dataset(name, seed=seed)
    return _cache[name, seed]


def test_registry_matches_expectations():
    assert set(DATASETS) == set(EXPECTED)


@pytest.mark.parametrize("name", PARAMS)
def test_shapes_dtypes_labels(name):
    n, input_shape, num_classes, task, _ = EXPECTED[name]
    ds = load(name)
    assert (ds.name, ds.input_shape, ds.num_classes, ds.task) == (name, input_shape, num_classes, task)
    n_test = int(np.ceil(0.2 * n))
    assert ds.x_train.shape == (n - n_test, *input_shape) and ds.x_test.shape == (n_test, *input_shape)
    assert ds.y_train.shape == (n - n_test,) and ds.y_test.shape == (n_test,)
    assert ds.x_train.dtype == ds.x_test.dtype == torch.float32
    assert ds.y_train.dtype == ds.y_test.dtype == torch.int64
    for y in (ds.y_train, ds.y_test):
        assert 0 <= int(y.min()) and int(y.max()) < num_classes
    assert torch.isfinite(ds.x_train).all() and torch.isfinite(ds.x_test).all()
    assert ds.source


@pytest.mark.parametrize("name", PARAMS)
def test_split_is_stratified(name):
    ds = load(name)
    y = torch.cat([ds.y_train, ds.y_test])
    counts_all = torch.bincount(y, minlength=ds.num_classes).double()
    counts_test = torch.bincount(ds.y_test, minlength=ds.num_classes).double()
    # Each class contributes its share of the test split, up to rounding (one example per class).
    assert (counts_test - counts_all * len(ds.y_test) / len(y)).abs().max() <= 1.0, (counts_all, counts_test)
    assert set(torch.unique(ds.y_train).tolist()) == set(range(ds.num_classes)), "every class is in the train split"


@pytest.mark.parametrize("name", PARAMS)
def test_standardised_with_train_statistics(name):
    ds = load(name)
    image = len(ds.input_shape) == 3
    x_train = ds.x_train.double().reshape(len(ds.x_train), -1)
    x_test = ds.x_test.double().reshape(len(ds.x_test), -1)
    if image:  # one global mean/std over all training pixels
        x_train, x_test = x_train.reshape(-1, 1), x_test.reshape(-1, 1)
    mean, std = x_train.mean(0), x_train.std(0, unbiased=False)
    torch.testing.assert_close(mean, torch.zeros_like(mean), atol=1e-5, rtol=0, msg="train mean must be 0")
    constant = std < 1e-6  # constant features keep std 0 (divided by 1, not by 0)
    torch.testing.assert_close(std[~constant], torch.ones_like(std[~constant]), atol=1e-4, rtol=0, msg="train std 1")
    # The test split was not used for fitting: its mean is not exactly zero.
    assert x_test.mean(0).abs().max() > 1e-4


@pytest.mark.parametrize("image", [False, True], ids=["tabular", "image"])
def test_standardise_known_answer(image):
    """x_train/x_test equal (raw - mean) / std with mean/std of the raw training rows only (std 0 -> 1)."""
    n = 40
    rng = np.random.default_rng(0)
    raw = rng.uniform(size=(n, 4))
    raw[:, 0] = np.arange(n) / n  # identifies the rows: standardising is increasing in it
    raw[:, 1] = 0.5  # constant feature
    raw[n // 2 :, 2] += 100.0  # outliers, so train-only and all-row statistics differ whichever rows are tested
    y = np.arange(n) % 3
    x = raw.reshape(n, 1, 2, 2) if image else raw
    ds = split_and_standardise("toy", x, y, 3, "toy", seed=1, test_fraction=0.25, image=image)
    assert ds.input_shape == ((1, 2, 2) if image else (4,))
    x_train, x_test = ds.x_train.reshape(-1, 4).double(), ds.x_test.reshape(-1, 4).double()
    # Rank of column 0 among all rows = row index (the same increasing affine map is applied to both splits).
    rank = torch.argsort(torch.argsort(torch.cat([x_train[:, 0], x_test[:, 0]])))
    train_idx, test_idx = rank[: len(x_train)], rank[len(x_train) :]
    assert len(set(train_idx.tolist()) & set(test_idx.tolist())) == 0
    torch.testing.assert_close(torch.cat([ds.y_train, ds.y_test]), torch.from_numpy(y)[rank], msg="labels follow rows")
    r = torch.from_numpy(raw)
    fit = r[train_idx].reshape(-1, 1) if image else r[train_idx]
    mean, std = fit.mean(0), fit.std(0, unbiased=False)
    std = torch.where(std > 1e-12, std, torch.ones_like(std))
    torch.testing.assert_close(x_train, (r[train_idx] - mean) / std, rtol=1e-6, atol=1e-6, msg="train rows")
    torch.testing.assert_close(x_test, (r[test_idx] - mean) / std, rtol=1e-6, atol=1e-6, msg="test rows")
    if not image:
        assert torch.all(ds.x_train[:, 1] == 0) and torch.all(ds.x_test[:, 1] == 0), "constant feature -> 0"


def test_split_is_deterministic_and_seeded():
    a, b, c = (
        load_dataset("breast_cancer", seed=0),
        load_dataset("breast_cancer", seed=0),
        load_dataset("breast_cancer", seed=1),
    )
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert not torch.equal(a.x_train, c.x_train)
    assert a.x_train.shape == c.x_train.shape


@pytest.mark.parametrize("name", PARAMS)
def test_train_and_test_are_disjoint(name):
    ds = load(name)
    n = EXPECTED[name][0]
    assert len(ds.x_train) + len(ds.x_test) == n
    if name not in ("yeast", "magic", "campaign", "adult", "default_credit"):  # the others have no duplicate rows
        rows = torch.cat([ds.x_train, ds.x_test]).reshape(n, -1)
        assert len(torch.unique(rows, dim=0)) == n


@pytest.mark.parametrize("test_fraction", [0.0, 1.0, -0.1, 1.5])
def test_bad_test_fraction(test_fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("breast_cancer", test_fraction=test_fraction)


def test_other_test_fraction():
    ds = load_dataset("digits", test_fraction=0.5, seed=3)
    assert len(ds.x_test) == 899 and len(ds.x_train) == 898


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match="available: .*breast_cancer.*mnist"):
        load_dataset("cifar10")


@pytest.mark.parametrize("name", [n for n, e in EXPECTED.items() if e[4]])
def test_missing_file(name, tmp_path):
    with pytest.raises(FileNotFoundError, match="FASTDP_DATA_DIR") as info:
        load_dataset(name, data_dir=tmp_path)
    assert str(tmp_path) in str(info.value) and "--data-dir" in str(info.value)


def test_bundled_sets_need_no_data_dir(tmp_path):
    assert load_dataset("digits", data_dir=tmp_path).num_classes == 10


def test_default_data_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTDP_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("FASTDP_DATA_DIR")
    found = default_data_dir()
    assert found is None or found == Path(__file__).resolve().parents[1].parent / "shared" / "data"


def test_read_idx_roundtrip(tmp_path):
    data = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte.gz"
    header = bytes([0, 0, 0x08, 3]) + np.array(data.shape, dtype=">u4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + data.tobytes())
    np.testing.assert_array_equal(read_idx(path), data)
    with gzip.open(path, "wb") as f:
        f.write(header + data.tobytes()[:-1])
    with pytest.raises(ValueError, match="IDX header"):
        read_idx(path)


@needs_files
def test_mnist_source_says_split():
    ds = load("mnist")
    assert "t10k" in ds.source and "split" in ds.source
    assert ds.x_train.shape[0] == 8000 and ds.x_test.shape[0] == 2000
