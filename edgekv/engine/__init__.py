"""The eager PyTorch block-wise engine: the oracle for every compiled result."""

from .block_engine import BlockEngine, EngineStats
from .cache import LayerCache
from .sampling import Sampler

__all__ = ["BlockEngine", "EngineStats", "LayerCache", "Sampler"]
