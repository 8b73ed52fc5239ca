"""GPU versions of edgekv's TIR kernels: thread-bound, shared-memory tiled, static shapes.

Each builder returns a PrimFunc with *exactly* the signature of its CPU counterpart in
``kernels/`` (see ``kernels/common.py`` for the buffers), so ``gpu_schedule.ReplaceKernels``
can swap one for the other in the lowered module without touching the graph. All functions
are marked ``tirx.is_scheduled`` (dlight leaves them alone) and every buffer access happens
inside a ``blockIdx``/``threadIdx`` launch, so nothing runs on the host.

Thread counts stay ≤ 128 per block and shared memory ≤ ~20 KiB for head_dim ≤ 128, which
fits CUDA, Metal (32 KiB threadgroup memory) and Adreno/Mali OpenCL work-groups.

Numerics: the kernels follow the CPU kernels' definitions (ties, NaN, padding) but sum in a
different order (online softmax in attention, tree reductions), so logits agree to rounding
and kept sets can differ only on exact near-ties of the score.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .kernels.common import check_dtype

NEG_BIG = -3.0e38  # "minus infinity" that stays finite through exp(x - m)


def _lanes(d: int) -> int:
    for w in (32, 16, 8, 4, 2, 1):
        if d % w == 0 and w <= d:
            return w
    return 1


# --------------------------------------------------------------------------------------------
# block attention over cache ⊕ block
# --------------------------------------------------------------------------------------------

def build_gpu_attention_kernel(num_q_heads: int, num_kv_heads: int, budget: int, block: int,
                               head_dim: int, sm_scale: float, dtype: str = "float32",
                               rows_per_block: int = 4, extra_rows: int = 0):
    """One thread block = ``RQ`` query rows that share a KV head (threadIdx.y) × ``TX`` lanes
    (threadIdx.x). Keys are streamed in tiles of ``TK`` rows: the K and V tiles are loaded
    into shared memory once (coalesced) and reused by all RQ rows; each row keeps an online
    softmax (running max, sum, and its slice of the output in registers). Cache tiles run
    only up to ``fill``, block tiles only up to ``n_valid`` (causal mask inside the block);
    rows ≥ n_valid are written as zeros. With ``extra_rows`` = w pseudo rows (DapQ) the last w
    of the ``block`` rows see the real rows < n_valid and the pseudo rows up to their own
    (``kernels.attention.block_key_visible``); block tiles then run over all rows."""
    from .kernels.attention import block_key_visible

    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    W = int(extra_rows)
    BR = B - W  # real rows
    G = Hq // H
    ROWS = G * B  # query rows per KV head
    RQ = max(1, min(rows_per_block, ROWS))
    RT = (ROWS + RQ - 1) // RQ  # row tiles per KV head
    TX = _lanes(D)
    TK = max(8, min(32, 2048 // D))
    CPT = (D + TX - 1) // TX  # channels per lane
    NT = RQ * TX
    LOADS = (TK * D + NT - 1) // NT
    SPT = (TK + TX - 1) // TX  # scores per lane per tile
    scale = float(sm_scale)

    @T.prim_func(private=True, s_tir=True)
    def block_attention_gpu(
        q: T.Buffer((1, Hq, B, D), "float32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        fill: T.Buffer((1,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        out: T.Buffer((1, Hq, B, D), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(H * RT, thread="blockIdx.x"):
            for ty in T.thread_binding(RQ, thread="threadIdx.y"):
                for tx in T.thread_binding(TX, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        q_sh = T.sblock_alloc_buffer((RQ, D), "float32", scope="shared")
                        k_sh = T.sblock_alloc_buffer((TK, D + 1), "float32", scope="shared")  # +1: no bank conflicts
                        v_sh = T.sblock_alloc_buffer((TK, D), "float32", scope="shared")
                        s_sh = T.sblock_alloc_buffer((RQ, TK), "float32", scope="shared")
                        acc = T.sblock_alloc_buffer((CPT,), "float32", scope="local")
                        st = T.sblock_alloc_buffer((4,), "float32", scope="local")  # m, l, tile max, rescale
                        dot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        kh: T.let[T.int32] = bx // RT
                        rr: T.let[T.int32] = (bx % RT) * RQ + ty  # query row within the KV head
                        g: T.let[T.int32] = T.min(rr, ROWS - 1) // B
                        i: T.let[T.int32] = T.min(rr, ROWS - 1) % B
                        h: T.let[T.int32] = kh * G + g
                        tid: T.let[T.int32] = ty * TX + tx
                        nf: T.let[T.int32] = fill[0]
                        nv: T.let[T.int32] = n_valid[0]
                        ct: T.let[T.int32] = (nf + TK - 1) // TK
                        bt: T.let[T.int32] = T.if_then_else(W > 0, (B + TK - 1) // TK, (nv + TK - 1) // TK)
                        for u in T.serial(CPT):
                            if u * TX + tx < D:
                                q_sh[ty, u * TX + tx] = q[0, h, i, u * TX + tx]
                                acc[u] = T.float32(0)
                        st[0] = T.float32(NEG_BIG)
                        st[1] = T.float32(0)
                        for it in T.serial(ct + bt):
                            T.tvm_storage_sync("shared")
                            # stage the K/V tile (cache rows, then block rows) in shared memory
                            for u in T.serial(LOADS):
                                if u * NT + tid < TK * D:
                                    jj: T.let[T.int32] = (u * NT + tid) // D
                                    cc: T.let[T.int32] = (u * NT + tid) % D
                                    if it < ct:
                                        k_sh[jj, cc] = T.if_then_else(it * TK + jj < nf,
                                                                      k_cache[kh, T.min(it * TK + jj, N - 1), cc],
                                                                      T.float32(0))
                                        v_sh[jj, cc] = T.if_then_else(it * TK + jj < nf,
                                                                      v_cache[kh, T.min(it * TK + jj, N - 1), cc],
                                                                      T.float32(0))
                                    else:
                                        k_sh[jj, cc] = T.if_then_else(T.Or((it - ct) * TK + jj < nv,
                                                                           T.And(W > 0, (it - ct) * TK + jj >= BR)),
                                                                      k_blk[0, kh, T.min((it - ct) * TK + jj, B - 1), cc],
                                                                      T.float32(0))
                                        v_sh[jj, cc] = T.if_then_else(T.Or((it - ct) * TK + jj < nv,
                                                                           T.And(W > 0, (it - ct) * TK + jj >= BR)),
                                                                      v_blk[0, kh, T.min((it - ct) * TK + jj, B - 1), cc],
                                                                      T.float32(0))
                            T.tvm_storage_sync("shared")
                            # scores of this row against the tile
                            for u in T.serial(SPT):
                                if u * TX + tx < TK:
                                    dot[0] = T.float32(0)
                                    for c in T.serial(D):
                                        dot[0] = dot[0] + q_sh[ty, c] * k_sh[u * TX + tx, c]
                                    s_sh[ty, u * TX + tx] = T.if_then_else(
                                        T.if_then_else(it < ct, it * TK + u * TX + tx < nf,
                                                       block_key_visible((it - ct) * TK + u * TX + tx, i, nv, BR, W)),
                                        dot[0] * T.float32(scale), T.float32(NEG_BIG))
                            T.tvm_storage_sync("shared")
                            # online softmax update (every lane of the row does the same scalar work)
                            st[2] = st[0]
                            for j in T.serial(TK):
                                st[2] = T.max(st[2], s_sh[ty, j])
                            st[3] = T.exp(st[0] - st[2])
                            st[1] = st[1] * st[3]
                            for u in T.serial(CPT):
                                acc[u] = acc[u] * st[3]
                            for j in T.serial(TK):
                                dot[0] = T.if_then_else(s_sh[ty, j] > T.float32(NEG_BIG), T.exp(s_sh[ty, j] - st[2]),
                                                        T.float32(0))
                                st[1] = st[1] + dot[0]
                                for u in T.serial(CPT):
                                    if u * TX + tx < D:
                                        acc[u] = acc[u] + dot[0] * v_sh[j, u * TX + tx]
                            st[0] = st[2]
                        if rr < ROWS:
                            for u in T.serial(CPT):
                                if u * TX + tx < D:
                                    out[0, h, i, u * TX + tx] = T.if_then_else(
                                        T.Or(i < nv, i >= BR), acc[u] / T.max(st[1], T.float32(1e-30)), T.float32(0))

    return block_attention_gpu


# --------------------------------------------------------------------------------------------
# score kernels (signature: kernels/common.py)
# --------------------------------------------------------------------------------------------

def build_gpu_streaming_score(num_kv_heads: int, budget: int, block: int, head_dim: int,
                              dtype: str = "float32", sinks: int = 4):
    """Elementwise: one thread per (head, candidate)."""
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S = int(sinks)
    TPB = 128
    NBLK = (H * NB + TPB - 1) // TPB

    @T.prim_func(private=True, s_tir=True)
    def streaming_score_gpu(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                with T.sblock("score"):
                    T.reads()
                    T.writes()
                    e: T.let[T.int32] = bx * TPB + tx
                    h: T.let[T.int32] = e // NB
                    i: T.let[T.int32] = e % NB
                    nf: T.let[T.int32] = fill[0]
                    if e < H * NB:
                        if i < nf:
                            score[h, i] = T.if_then_else(pos_cache[h, T.min(i, N - 1)] < S, T.float32("inf"),
                                                         T.Cast("float32", pos_cache[h, T.min(i, N - 1)]))
                        elif i < nf + n_valid[0]:
                            score[h, i] = T.if_then_else(pos_blk[T.max(i - nf, 0)] < S, T.float32("inf"),
                                                         T.Cast("float32", pos_blk[T.max(i - nf, 0)]))
                        else:
                            score[h, i] = T.float32("-inf")

    return streaming_score_gpu


def build_gpu_keydiff_score(num_kv_heads: int, budget: int, block: int, head_dim: int,
                            dtype: str = "float32", recent: int = 0, eps: float = 1e-6):
    """One thread block per KV head, NT threads. Pass 1: per tile of NT candidates each thread
    computes one row's norm (into shared memory), then thread (group, channel) pairs
    accumulate the normalised keys column-wise (coalesced); the per-group partial anchors are
    summed in shared memory and normalised. Pass 2: one thread per candidate, −k̂ · μ̂."""
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    EPS = float(eps)
    W = int(recent)
    NT = 128 if D <= 128 else D
    GR = max(1, NT // D)  # row groups in the column pass
    TILES = (NB + NT - 1) // NT

    @T.prim_func(private=True, s_tir=True)
    def keydiff_score_gpu(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("keydiff"):
                    T.reads()
                    T.writes()
                    inv_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    part_sh = T.sblock_alloc_buffer((GR, D), "float32", scope="shared")
                    anchor_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = nf + nv
                    grp: T.let[T.int32] = tx // D
                    ch: T.let[T.int32] = tx % D
                    if n > N:
                        red[1] = T.float32(0)  # this thread's partial anchor for channel ch
                        for it in T.serial((n + NT - 1) // NT):
                            # norm of candidate it*NT + tx
                            red[0] = T.float32(0)
                            if it * NT + tx < n:
                                for c in T.serial(D):
                                    red[0] = red[0] + T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c]) * T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c])
                            inv_sh[tx] = T.max(T.sqrt(red[0]), T.float32(EPS))
                            T.tvm_storage_sync("shared")
                            if grp < GR:
                                for r in T.serial((NT + GR - 1) // GR):
                                    if r * GR + grp < NT:
                                        if it * NT + r * GR + grp < n:
                                            red[1] = red[1] + T.if_then_else(
                                                it * NT + r * GR + grp < nf,
                                                k_cache[h, T.min(it * NT + r * GR + grp, N - 1), ch],
                                                k_blk[0, h, T.min(T.max(it * NT + r * GR + grp - nf, 0), B - 1), ch]
                                            ) / inv_sh[r * GR + grp]
                            T.tvm_storage_sync("shared")
                        if grp < GR:
                            part_sh[grp, ch] = red[1]
                        T.tvm_storage_sync("shared")
                        if tx < D:
                            red[1] = T.float32(0)
                            for gg in T.serial(GR):
                                red[1] = red[1] + part_sh[gg, tx]
                            anchor_sh[tx] = red[1] / T.Cast("float32", n)
                        T.tvm_storage_sync("shared")
                        red[0] = T.float32(0)
                        for c in T.serial(D):
                            red[0] = red[0] + anchor_sh[c] * anchor_sh[c]
                        red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                        T.tvm_storage_sync("shared")
                        if tx < D:
                            anchor_sh[tx] = anchor_sh[tx] / red[0]
                        T.tvm_storage_sync("shared")
                        for it in T.serial(TILES):
                            if it * NT + tx < n:
                                red[0] = T.float32(0)
                                for c in T.serial(D):
                                    red[0] = red[0] + T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c]) * T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c])
                                red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                red[1] = T.float32(0)
                                for c in T.serial(D):
                                    red[1] = red[1] - (T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c]) / red[0]) * anchor_sh[c]
                                if W > 0:
                                    if T.if_then_else(it * NT + tx < nf, pos_cache[h, T.min(it * NT + tx, N - 1)],
                                                      pos_blk[T.min(T.max(it * NT + tx - nf, 0), B - 1)]) > pos_blk[
                                                          T.max(nv - 1, 0)] - W:
                                        red[1] = T.float32("inf")
                                score[h, it * NT + tx] = red[1]
                            elif it * NT + tx < NB:
                                score[h, it * NT + tx] = T.float32("-inf")

    return keydiff_score_gpu


def build_gpu_lagkv_score(num_kv_heads: int, budget: int, block: int, head_dim: int,
                          dtype: str = "float32", sinks: int = 16, lag: int = 128,
                          value_weight: float = 1.0, unbiased_std: bool = True, eps: float = 1e-6):
    """Two launches. (1) elementwise over (head, candidate): sinks +inf, tail 2 + i/n, beyond n
    −inf, scored partitions 0. (2) one thread block per (head, partition p): threads over
    channels find partition p+1's per-channel min/max (shared), threads over tokens take the
    std of each min-max-normalised token, softmax over the L tokens (shared), K then V
    accumulated into raw (shared), and each token's rank inside the partition is its score."""
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S, L = int(sinks), int(lag)
    WV = float(value_weight)
    EPS = float(eps)
    DDOF = float(D - 1) if (unbiased_std and D > 1) else float(D)
    TPB = 128
    NBLK = (H * NB + TPB - 1) // TPB
    PMAX = max(1, (NB - min(S, NB)) // L - 1)  # most scored partitions any step can have
    NT = 128
    TPT = (L + NT - 1) // NT  # tokens per thread
    CPT = (D + NT - 1) // NT  # channels per thread

    @T.prim_func(private=True, s_tir=True)
    def lagkv_score_gpu(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                with T.sblock("lagkv_base"):
                    T.reads()
                    T.writes()
                    e: T.let[T.int32] = bx * TPB + tx
                    h: T.let[T.int32] = e // NB
                    i: T.let[T.int32] = e % NB
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    start: T.let[T.int32] = T.min(S, n)
                    P: T.let[T.int32] = (n - start) // L
                    scored_end: T.let[T.int32] = T.if_then_else(P >= 2, start + (P - 1) * L, start)
                    if e < H * NB:
                        if n > N:
                            if i < start:
                                score[h, i] = T.float32("inf")
                            elif i < scored_end:
                                score[h, i] = T.float32(0)
                            elif i < n:
                                score[h, i] = T.float32(2) + T.Cast("float32", i) / T.Cast("float32", n)
                            else:
                                score[h, i] = T.float32("-inf")
        for bx in T.thread_binding(H * PMAX, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("lagkv_part"):
                    T.reads()
                    T.writes()
                    lo_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    hi_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    part_sh = T.sblock_alloc_buffer((L,), "float32", scope="shared")
                    raw_sh = T.sblock_alloc_buffer((L,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    better = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    h: T.let[T.int32] = bx // PMAX
                    p: T.let[T.int32] = bx % PMAX
                    nf: T.let[T.int32] = fill[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    start: T.let[T.int32] = T.min(S, n)
                    P: T.let[T.int32] = (n - start) // L
                    if n > N:
                        if p < P - 1:
                            for u in T.serial(TPT):
                                if u * NT + tx < L:
                                    raw_sh[u * NT + tx] = T.float32(0)
                            for z in T.serial(2):
                                # per-channel range of the reference partition p + 1
                                for u in T.serial(CPT):
                                    if u * NT + tx < D:
                                        acc[0] = T.float32("inf")
                                        acc[1] = T.float32("-inf")
                                        for t in T.serial(L):
                                            acc[2] = T.if_then_else(
                                                z == 0,
                                                T.if_then_else(start + (p + 1) * L + t < nf,
                                                               k_cache[h, T.min(start + (p + 1) * L + t, N - 1), u * NT + tx],
                                                               k_blk[0, h, T.min(T.max(start + (p + 1) * L + t - nf, 0), B - 1), u * NT + tx]),
                                                T.if_then_else(start + (p + 1) * L + t < nf,
                                                               v_cache[h, T.min(start + (p + 1) * L + t, N - 1), u * NT + tx],
                                                               v_blk[0, h, T.min(T.max(start + (p + 1) * L + t - nf, 0), B - 1), u * NT + tx]))
                                            acc[0] = T.min(acc[0], acc[2])
                                            acc[1] = T.max(acc[1], acc[2])
                                        lo_sh[u * NT + tx] = acc[0]
                                        hi_sh[u * NT + tx] = acc[1]
                                T.tvm_storage_sync("shared")
                                # std over channels of each normalised token of partition p
                                for u in T.serial(TPT):
                                    if u * NT + tx < L:
                                        acc[0] = T.float32(0)
                                        for c in T.serial(D):
                                            acc[0] = acc[0] + (T.if_then_else(
                                                z == 0,
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               k_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               k_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]),
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               v_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               v_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]))
                                                - lo_sh[c]) / T.max(hi_sh[c] - lo_sh[c], T.float32(EPS))
                                        acc[0] = acc[0] / T.float32(D)
                                        acc[1] = T.float32(0)
                                        for c in T.serial(D):
                                            acc[2] = (T.if_then_else(
                                                z == 0,
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               k_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               k_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]),
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               v_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               v_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]))
                                                - lo_sh[c]) / T.max(hi_sh[c] - lo_sh[c], T.float32(EPS))
                                            acc[1] = acc[1] + (acc[2] - acc[0]) * (acc[2] - acc[0])
                                        part_sh[u * NT + tx] = T.sqrt(acc[1] / T.float32(DDOF))
                                T.tvm_storage_sync("shared")
                                # softmax over the L tokens (each thread reduces the same values)
                                acc[3] = T.float32("-inf")
                                for t in T.serial(L):
                                    acc[3] = T.max(acc[3], part_sh[t])
                                acc[0] = T.float32(0)
                                for t in T.serial(L):
                                    acc[0] = acc[0] + T.exp(part_sh[t] - acc[3])
                                for u in T.serial(TPT):
                                    if u * NT + tx < L:
                                        raw_sh[u * NT + tx] = raw_sh[u * NT + tx] + T.if_then_else(
                                            z == 0, T.float32(1), T.float32(WV)) * (
                                                T.exp(part_sh[u * NT + tx] - acc[3]) / acc[0])
                                T.tvm_storage_sync("shared")
                            # rank inside the partition: (L - 1 - #better) / L
                            for u in T.serial(TPT):
                                if u * NT + tx < L:
                                    better[0] = 0
                                    acc[0] = raw_sh[u * NT + tx]
                                    for w in T.serial(L):
                                        acc[1] = raw_sh[w]
                                        if acc[1] > acc[0]:
                                            better[0] = better[0] + 1
                                        elif acc[1] == acc[0]:
                                            if w < u * NT + tx:
                                                better[0] = better[0] + 1
                                    score[h, start + p * L + u * NT + tx] = T.Cast("float32", L - 1 - better[0]) / T.float32(L)

    return lagkv_score_gpu


# --------------------------------------------------------------------------------------------
# attention-probability kernels of the query-based policies (SnapKV, SnapKV++, TOVA, H2O);
# arguments and definitions as kernels/attention_scores.py
# --------------------------------------------------------------------------------------------

_HEADS = ("group_mean", "group_sum", "layer_mean")
_POOLS = ("none", "avg", "max")


def _gpu_colsum_stages(H, Hq, N, B, D, scale, W, NT):
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


def _gpu_head_reduce(H, Hq, heads):
    G = Hq // H
    if heads not in _HEADS:
        raise ValueError(f"heads must be one of {_HEADS}, not {heads!r}")
    return {"group_mean": (G, G, 1.0 / G), "group_sum": (G, G, 1.0), "layer_mean": (0, Hq, 1.0 / Hq)}[heads]


def build_gpu_window_score(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
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
    if pooling not in _POOLS:
        raise ValueError(f"pooling must be one of {_POOLS}, not {pooling!r}")
    NB = N + B
    NT = 128
    CT = (NB + NT - 1) // NT
    W = max(1, min(int(window), B))
    PINI = 1 if pin_window else 0
    POOL = _POOLS.index(pooling)
    KS, KL, THR = int(kernel_short), int(kernel_long), int(long_threshold)
    stride, count, factor = _gpu_head_reduce(H, Hq, heads)
    row_stats, column_sums = _gpu_colsum_stages(H, Hq, N, B, D, float(sm_scale), W, NT)

    @T.prim_func(private=True, s_tir=True)
    def window_score_gpu(
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
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
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

    return window_score_gpu


def build_gpu_colsum_observe(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
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
    stride, count, factor = _gpu_head_reduce(H, Hq, heads)
    row_stats, column_sums = _gpu_colsum_stages(H, Hq, N, B, D, float(sm_scale), B, NT)

    @T.prim_func(private=True, s_tir=True)
    def colsum_observe_gpu(
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
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
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

    return colsum_observe_gpu


def build_gpu_state_score(num_kv_heads: int, budget: int, block: int, head_dim: int, num_q_heads: int,
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

    @T.prim_func(private=True, s_tir=True)
    def state_score_gpu(
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
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
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

    return state_score_gpu


# the policies' GPU entry points: the keyword arguments of their CPU builders (``kernel_params``
# + ``num_q_heads`` / ``sm_scale``), mapped as the policy files map them
def build_gpu_snapkv_score(H, N, B, D, dtype="float32", *, window, kernel, pooling, num_q_heads, sm_scale):
    return build_gpu_window_score(H, N, B, D, num_q_heads, sm_scale, window=window, heads="group_mean",
                                  pin_window=True, pooling=pooling, kernel_short=kernel, kernel_long=kernel,
                                  dtype=dtype)


def build_gpu_snapkvpp_score(H, N, B, D, dtype="float32", *, window, kernel_short, kernel_long, long_threshold,
                             pooling, num_q_heads, sm_scale):
    return build_gpu_window_score(H, N, B, D, num_q_heads, sm_scale, window=window, heads="group_sum",
                                  pin_window=True, pooling=pooling, kernel_short=kernel_short,
                                  kernel_long=kernel_long, long_threshold=long_threshold, dtype=dtype)


def build_gpu_tova_score(H, N, B, D, dtype="float32", *, heads="group", num_q_heads, sm_scale):
    return build_gpu_window_score(H, N, B, D, num_q_heads, sm_scale, window=1,
                                  heads={"group": "group_mean", "layer": "layer_mean"}[heads], pin_window=False,
                                  dtype=dtype)


def build_gpu_h2o_score(H, N, B, D, dtype="float32", *, recent, num_q_heads, sm_scale):
    return build_gpu_state_score(H, N, B, D, num_q_heads, sm_scale, recent=recent, dtype=dtype)


def build_gpu_h2o_observe(H, N, B, D, dtype="float32", *, recent=0, num_q_heads, sm_scale):
    return build_gpu_colsum_observe(H, N, B, D, num_q_heads, sm_scale, heads="group_mean", dtype=dtype)


# --------------------------------------------------------------------------------------------
# top-N select + in-place compaction (and append-only for ``full``)
# --------------------------------------------------------------------------------------------

def build_gpu_select_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                            dtype: str = "float32", with_score: bool = True, num_state: int = 0):
    """GPU top-N select + in-place compaction, the signature of ``kernels/select.py`` (score or
    append-only × with or without per-entry state ``state [S, H, N]`` / ``cand_state [S, H, N + B]``).

    One thread block per KV head, NT threads.

    Append (n = fill + n_valid ≤ N, and always without a score): the block rows are copied behind
    the cache (rows past N dropped: ``full`` refuses such runs on the host), and the candidate state
    of every row [0, n) is written to ``state``.

    Selection: ``n − N`` rounds; each round every thread scans its strided candidates for the
    lowest score not yet evicted (``<=`` while scanning upwards, so among equal scores the
    highest index), a shared-memory tree reduction with the same rule picks the round's
    victim, and its bit is set in a shared bitset. NaN never compares ≤, so it is never evicted.

    Compaction: candidates are walked in chunks of ``CH`` rows. Each chunk's K/V rows are
    staged in shared memory (coalesced), every thread derives the destination of each kept
    row from the bitset (a running count, identical in all threads), then the rows are
    written out (state rows straight from ``cand_state``, a separate buffer). A destination is
    never above its source, chunks go upwards and a chunk is fully read before it is written,
    so the compaction is in place and race-free."""
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    S = int(num_state)
    NB = N + B
    NT = 128
    WORDS = (NB + 31) // 32
    CH = 32
    LD = (CH * D + NT - 1) // NT
    SCAN = (NB + NT - 1) // NT

    @T.macro
    def append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, tx, nf, nv):
        for u in T.serial((B * D + NT - 1) // NT):
            if u * NT + tx < nv * D:
                if nf + (u * NT + tx) // D < N:
                    k_cache[h, T.min(nf + (u * NT + tx) // D, N - 1), (u * NT + tx) % D] = \
                        k_blk[0, h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D]
                    v_cache[h, T.min(nf + (u * NT + tx) // D, N - 1), (u * NT + tx) % D] = \
                        v_blk[0, h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D]
        for u in T.serial((B + NT - 1) // NT):
            if u * NT + tx < nv:
                if nf + u * NT + tx < N:
                    pos_cache[h, T.min(nf + u * NT + tx, N - 1)] = pos_blk[T.min(u * NT + tx, B - 1)]
        if S > 0:
            for u in T.serial((N + NT - 1) // NT):
                if u * NT + tx < T.min(nf + nv, N):
                    for s in T.serial(S):
                        state[s, h, T.min(u * NT + tx, N - 1)] = cand_state[s, h, T.min(u * NT + tx, NB - 1)]

    @T.macro
    def evict(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, score, state, cand_state, h, tx, nf, nv,
              gone, rv, ri, k_sh, v_sh, p_sh, dst, bv, bi, cnt, ov, oi, word):
        n = nf + nv
        for u in T.serial((WORDS + NT - 1) // NT):
            if u * NT + tx < WORDS:
                gone[u * NT + tx] = T.uint32(0)
        T.tvm_storage_sync("shared")
        for _e in T.serial(n - N):
            bv[0] = T.float32("inf")
            bi[0] = -1
            for u in T.serial(SCAN):
                if u * NT + tx < n:
                    word[0] = gone[(u * NT + tx) // 32]
                    if T.bitwise_and(T.shift_right(word[0], T.Cast("uint32", (u * NT + tx) % 32)),
                                     T.uint32(1)) == T.uint32(0):
                        if score[h, u * NT + tx] <= bv[0]:
                            bv[0] = score[h, u * NT + tx]
                            bi[0] = u * NT + tx
            rv[tx] = bv[0]
            ri[tx] = bi[0]
            T.tvm_storage_sync("shared")
            for lvl in T.unroll(7):  # NT = 128 = 2^7
                if tx < T.shift_right(64, lvl):
                    ov[0] = rv[tx + T.shift_right(64, lvl)]
                    oi[0] = ri[tx + T.shift_right(64, lvl)]
                T.tvm_storage_sync("shared")
                if tx < T.shift_right(64, lvl):
                    if oi[0] >= 0:
                        if (bi[0] < 0) or (ov[0] < bv[0]) or (ov[0] == bv[0] and oi[0] > bi[0]):
                            bv[0] = ov[0]
                            bi[0] = oi[0]
                            rv[tx] = ov[0]
                            ri[tx] = oi[0]
                T.tvm_storage_sync("shared")
            if tx == 0:
                bi[0] = ri[0]
                if bi[0] >= 0:
                    gone[bi[0] // 32] = T.bitwise_or(
                        gone[bi[0] // 32], T.shift_left(T.uint32(1), T.Cast("uint32", bi[0] % 32)))
            T.tvm_storage_sync("shared")
        cnt[0] = 0
        for it in T.serial((n + CH - 1) // CH):
            # stage the chunk's rows (cache rows or block rows)
            for u in T.serial(LD):
                if u * NT + tx < CH * D:
                    if it * CH + (u * NT + tx) // D < n:
                        k_sh[(u * NT + tx) // D, (u * NT + tx) % D] = T.if_then_else(
                            it * CH + (u * NT + tx) // D < nf,
                            k_cache[h, T.min(it * CH + (u * NT + tx) // D, N - 1), (u * NT + tx) % D],
                            k_blk[0, h, T.min(T.max(it * CH + (u * NT + tx) // D - nf, 0), B - 1),
                                  (u * NT + tx) % D])
                        v_sh[(u * NT + tx) // D, (u * NT + tx) % D] = T.if_then_else(
                            it * CH + (u * NT + tx) // D < nf,
                            v_cache[h, T.min(it * CH + (u * NT + tx) // D, N - 1), (u * NT + tx) % D],
                            v_blk[0, h, T.min(T.max(it * CH + (u * NT + tx) // D - nf, 0), B - 1),
                                  (u * NT + tx) % D])
            if tx < CH:
                if it * CH + tx < n:
                    p_sh[tx] = T.if_then_else(it * CH + tx < nf,
                                              pos_cache[h, T.min(it * CH + tx, N - 1)],
                                              pos_blk[T.min(T.max(it * CH + tx - nf, 0), B - 1)])
            # destinations (-1 = dropped), the same running count in every thread
            for r in T.serial(CH):
                if it * CH + r < n:
                    word[0] = gone[(it * CH + r) // 32]
                    if T.bitwise_and(T.shift_right(word[0], T.Cast("uint32", (it * CH + r) % 32)),
                                     T.uint32(1)) == T.uint32(0):
                        if cnt[0] < N:
                            if tx == 0:
                                dst[r] = cnt[0]
                            cnt[0] = cnt[0] + 1
                        elif tx == 0:
                            dst[r] = -1
                    elif tx == 0:
                        dst[r] = -1
                elif tx == 0:
                    dst[r] = -1
            T.tvm_storage_sync("shared")
            for u in T.serial(LD):
                if u * NT + tx < CH * D:
                    oi[0] = dst[(u * NT + tx) // D]
                    if oi[0] >= 0:
                        k_cache[h, T.min(oi[0], N - 1), (u * NT + tx) % D] = \
                            k_sh[(u * NT + tx) // D, (u * NT + tx) % D]
                        v_cache[h, T.min(oi[0], N - 1), (u * NT + tx) % D] = \
                            v_sh[(u * NT + tx) // D, (u * NT + tx) % D]
            if tx < CH:
                oi[0] = dst[tx]
                if oi[0] >= 0:
                    pos_cache[h, T.min(oi[0], N - 1)] = p_sh[tx]
                    if S > 0:
                        for s in T.serial(S):
                            state[s, h, T.min(oi[0], N - 1)] = cand_state[s, h, T.min(it * CH + tx, NB - 1)]
            T.tvm_storage_sync("shared")

    @T.macro
    def launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("select"):
                    T.reads()
                    T.writes()
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    if with_score:
                        gone = T.sblock_alloc_buffer((WORDS,), "uint32", scope="shared")
                        rv = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                        ri = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                        k_sh = T.sblock_alloc_buffer((CH, D), "float32", scope="shared")
                        v_sh = T.sblock_alloc_buffer((CH, D), "float32", scope="shared")
                        p_sh = T.sblock_alloc_buffer((CH,), "int32", scope="shared")
                        dst = T.sblock_alloc_buffer((CH,), "int32", scope="shared")
                        bv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        bi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        cnt = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        ov = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        oi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        word = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                        if nf + nv <= N:
                            append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, tx, nf, nv)
                        else:
                            evict(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, score, state, cand_state,
                                  h, tx, nf, nv, gone, rv, ri, k_sh, v_sh, p_sh, dst, bv, bi, cnt, ov, oi, word)
                    else:
                        append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, tx, nf, nv)
        for _b in T.thread_binding(1, thread="blockIdx.x"):
            for _t in T.thread_binding(1, thread="threadIdx.x"):
                with T.sblock("fill"):
                    T.reads()
                    T.writes()
                    fill[0] = T.min(fill[0] + n_valid[0], N)

    # the four signatures (score or append-only) × (with or without state) share the bodies above
    if with_score and S:
        @T.prim_func(private=True, s_tir=True)
        def select_compact_state_gpu(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            score: T.Buffer((H, NB), "float32"),
            state: T.Buffer((S, H, N), "float32"), cand_state: T.Buffer((S, H, NB), "float32"),
        ):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state)

        return select_compact_state_gpu
    if with_score:
        @T.prim_func(private=True, s_tir=True)
        def select_compact_gpu(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            score: T.Buffer((H, NB), "float32"),
        ):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, None, None)

        return select_compact_gpu
    if S:
        @T.prim_func(private=True, s_tir=True)
        def append_only_state_gpu(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            state: T.Buffer((S, H, N), "float32"), cand_state: T.Buffer((S, H, NB), "float32"),
        ):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, None, state, cand_state)

        return append_only_state_gpu

    @T.prim_func(private=True, s_tir=True)
    def append_only_gpu(
        k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, None, None, None)

    return append_only_gpu


def _dapq_gpu_score(*args, **kwargs):
    from ..policies.dapq import build_dapq_gpu_evict_kernel  # beside its reference scorer

    return build_dapq_gpu_evict_kernel(*args, **kwargs)


# GPU score kernels by policy name: same arguments as the policy's ``evict_kernel`` (including,
# for policies with ``kernel_inputs``, ``num_q_heads`` / ``sm_scale``).
GPU_SCORE_KERNELS = {
    "dapq": _dapq_gpu_score,
    "streaming": build_gpu_streaming_score,
    "keydiff": build_gpu_keydiff_score,
    "lagkv": build_gpu_lagkv_score,
    "snapkv": build_gpu_snapkv_score,
    "snapkv++": build_gpu_snapkvpp_score,
    "tova": build_gpu_tova_score,
    "h2o": build_gpu_h2o_score,
}
# GPU observe (per-step state update) kernels by policy name: same arguments as ``observe_kernel``.
GPU_OBSERVE_KERNELS = {
    "h2o": build_gpu_h2o_observe,
}
