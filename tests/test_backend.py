"""Backend selection: FASTDP_BACKEND, set_backend, backend_info, announced fallbacks."""

import os
import subprocess
import sys

import pytest

import fastdp
from fastdp import _ext


def _run(code: str, **env_overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FASTDP_BACKEND", "TRITON_INTERPRET")}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_set_backend_round_trip(restore_backend):
    fastdp.set_backend("torch")
    assert fastdp.get_backend() == "torch"
    assert fastdp.set_backend("AUTO") == "torch"
    assert fastdp.get_backend() == "auto"


def test_unknown_backend_is_refused(restore_backend):
    with pytest.raises(ValueError, match="choose one of auto, torch, triton, cuda"):
        fastdp.set_backend("tpu")


def test_environment_variable_selects_and_validates():
    ok = _run("import fastdp; print(fastdp.get_backend())", FASTDP_BACKEND="torch")
    assert ok.stdout.strip() == "torch", ok.stderr
    bad = _run("import fastdp", FASTDP_BACKEND="bogus")
    assert bad.returncode != 0 and "unknown backend 'bogus'" in bad.stderr


def test_backend_info_explains_choices(restore_backend):
    fastdp.set_backend("auto")
    info = fastdp.backend_info()
    assert info["requested"] == "auto"
    cpu, cuda = info["ops"]["noise"]["cpu"], info["ops"]["noise"]["cuda"]
    assert cpu["backend"] == ("cuda" if _ext._C is not None else "torch")
    # No GPU run has validated a noise kernel yet: auto on CUDA is the reference.
    assert cuda["backend"] == "torch" and "validated" in cuda["reason"]


def test_unavailable_backend_falls_back_with_one_warning():
    code = """
import warnings, torch, fastdp
fastdp.set_backend("triton")  # no TRITON_INTERPRET: Triton cannot run on CPU tensors
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = torch.zeros(100); fastdp.ops.add_noise_([a], 1.0, seed=1, offset=0)
    fastdp.ops.add_noise_([torch.zeros(3)], 1.0, seed=1, offset=0)
fastdp.set_backend("auto")
b = torch.zeros(100); fastdp.ops.add_noise_([b], 1.0, seed=1, offset=0)
messages = [str(w.message) for w in caught]
assert len(messages) == 1 and "fell back" in messages[0] and "TRITON_INTERPRET" in messages[0], messages
assert torch.equal(a, b)
print("ok")
"""
    result = _run(code)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
