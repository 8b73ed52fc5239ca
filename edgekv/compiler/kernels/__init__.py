"""TIR kernels placed into the graph by the block-cache pass.

``build_<policy>_evict_kernel(num_kv_heads, budget, block, head_dim, dtype, **policy_params)``
returns the policy's *score* PrimFunc (see ``common`` for the shared signature) or ``None``
(``full``: append only). Selection and compaction are shared (``select``); attention over
cache ⊕ block is ``attention``. These builders are meant to move into the policy files
(``edgekv/policies/<policy>.py``) next to each reference scorer.
"""

from __future__ import annotations

import functools
from typing import Any

from .attention import build_block_attention_kernel
from .full import build_full_evict_kernel
from .keydiff import build_keydiff_evict_kernel
from .lagkv import build_lagkv_evict_kernel
from .select import build_select_compact_kernel
from .streaming import build_streaming_evict_kernel

EVICT_KERNELS = {
    "full": build_full_evict_kernel,
    "streaming": build_streaming_evict_kernel,
    "keydiff": build_keydiff_evict_kernel,
    "lagkv": build_lagkv_evict_kernel,
}


class UnsupportedPolicyError(ValueError):
    pass


def compiled_policy_names() -> list[str]:
    return sorted(EVICT_KERNELS)


# Kernels are immutable PrimFuncs and TVMScript parsing costs ~0.1–0.3 s each: build each
# distinct (shape, parameter) combination once per process.
@functools.lru_cache(maxsize=256)
def build_attention(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype="float32"):
    return build_block_attention_kernel(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype)


def build_score(policy: str, num_kv_heads, budget, block, head_dim, dtype="float32", params: dict[str, Any] | None = None):
    return _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, tuple(sorted((params or {}).items())))


@functools.lru_cache(maxsize=256)
def _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, params):
    params = dict(params)
    if policy not in EVICT_KERNELS:
        raise UnsupportedPolicyError(
            f"policy '{policy}' has no compiled kernel yet; compiled policies: {', '.join(compiled_policy_names())}")
    return EVICT_KERNELS[policy](num_kv_heads, budget, block, head_dim, dtype, **(params or {}))


@functools.lru_cache(maxsize=256)
def build_select(num_kv_heads, budget, block, head_dim, dtype="float32", with_score=True):
    return build_select_compact_kernel(num_kv_heads, budget, block, head_dim, dtype, with_score)
