"""The geometry of a Llama-family decoder, read from a transformers config.

Only the fields the engine, the memory plan and the compiler need; the full
transformers config is kept beside it for RoPE initialisation (scaling types)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import ModelError

# model_type values whose decoder layer is: RMSNorm → attention (GQA, RoPE) → RMSNorm → SwiGLU MLP.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

# a GGUF's `general.architecture` → the transformers model_type its conversion gives, so that a file
# is refused from its metadata, before minutes of conversion (``check_architecture``)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "gemma3": "gemma3_text",
                      "gemma2": "gemma2", "gemma": "gemma", "phi3": "phi3", "qwen3": "qwen3"}

# what edgekv lacks for the architectures people ask for most (the refusal names the piece)
MISSING_PIECES = {
    "gemma3_text": "per-layer sliding-window / global attention with their own caches, QK-norm, the four norms "
                   "per layer and GeGLU (edgekv/models/config.py has no Gemma 3 description yet)",
    "gemma2": "attention-logit softcapping and alternating sliding-window layers",
    "gemma": "Gemma's (1 + w) RMSNorm, GeGLU and the embedding scale",
    "phi3": "the fused qkv / gate_up projections of Phi-3",
    "qwen3": "QK-norm (Qwen3's per-head RMSNorm of queries and keys)",
}


def check_architecture(model_type: str, what: str = "the model") -> None:
    """Refuse an architecture edgekv has no description for, naming the missing piece."""
    if model_type in SUPPORTED_ARCHITECTURES:
        return
    missing = MISSING_PIECES.get(model_type, "a description of its decoder layer in edgekv/models/config.py")
    raise ModelError(
        f"unsupported architecture '{model_type}' ({what}); edgekv supports Llama-family decoders: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (GQA, RoPE, RMSNorm, SwiGLU). Missing for '{model_type}': {missing}"
    )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


def config_from_hf(hf_config) -> ModelConfig:
    model_type = getattr(hf_config, "model_type", "?")
    check_architecture(model_type)
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        raise ModelError("models with sliding-window attention layers are not supported yet")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rope_theta=_rope_theta(hf_config),
        rms_eps=float(hf_config.rms_norm_eps),
        max_position=int(getattr(hf_config, "max_position_embeddings", 2048)),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        # Qwen2 has q/k/v biases without saying so in an attention_bias field.
        attention_bias=bool(getattr(hf_config, "attention_bias", model_type == "qwen2")),
    )
