"""Model loading: known names, GGUF files and HF directories → ``LoadedModel``."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, config_from_hf
from .errors import ModelError
from .sources import DEFAULT_MODEL, KNOWN_MODELS, cache_root

# the parts that import torch load on first use, so that importing a light part (config, sources:
# the CLI's help, budgets, manifests) does not cost torch's import (seconds)
_LAZY = {"LoadedModel": ".loaded", "load_model": ".loader", "tiny_random_model": ".tiny",
         "tiny_gemma3_model": ".tiny", "tiny_qwen2_model": ".tiny"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelConfig", "ModelError",
    "cache_root", "config_from_hf", "load_model", "tiny_gemma3_model", "tiny_qwen2_model", "tiny_random_model",
]
