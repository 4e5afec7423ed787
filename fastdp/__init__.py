"""fastdp: differentially private training of PyTorch models at the speed of non-private training."""

from fastdp import ops
from fastdp._backend import backend_info, get_backend, set_backend

__version__ = "0.1.0"
__all__ = ["backend_info", "get_backend", "ops", "set_backend"]
