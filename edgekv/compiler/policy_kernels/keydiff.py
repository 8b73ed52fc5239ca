"""KeyDiff's compiled face (``edgekv/policies/keydiff.py``): its score kernel, CPU and GPU."""

from __future__ import annotations

from ...policies.keydiff import recent_count
from .face import PolicyKernels


def build_keydiff_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                               dtype: str = "float32", recent: int = 0, eps: float = 1e-6):
    """TIR score kernel: the same definition as ``keydiff_scores``, in three parallel phases —
    (1) every candidate's clamped norm, parallel over (head, chunk of rows); (2) the anchor per
    head (mean of k_i / ‖k_i‖, normalised); (3) the scores, parallel over (head, chunk). With
    only H = 3 KV heads a per-head split leaves a core idle; the chunks keep two or more busy.
    Norms and dot products are 16-lane partial sums folded by a halving tree (vector ops, not
    a chain of 16 dependent scalar adds per row). The summation order differs from torch's, so
    scores differ in the last bits: on SmolLM2 (2K prompt, N = 1K, 240 eviction events, 737,280
    kept entries) one kept entry differed from ``topk_keep`` on the reference scores, a pair
    whose fp64 scores differ by 2.2e-7 relative — a near tie, allowed (< 1e-5 relative;
    docs/COMPILER.md)."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype, lane_tree_sum
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    EPS = float(eps)
    W = int(recent)
    LANES = 16 if D % 16 == 0 else (8 if D % 8 == 0 else 1)
    CH = D // LANES
    RC = 64  # candidate rows per parallel task
    NCH = (NB + RC - 1) // RC
    lane_sum = lane_tree_sum(LANES)

    @T.macro
    def candidate(k_cache, k_blk, h, i, nf, kv):
        # candidate i: cache row i (i < fill) or block row i − fill
        for c in T.vectorized(D):
            kv[c] = T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.max(i - nf, 0), c])

    @T.macro
    def dot(x, y, part):
        for l in T.vectorized(LANES):
            part[l] = T.float32(0)
        for c0 in T.serial(CH):
            for l in T.vectorized(LANES):
                part[l] = part[l] + x[c0 * LANES + l] * y[c0 * LANES + l]
        lane_sum(part)

    @T.macro
    def keydiff_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        norm = T.alloc_buffer((H, NB), "float32")
        anchor = T.alloc_buffer((H, D), "float32")
        if fill[0] + n_valid[0] > N:
            for task in T.parallel(H * NCH):
                with T.sblock("keydiff_norms"):
                    T.reads(k_cache[0:H, 0:N, 0:D], k_blk[0, 0:H, 0:B, 0:D], fill[0:1], n_valid[0:1])
                    T.writes(norm[0:H, 0:NB])
                    kv = T.sblock_alloc_buffer((D,), "float32")
                    part = T.sblock_alloc_buffer((LANES,), "float32")
                    h: T.let[T.int32] = task // NCH
                    for r in T.serial(RC):
                        if (task % NCH) * RC + r < fill[0] + n_valid[0]:
                            candidate(k_cache, k_blk, h, (task % NCH) * RC + r, fill[0], kv)
                            dot(kv, kv, part)
                            norm[h, (task % NCH) * RC + r] = T.max(T.sqrt(part[0]), T.float32(EPS))
            for h in T.parallel(H):
                with T.sblock("keydiff_anchor"):
                    T.reads(k_cache[h, 0:N, 0:D], k_blk[0, h, 0:B, 0:D], norm[h, 0:NB], fill[0:1], n_valid[0:1])
                    T.writes(anchor[h, 0:D])
                    kv = T.sblock_alloc_buffer((D,), "float32")
                    part = T.sblock_alloc_buffer((LANES,), "float32")
                    for c in T.vectorized(D):
                        anchor[h, c] = T.float32(0)
                    for i in T.serial(NB):
                        if i < fill[0] + n_valid[0]:
                            candidate(k_cache, k_blk, h, i, fill[0], kv)
                            for c in T.vectorized(D):
                                anchor[h, c] = anchor[h, c] + kv[c] / norm[h, i]
                    for c in T.vectorized(D):
                        kv[c] = anchor[h, c] / T.Cast("float32", fill[0] + n_valid[0])
                    dot(kv, kv, part)
                    for c in T.vectorized(D):
                        anchor[h, c] = kv[c] / T.max(T.sqrt(part[0]), T.float32(EPS))
            for task in T.parallel(H * NCH):
                with T.sblock("keydiff_scores"):
                    T.reads(k_cache[0:H, 0:N, 0:D], k_blk[0, 0:H, 0:B, 0:D], norm[0:H, 0:NB], anchor[0:H, 0:D],
                            pos_cache[0:H, 0:N], pos_blk[0:B], fill[0:1], n_valid[0:1])
                    T.writes(score[0:H, 0:NB])
                    kv = T.sblock_alloc_buffer((D,), "float32")
                    av = T.sblock_alloc_buffer((D,), "float32")
                    part = T.sblock_alloc_buffer((LANES,), "float32")
                    h: T.let[T.int32] = task // NCH
                    nf: T.let[T.int32] = fill[0]
                    newest: T.let[T.int32] = pos_blk[T.max(n_valid[0] - 1, 0)]
                    for c in T.vectorized(D):
                        av[c] = anchor[h, c]
                    for r in T.serial(RC):
                        i: T.let[T.int32] = (task % NCH) * RC + r
                        if i < NB:
                            score[h, i] = T.float32("-inf")
                            if i < nf + n_valid[0]:
                                candidate(k_cache, k_blk, h, i, nf, kv)
                                for c in T.vectorized(D):
                                    kv[c] = kv[c] / norm[h, i]
                                dot(kv, av, part)
                                score[h, i] = T.float32(0) - part[0]
                                if W > 0:
                                    if T.if_then_else(i < nf, pos_cache[h, T.min(i, N - 1)],
                                                      pos_blk[T.max(i - nf, 0)]) > newest - W:
                                        score[h, i] = T.float32("inf")

    return score_kernel(StepShapes(H, N, B, D), keydiff_score)


KEYDIFF_GPU_THREADS = 256  # threads per work-group: one candidate each in a tile


def build_keydiff_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                   dtype: str = "float32", recent: int = 0, eps: float = 1e-6):
    """H × ⌈(N + B) / NT⌉ work-groups of NT threads: work-group (h, s) scores head h's candidates
    [s·NT, (s + 1)·NT), so a decode step's N + B candidates are spread over several work-groups
    per head (one per head before: 3 on SmolLM2, each walking every candidate twice).

    The anchor (mean of the normalised keys) needs every candidate, so each work-group of a head
    computes it itself, in the same order (identical anchors, no second launch and no exchange
    between work-groups). With head_dim a multiple of 16 each tile of NT candidates is one pass:
    thread (row kk, lane l) holds channels l, l + 16, ... of 16 rows in registers (K read
    coalesced, every load in flight at once), the rows' squared norms meet in shared memory, and
    the same registers, normalised, go into the thread's column sums, which meet in shared memory
    after the last tile. (The first GPU version walked each row in one thread and read the tile
    twice; on an H200 each such step is a global round trip, and the kernel was those round trips.)
    Then the work-group's own candidates: −k̂ · μ̂ (the recent window +inf)."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    EPS = float(eps)
    W = int(recent)
    NT = KEYDIFF_GPU_THREADS if D <= KEYDIFF_GPU_THREADS else D
    GR = max(1, NT // D)  # row groups in the column pass
    SPL = (NB + NT - 1) // NT  # work-groups per head: one tile of candidates each
    # row dot products with LQ lanes per row, K read coalesced (a warp reads two whole rows per load,
    # against 32 rows' one channel when a thread walks its own row)
    LQ = 16
    # (and D ≤ 128: a thread holds D floats of its rows in registers)
    COAL = D % LQ == 0 and NT % LQ == 0 and D <= 128
    KR = NT // LQ if COAL else 1  # rows per pass
    NP = NT // KR if COAL else 1  # passes per tile
    CPL = D // LQ if COAL else 1  # channels per lane

    def cand(k_cache, k_blk, h, i, nf, c):
        return T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.min(T.max(i - nf, 0), B - 1), c])

    @T.macro
    def load_rows(k_cache, k_blk, kv, h, r0, n, nf, tx):
        # thread (row kk, lane l): channels l, l + LQ, ... of rows r0 + m·KR + kk (rows past n read as
        # 0), every load in flight at once
        for m in T.unroll(NP):
            for cc in T.unroll(CPL):
                kv[m, cc] = T.if_then_else(r0 + m * KR + tx // LQ < n,
                                           cand(k_cache, k_blk, h, r0 + m * KR + tx // LQ, nf, cc * LQ + tx % LQ),
                                           T.float32(0))

    @T.macro
    def keydiff_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        for bx in T.thread_binding(H * SPL, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("keydiff"):
                    T.reads()
                    T.writes()
                    inv_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")  # row norms
                    part_sh = T.sblock_alloc_buffer((1 if COAL else GR, D), "float32", scope="shared")
                    anchor_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((3,), "float32", scope="local")  # sum, anchor part, own norm
                    kp_sh = T.sblock_alloc_buffer(((LQ + 1) * NT if COAL else 1,), "float32", scope="shared")
                    kv = T.sblock_alloc_buffer((NP, CPL), "float32", scope="local")
                    colacc = T.sblock_alloc_buffer((CPL,), "float32", scope="local")
                    h: T.let[T.int32] = bx // SPL
                    sp: T.let[T.int32] = bx % SPL
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = nf + nv
                    grp: T.let[T.int32] = tx // D
                    ch: T.let[T.int32] = tx % D
                    i: T.let[T.int32] = sp * NT + tx  # this thread's candidate
                    if n > N:
                        red[1] = T.float32(0)  # this thread's partial anchor for channel ch
                        red[2] = T.float32(1)
                        if COAL:
                            # one pass over each tile: thread (row kk, lane l) loads channels l, l + LQ, ...
                            # of rows m·KR + kk (all in flight together), their squares meet in kp_sh
                            # for the row norms, and the same registers, normalised, go into the
                            # thread's column sums (one global round trip a tile, not two)
                            for cc in T.unroll(CPL):
                                colacc[cc] = T.float32(0)
                            for it in T.serial((n + NT - 1) // NT):
                                load_rows(k_cache, k_blk, kv, h, it * NT, n, nf, tx)
                                for m in T.unroll(NP):
                                    red[0] = T.float32(0)
                                    for cc in T.unroll(CPL):
                                        red[0] = red[0] + kv[m, cc] * kv[m, cc]
                                    kp_sh[(m * KR + tx // LQ) * (LQ + 1) + tx % LQ] = red[0]
                                T.tvm_storage_sync("shared")
                                red[0] = T.float32(0)
                                for l in T.unroll(LQ):
                                    red[0] = red[0] + kp_sh[tx * (LQ + 1) + l]
                                inv_sh[tx] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                if it == sp:
                                    red[2] = inv_sh[tx]
                                T.tvm_storage_sync("shared")
                                for m in T.unroll(NP):
                                    for cc in T.unroll(CPL):
                                        colacc[cc] = colacc[cc] + kv[m, cc] / inv_sh[m * KR + tx // LQ]
                            # the column sums meet in kp_sh (free after the last tile's second barrier;
                            # KR·D ≤ (LQ + 1)·NT)
                            for cc in T.unroll(CPL):
                                kp_sh[(tx // LQ) * D + cc * LQ + tx % LQ] = colacc[cc]
                            T.tvm_storage_sync("shared")
                            if tx < D:
                                red[1] = T.float32(0)
                                for k2 in T.serial(KR):
                                    red[1] = red[1] + kp_sh[k2 * D + tx]
                                anchor_sh[tx] = red[1] / T.Cast("float32", n)
                            T.tvm_storage_sync("shared")
                        else:
                            for it in T.serial((n + NT - 1) // NT):
                                # norm of candidate it*NT + tx
                                red[0] = T.float32(0)
                                if it * NT + tx < n:
                                    for c in T.serial(D):
                                        red[0] = red[0] + cand(k_cache, k_blk, h, it * NT + tx, nf, c) * cand(
                                            k_cache, k_blk, h, it * NT + tx, nf, c)
                                inv_sh[tx] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                if it == sp:
                                    red[2] = inv_sh[tx]
                                T.tvm_storage_sync("shared")
                                if grp < GR:
                                    for r in T.serial((NT + GR - 1) // GR):
                                        if r * GR + grp < NT:
                                            if it * NT + r * GR + grp < n:
                                                red[1] = red[1] + cand(k_cache, k_blk, h, it * NT + r * GR + grp, nf,
                                                                       ch) / inv_sh[r * GR + grp]
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
                        red[1] = T.float32(0)
                        if COAL:  # −k̂ · μ̂ of this work-group's rows, loaded as in the tile pass
                            load_rows(k_cache, k_blk, kv, h, sp * NT, n, nf, tx)
                            for m in T.unroll(NP):
                                red[0] = T.float32(0)
                                for cc in T.unroll(CPL):
                                    red[0] = red[0] + kv[m, cc] * anchor_sh[cc * LQ + tx % LQ]
                                kp_sh[(m * KR + tx // LQ) * (LQ + 1) + tx % LQ] = red[0]
                            T.tvm_storage_sync("shared")
                            for l in T.unroll(LQ):
                                red[1] = red[1] - kp_sh[tx * (LQ + 1) + l]
                            red[1] = red[1] / red[2]
                        if i < n:
                            if not COAL:
                                for c in T.serial(D):
                                    red[1] = red[1] - (cand(k_cache, k_blk, h, i, nf, c) / red[2]) * anchor_sh[c]
                            if W > 0:
                                if T.if_then_else(i < nf, pos_cache[h, T.min(i, N - 1)],
                                                  pos_blk[T.min(T.max(i - nf, 0), B - 1)]) > pos_blk[
                                                      T.max(nv - 1, 0)] - W:
                                    red[1] = T.float32("inf")
                            score[h, i] = red[1]
                        elif i < NB:
                            score[h, i] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, B, D), keydiff_score_gpu, gpu=True)


def keydiff_kernel_params(policy, budget: int) -> dict:
    return {"recent": recent_count(float(policy.recent_window), budget), "eps": float(policy.EPS)}


KERNELS = PolicyKernels(
    evict_kernel=build_keydiff_evict_kernel,
    gpu_evict_kernel=build_keydiff_evict_kernel_gpu,
    kernel_params=keydiff_kernel_params,
)
