"""Triton kernels of fastdp, installed as ``fastdp.kernels``: @triton.jit kernels and launchers only.

``TRITON_INTERPRET=1`` must be set before this package is imported for the kernels
to run on CPU tensors in Triton's interpreter.
"""

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_table(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A launch's metadata (a nested list or a host tensor) as a ``dtype`` tensor on ``device``. For CUDA it is built
    in pinned host memory and copied asynchronously: no host synchronisation and capturable in a CUDA graph (a copy
    from pageable memory with ``non_blocking=True`` may synchronise, and graph capture rejects it); torch's caching
    host allocator records the copy's stream and keeps the pinned buffer until the copy has run."""
    table = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)
