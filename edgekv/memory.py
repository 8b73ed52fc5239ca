"""Memory: a static plan in exact bytes before running, and the measured peak after.

The plan counts the tensors the engine itself allocates: weights, the fixed cache buffers
(N + B (+ pseudo rows) entries per layer and KV head: K, V, int32 positions, per-entry
policy state), and the largest set of per-block activations live at once in a layer step.
The measured side is the process RSS high-water mark (what the OS charged) next to the
engine's own cache bytes, so a reader sees both what edgekv planned and what Python,
torch and the allocator added."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass

from .models.config import ModelConfig


@dataclass
class MemoryPlan:
    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def kv_cache_bytes(cfg: ModelConfig, capacity: int, state_buffers: int = 0, dtype_bytes: int = 4) -> int:
    per_entry = cfg.num_kv_heads * (2 * cfg.head_dim * dtype_bytes + 4 + 4 * state_buffers)
    return cfg.num_layers * capacity * per_entry


def block_activation_bytes(cfg: ModelConfig, block: int, capacity: int, dtype_bytes: int = 4) -> int:
    """Largest live activation set of one layer step with b = block rows attending to
    `capacity` keys: residual + normed input, q/k/v, attention scores (the math path's
    [Hq, b, n] matrix, an upper bound for fused kernels), attention output, the MLP's gate,
    up and product, plus the last row's logits."""
    b = block
    per_row = cfg.hidden_size * 3 + cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.intermediate_size * 3
    scores = cfg.num_heads * b * capacity
    return dtype_bytes * (b * per_row + scores + cfg.vocab_size)


def plan_memory(cfg: ModelConfig, weight_bytes: int, capacity: int, block: int, state_buffers: int = 0) -> MemoryPlan:
    return MemoryPlan(
        weights=weight_bytes,
        kv_cache=kv_cache_bytes(cfg, capacity, state_buffers),
        activations=block_activation_bytes(cfg, block, capacity),
    )


def peak_rss_bytes() -> int:
    """Process RSS high-water mark (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss
