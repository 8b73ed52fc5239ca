"""DapQ's compiled face (``edgekv/policies/dapq.py``): its score kernel, CPU and GPU. The compiled
prefill step carries the pseudo rows as its last w rows (``compiler/passes/pseudo_rows.py``)."""

from __future__ import annotations

import math
from typing import Any

from .face import PolicyKernels


def pseudo_rows_in_step(rows: int, window: int) -> int:
    """How many of a compiled step's ``rows`` are pseudo rows: the compiled prefill step runs
    B + window rows (the last window are the pseudo tokens), decode runs 1 ≤ window real row."""
    return window if rows > window else 0


def _kernel_constants(num_kv_heads, budget, block, head_dim, window, softmax_pseudo, kernel, pooling, keep_recent,
                      num_q_heads, sm_scale, question_rows=0):
    """The compile-time constants both DapQ kernels share: (Hq, G, N + T, pseudo rows P, real rows,
    observer rows R, pseudo keys in the softmax, pooling half-width, avg?, κ, recent window, scale)."""
    if num_q_heads is None or num_q_heads % num_kv_heads:
        raise ValueError(f"dapq kernel: num_q_heads ({num_q_heads}) must be a multiple of the {num_kv_heads} KV heads")
    if pooling not in ("avg", "max"):
        raise ValueError(f"dapq kernel: pooling must be avg or max (got {pooling!r})")
    # with question rows (`--question-rows`) the step's extra rows are max(window, Q): the pseudo
    # tokens or the question, then padding at position −1 that observes nothing
    P = int(question_rows) if question_rows else pseudo_rows_in_step(block, int(window))
    return (int(num_q_heads), int(num_q_heads) // num_kv_heads, budget + block, P, block - P,
            P if P else min(int(window), block), bool(softmax_pseudo) and P > 0, int(kernel) // 2, pooling == "avg",
            float(kernel), int(keep_recent), float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim))


def build_dapq_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                            window: int = 32, softmax_pseudo: bool = True, kernel: int = 1, pooling: str = "avg",
                            keep_recent: int = 0, num_q_heads: int | None = None, sm_scale: float | None = None,
                            question_rows: int = 0):
    """TIR score kernel: the same definition as ``DapQPolicy.score``, computing only the observer
    rows of the attention matrix.

    ``question_rows``: the step's extra rows when the artifact takes a question (``--question-rows``):
    the question or the pseudo tokens first, then padding rows at position −1, which observe nothing
    (and, coming last, are seen by no other row).

    ``block`` is the step's row count T. A prefill step carries the pseudo rows as its last
    ``window`` rows (T = B + window, ``pseudo_rows_in_step``): they observe the candidates cache ⊕
    real rows [0, n_valid), with their own causal keys in the softmax when ``softmax_pseudo``. A
    decode step (T = 1) has no pseudo rows: its last min(window, n_valid) real rows observe (the
    reference's fallback), causally. Inputs: the eight common buffers (``kernels/common.py``, with
    B = T), then the step's post-RoPE queries ``q [1, Hq, T, d]``.

    One parallel task per KV head; per (query head of the group, observer row): that row's logits
    over the cache and block keys (an [N + T] buffer: never more than one row), max, exp, sum,
    and its probabilities added to the candidates' scores; then the group mean, the optional
    pooling (``kernel`` odd, ``pooling`` avg/max as ``pool_scores``) and the protected recent
    window. Dot products as partial sums over LANES lanes (vectorised); the summation order
    differs from torch's, so scores agree to rounding and kept sets can differ only on near ties.
    """
    from tvm import tirx
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, TR, D = num_kv_heads, budget, block, head_dim
    Hq, G, NB, P, BR, R, SP, K2, AVG, KAPPA, REC, scale = _kernel_constants(
        num_kv_heads, budget, block, head_dim, window, softmax_pseudo, kernel, pooling, keep_recent, num_q_heads, sm_scale,
        question_rows)
    LANES = 16 if D % 16 == 0 else (8 if D % 8 == 0 else 1)
    CH = D // LANES

    def candidate_seen(j, row, nv):
        """Block row j is a candidate the observer row sees."""
        return j < nv if P else tirx.all(j < nv, j <= row)

    def key_seen(j, row, nv):
        """Block row j is in the observer row's softmax (a seen candidate or an earlier pseudo row)."""
        if not SP:
            return candidate_seen(j, row, nv)
        return tirx.any(candidate_seen(j, row, nv), tirx.all(j >= BR, j <= row))

    @T.macro
    def dot(qv, kv, part, red):
        for l in T.vectorized(LANES):
            part[l] = T.float32(0)
        for c0 in T.serial(CH):
            for l in T.vectorized(LANES):
                part[l] = part[l] + qv[c0 * LANES + l] * kv[c0 * LANES + l]
        red[0] = T.float32(0)
        for l in T.serial(LANES):
            red[0] = red[0] + part[l]
        red[0] = red[0] * T.float32(scale)

    @T.macro
    def dapq_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score):
        for h in T.parallel(H):
            with T.sblock("dapq"):
                # explicit regions: automatic inference would reference the block's own let vars
                T.reads(k_cache[h, 0:N, 0:D], pos_cache[h, 0:N], fill[0:1], k_blk[0, h, 0:TR, 0:D], pos_blk[0:TR],
                        n_valid[0:1], q[0, h * G:h * G + G, 0:TR, 0:D])
                T.writes(score[h, 0:NB])
                qv = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                s = T.sblock_alloc_buffer((NB,), "float32")  # one observer row: cache key i at i, block key j at N + j
                raw = T.sblock_alloc_buffer((NB,), "float32")  # per candidate (cache rows, then block rows)
                part = T.sblock_alloc_buffer((LANES,), "float32")
                red = T.sblock_alloc_buffer((3,), "float32")  # dot, row max, row sum
                newest = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                nobs: T.let[T.int32] = T.if_then_else(P > 0, R, T.min(R, n_valid[0]))
                if n > N:
                    for i in T.serial(NB):
                        raw[i] = T.float32(0)
                    for g in T.serial(G):
                        for r in T.serial(nobs):
                            row: T.let[T.int32] = T.if_then_else(P > 0, BR + r, nv - nobs + r)
                            if pos_blk[row] >= 0:  # a padding row (position −1) observes nothing
                                for c in T.vectorized(D):
                                    qv[c] = q[0, h * G + g, row, c]
                                red[1] = T.float32("-inf")
                                for i in T.serial(nf):
                                    for c in T.vectorized(D):
                                        kv[c] = k_cache[h, i, c]
                                    dot(qv, kv, part, red)
                                    s[i] = red[0]
                                    red[1] = T.max(red[1], red[0])
                                for j in T.serial(TR):
                                    if key_seen(j, row, nv):
                                        for c in T.vectorized(D):
                                            kv[c] = k_blk[0, h, j, c]
                                        dot(qv, kv, part, red)
                                        s[N + j] = red[0]
                                        red[1] = T.max(red[1], red[0])
                                red[2] = T.float32(0)
                                for i in T.serial(nf):
                                    s[i] = T.exp(s[i] - red[1])
                                    red[2] = red[2] + s[i]
                                for j in T.serial(TR):
                                    if key_seen(j, row, nv):
                                        s[N + j] = T.exp(s[N + j] - red[1])
                                        red[2] = red[2] + s[N + j]
                                for i in T.serial(nf):
                                    raw[i] = raw[i] + s[i] / red[2]
                                for j in T.serial(TR):
                                    if candidate_seen(j, row, nv):
                                        raw[nf + j] = raw[nf + j] + s[N + j] / red[2]
                    # group mean, then pooling over the candidate order (kernel 1: the identity)
                    for i in T.serial(NB):
                        raw[i] = raw[i] / T.float32(G)
                    newest[0] = -2147483647
                    for i in T.serial(nf):
                        newest[0] = T.max(newest[0], pos_cache[h, i])
                    for j in T.serial(nv):
                        newest[0] = T.max(newest[0], pos_blk[j])
                    for i in T.serial(NB):
                        if i < n:
                            red[0] = T.if_then_else(AVG, T.float32(0), T.float32("-inf"))
                            for o in T.serial(2 * K2 + 1):
                                if i + o - K2 >= 0 and i + o - K2 < n:
                                    red[0] = T.if_then_else(AVG, red[0] + raw[i + o - K2], T.max(red[0], raw[i + o - K2]))
                            score[h, i] = T.if_then_else(
                                T.if_then_else(i < nf, pos_cache[h, T.min(i, N - 1)], pos_blk[T.max(i - nf, 0)])
                                > newest[0] - REC,
                                T.float32("inf"), T.if_then_else(AVG, red[0] / T.float32(KAPPA), red[0]))
                        else:
                            score[h, i] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, TR, D, Hq=Hq), dapq_score, queries=True)


def build_dapq_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                                window: int = 32, softmax_pseudo: bool = True, kernel: int = 1, pooling: str = "avg",
                                keep_recent: int = 0, num_q_heads: int | None = None, sm_scale: float | None = None):
    """GPU version of ``build_dapq_evict_kernel`` (same signature and definition), the flash-style
    two-pass form: one thread block per KV head, one thread per key column of a tile of NT
    columns (cache rows [0, N), then the step's rows). The G·R observer rows are taken RC at a
    time, their queries staged in shared memory. Pass 1: each thread keeps an online (max, sum)
    per row over the columns it owns; the NT partials are merged in shared memory into each
    row's softmax normaliser. Pass 2: each thread adds exp(s − max) / sum of every row to its
    own candidates. No logits are stored (scratch: RC·d + 2·RC·NT floats of shared memory, the
    thread's key and its candidates' sums in registers). Group mean, pooling and the protected
    recent window follow, the pooling neighbours exchanged through a shared-memory tile with a
    halo (never through global memory, which a work-group barrier does not order on OpenCL/Metal)."""
    from tvm import tirx
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, TR, D = num_kv_heads, budget, block, head_dim
    Hq, G, NB, P, BR, R, SP, K2, AVG, KAPPA, REC, scale = _kernel_constants(
        num_kv_heads, budget, block, head_dim, window, softmax_pseudo, kernel, pooling, keep_recent, num_q_heads, sm_scale)
    RWS = G * R  # observer rows of one KV head
    NT = 128
    RC = 8  # observer rows per chunk
    NCH = (RWS + RC - 1) // RC
    CT = (NB + NT - 1) // NT  # column tiles
    QL = (RC * D + NT - 1) // NT
    NEG = -3.0e38
    if K2 > NT:
        raise ValueError(f"dapq GPU kernel: a pooling kernel of at most {2 * NT + 1} (got {kernel})")

    def seen(col, row, nv, nf, candidate_only):
        """Column col (candidate order: cache rows [0, nf), step rows [nf, nf + nv), then the pseudo
        rows) is in the observer row's softmax (``candidate_only``: and is a candidate)."""
        blk = tirx.all(col >= nf, col < nf + nv) if P else tirx.all(col >= nf, col < nf + nv, col - nf <= row)
        out = tirx.any(col < nf, blk)
        if SP and not candidate_only:
            out = tirx.any(out, tirx.all(col >= nf + nv, BR + col - nf - nv <= row))
        return out

    def observer_row(rr, nv, nobs):
        """Step row of observer rr (of the G·R, group-major): a pseudo row, or (decode) a last real row."""
        return tirx.if_then_else(P > 0, BR + rr % R, nv - nobs + rr % R)

    @T.macro
    def load_key(kreg, k_cache, k_blk, h, col, nf, nv):
        for c in T.serial(D):
            kreg[c] = T.if_then_else(
                col < nf, k_cache[h, T.min(col, N - 1), c],
                k_blk[0, h, T.min(T.max(T.if_then_else(col < nf + nv, col - nf, BR + col - nf - nv), 0), TR - 1), c])

    @T.macro
    def row_logit(st, q_sh, kreg, k):
        st[0] = T.float32(0)
        for c in T.serial(D):
            st[0] = st[0] + q_sh[k, c] * kreg[c]
        st[0] = st[0] * T.float32(scale)

    @T.macro
    def dapq_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("dapq"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((RC, D), "float32", scope="shared")
                    m_part = T.sblock_alloc_buffer((RC, NT), "float32", scope="shared")
                    l_part = T.sblock_alloc_buffer((RC, NT), "float32", scope="shared")
                    m_row = T.sblock_alloc_buffer((RC,), "float32", scope="shared")
                    l_row = T.sblock_alloc_buffer((RC,), "float32", scope="shared")
                    newest_sh = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                    halo = T.sblock_alloc_buffer((NT + 2 * K2,), "float32", scope="shared")
                    kreg = T.sblock_alloc_buffer((D,), "float32", scope="local")
                    mt = T.sblock_alloc_buffer((RC,), "float32", scope="local")
                    lt = T.sblock_alloc_buffer((RC,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((CT,), "float32", scope="local")
                    pooled = T.sblock_alloc_buffer((CT,), "float32", scope="local")
                    st = T.sblock_alloc_buffer((3,), "float32", scope="local")  # dot, new max, merged sum
                    newest = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    nobs: T.let[T.int32] = T.if_then_else(P > 0, R, T.min(R, n_valid[0]))
                    if n > N:
                        for u in T.serial(CT):
                            acc[u] = T.float32(0)
                        for ch in T.serial(NCH):
                            T.tvm_storage_sync("shared")
                            # stage the chunk's queries (coalesced over d)
                            for e in T.serial(QL):
                                if e * NT + tx < RC * D:
                                    q_sh[(e * NT + tx) // D, (e * NT + tx) % D] = q[
                                        0, h * G + T.min(ch * RC + (e * NT + tx) // D, RWS - 1) // R,
                                        T.min(T.max(observer_row(T.min(ch * RC + (e * NT + tx) // D, RWS - 1), nv, nobs),
                                                    0), TR - 1),
                                        (e * NT + tx) % D]
                            T.tvm_storage_sync("shared")
                            # pass 1: per-thread online max / sum of each row over its columns
                            for k in T.serial(RC):
                                mt[k] = T.float32(NEG)
                                lt[k] = T.float32(0)
                            for u in T.serial(CT):
                                load_key(kreg, k_cache, k_blk, h, u * NT + tx, nf, nv)
                                for k in T.serial(RC):
                                    if ch * RC + k < RWS and (ch * RC + k) % R < nobs:
                                        if seen(u * NT + tx, observer_row(ch * RC + k, nv, nobs), nv, nf, False):
                                            row_logit(st, q_sh, kreg, k)
                                            st[1] = T.max(mt[k], st[0])
                                            lt[k] = lt[k] * T.exp(mt[k] - st[1]) + T.exp(st[0] - st[1])
                                            mt[k] = st[1]
                            for k in T.serial(RC):
                                m_part[k, tx] = mt[k]
                                l_part[k, tx] = lt[k]
                            T.tvm_storage_sync("shared")
                            if tx < RC:
                                st[1] = T.float32(NEG)
                                for t in T.serial(NT):
                                    st[1] = T.max(st[1], m_part[tx, t])
                                st[2] = T.float32(0)
                                for t in T.serial(NT):
                                    st[2] = st[2] + l_part[tx, t] * T.exp(m_part[tx, t] - st[1])
                                m_row[tx] = st[1]
                                l_row[tx] = T.max(st[2], T.float32(1e-30))
                            T.tvm_storage_sync("shared")
                            # pass 2: each row's probabilities of this thread's candidates
                            for u in T.serial(CT):
                                load_key(kreg, k_cache, k_blk, h, u * NT + tx, nf, nv)
                                for k in T.serial(RC):
                                    if ch * RC + k < RWS and (ch * RC + k) % R < nobs:
                                        if seen(u * NT + tx, observer_row(ch * RC + k, nv, nobs), nv, nf, True):
                                            row_logit(st, q_sh, kreg, k)
                                            acc[u] = acc[u] + T.exp(st[0] - m_row[k]) / l_row[k]
                        # newest candidate position (protected recent window)
                        newest[0] = -2147483647
                        for u in T.serial(CT):
                            if u * NT + tx < n:
                                newest[0] = T.max(newest[0], T.if_then_else(
                                    u * NT + tx < nf, pos_cache[h, T.min(u * NT + tx, N - 1)],
                                    pos_blk[T.min(T.max(u * NT + tx - nf, 0), TR - 1)]))
                        newest_sh[tx] = newest[0]
                        T.tvm_storage_sync("shared")
                        newest[0] = -2147483647
                        for t in T.serial(NT):
                            newest[0] = T.max(newest[0], newest_sh[t])
                        # group mean and pooling over the candidate order (kernel 1: the identity); a tile's
                        # neighbours come through shared memory with a halo of K2 on each side
                        for u in T.serial(CT):
                            T.tvm_storage_sync("shared")
                            halo[K2 + tx] = acc[u] / T.float32(G)
                            if tx >= NT - K2:
                                halo[tx - (NT - K2)] = T.if_then_else(u > 0, acc[T.max(u - 1, 0)] / T.float32(G),
                                                                      T.float32(0))
                            if tx < K2:
                                halo[NT + K2 + tx] = T.if_then_else(u + 1 < CT, acc[T.min(u + 1, CT - 1)] / T.float32(G),
                                                                    T.float32(0))
                            T.tvm_storage_sync("shared")
                            pooled[u] = T.if_then_else(AVG, T.float32(0), T.float32("-inf"))
                            for o in T.serial(2 * K2 + 1):
                                if u * NT + tx + o - K2 >= 0 and u * NT + tx + o - K2 < n:
                                    pooled[u] = T.if_then_else(AVG, pooled[u] + halo[tx + o],
                                                               T.max(pooled[u], halo[tx + o]))
                        for u in T.serial(CT):
                            if u * NT + tx < NB:
                                if u * NT + tx < n:
                                    score[h, u * NT + tx] = T.if_then_else(
                                        T.if_then_else(u * NT + tx < nf, pos_cache[h, T.min(u * NT + tx, N - 1)],
                                                       pos_blk[T.min(T.max(u * NT + tx - nf, 0), TR - 1)])
                                        > newest[0] - REC,
                                        T.float32("inf"), T.if_then_else(AVG, pooled[u] / T.float32(KAPPA), pooled[u]))
                                else:
                                    score[h, u * NT + tx] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, TR, D, Hq=Hq), dapq_score_gpu, gpu=True, queries=True)




def dapq_kernel_params(policy, budget: int) -> dict[str, Any]:
    return {"window": int(policy.window), "softmax_pseudo": policy.softmax_over == "prompt+pseudo",
            "kernel": int(policy.kernel), "pooling": str(policy.pooling), "keep_recent": int(policy.keep_recent)}


KERNELS = PolicyKernels(
    evict_kernel=build_dapq_evict_kernel,
    gpu_evict_kernel=build_dapq_evict_kernel_gpu,
    # the kernels also take the step's post-RoPE queries (the pseudo rows' among them)
    kernel_inputs=("queries",),
    question_kernels=True,
    kernel_params=dapq_kernel_params,
)
