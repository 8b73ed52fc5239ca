"""A sliding-window ("local") layer's cache step: keep the newest ``window`` tokens, in place.

A local layer (Gemma 3's sliding-window layers: ``ModelConfig.layer_kinds``) needs no policy and no
scores: every key its queries can still see is among the last ``window`` positions. Its cache is
``k, v [H, W, d], pos [H, W], fill [1]`` with W = window; a step attends over cache ⊕ block (W + B
rows: ``attention.py`` with ``window``) and then this kernel keeps the newest min(fill + n_valid, W)
of the fill + n_valid candidates (cache rows, then the block's valid rows), shifted to the front in
order. Candidate ``drop + i`` goes to row i (drop = the oldest rows that leave): the source is never
before the destination, so ascending i writes in place. The order (oldest first, positions
contiguous) is what lets the attention kernel apply the window as a bound on indices.

Signature: the common eight of ``signature.py`` (``k_cache, v_cache, pos_cache, fill, k_blk, v_blk,
pos_blk, n_valid``), in place on the first four, as the append-only select kernel's.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype
from .signature import StepShapes, select_kernel


def build_window_kernel(num_kv_heads: int, window: int, block: int, head_dim: int, dtype: str = "float32"):
    """In-place kernel ``(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid)`` of a
    local layer whose cache holds ``window`` rows."""
    check_dtype(dtype)
    H, W, B, D = num_kv_heads, window, block, head_dim

    @T.macro
    def keep_newest(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        for h in T.parallel(H):
            with T.sblock("window"):
                nf: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                drop: T.let[T.int32] = T.max(n - W, 0)
                for i in T.serial(W):
                    if i < n - drop:
                        if drop + i < nf:
                            if drop > 0:
                                for c in T.vectorized(D):
                                    k_cache[h, i, c] = k_cache[h, drop + i, c]
                                    v_cache[h, i, c] = v_cache[h, drop + i, c]
                                pos_cache[h, i] = pos_cache[h, drop + i]
                        else:
                            for c in T.vectorized(D):
                                k_cache[h, i, c] = k_blk[0, h, drop + i - nf, c]
                                v_cache[h, i, c] = v_blk[0, h, drop + i - nf, c]
                            pos_cache[h, i] = pos_blk[drop + i - nf]
        with T.sblock("fill"):
            fill[0] = T.min(fill[0] + n_valid[0], W)

    return select_kernel(StepShapes(H, W, B, D), keep_newest, with_score=False)
