"""The front door: Opacus' API (``PrivacyEngine``) over fastdp's per-example engine, for any model, data and loop.

Layers: ``data`` (Poisson loader), ``module`` (the model's recording wrapper), ``optimizer`` (the private step),
``privacy_engine`` (``make_private``, accounting). It sits above ``fastdp.algorithms``: the variants compute the
clipped sums and the noise, the front door only wires the user's loop to them.
"""

from fastdp.engine.data import BatchMemoryManager, DPDataLoader
from fastdp.engine.loss import DPLoss
from fastdp.engine.module import PrivateModule
from fastdp.engine.optimizer import DPOptimizer
from fastdp.engine.privacy_engine import PrivacyEngine

__all__ = ["BatchMemoryManager", "DPDataLoader", "DPLoss", "DPOptimizer", "PrivacyEngine", "PrivateModule"]
