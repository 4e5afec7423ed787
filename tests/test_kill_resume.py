"""Interrupted training: ``fastdp train --checkpoint PATH`` killed with SIGKILL in the middle of an epoch (after at
least one checkpoint was written) and continued with ``--resume`` ends exactly where the uninterrupted run ends: the
same accountant history (no step lost or counted twice), the same epsilon, and bitwise the same model.

The killed run's stderr is a pseudo-terminal, so the trainer draws its progress bar ("epoch e/E: ... n/N"): the
test kills the process when the bar shows that epoch 2 is under way, i.e. steps after the last checkpoint (epoch 1)
are done and will be lost with the process. The uninterrupted run and the resume run in this process through the
same CLI entry point (``fastdp.train.cli.main``), saving two interpreter start-ups. All three use one intra-op thread
(OMP_NUM_THREADS=1 / ``torch.set_num_threads(1)``): the same arithmetic in each, and on a shared 2-core machine
~20x faster small steps than two contending threads."""

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from fastdp.train.cli import main

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 3
# breast_cancer, expected batch 1 of 455: 455 small steps per epoch (about a second)
ARGS = ["train", "--variant", "dpsgd", "--dataset", "breast_cancer", "--noise-multiplier", "1.0", "--batch-size", "1",
        "--epochs", str(EPOCHS), "--lr", "0.05", "--momentum", "0.5", "--hidden", "16", "--seed", "3",
        "--reproducible-privacy-seed", "3"]  # fmt: skip
# The comparison is bitwise, so the privacy draws are keyed by a reproducible seed (NOT FOR RELEASE); the default,
# OS entropy, resumes too, with fresh draws (tests/test_holes_keys.py)
STEPS_PER_EPOCH = 455
KILL_AFTER, KILL_MARGIN = 20, 150  # kill when the bar shows >= 20 steps of epoch 2 done and >= 150 still to go
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PROGRESS = re.compile(rb"epoch (\d+)/\d+:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")


def _command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "fastdp.train.cli", *ARGS, *extra]


def _in_this_process(*extra: str) -> None:
    """``fastdp train ARGS extra`` through the CLI's entry point, with one intra-op thread like the subprocess."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*ARGS, *extra]) == 0
    finally:
        torch.set_num_threads(threads)


def _kill_mid_epoch(checkpoint: Path) -> tuple[int, int]:
    """Start a run that checkpoints every epoch and SIGKILL it (by its pid) when its progress bar shows epoch 2
    under way (KILL_AFTER, KILL_MARGIN); returns the (epoch, step within it) the bar showed last."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing 0 columns wide
    process = subprocess.Popen(_command("--checkpoint", str(checkpoint)), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=slave)  # fmt: skip
    os.close(slave)
    seen, shown, killed, deadline = b"", (0, 0), False, time.monotonic() + 240
    try:
        while not killed and time.monotonic() < deadline and process.poll() is None:
            if not select.select([master], [], [], 0.05)[0]:
                continue
            try:
                seen = (seen + os.read(master, 4096))[-4096:]
            except OSError:  # the process closed the terminal
                break
            bars = PROGRESS.findall(seen)
            if bars:
                shown = (int(bars[-1][0]), int(bars[-1][1]))
                if shown[0] == 2 and KILL_AFTER <= shown[1] <= STEPS_PER_EPOCH - KILL_MARGIN:
                    os.kill(process.pid, signal.SIGKILL)
                    killed = True
    finally:
        if process.poll() is None and not killed:  # the moment was missed: do not leave the run behind
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        os.close(master)
    assert killed and process.returncode == -signal.SIGKILL, f"not killed mid-epoch (last progress shown: {shown})"
    return shown


def _final_state(path: Path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs a POSIX pseudo-terminal")
def test_sigkill_mid_epoch_then_resume_equals_the_uninterrupted_run(tmp_path):
    straight, interrupted = tmp_path / "straight.pt", tmp_path / "interrupted.pt"
    epoch, step_in_epoch = _kill_mid_epoch(interrupted)
    saved = _final_state(interrupted)
    # killed with steps of epoch 2 done, after epoch 1's checkpoint: those steps exist nowhere but in the dead process
    assert (epoch, saved["epoch"], saved["step"]) == (2, 1, STEPS_PER_EPOCH) and step_in_epoch >= KILL_AFTER
    assert saved["accountant"]["history"][0][2] == STEPS_PER_EPOCH  # the accountant saw exactly the saved steps

    _in_this_process("--checkpoint", str(interrupted), "--resume", "--quiet")
    _in_this_process("--checkpoint", str(straight), "--quiet")  # the uninterrupted run
    a, b = _final_state(straight), _final_state(interrupted)
    assert a["step"] == b["step"] == EPOCHS * STEPS_PER_EPOCH and a["epoch"] == b["epoch"] == EPOCHS
    assert a["accountant"] == b["accountant"]  # [[sigma, q, steps]]: no step lost or counted twice
    assert [r["epsilon"] for r in a["history"]] == [r["epsilon"] for r in b["history"]]
    for key in ("train_loss", "test_loss", "test_accuracy", "test_auroc"):
        assert [r[key] for r in a["history"]] == [r[key] for r in b["history"]], key
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs (bitwise)"
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True):
        assert torch.equal(x["momentum_buffer"], y["momentum_buffer"])
