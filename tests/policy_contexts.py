"""Hand-built eviction contexts shared by the attention-based policy tests."""

from __future__ import annotations

import torch

from edgekv.policies.base import EvictionContext


def make_ctx(H=2, G=2, d=8, n_cache=12, b=8, budget=10, seed=0, keys="randn", queries="randn",
             dtype=torch.float32, scale=None, state_names=()) -> EvictionContext:
    """Cache ⊕ block candidates: each head's cache holds its own sorted positions (with gaps),
    followed by a block of b consecutive positions; G query heads per KV head."""
    gen = torch.Generator().manual_seed(seed)
    start = 3 * n_cache + 5
    cache_pos = torch.stack([torch.sort(torch.randperm(start, generator=gen)[:n_cache]).values for _ in range(H)])
    block_pos = torch.arange(start, start + b)
    positions = torch.cat([cache_pos, block_pos.expand(H, b)], dim=1)
    n = n_cache + b

    def fill(mode, shape):
        return {"randn": lambda: torch.randn(shape, generator=gen), "zero": lambda: torch.zeros(shape),
                "const": lambda: torch.full(shape, 0.7)}[mode]()

    k = fill(keys, (H, n, d)).to(dtype)
    q = fill(queries, (H * G, b, d)).to(dtype)
    return EvictionContext(layer=0, num_layers=1, budget=budget, keys=k, values=k.clone(), positions=positions,
                           n_cache=n_cache, queries=q, query_positions=block_pos, scale=scale,
                           state={name: torch.zeros(H, n) for name in state_names})
