"""Opacus-style scripts (``bench/opacus_scripts/``) run on fastdp after changing only their import line.

Each script is run with ``--smoke`` as written (Opacus) and as the copy ``bench/bench_opacus_accuracy.py`` makes
(``from fastdp import PrivacyEngine``, nothing else changed), each in its own process, all at once: it must finish,
report a finite epsilon within the target and a test accuracy above chance. The accuracy at full size, over seeds,
is the benchmark's (bench/results/cpu-opacus-accuracy.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opacus")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("mnist_cnn", "char_lm")
CHANCE = {"mnist_cnn": 0.1}  # char_lm reports its own (1 / vocabulary size)
# MNIST's fallback when ../shared/data/mnist is absent (scikit-learn's digits) is run under fastdp
CASES = [(s, e, "default") for s in SCRIPTS for e in ("opacus", "fastdp")] + [("mnist_cnn", "fastdp", "digits")]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_opacus_accuracy", ROOT / "bench" / "bench_opacus_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(script, engine, data): (returncode, stdout, stderr)} for every smoke run, run concurrently."""
    bench = _bench()
    tmp = tmp_path_factory.mktemp("fastdp_copies")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    paths = {}
    for script in SCRIPTS:
        original = ROOT / "bench" / "opacus_scripts" / f"{script}.py"
        paths[script] = {"opacus": original, "fastdp": bench.fastdp_copy(original, tmp)}
    jobs = {}
    for script, engine, data in CASES:
        jobs[(script, engine, data)] = [sys.executable, str(paths[script][engine]), "--smoke", "--seed", "1"]
        if data == "digits":
            jobs[(script, engine, data)] += ["--data-root", str(tmp / "absent")]
    procs = {key: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for key, cmd in jobs.items()}  # fmt: skip
    return {key: (proc.wait(timeout=300), *proc.communicate()) for key, proc in procs.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_fastdp_copy_changes_only_the_import(script, tmp_path):
    original = ROOT / "bench" / "opacus_scripts" / f"{script}.py"
    copy = _bench().fastdp_copy(original, tmp_path)
    before, after = original.read_text().splitlines(), copy.read_text().splitlines()
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert changed == [("from opacus import PrivacyEngine", "from fastdp import PrivacyEngine")]


@pytest.mark.parametrize("script, engine, data", CASES)
def test_smoke_run(runs, script, engine, data):
    returncode, stdout, stderr = runs[(script, engine, data)]
    assert returncode == 0, f"{script} on {engine} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["engine"] == engine and result["script"] == script
    if data == "digits":
        assert result["data"] == "sklearn-digits"
    assert result["steps"] >= 1
    assert math.isfinite(result["epsilon"]) and 0 < result["epsilon"] <= result["target_epsilon"]
    chance = CHANCE.get(script, result.get("chance"))
    assert result["accuracy"] > chance, result
