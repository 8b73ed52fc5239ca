"""Shared TIR kernels placed into the graph by the block-cache pass, and the lookup of each
policy's own score kernel.

A policy's *score kernel* lives in its policy file (``edgekv/policies/<policy>.py``) next to
its reference scorer: ``<Policy>.evict_kernel`` is ``build_<policy>_evict_kernel(num_kv_heads,
budget, block, head_dim, dtype, **policy.kernel_params(budget))`` and returns the score
PrimFunc (see ``common`` for the shared signature) or ``None`` (``full``: append only).
Kernels shared by all policies stay here: top-N selection + compaction (``select``), block
attention over cache ⊕ block (``attention``) and the conventions (``common``).
"""

from __future__ import annotations

import functools
from typing import Any

from ...policies import REGISTRY
from ...policies.base import UnsupportedPolicyError, compiled_policy_names
from .attention import build_block_attention_kernel
from .select import build_select_compact_kernel

__all__ = ["UnsupportedPolicyError", "build_attention", "build_score", "build_select", "compiled_policy_names"]


# Kernels are immutable PrimFuncs and TVMScript parsing costs ~0.1–0.3 s each: build each
# distinct (shape, parameter) combination once per process.
@functools.lru_cache(maxsize=256)
def build_attention(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype="float32", extra_rows=0):
    return build_block_attention_kernel(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype,
                                        extra_rows)


def build_score(policy: str, num_kv_heads, budget, block, head_dim, dtype="float32", params: dict[str, Any] | None = None):
    """The score PrimFunc of the registered policy ``policy`` (None for ``full``)."""
    return _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, tuple(sorted((params or {}).items())))


@functools.lru_cache(maxsize=256)
def _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, params):
    cls = REGISTRY.get(policy)
    builder = cls.evict_kernel if cls is not None else None
    if builder is None:
        raise UnsupportedPolicyError(
            f"policy '{policy}' has no compiled kernel yet; compiled policies: {', '.join(compiled_policy_names())}")
    return builder(num_kv_heads, budget, block, head_dim, dtype, **dict(params))


@functools.lru_cache(maxsize=256)
def build_select(num_kv_heads, budget, block, head_dim, dtype="float32", with_score=True):
    return build_select_compact_kernel(num_kv_heads, budget, block, head_dim, dtype, with_score)
