"""The UCI loaders added for papers/01 Table 1 (adult, default_credit, dropout): the real files (class counts, one
row decoded field by field, every encoding choice), the formats of UCI's own downloads (no header, the ``|1x3 Cross
validator`` line, the .xls export's two header rows, BOM and CRLF), and every malformed file refused with its path
and line. Synthetic files are written here (tmp_path); the real ones are read from the shared data folder when it is
beside the repository (skipped otherwise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastdp.train import data as data_module
from fastdp.train.data import default_data_dir, load_dataset, load_raw

DATA_DIR = default_data_dir()
needs_files = pytest.mark.skipif(
    DATA_DIR is None or not (DATA_DIR / "uci" / "adult").is_dir(),
    reason="shared data directory not found (<repo>/../shared/data, or set FASTDP_DATA_DIR)",
)

ADULT_ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, "
    "United-States, <=50K",
    "50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, 13, "
    "United-States, >50K",
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, White, Male, 0, 0, 40, "
    "United-States, <=50K",
    "53, ?, 234721, 11th, 7, Married-civ-spouse, ?, Husband, Black, Male, 0, 0, 40, ?, >50K",
]
ADULT_TEST_ROWS = [
    "25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, "
    "United-States, <=50K.",
    "44, Private, 160323, Some-college, 10, Married-civ-spouse, Machine-op-inspct, Husband, Black, Female, 7688, 0, "
    "40, Mexico, >50K.",
    "18, ?, 103497, Some-college, 10, Never-married, ?, Own-child, White, Female, 0, 0, 30, United-States, <=50K.",
    "34, Private, 198693, 10th, 6, Never-married, Other-service, Not-in-family, White, Male, 0, 0, 30, "
    "United-States, >50K.",
]
CREDIT_HEADER_X = ",X1,X2,X3,X4,X5,X6,X7,X8,X9,X10,X11,X12,X13,X14,X15,X16,X17,X18,X19,X20,X21,X22,X23,Y"
CREDIT_HEADER_NAMES = ("ID,LIMIT_BAL,SEX,EDUCATION,MARRIAGE,AGE,PAY_0,PAY_2,PAY_3,PAY_4,PAY_5,PAY_6,BILL_AMT1,"
                       "BILL_AMT2,BILL_AMT3,BILL_AMT4,BILL_AMT5,BILL_AMT6,PAY_AMT1,PAY_AMT2,PAY_AMT3,PAY_AMT4,PAY_AMT5,"
                       "PAY_AMT6,default payment next month")  # fmt: skip


def _credit_row(i: int, label: int) -> str:
    values = [i, 20000 * i, 1 + i % 2, i % 7, i % 4, 24 + i, -1, 2, 0, 0, -2, -2, *([100 * i] * 6), *([10 * i] * 6)]
    return ",".join(str(v) for v in [*values, label])


def _dropout_row(i: int, target: str) -> str:
    values = [1, 17 if i % 2 else 15, 1 + i % 9, 171 + i, 1, 1, 122.5, 1 + i % 3, 19, 12, 5, 9, 127.3, 1, 0, 0, 1,
              i % 2, 0, 20, 0, *([0] * 4), 12.5, 0, *([0] * 4), 13.0, 0, 10.8, 1.4, 1.74]  # fmt: skip
    assert len(values) == 36
    return ";".join(str(v) for v in [*values, target])


def _write(root: Path, relative: str, lines: list[str], newline: str = "\n", bom: bool = False) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + (newline.join(lines) + newline).encode())
    return path


def _adult(root: Path, train: list[str] | None = None, test: list[str] | None = None, uci_original: bool = True):
    """Adult as UCI distributes it (no header in adult.data, '|1x3 Cross validator' first in adult.test, a blank
    last line) or as the shared copy has it (a header line added to each file)."""
    if uci_original:
        _write(root, "uci/adult/adult.data", [*(train or ADULT_ROWS), ""])
        _write(root, "uci/adult/adult.test", ["|1x3 Cross validator", *(test or ADULT_TEST_ROWS), ""])
    else:
        _write(root, "uci/adult/adult.data", ["age,workclass,fnlwgt,...,salary", *(train or ADULT_ROWS)])
        header = "age, workclass, fnlwgt, ..., native-country"
        _write(root, "uci/adult/adult.test", [header, *(test or ADULT_TEST_ROWS)])


@pytest.mark.parametrize("uci_original", [True, False], ids=["uci-download", "shared-copy"])
def test_adult_reads_both_files_one_hot_with_missing_as_a_category(tmp_path, uci_original):
    _adult(tmp_path, uci_original=uci_original)
    x, y = data_module._read_uci_table(
        [tmp_path / "uci/adult/adult.data", tmp_path / "uci/adult/adult.test"], data_module._ADULT
    )
    assert y.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]  # adult.test's trailing '.' stripped
    # numeric fields in place: age, fnlwgt, education-num, capital-gain, capital-loss, hours-per-week
    # categories present in both files: workclass 4 ('?', Private, Self-emp-not-inc, State-gov), education 5,
    # marital-status 3, occupation 6, relationship 3, race 2, sex 2, native-country 3 ('?', Mexico, United-States)
    assert x.shape == (8, 6 + 4 + 5 + 3 + 6 + 3 + 2 + 2 + 3)
    numeric = [0, 5, 11, 28, 29, 30]  # age, fnlwgt, education-num, capital-gain, capital-loss, hours-per-week
    np.testing.assert_array_equal(x[0, numeric], [39, 77516, 13, 2174, 0, 40])
    np.testing.assert_array_equal(x[0, 1:5], [0, 0, 0, 1])  # workclass one-hot, sorted: State-gov last
    np.testing.assert_array_equal(x[3, 1:5], [1, 0, 0, 0])  # '?' is a category of its own
    one_hot = np.delete(x, numeric, axis=1)
    assert set(np.unique(one_hot)) == {0.0, 1.0} and np.all(one_hot.sum(1) == 8)  # one category per attribute


def test_adult_through_load_raw(tmp_path):
    _adult(tmp_path)
    raw = load_raw("adult", data_dir=tmp_path, test_fraction=0.25)
    assert raw.num_classes == 2 and len(raw.y_train) + len(raw.y_test) == 8
    assert "adult.data" in raw.source and "adult.test" in raw.source


def test_default_credit_skips_the_xls_export_headers(tmp_path):
    rows = [_credit_row(i, i % 2) for i in range(1, 9)]
    for headers in ([], [CREDIT_HEADER_X.replace(",", "ID,", 1)], [CREDIT_HEADER_X, CREDIT_HEADER_NAMES]):
        _write(tmp_path, "uci/default_credit_card/UCI_Credit_Card.csv", [*headers, *rows], newline="\r\n")
        raw = load_raw("default_credit", data_dir=tmp_path, test_fraction=0.25)
        assert raw.input_shape == (20 + 2 + 7 + 4,), headers  # sex 1-2, education 0-6, marriage 0-3 present here
        assert len(raw.y_train) + len(raw.y_test) == 8


def test_dropout_reads_bom_crlf_semicolons(tmp_path):
    header = "Marital status;Application mode;...;Target"
    targets = ["Dropout", "Graduate", "Enrolled"] * 3
    _write(tmp_path, "uci/student_dropout/data.csv", [header, *(_dropout_row(i, t) for i, t in enumerate(targets))],
           newline="\r\n", bom=True)  # fmt: skip
    x, y = data_module._read_uci_table([tmp_path / "uci/student_dropout/data.csv"], data_module._DROPOUT)
    assert y.tolist() == [0, 2, 1] * 3
    # 27 numeric fields; categorical: marital 1, application mode {15, 17}, course 171..179, previous qualification
    # 1, nacionality {1, 2, 3}, parents' qualifications and occupations 1 each
    assert x.shape == (9, 27 + 1 + 2 + 9 + 1 + 3 + 4)
    np.testing.assert_array_equal(x[0, 1:3], [1, 0])  # application mode 15 -> first (codes sorted numerically)


@pytest.mark.parametrize(
    "name, relative, lines, match",
    [
        ("adult", "uci/adult/adult.data", [*ADULT_ROWS[:2], ADULT_ROWS[2].replace(", 40,", ",")],
         r"adult\.data: 1 malformed data line \(first: line 3, 14 fields separated by ','"),
        ("adult", "uci/adult/adult.data", [*ADULT_ROWS[:3], ADULT_ROWS[3].replace(">50K", ">50k")],
         r"adult\.data: 1 malformed data line \(first: line 4, label '>50k' is not one of <=50K, >50K"),
        ("adult", "uci/adult/adult.data", [ADULT_ROWS[0], ADULT_ROWS[1].replace("83311", "?")],
         r"line 2, 'fnlwgt' is '\?', not a finite number"),
        ("adult", "uci/adult/adult.data", ["age,workclass,...", ADULT_ROWS[0].replace("39", "inf")],
         r"line 2, 'age' is 'inf', not a finite number"),
        ("adult", "uci/adult/adult.data", ["header only"], r"adult\.data: no data rows"),
        ("default_credit", "uci/default_credit_card/UCI_Credit_Card.csv",
         [CREDIT_HEADER_NAMES, _credit_row(1, 0), _credit_row(2, 2)], r"line 3, label '2' is not one of 0, 1"),
        ("default_credit", "uci/default_credit_card/UCI_Credit_Card.csv",
         ["a,b", "c,d", "e,f", _credit_row(1, 0)], r"line 3, 2 fields separated by ','"),
        ("dropout", "uci/student_dropout/data.csv", ["Marital status;...;Target", _dropout_row(1, "Dropout"),
         _dropout_row(2, "Graduate").replace(";", ",")], r"line 3, 1 field separated by ';'"),
    ],
    ids=["field-count", "label", "missing-numeric", "inf", "no-rows", "credit-label", "three-headers", "separator"],
)  # fmt: skip
def test_malformed_files_are_refused_naming_file_and_line(tmp_path, name, relative, lines, match):
    if name == "adult":
        _adult(tmp_path)
    path = _write(tmp_path, relative, lines)
    with pytest.raises(ValueError, match=match) as info:
        load_raw(name, data_dir=tmp_path)
    assert str(path) in str(info.value) and "archive.ics.uci.edu" in str(info.value)


def test_not_utf8_is_refused(tmp_path):
    path = tmp_path / "uci/student_dropout/data.csv"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe" + "Target".encode("utf-16-le"))
    with pytest.raises(ValueError, match="cannot read it as UTF-8 text"):
        load_raw("dropout", data_dir=tmp_path)


@pytest.mark.parametrize("name", ["adult", "default_credit", "dropout", "german_credit", "nursery"])
def test_missing_file_says_where_the_data_comes_from(tmp_path, name):
    with pytest.raises(FileNotFoundError, match=r"https://archive\.ics\.uci\.edu/dataset/\d+") as info:
        load_raw(name, data_dir=tmp_path)
    assert str(tmp_path) in str(info.value) and "FASTDP_DATA_DIR" in str(info.value)


def test_adult_second_file_missing_is_named(tmp_path):
    _write(tmp_path, "uci/adult/adult.data", ADULT_ROWS)
    with pytest.raises(FileNotFoundError, match=r"adult\.test"):
        load_raw("adult", data_dir=tmp_path)


# ------------------------------------------------------------------------------------------------ the real files


@needs_files
@pytest.mark.parametrize(
    "name, counts",
    [("adult", [24720 + 12435, 7841 + 3846]), ("default_credit", [23364, 6636]), ("dropout", [1421, 794, 2209])],
)
def test_real_files_class_counts_match_uci(name, counts):
    table = data_module._UCI_TABLES[name]
    _, y = data_module._read_uci_table(data_module._resolve_files(name, DATA_DIR), table)
    assert np.bincount(y).tolist() == counts


@needs_files
def test_real_files_first_rows_decoded():
    adult = data_module._resolve_files("adult", DATA_DIR)
    x, y = data_module._read_uci_table(adult, data_module._ADULT)
    rows = data_module._uci_rows(adult[0], data_module._ADULT)
    assert rows[0][:3] == ["39", "State-gov", "77516"] and y[0] == 0
    assert x[0, 0] == 39 and x.shape[1] == 108
    credit = data_module._resolve_files("default_credit", DATA_DIR)
    x, y = data_module._read_uci_table(credit, data_module._DEFAULT_CREDIT)
    # ID 1: LIMIT_BAL 20000, SEX 2, EDUCATION 2, MARRIAGE 1, AGE 24, PAY_0 2 ... Y 1
    np.testing.assert_array_equal(x[0, :3], [20000, 0, 1])  # LIMIT_BAL, SEX one-hot (1, 2)
    assert y[0] == 1 and x.shape == (30000, 33)
    dropout = data_module._resolve_files("dropout", DATA_DIR)
    x, y = data_module._read_uci_table(dropout, data_module._DROPOUT)
    assert y[0] == 0 and x.shape == (4424, 247) and np.isfinite(x).all()


@needs_files
@pytest.mark.parametrize("name", ["adult", "default_credit", "dropout"])
def test_real_sets_train_a_non_private_baseline_above_the_majority(name):
    """A sanity check of the encoding: standardised features carry signal (logistic regression beats the majority
    class on the test split by a clear margin)."""
    from sklearn.linear_model import LogisticRegression

    ds = load_dataset(name, seed=0)
    model = LogisticRegression(max_iter=300).fit(ds.x_train.numpy(), ds.y_train.numpy())
    majority = np.bincount(ds.y_test.numpy()).max() / len(ds.y_test)
    assert model.score(ds.x_test.numpy(), ds.y_test.numpy()) > majority + 0.02
