"""fastdp: differentially private training of PyTorch models at the speed of non-private training."""

from fastdp import ops
from fastdp._backend import backend_info, get_backend, set_backend

__version__ = "0.1.0"
__all__ = ["PrivacyEngine", "backend_info", "get_backend", "ops", "set_backend"]


def __getattr__(name: str):
    """``fastdp.PrivacyEngine``, imported on first use (the front door pulls in the variants and the accountants)."""
    if name == "PrivacyEngine":
        from fastdp.engine import PrivacyEngine

        return PrivacyEngine
    raise AttributeError(f"module 'fastdp' has no attribute {name!r}")
