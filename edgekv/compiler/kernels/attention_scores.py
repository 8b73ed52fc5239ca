"""Attention-probability kernels of the query-based policies (SnapKV, SnapKV++, TOVA, H2O): the
TIR counterparts of ``edgekv.policies.attention_rows``, CPU and GPU (the ``_gpu`` builders at
the end of this file; same signatures, ``signature.py``).

Arguments (``compiler/policy_kernels/face.py``): the common eight, then the
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

from .common import NEG_BIG, check_dtype
from .signature import StepShapes, observe_kernel, score_kernel, state_score_kernel


HEADS = ("group_mean", "group_sum", "layer_mean")
POOLS = ("none", "avg", "max")


def _lanes(d: int) -> int:
    return 16 if d % 16 == 0 else (8 if d % 8 == 0 else 1)


def _colsum_macros(H, Hq, N, B, D, scale, W, Q=0, WQ=0):
    """Stage 1 as a macro: ``colsum[hq, :]`` = Σ over the observer rows of p[hq, r, :].

    The step has B real rows then Q question rows (``--question-rows``; ``passes/pseudo_rows.py``). The
    observers are the last min(W, n_valid) real rows, each seeing the cache and the real rows up to
    its own — or, when the step carries a question (``nq`` > 0 rows at a position ≥ 0, the first nq
    of the Q), the last min(WQ, nq) question rows, each seeing the cache and every real row (all
    older), never the question's own keys (they are not candidates: the eager reference's softmax)."""
    G = Hq // H
    NB = N + B + Q
    LANES = _lanes(D)
    CH = D // LANES
    WL = max(W, WQ)

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
    def colsum_stage(q, k_cache, k_blk, fill, n_valid, nq_buf, colsum):
        for hq in T.parallel(Hq):
            with T.sblock("colsum"):
                T.reads(q[0, hq, 0:B + Q, 0:D], k_cache[hq // G, 0:N, 0:D], k_blk[0, hq // G, 0:B + Q, 0:D],
                        fill[0:1], n_valid[0:1], nq_buf[0:1])
                T.writes(colsum[hq, 0:NB])
                qs = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                srow = T.sblock_alloc_buffer((NB,), "float32")
                part = T.sblock_alloc_buffer((LANES,), "float32")
                red = T.sblock_alloc_buffer((2,), "float32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                nq: T.let[T.int32] = nq_buf[0]
                w: T.let[T.int32] = T.if_then_else(nq > 0, T.min(WQ, nq), T.min(W, nv))
                row0: T.let[T.int32] = T.if_then_else(nq > 0, B + nq - w, nv - w)
                # the last block key the observer row r0 sees (question rows: every real row)
                for j in T.serial(NB):
                    colsum[hq, j] = T.float32(0)
                for r0 in T.serial(WL):
                    if r0 < w:
                        for c in T.vectorized(D):
                            qs[c] = q[0, hq, row0 + r0, c]
                        # logits of the visible candidates and the row max
                        red[0] = T.float32(NEG_BIG)
                        for j in T.serial(N):
                            if j < nf:
                                for c in T.vectorized(D):
                                    kv[c] = k_cache[hq // G, j, c]
                                dot(qs, kv, hq // G, j, part, srow, j)
                                red[0] = T.max(red[0], srow[j])
                        for j in T.serial(B):
                            if j <= T.if_then_else(nq > 0, nv - 1, row0 + r0):
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
                            if j <= T.if_then_else(nq > 0, nv - 1, row0 + r0):
                                srow[nf + j] = T.exp(srow[nf + j] - red[0])
                                red[1] = red[1] + srow[nf + j]
                        for j in T.serial(N):
                            if j < nf:
                                colsum[hq, j] = colsum[hq, j] + srow[j] / red[1]
                        for j in T.serial(B):
                            if j <= T.if_then_else(nq > 0, nv - 1, row0 + r0):
                                colsum[hq, nf + j] = colsum[hq, nf + j] + srow[nf + j] / red[1]

    @T.macro
    def count_question_rows(pos_blk, nq_buf):
        """nq_buf[0] = the question rows of this step: those at a position ≥ 0 (padding is at −1)."""
        with T.sblock("question_rows"):
            T.reads(pos_blk[B:B + Q])
            T.writes(nq_buf[0:1])
            nq_buf[0] = 0
            for r in T.serial(Q):
                if pos_blk[B + r] >= 0:
                    nq_buf[0] = nq_buf[0] + 1

    return colsum_stage, count_question_rows


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
                              question_rows: int = 0, dtype: str = "float32"):
    """Score kernel ``(8 common, q, out score[H, N + B])`` of SnapKV / SnapKV++ / TOVA.

    ``question_rows`` = Q > 0: the last Q of the ``block`` rows are question rows (``--question-rows``);
    on a step that carries a question the window is its last min(window, nq) rows, which vote over
    the candidates and pin nothing (they are not candidates), as ``scoring_rows`` in the reference.

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
    Q = int(question_rows)
    B = B - Q  # real rows
    NB = N + B + Q
    W = max(1, min(int(window), B))
    WQ = max(1, min(int(window), Q)) if Q else 0
    PINI = 1 if pin_window else 0
    POOL = POOLS.index(pooling)
    KS, KL, THR = int(kernel_short), int(kernel_long), int(long_threshold)
    first, count, factor = _head_reduce(H, Hq, heads)
    colsum_stage, count_question_rows = _colsum_macros(H, Hq, N, B, D, float(sm_scale), W, Q, WQ)

    @T.macro
    def window_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score):
        colsum = T.alloc_buffer((Hq, NB), "float32")
        nq_buf = T.alloc_buffer((1,), "int32")
        if fill[0] + n_valid[0] > N:
            count_question_rows(pos_blk, nq_buf)
            colsum_stage(q, k_cache, k_blk, fill, n_valid, nq_buf, colsum)
            for h in T.parallel(H):
                with T.sblock("finish"):
                    T.reads(colsum[0:Hq, 0:NB], fill[0:1], n_valid[0:1], pos_blk[0:B], nq_buf[0:1])
                    T.writes(score[h, 0:NB])
                    votes = T.sblock_alloc_buffer((NB,), "float32")
                    red = T.sblock_alloc_buffer((1,), "float32")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = nf + nv
                    w: T.let[T.int32] = T.if_then_else(nq_buf[0] > 0, 0, T.min(W, nv))  # the pinned window
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

    return score_kernel(StepShapes(H, N, B + Q, D, Hq=Hq), window_score, queries=True)


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
    colsum_stage, _ = _colsum_macros(H, Hq, N, B, D, float(sm_scale), B)

    @T.macro
    def colsum_observe(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, state, cand_state):
        colsum = T.alloc_buffer((Hq, NB), "float32")
        nq_buf = T.alloc_buffer((1,), "int32")  # no question rows: every step observes its real rows
        with T.sblock("no_question"):
            nq_buf[0] = 0
        colsum_stage(q, k_cache, k_blk, fill, n_valid, nq_buf, colsum)
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

    return observe_kernel(StepShapes(H, N, B, D, Hq=Hq, S=S), colsum_observe)


def build_state_score_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                             sm_scale: float, *, recent: int = 0, num_state: int = 1, question_rows: int = 0,
                             dtype: str = "float32"):
    """Score kernel ``(8 common, q, cand_state[S, H, N + B], out score[H, N + B])`` of H2O: the
    accumulated attention (state row 0), the ``recent`` newest candidates (the last ones: the
    candidates are in position order) pinned to +inf. ``question_rows`` = Q > 0: on a step that
    carries a question, the column sums of all its rows over the candidates (group mean) join
    the accumulated sums, never stored (the reference's ``score`` with ``extra_is_question``)."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    Q = int(question_rows)
    B = B - Q  # real rows
    S = int(num_state)
    NB = N + B + Q
    R = int(recent)
    first, count, factor = _head_reduce(H, Hq, "group_mean")
    colsum_stage, count_question_rows = _colsum_macros(H, Hq, N, B, D, float(sm_scale), 1, Q, Q)

    @T.macro
    def state_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, cand_state, score):
        colsum = T.alloc_buffer((Hq, NB), "float32")
        nq_buf = T.alloc_buffer((1,), "int32")
        if Q > 0:
            count_question_rows(pos_blk, nq_buf)
            if nq_buf[0] > 0:
                colsum_stage(q, k_cache, k_blk, fill, n_valid, nq_buf, colsum)
        for h in T.parallel(H):
            with T.sblock("score"):
                T.reads(cand_state[0, h, 0:NB], fill[0:1], n_valid[0:1], colsum[0:Hq, 0:NB], nq_buf[0:1])
                T.writes(score[h, 0:NB])
                asked = T.sblock_alloc_buffer((NB,), "float32")
                n: T.let[T.int32] = fill[0] + n_valid[0]
                for j in T.serial(NB):
                    asked[j] = T.float32(0)
                if Q > 0:
                    if nq_buf[0] > 0:
                        for g in T.serial(count):
                            for j in T.serial(NB):
                                asked[j] = asked[j] + colsum[first(h) + g, j]
                for j in T.serial(NB):
                    score[h, j] = T.if_then_else(
                        j < n, T.if_then_else(j >= n - R, T.float32("inf"),
                                              cand_state[0, h, j] + asked[j] * T.float32(factor)), T.float32("-inf"))

    return state_score_kernel(StepShapes(H, N, B + Q, D, Hq=Hq, S=S), state_score)


# ---- GPU versions (same signatures; swapped in by gpu_schedule.ReplaceKernels) ---------------------

def _colsum_stages_gpu(H, Hq, N, B, D, scale, W, NT):
    """Stages 1–2 as macros, each its own launch (launch boundaries order the global writes):

    ``row_stats``: one thread block per (query head, window row); the NT threads take strided
    candidates, keep an online max / sum of exp, and a shared-memory tree combines them into the
    row's softmax max and denominator (``stats [Hq, W, 2]``).
    ``column_sums``: one thread block per (query head, tile of NT candidates), one candidate per
    thread (its key row in registers); every window row's query is staged in shared memory and the
    thread adds exp(s − max) / sum — the probabilities re-derived from the row statistics, so no
    row of N + B probabilities is ever stored (``colsum [Hq, N + B]``)."""
    G = Hq // H
    NB = N + B
    SCAN = (NB + NT - 1) // NT
    CT = SCAN
    LEVELS = NT.bit_length() - 1
    assert 1 << LEVELS == NT

    @T.macro
    def row_stats(q, k_cache, k_blk, fill, n_valid, stats):
        for bx in T.thread_binding(Hq * W, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("row_stats"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    m_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    l_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    st = T.sblock_alloc_buffer((4,), "float32", scope="local")  # m, l, s, m_new
                    hq: T.let[T.int32] = bx // W
                    r0: T.let[T.int32] = bx % W
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    w: T.let[T.int32] = T.min(W, nv)
                    r: T.let[T.int32] = T.max(nv - w + r0, 0)
                    for u in T.serial((D + NT - 1) // NT):
                        if u * NT + tx < D:
                            q_sh[u * NT + tx] = q[0, hq, T.min(r, B - 1), u * NT + tx]
                    T.tvm_storage_sync("shared")
                    st[0] = T.float32(NEG_BIG)
                    st[1] = T.float32(0)
                    if r0 < w:
                        for u in T.serial(SCAN):
                            if u * NT + tx < nf or (u * NT + tx >= nf and u * NT + tx - nf <= r):
                                st[2] = T.float32(0)
                                for c in T.serial(D):
                                    st[2] = st[2] + q_sh[c] * T.if_then_else(
                                        u * NT + tx < nf, k_cache[hq // G, T.min(u * NT + tx, N - 1), c],
                                        k_blk[0, hq // G, T.min(T.max(u * NT + tx - nf, 0), B - 1), c])
                                st[2] = st[2] * T.float32(scale)
                                st[3] = T.max(st[0], st[2])
                                st[1] = st[1] * T.exp(st[0] - st[3]) + T.exp(st[2] - st[3])
                                st[0] = st[3]
                    m_sh[tx] = st[0]
                    l_sh[tx] = st[1]
                    T.tvm_storage_sync("shared")
                    for lvl in T.unroll(LEVELS):
                        if tx < T.shift_right(NT // 2, lvl):
                            st[2] = m_sh[tx + T.shift_right(NT // 2, lvl)]
                            st[3] = T.max(st[0], st[2])
                            st[1] = st[1] * T.exp(st[0] - st[3]) + l_sh[tx + T.shift_right(NT // 2, lvl)] * T.exp(
                                st[2] - st[3])
                            st[0] = st[3]
                        T.tvm_storage_sync("shared")
                        if tx < T.shift_right(NT // 2, lvl):
                            m_sh[tx] = st[0]
                            l_sh[tx] = st[1]
                        T.tvm_storage_sync("shared")
                    if tx == 0:
                        stats[hq, r0, 0] = m_sh[0]
                        stats[hq, r0, 1] = l_sh[0]

    @T.macro
    def column_sums(q, k_cache, k_blk, fill, n_valid, stats, colsum):
        for bx in T.thread_binding(Hq * CT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("column_sums"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    kreg = T.sblock_alloc_buffer((D,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    hq: T.let[T.int32] = bx // CT
                    j: T.let[T.int32] = (bx % CT) * NT + tx
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    w: T.let[T.int32] = T.min(W, nv)
                    for c in T.serial(D):
                        kreg[c] = T.if_then_else(j < nf, k_cache[hq // G, T.min(j, N - 1), c],
                                                 k_blk[0, hq // G, T.min(T.max(j - nf, 0), B - 1), c])
                    acc[0] = T.float32(0)
                    for r0 in T.serial(W):
                        if r0 < w:
                            T.tvm_storage_sync("shared")
                            for u in T.serial((D + NT - 1) // NT):
                                if u * NT + tx < D:
                                    q_sh[u * NT + tx] = q[0, hq, T.min(T.max(nv - w + r0, 0), B - 1), u * NT + tx]
                            T.tvm_storage_sync("shared")
                            if j < nf or (j >= nf and j - nf <= nv - w + r0):
                                acc[1] = T.float32(0)
                                for c in T.serial(D):
                                    acc[1] = acc[1] + q_sh[c] * kreg[c]
                                acc[0] = acc[0] + T.exp(acc[1] * T.float32(scale) - stats[hq, r0, 0]) / stats[hq, r0, 1]
                    if j < NB:
                        colsum[hq, T.min(j, NB - 1)] = T.if_then_else(j < nf + nv, acc[0], T.float32(0))

    return row_stats, column_sums


def _head_reduce_gpu(H, Hq, heads):
    G = Hq // H
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, not {heads!r}")
    return {"group_mean": (G, G, 1.0 / G), "group_sum": (G, G, 1.0), "layer_mean": (0, Hq, 1.0 / Hq)}[heads]


def build_window_score_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                                  sm_scale: float, *, window: int, heads: str, pin_window: bool, pooling: str = "none",
                                  kernel_short: int = 1, kernel_long: int = 1, long_threshold: int = 1 << 30,
                                  dtype: str = "float32"):
    """GPU ``kernels.attention_scores.build_window_score_kernel``: row statistics, column sums,
    then per (KV head, tile of candidates) the head reduction into ``votes [H, N + B]`` (a device
    workspace), then the pooling / window pin into ``score`` — four launches, each fully parallel."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    if Hq % H:
        raise ValueError(f"{Hq} query heads cannot be grouped over {H} KV heads")
    if pooling not in POOLS:
        raise ValueError(f"pooling must be one of {POOLS}, not {pooling!r}")
    NB = N + B
    NT = 128
    CT = (NB + NT - 1) // NT
    W = max(1, min(int(window), B))
    PINI = 1 if pin_window else 0
    POOL = POOLS.index(pooling)
    KS, KL, THR = int(kernel_short), int(kernel_long), int(long_threshold)
    stride, count, factor = _head_reduce_gpu(H, Hq, heads)
    row_stats, column_sums = _colsum_stages_gpu(H, Hq, N, B, D, float(sm_scale), W, NT)

    @T.macro
    def window_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score):
        stats = T.alloc_buffer((Hq, W, 2), "float32")
        colsum = T.alloc_buffer((Hq, NB), "float32")
        votes = T.alloc_buffer((H, NB), "float32")
        row_stats(q, k_cache, k_blk, fill, n_valid, stats)
        column_sums(q, k_cache, k_blk, fill, n_valid, stats, colsum)
        for bx in T.thread_binding(H * CT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("reduce_heads"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    h: T.let[T.int32] = bx // CT
                    j: T.let[T.int32] = (bx % CT) * NT + tx
                    if j < NB:
                        acc[0] = T.float32(0)
                        for g in T.serial(count):
                            acc[0] = acc[0] + colsum[h * stride + g, T.min(j, NB - 1)]
                        votes[h, T.min(j, NB - 1)] = acc[0] * T.float32(factor)
        for bx in T.thread_binding(H * CT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("pool"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    h: T.let[T.int32] = bx // CT
                    j: T.let[T.int32] = (bx % CT) * NT + tx
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = nf + nv
                    m: T.let[T.int32] = n - T.min(W, nv) * PINI
                    kap: T.let[T.int32] = T.if_then_else(pos_blk[T.max(nv - 1, 0)] + 1 < THR, KS, KL)
                    if j < NB:
                        if j < m:
                            if POOL == 0:
                                red[0] = votes[h, T.min(j, NB - 1)]
                            elif POOL == 1:
                                red[0] = T.float32(0)
                                for t in T.serial(kap):
                                    if j - kap // 2 + t >= 0 and j - kap // 2 + t < m:
                                        red[0] = red[0] + votes[h, T.min(T.max(j - kap // 2 + t, 0), NB - 1)]
                                red[0] = red[0] / T.Cast("float32", kap)
                            else:
                                red[0] = votes[h, T.min(j, NB - 1)]
                                for t in T.serial(kap):
                                    if j - kap // 2 + t >= 0 and j - kap // 2 + t < m:
                                        red[0] = T.max(red[0], votes[h, T.min(T.max(j - kap // 2 + t, 0), NB - 1)])
                            score[h, T.min(j, NB - 1)] = red[0]
                        elif j < n:
                            score[h, T.min(j, NB - 1)] = T.float32("inf")
                        else:
                            score[h, T.min(j, NB - 1)] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, B, D, Hq=Hq), window_score_gpu, gpu=True, queries=True)


def build_colsum_observe_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                                    sm_scale: float, *, heads: str = "group_mean", num_state: int = 1,
                                    dtype: str = "float32"):
    """GPU ``kernels.attention_scores.build_colsum_observe_kernel`` (H2O's per-step state update):
    row statistics and column sums over all n_valid block rows, then per (KV head, candidate) the
    head reduction added to the old state."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    if Hq % H:
        raise ValueError(f"{Hq} query heads cannot be grouped over {H} KV heads")
    S = int(num_state)
    NB = N + B
    NT = 128
    CT = (NB + NT - 1) // NT
    stride, count, factor = _head_reduce_gpu(H, Hq, heads)
    row_stats, column_sums = _colsum_stages_gpu(H, Hq, N, B, D, float(sm_scale), B, NT)

    @T.macro
    def colsum_observe_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, state, cand_state):
        stats = T.alloc_buffer((Hq, B, 2), "float32")
        colsum = T.alloc_buffer((Hq, NB), "float32")
        row_stats(q, k_cache, k_blk, fill, n_valid, stats)
        column_sums(q, k_cache, k_blk, fill, n_valid, stats, colsum)
        for bx in T.thread_binding(H * CT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("accumulate"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    h: T.let[T.int32] = bx // CT
                    j: T.let[T.int32] = (bx % CT) * NT + tx
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    if j < NB:
                        acc[0] = T.float32(0)
                        for g in T.serial(count):
                            acc[0] = acc[0] + colsum[h * stride + g, T.min(j, NB - 1)]
                        for s in T.serial(S):
                            cand_state[s, h, T.min(j, NB - 1)] = T.if_then_else(
                                j < nf, state[s, h, T.min(j, N - 1)], T.float32(0)) + T.if_then_else(
                                s == 0 and j < nf + nv, acc[0] * T.float32(factor), T.float32(0))

    return observe_kernel(StepShapes(H, N, B, D, Hq=Hq, S=S), colsum_observe_gpu, gpu=True)


def build_state_score_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
                                 sm_scale: float, *, recent: int = 0, num_state: int = 1, dtype: str = "float32"):
    """GPU ``kernels.attention_scores.build_state_score_kernel``: elementwise, one thread per
    (KV head, candidate)."""
    check_dtype(dtype)
    H, N, B, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    S = int(num_state)
    NB = N + B
    R = int(recent)
    TPB = 128
    NBLK = (H * NB + TPB - 1) // TPB

    @T.macro
    def state_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, cand_state, score):
        for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                with T.sblock("score"):
                    T.reads()
                    T.writes()
                    e: T.let[T.int32] = bx * TPB + tx
                    h: T.let[T.int32] = T.min(e // NB, H - 1)
                    i: T.let[T.int32] = e % NB
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    if e < H * NB:
                        score[h, i] = T.if_then_else(
                            i < n, T.if_then_else(i >= n - R, T.float32("inf"), cand_state[0, h, i]), T.float32("-inf"))

    return state_score_kernel(StepShapes(H, N, B, D, Hq=Hq, S=S), state_score_gpu, gpu=True)
