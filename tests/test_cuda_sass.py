"""SASS checks of the CUDA kernels of norms.cu, orthogonal.cu and spectral.cu that need no GPU (clip.cu has its
own: tests/test_cuda_clip_sass.py). Compiled for sm_90: the float16 and bfloat16 ghost-norm Gram tiles multiply on
tensor cores (HMMA with fp32 accumulation) and the float32 ones on CUDA cores (FFMA, no TF32 rounding); Björck's
products run on TF32 tensor cores (3xTF32); no kernel spills registers. Their numbers on a GPU are the CUDA cases
of tests/test_norms.py, test_orthogonal.py and test_spectral.py (skipped without one)."""

import functools
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.test_cuda_clip_sass import CUOBJDUMP, NVCC, PROPERTIES

ROOT = Path(__file__).resolve().parents[1]
TILES = re.compile(r"(ghost_tiles_kernel)I(f|6__half|13__nv_bfloat16)E")
DTYPES = {"f": "float32", "6__half": "float16", "13__nv_bfloat16": "bfloat16"}

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check .cu files)"),
    pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (CUDA toolkit or triton's NVIDIA backend)"),
]


@functools.cache
def compiled(name: str) -> tuple[dict[str, str], str]:
    """csrc/cuda/<name>.cu for sm_90: ({mangled kernel: SASS}, ptxas's -v report)."""
    out = Path(tempfile.mkdtemp()) / f"{name}.o"
    source = ROOT / "csrc" / "cuda" / f"{name}.cu"
    cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
           "-Werror=all-warnings", "-Xptxas", "-v", "-c", str(source), "-o", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed on {name}.cu:\n{result.stderr}"
    sass = subprocess.run([CUOBJDUMP, "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    functions, current = {}, None
    for line in sass.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            current = header.group(1)
            functions[current] = []
        elif current is not None:
            functions[current].append(line)
    return {k: "\n".join(v) for k, v in functions.items()}, result.stdout + result.stderr


def test_16_bit_ghost_gram_tiles_run_on_tensor_cores():
    functions, _ = compiled("norms")
    tiles = {DTYPES[m.group(2)]: (m.group(1), sass) for name, sass in functions.items() if (m := TILES.search(name))}
    assert set(tiles) == {"float32", "float16", "bfloat16"}, sorted(tiles)
    for dtype, suffix in (("float16", ""), ("bfloat16", r"\.BF16")):  # SASS names f16 inputs with no suffix
        kernel, sass = tiles[dtype]
        assert re.search(rf"\bHMMA\.16816\.F32{suffix}\s", sass), f"{dtype}: no HMMA with fp32 accumulation"
    kernel, sass = tiles["float32"]
    assert kernel == "ghost_tiles_kernel" and "HMMA" not in sass and "FFMA" in sass  # fp32: no TF32 rounding


def test_16_bit_ghost_gram_slices_run_on_tensor_cores():
    """The split plan's slice kernel (few examples of short sequences) multiplies like the tile kernels."""
    functions, _ = compiled("norms")
    slices = {DTYPES[m.group(1)]: sass for name, sass in functions.items()
              if (m := re.search(r"ghost_slice_kernelI(f|6__half|13__nv_bfloat16)E", name))}  # fmt: skip
    assert set(slices) == {"float32", "float16", "bfloat16"}, sorted(functions)
    assert re.search(r"\bHMMA\.16816\.F32\s", slices["float16"]) and re.search(
        r"\bHMMA\.16816\.F32\.BF16\s", slices["bfloat16"]
    )
    assert "HMMA" not in slices["float32"] and "FFMA" in slices["float32"]


def test_bjorck_products_run_on_tf32_tensor_cores():
    functions, _ = compiled("orthogonal")
    kernels = {name: sass for name, sass in functions.items() if re.search(r"(gram|bjorck_update)_kernel", name)}
    assert len(kernels) == 2, sorted(functions)
    for name, sass in kernels.items():
        # 2 k-steps x 2 fragments x 3 products (3xTF32) x 4 HMMA.1684 per 16 x 16 x 8 product
        assert len(re.findall(r"\bHMMA\.1684\.F32\.TF32\b", sass)) == 48, name


@pytest.mark.parametrize("name", ["norms", "orthogonal", "spectral"])
def test_no_kernel_spills(name):
    _, report = compiled(name)
    found = PROPERTIES.findall(report)
    assert len(found) >= 2, report
    for kernel, stack, stores, loads in found:
        assert (int(stack), int(stores), int(loads)) == (0, 0, 0), f"{kernel}: {stack} B stack, {stores}/{loads} spill"
