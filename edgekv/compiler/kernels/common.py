"""Shared conventions of edgekv's TIR kernels (fp32, batch 1, static shapes).

Every layer's cache is four buffers, fixed at compile time:

    k_cache, v_cache  [H, N, d]   post-RoPE keys / values, rows [0, fill) valid, in temporal order
    pos_cache         [H, N]      int32 original token position of each row
    fill              [1]         int32 number of valid rows (the same for every head)

The block's own entries come straight from the graph: ``k_blk``/``v_blk`` [1, H, B, d]
(post-RoPE, KV heads), ``pos_blk`` [B] int32 and ``n_valid`` [1] int32 (rows ≥ n_valid
are padding and never enter the cache).

The eviction candidates are cache rows [0, fill) followed by block rows [0, n_valid):
candidate index c < fill is cache row c, otherwise block row c − fill — the same order as
the reference engine's ``cache ⊕ block`` (see ``edgekv.policies.base``).

A policy's *score kernel* has one signature for all policies:

    score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, out_score[H, N + B])

writing one float32 score per candidate (higher = keep; ties go to the lower index). It only
has to write the candidates < fill + n_valid, and only when fill + n_valid > N (otherwise
nothing is evicted and the scores are not read).
"""

from __future__ import annotations

import math

NEG_INF = -math.inf
POS_INF = math.inf


def check_dtype(dtype: str) -> None:
    if dtype != "float32":
        raise NotImplementedError(f"edgekv kernels support float32 only for now, not {dtype}")
