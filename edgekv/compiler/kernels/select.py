"""Top-N selection and in-place compaction of one layer's cache, as one TIR kernel.

Candidates are cache rows [0, fill) ⊕ block rows [0, n_valid) (see ``common``). When
n = fill + n_valid ≤ N the block rows are appended. Otherwise the E = n − N candidates with
the lowest score are evicted — among equal scores the *higher* candidate index goes first, so
the kept set is the top-N by (score descending, index ascending): the ``topk_keep`` rule of
``edgekv.policies.base``. Selection without a sort: scores are mapped to order-preserving
int32 keys, the E-th smallest key is found by bisection over the int32 range (≤ 33 counting
passes over the n candidates, vectorisable), then every key below it and the highest-index
ties at it are evicted. The survivors are written back in ascending candidate order, so the
cache stays in temporal order. Because kept[j] ≥ j, writing row j from candidate kept[j] in
ascending j never overwrites a row that is still to be read: the compaction runs in place.

Selection cost is O(33 · n) per head (the first version picked the minimum E times,
O(E · n)). NaN scores are never evicted (torch's
descending sort puts NaN first, i.e. keeps it).

Per-entry state (policies with ``entry_state``, see ``compiler/policy_kernels/face.py``): the kernel also
takes the layer's state cache ``state [S, H, N]`` (in place) and this step's candidate state
``cand_state [S, H, N + B]`` (from the policy's observe kernel), and writes the candidate state
of every surviving row next to its K/V/pos — appended rows and, when nothing is evicted, the
updated state of the old rows too.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype
from .signature import StepShapes, select_kernel


def evicted_mask_macro(NB: int, lanes: int = 16):
    """``mark_evicted(score, h, n, keep, key, gone, lo, hi, cnt)``: sets ``gone[i]`` = 1 for the
    n − keep candidates of head ``h`` (of the n ≤ NB valid ones) with the lowest score — ties evict
    the higher index, the ``topk_keep`` rule — and 0 for the others. ``key`` [NB] int32, ``lo``/``hi``
    [1] int64 and ``cnt`` [1] int32 are scratch. Shared by the select kernel and kernels that must
    know the evicted set before the compaction (D2O's merge). ``lanes``: the width of the
    vectorised counting passes (16 int32 = one AVX-512 register; 1 inside one GPU thread)."""

    LANES = int(lanes) if NB >= int(lanes) else 1

    @T.macro
    def mark_evicted(score, h, n, keep, key, gone, lo, hi, cnt):
        # order-preserving int32 key of each score (NaN → INT32_MAX: never evicted;
        # −0.0 → +0.0 so they tie as floats do); padding rows get INT32_MAX too
        for i in T.serial(NB):
            key[i] = T.if_then_else(
                i < n,
                T.if_then_else(score[h, i] != score[h, i], T.int32(2147483647),
                               T.if_then_else(T.reinterpret("int32", score[h, i] + T.float32(0)) < 0,
                                              T.bitwise_xor(T.reinterpret("int32", score[h, i] + T.float32(0)),
                                                            T.int32(2147483647)),
                                              T.reinterpret("int32", score[h, i] + T.float32(0)))),
                T.int32(2147483647))
        # thr = the E-th smallest key (E = n − keep evictions): bisection over the int32
        # range, each step one vectorisable counting pass over the candidates
        lo[0] = T.int64(-2147483648)
        hi[0] = T.int64(2147483647)
        for it in T.serial(33):
            if lo[0] < hi[0]:
                # the count as LANES partial sums (one vector compare-and-add per LANES keys),
                # then summed: a scalar running count is one dependent add per candidate;
                # gone[0:LANES] holds the partial counts (it is written for real only below)
                for l in T.vectorized(LANES):
                    gone[l] = 0
                for i0 in T.serial(NB // LANES):
                    for l in T.vectorized(LANES):
                        gone[l] = gone[l] + T.Cast(
                            "int32", T.Cast("int64", key[i0 * LANES + l]) <= (lo[0] + hi[0]) // 2)
                cnt[0] = 0
                for l in T.serial(LANES):
                    cnt[0] = cnt[0] + gone[l]
                for i in T.serial(NB % LANES):
                    cnt[0] = cnt[0] + T.Cast("int32", T.Cast("int64", key[NB - NB % LANES + i]) <= (lo[0] + hi[0]) // 2)
                if cnt[0] >= n - keep:
                    hi[0] = (lo[0] + hi[0]) // 2
                else:
                    lo[0] = (lo[0] + hi[0]) // 2 + 1
        # evict every key < thr, then the highest-index ties at thr (topk_keep's rule)
        cnt[0] = 0
        for i in T.serial(NB):
            gone[i] = T.Cast("int32", T.Cast("int64", key[i]) < lo[0])
            cnt[0] = cnt[0] + gone[i]
        for i0 in T.serial(NB):
            if cnt[0] < n - keep:
                if T.Cast("int64", key[NB - 1 - i0]) == lo[0]:
                    gone[NB - 1 - i0] = 1
                    cnt[0] = cnt[0] + 1

    return mark_evicted


def build_select_compact_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                dtype: str = "float32", with_score: bool = True, num_state: int = 0):
    """In-place kernel ``(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid[, score]
    [, state, cand_state])``; in place on k_cache, v_cache, pos_cache, fill (and state).

    Without a score (policy ``full``) the block is appended while it fits and the newest
    overflowing rows are dropped (the host refuses a ``full`` run that would overflow)."""
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S = int(num_state)
    if S < 0:
        raise ValueError("num_state must be >= 0")
    mark_evicted = evicted_mask_macro(NB)

    @T.macro
    def append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, nf, nv):
        for i in T.serial(B):
            if i < nv:
                if nf + i < N:
                    for c in T.vectorized(D):
                        k_cache[h, nf + i, c] = k_blk[0, h, i, c]
                        v_cache[h, nf + i, c] = v_blk[0, h, i, c]
                    pos_cache[h, nf + i] = pos_blk[i]
        if S > 0:
            for s, i in T.grid(S, N):
                if i < nf + nv:
                    state[s, h, i] = cand_state[s, h, i]

    @T.macro
    def compact(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, gone, cnt, h, part, nf, nv):
        # survivors in ascending candidate order; part 0 moves the keys, part 1 the values,
        # positions and state (two tasks per head: the moves are most of the kernel's time)
        cnt[0] = 0
        for i in T.serial(NB):
            if i < nf + nv:
                if gone[h, i] == 0:
                    if cnt[0] < N:
                        if i < nf:
                            if cnt[0] != i:
                                if part == 0:
                                    for c in T.vectorized(D):
                                        k_cache[h, cnt[0], c] = k_cache[h, i, c]
                                else:
                                    for c in T.vectorized(D):
                                        v_cache[h, cnt[0], c] = v_cache[h, i, c]
                                    pos_cache[h, cnt[0]] = pos_cache[h, i]
                        else:
                            if part == 0:
                                for c in T.vectorized(D):
                                    k_cache[h, cnt[0], c] = k_blk[0, h, i - nf, c]
                            else:
                                for c in T.vectorized(D):
                                    v_cache[h, cnt[0], c] = v_blk[0, h, i - nf, c]
                                pos_cache[h, cnt[0]] = pos_blk[i - nf]
                        if S > 0:
                            if part == 1:
                                for s in T.serial(S):
                                    state[s, h, cnt[0]] = cand_state[s, h, i]
                        cnt[0] = cnt[0] + 1

    @T.macro
    def select_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        gone_all = T.alloc_buffer((H, NB), "int32")
        if fill[0] + n_valid[0] <= N:
            for h in T.parallel(H):
                with T.sblock("append"):
                    append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, fill[0],
                           n_valid[0])
        else:
            for h in T.parallel(H):
                with T.sblock("select"):
                    T.reads(score[h, 0:NB], fill[0:1], n_valid[0:1])
                    T.writes(gone_all[h, 0:NB])
                    gone = T.sblock_alloc_buffer((NB,), "int32")
                    key = T.sblock_alloc_buffer((NB,), "int32")
                    lo = T.sblock_alloc_buffer((1,), "int64")
                    hi = T.sblock_alloc_buffer((1,), "int64")
                    cnt = T.sblock_alloc_buffer((1,), "int32")
                    mark_evicted(score, h, fill[0] + n_valid[0], N, key, gone, lo, hi, cnt)
                    for i in T.serial(NB):
                        gone_all[h, i] = gone[i]
            for task in T.parallel(2 * H):
                with T.sblock("compact"):
                    cnt = T.sblock_alloc_buffer((1,), "int32")
                    compact(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, gone_all, cnt,
                            task // 2, task % 2, fill[0], n_valid[0])
        with T.sblock("fill"):
            fill[0] = T.min(fill[0] + n_valid[0], N)

    @T.macro
    def append_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        for h in T.parallel(H):
            with T.sblock("append"):
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, nf, nv)
        with T.sblock("fill"):
            fill[0] = T.min(fill[0] + n_valid[0], N)

    # the four signatures (a score or append-only) × (with or without state) share the bodies above
    return select_kernel(StepShapes(H, N, B, D, S=S), select_all if with_score else append_all, with_score=with_score)


# ---- GPU version (same signatures; swapped in by gpu_schedule.ReplaceKernels) ----------------------

def build_select_compact_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int,
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

    return select_kernel(StepShapes(H, N, B, D, S=S), launch, with_score=with_score, gpu=True)
