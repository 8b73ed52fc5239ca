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

from tvm import tirx
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
        # −0.0 → 0, the key of +0.0, so they tie as floats do: an explicit test, since TVM folds
        # the `x + 0.0` that would do it and `x != x`); padding rows get INT32_MAX too
        for i in T.serial(NB):
            key[i] = T.if_then_else(
                i < n,
                T.if_then_else(T.isnan(score[h, i]), T.int32(2147483647),
                               T.if_then_else(score[h, i] == T.float32(0), T.int32(0),
                                              T.if_then_else(T.reinterpret("int32", score[h, i]) < 0,
                                                             T.bitwise_xor(T.reinterpret("int32", score[h, i]),
                                                                           T.int32(2147483647)),
                                                             T.reinterpret("int32", score[h, i])))),
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

GPU_SELECT_THREADS = 256  # a work-group; 16 slices of 16 threads (the two-level reductions below)
_RADIX_PASSES = 8  # 4-bit digits of the 32-bit key


def order_key(x):
    """The order-preserving uint32 key of float32 ``x`` (a TIR expression): ``a < b`` as floats iff
    ``key(a) < key(b)``; −0.0 and +0.0 get the same key (they tie, as floats compare), NaN the
    largest (it is never evicted while a number is, as on the CPU)."""
    bits = T.reinterpret("uint32", x)
    return T.if_then_else(
        T.isnan(x), T.uint32(0xFFFFFFFF),
        T.if_then_else(x == T.float32(0), T.uint32(0x80000000),
                       T.if_then_else(T.bitwise_and(bits, T.uint32(0x80000000)) != T.uint32(0),
                                      T.bitwise_not(bits), T.bitwise_or(bits, T.uint32(0x80000000)))))


def work_group_select_macro(NB: int, NT: int = GPU_SELECT_THREADS):
    """``find_cut(score, h, n, keep, tx, part, cnt, slc, res, dig, st, pre)``, run by all ``NT`` threads of a
    work-group in uniform control flow: of head ``h``'s first ``n`` candidates (n > keep) the kept
    set is the ``keep`` largest scores, ties keeping the lower index (``topk_keep``), i.e. candidate
    i is kept iff ``key(i) > res[0]`` or (``key(i) == res[0]`` and ``i < res[1]``), where
    ``res[0]`` is the (n − keep)-th smallest key and ``res[1]`` the index of the first tie at it
    that is evicted.

    Radix select: 8 passes over the 4-bit digits of the key, high digit first; each pass counts,
    per thread, the candidates whose higher digits equal the threshold's so far, by digit
    (16 registers); the 16 × NT counts go through shared memory (``part``, as float32: exact below
    2^24) into 16 bin totals (two levels of 16), and every thread picks the same digit. Then the
    tie cut: each thread counts the ties in its contiguous range of candidates, an exclusive prefix
    sum (two levels) tells the thread holding the (ties to keep)-th tie, which writes its index.
    About 30 barriers per head whatever n is, against the n − keep rounds of a minimum search.

    Scratch: ``part`` [≥ 17·NT + 16] float32 (the counts, their slice sums, the bins), ``cnt`` [NT] int32, ``slc`` [16]
    int32, ``res`` [2] uint32 — shared; ``dig`` [16] int32, ``st`` [4] int32, ``pre`` [1] uint32 —
    local (per thread)."""
    if NT % 16 or NT // 16 > 16:
        raise ValueError(f"work-group select: {NT} threads is not 16 × (1..16)")
    NSL = NT // 16  # slices of 16 threads
    C = (NB + NT - 1) // NT  # candidates per thread: strided in the histogram, contiguous in the cut

    @T.macro
    def find_cut(score, h, n, keep, tx, part, cnt, slc, res, dig, st, pre):
        # st: evictions left, running count, digit, bin total; pre: the threshold's digits so far
        st[0] = n - keep
        pre[0] = T.uint32(0)
        for p in T.serial(_RADIX_PASSES):
            for d in T.unroll(16):
                dig[d] = 0
            for j in T.serial(C):
                if j * NT + tx < n:
                    # candidates that still match the threshold's higher digits, by their digit p
                    if T.bitwise_and(order_key(score[h, T.min(j * NT + tx, NB - 1)]),
                                     T.bitwise_not(T.shift_right(T.uint32(0xFFFFFFFF), T.Cast("uint32", 4 * p)))) \
                            == pre[0]:
                        for d in T.unroll(16):
                            dig[d] = dig[d] + T.Cast("int32", T.bitwise_and(
                                T.shift_right(order_key(score[h, T.min(j * NT + tx, NB - 1)]),
                                              T.Cast("uint32", 28 - 4 * p)), T.uint32(15)) == T.uint32(d))
            for d in T.unroll(16):
                part[d * NT + tx] = T.Cast("float32", dig[d])
            T.tvm_storage_sync("shared")
            # thread (slice s, bin b) sums bin b over the 16 threads of slice s
            st[3] = 0
            if tx < 16 * NSL:
                for k in T.serial(16):
                    st[3] = st[3] + T.Cast("int32", part[(tx % 16) * NT + (tx // 16) * 16 + k])
            # (TVM's barrier planner cannot tell the slice sums' slots from the counts' slots)
            T.tvm_storage_sync("shared")
            if tx < 16 * NSL:
                part[16 * NT + tx] = T.Cast("float32", st[3])
            T.tvm_storage_sync("shared")
            # threads 0..15: bin tx's total over the slices
            st[3] = 0
            if tx < 16:
                for s in T.serial(NSL):
                    st[3] = st[3] + T.Cast("int32", part[16 * NT + s * 16 + tx])
            T.tvm_storage_sync("shared")
            if tx < 16:
                part[17 * NT + tx] = T.Cast("float32", st[3])
            T.tvm_storage_sync("shared")
            # every thread: the bins in digit order, the first that reaches the evictions left
            st[1] = 0
            st[2] = -1
            for d in T.serial(16):
                st[3] = T.Cast("int32", part[17 * NT + d])
                if st[2] < 0:
                    if st[1] + st[3] >= st[0]:
                        st[2] = d
                        st[0] = st[0] - st[1]
                    else:
                        st[1] = st[1] + st[3]
            pre[0] = T.bitwise_or(pre[0], T.shift_left(T.Cast("uint32", st[2]), T.Cast("uint32", 28 - 4 * p)))
            T.tvm_storage_sync("shared")  # part is rewritten by the next pass
        # st[0] ties at pre[0] are evicted, the highest indices: the first evicted tie is the
        # (ties − st[0])-th one (0-based) in index order
        st[1] = 0
        for j in T.serial(C):
            if tx * C + j < n:
                st[1] = st[1] + T.Cast("int32", order_key(score[h, T.min(tx * C + j, NB - 1)]) == pre[0])
        cnt[tx] = st[1]
        T.tvm_storage_sync("shared")
        # (every phase that reads shared memory ends at a barrier before the next one writes it:
        # TVM may give two scratch buffers one slot, and its barrier planner cannot add barriers
        # under the branch this runs in)
        st[3] = 0
        if tx < NSL:
            for k in T.serial(16):
                st[3] = st[3] + cnt[tx * 16 + k]
        T.tvm_storage_sync("shared")
        if tx < NSL:
            slc[tx] = st[3]
        T.tvm_storage_sync("shared")
        st[2] = 0  # ties before this thread's range
        for s in T.serial(NSL):
            if s < tx // 16:
                st[2] = st[2] + slc[s]
        for k in T.serial(16):
            if k < tx % 16:
                st[2] = st[2] + cnt[(tx // 16) * 16 + k]
        st[3] = 0  # all ties
        for s in T.serial(NSL):
            st[3] = st[3] + slc[s]
        T.tvm_storage_sync("shared")
        st[1] = -1
        for j in T.serial(C):
            if tx * C + j < n:
                if order_key(score[h, T.min(tx * C + j, NB - 1)]) == pre[0]:
                    if st[2] == st[3] - st[0]:
                        st[1] = tx * C + j
                    st[2] = st[2] + 1
        if tx == 0:
            res[0] = pre[0]
        if st[1] >= 0:  # one thread holds it
            res[1] = T.Cast("uint32", st[1])
        T.tvm_storage_sync("shared")

    return find_cut


def work_group_min_macro(NB: int, NT: int = GPU_SELECT_THREADS):
    """``find_min(score, h, n, tx, red, mine, thr, cut)``, the decode (block of 1) replacement of
    ``work_group_select_macro``, run by all ``NT`` threads of a work-group in uniform control flow:
    with n ≤ N + 1 candidates and N kept, exactly one candidate of head ``h`` is evicted — its
    smallest order key, among equal keys the highest index (ties keep the lower index, the
    ``topk_keep`` rule; −0.0 and +0.0 share a key, NaN has the largest). So ``thr[0]`` = that key
    and ``cut[0]`` = that index give the same kept(i) rule as the radix select (key > thr, or
    key == thr and i < cut), in one pass instead of ~30 barriers.

    A (key, index) pair is one uint64, ``key << 32 | ~index``: its minimum is the smallest key and,
    among equal keys, the highest index. Each thread takes the minimum over its strided candidates,
    then two levels through shared memory (16 threads per slice, then the slices). Scratch:
    ``red`` [NT + NT / 16] uint64 shared, ``mine`` [1] uint64, ``thr`` [1] uint32 and ``cut`` [1]
    int32 local (every thread gets the result)."""
    if NT % 16 or NT // 16 > 16:
        raise ValueError(f"work-group min select: {NT} threads is not 16 × (1..16)")
    NSL = NT // 16
    C = (NB + NT - 1) // NT
    NONE = tirx.max_value("uint64")

    @T.macro
    def find_min(score, h, n, tx, red, mine, thr, cut):
        mine[0] = NONE
        for j in T.serial(C):
            if j * NT + tx < n:
                mine[0] = T.min(mine[0], T.bitwise_or(
                    T.shift_left(T.Cast("uint64", order_key(score[h, T.min(j * NT + tx, NB - 1)])), T.uint64(32)),
                    T.Cast("uint64", T.bitwise_not(T.Cast("uint32", j * NT + tx)))))
        red[tx] = mine[0]
        T.tvm_storage_sync("shared")
        if tx < NSL:  # slice minima
            mine[0] = NONE
            for k in T.serial(16):
                mine[0] = T.min(mine[0], red[tx * 16 + k])
        # (TVM's barrier planner cannot tell the slice minima's slots from the threads' slots)
        T.tvm_storage_sync("shared")
        if tx < NSL:
            red[NT + tx] = mine[0]
        T.tvm_storage_sync("shared")
        mine[0] = NONE
        for s in T.serial(NSL):
            mine[0] = T.min(mine[0], red[NT + s])
        thr[0] = T.Cast("uint32", T.shift_right(mine[0], T.uint64(32)))
        cut[0] = T.Cast("int32", T.bitwise_not(T.Cast("uint32", T.bitwise_and(mine[0], tirx.const(0xFFFFFFFF, "uint64")))))
        T.tvm_storage_sync("shared")  # red is free again

    return find_min


def build_select_compact_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                    dtype: str = "float32", with_score: bool = True, num_state: int = 0):
    """GPU top-N select + in-place compaction, the signature of ``kernels/select.py`` (score or
    append-only × with or without per-entry state ``state [S, H, N]`` / ``cand_state [S, H, N + B]``).

    Two launches, in this order on the device's queue:

    1. **Evict** (with a score): one work-group of 256 threads per KV head, doing nothing unless
       n = fill + n_valid > N. Its head's selection — ``work_group_select_macro`` (a radix select
       of the (n − N)-th smallest order-preserving key and the index where evicted ties begin), or
       at decode (B = 1, one eviction) ``work_group_min_macro`` (the smallest (key, index) pair) —
       gives exactly the CPU kernel's kept set (top N by score, ties keeping the lower index; NaN
       never evicted). Then the in-place compaction: cache rows before the first evicted candidate stay;
       from there candidates go in chunks of ``CH`` rows staged in shared memory, a kept row's
       destination being the kept rows before it. A destination is never above its source and a
       chunk is fully read before it is written, so one work-group per head is race-free, and the
       heads run side by side (the first version did every head in one work-group, one after the
       other: 174 µs a decode step on an H200, nearly all of it this compaction).
    2. **Append and fill**: one work-group. When n ≤ N it copies the block rows of every head behind
       the cache (rows past N dropped: ``full`` refuses such runs on the host) and the candidate
       state of rows [0, n); then it writes ``fill`` = min(n, N). ``fill`` is read by every
       work-group of launch 1, and work-groups of one launch cannot wait for each other, so only a
       later launch may change it — this one, which has real work in append steps."""
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    S = int(num_state)
    NB = N + B
    NT = GPU_SELECT_THREADS
    CH = max(1, min(NT, 2048 // D))  # rows per chunk: ≤ 16 KiB of staged K and V (32 KiB of local memory on phones)
    STAGE = max(17 * NT + 16, 2 * CH * D)
    find_cut = work_group_select_macro(NB, NT)
    find_min = work_group_min_macro(NB, NT)  # decode (B == 1): n ≤ N + 1, one eviction
    RED = NT + NT // 16 if B == 1 else 1

    def kept(score, h, i, thr, cut):
        key = order_key(score[h, T.min(i, NB - 1)])
        return tirx.any(key > thr, tirx.all(key == thr, i < cut))

    @T.macro
    def append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, tx, nf, nv):
        for u in T.serial((H * B * D + NT - 1) // NT):
            if u * NT + tx < H * B * D:
                if (u * NT + tx) // D % B < nv and nf + (u * NT + tx) // D % B < N:
                    k_cache[(u * NT + tx) // (B * D), T.min(nf + (u * NT + tx) // D % B, N - 1), (u * NT + tx) % D] = \
                        k_blk[0, (u * NT + tx) // (B * D), (u * NT + tx) // D % B, (u * NT + tx) % D]
                    v_cache[(u * NT + tx) // (B * D), T.min(nf + (u * NT + tx) // D % B, N - 1), (u * NT + tx) % D] = \
                        v_blk[0, (u * NT + tx) // (B * D), (u * NT + tx) // D % B, (u * NT + tx) % D]
        for u in T.serial((H * B + NT - 1) // NT):
            if u * NT + tx < H * B:
                if (u * NT + tx) % B < nv and nf + (u * NT + tx) % B < N:
                    pos_cache[(u * NT + tx) // B, T.min(nf + (u * NT + tx) % B, N - 1)] = pos_blk[(u * NT + tx) % B]
        if S > 0:
            for u in T.serial((S * H * N + NT - 1) // NT):
                if u * NT + tx < S * H * N:
                    if (u * NT + tx) % N < nf + nv:
                        state[(u * NT + tx) // (H * N), (u * NT + tx) // N % H, (u * NT + tx) % N] = \
                            cand_state[(u * NT + tx) // (H * N), (u * NT + tx) // N % H, (u * NT + tx) % N]

    @T.macro
    def evict(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, score, state, cand_state, h, tx, nf, nv,
              part, cnt, slc, res, dig, st, pre, red, mine, dst, p_sh, kflag, thr, cut, first, base, row):
        n = nf + nv
        if B == 1:
            # decode: one eviction, and it is the cut itself (the first evicted row)
            find_min(score, h, n, tx, red, mine, thr, cut)
            first[0] = T.min(cut[0], nf)
        else:
            find_cut(score, h, n, N, tx, part, cnt, slc, res, dig, st, pre)
            thr[0] = res[0]
            cut[0] = T.Cast("int32", res[1])
            T.tvm_storage_sync("shared")
            # the first evicted candidate: the first tie cut, or an earlier key below the threshold
            row[0] = cut[0]
            for j in T.serial((NB + NT - 1) // NT):
                if j * NT + tx < n:
                    if order_key(score[h, T.min(j * NT + tx, NB - 1)]) < thr[0]:
                        row[0] = T.min(row[0], j * NT + tx)
            cnt[tx] = row[0]
            T.tvm_storage_sync("shared")
            if tx < NT // 16:  # the minimum in two levels: 16 slices of 16 threads
                for k in T.serial(16):
                    row[0] = T.min(row[0], cnt[tx * 16 + k])
            T.tvm_storage_sync("shared")
            if tx < NT // 16:
                cnt[tx] = row[0]
            T.tvm_storage_sync("shared")
            first[0] = T.min(cnt[0], nf)  # (kept block rows before the first eviction move too)
            for t in T.serial(NT // 16):
                first[0] = T.min(first[0], cnt[t])
            T.tvm_storage_sync("shared")
        if S > 0:  # the unmoved kept rows' state (moved rows get theirs with the compaction)
            for u in T.serial((S * N + NT - 1) // NT):
                if u * NT + tx < S * N:
                    if (u * NT + tx) % N < first[0]:
                        state[(u * NT + tx) // N, h, (u * NT + tx) % N] = cand_state[(u * NT + tx) // N, h, (u * NT + tx) % N]
        base[0] = first[0]  # where the next kept row goes (first: the first row that is evicted or is a block row)
        # (a loop over the chunks that move, not a condition in every chunk: the barriers inside
        # must not sit under a branch; first[0] is the same in every thread)
        for c in T.serial((n - first[0] + CH - 1) // CH):
            # destinations: at decode every row after the cut moves down by one (a block row before it
            # stays in place); in a block step thread r of the chunk flags whether row r is kept, and
            # the destinations are counted from the flags once the chunk is staged
            if tx < CH:
                dst[tx] = -1
                if B > 1:
                    kflag[tx] = 0
                if first[0] + c * CH + tx < n:
                    if B == 1:
                        if first[0] + c * CH + tx != cut[0]:
                            dst[tx] = first[0] + c * CH + tx - T.Cast("int32", first[0] + c * CH + tx > cut[0])
                    else:
                        kflag[tx] = T.Cast("int32", kept(score, h, first[0] + c * CH + tx, thr[0], cut[0]))
                    p_sh[tx] = T.if_then_else(first[0] + c * CH + tx < nf,
                                              pos_cache[h, T.min(first[0] + c * CH + tx, N - 1)],
                                              pos_blk[T.min(T.max(first[0] + c * CH + tx - nf, 0), B - 1)])
            # stage the chunk's K and V rows (cache rows or block rows), coalesced over d, every
            # thread's loads in flight together (unrolled)
            for u in T.unroll((CH * D + NT - 1) // NT):
                if u * NT + tx < CH * D:
                    if first[0] + c * CH + (u * NT + tx) // D < n:
                        part[u * NT + tx] = T.if_then_else(
                            first[0] + c * CH + (u * NT + tx) // D < nf,
                            k_cache[h, T.min(first[0] + c * CH + (u * NT + tx) // D, N - 1), (u * NT + tx) % D],
                            k_blk[0, h, T.min(T.max(first[0] + c * CH + (u * NT + tx) // D - nf, 0), B - 1),
                                  (u * NT + tx) % D])
                        part[CH * D + u * NT + tx] = T.if_then_else(
                            first[0] + c * CH + (u * NT + tx) // D < nf,
                            v_cache[h, T.min(first[0] + c * CH + (u * NT + tx) // D, N - 1), (u * NT + tx) % D],
                            v_blk[0, h, T.min(T.max(first[0] + c * CH + (u * NT + tx) // D - nf, 0), B - 1),
                                  (u * NT + tx) % D])
            T.tvm_storage_sync("shared")
            if B > 1:
                # a kept row's destination: the kept rows before it, counted from the chunk's flags
                if tx < CH:
                    row[0] = base[0]
                    for r in T.serial(CH):
                        if r < tx:
                            row[0] = row[0] + kflag[r]
                    # (a shared value in a condition is not allowed by TVM's barrier planner)
                    dst[tx] = T.if_then_else(kflag[tx] > 0, row[0], -1)
                T.tvm_storage_sync("shared")
            for u in T.unroll((CH * D + NT - 1) // NT):
                if u * NT + tx < CH * D:
                    row[0] = dst[(u * NT + tx) // D]
                    if row[0] >= 0:
                        k_cache[h, T.min(row[0], N - 1), (u * NT + tx) % D] = part[u * NT + tx]
                        v_cache[h, T.min(row[0], N - 1), (u * NT + tx) % D] = part[CH * D + u * NT + tx]
            if tx < CH:
                row[0] = dst[tx]
                if row[0] >= 0:
                    pos_cache[h, T.min(row[0], N - 1)] = p_sh[tx]
                    if S > 0:
                        for s in T.serial(S):
                            state[s, h, T.min(row[0], N - 1)] = \
                                cand_state[s, h, T.min(first[0] + c * CH + tx, NB - 1)]
            if B > 1:  # the chunk's kept rows: the next chunk's base
                for r in T.serial(CH):
                    base[0] = base[0] + kflag[r]
            T.tvm_storage_sync("shared")

    @T.macro
    def evict_launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("evict"):
                    T.reads()
                    T.writes()
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    part = T.sblock_alloc_buffer((STAGE,), "float32", scope="shared")
                    cnt = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                    slc = T.sblock_alloc_buffer((16,), "int32", scope="shared")
                    res = T.sblock_alloc_buffer((2,), "uint32", scope="shared")
                    red = T.sblock_alloc_buffer((RED,), "uint64", scope="shared")
                    dst = T.sblock_alloc_buffer((CH,), "int32", scope="shared")
                    p_sh = T.sblock_alloc_buffer((CH,), "int32", scope="shared")
                    kflag = T.sblock_alloc_buffer((CH if B > 1 else 1,), "int32", scope="shared")
                    mine = T.sblock_alloc_buffer((1,), "uint64", scope="local")
                    thr = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    cut = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    first = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    base = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    row = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    dig = T.sblock_alloc_buffer((16,), "int32", scope="local")
                    st = T.sblock_alloc_buffer((4,), "int32", scope="local")
                    pre = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    if nf + nv > N:
                        evict(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, score, state, cand_state, h, tx,
                              nf, nv, part, cnt, slc, res, dig, st, pre, red, mine, dst, p_sh, kflag, thr, cut,
                              first, base, row)

    @T.macro
    def append_launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, state, cand_state):
        for _g in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    if nf + nv <= N:
                        append(k_cache, v_cache, pos_cache, k_blk, v_blk, pos_blk, state, cand_state, tx, nf, nv)
                    # every thread has read fill (nf) before it changes: the one work-group's barrier
                    T.tvm_storage_sync("shared")
                    if tx == 0:
                        fill[0] = T.min(nf + nv, N)

    @T.macro
    def launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state):
        if with_score:
            evict_launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state)
        append_launch(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, state, cand_state)

    return select_kernel(StepShapes(H, N, B, D, S=S), launch, with_score=with_score, gpu=True)
