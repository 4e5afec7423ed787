"""`fastdp demo`: six runs (the non-private baseline and the five DP variants) on one data set, the table of epsilon,
accuracy and step time, and the plot (or a clear note without matplotlib)."""

import math
import sys

import pytest
import torch

from fastdp.algorithms import VARIANTS
from fastdp.train import cli
from fastdp.train.cli import DEMO_DATASET, DEMO_DELTA, DEMO_EPSILON, DEMO_PLOT, demo_configs, format_table, main

PRIVATE = {"dpsgd", "jl", "backprop", "clipless", "weightclip"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _canned(config) -> dict:
    """What `train` returns, in the fields the demo reads, for ``config`` (no training)."""
    private = config.variant != "nonprivate"
    steps = config.epochs * 6
    return {
        "variant": config.variant,
        "dataset": config.dataset,
        "epsilon": 0.98 * config.epsilon if private else math.inf,
        "delta": config.delta if private else None,
        "variant_config": {"noise_multiplier": 3.5} if private else {},
        "test_accuracy": 0.9 if private else 0.97,
        "test_auroc": None,
        "steps": steps,
        "train_seconds": 0.002 * steps,
        # epoch 1 slow (warm-up): the median over epochs is 2 ms per step
        "history": [{"steps_per_second": 100.0}] + [{"steps_per_second": 500.0}] * (config.epochs - 1),
        "config": {k: getattr(config, k) for k in config.__dataclass_fields__ if k != "extra"},
    }


def _table(printed: str) -> str:
    """The table in the demo's output: from its header line to the note below it."""
    start = printed.index("\nvariant ") + 1
    return printed[start : printed.index("\nms/step", start)]


def _data_rows(table: str) -> list[list[str]]:
    lines = table.splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}, "the second line underlines the header"
    return [line.split() for line in lines[2:]]


def test_demo_configs_are_the_baseline_and_every_variant_at_one_epsilon():
    configs = demo_configs()
    assert [c.variant for c in configs][0] == "nonprivate"
    assert {c.variant for c in configs} == set(VARIANTS) == PRIVATE | {"nonprivate"}
    assert len(configs) == 6, "one row per variant"
    for c in configs:
        c.validate()
        assert c.dataset == DEMO_DATASET and c.delta == DEMO_DELTA and c.quiet and not c.progress
        assert (c.batch_size, c.epochs, c.seed) == (configs[0].batch_size, configs[0].epochs, 0)
        assert c.epsilon == (DEMO_EPSILON if c.variant in PRIVATE else None)
        assert c.noise_multiplier is None, "every private run is calibrated to the same target epsilon"
        assert c.reproducible_privacy_seed is None, "the demo's privacy draws come from OS entropy"
    models = {c.variant: c.model for c in configs}
    assert models["clipless"] == "lipschitz_mlp" and models["weightclip"] == "weightclip_mlp"
    assert {c.accountant for c in configs if c.variant in PRIVATE} == {"pld"}, "jl needs it; one accountant for all"
    quick = demo_configs(data_dir="/somewhere", seed=3, epochs=2)
    assert all((c.data_dir, c.seed, c.epochs) == ("/somewhere", 3, 2) for c in quick)


def test_format_table_has_six_rows_of_epsilon_accuracy_and_step_time():
    table = format_table([_canned(c) for c in demo_configs()])
    header = table.splitlines()[0].split()
    for column in ("variant", "epsilon", "delta", "acc", "ms/step", "train"):
        assert column in header, f"{column!r} missing from the header {header}"
    rows = _data_rows(table)
    assert [row[0] for row in rows] == [c.variant for c in demo_configs()]
    epsilon, delta, accuracy, ms = (header.index(k) for k in ("epsilon", "delta", "acc", "ms/step"))
    shift = 1  # "test acc" is two words in the header
    assert rows[0][epsilon] == "inf" and rows[0][delta] == "-"
    for row in rows[1:]:
        assert row[epsilon] == f"{0.98 * DEMO_EPSILON:.2f}" and row[delta] == f"{DEMO_DELTA:g}"
        assert row[accuracy - shift] == "0.9000"
        assert row[ms - shift] == "2.00", "ms/step is the median over epochs, not the warm-up's mean"
    assert "C1 5" in table and "max ||W|| 2" in table and "r 10" in table, "each row's own settings are shown"


def test_demo_prints_the_table_and_writes_the_plot(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    seen, threads = [], torch.get_num_threads()

    def fake_train(config):
        seen.append((config, torch.get_num_threads()))
        return _canned(config)

    monkeypatch.setattr(cli, "train", fake_train)
    out = tmp_path / "plots"
    assert main(["demo", "--out", str(out), "--seed", "4", "--epochs", "3"]) == 0
    assert {n for _, n in seen} == {1} and torch.get_num_threads() == threads, "1 thread for the runs, then restored"
    seen = [config for config, _ in seen]
    assert [c.variant for c in seen] == [c.variant for c in demo_configs()]
    assert all(c.seed == 4 and c.epochs == 3 for c in seen)
    printed = capsys.readouterr().out
    assert len(_data_rows(_table(printed))) == 6
    plot = out / DEMO_PLOT
    assert f"plot: {plot}" in printed
    assert plot.read_bytes()[:8] == PNG_SIGNATURE and plot.stat().st_size > 10_000


def test_demo_without_matplotlib_prints_the_table_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "train", _canned)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    assert main(["demo", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "matplotlib is not installed" in printed and "weightclip" in printed
    assert not (tmp_path / DEMO_PLOT).exists()


def test_demo_help_names_every_variant_and_the_plot(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for word in (*sorted(PRIVATE), "non-private", DEMO_PLOT, "--out", "--seed", "--epochs", "--threads", "--data-dir"):
        assert word in text


@pytest.mark.parametrize("option", [["--epochs", "0"], ["--threads", "0"]])
def test_demo_refuses_bad_options_before_training(option, monkeypatch, capsys):
    monkeypatch.setattr(cli, "train", lambda config: pytest.fail("trained despite a bad option"))
    assert main(["demo", *option]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "must be >= 1" in captured.err


def test_demo_trains_every_variant_for_real(tmp_path, capsys):
    """One epoch of each run (about 7 s on 2 cores): every variant trains on the demo's data set through the
    trainer, each private run within the target epsilon (calibrated anew for the fewer steps), and the plot is
    written. Accuracy after one epoch is near chance for some variants; the tuned 30 epochs are not run here."""
    pytest.importorskip("matplotlib")
    assert main(["demo", "--epochs", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = {row[0]: row for row in _data_rows(_table(printed))}
    assert set(rows) == PRIVATE | {"nonprivate"}
    for variant in PRIVATE:
        assert 0.9 * DEMO_EPSILON <= float(rows[variant][2]) <= DEMO_EPSILON, rows[variant]
    for row in rows.values():
        assert 0.0 <= float(row[5]) <= 1.0 and float(row[7]) > 0, row  # test accuracy, ms/step
    assert (tmp_path / DEMO_PLOT).read_bytes()[:8] == PNG_SIGNATURE
