"""Model loading: known names, GGUF files and HF directories → ``LoadedModel``."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, config_from_hf
from .errors import ModelError
from .loaded import LoadedModel
from .loader import load_model
from .sources import DEFAULT_MODEL, KNOWN_MODELS, cache_root
from .tiny import tiny_gemma3_model, tiny_random_model

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelConfig", "ModelError",
    "cache_root", "config_from_hf", "load_model", "tiny_gemma3_model", "tiny_random_model",
]
