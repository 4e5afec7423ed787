"""Loads the compiled extension ``fastdp._C`` if it was built; fastdp works without it."""

from __future__ import annotations

import warnings

BUILD_HINT = (
    "build it from the source tree with `pip install --no-build-isolation -e .` "
    "(a C++17 compiler and ninja are needed; nvcc too for the CUDA kernels)"
)

try:
    from fastdp import _C  # type: ignore[attr-defined]

    LOAD_ERROR = None
except ImportError as exc:  # the package still works: torch and Triton backends
    _C = None
    LOAD_ERROR = str(exc)
    warnings.warn(
        f"fastdp._C is not available ({exc}); the C++/CUDA kernels are disabled and fastdp "
        f"uses its torch and Triton backends. To get them, {BUILD_HINT}.",
        RuntimeWarning,
        stacklevel=2,
    )


def has_cuda_kernels() -> bool:
    """Whether ``fastdp._C`` is loaded and was built with its CUDA kernels."""
    return _C is not None and bool(_C.has_cuda())
