"""A loaded model: geometry, fp32 weights under HF names, tokenizer, RoPE frequencies."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig


def rope_frequencies(hf_config, local: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling factor, for every RoPE
    scaling type transformers knows (default, linear, dynamic, llama3, yarn, ...); ``local``: those
    of a family's sliding-window layers (Gemma 3's own base).

    Taken from transformers' own rotary embedding so scaling rules are not re-implemented."""
    if isinstance((getattr(hf_config, "rope_parameters", None) or {}).get("full_attention"), dict):
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        rotary = Gemma3RotaryEmbedding(config=hf_config)
        kind = "sliding_attention" if local else "full_attention"
        return (getattr(rotary, f"{kind}_inv_freq").detach().float().clone(),
                float(getattr(rotary, f"{kind}_attention_scaling")))
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=hf_config)
    return rotary.inv_freq.detach().float().clone(), float(getattr(rotary, "attention_scaling", 1.0))


@dataclass
class LoadedModel:
    model_id: str
    config: ModelConfig
    hf_config: Any
    weights: dict[str, torch.Tensor]
    tokenizer: Any = None
    chat: bool = False
    source: Path | None = None
    known_weight_hash: str | None = None
    inv_freq: torch.Tensor = field(init=False)
    attention_scaling: float = field(init=False)
    # the sliding-window layers' RoPE (Gemma 3: another base); the global one where there are none
    local_inv_freq: torch.Tensor = field(init=False)
    local_attention_scaling: float = field(init=False)

    def __post_init__(self):
        self.inv_freq, self.attention_scaling = rope_frequencies(self.hf_config)
        self.local_inv_freq, self.local_attention_scaling = (
            rope_frequencies(self.hf_config, local=True) if self.config.has_local_layers
            else (self.inv_freq, self.attention_scaling))

    def weight(self, name: str) -> torch.Tensor:
        return self.weights[name]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])

    @property
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape, without reading weights kept in their file (``GGUFWeights``)."""
        shapes = getattr(self.weights, "shapes", None)
        return dict(shapes) if shapes is not None else {n: tuple(t.shape) for n, t in self.weights.items()}

    @property
    def weights_in_file(self) -> bool:
        """The weights are read from the source file on access (``gguf_weights.GGUFWeights``), not held."""
        return hasattr(self.weights, "shapes")

    @property
    def weight_bytes(self) -> int:
        if self.weights_in_file:
            return sum(4 * math.prod(s) for s in self.weight_shapes.values())
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    @cached_property
    def weight_hash(self) -> str:
        """sha256 of the weights (of the source file when known, else of the tensors)."""
        if self.known_weight_hash:
            return self.known_weight_hash
        if self.weights_in_file:  # hashing the tensors would read (dequantise) every one of them
            from .file_hash import source_sha256

            return source_sha256(Path(self.weights.path))
        digest = hashlib.sha256()
        for name in sorted(self.weights):
            digest.update(name.encode())
            digest.update(self.weights[name].contiguous().numpy().tobytes())
        return digest.hexdigest()

    def to_hf(self):
        """The same weights in transformers' own model class (for differential tests and peers)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(self.weights, strict=False)
        if unexpected or any(m != "lm_head.weight" for m in missing):
            raise RuntimeError(f"weights do not fit the HF model: missing {missing}, unexpected {unexpected}")
        if self.config.tie_embeddings:
            model.tie_weights()
        return model.eval()
