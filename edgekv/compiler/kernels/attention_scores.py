"""Attention-probability kernels of the query-based policies (SnapKV, SnapKV++, TOVA, H2O): the
TIR counterparts of ``edgekv.policies.attention_rows`` (CPU; the GPU versions are in
``edgekv/compiler/gpu_kernels.py``).

Arguments (``edgekv.policies.base``, "Compiled kernels beyond K/V"): the common eight, then the
block's queries ``q [1, Hq, B, d]`` (post-RoPE), then — for H2O — the state.

Definition (as ``attention_rows``): for query head ``hq`` (KV head ``hq // G``) and block row
``r < n_valid``, the logits ``sm_scale · q·k`` over the candidates cache rows [0, fill) ⊕ block
rows [0, r] (causal; every cache row is older than the block), softmax written out (row max,
exp, sum, divide). The rows used are the last ``min(W, n_valid)`` rows of the block (SnapKV's
window, TOVA's last row, H2O all rows).

Two stages in one PrimFunc:
1. per query head in scope (parallel): the column sums over the rows of that head's
   probabilities, row by row — one row of N + B logits at a time, never a [rows, N + B] matrix —
   into ``colsum [Hq, N + B]`` (a function-local buffer);
2. per KV head (parallel): the reduction over query heads (group mean / group sum / mean over all
   heads) and the policy's finishing step (pooling + pinned window, or the state update).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype

NEG_BIG = -3.0e38  # finite "minus infinity" for running maxima

HEADS = ("group_mean", "group_sum", "layer_mean")
POOLS = ("none", "avg", "max")


def _lanes(d: int) -> int:
    return 16 if d % 16 == 0 else (8 if d % 8 == 0 else 1)


def _colsum_macros(H, Hq, N, B, D, scale, W):
    """Stage 1 as a macro: ``colsum[hq, :]`` = Σ over the last min(W, n_valid) rows of p[hq, r, :]."""
    G = Hq // H
    NB = N + B
    LANES = _lanes(D)
    CH = D // LANES

    @T.macro
    def dot(qs, kbuf, kh, j, part, out, idx):
        for l in T.vectorized(LANES):
            part[l] = T.float32(0)
        for c0 in T.serial(CH):
            for l in T.vectorized(LANES):
                part[l] = part[l] + qs[c0 * LANES + l] * kbuf[c0 * LANES + l]
        out[idx] = T.float32(0)
        for l in T.serial(LANES):
            out[idx] = out[idx] + part[l]
        out[idx] = out[idx] * T.float32(scale)

    @T.macro
    def colsum_stage(q, k_cache, k_blk, fill, n_valid, colsum):
        for hq in T.parallel(Hq):
            with T.sblock("colsum"):
                T.reads(q[0, hq, 0:B, 0:D], k_cache[hq // G, 0:N, 0:D], k_blk[0, hq // G, 0:B, 0:D], fill[0:1],
                        n_valid[0:1])
                T.writes(colsum[hq, 0:NB])
                qs = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                srow = T.sblock_alloc_buffer((NB,), "float32")
                part = T.sblock_alloc_buffer((LANES,), "float32")
                red = T.sblock_alloc_buffer((2,), "float32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                w: T.let[T.int32] = T.min(W, nv)
                for j in T.serial(NB):
                    colsum[hq, j] = T.float32(0)
                for r0 in T.serial(W):
                    if r0 < w:
                        for c in T.vectorized(D):
                            qs[c] = q[0, hq, nv - w + r0, c]
                        # logits of the visible candidates and the row max
                        red[0] = T.float32(NEG_BIG)
                        for j in T.serial(N):
                            if j < nf:
                                for c in T.vectorized(D):
                                    kv[c] = k_cache[hq // G, j, c]
                                dot(qs, kv, hq // G, j, part, srow, j)
                                red[0] = T.max(red[0], srow[j])
                        for j in T.serial(B):
                            if j <= nv - w + r0:
                                for c in T.vectorized(D):
                                    kv[c] = k_blk[0, hq // G, j, c]
                                dot(qs, kv, hq // G, j, part, srow, nf + j)
                                red[0] = T.max(red[0], srow[nf + j])
                        # exp and row sum, then the normalised row into the column sums
                        red[1] = T.float32(0)
                        for j in T.serial(N):
                            if j < nf:
                                srow[j] = T.exp(srow[j] - red[0])
                                red[1] = red[1] + srow[j]
                        for j in T.serial(B):
                            if j <= nv - w + r0:
                                srow[nf + j] = T.exp(srow[nf + j] - red[0])
                                red[1] = red[1] + srow[nf + j]
                        for j in T.serial(N):
                            if j < nf:
                                colsum[hq, j] = colsum[hq, j] + srow[j] / red[1]
                        for j in T.serial(B):
                            if j <= nv - w + r0:
                                colsum[hq, nf + j] = colsum[hq, nf + j] + srow[nf + j] / red[1]

    return colsum_stage


def _head_reduce(H, Hq, heads):
    """(first query head, count, factor) of KV head h's reduction as TIR expressions."""
    G = Hq // H
    if heads == "group_mean":
        return (lambda h: h * G), G, 1.0 / G
    if heads == "group_sum":
        return (lambda h: h * G), G, 1.0
    if heads == "layer_mean":
        return (lambda h: 0 * h), Hq, 1.0 / Hq
    raise ValueError(f"heads must be one of {HEADS}, not {heads!r}")


def build_window_score_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                              sm_scale: float, *, window: int, heads: str, pin_window: bool, pooling: str = "none",
                              kernel_short: int = 1, kernel_long: int = 1, long_threshold: int = 1 << 30,
                              dtype: str = "float32"):
    """Score kernel ``(8 common, q, out score[H, N + B])`` of SnapKV / SnapKV++ / TOVA.

    votes[h, j] = reduction over the query heads (``heads``) of Σ over the last w = min(window,
    n_valid) block rows of p[hq, r, j]. The candidates before the last w (m = n − w of them with
    ``pin_window``, else all n) are pooled along the candidate order (stride 1, κ // 2 padding:
    ``avg`` divides the in-range sum by κ, ``max`` takes the in-range max; κ = ``kernel_short`` when
    the newest position + 1 < ``long_threshold`` else ``kernel_long``); with ``pin_window`` the last w
    candidates (the window) score +inf. Written only when fill + n_valid > N."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    if Hq % H:
        raise ValueError(f"{Hq} query heads cannot be grouped over {H} KV heads")
    if pooling not in POOLS:
        raise ValueError(f"pooling must be one of {POOLS}, not {pooling!r}")
    for k in (kernel_short, kernel_long):
        if k < 1 or k % 2 == 0:
            raise ValueError(f"pooling kernels must be odd and >= 1 (got {k})")
    NB = N + B
    W = max(1, min(int(window), B))
    PINI = 1 if pin_window else 0
    POOL = POOLS.index(pooling)
    KS, KL, THR = int(kernel_short), int(kernel_long), int(long_threshold)
    first, count, factor = _head_reduce(H, Hq, heads)
    colsum_stage = _colsum_macros(H, Hq, N, B, D, float(sm_scale), W)

    @T.prim_func(private=True, s_tir=True)
    def window_score(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        q: T.Buffer((1, Hq, B, D), "float32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        colsum = T.alloc_buffer((Hq, NB), "float32")
        if fill[0] + n_valid[0] > N:
            colsum_stage(q, k_cache, k_blk, fill, n_valid, colsum)
            for h in T.parallel(H):
                with T.sblock("finish"):
                    T.reads(colsum[0:Hq, 0:NB], fill[0:1], n_valid[0:1], pos_blk[0:B])
                    T.writes(score[h, 0:NB])
                    votes = T.sblock_alloc_buffer((NB,), "float32")
                    red = T.sblock_alloc_buffer((1,), "float32")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = nf + nv
                    w: T.let[T.int32] = T.min(W, nv)
                    m: T.let[T.int32] = n - w * PINI
                    kap: T.let[T.int32] = T.if_then_else(pos_blk[T.max(nv - 1, 0)] + 1 < THR, KS, KL)
                    for j in T.serial(NB):
                        votes[j] = T.float32(0)
                    for g in T.serial(count):
                        for j in T.serial(NB):
                            votes[j] = votes[j] + colsum[first(h) + g, j]
                    for j in T.serial(NB):
                        votes[j] = votes[j] * T.float32(factor)
                    for j in T.serial(NB):
                        if j < m:
                            if POOL == 0:
                                score[h, j] = votes[j]
                            elif POOL == 1:
                                red[0] = T.float32(0)
                                for t in T.serial(kap):
                                    if j - kap // 2 + t >= 0 and j - kap // 2 + t < m:
                                        red[0] = red[0] + votes[T.min(T.max(j - kap // 2 + t, 0), NB - 1)]
                                score[h, j] = red[0] / T.Cast("float32", kap)
                            else:
                                red[0] = votes[j]
                                for t in T.serial(kap):
                                    if j - kap // 2 + t >= 0 and j - kap // 2 + t < m:
                                        red[0] = T.max(red[0], votes[T.min(T.max(j - kap // 2 + t, 0), NB - 1)])
                                score[h, j] = red[0]
                        elif j < n:
                            score[h, j] = T.float32("inf")
                        else:
                            score[h, j] = T.float32("-inf")

    return window_score


def build_colsum_observe_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                                sm_scale: float, *, heads: str = "group_mean", num_state: int = 1,
                                dtype: str = "float32"):
    """Observe kernel ``(8 common, q, state[S, H, N], out cand_state[S, H, N + B])`` of H2O-like
    policies: state row 0 of candidate j becomes its old value (cache rows; block rows start at 0)
    plus this step's column sum over *all* n_valid block rows, reduced over query heads (``heads``).
    Other state rows (S > 1) are carried unchanged. Runs on every step."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    if Hq % H:
        raise ValueError(f"{Hq} query heads cannot be grouped over {H} KV heads")
    S = int(num_state)
    NB = N + B
    first, count, factor = _head_reduce(H, Hq, heads)
    colsum_stage = _colsum_macros(H, Hq, N, B, D, float(sm_scale), B)

    @T.prim_func(private=True, s_tir=True)
    def colsum_observe(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        q: T.Buffer((1, Hq, B, D), "float32"),
        state: T.Buffer((S, H, N), "float32"),
        cand_state: T.Buffer((S, H, NB), "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        colsum = T.alloc_buffer((Hq, NB), "float32")
        colsum_stage(q, k_cache, k_blk, fill, n_valid, colsum)
        for h in T.parallel(H):
            with T.sblock("accumulate"):
                T.reads(colsum[0:Hq, 0:NB], fill[0:1], n_valid[0:1], state[0:S, h, 0:N])
                T.writes(cand_state[0:S, h, 0:NB])
                inc = T.sblock_alloc_buffer((NB,), "float32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                for j in T.serial(NB):
                    inc[j] = T.float32(0)
                for g in T.serial(count):
                    for j in T.serial(NB):
                        inc[j] = inc[j] + colsum[first(h) + g, j]
                for s, j in T.grid(S, NB):
                    if j < nf:
                        cand_state[s, h, j] = state[s, h, T.min(j, N - 1)] + T.if_then_else(
                            s == 0, inc[j] * T.float32(factor), T.float32(0))
                    elif j < nf + nv:
                        cand_state[s, h, j] = T.if_then_else(s == 0, inc[j] * T.float32(factor), T.float32(0))
                    else:
                        cand_state[s, h, j] = T.float32(0)

    return colsum_observe


def build_state_score_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                             sm_scale: float, *, recent: int = 0, num_state: int = 1, dtype: str = "float32"):
    """Score kernel ``(8 common, q, cand_state[S, H, N + B], out score[H, N + B])`` of H2O: the
    accumulated attention (state row 0), the ``recent`` newest candidates (the last ones: the
    candidates are in position order) pinned to +inf."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    S = int(num_state)
    NB = N + B
    R = int(recent)

    @T.prim_func(private=True, s_tir=True)
    def state_score(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        q: T.Buffer((1, Hq, B, D), "float32"),
        cand_state: T.Buffer((S, H, NB), "float32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        for h in T.parallel(H):
            with T.sblock("score"):
                T.reads(cand_state[0, h, 0:NB], fill[0:1], n_valid[0:1])
                T.writes(score[h, 0:NB])
                n: T.let[T.int32] = fill[0] + n_valid[0]
                for j in T.serial(NB):
                    score[h, j] = T.if_then_else(
                        j < n, T.if_then_else(j >= n - R, T.float32("inf"), cand_state[0, h, j]), T.float32("-inf"))

    return state_score
