"""IEEE float32 for the products a bound is taken of, whatever the user's TF32 / bfloat16 settings.

DP-SGD's and DP-SGD-JL's clipped sums are float64 (``fastdp.ops.summation``, unaffected by these settings); the
float32 products left inside their step (per-example gradients formed for their norm) and the Lipschitz variants'
and backprop clipping's steps, whose bounds allow for IEEE float32 rounding, run under :func:`exact_fp32`. PyTorch
can run float32 matrix products and convolutions with fewer mantissa bits:

- ``torch.set_float32_matmul_precision("high" / "medium")`` (TF32 on CUDA, TF32 or bfloat16 passes in oneDNN);
- ``torch.backends.cudnn.allow_tf32``, **True by default**: every float32 cuDNN convolution in TF32 (10 bits);
- the per-backend ``fp32_precision`` settings (``torch.backends.cuda.matmul``, ``torch.backends.cudnn.conv``,
  ``torch.backends.mkldnn.matmul`` / ``.conv``, ``torch.backends.fp32_precision``).

Each input of such a product is rounded to 2^-11 (TF32) or 2^-8 (bfloat16) of itself, so an example whose terms
cancel at large magnitude (``mass`` far above its norm) moves the sum by about ``2^-11 mass``: far beyond its bound.
:func:`exact_fp32` runs those steps with all of these at IEEE float32 and puts the user's settings back
afterwards; the forward and backward keep the user's settings (their rounding changes A and G, whose norms are
taken as they are).

The settings are process-wide: another thread's float32 products during the clipped sums also run in IEEE float32.
"""

from __future__ import annotations

import contextlib

import torch

# (backend, op) keys of the per-backend settings (torch >= 2.9), parents first: an op's "none" defers to its
# backend's "all", and that to ("generic", "all").
_KEYS = (
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)
_EXACT = ("ieee", "none")


def _getter():
    return getattr(torch._C, "_get_fp32_precision_getter", None)


def _setter():
    return getattr(torch._C, "_set_fp32_precision_setter", None)


def effective_precisions() -> dict[tuple[str, str], str]:
    """The precision each (backend, op) of :data:`_KEYS` resolves to ("ieee", "tf32", "bf16"; torch >= 2.9, else
    {}): its own setting, else its backend's "all", else the generic one."""
    get = _getter()
    if get is None:
        return {}
    raw = {key: get(*key) for key in _KEYS}
    out = {}
    for backend, op in _KEYS:
        value = raw[(backend, op)]
        for parent in ((backend, "all"), ("generic", "all")):
            if value == "none":
                value = raw[parent]
        out[(backend, op)] = "ieee" if value == "none" else value
    return out


def _read(getter):
    """A legacy setting's value, or None where torch refuses to read it (the user mixed the legacy and the
    per-backend APIs for it; the per-backend settings are then the ones set and restored)."""
    try:
        return getter()
    except RuntimeError:
        return None


@contextlib.contextmanager
@torch.compiler.disable
def exact_fp32():
    """Run the block with every float32 matrix product and convolution in IEEE float32 (module docstring); the
    previous settings are restored on exit, also on an exception."""
    get, set_ = _getter(), _setter()
    matmul, cudnn = _read(torch.get_float32_matmul_precision), _read(torch._C._get_cudnn_allow_tf32)
    saved = {key: get(*key) for key in _KEYS} if get is not None else {}
    try:
        if matmul is not None:
            torch.set_float32_matmul_precision("highest")
        if cudnn is not None:
            torch._C._set_cudnn_allow_tf32(False)
        if set_ is not None:
            for key, value in effective_precisions().items():
                if value not in _EXACT:
                    set_(*key, "ieee")
        yield
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        if cudnn is not None:
            torch._C._set_cudnn_allow_tf32(cudnn)
        for key, value in saved.items():
            set_(*key, value)
