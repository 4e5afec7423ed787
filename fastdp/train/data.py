"""Data sets for DP training: the bundled ones (local files or scikit-learn's bundled sets; nothing is downloaded) and
the user's own file (CSV/TSV, Parquet, ``.npz``: :func:`load_file`, ``fastdp train --data FILE``).

Every data set goes through one path: a reader returns raw features ``x`` and labels ``y``; :func:`split` checks them
and makes a fixed, seeded, stratified train/test split (:class:`RawSplit`); a standardisation is fitted on the
training split only (:class:`Standardisation`: :func:`fit_exact`, :func:`fit_dp` or :func:`fit_off`); and
:func:`make_dataset` applies it to both splits. The test split is never looked at when fitting the transform.

Standardisation and privacy (``docs/data.md``). A transform fitted on the training split depends on every training
example: without noise, the model trained after it is not covered by the accounted epsilon. Hence three modes:

* ``exact``: per-feature mean/std of the training split (images: one global mean/std), no noise. Non-private runs,
  :func:`load_dataset` and :func:`split_and_standardise`; private training refuses it.
* ``dp``: a Gaussian-mechanism estimate (:func:`fit_dp`): per-feature ranges from a noisy histogram of octaves, then
  noisy sums of the clipped features and of their squares. Its releases are accounted with the training steps.
* ``off``: no fitted transform: tabular features as they are in the file; images as their pixels scaled to [0, 1]
  by the public constant of their format (/255 for uint8, /16 for digits), which every reader applies.

The one-hot vocabularies of the UCI tables and the label set of a user's file are the sorted values present in the
whole file: a schema, treated as public like the column names (German credit lacks A47 and A95, hence 61 features,
not 63). The number of training rows N is public too, as everywhere in fastdp (the sample rate q = B / N).

Where the files come from: ``data_dir`` (``--data-dir``, ``$FASTDP_DATA_DIR``) holds ``adbench/``, ``uci/`` and
``mnist/`` as :data:`_FILES` lays them out. The UCI tables are the UCI Machine Learning Repository's own files (Adult
https://archive.ics.uci.edu/dataset/2/adult, default of credit card clients .../dataset/350 saved from its .xls as
CSV, students' dropout .../dataset/697, German credit .../dataset/144, nursery .../dataset/76); a missing file's error
names its download page (:data:`_DOWNLOAD`). Their readers accept UCI's files as downloaded and the shared copies
(``../shared/data/README.md``: a header line added to Adult's files, the credit .xls exported with an ``ID,X1..X23,Y``
header), and refuse a malformed row naming the file and line.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import math
import numbers
import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split

__all__ = [
    "DATASETS",
    "FILE_FORMATS",
    "STANDARDIZE",
    "STANDARDIZE_PRECISION",
    "Dataset",
    "RawSplit",
    "Standardisation",
    "default_data_dir",
    "dp_noised_coordinates",
    "fastdp_noise",
    "file_format",
    "fit_dp",
    "fit_exact",
    "fit_off",
    "image_moment_sums",
    "load_dataset",
    "load_file",
    "load_raw",
    "make_dataset",
    "moment_sensitivity",
    "moment_sums",
    "precision_noise_multiplier",
    "range_from_histogram",
    "range_histogram",
    "range_sensitivity",
    "read_idx",
    "release_noise_multipliers",
    "split",
    "split_and_standardise",
]

# --standardize: auto = dp for private runs, exact for non-private runs
STANDARDIZE = ("auto", "dp", "exact", "off")


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
    "adult": ("uci/adult/adult.data", "uci/adult/adult.test"),
    "default_credit": ("uci/default_credit_card/UCI_Credit_Card.csv",),
    "dropout": ("uci/student_dropout/data.csv",),
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
    "adult": "UCI Adult (census income), adult.data + adult.test = 48842 rows, 6 numeric + 8 categorical attributes "
    "one-hot ('?' kept as a category) -> 108 features, binary 0=<=50K/1=>50K (uci/adult/adult.data, adult.test)",
    "default_credit": "UCI default of credit card clients, 30000 rows, 20 numeric + 3 categorical attributes (sex, "
    "education, marriage) one-hot -> 33 features, binary 1=default (uci/default_credit_card/UCI_Credit_Card.csv)",
    "dropout": "UCI predict students' dropout and academic success, 4424 rows, 27 numeric + 9 categorical attributes "
    "one-hot -> 247 features, 3 classes Dropout/Enrolled/Graduate (uci/student_dropout/data.csv)",
    "mnist": "MNIST t10k split only (the training images are not available offline), 10000 images (1, 28, 28), "
    "10 classes, seeded 8000/2000 train/test split at test_fraction=0.2 "
    "(mnist/t10k-images-idx3-ubyte.gz, mnist/t10k-labels-idx1-ubyte.gz)",
}

# Fixed label sets, so that the class index of a name never depends on which rows a file holds.
_GERMAN_CLASSES = ("1", "2")  # 1 = good -> 0, 2 = bad -> 1
_NURSERY_CLASSES = ("not_recom", "priority", "recommend", "spec_prior", "very_recom")  # sorted; 'recommend' has 2 rows


@dataclass(frozen=True)
class _UciTable:
    """The layout of a UCI table, by field position: ``columns`` names every field of a data row in file order (the
    label included); ``categorical`` fields are one-hot encoded over the sorted values present in the file(s) (a
    schema, public like the column names); ``dropped`` fields (a row id) are read and checked to be present, not used;
    every other field must be a finite number. ``classes`` lists the label values in class-index order, compared after
    stripping ``label_suffix`` (adult.test writes ``<=50K.``). At most ``header_lines`` leading lines that are not
    data rows (their label is not a class and a numeric field is not a number) are skipped as headers; lines starting
    with ``|`` are UCI comments (adult.test's first line in UCI's own file)."""

    columns: tuple[str, ...]
    label: str
    classes: tuple[str, ...]
    categorical: tuple[str, ...]
    sep: str
    source: str  # where a user gets the file(s), for error messages and docs
    dropped: tuple[str, ...] = ()
    label_suffix: str = ""
    header_lines: int = 1

    def __post_init__(self) -> None:
        named = {self.label, *self.categorical, *self.dropped}
        assert named <= set(self.columns) and len(set(self.columns)) == len(self.columns), self.columns


# UCI Adult (Becker & Kohavi 1996): adult.names' attributes in file order; '?' (missing) is kept as its own category.
_ADULT_COLUMNS = ("age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
                  "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country",
                  "income")  # fmt: skip
_ADULT_CATEGORICAL = ("workclass", "education", "marital-status", "occupation", "relationship", "race", "sex",
                      "native-country")  # fmt: skip
_ADULT = _UciTable(
    columns=_ADULT_COLUMNS,
    label="income",
    classes=("<=50K", ">50K"),
    categorical=_ADULT_CATEGORICAL,
    sep=",",
    source="https://archive.ics.uci.edu/dataset/2/adult (doi:10.24432/C5XW20): adult.data and adult.test from its zip",
    label_suffix=".",
)
# UCI default of credit card clients (Yeh & Lien 2009): ID, X1..X23, Y. UCI distributes an .xls whose CSV export has
# two header rows (X1..X23, then LIMIT_BAL..); both are skipped. PAY_0..PAY_6 (X6-X11, months of delay, -2..8) are
# ordinal and kept numeric; sex, education and marriage (X2-X4) are codes, one-hot (education 0, 5, 6 and marriage 0
# are undocumented codes present in the data, each its own category).
_DEFAULT_CREDIT_COLUMNS = ("ID", "LIMIT_BAL", "SEX", "EDUCATION", "MARRIAGE", "AGE", "PAY_0", "PAY_2", "PAY_3",
                           "PAY_4", "PAY_5", "PAY_6", "BILL_AMT1", "BILL_AMT2", "BILL_AMT3", "BILL_AMT4", "BILL_AMT5",
                           "BILL_AMT6", "PAY_AMT1", "PAY_AMT2", "PAY_AMT3", "PAY_AMT4", "PAY_AMT5", "PAY_AMT6",
                           "default payment next month")  # fmt: skip
_DEFAULT_CREDIT = _UciTable(
    columns=_DEFAULT_CREDIT_COLUMNS,
    label="default payment next month",
    classes=("0", "1"),
    categorical=("SEX", "EDUCATION", "MARRIAGE"),
    sep=",",
    source="https://archive.ics.uci.edu/dataset/350/default+of+credit+card+clients (doi:10.24432/C55S3H): its .xls "
    "saved as CSV (comma-separated, header rows kept or not)",
    dropped=("ID",),
    header_lines=2,
)
# UCI predict students' dropout and academic success (Realinho et al. 2022), data.csv from the UCI zip: ';'-separated,
# UTF-8 with BOM. Integer-coded nominal attributes are one-hot; the 0/1 attributes (attendance, displaced, special
# needs, debtor, fees up to date, gender, scholarship, international) and the ordinal application order stay numeric.
_DROPOUT_COLUMNS = ("Marital status", "Application mode", "Application order", "Course", "Daytime/evening attendance",
                    "Previous qualification", "Previous qualification (grade)", "Nacionality", "Mother's qualification",
                    "Father's qualification", "Mother's occupation", "Father's occupation", "Admission grade",
                    "Displaced", "Educational special needs", "Debtor", "Tuition fees up to date", "Gender",
                    "Scholarship holder", "Age at enrollment", "International", "Curricular units 1st sem (credited)",
                    "Curricular units 1st sem (enrolled)", "Curricular units 1st sem (evaluations)",
                    "Curricular units 1st sem (approved)", "Curricular units 1st sem (grade)",
                    "Curricular units 1st sem (without evaluations)", "Curricular units 2nd sem (credited)",
                    "Curricular units 2nd sem (enrolled)", "Curricular units 2nd sem (evaluations)",
                    "Curricular units 2nd sem (approved)", "Curricular units 2nd sem (grade)",
                    "Curricular units 2nd sem (without evaluations)", "Unemployment rate", "Inflation rate", "GDP",
                    "Target")  # fmt: skip
_DROPOUT_CATEGORICAL = ("Marital status", "Application mode", "Course", "Previous qualification", "Nacionality",
                        "Mother's qualification", "Father's qualification", "Mother's occupation",
                        "Father's occupation")  # fmt: skip
_DROPOUT = _UciTable(
    columns=_DROPOUT_COLUMNS,
    label="Target",
    classes=("Dropout", "Enrolled", "Graduate"),
    categorical=_DROPOUT_CATEGORICAL,
    sep=";",
    source="https://archive.ics.uci.edu/dataset/697/predict+students+dropout+and+academic+success "
    "(doi:10.24432/C5MC89): data.csv from its zip",
)
_UCI_TABLES = {"adult": _ADULT, "default_credit": _DEFAULT_CREDIT, "dropout": _DROPOUT}
# Where a user without the shared data folder gets each file set (named in the missing-file error).
_DOWNLOAD = {
    "german_credit": "https://archive.ics.uci.edu/dataset/144/statlog+german+credit+data (doi:10.24432/C5NC77): "
    "german.data",
    "nursery": "https://archive.ics.uci.edu/dataset/76/nursery (doi:10.24432/C5P88W): nursery.data",
    **{name: table.source for name, table in _UCI_TABLES.items()},
}

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


def _is_float(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _uci_rows(path: Path, table: _UciTable) -> list[list[str]]:
    """The data rows of one file of ``table`` (fields stripped, label suffix removed), every one checked: the field
    count, the label, a finite number in every numeric field. ValueError naming the file, its line and the field."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (UnicodeDecodeError, OSError) as exc:
        raise ValueError(
            f"{path}: cannot read it as UTF-8 text ({exc}); expected the UCI file from {table.source}"
        ) from exc
    label = table.columns.index(table.label)
    skipped = {table.label, *table.categorical, *table.dropped}
    numeric = [i for i, name in enumerate(table.columns) if name not in skipped]
    rows: list[list[str]] = []
    headers, bad = 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("|"):
            continue
        fields = [field.strip() for field in line.split(table.sep)]
        if len(fields) == len(table.columns) and fields[label].endswith(table.label_suffix):
            fields[label] = fields[label][: len(fields[label]) - len(table.label_suffix)]
        is_data = len(fields) == len(table.columns) and fields[label] in table.classes
        numbers_ok = all(_is_float(fields[i]) for i in numeric if i < len(fields))
        if not rows and headers < table.header_lines and not is_data and not numbers_ok:
            headers += 1  # a header line (column names), before the first data row
            continue
        problem = None
        if len(fields) != len(table.columns):
            problem = (f"{len(fields)} field{'s' if len(fields) != 1 else ''} separated by {table.sep!r}, expected "
                       f"{len(table.columns)}")  # fmt: skip
        elif fields[label] not in table.classes:
            problem = f"label {fields[label]!r} is not one of {', '.join(table.classes)}"
        elif not numbers_ok:
            i = next(i for i in numeric if not _is_float(fields[i]))
            problem = f"{table.columns[i]!r} is {fields[i]!r}, not a finite number"
        if problem is None:
            rows.append(fields)
        else:
            bad.append((number, problem))
    if bad:
        number, problem = bad[0]
        raise ValueError(f"{path}: {len(bad)} malformed data line{'s' if len(bad) > 1 else ''} (first: line {number}, "
                         f"{problem}); expected the UCI file from {table.source}")  # fmt: skip
    if not rows:
        raise ValueError(f"{path}: no data rows; expected the UCI file from {table.source}")
    return rows


def _category_order(value: str) -> tuple:
    """Sort key of a category: integer codes in numeric order, before any text, text in string order."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def _read_uci_table(paths: Sequence[Path], table: _UciTable) -> tuple[np.ndarray, np.ndarray]:
    """Features [n, d] (numeric fields as they are, categorical fields one-hot over the sorted values present in all
    ``paths``, in column order) and class indices of the rows of ``paths`` concatenated in order."""
    rows = [row for path in paths for row in _uci_rows(path, table)]
    features = []
    for i, name in enumerate(table.columns):
        if name == table.label or name in table.dropped:
            continue
        column = [row[i] for row in rows]
        if name in table.categorical:
            categories = np.array(sorted(set(column), key=_category_order))
            features.append((np.array(column)[:, None] == categories[None, :]).astype(np.float64))
        else:
            features.append(np.array([float(v) for v in column])[:, None])
    label = table.columns.index(table.label)
    y = np.array([table.classes.index(row[label]) for row in rows], dtype=np.int64)
    return np.concatenate(features, axis=1), y


# ---------------------------------------------------------------------------------------------------------------
# Split.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawSplit:
    """A checked, seeded, stratified train/test split before any fitted transform: float64 features (images already
    scaled to [0, 1] by the public constant of their format), int64 labels 0..num_classes-1."""

    name: str
    x_train: np.ndarray  # float64, [n_train, *input_shape]
    y_train: np.ndarray  # int64, [n_train]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    image: bool  # [n, C, H, W] pixels in [0, 1] (one global transform) rather than [n, d] features
    source: str  # human-readable provenance
    classes: tuple[str, ...] | None = None  # a file's label names by class index; None: the bundled set's own
    notes: tuple[str, ...] = ()  # what the reader decided for the user (label mapping), to show them
    provenance: dict | None = None  # a file's path, sha256, format, target column, ...

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def split(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    source: str,
    seed: int = 0,
    test_fraction: float = 0.2,
    image: bool = False,
    **info,
) -> RawSplit:
    """Check the raw rows (``_check_raw``) and make the seeded stratified split of ``(x, y)``.

    ``n_test = ceil(test_fraction * n)`` (sklearn's rule); the same seed gives the same split. Rows keep their file
    order within each split. ``info``: ``classes``, ``notes``, ``provenance`` of :class:`RawSplit`.
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
    return RawSplit(name, x[train_idx], y[train_idx], x[test_idx], y[test_idx], num_classes, image, source, **info)


# ---------------------------------------------------------------------------------------------------------------
# Standardisation: exact (non-private), dp (Gaussian mechanism, accounted), off.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Standardisation:
    """The transform of every row of both splits: ``(clip(x, -bound, bound) - mean) / std``.

    ``mode``: ``"exact"`` (training-split statistics, no noise), ``"dp"`` (:func:`fit_dp`) or ``"off"`` (identity).
    Tabular: ``mean``, ``std`` (and, dp, ``bound``) per feature; images: one global ``mean`` and ``std``.
    ``noise_multipliers``: dp, one per release (``releases``), noise std / add-remove sensitivity, as the accountant
    records them (each a full-batch Gaussian mechanism: ``PrivacyAccountant.step(sigma, 1.0, 1)``).
    """

    mode: str
    image: bool
    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    bound: np.ndarray | None = None
    noise_multipliers: tuple[float, ...] = ()
    releases: tuple[str, ...] = ()

    def apply(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if self.mode == "off":
            return x
        if self.bound is not None:
            x = np.clip(x, -self.bound, self.bound)
        return (x - self.mean) / self.std

    def state_dict(self) -> dict:
        """Plain lists and floats (for checkpoints, ``torch.load(weights_only=True)``, and JSON results)."""

        def plain(a: np.ndarray | None):
            return None if a is None else np.asarray(a, dtype=np.float64).tolist()

        return {
            "mode": self.mode,
            "image": self.image,
            "mean": plain(self.mean),
            "std": plain(self.std),
            "bound": plain(self.bound),
            "noise_multipliers": list(self.noise_multipliers),
            "releases": list(self.releases),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> Standardisation:
        def array(v):
            return None if v is None else np.asarray(v, dtype=np.float64)

        return cls(mode=state["mode"], image=bool(state["image"]), mean=array(state["mean"]), std=array(state["std"]),
                   bound=array(state["bound"]), noise_multipliers=tuple(float(s) for s in state["noise_multipliers"]),
                   releases=tuple(state["releases"]))  # fmt: skip

    def describe(self) -> str:
        if self.mode == "off":
            return ("off: images scaled to [0, 1] by the public constant of their format, no fitted transform"
                    if self.image else "off: features as they are in the data, no fitted transform")  # fmt: skip
        if self.mode == "exact":
            return ("exact: mean and std of the training split, without noise (not covered by any epsilon; "
                    "non-private runs only)")  # fmt: skip
        sigmas = ", ".join(f"{r} sigma={s:.4g}" for r, s in zip(self.releases, self.noise_multipliers, strict=True))
        return (f"dp: {'one global' if self.image else 'per-feature'} mean and std estimated by the Gaussian "
                f"mechanism on the training split ({sigmas}; docs/data.md), accounted in epsilon")  # fmt: skip


def fit_exact(x_train: np.ndarray, image: bool = False) -> Standardisation:
    """Training-split mean/std without noise: per feature (tabular) or one global pair (images). A zero std (a
    constant feature, up to rounding) is replaced by 1. Population statistics (ddof=0): training features end with
    mean 0 and std 1. Not private: for non-private runs."""
    x_train = np.asarray(x_train, dtype=np.float64)
    axis = None if image else 0
    mean, std = x_train.mean(axis=axis), x_train.std(axis=axis)
    std = np.where(std > 1e-12 * np.maximum(np.abs(mean), 1.0), std, 1.0)  # constant feature: std 0 up to rounding
    return Standardisation("exact", image, mean=np.asarray(mean), std=np.asarray(std))


def fit_off(image: bool = False) -> Standardisation:
    """No fitted transform (nothing depends on the data)."""
    return Standardisation("off", image)


# The octaves of the range histogram: bucket e holds |x| in [2^(e-1), 2^e); e = OCTAVE_LOW also holds 0 and every
# |x| < 2^(OCTAVE_LOW - 1), e = OCTAVE_HIGH every |x| >= 2^(OCTAVE_HIGH - 1).
OCTAVE_LOW, OCTAVE_HIGH = -20, 40
_OCTAVES = OCTAVE_HIGH - OCTAVE_LOW + 1
# A bucket counts as populated when its noisy count is at least this many noise stds (a false one among 61 buckets
# x d features has probability about 61 d 2.9e-7) and at least half a row.
RANGE_THRESHOLD_STDS = 5.0
# The variance estimate is floored at this many noise stds of the second-moment estimate (a variance that the noise
# alone made small would blow the feature up), and at 2^-40 (in units of the bound squared).
VARIANCE_FLOOR_STDS = 2.0


def range_sensitivity(features: int) -> float:
    """Add/remove L2 sensitivity of :func:`range_histogram`: a row adds 1 to one bucket of each of the d features'
    histograms, so the released [d, 61] counts move by d ones: sqrt(d), exactly (integer counts are exact in
    float64)."""
    return math.sqrt(features)


def moment_sensitivity(groups: int, rows: int) -> float:
    """Add/remove L2 sensitivity of :func:`moment_sums` (``groups`` = d features) and :func:`image_moment_sums`
    (``groups`` = 1), for data sets of up to ``rows`` rows.

    A row contributes, per group, (m, s - 1) with m in [-1, 1], s in [m^2, 1] (tabular: m = u = clip(x / b, -1, 1),
    s = u^2; images: m, s the means of u and u^2 over the image's pixels, u = 2p - 1): m^2 + (1 - s)^2 <= s + (1 -
    s)^2 <= 1, with equality at u in {-1, 0, 1}; over the groups sqrt(groups). Rounding: each term is computed with
    relative errors of a few 2^-53 (<= 2^-40 in all), and each released sum is correctly rounded (``math.fsum``) with
    |sum| <= rows, so the two neighbours' sums differ from the exact contribution by at most 2^-52 rows per coordinate;
    over 2 groups coordinates sqrt(2 groups) 2^-52 rows <= sqrt(groups) rows 2^-50. Hence
    sqrt(groups) (1 + 2^-40 + rows 2^-50).
    """
    return math.sqrt(groups) * (1.0 + 2.0**-40 + (rows + 1) * 2.0**-50)


def _octave(x: np.ndarray) -> np.ndarray:
    """The octave e of every |x| (bucket e: |x| in [2^(e-1), 2^e)), exactly (``np.frexp``), clamped to the range."""
    _, exponent = np.frexp(np.abs(x))  # |x| = m 2^e with m in [0.5, 1); x = 0 gives e = 0
    exponent = np.where(x == 0, OCTAVE_LOW, exponent)
    return np.clip(exponent, OCTAVE_LOW, OCTAVE_HIGH)


def range_histogram(x: np.ndarray) -> np.ndarray:
    """The noiseless first release of :func:`fit_dp`: for each feature j of ``x`` [n, d], the number of rows whose
    |x_ij| falls in each octave ``OCTAVE_LOW..OCTAVE_HIGH`` ([d, 61] float64 counts)."""
    x = np.asarray(x, dtype=np.float64)
    buckets = _octave(x) - OCTAVE_LOW
    return np.stack([np.bincount(buckets[:, j], minlength=_OCTAVES) for j in range(x.shape[1])]).astype(np.float64)


def range_from_histogram(noisy: np.ndarray, noise_std: float) -> np.ndarray:
    """Per-feature clip bounds (powers of 2) from the noisy octave histogram: one octave above the highest octave whose
    noisy count reaches ``RANGE_THRESHOLD_STDS`` noise stds (at least half a row), or above the fullest octave where
    none does. Post-processing of the release: no further privacy cost."""
    threshold = max(RANGE_THRESHOLD_STDS * noise_std, 0.5)
    bounds = []
    for counts in np.asarray(noisy, dtype=np.float64):
        populated = np.flatnonzero(counts >= threshold)
        top = int(populated.max()) if populated.size else int(np.argmax(counts))
        bounds.append(2.0 ** (top + OCTAVE_LOW + 1))
    return np.array(bounds)


def _fsum_columns(a: np.ndarray) -> np.ndarray:
    """Correctly rounded column sums (``math.fsum``): rounding that depends on the order of the rows cannot add to
    the sensitivity beyond :func:`moment_sensitivity`'s margin."""
    return np.array([math.fsum(column) for column in np.asarray(a, dtype=np.float64).T.tolist()])


def moment_sums(x: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """The noiseless second release of :func:`fit_dp` (tabular): with u = clip(x / bound, -1, 1) per feature, the
    column sums of u and of u^2 - 1 ([2, d]). Add/remove sensitivity: :func:`moment_sensitivity` (d, rows)."""
    u = np.clip(np.asarray(x, dtype=np.float64) / np.asarray(bound, dtype=np.float64), -1.0, 1.0)
    return np.stack([_fsum_columns(u), _fsum_columns(u * u - 1.0)])


def image_moment_sums(x: np.ndarray) -> np.ndarray:
    """The noiseless release of :func:`fit_dp` for images with pixels in [0, 1]: with u = 2p - 1 in [-1, 1], m and
    s the means of u and u^2 over each image (s raised to m^2 where rounding left it below), the sums over the
    images of m and of s - 1 ([2, 1]). Add/remove sensitivity: :func:`moment_sensitivity` (1, rows)."""
    x = np.asarray(x, dtype=np.float64)
    u = np.clip(2.0 * x.reshape(len(x), -1) - 1.0, -1.0, 1.0)
    m = np.clip(u.mean(axis=1), -1.0, 1.0)
    s = np.clip(np.maximum((u * u).mean(axis=1), m * m), 0.0, 1.0)
    return np.stack([_fsum_columns(m[:, None]), _fsum_columns((s - 1.0)[:, None])])


Noise = Callable[[int, tuple[int, ...], float], np.ndarray]


def fastdp_noise(reproducible_seed: int | None = None) -> Noise:
    """Noise for :func:`fit_dp`'s releases, from fastdp's noise stream (``fastdp.ops.add_noise_``: the sum of 4
    Box-Muller draws divided by 2, as every fastdp release): ``draw(release, shape, std)``. Default: a fresh 126-bit
    OS-entropy key per release. ``reproducible_seed``: key = the seed, counter = the release index (NOT FOR RELEASE,
    like the trainer's reproducible privacy seed)."""
    from fastdp.ops import add_noise_

    def draw(release: int, shape: tuple[int, ...], std: float) -> np.ndarray:
        values = torch.zeros(int(np.prod(shape)), dtype=torch.float64)
        if reproducible_seed is None:
            add_noise_(values, float(std), secure=True)
        else:
            add_noise_(values, float(std), reproducible_seed, release, num_draws=4)
        return values.numpy().reshape(shape)

    return draw


def _moments(noisy: np.ndarray, rows: int, noise_std: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of u from the noisy sums of m and s - 1 (post-processing): mean clamped to [-1, 1], second moment
    to [0, 1], variance floored (``VARIANCE_FLOOR_STDS``)."""
    mean = np.clip(noisy[0] / rows, -1.0, 1.0)
    second = np.clip(noisy[1] / rows + 1.0, 0.0, 1.0)
    floor = max(VARIANCE_FLOOR_STDS * noise_std / rows, 2.0**-40)
    return mean, np.sqrt(np.maximum(second - mean * mean, floor))


def fit_dp(x_train: np.ndarray, image: bool, noise_multiplier: float, noise: Noise | None = None) -> Standardisation:
    """Mean and std of the training split estimated with the Gaussian mechanism, add/remove-one adjacency.

    Tabular ``x_train`` [n, d], two releases, each with noise multiplier ``noise_multiplier * sqrt(2)`` (together
    one Gaussian mechanism of multiplier ``noise_multiplier``: sigma^-2 = 2 (sigma sqrt 2)^-2):

    1. range: the octave histogram of every feature (:func:`range_histogram`, sensitivity sqrt(d)), giving each
       feature a clip bound b_j, a power of 2 (:func:`range_from_histogram`);
    2. moments: the sums of u = clip(x / b, -1, 1) and of u^2 - 1 (:func:`moment_sums`, sensitivity
       :func:`moment_sensitivity`); b is public after release 1.

    Images ``x_train`` [n, C, H, W] with pixels in [0, 1] (a public range): one release, the sums of each image's mean
    u and mean u^2 - 1 for u = 2p - 1 (:func:`image_moment_sums`, sensitivity about 1), multiplier
    ``noise_multiplier``.

    Each release adds N(0, (sigma * sensitivity)^2) to every coordinate (``noise``: default :func:`fastdp_noise`,
    OS entropy). The mean and std (floored: ``VARIANCE_FLOOR_STDS``) are post-processing. The features are then
    clipped to [-b, b] and standardised, both splits alike. N is public.
    """
    x_train = np.asarray(x_train, dtype=np.float64)
    sigma = float(noise_multiplier)
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"the standardisation's noise multiplier must be finite and > 0, got {noise_multiplier!r}")
    noise = fastdp_noise() if noise is None else noise
    rows = len(x_train)
    if image:
        std = sigma * moment_sensitivity(1, rows)
        sums = image_moment_sums(x_train)
        mean_u, std_u = _moments(sums + noise(0, sums.shape, std), rows, std)
        return Standardisation("dp", True, mean=(mean_u[0] + 1.0) / 2.0, std=std_u[0] / 2.0,
                               noise_multipliers=(sigma,), releases=("moments",))  # fmt: skip
    release_sigma = release_noise_multipliers(False, sigma)[0]
    features = x_train.shape[1]
    std = release_sigma * range_sensitivity(features)
    histogram = range_histogram(x_train)
    bound = range_from_histogram(histogram + noise(0, histogram.shape, std), std)
    std = release_sigma * moment_sensitivity(features, rows)
    sums = moment_sums(x_train, bound)
    mean_u, std_u = _moments(sums + noise(1, sums.shape, std), rows, std)
    return Standardisation("dp", False, mean=bound * mean_u, std=bound * std_u, bound=bound,
                           noise_multipliers=(release_sigma, release_sigma), releases=("range", "moments"))  # fmt: skip


# The default standardisation's estimates have at least this noise std, in units of each feature's clip range (of
# the pixel range for images): Trainer._default_standardize_noise.
STANDARDIZE_PRECISION = 0.05


def precision_noise_multiplier(rows: int, input_shape: tuple[int, ...], image: bool,
                               precision: float = STANDARDIZE_PRECISION) -> float:  # fmt: skip
    """The noise multiplier of :func:`fit_dp` at which its moment estimates (the means of u and u^2, u in [-1, 1])
    have noise std ``precision``: release noise std sigma_r sqrt(groups) over ``rows`` rows. Tabular (d features,
    two releases at sigma sqrt 2): sigma = precision rows / sqrt(2 d); images (one release, one group): precision
    rows."""
    if image:
        return precision * rows
    return precision * rows / math.sqrt(2.0 * math.prod(input_shape))


def release_noise_multipliers(image: bool, noise_multiplier: float) -> list[float]:
    """The noise multiplier of each release of :func:`fit_dp` at ``noise_multiplier`` (what the accountant records):
    images one release at sigma; tabular two at sigma sqrt(2), together one Gaussian mechanism at sigma."""
    return [float(noise_multiplier)] if image else [float(noise_multiplier) * math.sqrt(2.0)] * 2


def dp_noised_coordinates(raw: RawSplit) -> list[int]:
    """The number of noised coordinates of each release of :func:`fit_dp` on ``raw`` (for the bounded noise's
    truncation bound, ``fastdp.privacy.accounting.truncation_delta``)."""
    if raw.image:
        return [2]
    features = raw.x_train.shape[1]
    return [features * _OCTAVES, 2 * features]


def make_dataset(raw: RawSplit, standardisation: Standardisation) -> Dataset:
    """Apply ``standardisation`` to both splits of ``raw``: float32 tensors, checked by :class:`Dataset`."""
    limit = float(np.finfo(np.float32).max)

    def features(split_name: str, x: np.ndarray) -> torch.Tensor:
        x = standardisation.apply(x)
        bad = (np.abs(x) > limit).reshape(len(x), -1).any(1)
        if bad.any():
            raise ValueError(_bad_rows_message(raw.name, f"{split_name} rows", bad, "features beyond float32's range "
                                               f"({limit:.3g}) after --standardize {standardisation.mode}",
                                               "scale them, or standardise them (--standardize dp)"))  # fmt: skip
        return torch.from_numpy(x.astype(np.float32))

    return Dataset(
        name=raw.name,
        x_train=features("training", raw.x_train),
        y_train=torch.from_numpy(raw.y_train),
        x_test=features("test", raw.x_test),
        y_test=torch.from_numpy(raw.y_test),
        num_classes=raw.num_classes,
        input_shape=raw.input_shape,
        task="binary" if raw.num_classes == 2 else "multiclass",
        source=raw.source,
    )


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
    """Seeded stratified split of ``(x, y)`` (:func:`split`), then standardise with training-split statistics only,
    without noise (:func:`fit_exact`: not private).

    ``x`` is [n, d] (tabular: one mean/std per feature) or [n, C, H, W] already scaled to [0, 1] (image: one global
    mean/std over all training pixels). A zero std (constant feature) is replaced by 1.
    """
    raw = split(name, x, y, num_classes, source, seed=seed, test_fraction=test_fraction, image=image)
    return make_dataset(raw, fit_exact(raw.x_train, image))


def load_raw(name: str, data_dir: str | Path | None = None, seed: int = 0, test_fraction: float = 0.2) -> RawSplit:
    """The seeded stratified split of bundled data set ``name`` (see :data:`DATASETS`), before any fitted transform.

    ``data_dir`` is the folder holding ``adbench/``, ``uci/`` and ``mnist/`` (the shared/data folder); None means
    :func:`default_data_dir`. The sklearn-bundled sets need no data directory.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(sorted(DATASETS))}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    paths = _resolve_files(name, data_dir)
    kw = dict(seed=seed, test_fraction=test_fraction)
    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        bunch = load_breast_cancer()
        return split(name, bunch.data, bunch.target, 2, "sklearn.datasets.load_breast_cancer", **kw)
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()  # pixel values 0..16
        x = bunch.images[:, None, :, :] / 16.0
        return split(name, x, bunch.target, 10, "sklearn.datasets.load_digits", image=True, **kw)
    if name in ("yeast", "magic", "shuttle", "campaign"):
        x, y = _read_npz(paths[0])
        return split(name, x, y, 2, str(paths[0]), **kw)
    if name == "german_credit":
        x, y = _read_categorical_table(paths[0], None, _GERMAN_CLASSES)
        return split(name, x, y, 2, str(paths[0]), **kw)
    if name == "nursery":
        x, y = _read_categorical_table(paths[0], ",", _NURSERY_CLASSES)
        return split(name, x, y, len(_NURSERY_CLASSES), str(paths[0]), **kw)
    if name in _UCI_TABLES:
        table = _UCI_TABLES[name]
        x, y = _read_uci_table(paths, table)
        return split(name, x, y, len(table.classes), " + ".join(str(p) for p in paths), **kw)
    # mnist
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
        raise ValueError(f"mnist: images {images.shape} and labels {labels.shape} do not match (N, 28, 28) / (N,)")
    source = (
        f"{paths[0]} + {paths[1]} (MNIST t10k split only, the training images are not available offline; "
        f"seeded stratified train/test split of its {len(labels)} images, test_fraction={test_fraction}, seed={seed})"
    )
    x = images[:, None, :, :].astype(np.float64) / 255.0
    return split(name, x, labels, 10, source, image=True, **kw)


def load_dataset(name: str, data_dir: str | Path | None = None, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Load data set ``name`` (see :data:`DATASETS`) with a seeded stratified split and the exact (non-private)
    train-fitted standardisation (:func:`fit_exact`). The trainer's private runs use :func:`load_raw` and a
    standardisation paid for in epsilon, or none (``docs/data.md``)."""
    raw = load_raw(name, data_dir, seed=seed, test_fraction=test_fraction)
    return make_dataset(raw, fit_exact(raw.x_train, raw.image))


# ---------------------------------------------------------------------------------------------------------------
# The user's own file: CSV/TSV, Parquet, .npz.
# ---------------------------------------------------------------------------------------------------------------

# file name ending -> format
FILE_FORMATS: dict[str, str] = {
    ".csv": "csv", ".csv.gz": "csv", ".tsv": "tsv", ".tsv.gz": "tsv", ".tab": "tsv",
    ".parquet": "parquet", ".pq": "parquet", ".npz": "npz",
}  # fmt: skip
# cells read as missing (case-insensitive) in text and string columns; a missing feature is refused like NaN
MISSING = ("", "na", "n/a", "nan", "null", "none", "?")
_SHOWN = 10  # rows, columns or classes named in a message


def _shown(items: Sequence, render=repr) -> str:
    items = list(items)
    more = f", ... ({len(items)} in all)" if len(items) > _SHOWN else ""
    return ", ".join(render(i) for i in items[:_SHOWN]) + more


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_format(path: str | Path) -> str:
    """The format of ``path`` from its name's ending (:data:`FILE_FORMATS`); ValueError listing them otherwise."""
    name = Path(path).name.lower()
    for ending in sorted(FILE_FORMATS, key=len, reverse=True):
        if name.endswith(ending):
            return FILE_FORMATS[ending]
    raise ValueError(f"{Path(path).name}: unknown data file format; fastdp reads {', '.join(FILE_FORMATS)} "
                     "(CSV/TSV with a header row, Parquet, or .npz with arrays x and y)")  # fmt: skip


class _Rows:
    """How a file's data rows are named in messages: 0-based in file order, header excluded (text files also give
    the line of the file)."""

    def __init__(self, lines: Sequence[int] | None = None) -> None:
        self.lines = None if lines is None else list(lines)

    def __call__(self, rows: Sequence[int]) -> str:
        rows = [int(r) for r in rows]
        text = ("row " if len(rows) == 1 else "rows ") + _shown(rows, str)
        if self.lines is not None:
            text += f" (file line{'s' if len(rows) > 1 else ''} {_shown([self.lines[r] for r in rows], str)})"
        return text


def _read_text_table(path: Path, delimiter: str) -> tuple[list[str], list[list[str]], _Rows]:
    """Header and data rows of a delimited text file (UTF-8, optionally gzip'd); blank lines skipped."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, delimiter=delimiter)
            records = [(reader.line_num, row) for row in reader if any(field.strip() for field in row)]
    except (UnicodeDecodeError, OSError, EOFError, csv.Error) as exc:
        raise ValueError(f"{path.name}: cannot read it as UTF-8 {'TSV' if delimiter == chr(9) else 'CSV'} text "
                         f"({exc})") from exc  # fmt: skip
    if not records:
        raise ValueError(f"{path.name}: the file is empty; expected a header row of column names, then data rows")
    header = [name.strip() for name in records[0][1]]
    rows = [row for _, row in records[1:]]
    lines = [line for line, _ in records[1:]]
    bad = [i for i, row in enumerate(rows) if len(row) != len(header)]
    if bad:
        raise ValueError(f"{path.name}: {len(bad)} rows do not have the header's {len(header)} fields (first: "
                         f"{_Rows(lines)([bad[0]])} has {len(rows[bad[0]])}); check the delimiter "
                         f"({'tab' if delimiter == chr(9) else 'comma'} for this file name) and quoting")  # fmt: skip
    return header, [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in header], _Rows(lines)


def _read_parquet(path: Path) -> tuple[list[str], list[list], _Rows]:
    """Column names and columns (lists of Python values, None for nulls) of a Parquet file, via pyarrow or pandas."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    try:
        if pq is not None:
            table = pq.read_table(path)
            return list(table.column_names), [table.column(i).to_pylist() for i in range(table.num_columns)], _Rows()
        import pandas

        frame = pandas.read_parquet(path)
    except ImportError as exc:
        raise ValueError(
            f"{path.name}: reading Parquet needs pyarrow (pip install pyarrow) or pandas with a Parquet engine (pip "
            f"install pandas pyarrow), and neither is installed in this environment ({exc}); install one, or save "
            "the data as CSV or .npz"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any reader failure: a corrupt or foreign file
        raise ValueError(f"{path.name}: cannot read it as Parquet ({type(exc).__name__}: {exc})") from exc
    columns = [[None if _is_missing(v) else v for v in frame[c].tolist()] for c in frame.columns]
    return [str(c) for c in frame.columns], columns, _Rows()


def _is_missing(value) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip().lower() in MISSING
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return math.isnan(float(value))
    return False


def _as_number(value) -> float | None:
    """``value`` as a float (strings parsed, booleans 0/1, missing cells NaN), or None if it is not a number."""
    if _is_missing(value):
        return math.nan
    if isinstance(value, bool | np.bool_):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    try:  # decimal.Decimal and other numbers
        return float(value) if isinstance(value, numbers.Number) else None
    except (TypeError, ValueError):
        return None


def _numeric_column(values: Sequence) -> tuple[np.ndarray | None, int | None]:
    """The column as float64 (missing cells NaN), or (None, the first row that is not a number)."""
    out = np.empty(len(values), dtype=np.float64)
    for i, value in enumerate(values):
        number = _as_number(value)
        if number is None:
            return None, i
        out[i] = number
    return out, None


def _table_features_and_labels(name: str, header: list[str], columns: list[list], rows: _Rows,
                               target: str | None) -> tuple[np.ndarray, list, list[str]]:  # fmt: skip
    """Features [n, d] float64 (NaN where missing) and raw label values of a table, refusing what cannot be one."""
    if target is None:
        raise ValueError(f"{name}: give the label column with --target COLUMN (columns: {_shown(header)})")
    empty = [i for i, column in enumerate(header) if not column]
    if empty:
        raise ValueError(f"{name}: column {empty[0]} of the header has no name; every column needs one")
    duplicated = sorted({c for c in header if header.count(c) > 1})
    if duplicated:
        raise ValueError(f"{name}: duplicated column names {_shown(duplicated)}; every column needs its own name")
    if target not in header:
        raise ValueError(f"{name}: no column {target!r} for --target (columns: {_shown(header)}); names are "
                         "case-sensitive")  # fmt: skip
    if len(header) < 2:
        raise ValueError(f"{name}: the label column {target!r} is the only column: there are no features")
    labels = columns[header.index(target)]
    if not labels:
        raise ValueError(f"{name}: the data set has no rows (a header only); check the data file")
    names = [c for c in header if c != target]
    features, bad = [], []
    for column in names:
        values, first = _numeric_column(columns[header.index(column)])
        if values is None:
            bad.append(f"{column!r} ({rows([first])}: {columns[header.index(column)][first]!r})")
        features.append(values)
    if bad:
        raise ValueError(
            f"{name}: {len(bad)} feature column{'s are' if len(bad) > 1 else ' is'} not numeric: {_shown(bad, str)}. "
            "fastdp encodes no categorical features itself: one-hot encode them (or drop them) before training, "
            "or name the label column with --target"
        )
    x = np.stack(features, axis=1)
    _refuse_non_finite(name, x, rows, names)
    return x, list(labels), names


def _refuse_non_finite(name: str, x: np.ndarray, rows: _Rows, names: list[str] | None) -> None:
    """Refuse missing, NaN or Inf features, naming the rows (and, for a table, the columns)."""
    flat = x.reshape(len(x), -1)
    bad_rows = np.flatnonzero(~np.isfinite(flat).all(1))
    if not bad_rows.size:
        return
    where = rows(bad_rows)
    if names is not None:
        where += f"; columns {_shown([names[j] for j in np.flatnonzero(~np.isfinite(flat[bad_rows]).all(0))])}"
    missing = "" if names is None else ". Cells read as missing: empty, " + ", ".join(repr(t) for t in MISSING[1:])
    raise ValueError(f"{name}: {bad_rows.size} of the {len(x)} rows have missing, NaN or Inf features ({where}); "
                     f"{_NONFINITE_HINT}{missing}")  # fmt: skip


def _read_npz_file(name: str, path: Path, target: str | None) -> tuple[np.ndarray, list, bool, str]:
    """Features (images scaled to [0, 1]), raw label values, whether they are images, and what was read."""
    if target is not None:
        raise ValueError(f"{name}: an .npz file holds its labels in array y; leave --target out")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{name}: not an .npz archive (a zip of .npy arrays, as numpy.savez writes); save the data "
                         "with numpy.savez(path, x=features, y=labels)")  # fmt: skip
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = list(f.files)
            x_key = "x" if "x" in keys else "X" if "X" in keys else None
            if x_key is None or "y" not in keys:
                raise ValueError(f"{name}: an .npz data file needs arrays x (features) and y (labels); it has "
                                 f"{_shown(keys) or 'none'}")  # fmt: skip
            x, y = f[x_key], f["y"]
    except ValueError as exc:
        if str(exc).startswith(name):
            raise
        raise ValueError(
            f"{name}: cannot read its arrays ({exc}); x and y must be plain numeric (or, y, string) "
            "arrays: object arrays are refused (loading them would run pickled code)"
        ) from exc
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{name}: not a readable .npz file ({exc})") from exc
    if y.ndim != 1:
        raise ValueError(f"{name}: y must be a vector of labels, one per row, got shape {y.shape}")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: x has shape {x.shape}; expected [rows, features] (tabular), [rows, H, W] or "
                         "[rows, C, H, W] (images)")  # fmt: skip
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{name}: x has {x.shape[0]} rows but y has {y.shape[0]} labels; one label per row")
    if x.dtype.kind not in "biuf":
        raise ValueError(f"{name}: x has dtype {x.dtype}: features must be numbers (fastdp encodes no categorical "
                         "features itself: encode them before saving)")  # fmt: skip
    if x.ndim == 2:
        x = x.astype(np.float64)
        _refuse_non_finite(name, x, _Rows(), None)
        return x, y.tolist(), False, f"x {x.shape} {x.dtype} (tabular), y"
    images = x[:, None] if x.ndim == 3 else x
    what = f"x {x.shape} {x.dtype} (images{', channel axis added' if x.ndim == 3 else ''}"
    if images.dtype == np.uint8:
        return images.astype(np.float64) / 255.0, y.tolist(), True, what + ", scaled by 1/255), y"
    if images.dtype.kind not in "bf":
        raise ValueError(f"{name}: images of dtype {x.dtype}: save them as uint8 (0..255, scaled by 1/255) or as "
                         "floats in [0, 1]")  # fmt: skip
    images = images.astype(np.float64)
    _refuse_non_finite(name, images, _Rows(), None)
    flat = images.reshape(len(images), -1)
    bad = ((flat < 0) | (flat > 1)).any(1)
    if bad.any():
        raise ValueError(_bad_rows_message(
            name, "images", bad, f"pixels outside [0, 1] (values from {flat.min():.4g} to {flat.max():.4g})",
            "float images must be scaled to [0, 1] (a public constant map such as /255) or saved as uint8; to train "
            "the values as tabular features instead, save x as a 2-D array [rows, features]"))  # fmt: skip
    return images, y.tolist(), True, what + ", pixels in [0, 1]), y"


def _labels_to_classes(name: str, values: list, rows: _Rows, what: str) -> tuple[np.ndarray, tuple[str, ...], str]:
    """Class indices for ``values``: integer labels 0..K-1 as they are; other integers and strings mapped to
    0..K-1 in sorted order (said in the returned note, empty otherwise); missing and non-integer numbers refused."""
    missing = [i for i, v in enumerate(values) if _is_missing(v)]
    if missing:
        raise ValueError(f"{name}: {len(missing)} of the {len(values)} rows have no label ({rows(missing)}) in "
                         f"{what}; remove those rows or fill in their labels")  # fmt: skip
    numbers_ = [_as_number(v) for v in values]
    if all(v is not None for v in numbers_) and not any(isinstance(v, bool | np.bool_) for v in values):
        y = np.array(numbers_, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if bad.size:
            raise ValueError(
                f"{name}: {bad.size} of the {len(y)} rows have a label in {what} that is not an integer ({rows(bad)}: "
                f"{_shown([values[i] for i in bad[:_SHOWN]])}); fastdp trains classifiers: labels must be integers or "
                "strings naming classes (bin a numeric target into classes first)"
            )
        y = y.astype(np.int64)
        present = np.unique(y)
        if np.array_equal(present, np.arange(len(present))):
            return y, tuple(str(c) for c in present), ""
        classes = tuple(str(c) for c in present)
        indices = np.searchsorted(present, y)
    else:
        labels = [str(v).strip() if not isinstance(v, bool | np.bool_) else str(bool(v)) for v in values]
        present_labels = sorted(set(labels))
        lookup = {c: i for i, c in enumerate(present_labels)}
        classes, indices = tuple(present_labels), np.array([lookup[v] for v in labels], dtype=np.int64)
    mapping = ", ".join(f"{c!r} -> {i}" for i, c in enumerate(classes[:_SHOWN]))
    more = f", ... ({len(classes)} classes)" if len(classes) > _SHOWN else ""
    note = (f"{name}: the labels in {what} are not class indices 0..K-1; they were mapped to classes in sorted order: "
            f"{mapping}{more}")  # fmt: skip
    return indices.astype(np.int64), classes, note


def _check_classes(name: str, y: np.ndarray, classes: tuple[str, ...], test_fraction: float) -> None:
    """Refuse a label set that the seeded stratified split or a classifier cannot use, saying what to do."""
    if len(classes) < 2:
        raise ValueError(f"{name}: all {len(y)} rows have the label {classes[0]!r}: a classifier needs at least 2 "
                         "classes; check the label column (--target)")  # fmt: skip
    counts = np.bincount(y, minlength=len(classes))
    rare = [f"{classes[c]!r} ({counts[c]} row)" for c in np.flatnonzero(counts < 2)]
    if rare:
        raise ValueError(f"{name}: {len(rare)} class{'es have' if len(rare) > 1 else ' has'} a single row: "
                         f"{_shown(rare, str)}; the seeded stratified split needs at least 2 rows of every class (one "
                         "to train on, one to test on): remove or merge rare classes")  # fmt: skip
    n_test = math.ceil(test_fraction * len(y))
    if n_test < len(classes) or len(y) - n_test < len(classes):
        raise ValueError(f"{name}: too few rows: {len(y)} rows give {len(y) - n_test} training and {n_test} test rows "
                         f"at test_fraction={test_fraction}, fewer than the {len(classes)} classes; the stratified "
                         "split needs a row of every class in each split: add rows or merge classes")  # fmt: skip


def load_file(
    path: str | os.PathLike, target: str | None = None, seed: int = 0, test_fraction: float = 0.2
) -> RawSplit:
    """The user's data file as a seeded stratified split (the bundled sets' conventions), before any fitted transform.

    Formats (:data:`FILE_FORMATS`, by the name's ending): CSV / TSV (UTF-8, optionally gzip'd, a header row of column
    names; ``target`` names the label column, every other column is a numeric feature), Parquet (the same, needs
    pyarrow or pandas) and ``.npz`` (arrays ``x`` and ``y``; ``x`` [rows, features], or images [rows, H, W] or
    [rows, C, H, W] as uint8 0..255 or floats in [0, 1]; ``target`` must be None).

    Refused with a ValueError saying what to do (FileNotFoundError for a missing file): non-numeric feature columns
    (named; categorical features are not encoded silently), missing / NaN / Inf features (rows and columns named),
    missing or non-integer numeric labels, a single class, a class of a single row, too few rows for the split, and
    everything :func:`split` refuses. Integer labels 0..K-1 are the classes; other labels (strings, other integers)
    map to classes in sorted order, said in ``notes``. ``provenance`` holds the path and the file's sha256.
    """
    path = Path(path).expanduser()
    fmt = file_format(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (or is not a file); check the path given to --data")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    name = path.name
    if fmt == "npz":
        x, labels, image, what = _read_npz_file(name, path, target)
        rows, label_what, names = _Rows(), "array y", None
    else:
        if fmt == "parquet":
            header, columns, rows = _read_parquet(path)
        else:
            header, columns, rows = _read_text_table(path, "\t" if fmt == "tsv" else ",")
        x, labels, names = _table_features_and_labels(name, header, columns, rows, target)
        image, label_what = False, f"column {target!r}"
        what = f"{len(names)} numeric feature columns, label column {target!r}"
    y, classes, note = _labels_to_classes(name, labels, rows, label_what)
    _check_classes(name, y, classes, test_fraction)
    digest = _sha256(path)
    provenance = {
        "path": str(path.resolve()),
        "sha256": digest,
        "format": fmt,
        "target": target,
        "rows": int(len(y)),
        "read": what,
        "features": names,
        "classes": list(classes),
    }
    source = f"{path.resolve()} (sha256 {digest}; {fmt}: {what})"
    return split(name, x, y, len(classes), source, seed=seed, test_fraction=test_fraction, image=image,
                 classes=classes, notes=(note,) if note else (), provenance=provenance)  # fmt: skip


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
            origin = f" (the data comes from {_DOWNLOAD[name]})" if name in _DOWNLOAD else ""
            raise FileNotFoundError(f"dataset {name!r}: expected file {path} ({path.name} under {root}); {hint}"
                                    f"{origin}")  # fmt: skip
    return paths
