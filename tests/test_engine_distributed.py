"""The front door under ``torchrun``: ``examples/distributed.py`` (an ordinary PrivacyEngine script) on 2 gloo
processes trains the model one process trains (reproducible draws: the same global samples and noise keys, so the
noise was added once, not per process), every process ends with the same model (OS-entropy draws too: rank 0's
sample and release are shared), and processes started with different settings are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "distributed.py"


def _run(tmp_path: Path, name: str, *args: str, nproc: int = 1, env: dict | None = None) -> dict:
    out = tmp_path / f"{name}.pt"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = [*(launcher if nproc > 1 else [sys.executable]), str(SCRIPT), "--epochs", "1", "--out", str(out), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    result["state"] = torch.load(out, weights_only=True)
    return result


@pytest.mark.parametrize(
    "variant, extra",
    [("dpsgd", ["--max-physical-batch-size", "40"]), ("jl", []), ("clipless", []), ("backprop", [])],
)
def test_two_gloo_processes_train_the_model_one_process_trains(tmp_path, variant, extra):
    args = ["--variant", variant, "--reproducible-seed", "5", *extra]
    one = _run(tmp_path, "one", *args)
    two = _run(tmp_path, "two", *args, nproc=2)
    assert two["processes"] == 2 and two["steps"] == one["steps"] > 0 and two["epsilon"] == one["epsilon"]
    for key, value in one["state"].items():
        torch.testing.assert_close(two["state"][key], value, rtol=1e-5, atol=1e-6)  # the all-reduce's summation order


def test_os_entropy_runs_hold_one_model_on_every_process(tmp_path):
    """No seed: rank 0 draws every sample and noise (and JL tangent) key; the script asserts the processes' models
    are bitwise equal at the end."""
    result = _run(tmp_path, "os", "--variant", "jl", nproc=2)
    assert result["processes"] == 2 and all(torch.isfinite(v).all() for v in result["state"].values())


def test_processes_with_different_settings_are_refused(tmp_path):
    """Rank 1 given another noise multiplier (via an environment override read by a wrapper script)."""
    wrapper = tmp_path / "differ.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "if os.environ.get('RANK') == '1':\n"
        "    sys.argv[sys.argv.index('--noise-multiplier') + 1] = '2.0'\n"
        f"sys.argv[0] = {str(SCRIPT)!r}\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(wrapper),
               "--epochs", "1", "--noise-multiplier", "1.0"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode != 0
    assert "started with different settings" in proc.stdout + proc.stderr and "noise_multiplier" in proc.stderr
