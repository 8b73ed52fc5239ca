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

Per-entry state (policies with ``entry_state``, see ``edgekv.policies.base``): the kernel also
takes the layer's state cache ``state [S, H, N]`` (in place) and this step's candidate state
``cand_state [S, H, N + B]`` (from the policy's observe kernel), and writes the candidate state
of every surviving row next to its K/V/pos — appended rows and, when nothing is evicted, the
updated state of the old rows too.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype


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
    def append_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, state, cand_state):
        for h in T.parallel(H):
            with T.sblock("append"):
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, h, nf, nv)
        with T.sblock("fill"):
            fill[0] = T.min(fill[0] + n_valid[0], N)

    # the four signatures (score or append-only) × (with or without state) share the bodies above
    if with_score and S:
        @T.prim_func(private=True, s_tir=True)
        def select_compact_state(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            score: T.Buffer((H, NB), "float32"),
            state: T.Buffer((S, H, N), "float32"), cand_state: T.Buffer((S, H, NB), "float32"),
        ):
            T.func_attr({"tirx.noalias": True})
            select_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state)

        return select_compact_state
    if with_score:
        @T.prim_func(private=True, s_tir=True)
        def select_compact(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            score: T.Buffer((H, NB), "float32"),
        ):
            T.func_attr({"tirx.noalias": True})
            select_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, None, None)

        return select_compact
    if S:
        @T.prim_func(private=True, s_tir=True)
        def append_only_state(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            state: T.Buffer((S, H, N), "float32"), cand_state: T.Buffer((S, H, NB), "float32"),
        ):
            T.func_attr({"tirx.noalias": True})
            append_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, state, cand_state)

        return append_only_state

    @T.prim_func(private=True, s_tir=True)
    def append_only(
        k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
    ):
        T.func_attr({"tirx.noalias": True})
        append_all(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, None, None)

    return append_only
