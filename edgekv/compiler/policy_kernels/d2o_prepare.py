"""D2O's per-prompt probe: the kernels of the compiled ``prepare`` function (``compiler/passes/add_prepare_function.py``)
that turn the first block's column sums into every layer's budget, and its Relax emitter."""

from __future__ import annotations

BUDGET_SETTINGS = "edgekv.d2o_budget_settings"  # PrimFunc attribute: build_d2o_budget_kernel's arguments
DEVICE_THREADS = 64  # the budget kernel's GPU work-group: one (layer, head) column-sum variance per thread


def build_d2o_budget_kernel(num_layers: int, num_q_heads: int, candidates: int, budget: int, *, avg_ratio: float,
                            min_budget: int, recent_ratio: float, variance_norm: str, device: bool = False):
    """TIR kernel: the first block's column sums → every layer's (N_l, M_l): ``prompt_budgets``
    compiled (float64, serial; 30 layers × a few heads is microseconds). Steps as in
    ``column_sum_variance`` → ``layer_statistic`` → softmax(−σ̃²) → ``allocate_budgets``:

        (col_sums[L, Hq, N + B] f32, n_valid[1] i32, prompt_len[1] i64) -> budgets[L, 2] i32

    A prompt that fits (prompt_len ≤ N) gets N everywhere, as the reference skips the probe then.

    ``device``: the GPU form — one work-group of ``DEVICE_THREADS``: the L·Hq column-sum variances
    (the bulk of the reads) one per thread into shared memory, then thread 0 the few hundred scalar
    steps of the allocation in private memory — and float32 arithmetic: phone GPUs have no
    fp64 (the profiles demote float64), so a layer's share can round differently from the CPU's
    float64 in a near-tie of the water-filling (one entry of budget, at most)."""
    from tvm.script import tirx as T

    if variance_norm not in ("minmax", "mean", "raw", "head_minmax"):
        raise ValueError(f"d2o budget kernel: unknown variance_norm {variance_norm!r}")
    L, Hq, NB, cap = num_layers, num_q_heads, candidates, budget
    floor_ = min(min_budget, cap)
    total = max(min(int(avg_ratio * budget * L), L * cap), L * floor_)  # as allocate_budgets clamps it
    norm = ("minmax", "mean", "raw", "head_minmax").index(variance_norm)
    F = "float32" if device else "float64"  # the accumulation type
    scope = "local" if device else "global"

    @T.macro
    def column_variance(col_sums, n, hv, acc, l, h):
        # unbiased variance of layer l, head h's column sums over the n valid columns
        acc[0] = T.Cast(F, 0)
        for j in T.serial(NB):
            if j < n:
                acc[0] = acc[0] + T.Cast(F, col_sums[l, h, j])
        acc[1] = acc[0] / T.Cast(F, T.max(n, 1))
        acc[2] = T.Cast(F, 0)
        for j in T.serial(NB):
            if j < n:
                acc[2] = acc[2] + (T.Cast(F, col_sums[l, h, j]) - acc[1]) * (
                    T.Cast(F, col_sums[l, h, j]) - acc[1])
        hv[l, h] = T.if_then_else(n < 2, T.Cast(F, 0), acc[2] / T.Cast(F, T.max(n - 1, 1)))

    @T.macro
    def allocate_from_variances(hv, prompt_len, budgets, acc, sig, alloc, share, free, out, cnt):
        # hv → budgets: layer_statistic, softmax(−σ̃²), water-filling, rounding (serial, small)
        for l in T.serial(L):  # layer_statistic
            acc[0] = T.Cast(F, 0)
            if norm == 3:  # head_minmax
                acc[1] = hv[l, 0]
                acc[2] = hv[l, 0]
                for h in T.serial(Hq):
                    acc[1] = T.min(acc[1], hv[l, h])
                    acc[2] = T.max(acc[2], hv[l, h])
                for h in T.serial(Hq):
                    acc[0] = acc[0] + (hv[l, h] - acc[1]) / (acc[2] - acc[1] + T.Cast(F, 1e-6))
            else:
                for h in T.serial(Hq):
                    acc[0] = acc[0] + hv[l, h]
            sig[l] = acc[0] / T.Cast(F, Hq)
        if norm == 0 or norm == 1:
            acc[0] = T.Cast(F, 0)
            acc[1] = sig[0]
            acc[2] = sig[0]
            for l in T.serial(L):
                acc[0] = acc[0] + sig[l]
                acc[1] = T.min(acc[1], sig[l])
                acc[2] = T.max(acc[2], sig[l])
            for l in T.serial(L):
                if norm == 0:
                    sig[l] = (sig[l] - acc[1]) / (acc[2] - acc[1] + T.Cast(F, 1e-12))
                else:
                    sig[l] = sig[l] / T.max(acc[0] / T.Cast(F, L), T.Cast(F, 1e-12))
        acc[1] = -sig[0]  # softmax(−σ̃²)
        for l in T.serial(L):
            acc[1] = T.max(acc[1], -sig[l])
        acc[0] = T.Cast(F, 0)
        for l in T.serial(L):
            sig[l] = T.exp(-sig[l] - acc[1])
            acc[0] = acc[0] + sig[l]
        for l in T.serial(L):
            sig[l] = sig[l] / acc[0]
            alloc[l] = T.Cast(F, 0)
            free[l] = 1
        acc[3] = T.Cast(F, total)  # water-filling: clamp at [floor, cap], re-split the rest
        for _it in T.serial(L + 1):
            cnt[0] = 0
            acc[0] = T.Cast(F, 0)
            for l in T.serial(L):
                if free[l] == 1:
                    cnt[0] = cnt[0] + 1
                    acc[0] = acc[0] + sig[l]
            if cnt[0] > 0:
                cnt[1] = 0
                cnt[2] = 0
                for l in T.serial(L):
                    if free[l] == 1:
                        share[l] = T.if_then_else(acc[0] > T.Cast(F, 0), sig[l] / acc[0] * acc[3],
                                                  acc[3] / T.Cast(F, cnt[0]))
                        if share[l] > T.Cast(F, cap):
                            cnt[1] = cnt[1] + 1
                        if share[l] < T.Cast(F, floor_):
                            cnt[2] = cnt[2] + 1
                for l in T.serial(L):
                    if free[l] == 1:
                        if cnt[1] > 0:
                            if share[l] > T.Cast(F, cap):
                                alloc[l] = T.Cast(F, cap)
                                free[l] = 0
                                acc[3] = acc[3] - T.Cast(F, cap)
                        elif cnt[2] > 0:
                            if share[l] < T.Cast(F, floor_):
                                alloc[l] = T.Cast(F, floor_)
                                free[l] = 0
                                acc[3] = acc[3] - T.Cast(F, floor_)
                        else:
                            alloc[l] = share[l]
                            free[l] = 0
        cnt[3] = total  # round down, the remainder to the largest fractional parts (stable)
        for l in T.serial(L):
            out[l] = T.Cast("int32", T.floor(alloc[l]))
            cnt[3] = cnt[3] - out[l]
            free[l] = 1  # now: not yet visited
        for _k in T.serial(L):
            cnt[0] = -1
            for l in T.serial(L):
                if free[l] == 1:
                    if cnt[0] < 0:
                        cnt[0] = l
                    elif alloc[l] - T.floor(alloc[l]) > alloc[cnt[0]] - T.floor(alloc[cnt[0]]):
                        cnt[0] = l
            free[cnt[0]] = 0
            if cnt[3] > 0 and out[cnt[0]] < cap:
                out[cnt[0]] = out[cnt[0]] + 1
                cnt[3] = cnt[3] - 1
        for l in T.serial(L):
            out[l] = T.if_then_else(prompt_len[0] <= T.int64(cap), cap, T.min(out[l], cap))
            budgets[l, 0] = out[l]
            budgets[l, 1] = T.Cast("int32", T.floor(T.Cast(F, out[l]) * T.Cast(F, recent_ratio)))

    @T.macro
    def allocate(col_sums, n_valid, prompt_len, budgets):
        with T.sblock("d2o_layer_budgets"):
            T.reads(col_sums[0:L, 0:Hq, 0:NB], n_valid[0:1], prompt_len[0:1])
            T.writes(budgets[0:L, 0:2])
            hv = T.sblock_alloc_buffer((L, Hq), F, scope=scope)    # per-head column-sum variance
            acc = T.sblock_alloc_buffer((4,), F, scope=scope)      # sums, min, max, remaining
            sig = T.sblock_alloc_buffer((L,), F, scope=scope)      # σ̃², then the shares
            alloc = T.sblock_alloc_buffer((L,), F, scope=scope)
            share = T.sblock_alloc_buffer((L,), F, scope=scope)
            free = T.sblock_alloc_buffer((L,), "int32", scope=scope)
            out = T.sblock_alloc_buffer((L,), "int32", scope=scope)
            cnt = T.sblock_alloc_buffer((4,), "int32", scope=scope)        # free layers, over, under, rest
            n: T.let[T.int32] = n_valid[0]
            for l, h in T.grid(L, Hq):
                column_variance(col_sums, n, hv, acc, l, h)
            allocate_from_variances(hv, prompt_len, budgets, acc, sig, alloc, share, free, out, cnt)

    @T.macro
    def allocate_device(col_sums, n_valid, prompt_len, budgets):
        # a work-group: one (layer, head) variance per thread (the bulk: L·Hq·(N + B) reads), then
        # thread 0 the few hundred scalar steps of the allocation (float32: see above)
        for _b in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(DEVICE_THREADS, thread="threadIdx.x"):
                with T.sblock("d2o_layer_budgets"):
                    T.reads()
                    T.writes()
                    hv = T.sblock_alloc_buffer((L, Hq), F, scope="shared")
                    acc = T.sblock_alloc_buffer((4,), F, scope="local")
                    sig = T.sblock_alloc_buffer((L,), F, scope="local")
                    alloc = T.sblock_alloc_buffer((L,), F, scope="local")
                    share = T.sblock_alloc_buffer((L,), F, scope="local")
                    free = T.sblock_alloc_buffer((L,), "int32", scope="local")
                    out = T.sblock_alloc_buffer((L,), "int32", scope="local")
                    cnt = T.sblock_alloc_buffer((4,), "int32", scope="local")
                    n: T.let[T.int32] = n_valid[0]
                    for u in T.serial((L * Hq + DEVICE_THREADS - 1) // DEVICE_THREADS):
                        if u * DEVICE_THREADS + tx < L * Hq:
                            column_variance(col_sums, n, hv, acc, (u * DEVICE_THREADS + tx) // Hq,
                                            (u * DEVICE_THREADS + tx) % Hq)
                    T.tvm_storage_sync("shared")
                    if tx == 0:
                        allocate_from_variances(hv, prompt_len, budgets, acc, sig, alloc, share, free, out, cnt)

    @T.prim_func(private=True, s_tir=True)
    def d2o_layer_budgets(col_sums: T.Buffer((L, Hq, NB), "float32"), n_valid: T.Buffer((1,), "int32"),
                          prompt_len: T.Buffer((1,), "int64"), budgets: T.Buffer((L, 2), "int32")):
        T.func_attr({"tirx.noalias": True})
        if device:
            allocate_device(col_sums, n_valid, prompt_len, budgets)
        else:
            allocate(col_sums, n_valid, prompt_len, budgets)

    return d2o_layer_budgets


def build_d2o_set_layer_kernel(num_layers: int, device: bool = False):
    """TIR kernel, in place: one layer's d2o_budget ← budgets[layer], τ cleared, the cache emptied
    (the probe block leaves it): ``(budgets[L, 2], layer[1], d2o_budget[2], d2o_tau[2], fill[1])``.
    ``device``: the GPU form (two work-items)."""
    from tvm.script import tirx as T

    @T.macro
    def set_layer(budgets, layer, d2o_budget, d2o_tau, fill):
        with T.sblock("d2o_set_layer"):
            T.reads(budgets[0:num_layers, 0:2], layer[0:1])
            T.writes(d2o_budget[0:2], d2o_tau[0:2], fill[0:1])
            for i in T.serial(2):
                d2o_budget[i] = budgets[layer[0], i]
                d2o_tau[i] = T.float32(0)
            fill[0] = 0

    @T.prim_func(private=True, s_tir=True)
    def d2o_set_layer(budgets: T.Buffer((num_layers, 2), "int32"), layer: T.Buffer((1,), "int32"),
                      d2o_budget: T.Buffer((2,), "int32"), d2o_tau: T.Buffer((2,), "float32"),
                      fill: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        if device:  # two work-items: one per (budget, τ) slot; the first also empties the cache
            for _b in T.thread_binding(1, thread="blockIdx.x"):
                for i in T.thread_binding(2, thread="threadIdx.x"):
                    with T.sblock("d2o_set_layer"):
                        T.reads()
                        T.writes()
                        d2o_budget[i] = budgets[layer[0], i]
                        d2o_tau[i] = T.float32(0)
                        if i == 0:
                            fill[0] = 0
        else:
            set_layer(budgets, layer, d2o_budget, d2o_tau, fill)

    return d2o_set_layer


def emit_d2o_prepare(bb, kernel, policy, probe, caches, n_valid, prompt_len, budget):
    """``D2OPolicy.emit_prepare``: after the probe (``prefill_block`` over the empty cache on the
    prompt's first block; ``probe`` its outputs: logits, caches, then each layer's col_sums), the
    budget kernel turns the column sums into every layer's (N_l, M_l), and one small in-place kernel
    per layer writes them into ``d2o_budget``, clears τ and empties the cache. Returns the caches."""
    import json

    import numpy as np
    from tvm import relax

    L = len(caches)
    col_sums = probe[-L:]
    Hq, NB = (int(d) for d in col_sums[0].ty.shape.values)
    stacked = bb.emit(relax.op.stack(col_sums, axis=0), "d2o_probe_col_sums")
    settings = {"num_layers": L, "num_q_heads": Hq, "candidates": NB, "budget": int(budget),
                "avg_ratio": float(policy.avg_ratio), "min_budget": int(policy.min_layer_budget(budget)),
                "recent_ratio": float(policy.recent_ratio), "variance_norm": policy.variance_norm}
    # the settings ride on the kernel, so that a GPU build can rebuild its device form (d2o_gpu_kernel)
    budget_gv = kernel(f"d2o_layer_budgets_l{L}_h{Hq}", lambda: build_d2o_budget_kernel(**settings).with_attr(
        BUDGET_SETTINGS, json.dumps(settings)))
    budgets = bb.emit(relax.call_tir(budget_gv, [stacked, n_valid, prompt_len], relax.TensorType((L, 2), "int32")),
                      "d2o_budgets")
    set_gv = kernel(f"d2o_set_layer_l{L}", lambda: build_d2o_set_layer_kernel(L))
    out = []
    # ``stored``: what the layout has after D2O's own tensors (an int8 cache's scales), passed through
    for layer, (kc, vc, pc, fc, acc, layer_budget, tau, *stored) in enumerate(caches):
        args = [budgets, relax.const(np.array([layer], dtype="int32")), layer_budget, tau, fc]
        upd = bb.emit(relax.call_tir_inplace(set_gv, args, [2, 3, 4], [a.ty for a in args[2:]]), f"d2o_set_{layer}")
        lb, ta, fi = (bb.emit(relax.TupleGetItem(upd, i)) for i in range(3))
        out.append([kc, vc, pc, fi, acc, lb, ta, *stored])
    return out
