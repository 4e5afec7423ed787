"""Build checks that need no GPU: CUDA sources compile for sm_90, Triton kernels compile for Hopper."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastdp._ext

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
KERNEL_MODULES = {p.stem for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__"}
NVCC = shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.path.exists(p)), None)


def test_there_are_cuda_sources():
    assert CUDA_SOURCES, "csrc/cuda/*.cu not found"


@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_sources_include_no_torch_headers(source):
    includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', source.read_text())
    banned = [h for h in includes if h.split("/")[0] in {"torch", "ATen", "c10"}]
    assert not banned, f"{source.name} includes torch headers {banned}; keep torch types in bindings.cpp"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check .cu files)")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_sources_compile_for_sm90(source, tmp_path):
    cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
           "-Werror=all-warnings", "-c", str(source), "-o", str(tmp_path / "out.o")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr}"


# Just enough of the CUDA libraries that torch's ATen/cuda headers name (their handle and status types), which the
# toolkit here lacks: the compile check below needs declarations, not the libraries.
CUDA_LIBRARY_STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n"
    "typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;\n"
    'inline const char* cusparseGetErrorString(cusparseStatus_t) { return ""; }',
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\n"
    "typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_SUPPORTED = 15 } cublasStatus_t;",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;",
    "cusolver_common.h": "typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (its runtime headers are needed)")
def test_bindings_compile_with_cuda(tmp_path):
    """bindings.cpp's CUDA half (FASTDP_WITH_CUDA) is never built here (the CPU torch wheel): compile it anyway
    (syntax and types, against the wheel's ATen/cuda headers and the toolkit's runtime headers), so that a GPU
    session does not start with a build error."""
    import sysconfig

    import torch.utils.cpp_extension as cpp

    for name, text in CUDA_LIBRARY_STUBS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"#pragma once\n{text}\n")
    cuda_include = Path(cpp.CUDA_HOME or "/usr/local/cuda") / "include"
    if not (cuda_include / "cuda_runtime_api.h").exists():
        pytest.skip(f"no CUDA runtime headers in {cuda_include}")
    includes = [f"-isystem{p}" for p in [*cpp.include_paths(), cuda_include, sysconfig.get_paths()["include"]]]
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-DFASTDP_WITH_CUDA", f"-I{tmp_path}", *includes,
           f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}", "-Wall", "-Werror",
           str(ROOT / "csrc" / "bindings.cpp")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"bindings.cpp with FASTDP_WITH_CUDA does not compile:\n{result.stderr[-4000:]}"


def test_triton_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "hopper_compile.py")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, f"Triton compile for sm_90 failed:\n{result.stdout}\n{result.stderr}"
    assert "compiled" in result.stdout
    compiled = {line.split()[1].split(".")[0] for line in result.stdout.splitlines() if line.startswith("ok ")}
    stacks = [line.rsplit(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert "None" not in stacks, "triton ships no cuobjdump here: the register-spill check did not run"
    missing = sorted(KERNEL_MODULES - compiled)
    assert not missing, f"kernels/{missing} compiled no kernel for sm_90; list them in hopper_compile_specs()"


@pytest.mark.skipif(os.environ.get("FASTDP_REQUIRE_EXT") != "1", reason="set FASTDP_REQUIRE_EXT=1 to require _C")
def test_extension_is_built():
    assert fastdp._ext._C is not None, f"fastdp._C did not load: {fastdp._ext.LOAD_ERROR}"


def test_package_works_without_the_extension():
    """Without _C: one warning that says how to build it, and the torch backend still adds noise."""
    code = """
import sys, warnings
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "fastdp._C":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fastdp, torch
    g = torch.zeros(1000)
    fastdp.ops.add_noise_([g], 1.0, seed=1, offset=0)
    fastdp.ops.add_noise_([g], 1.0, seed=1, offset=1)
messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert len(messages) == 1, messages
assert "pip install --no-build-isolation -e ." in messages[0], messages[0]
assert fastdp.backend_info()["ops"]["noise"]["cpu"]["backend"] == "torch"
assert g.std() > 0.5
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("FASTDP_BACKEND", "TRITON_INTERPRET")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
