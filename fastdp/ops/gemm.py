"""The clipped sums' GEMM: ``x^T y`` over every example's positions (``fastdp.nn.layers``, ``fastdp.nn.forms``)."""

from __future__ import annotations

import functools

import torch

__all__ = ["gemm_tn"]


def gemm_tn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x^T y`` [p, d] for x [N, p], y [N, d]: on CPU in float32 by oneDNN's linear on the transposed views
    (:func:`_onednn_linear_works`), else ``torch.mm``. On the benchmark's AMD EPYC (2026-11-24), for the clipped sums
    of the LSTM, attention, GPT-2 and MLP workloads (N 256-4096, p 10-512, d 128-784): 1.04-1.85x faster than
    ``torch.mm``'s MKL GEMM with 2 threads, 1.5-1.9x with 1; passing the transposed views, not copies, is part of
    that (oneDNN reads the strides). Both accumulate in IEEE float32 inside ``fastdp._precision.exact_fp32``, which every clipped sum
    runs in (the rounding allowance of ``fastdp.nn.layers._clip_sq``)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and y.dtype == torch.float32 and _onednn_linear_works():
        return _linear(x.t(), y.t(), None, "none", [], "")
    return x.t() @ y


def _linear(*args) -> torch.Tensor:
    """torch's oneDNN linear (``mkldnn::_linear_pointwise``): ``input weight^T``."""
    return torch.ops.mkldnn._linear_pointwise(*args)


@functools.cache
def _probe_onednn_linear() -> bool:
    try:
        x, y = torch.arange(12.0).reshape(4, 3), torch.arange(8.0).reshape(4, 2)
        return torch.equal(_linear(x.t(), y.t(), None, "none", [], ""), x.t() @ y)
    except (AttributeError, RuntimeError):
        return False


def _onednn_linear_works() -> bool:
    """Whether torch's oneDNN linear (``mkldnn::_linear_pointwise``) is built, enabled (``torch.backends.mkldnn``)
    and gives ``x^T y`` on a probe (once per process)."""
    return torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available() and _probe_onednn_linear()
