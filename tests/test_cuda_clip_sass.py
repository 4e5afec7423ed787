"""SASS checks of the CUDA clip kernels (csrc/cuda/clip.cu) that need no GPU: compiled for sm_90, every kernel
instance (fp32, fp16, bf16; forward and backward) moves its rows with 128-bit loads and stores and spills no
registers. The clip kernels' numbers on a GPU are tests/test_clip_ops.py's (skipped without one)."""

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "cuda" / "clip.cu"
NVCC = shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.path.exists(p)), None)


def _find_cuobjdump() -> str | None:
    """The CUDA toolkit's cuobjdump, else the one that ships with triton (backends/nvidia/bin)."""
    found = shutil.which("cuobjdump") or next((p for p in ["/usr/local/cuda/bin/cuobjdump"] if os.path.exists(p)), None)
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    return None


CUOBJDUMP = _find_cuobjdump()
# The kernels (templates on the element type and the direction) and their mangled template arguments.
KERNELS = ["clip_partial_kernel", "clip_apply_kernel", "clip_row_on_chip_kernel"]
WRITERS = {"clip_apply_kernel", "clip_row_on_chip_kernel"}  # the kernels that write y / dx
DTYPES = {"f": "float32", "6__half": "float16", "13__nv_bfloat16": "bfloat16"}
DIRECTIONS = {"0": "forward", "1": "backward"}
INSTANCES = [(k, d, w) for k in KERNELS for d in DTYPES.values() for w in DIRECTIONS.values()]
MANGLED = re.compile(r"(clip_[a-z_]+_kernel)I(" + "|".join(DTYPES) + r")Lb([01])E")
LOAD_128 = re.compile(r"\bLDG?\.E\.128\b")  # LDG.E.128[.CONSTANT] (global), LD.E.128 (generic)
STORE_128 = re.compile(r"\bSTG?\.E\.128\b")
PROPERTIES = re.compile(
    r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check .cu files)"),
    pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (CUDA toolkit or triton's NVIDIA backend)"),
]


def _instance(mangled: str) -> tuple[str, str, str] | None:
    """(kernel, dtype, direction) of a mangled kernel name; None for a name that is no clip kernel."""
    m = MANGLED.search(mangled)
    return (m.group(1), DTYPES[m.group(2)], DIRECTIONS[m.group(3)]) if m else None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """clip.cu compiled for sm_90: {instance: SASS text} and {instance: (stack, spill stores, spill loads)}."""
    out = tmp_path_factory.mktemp("clip_sass") / "clip.o"
    cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
           "-Werror=all-warnings", "-Xptxas", "-v", "-c", str(SOURCE), "-o", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed on clip.cu:\n{result.stderr}"
    sass = subprocess.run([CUOBJDUMP, "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    functions: dict[tuple[str, str, str], list[str]] = {}
    current = None
    for line in sass.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            current = _instance(header.group(1))
            if current is not None:
                functions[current] = []
        elif current is not None:
            functions[current].append(line)
    usage = {}
    for m in PROPERTIES.finditer(result.stdout + result.stderr):
        instance = _instance(m.group(1))
        if instance is not None:
            usage[instance] = tuple(int(v) for v in m.group(2, 3, 4))
    return {k: "\n".join(v) for k, v in functions.items()}, usage


def test_every_clip_kernel_instance_is_compiled(compiled):
    sass, usage = compiled
    assert sorted(sass) == sorted(INSTANCES), f"SASS functions: {sorted(sass)}"
    assert sorted(usage) == sorted(INSTANCES), f"ptxas -v reported: {sorted(usage)}"


@pytest.mark.parametrize("instance", INSTANCES, ids="-".join)
def test_clip_kernel_loads_128_bit_vectors(compiled, instance):
    sass, _ = compiled
    assert instance in sass, f"{instance} not in the SASS of clip.cu"
    assert LOAD_128.search(sass[instance]), f"{instance}: no 128-bit global load (LDG.E.128) in its SASS"
    if instance[0] in WRITERS:
        assert STORE_128.search(sass[instance]), f"{instance}: no 128-bit global store (STG.E.128) in its SASS"


@pytest.mark.parametrize("instance", INSTANCES, ids="-".join)
def test_clip_kernel_spills_no_registers(compiled, instance):
    _, usage = compiled
    assert instance in usage, f"ptxas -v reported nothing for {instance}"
    stack, spill_stores, spill_loads = usage[instance]
    assert (spill_stores, spill_loads) == (0, 0), (
        f"{instance}: {spill_stores} bytes spill stores, {spill_loads} bytes spill loads ({stack} bytes stack frame)"
    )
