"""Data sets for DP training, read only from local files or scikit-learn's bundled sets (nothing is downloaded).

Every data set goes through one path: a reader returns raw features ``x`` and integer labels ``y``, then
:func:`split_and_standardise` makes a fixed, seeded, stratified train/test split and standardises the features with
statistics fitted on the training split only (tabular: per-feature mean/std; images: pixels scaled to [0, 1] by the
reader, then one global mean/std). The test split is never looked at when fitting the transform.

Privacy note: the standardisation statistics come from the private training split and are treated, as is usual in the
DP-SGD literature, as public preprocessing; they are not accounted for by the privacy accountant. The one-hot
vocabularies of the UCI tables are the sorted values present in the whole file: the schema's published codes, less
any code that never occurs (German credit lacks A47 and A95, hence 61 features, not 63).
"""

from __future__ import annotations

import gzip
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split

__all__ = ["DATASETS", "Dataset", "default_data_dir", "load_dataset", "read_idx", "split_and_standardise"]


@dataclass(frozen=True)
class Dataset:
    """A train/test split ready for training: float32 standardised features and int64 labels 0..num_classes-1."""

    name: str
    x_train: torch.Tensor  # float32, [n_train, *input_shape]
    y_train: torch.Tensor  # int64, [n_train]
    x_test: torch.Tensor  # float32, [n_test, *input_shape]
    y_test: torch.Tensor  # int64, [n_test]
    num_classes: int
    input_shape: tuple[int, ...]  # (d,) for tabular, (1, H, W) for images
    task: str  # "binary" or "multiclass"
    source: str  # human-readable provenance

    def __post_init__(self) -> None:
        """Refuse a split that training cannot use soundly: an empty split, NaN/Inf features, labels that are not
        int64 class indices in [0, num_classes), or rows that do not match (see ``docs/bad-inputs.md``)."""
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ValueError(f"{self.name}: num_classes must be an integer >= 2, got {self.num_classes!r}")
        for split, x, y in (("training", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2):
                raise ValueError(f"{self.name}: the {split} features must be a floating-point tensor [rows, *shape]")
            if x.shape[0] == 0:
                raise ValueError(
                    f"{self.name}: the {split} split has 0 rows; training needs at least one training and one test "
                    "row (check the data file, and test_fraction)"
                )
            if tuple(x.shape[1:]) != tuple(self.input_shape):
                raise ValueError(f"{self.name}: {split} features have shape {tuple(x.shape[1:])} per row, but "
                                 f"input_shape is {tuple(self.input_shape)}")  # fmt: skip
            if not (isinstance(y, torch.Tensor) and y.dtype == torch.int64 and y.shape == x.shape[:1]):
                got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(f"{self.name}: the {split} labels must be an int64 vector of {x.shape[0]} class "
                                 f"indices, got {got}")  # fmt: skip
            rows = ~torch.isfinite(x.reshape(x.shape[0], -1)).all(1).cpu()
            if bool(rows.any()):
                raise ValueError(_bad_rows_message(self.name, f"{split} rows", rows.numpy(), "NaN or Inf features",
                                                   _NONFINITE_HINT))  # fmt: skip
            rows = ((y < 0) | (y >= self.num_classes)).cpu()
            if bool(rows.any()):
                raise ValueError(_bad_rows_message(self.name, f"{split} rows", rows.numpy(),
                                                   f"labels outside [0, {self.num_classes})", _LABEL_HINT,
                                                   y.cpu().numpy()))  # fmt: skip


_NONFINITE_HINT = (
    "remove or impute them before training (fastdp imputes nothing: one non-finite feature makes that example's "
    "gradient, and with most variants the whole step's, non-finite)"
)
_LABEL_HINT = "labels must be class indices 0..num_classes-1 (cross-entropy indexes the logits with them)"


def _bad_rows_message(name: str, what: str, bad: np.ndarray, problem: str, hint: str, values=None) -> str:
    """'<name>: k of the n <what> have <problem> (first: row i[, value v]); <hint>'."""
    first = int(np.flatnonzero(bad)[0])
    value = "" if values is None else f", value {np.asarray(values)[first].item()!r}"
    return f"{name}: {int(bad.sum())} of the {bad.size} {what} have {problem} (first: row {first}{value}); {hint}"


def _check_raw(name: str, x: np.ndarray, y, num_classes: int) -> np.ndarray:
    """``y`` as int64 class indices, after refusing what a reader returned that training cannot use: no rows, rows
    of x and y that do not match, NaN/Inf features, labels that are NaN, non-integer or outside [0, num_classes).
    Rows are counted in file order."""
    if x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"{name}: the data set has no rows (features of shape {x.shape}); check the data file")
    if x.ndim < 2 or x[0].size == 0:
        raise ValueError(f"{name}: features of shape {x.shape}; expected [rows, *shape] with at least one feature")
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{name}: labels must be a vector of {len(x)} class indices (one per row), got {y.shape}")
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(1)
    if bad.any():
        raise ValueError(_bad_rows_message(name, "rows", bad, "NaN or Inf features", _NONFINITE_HINT))
    if y.dtype.kind == "b":
        y = y.astype(np.int64)
    elif y.dtype.kind == "f":
        bad = ~np.isfinite(y) | (y != np.round(y))
        if bad.any():
            raise ValueError(_bad_rows_message(name, "rows", bad, "a NaN or non-integer label", _LABEL_HINT, y))
    elif y.dtype.kind not in "iu":
        raise ValueError(f"{name}: labels must be integer class indices 0..{num_classes - 1}, got dtype {y.dtype}")
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        raise ValueError(_bad_rows_message(name, "rows", bad, f"labels outside [0, {num_classes})", _LABEL_HINT, y))
    return y.astype(np.int64)


# name -> files it reads, relative to the data directory (empty: bundled with scikit-learn).
_FILES: dict[str, tuple[str, ...]] = {
    "breast_cancer": (),
    "digits": (),
    "yeast": ("adbench/47_yeast.npz",),
    "magic": ("adbench/22_magic.gamma.npz",),
    "shuttle": ("adbench/32_shuttle.npz",),
    "campaign": ("adbench/5_campaign.npz",),
    "german_credit": ("uci/german_credit/german.data",),
    "nursery": ("uci/nursery/nursery.data",),
    "mnist": ("mnist/t10k-images-idx3-ubyte.gz", "mnist/t10k-labels-idx1-ubyte.gz"),
}

DATASETS: dict[str, str] = {
    "breast_cancer": "Wisconsin breast cancer, 569 x 30, binary (sklearn.datasets.load_breast_cancer, bundled)",
    "digits": "8x8 handwritten digits, 1797 images (1, 8, 8), 10 classes (sklearn.datasets.load_digits, bundled)",
    "yeast": "ADBench yeast, 1484 x 8, binary, y=1 anomaly (adbench/47_yeast.npz)",
    "magic": "ADBench MAGIC gamma telescope, 19020 x 10, binary, y=1 anomaly (adbench/22_magic.gamma.npz)",
    "shuttle": "ADBench Statlog shuttle, 49097 x 9, binary, y=1 anomaly (adbench/32_shuttle.npz)",
    "campaign": "ADBench bank marketing, 41188 x 62, binary, y=1 anomaly (adbench/5_campaign.npz)",
    "german_credit": "UCI German credit, 1000 rows, 13 categorical attributes one-hot -> 61 features, "
    "binary 0=good/1=bad (uci/german_credit/german.data)",
    "nursery": "UCI nursery, 12960 rows, 8 categorical attributes one-hot -> 27 features, 5 classes "
    "(uci/nursery/nursery.data)",
    "mnist": "MNIST t10k split only (the training images are not available offline), 10000 images (1, 28, 28), "
    "10 classes, seeded 8000/2000 train/test split at test_fraction=0.2 "
    "(mnist/t10k-images-idx3-ubyte.gz, mnist/t10k-labels-idx1-ubyte.gz)",
}

# Fixed label sets, so that the class index of a name never depends on which rows a file holds.
_GERMAN_CLASSES = ("1", "2")  # 1 = good -> 0, 2 = bad -> 1
_NURSERY_CLASSES = ("not_recom", "priority", "recommend", "spec_prior", "very_recom")  # sorted; 'recommend' has 2 rows

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def default_data_dir() -> Path | None:
    """The data directory: ``$FASTDP_DATA_DIR`` if set, else ``<repo root>/../shared/data`` if it exists, else None."""
    env = os.environ.get("FASTDP_DATA_DIR")
    if env:
        return Path(env).expanduser()
    candidate = Path(__file__).resolve().parents[2].parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


# ---------------------------------------------------------------------------------------------------------------
# Readers: one per file format. Each returns raw numpy arrays; no splitting or scaling here.
# ---------------------------------------------------------------------------------------------------------------


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzip'd if it ends in .gz).

    Layout: two zero bytes, a type byte (0x08 uint8 ... 0x0E float64), an ndim byte, ndim big-endian uint32 dims,
    then the data in C order, big-endian.
    """
    path = Path(path)
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4].hex()}, expected 0000<type><ndim>)")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    expected = offset + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: IDX header says dims {dims} ({expected} bytes in all), but the file has {len(raw)}")
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(dims).astype(dtype.newbyteorder("="))


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """ADBench npz: keys X (n, d) and y (n,), y=1 anomaly."""
    with np.load(path, allow_pickle=False) as f:  # labels as stored: split_and_standardise checks them
        return np.asarray(f["X"], dtype=np.float64), np.asarray(f["y"])


def _read_categorical_table(path: Path, sep: str | None, classes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Delimited text, label in the last field; numeric columns kept, the others one-hot over sorted categories.

    A first row whose label is not one of ``classes`` is taken as a header and skipped; blank lines are ignored.
    Labels map to their index in ``classes``.
    """
    rows = [line.split(sep) for line in path.read_text().splitlines() if line.strip()]
    if rows and rows[0][-1].strip() not in classes:
        rows = rows[1:]
    rows = [[field.strip() for field in row] for row in rows]
    bad = [row for row in rows if len(row) != len(rows[0]) or row[-1] not in classes]
    if bad:
        raise ValueError(f"{path}: {len(bad)} rows with the wrong field count or a label not in {classes}: {bad[0]}")
    columns = list(zip(*rows, strict=True))
    features = []
    for column in columns[:-1]:
        try:
            features.append(np.array([float(v) for v in column])[:, None])
        except ValueError:
            categories = np.array(sorted(set(column)))
            features.append((np.array(column)[:, None] == categories[None, :]).astype(np.float64))
    y = np.array([classes.index(v) for v in columns[-1]], dtype=np.int64)
    return np.concatenate(features, axis=1), y


# ---------------------------------------------------------------------------------------------------------------
# Shared split + standardise.
# ---------------------------------------------------------------------------------------------------------------


def split_and_standardise(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    source: str,
    seed: int = 0,
    test_fraction: float = 0.2,
    image: bool = False,
) -> Dataset:
    """Seeded stratified split of ``(x, y)``, then standardise with training-split statistics only.

    ``x`` is [n, d] (tabular: one mean/std per feature) or [n, C, H, W] already scaled to [0, 1] (image: one global
    mean/std over all training pixels). A zero std (constant feature) is replaced by 1.
    ``n_test = ceil(test_fraction * n)`` (sklearn's rule); the same seed gives the same split. Rows keep their file
    order within each split. The statistics are population ones (ddof=0), so train features end with mean 0, std 1.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x = np.asarray(x, dtype=np.float64)
    y = _check_raw(name, x, y, num_classes)
    n_test = math.ceil(test_fraction * len(y))
    if len(y) - n_test < 1:
        raise ValueError(f"{name}: {len(y)} rows at test_fraction={test_fraction} leave 0 training rows "
                         f"({n_test} test); training needs at least one of each")  # fmt: skip
    try:
        train_idx, test_idx = train_test_split(np.arange(len(y)), test_size=test_fraction, random_state=seed,
                                               stratify=y)  # fmt: skip
    except ValueError as exc:  # e.g. a class with a single row cannot be stratified
        raise ValueError(f"{name}: cannot make a stratified train/test split of its {len(y)} rows: {exc}") from exc
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    axis = None if image else 0
    mean, std = x[train_idx].mean(axis=axis), x[train_idx].std(axis=axis)
    std = np.where(std > 1e-12 * np.maximum(np.abs(mean), 1.0), std, 1.0)  # constant feature: std 0 up to rounding
    x = (x - mean) / std

    def tensors(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x[idx].astype(np.float32)), torch.from_numpy(y[idx])

    (x_train, y_train), (x_test, y_test) = tensors(train_idx), tensors(test_idx)
    return Dataset(
        name=name,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        input_shape=tuple(x.shape[1:]),
        task="binary" if num_classes == 2 else "multiclass",
        source=source,
    )


def load_dataset(name: str, data_dir: str | Path | None = None, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Load data set ``name`` (see :data:`DATASETS`) with a seeded stratified split and train-fitted standardisation.

    ``data_dir`` is the folder holding ``adbench/``, ``uci/`` and ``mnist/`` (the shared/data folder); None means
    :func:`default_data_dir`. The sklearn-bundled sets need no data directory.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(sorted(DATASETS))}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    paths = _resolve_files(name, data_dir)
    split = dict(seed=seed, test_fraction=test_fraction)
    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        bunch = load_breast_cancer()
        return split_and_standardise(name, bunch.data, bunch.target, 2, "sklearn.datasets.load_breast_cancer", **split)
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()  # pixel values 0..16
        x = bunch.images[:, None, :, :] / 16.0
        return split_and_standardise(name, x, bunch.target, 10, "sklearn.datasets.load_digits", image=True, **split)
    if name in ("yeast", "magic", "shuttle", "campaign"):
        x, y = _read_npz(paths[0])
        return split_and_standardise(name, x, y, 2, str(paths[0]), **split)
    if name == "german_credit":
        x, y = _read_categorical_table(paths[0], None, _GERMAN_CLASSES)
        return split_and_standardise(name, x, y, 2, str(paths[0]), **split)
    if name == "nursery":
        x, y = _read_categorical_table(paths[0], ",", _NURSERY_CLASSES)
        return split_and_standardise(name, x, y, len(_NURSERY_CLASSES), str(paths[0]), **split)
    # mnist
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
        raise ValueError(f"mnist: images {images.shape} and labels {labels.shape} do not match (N, 28, 28) / (N,)")
    source = (
        f"{paths[0]} + {paths[1]} (MNIST t10k split only, the training images are not available offline; "
        f"seeded stratified train/test split of its {len(labels)} images, test_fraction={test_fraction}, seed={seed})"
    )
    x = images[:, None, :, :].astype(np.float64) / 255.0
    return split_and_standardise(name, x, labels, 10, source, image=True, **split)


def _resolve_files(name: str, data_dir: str | Path | None) -> list[Path]:
    """Absolute paths of the files ``name`` reads; FileNotFoundError naming the first missing one."""
    files = _FILES[name]
    if not files:
        return []
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    hint = "pass --data-dir (data_dir=...) or set FASTDP_DATA_DIR to the shared/data folder that holds it"
    if root is None:
        raise FileNotFoundError(
            f"dataset {name!r} reads {files[0]!r} under a data directory, but none was given and the default "
            f"<repo>/../shared/data does not exist; {hint}"
        )
    paths = [root / f for f in files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"dataset {name!r}: expected file {path} ({path.name} under {root}); {hint}")
    return paths
