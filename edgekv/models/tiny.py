"""Tiny random Llama-family models for fast tests (no files, no downloads)."""

from __future__ import annotations

import torch

from .config import config_from_hf
from .loaded import LoadedModel


def tiny_random_model(
    seed: int = 0,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    vocab: int = 256,
    max_position: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    model_type: str = "llama",
    tie_embeddings: bool = False,
) -> LoadedModel:
    """A randomly initialised decoder built by transformers itself, so its weights and
    config are exactly what the HF forward pass uses."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position, rope_parameters=rope, tie_word_embeddings=tie_embeddings,
        rms_norm_eps=1e-5,
    )
    hf_config = Qwen2Config(**kwargs) if model_type == "qwen2" else LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # HF init is tiny (std 0.02); larger weights make attention non-trivial
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.uniform_(0.8, 1.2)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tie_embeddings:
        weights.pop("lm_head.weight", None)
    return LoadedModel(
        model_id=f"tiny-{model_type}-{seed}", config=config_from_hf(hf_config), hf_config=hf_config, weights=weights
    )


def tiny_gemma3_model(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 1,
    head_dim: int = 32,
    intermediate: int = 128,
    vocab: int = 256,
    sliding_window: int = 16,
    pattern: int = 3,
    max_position: int = 4096,
    final_softcap: float | None = None,
    attn_softcap: float | None = None,
) -> LoadedModel:
    """A random Gemma 3 decoder built by transformers' Gemma3ForCausalLM: ``pattern`` − 1 sliding-window
    layers then one global layer (the real model: 5 : 1, window 512; here 2 : 1, window 16, so short
    prompts cross the window), QK-norm, four norms per layer, GeGLU, tied embeddings, √hidden scale,
    local RoPE base 10000 and global 1e6 (Gemma's)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    hf_config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_position,
        sliding_window=sliding_window, sliding_window_pattern=pattern, query_pre_attn_scalar=head_dim,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=final_softcap, attn_logit_softcapping=attn_softcap, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    hf_config._attn_implementation = "eager"  # softcapping needs the eager attention
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # Gemma's norms scale by (1 + w): weights around 0 keep that near 1
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(-0.2, 0.2)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights.pop("lm_head.weight", None)
    return LoadedModel(
        model_id=f"tiny-gemma3-{seed}", config=config_from_hf(hf_config), hf_config=hf_config, weights=weights
    )


def tiny_qwen2_model(seed: int = 0, *, layers: int = 2, tie_embeddings: bool = False) -> LoadedModel:
    """A tiny random Qwen2 shaped like Qwen2.5's small models where it matters to the engine and the
    compiler: biases on q/k/v (none on o), 2 KV heads under 6 query heads, RoPE θ = 1e6, and an
    untied LM head (Qwen2.5-1.5B's; the 0.5B ties it: ``tie_embeddings``)."""
    return tiny_random_model(seed, layers=layers, hidden=96, heads=6, kv_heads=2, head_dim=16, intermediate=160,
                             vocab=256, rope_theta=1_000_000.0, model_type="qwen2", tie_embeddings=tie_embeddings)
