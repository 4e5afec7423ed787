"""Build fastdp._C (C++ always, CUDA when torch has CUDA and nvcc is found).

Switches: FASTDP_SKIP_CUDA_BUILD=1 skips the CUDA kernels; TORCH_CUDA_ARCH_LIST
picks the architectures (default: 9.0 for Hopper); MAX_JOBS bounds ninja's jobs.
Install without build isolation so the extension is built against the torch in
the environment: pip install --no-build-isolation -e .
"""

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:  # pragma: no cover - build-time message only
        raise RuntimeError(
            "building fastdp._C needs torch in the build environment; install torch first "
            "(pip install torch==2.13.0 on CPU machines) and build with "
            "pip install --no-build-isolation -e ."
        ) from exc

    cpu_sources = ["csrc/bindings.cpp", *sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cpu").glob("*.cpp"))]
    include_dirs = [str(CSRC), str(CSRC / "include")]
    # -fopenmp: at::parallel_for runs on one thread without it. No fast-math: it changes the noise.
    cxx_flags = ["-O3", "-std=c++17", "-fno-math-errno", "-fopenmp"]
    link_flags = ["-fopenmp"]
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and not _truthy("FASTDP_SKIP_CUDA_BUILD")
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cuda").glob("*.cu"))
        ext = CUDAExtension(
            "fastdp._C",
            cpu_sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("FASTDP_WITH_CUDA", None)],
            # No --use_fast_math: it changes the noise and the norms.
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "-lineinfo"]},
            extra_link_args=link_flags,
        )
    else:
        ext = CppExtension(
            "fastdp._C",
            cpu_sources,
            include_dirs=include_dirs,
            extra_compile_args=cxx_flags,
            extra_link_args=link_flags,
        )
    print(f"fastdp: building fastdp._C with {'CPU + CUDA' if with_cuda else 'CPU'} kernels")
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
