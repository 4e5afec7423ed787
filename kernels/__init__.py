"""Triton kernels of fastdp, installed as ``fastdp.kernels``: @triton.jit kernels and launchers only.

``TRITON_INTERPRET=1`` must be set before this package is imported for the kernels
to run on CPU tensors in Triton's interpreter.
"""

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
