"""Every script in ``examples/`` runs in its ``--smoke`` mode (a few steps on a small slice): it exits 0 and prints a
finite epsilon with its delta. The distributed example runs under ``torchrun`` with 2 gloo processes; the image
classifier runs once more without the MNIST files (its digits fallback), the transformers examples on weights saved
to a local folder (``--model-path``). A new example must be added to ``SMOKE``: ``test_every_example_is_run`` fails
otherwise.

The runs are independent processes (one thread each), run a few at a time."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# example file -> the interpreter's arguments of its smoke run (cwd: the repository root)
SMOKE = {
    "image_classifier.py": ["examples/image_classifier.py", "--smoke"],
    "csv_classifier.py": ["examples/csv_classifier.py", "--smoke"],
    "text_classifier.py": ["examples/text_classifier.py", "--smoke"],
    "gpt2_finetune.py": ["examples/gpt2_finetune.py", "--smoke"],
    "resnet18_gn.py": ["examples/resnet18_gn.py", "--smoke"],
    "clipless.py": ["examples/clipless.py", "--smoke"],
    "weightclip.py": ["examples/weightclip.py", "--smoke"],
    "backprop.py": ["examples/backprop.py", "--smoke"],
    "jl.py": ["examples/jl.py", "--smoke"],
    "distributed.py": [*TORCHRUN, "examples/distributed.py", "--smoke"],
}
# --model-path runs: a tiny random model saved with save_pretrained (no tokenizer: the examples' word vocabulary)
SAVE = {
    "text_classifier.py": "BertForSequenceClassification(transformers.BertConfig(vocab_size=64, hidden_size=16, "
    "num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=32))",
    "gpt2_finetune.py": "GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, "
    "n_head=2))",
}
DIGITS = "image_classifier.py without MNIST"
DOCUMENTS = {".md", ".rst", ".txt"}  # files in examples/ that are not scripts
EPSILON = re.compile(r"epsilon\"?\s*[=:]\s*([0-9.]+(?:e[-+]?[0-9]+)?|inf)")
TIMEOUT = 300


def _run(arguments: list[str], **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, *arguments], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)  # fmt: skip


def _with_saved_model(name: str, folder: Path) -> subprocess.CompletedProcess:
    saved = _run(["-c", f"import sys, transformers; transformers.{SAVE[name]}.save_pretrained(sys.argv[1])",
                  str(folder)])  # fmt: skip
    if saved.returncode != 0:
        return saved
    return _run([*SMOKE[name], "--model-path", str(folder)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """{run name: its completed process} for every smoke run, a few at a time."""
    tmp = tmp_path_factory.mktemp("local_models")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run, arguments) for name, arguments in SMOKE.items()}
        futures |= {f"{name} --model-path": pool.submit(_with_saved_model, name, tmp / name) for name in SAVE}
        futures[DIGITS] = pool.submit(_run, SMOKE["image_classifier.py"], FASTDP_DATA_DIR=str(tmp / "absent"))
        return {name: future.result() for name, future in futures.items()}


def test_every_example_is_run():
    scripts = {p.name for p in EXAMPLES.iterdir() if p.is_file() and p.suffix not in DOCUMENTS}
    assert scripts == set(SMOKE), (
        f"examples without a smoke run in tests/test_examples.py: {sorted(scripts - set(SMOKE))}; "
        f"smoke runs without a file: {sorted(set(SMOKE) - scripts)}"
    )


@pytest.mark.parametrize("name", [*SMOKE, *(f"{name} --model-path" for name in SAVE), DIGITS])
def test_smoke_run_prints_epsilon(runs, name):
    proc = runs[name]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = EPSILON.findall(proc.stdout)
    assert found, f"{name} printed no epsilon:\n{proc.stdout[-3000:]}"
    epsilon = float(found[-1])
    assert math.isfinite(epsilon) and epsilon > 0, f"{name}: epsilon {epsilon}"
    assert "delta" in proc.stdout, f"{name} printed epsilon without its delta:\n{output[-3000:]}"
    if name == DIGITS:
        assert proc.stdout.startswith("digits:"), proc.stdout[:500]
