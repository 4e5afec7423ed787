"""SASS checks of the CUDA ghost-norm kernels (csrc/cuda/norms.cu) that need no GPU: compiled for sm_90, the
float16 and bfloat16 Gram tiles multiply on tensor cores (HMMA with fp32 accumulation), the float32 ones on CUDA
cores (FFMA, no TF32 rounding), and no kernel spills registers. Their numbers on a GPU are tests/test_norms.py's
CUDA cases (skipped without one)."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.test_cuda_clip_sass import CUOBJDUMP, NVCC, PROPERTIES

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "cuda" / "norms.cu"
TILES = re.compile(r"(ghost_tiles(?:_tc)?_kernel)I(f|6__half|13__nv_bfloat16)E")
DTYPES = {"f": "float32", "6__half": "float16", "13__nv_bfloat16": "bfloat16"}

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check .cu files)"),
    pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (CUDA toolkit or triton's NVIDIA backend)"),
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """norms.cu for sm_90: ({dtype: (kernel, SASS)} of the Gram-tile kernels, ptxas's -v report)."""
    out = tmp_path_factory.mktemp("norms_sass") / "norms.o"
    cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
           "-Werror=all-warnings", "-Xptxas", "-v", "-c", str(SOURCE), "-o", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed on norms.cu:\n{result.stderr}"
    sass = subprocess.run([CUOBJDUMP, "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    tiles, current = {}, None
    for line in sass.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            m = TILES.search(header.group(1))
            current = DTYPES[m.group(2)] if m else None
            if current is not None:
                tiles[current] = (m.group(1), [])
        elif current is not None:
            tiles[current][1].append(line)
    return {d: (k, "\n".join(lines)) for d, (k, lines) in tiles.items()}, result.stdout + result.stderr


def test_16_bit_gram_tiles_run_on_tensor_cores(compiled):
    tiles, _ = compiled
    assert set(tiles) == {"float32", "float16", "bfloat16"}, sorted(tiles)
    for dtype, suffix in (("float16", ""), ("bfloat16", r"\.BF16")):  # SASS names f16 inputs with no suffix
        kernel, sass = tiles[dtype]
        assert kernel == "ghost_tiles_tc_kernel", (dtype, kernel)
        assert re.search(rf"\bHMMA\.16816\.F32{suffix}\s", sass), f"{dtype}: no HMMA with fp32 accumulation"
    kernel, sass = tiles["float32"]
    assert kernel == "ghost_tiles_kernel" and "HMMA" not in sass and "FFMA" in sass  # fp32: no TF32 rounding


def test_no_kernel_spills(compiled):
    _, report = compiled
    found = PROPERTIES.findall(report)
    assert len(found) >= 5, report
    for name, stack, stores, loads in found:
        assert (int(stack), int(stores), int(loads)) == (0, 0, 0), f"{name}: {stack} B stack, {stores}/{loads} spill"
