"""A sliding-window ("local") layer's cache step: the block's tokens written into a ring, in place.

A local layer (Gemma 3's sliding-window layers: ``ModelConfig.layer_kinds``) needs no policy and no
scores: every key its queries can still see is among the last ``window`` positions. Its cache is
``k, v [H, W, d], pos [H, W], fill [1]`` with W = window, a ring: token p lives in slot p mod W. A step
attends over cache ⊕ block (W + B rows: ``attention.py`` with ``window``, which masks a cache slot by
the position it holds) and then this kernel writes the block's valid rows to their slots — the last
min(n_valid, W) of them, the older ones of a block longer than the window would be overwritten in the
same step — and sets fill = min(fill + n_valid, W). One row of K and V per token, nothing moves: the
entries still in the window stay where they are, the one that leaves it is overwritten.

Positions start at 0 in a fresh cache (the runtimes' sessions do, and a saved cache carries its
slots), so while fill < W the valid slots are [0, fill), as the attention kernel reads them.

Signature: the common eight of ``signature.py`` (``k_cache, v_cache, pos_cache, fill, k_blk, v_blk,
pos_blk, n_valid``), in place on the first four, as the append-only select kernel's.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype
from .signature import StepShapes, select_kernel


def build_window_kernel(num_kv_heads: int, window: int, block: int, head_dim: int, dtype: str = "float32"):
    """In-place kernel ``(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid)`` of a
    local layer whose cache is a ring of ``window`` slots."""
    check_dtype(dtype)
    H, W, B, D = num_kv_heads, window, block, head_dim

    @T.macro
    def write_ring(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        for h in T.parallel(H):
            with T.sblock("window"):
                nv: T.let[T.int32] = n_valid[0]
                first: T.let[T.int32] = T.max(nv - W, 0)
                for i in T.serial(B):
                    if i >= first:
                        if i < nv:
                            slot: T.let[T.int32] = T.floormod(pos_blk[i], W)
                            for c in T.vectorized(D):
                                k_cache[h, slot, c] = k_blk[0, h, i, c]
                                v_cache[h, slot, c] = v_blk[0, h, i, c]
                            pos_cache[h, slot] = pos_blk[i]
        with T.sblock("fill"):
            fill[0] = T.min(fill[0] + n_valid[0], W)

    return select_kernel(StepShapes(H, W, B, D), write_ring, with_score=False)
