"""A model family's description, read from a transformers config: the geometry and the few
properties in which a family's decoder layer differs from Llama's.

Only the fields the engine, the memory plan and the compiler need; the full
transformers config is kept beside it for RoPE initialisation (scaling types).

A family is a set of values of these fields, never a second copy of the engine: Llama, Qwen2 and
Mistral take the defaults; Gemma 3 (``gemma3_text``) sets per-layer kinds (five sliding-window
"local" layers to one "global" layer, window 512), its local RoPE base, QK-norm, the four norms per
layer with Gemma's (1 + w) scale, GeGLU with tanh GELU, the √hidden embedding scale and its
attention scale; the output logits' softcapping when a config has it. The engine, the memory plan and the budget read
these fields; ``layer_kinds`` decides each layer's cache (a ring of window + B entries for a local
layer, the policy's N + B for a global one)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import ModelError

# model_type values whose decoder layer is: RMSNorm → attention (GQA, RoPE) → RMSNorm → SwiGLU MLP.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma3_text")
# what a layer's attention sees and so which cache it gets
GLOBAL, LOCAL = "global", "local"

# a GGUF's `general.architecture` → the transformers model_type its conversion gives, so that a file
# is refused from its metadata, before minutes of conversion (``check_architecture``)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "gemma3": "gemma3_text",
                      "gemma2": "gemma2", "gemma": "gemma", "phi3": "phi3", "qwen3": "qwen3"}

# what edgekv lacks for the architectures people ask for most (the refusal names the piece)
MISSING_PIECES = {
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
    # ---- the family's description; the defaults are Llama's (older manifests have none of them) ----
    layer_kinds: tuple[str, ...] = ()  # GLOBAL / LOCAL per layer; empty: every layer global
    sliding_window: int = 0  # tokens a local layer's query sees, itself included
    local_rope_theta: float = 0.0  # RoPE base of the local layers (0: rope_theta)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (q_norm / k_norm weights)
    sandwich_norms: bool = False  # four norms per layer: attention and MLP outputs normed before the residual
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma's 1
    mlp_activation: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: √hidden)
    query_scale: float = 0.0  # attention logits scale (0: 1/√head_dim)
    final_softcap: float = 0.0  # tanh softcapping of the output logits (0: none)

    def __post_init__(self):
        # a manifest gives lists: keep the dataclass hashable and comparable
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else GLOBAL

    @property
    def local_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.layer_kind(i) == LOCAL]

    @property
    def global_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.layer_kind(i) == GLOBAL]

    @property
    def has_local_layers(self) -> bool:
        return bool(self.local_layers)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layer_kinds"] = list(self.layer_kinds)
        return out


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers' base
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


# Gemma's chat turns (the GGUF of gemma3-270m carries no template). Gemma has no system role: a system
# message is a user turn. The content is inserted as given (Google's template trims it, which would
# break a document's cache followed by its question: ``chat.chat_pieces``).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else 'user' }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# a family's chat template, for tokenizers that come without one
CHAT_TEMPLATES = {"gemma3_text": GEMMA_CHAT_TEMPLATE}


def _gemma3_description(hf_config) -> dict:
    """Gemma 3's differences from Llama, from its transformers config."""
    kinds = tuple(LOCAL if t == "sliding_attention" else GLOBAL for t in hf_config.layer_types)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelError(f"Gemma 3's local layers use RoPE scaling '{local['rope_type']}'; edgekv supports the "
                         "default RoPE on sliding-window layers")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ModelError("this Gemma 3 config uses bidirectional attention (an embedding model), not a decoder")
    return dict(
        layer_kinds=kinds,
        sliding_window=int(hf_config.sliding_window) if LOCAL in kinds else 0,
        local_rope_theta=float(local.get("rope_theta", 10000.0)),
        qk_norm=True, sandwich_norms=True, norm_offset=1.0, mlp_activation="gelu_tanh",
        embed_scale=float(hf_config.hidden_size) ** 0.5,
        query_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        # (attn_logit_softcapping is not read: Gemma 3 replaced it by QK-norm and transformers' Gemma 3 never
        # applies it; edgekv runs the model as its reference does)
        final_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
    )


def config_from_hf(hf_config) -> ModelConfig:
    model_type = getattr(hf_config, "model_type", "?")
    check_architecture(model_type)
    gemma = model_type == "gemma3_text"
    if gemma and getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelError(f"Gemma 3 with activation '{hf_config.hidden_activation}': edgekv has GeGLU with tanh GELU")
    if not gemma and getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
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
        **(_gemma3_description(hf_config) if gemma else {}),
    )
