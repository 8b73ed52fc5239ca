"""D2O's GPU kernels: the same signatures as the CPU ones of ``d2o.py`` (swapped in by
``gpu_schedule.ReplaceKernels`` through ``d2o_gpu_kernel``, the face's ``gpu_kernel``)."""

from __future__ import annotations

import math

from ...policies.base import PolicyError
from .d2o_prepare import BUDGET_SETTINGS, build_d2o_budget_kernel, build_d2o_set_layer_kernel

GPU_THREADS = 128


def build_d2o_score_kernel_gpu(num_q_heads: int, num_kv_heads: int, budget: int, block: int, head_dim: int,
                               sm_scale: float, dtype: str = "float32", sinks: int = 4):
    """``build_d2o_score_kernel`` thread-bound. Column sums: one thread block per query head, each
    of the 128 threads owning the candidates j ≡ tx (mod 128) (their logits and running column
    sums in registers); per query row the row's q sits in shared memory and the row max and sum
    are reduced through shared memory. Accumulation and pins: one thread block per KV head, one
    thread per candidate."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes
    from .d2o_shared import score_signature

    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    G = Hq // H
    NB = N + B
    S = int(sinks)
    scale = float(sm_scale)
    NT = GPU_THREADS
    KPT = (NB + NT - 1) // NT  # candidates per thread
    QL = (D + NT - 1) // NT

    @T.macro
    def d2o_score_gpu(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand, col_sums):
        for hq in T.thread_binding(Hq, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_col_sums"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    logit = T.sblock_alloc_buffer((KPT,), "float32", scope="local")
                    colacc = T.sblock_alloc_buffer((KPT,), "float32", scope="local")
                    red = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    for u in T.serial(KPT):
                        colacc[u] = T.float32(0)
                    for r in T.serial(B):
                        if r < nv:
                            T.tvm_storage_sync("shared")
                            for u in T.serial(QL):
                                if u * NT + tx < D:
                                    q_sh[T.min(u * NT + tx, D - 1)] = q[0, hq, r, T.min(u * NT + tx, D - 1)]
                            T.tvm_storage_sync("shared")
                            red[1] = T.float32("-inf")
                            for u in T.serial(KPT):
                                logit[u] = T.float32("-inf")
                                if u * NT + tx < nf + nv:
                                    if T.if_then_else(u * NT + tx < nf, pos_cache[hq // G, T.min(u * NT + tx, N - 1)],
                                                      pos_blk[T.min(T.max(u * NT + tx - nf, 0), B - 1)]) <= pos_blk[r]:
                                        red[0] = T.float32(0)
                                        for c in T.serial(D):
                                            red[0] = red[0] + q_sh[c] * T.if_then_else(
                                                u * NT + tx < nf, k_cache[hq // G, T.min(u * NT + tx, N - 1), c],
                                                k_blk[0, hq // G, T.min(T.max(u * NT + tx - nf, 0), B - 1), c])
                                        logit[u] = red[0] * T.float32(scale)
                                        red[1] = T.max(red[1], logit[u])
                            red_sh[tx] = red[1]
                            T.tvm_storage_sync("shared")
                            red[1] = T.float32("-inf")
                            for t in T.serial(NT):
                                red[1] = T.max(red[1], red_sh[t])
                            T.tvm_storage_sync("shared")
                            red[2] = T.float32(0)
                            for u in T.serial(KPT):
                                logit[u] = T.if_then_else(logit[u] == T.float32("-inf"), T.float32(0),
                                                          T.exp(logit[u] - red[1]))
                                red[2] = red[2] + logit[u]
                            red_sh[tx] = red[2]
                            T.tvm_storage_sync("shared")
                            red[2] = T.float32(0)
                            for t in T.serial(NT):
                                red[2] = red[2] + red_sh[t]
                            for u in T.serial(KPT):
                                colacc[u] = colacc[u] + logit[u] / red[2]
                    for u in T.serial(KPT):
                        if u * NT + tx < NB:
                            col_sums[hq, T.min(u * NT + tx, NB - 1)] = colacc[u]
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_acc_score"):
                    T.reads()
                    T.writes()
                    inc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    nf2: T.let[T.int32] = fill[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    for u in T.serial(KPT):
                        if u * NT + tx < NB:
                            inc[0] = T.float32(0)
                            for g in T.serial(G):
                                inc[0] = inc[0] + col_sums[h * G + g, T.min(u * NT + tx, NB - 1)]
                            acc_cand[h, T.min(u * NT + tx, NB - 1)] = T.if_then_else(
                                u * NT + tx < nf2, acc[0, h, T.min(u * NT + tx, N - 1)], T.float32(0)) + inc[0] / T.float32(G)
                            score[h, T.min(u * NT + tx, NB - 1)] = T.float32("-inf")
                            if u * NT + tx < n:
                                score[h, T.min(u * NT + tx, NB - 1)] = acc_cand[h, T.min(u * NT + tx, NB - 1)]
                                if u * NT + tx >= n - d2o_budget[1]:
                                    score[h, T.min(u * NT + tx, NB - 1)] = T.float32("inf")
                                if T.if_then_else(u * NT + tx < nf2, pos_cache[h, T.min(u * NT + tx, N - 1)],
                                                  pos_blk[T.min(T.max(u * NT + tx - nf2, 0), B - 1)]) < S:
                                    score[h, T.min(u * NT + tx, NB - 1)] = T.float32("inf")

    return score_signature(StepShapes(H, N, B, D, Hq=Hq), d2o_score_gpu, gpu=True)


def build_d2o_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                               merge: str = "weighted", threshold: str = "ema", beta: float = 0.7, eps: float = 1e-12):
    """``build_d2o_evict_kernel`` thread-bound, its four steps in two launches, none of one work-item.
    (1) one work-group per KV head: its 128 threads find the evicted set together
    (``work_group_select_macro``: a radix select, the CPU kernel's set and tie rule), then normalise
    candidates and match evicted entries (one evicted entry per thread, a loop over the kept ones).
    (2) one work-group for all heads: τ (thread 0, summed in the CPU kernel's order), the merge
    (a thread per (head, channel) column; targets shared by several evicted entries need no atomics:
    each head's channel-0 thread first tallies which rows are hit and their denominators), the
    compaction (the same columns, each walked in row order: kept[j] ≥ j keeps it in place; the
    channel-0 thread moves positions and state), then ``fill`` after a barrier — which is why it
    is one work-group: every thread reads ``fill`` before it changes."""
    from tvm import tirx
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes
    from ..kernels.select import order_key, work_group_select_macro
    from .d2o_shared import MERGE_MODES, evict_signature, merge_weight_fn, update_tau_macro

    check_dtype(dtype)
    if merge not in MERGE_MODES + ("none",):
        raise PolicyError(f"d2o: the compiled eviction has no merge mode {merge!r}; use weighted, code, average or none")
    H, N, B, D = num_kv_heads, budget, block, head_dim
    if D > 1024:
        raise ValueError(f"d2o GPU eviction runs one thread per channel: head_dim {D} > 1024")
    NB = N + B
    MERGE = merge != "none"
    SELF_W = math.e if merge == "weighted" else 1.0
    weight = merge_weight_fn(merge)
    COUNT_DEN = merge != "weighted"
    EPS = float(eps)
    NT = GPU_THREADS
    KPT = (NB + NT - 1) // NT
    CP = (B * D + NT - 1) // NT
    find_cut = work_group_select_macro(NB, NT)
    update_tau = update_tau_macro(H, NB, float(beta), threshold == "ema")

    HP = (H * D + NT - 1) // NT  # (head, channel) columns per thread

    @T.macro
    def fold_column(k_cache, v_cache, k_blk, v_blk, k_new, v_new, gone, best, target, thr, den_all, hit_all, w,
                    h, c, nf3):
        for j in T.serial(NB):
            if hit_all[h, j] == 1:
                if j < nf3:
                    k_cache[h, T.min(j, N - 1), c] = k_cache[h, T.min(j, N - 1), c] * T.float32(SELF_W)
                    v_cache[h, T.min(j, N - 1), c] = v_cache[h, T.min(j, N - 1), c] * T.float32(SELF_W)
                else:
                    k_new[h, T.min(j - nf3, B - 1), c] = k_new[h, T.min(j - nf3, B - 1), c] * T.float32(SELF_W)
                    v_new[h, T.min(j - nf3, B - 1), c] = v_new[h, T.min(j - nf3, B - 1), c] * T.float32(SELF_W)
        for i in T.serial(NB):
            if gone[h, i] == 1:
                if best[h, i] >= thr[0]:
                    w[0] = weight(best[h, i])
                    if target[h, i] < nf3:
                        k_cache[h, T.min(target[h, i], N - 1), c] = k_cache[h, T.min(target[h, i], N - 1), c] + w[0] * T.if_then_else(
                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                        v_cache[h, T.min(target[h, i], N - 1), c] = v_cache[h, T.min(target[h, i], N - 1), c] + w[0] * T.if_then_else(
                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                    else:
                        k_new[h, T.min(target[h, i] - nf3, B - 1), c] = k_new[h, T.min(target[h, i] - nf3, B - 1), c] + w[0] * T.if_then_else(
                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                        v_new[h, T.min(target[h, i] - nf3, B - 1), c] = v_new[h, T.min(target[h, i] - nf3, B - 1), c] + w[0] * T.if_then_else(
                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
        for j in T.serial(NB):
            if hit_all[h, j] == 1:
                if j < nf3:
                    k_cache[h, T.min(j, N - 1), c] = k_cache[h, T.min(j, N - 1), c] / (den_all[h, j] + T.float32(SELF_W))
                    v_cache[h, T.min(j, N - 1), c] = v_cache[h, T.min(j, N - 1), c] / (den_all[h, j] + T.float32(SELF_W))
                else:
                    k_new[h, T.min(j - nf3, B - 1), c] = k_new[h, T.min(j - nf3, B - 1), c] / (den_all[h, j] + T.float32(SELF_W))
                    v_new[h, T.min(j - nf3, B - 1), c] = v_new[h, T.min(j - nf3, B - 1), c] / (den_all[h, j] + T.float32(SELF_W))

    @T.macro
    def compact_column(k_cache, v_cache, pos_cache, pos_blk, k_new, v_new, gone, acc, acc_cand, cnt4, h, c, nf4, nv4):
        # the kept rows of column (h, c) in candidate order; kept[j] ≥ j keeps it in place
        cnt4[0] = 0
        for i in T.serial(NB):
            if i < nf4 + nv4:
                if gone[h, i] == 0:
                    if cnt4[0] < N:
                        if i < nf4:
                            if cnt4[0] != i:
                                k_cache[h, cnt4[0], c] = k_cache[h, T.min(i, N - 1), c]
                                v_cache[h, cnt4[0], c] = v_cache[h, T.min(i, N - 1), c]
                                if c == 0:
                                    pos_cache[h, cnt4[0]] = pos_cache[h, T.min(i, N - 1)]
                        else:
                            k_cache[h, cnt4[0], c] = k_new[h, T.min(i - nf4, B - 1), c]
                            v_cache[h, cnt4[0], c] = v_new[h, T.min(i - nf4, B - 1), c]
                            if c == 0:
                                pos_cache[h, cnt4[0]] = pos_blk[T.min(i - nf4, B - 1)]
                        if c == 0:
                            acc[0, h, cnt4[0]] = acc_cand[h, i]
                        cnt4[0] = cnt4[0] + 1

    @T.macro
    def d2o_evict_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, d2o_budget, acc, d2o_tau):
        gone = T.alloc_buffer((H, NB), "int32")
        best = T.alloc_buffer((H, NB), "float32")
        target = T.alloc_buffer((H, NB), "int32")
        unit = T.alloc_buffer((H, NB, D), "float32")
        k_new = T.alloc_buffer((H, B, D), "float32")
        v_new = T.alloc_buffer((H, B, D), "float32")
        den_all = T.alloc_buffer((H, NB), "float32")  # per row: Σ weights (or counts) merged into it
        hit_all = T.alloc_buffer((H, NB), "int32")  # per row: 1 when something merges into it
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_match"):
                    T.reads()
                    T.writes()
                    # the work-group selection's scratch (kernels/select.py, work_group_select_macro)
                    part = T.sblock_alloc_buffer((17 * NT + 16,), "float32", scope="shared")
                    cnt = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                    slc = T.sblock_alloc_buffer((16,), "int32", scope="shared")
                    res = T.sblock_alloc_buffer((2,), "uint32", scope="shared")
                    dig = T.sblock_alloc_buffer((16,), "int32", scope="local")
                    st = T.sblock_alloc_buffer((4,), "int32", scope="local")
                    pre = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                    red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    keep: T.let[T.int32] = d2o_budget[0]
                    for u in T.serial(CP):
                        if u * NT + tx < B * D:
                            k_new[h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D] = \
                                k_blk[0, h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D]
                            v_new[h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D] = \
                                v_blk[0, h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D]
                    for u in T.serial(KPT):
                        if u * NT + tx < NB:
                            gone[h, T.min(u * NT + tx, NB - 1)] = 0
                            best[h, T.min(u * NT + tx, NB - 1)] = T.float32("-inf")
                            target[h, T.min(u * NT + tx, NB - 1)] = 0
                    T.tvm_storage_sync("shared")
                    if n > keep:
                        find_cut(score, h, n, keep, tx, part, cnt, slc, res, dig, st, pre)
                        # (pre[0] holds the threshold in every thread; shared values may not steer branches)
                        st[1] = T.Cast("int32", res[1])
                        for u in T.serial(KPT):
                            if u * NT + tx < n:
                                gone[h, T.min(u * NT + tx, NB - 1)] = T.if_then_else(tirx.any(
                                    order_key(score[h, T.min(u * NT + tx, NB - 1)]) > pre[0],
                                    tirx.all(order_key(score[h, T.min(u * NT + tx, NB - 1)]) == pre[0],
                                             u * NT + tx < st[1])), 0, 1)
                    T.tvm_storage_sync("shared")
                    if MERGE and n > keep:
                        for u in T.serial(KPT):
                            if u * NT + tx < n:
                                red[0] = T.float32(0)
                                for c in T.serial(D):
                                    unit[h, T.min(u * NT + tx, NB - 1), c] = T.if_then_else(
                                        u * NT + tx < nf, k_cache[h, T.min(u * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(u * NT + tx - nf, 0), B - 1), c])
                                    red[0] = red[0] + unit[h, T.min(u * NT + tx, NB - 1), c] * unit[h, T.min(u * NT + tx, NB - 1), c]
                                red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                for c in T.serial(D):
                                    unit[h, T.min(u * NT + tx, NB - 1), c] = unit[h, T.min(u * NT + tx, NB - 1), c] / red[0]
                        T.tvm_storage_sync("shared")
                        for u in T.serial(KPT):
                            if u * NT + tx < n:
                                if gone[h, T.min(u * NT + tx, NB - 1)] == 1:
                                    for j in T.serial(NB):
                                        if j < n:
                                            if gone[h, j] == 0:
                                                red[0] = T.float32(0)
                                                for c in T.serial(D):
                                                    red[0] = red[0] + unit[h, T.min(u * NT + tx, NB - 1), c] * unit[h, j, c]
                                                if red[0] > best[h, T.min(u * NT + tx, NB - 1)]:
                                                    best[h, T.min(u * NT + tx, NB - 1)] = red[0]
                                                    target[h, T.min(u * NT + tx, NB - 1)] = j
        # τ, the merge and the compaction: one work-group for every head, so that fill (read by
        # all of it) is updated at its end after a barrier instead of by a launch of one work-item.
        # A thread owns (head, channel) columns; τ is summed by thread 0 in the CPU kernel's order
        # (the same float rounding), the merge targets tallied per head by its channel-0 thread.
        for _g in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_merge_compact"):
                    T.reads()
                    T.writes()
                    total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    thr_sh = T.sblock_alloc_buffer((1,), "float32", scope="shared")  # the merge threshold
                    thr = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    w = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    cnt4 = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    nf3: T.let[T.int32] = fill[0]
                    nv3: T.let[T.int32] = n_valid[0]
                    keep3: T.let[T.int32] = d2o_budget[0]
                    # (no barrier under a branch: PoCL's optimiser corrupts memory with one here)
                    if tx == 0:
                        if MERGE and nf3 + nv3 > keep3:
                            update_tau(gone, best, nf3 + nv3 - keep3, d2o_tau, thr_sh, total)
                    T.tvm_storage_sync("shared")
                    thr[0] = thr_sh[0]  # a register: shared values may not steer branches
                    if MERGE and nf3 + nv3 > keep3:
                        for u in T.serial(HP):
                            if u * NT + tx < H * D:
                                if (u * NT + tx) % D == 0:
                                    for j in T.serial(NB):
                                        den_all[(u * NT + tx) // D, j] = T.float32(0)
                                        hit_all[(u * NT + tx) // D, j] = 0
                                    for i in T.serial(NB):
                                        if gone[(u * NT + tx) // D, i] == 1:
                                            if best[(u * NT + tx) // D, i] >= thr[0]:
                                                hit_all[(u * NT + tx) // D, target[(u * NT + tx) // D, i]] = 1
                                                den_all[(u * NT + tx) // D, target[(u * NT + tx) // D, i]] = \
                                                    den_all[(u * NT + tx) // D, target[(u * NT + tx) // D, i]] + \
                                                    T.if_then_else(COUNT_DEN, T.float32(1),
                                                                   weight(best[(u * NT + tx) // D, i]))
                    T.tvm_storage_sync("shared")
                    if MERGE and nf3 + nv3 > keep3:
                        for u in T.serial(HP):
                            if u * NT + tx < H * D:
                                fold_column(k_cache, v_cache, k_blk, v_blk, k_new, v_new, gone, best, target, thr,
                                            den_all, hit_all, w, (u * NT + tx) // D, (u * NT + tx) % D, nf3)
                    for u in T.serial(HP):
                        if u * NT + tx < H * D:
                            compact_column(k_cache, v_cache, pos_cache, pos_blk, k_new, v_new, gone, acc, acc_cand,
                                           cnt4, (u * NT + tx) // D, (u * NT + tx) % D, nf3, nv3)
                    T.tvm_storage_sync("shared")  # every thread has read fill before it changes
                    if tx == 0:
                        fill[0] = T.min(nf3 + nv3, keep3)

    return evict_signature(StepShapes(H, N, B, D), d2o_evict_gpu, gpu=True)


def d2o_gpu_kernel(name: str, func, policy_params: dict, sm_scales: dict):
    """``gpu_schedule.ReplaceKernels``'s hook (``D2OPolicy.gpu_kernel``): (kind, GPU PrimFunc) for
    the D2O kernel ``name`` (the names ``emit_d2o_site`` gives), None for any other function."""
    import re

    params = dict(policy_params)
    sinks = int(params.pop("sinks"))
    shape = lambda i: tuple(int(x) for x in func.params[i].ty.shape)  # noqa: E731
    m = re.search(r"_d2o_score_h(\d+)_(\d+)_d(\d+)_s(\d+)$", name)
    if m:
        _, Hq, B, D = shape(0)
        H, N, _ = shape(1)
        scale = sm_scales.get((Hq, H, D))
        if scale is None:
            raise PolicyError(f"{name}: no attention site with {Hq} query heads, {H} KV heads, head dim {D}")
        return "score", build_d2o_score_kernel_gpu(Hq, H, N, B, D, scale, "float32", sinks)
    if re.search(r"_d2o_evict_h(\d+)_d(\d+)$", name):
        H, N, D = shape(0)
        B = shape(4)[2]
        return "select", build_d2o_evict_kernel_gpu(H, N, B, D, "float32", **params)
    if re.search(r"d2o_layer_budgets_l(\d+)_h(\d+)$", name):  # the per-prompt probe's kernels
        import json

        settings = json.loads(str(func.attrs[BUDGET_SETTINGS]))
        return "prepare", build_d2o_budget_kernel(**settings, device=True)
    if re.search(r"d2o_set_layer_l(\d+)$", name):
        return "prepare", build_d2o_set_layer_kernel(shape(0)[0], device=True)
    return None
