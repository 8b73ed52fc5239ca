"""D2O's compiled face (``edgekv/policies/d2o.py``): the CPU score and eviction kernels and the
block-cache pass's per-site hook that wires them (``emit_d2o_site``); the GPU versions are in
``d2o_gpu.py``, the per-prompt layer-budget probe in ``d2o_prepare.py``.

Each layer carries the accumulated sums as the generic per-entry ``state`` tensor (compacted with
the cache) and ``COMPILED_STATE`` — (N_l, M_l) and τ. The budgets are state, set per prompt by the
compiled ``prepare`` function from the first block's column sums (docs/COMPILER.md).
"""

from __future__ import annotations

import math

import numpy as np

from ...policies.base import PolicyError
from .d2o_gpu import d2o_gpu_kernel
from .d2o_prepare import emit_d2o_prepare
from .d2o_shared import MERGE_MODES, evict_signature, merge_weight_fn, score_signature, update_tau_macro
from .face import PolicyKernels

# What the compiled model carries per layer beside k, v, pos, fill (one tensor each, in this order):
#   state       [1, H, N] float32  the generic per-entry state of ``entry_state`` (Policy, "Compiled
#                                  kernels beyond K/V"): the accumulated column sums of the cached
#                                  entries, compacted with them
# and D2O's own per-layer tensors (``compiled_state``):
#   d2o_budget  [2] int32       N_l and M_l = ⌊N_l·recent_ratio⌋, set by the host per prompt
#   d2o_tau     [2] float32     τ, and 1.0 once the layer's first eviction has set it
COMPILED_STATE = (("d2o_budget", 2, "int32"), ("d2o_tau", 2, "float32"))


def build_d2o_score_kernel(num_q_heads: int, num_kv_heads: int, budget: int, block: int, head_dim: int,
                           sm_scale: float, dtype: str = "float32", sinks: int = 4):
    """TIR kernel: ``D2OPolicy.observe`` + ``D2OPolicy.score`` of one layer, on every step.

    ``(q[1, Hq, B, d], k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc[1, H, N], d2o_budget[2])
    -> (score[H, N+B], acc_cand[H, N+B], col_sums[Hq, N+B])``

    col_sums: per query head, Σ over the block's valid query rows of their attention probabilities
    over cache ⊕ block (softmax per row over the candidates with position ≤ the row's, as
    ``attention_column_sums``; one row at a time). acc_cand: the candidates' accumulated sums after
    this step (cache rows: ``acc`` + the group mean of col_sums; block rows: the group mean).
    score: acc_cand with the sinks (position < ``sinks``) and the M_l = ``d2o_budget[1]`` newest
    candidates (the last M_l indices: the cache is in temporal order) at +inf. The host reads
    col_sums of the probe block (``d2o_layer_budgets``); the eviction kernel compacts acc_cand."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes

    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    G = Hq // H
    NB = N + B
    S = int(sinks)
    scale = float(sm_scale)

    @T.macro
    def d2o_score(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand, col_sums):
        for hq in T.parallel(Hq):
            with T.sblock("d2o_col_sums"):
                T.reads(q[0, hq, 0:B, 0:D], k_cache[hq // G, 0:N, 0:D], pos_cache[hq // G, 0:N], fill[0:1],
                        k_blk[0, hq // G, 0:B, 0:D], pos_blk[0:B], n_valid[0:1])
                T.writes(col_sums[hq, 0:NB])
                logit = T.sblock_alloc_buffer((NB,), "float32")
                red = T.sblock_alloc_buffer((3,), "float32")  # dot product, row max, row sum
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                for j in T.serial(NB):
                    col_sums[hq, j] = T.float32(0)
                for r in T.serial(B):
                    if r < nv:
                        red[1] = T.float32("-inf")
                        for j in T.serial(NB):
                            logit[j] = T.float32("-inf")
                            if j < nf + nv:
                                if T.if_then_else(j < nf, pos_cache[hq // G, T.min(j, N - 1)],
                                                  pos_blk[T.max(j - nf, 0)]) <= pos_blk[r]:
                                    red[0] = T.float32(0)
                                    for c in T.serial(D):
                                        red[0] = red[0] + q[0, hq, r, c] * T.if_then_else(
                                            j < nf, k_cache[hq // G, T.min(j, N - 1), c], k_blk[0, hq // G, T.max(j - nf, 0), c])
                                    logit[j] = red[0] * T.float32(scale)
                                    red[1] = T.max(red[1], logit[j])
                        red[2] = T.float32(0)
                        for j in T.serial(NB):
                            logit[j] = T.if_then_else(logit[j] == T.float32("-inf"), T.float32(0),
                                                      T.exp(logit[j] - red[1]))
                            red[2] = red[2] + logit[j]
                        for j in T.serial(NB):
                            col_sums[hq, j] = col_sums[hq, j] + logit[j] / red[2]
        for h in T.parallel(H):
            with T.sblock("d2o_acc_score"):
                T.reads(col_sums[h * G:h * G + G, 0:NB], acc[0, h, 0:N], pos_cache[h, 0:N], pos_blk[0:B], fill[0:1],
                        n_valid[0:1], d2o_budget[0:2])
                T.writes(acc_cand[h, 0:NB], score[h, 0:NB])
                inc = T.sblock_alloc_buffer((1,), "float32")
                nf2: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                for j in T.serial(NB):
                    inc[0] = T.float32(0)
                    for g in T.serial(G):
                        inc[0] = inc[0] + col_sums[h * G + g, j]
                    acc_cand[h, j] = T.if_then_else(j < nf2, acc[0, h, T.min(j, N - 1)], T.float32(0)) + inc[0] / T.float32(G)
                    score[h, j] = T.float32("-inf")
                    if j < n:
                        score[h, j] = acc_cand[h, j]
                        if j >= n - d2o_budget[1]:
                            score[h, j] = T.float32("inf")
                        if T.if_then_else(j < nf2, pos_cache[h, T.min(j, N - 1)], pos_blk[T.max(j - nf2, 0)]) < S:
                            score[h, j] = T.float32("inf")

    return score_signature(StepShapes(H, N, B, D, Hq=Hq), d2o_score, gpu=False)


def build_d2o_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                           merge: str = "weighted", threshold: str = "ema", beta: float = 0.7, eps: float = 1e-12):
    """TIR eviction kernel of one layer: ``D2OPolicy.select`` (top-N_l, ``best_matches``,
    ``update_threshold``, ``merge_into``) and the engine's compaction, in place.

    ``(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score[H, N+B],
    acc_cand[H, N+B], d2o_budget[2], acc[1, H, N], d2o_tau[2])``; in place (``call_tir_inplace``):
    k_cache, v_cache, pos_cache, fill, acc, d2o_tau (indices 0, 1, 2, 3, 11, 12).

    When fill + n_valid ≤ N_l = ``d2o_budget[0]`` the block is appended (acc ← acc_cand). Otherwise
    four loop nests: (1) per KV head (parallel): the evicted set (the shared ``evicted_mask_macro``,
    ties → the higher index evicted, as ``topk_keep``), unit keys (``F.normalize``'s ``eps``) and
    for each evicted entry its most cosine-similar kept entry m, j* (ties → the lower index, as
    ``torch.max``); (2) once: τ ← β·mean(m) + (1 − β)·τ over all heads and evicted entries (τ =
    mean(m) at the layer's first eviction; ``d2o_tau[1]`` marks it set); (3) per KV head: every
    evicted entry with m ≥ τ (all with ``threshold="none"``) folded into its j* with the weights of
    ``merge`` — into the cache row itself, or into a copy of the block row; (4) per KV head: the
    kept candidates (merged) compacted to the front in ascending order with their positions and
    acc_cand. τ is float32 (the reference carries a Python float): a merge decision can differ
    only when m is within an ulp of τ."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes
    from ..kernels.select import evicted_mask_macro

    check_dtype(dtype)
    if merge not in MERGE_MODES + ("none",):
        raise PolicyError(f"d2o: the compiled eviction has no merge mode {merge!r}; use weighted, code, average or none")
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    MERGE = merge != "none"  # merge=none: plain top-N_l, τ never updated (as ``select``)
    SELF_W = math.e if merge == "weighted" else 1.0
    weight = merge_weight_fn(merge)
    COUNT_DEN = merge != "weighted"  # code/average: den = 1 + |E_j|; weighted: e + Σ e^u
    EPS = float(eps)
    mark_evicted = evicted_mask_macro(NB)
    update_tau = update_tau_macro(H, NB, float(beta), threshold == "ema")

    @T.macro
    def d2o_evict(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, d2o_budget, acc, d2o_tau):
        gone = T.alloc_buffer((H, NB), "int32")
        best = T.alloc_buffer((H, NB), "float32")
        target = T.alloc_buffer((H, NB), "int32")
        unit = T.alloc_buffer((H, NB, D), "float32")
        k_new = T.alloc_buffer((H, B, D), "float32")  # the block rows, merges applied
        v_new = T.alloc_buffer((H, B, D), "float32")
        thr = T.alloc_buffer((1,), "float32")
        for h in T.parallel(H):
            with T.sblock("d2o_match"):
                T.reads(k_cache[h, 0:N, 0:D], k_blk[0, h, 0:B, 0:D], v_blk[0, h, 0:B, 0:D], score[h, 0:NB],
                        fill[0:1], n_valid[0:1], d2o_budget[0:2])
                T.writes(k_new[h, 0:B, 0:D], v_new[h, 0:B, 0:D], gone[h, 0:NB], best[h, 0:NB],
                         target[h, 0:NB], unit[h, 0:NB, 0:D])
                key = T.sblock_alloc_buffer((NB,), "int32")
                row = T.sblock_alloc_buffer((NB,), "int32")
                lo = T.sblock_alloc_buffer((1,), "int64")
                hi = T.sblock_alloc_buffer((1,), "int64")
                cnt = T.sblock_alloc_buffer((1,), "int32")
                red = T.sblock_alloc_buffer((1,), "float32")
                nf: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                keep: T.let[T.int32] = d2o_budget[0]
                for i in T.serial(B):
                    for c in T.serial(D):
                        k_new[h, i, c] = k_blk[0, h, i, c]
                        v_new[h, i, c] = v_blk[0, h, i, c]
                for i in T.serial(NB):
                    gone[h, i] = 0
                if n > keep:
                    mark_evicted(score, h, n, keep, key, row, lo, hi, cnt)
                    for i in T.serial(NB):
                        gone[h, i] = row[i]
                        best[h, i] = T.float32("-inf")
                        target[h, i] = 0
                    if MERGE:
                        for i in T.serial(NB):
                            if i < n:
                                red[0] = T.float32(0)
                                for c in T.serial(D):
                                    unit[h, i, c] = T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c],
                                                                   k_blk[0, h, T.max(i - nf, 0), c])
                                    red[0] = red[0] + unit[h, i, c] * unit[h, i, c]
                                red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                for c in T.serial(D):
                                    unit[h, i, c] = unit[h, i, c] / red[0]
                        for i in T.serial(NB):
                            if i < n:
                                if row[i] == 1:
                                    for j in T.serial(NB):
                                        if j < n:
                                            if row[j] == 0:
                                                red[0] = T.float32(0)
                                                for c in T.serial(D):
                                                    red[0] = red[0] + unit[h, i, c] * unit[h, j, c]
                                                if red[0] > best[h, i]:
                                                    best[h, i] = red[0]
                                                    target[h, i] = j
        with T.sblock("d2o_tau"):
            T.reads(gone[0:H, 0:NB], best[0:H, 0:NB], fill[0:1], n_valid[0:1], d2o_budget[0:2], d2o_tau[0:2])
            T.writes(d2o_tau[0:2], thr[0:1])
            total = T.sblock_alloc_buffer((1,), "float32")
            n2: T.let[T.int32] = fill[0] + n_valid[0]
            if MERGE and n2 > d2o_budget[0]:
                update_tau(gone, best, n2 - d2o_budget[0], d2o_tau, thr, total)
        for h in T.parallel(H):
            with T.sblock("d2o_fold"):
                T.reads(gone[h, 0:NB], best[h, 0:NB], target[h, 0:NB], thr[0:1], k_blk[0, h, 0:B, 0:D],
                        v_blk[0, h, 0:B, 0:D], fill[0:1], n_valid[0:1], d2o_budget[0:2])
                T.writes(k_cache[h, 0:N, 0:D], v_cache[h, 0:N, 0:D], k_new[h, 0:B, 0:D], v_new[h, 0:B, 0:D])
                den = T.sblock_alloc_buffer((NB,), "float32")
                hit = T.sblock_alloc_buffer((NB,), "int32")
                w = T.sblock_alloc_buffer((1,), "float32")
                nf3: T.let[T.int32] = fill[0]
                if MERGE and fill[0] + n_valid[0] > d2o_budget[0]:
                    for j in T.serial(NB):
                        den[j] = T.float32(0)
                        hit[j] = 0
                    # numerators accumulate in the kept rows themselves: evicted rows are never targets
                    for i in T.serial(NB):
                        if gone[h, i] == 1:
                            if best[h, i] >= thr[0]:
                                w[0] = weight(best[h, i])
                                if hit[target[h, i]] == 0:
                                    hit[target[h, i]] = 1
                                    for c in T.serial(D):
                                        if target[h, i] < nf3:
                                            k_cache[h, target[h, i], c] = k_cache[h, target[h, i], c] * T.float32(SELF_W)
                                            v_cache[h, target[h, i], c] = v_cache[h, target[h, i], c] * T.float32(SELF_W)
                                        else:
                                            k_new[h, target[h, i] - nf3, c] = k_new[h, target[h, i] - nf3, c] * T.float32(SELF_W)
                                            v_new[h, target[h, i] - nf3, c] = v_new[h, target[h, i] - nf3, c] * T.float32(SELF_W)
                                den[target[h, i]] = den[target[h, i]] + T.if_then_else(COUNT_DEN, T.float32(1), w[0])
                                for c in T.serial(D):
                                    if target[h, i] < nf3:
                                        k_cache[h, target[h, i], c] = k_cache[h, target[h, i], c] + w[0] * T.if_then_else(
                                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.max(i - nf3, 0), c])
                                        v_cache[h, target[h, i], c] = v_cache[h, target[h, i], c] + w[0] * T.if_then_else(
                                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.max(i - nf3, 0), c])
                                    else:
                                        k_new[h, target[h, i] - nf3, c] = k_new[h, target[h, i] - nf3, c] + w[0] * T.if_then_else(
                                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.max(i - nf3, 0), c])
                                        v_new[h, target[h, i] - nf3, c] = v_new[h, target[h, i] - nf3, c] + w[0] * T.if_then_else(
                                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.max(i - nf3, 0), c])
                    for j in T.serial(NB):
                        if hit[j] == 1:
                            for c in T.serial(D):
                                if j < nf3:
                                    k_cache[h, j, c] = k_cache[h, j, c] / (den[j] + T.float32(SELF_W))
                                    v_cache[h, j, c] = v_cache[h, j, c] / (den[j] + T.float32(SELF_W))
                                else:
                                    k_new[h, j - nf3, c] = k_new[h, j - nf3, c] / (den[j] + T.float32(SELF_W))
                                    v_new[h, j - nf3, c] = v_new[h, j - nf3, c] / (den[j] + T.float32(SELF_W))
        for h in T.parallel(H):
            with T.sblock("d2o_compact"):
                T.reads(gone[h, 0:NB], k_new[h, 0:B, 0:D], v_new[h, 0:B, 0:D], acc_cand[h, 0:NB], pos_blk[0:B],
                        fill[0:1], n_valid[0:1], d2o_budget[0:2])
                T.writes(k_cache[h, 0:N, 0:D], v_cache[h, 0:N, 0:D], pos_cache[h, 0:N], acc[0, h, 0:N])
                cnt4 = T.sblock_alloc_buffer((1,), "int32")
                nf4: T.let[T.int32] = fill[0]
                # kept[j] ≥ j: writing row j from candidate kept[j] in ascending j never overwrites a
                # row still to be read (as in the select kernel); with nothing evicted this appends
                cnt4[0] = 0
                for i in T.serial(NB):
                    if i < fill[0] + n_valid[0]:
                        if gone[h, i] == 0:
                            if cnt4[0] < N:
                                if i < nf4:
                                    if cnt4[0] != i:
                                        for c in T.serial(D):
                                            k_cache[h, cnt4[0], c] = k_cache[h, i, c]
                                            v_cache[h, cnt4[0], c] = v_cache[h, i, c]
                                        pos_cache[h, cnt4[0]] = pos_cache[h, i]
                                else:
                                    for c in T.serial(D):
                                        k_cache[h, cnt4[0], c] = k_new[h, i - nf4, c]
                                        v_cache[h, cnt4[0], c] = v_new[h, i - nf4, c]
                                    pos_cache[h, cnt4[0]] = pos_blk[i - nf4]
                                acc[0, h, cnt4[0]] = acc_cand[h, i]
                                cnt4[0] = cnt4[0] + 1
        with T.sblock("d2o_fill"):
            fill[0] = T.min(fill[0] + n_valid[0], d2o_budget[0])

    return evict_signature(StepShapes(H, N, B, D), d2o_evict, gpu=False)




def emit_d2o_site(bb, kernel, site, spec, block, caches, inputs, k_blk, v_blk, pos_blk, n_valid):
    """The block-cache pass's hook (``D2OPolicy.emit_site_eviction``): at one attention site emit
    the score kernel and the in-place eviction kernel over the site's caches
    (k, v, pos, fill, state = the accumulated sums [1, H, N], d2o_budget, d2o_tau); ``inputs`` are
    the policy's ``kernel_inputs`` tensors (the block's queries). Returns (the site's new caches, [col_sums]):
    the per-query-head column sums of the step leave the function as an extra output, for the
    host's layer-budget probe (``d2o_layer_budgets``)."""
    from tvm import relax  # lazy: tvm is the optional `compile` extra

    H, Hq, D, N, T_ = site.num_kv_heads, site.num_q_heads, site.head_dim, spec.budget, block
    params = dict(spec.policy_params)
    sinks = int(params.pop("sinks"))
    kc, vc, pc, fc, acc, layer_budget, tau = caches
    (q,) = inputs
    score_gv = kernel(f"d2o_score_h{Hq}_{H}_d{D}_s{sinks}",
                      lambda: build_d2o_score_kernel(Hq, H, N, T_, D, site.sm_scale, spec.dtype, sinks))
    evict_gv = kernel(f"d2o_evict_h{H}_d{D}",
                      lambda: build_d2o_evict_kernel(H, N, T_, D, spec.dtype, **params))
    cand = relax.TensorType((H, N + T_), "float32")
    scored = bb.emit(relax.call_tir(score_gv, [q, kc, pc, fc, k_blk, pos_blk, n_valid, acc, layer_budget],
                                    [cand, cand, relax.TensorType((Hq, N + T_), "float32")]), f"d2o_score_{site.index}")
    score, acc_cand, col_sums = (bb.emit(relax.TupleGetItem(scored, i)) for i in range(3))
    args = [kc, vc, pc, fc, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, layer_budget, acc, tau]
    upd = bb.emit(relax.call_tir_inplace(evict_gv, args, [0, 1, 2, 3, 11, 12],
                                         [args[i].ty for i in (0, 1, 2, 3, 11, 12)]), f"evict_{site.index}")
    new = [bb.emit(relax.TupleGetItem(upd, i)) for i in range(6)]
    return new[:5] + [layer_budget, new[5]], [col_sums]



def d2o_kernel_params(policy, budget: int) -> dict:
    return {"merge": policy.merge, "threshold": policy.threshold, "beta": float(policy.beta), "sinks": int(policy.sinks)}


def d2o_compiled_state_init(policy, budget: int) -> dict:
    """Every layer's (N_l, M_l) before a prompt: uniform, or N until the probe sets it."""
    n_l = policy.uniform_budget(budget) if policy.layers == "uniform" else budget
    return {"d2o_budget": np.array([n_l, policy.recent_size(n_l)], dtype=np.int32)}


def d2o_prepare_min_prompt(policy, budget: int) -> int | None:
    """The first-block probe runs for prompts longer than N (shorter ones keep N everywhere)."""
    return None if policy.layers == "uniform" else budget


# the eviction kernel needs the queries' score kernel beside it, so the pass asks ``emit_site_eviction``
# to wire both; the per-layer state the compiled model carries; the per-prompt probe
KERNELS = PolicyKernels(
    kernel_inputs=("queries",),
    emit_site_eviction=emit_d2o_site,
    gpu_kernel=d2o_gpu_kernel,
    compiled_state=COMPILED_STATE,
    emit_prepare=emit_d2o_prepare,
    kernel_params=d2o_kernel_params,
    compiled_state_init=d2o_compiled_state_init,
    prepare_min_prompt=d2o_prepare_min_prompt,
)
