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
# A finite "minus infinity" for running maxima: exp(NEG_BIG - m) is 0 without producing NaN.
NEG_BIG = -3.0e38
POS_INF = math.inf


def check_dtype(dtype: str) -> None:
    if dtype != "float32":
        raise NotImplementedError(f"edgekv kernels support float32 only for now, not {dtype}")


def lane_tree_sum(lanes: int):
    """A TIR macro ``lane_sum(part)``: folds the ``lanes`` partial sums of ``part`` into
    ``part[0]`` as a halving tree (log2(lanes) vector adds; step w folds lanes [h, 2h) onto
    [0, h), h = lanes >> (w + 1)), instead of a chain of ``lanes`` dependent scalar adds. The
    other lanes are left as scratch. ``lanes`` must be a power of two."""
    from tvm.script import tirx as T

    if lanes & (lanes - 1):
        raise ValueError(f"lanes must be a power of two, not {lanes}")
    steps = lanes.bit_length() - 1

    @T.macro
    def lane_sum(part):
        for w in T.unroll(steps):
            for l in T.vectorized(lanes // 2):
                part[l] = part[l] + part[l + (lanes >> (w + 1))]

    return lane_sum


def panel_store(NR: int, N: int):
    """A TIR macro ``store(C, acc, jo)``: a panel GEMV's ``NR`` accumulators of panel ``jo`` into
    ``C[jo * NR : jo * NR + NR]`` — one vector store, or, when ``N`` is not a whole number of
    panels, lane by lane with the columns past ``N`` (the last panel's padding) left unwritten."""
    from tvm.script import tirx as T

    if N % NR:
        @T.macro
        def store(C, acc, jo):
            for j in T.serial(NR):
                if jo * NR + j < N:
                    C[jo * NR + j] = acc[j]
    else:
        @T.macro
        def store(C, acc, jo):
            for j in T.vectorized(NR):
                C[jo * NR + j] = acc[j]
    return store
