"""The shared TIR library the compiler's passes place into the graph: top-N selection +
compaction (``select``), a sliding-window layer's ring write (``window``), block attention over cache ⊕ block (``attention``), the attention-row
helpers of the query-based policies (``attention_scores``), the kernel signatures (``signature``)
and conventions (``common``), the dense / quantised GEMMs (``dense``, ``quant_dense``) and the
int8 cache's kernels (``kv_int8``).

Nothing here knows a policy: each policy's own kernels and the lookup of them are in
``compiler/policy_kernels`` (which builds on this library).
"""

from __future__ import annotations

import functools

from ..tvmscript_speed import install as _install_fast_macro_lookup
from .attention import build_block_attention_kernel
from .select import build_select_compact_kernel
from .window import build_window_kernel

__all__ = ["build_attention", "build_select", "build_window"]

_install_fast_macro_lookup()  # T.macro expansion without a source lookup per stack frame (tvmscript_speed)


# Kernels are immutable PrimFuncs and TVMScript parsing costs ~0.1–0.3 s each: build each
# distinct (shape, parameter) combination once per process.
@functools.lru_cache(maxsize=256)
def build_attention(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype="float32", extra_rows=0,
                    cores=1, window=0):
    return build_block_attention_kernel(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype,
                                        extra_rows, cores, window)


@functools.lru_cache(maxsize=256)
def build_select(num_kv_heads, budget, block, head_dim, dtype="float32", with_score=True, num_state=0):
    return build_select_compact_kernel(num_kv_heads, budget, block, head_dim, dtype, with_score, num_state)


@functools.lru_cache(maxsize=64)
def build_window(num_kv_heads, window, block, head_dim, dtype="float32"):
    return build_window_kernel(num_kv_heads, window, block, head_dim, dtype)
