"""D2O's kernel declarations and macros that its CPU kernels (``d2o.py``) and GPU kernels
(``d2o_gpu.py``) share: one declaration of the score and eviction signatures, the merge weight and
the τ update, so the two kernel files never import each other."""

from __future__ import annotations

MERGE_MODES = ("weighted", "code", "average")


def merge_weight_fn(merge: str):
    """sim (a PrimExpr) -> the weight of an evicted row in ``merge_into``'s numerator."""
    from tvm import tirx

    if merge == "weighted":
        return tirx.exp
    if merge == "code":
        return lambda sim: sim
    return lambda sim: tirx.const(1.0, "float32")


def update_tau_macro(H: int, NB: int, beta: float, ema: bool):
    """``update_tau(gone, best, evicted, d2o_tau, thr, total)``: ``update_threshold`` over the
    evicted entries of all H heads (``evicted`` per head) — τ = mean(m) at the first eviction,
    then β·mean(m) + (1 − β)·τ — and the merge threshold ``thr`` (−inf with threshold="none")."""
    from tvm.script import tirx as T

    @T.macro
    def update_tau(gone, best, evicted, d2o_tau, thr, total):
        total[0] = T.float32(0)
        for h in T.serial(H):
            for i in T.serial(NB):
                if gone[h, i] == 1:
                    total[0] = total[0] + best[h, i]
        total[0] = total[0] / T.Cast("float32", H * evicted)
        if d2o_tau[1] == T.float32(0):
            d2o_tau[0] = total[0]
            d2o_tau[1] = T.float32(1)
        else:
            d2o_tau[0] = T.float32(beta) * total[0] + T.float32(1.0 - beta) * d2o_tau[0]
        thr[0] = T.if_then_else(ema, d2o_tau[0], T.float32("-inf"))

    return update_tau


def score_signature(s, body, *, gpu: bool):
    """D2O's score kernel signature (CPU and GPU: one declaration, ``kernels/signature.py``'s way):
    ``(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand,
    col_sums)``."""
    from tvm.script import tirx as T

    from ..kernels.signature import kernel_attrs

    H, N, B, D, Hq, NB = s.H, s.N, s.B, s.D, s.Hq, s.NB
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def d2o_score(
        q: T.Buffer((1, Hq, B, D), "float32"),
        k_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        acc: T.Buffer((1, H, N), "float32"),
        d2o_budget: T.Buffer((2,), "int32"),
        score: T.Buffer((H, NB), "float32"),
        acc_cand: T.Buffer((H, NB), "float32"),
        col_sums: T.Buffer((Hq, NB), "float32"),
    ):
        T.func_attr(attrs)
        body(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand, col_sums)

    return d2o_score


def evict_signature(s, body, *, gpu: bool):
    """D2O's evict (select + merge + compaction) signature: the common eight, then ``score,
    acc_cand, d2o_budget, acc, d2o_tau``."""
    from tvm.script import tirx as T

    from ..kernels.signature import kernel_attrs

    H, N, B, D, NB = s.H, s.N, s.B, s.D, s.NB
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def d2o_evict(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        score: T.Buffer((H, NB), "float32"),
        acc_cand: T.Buffer((H, NB), "float32"),
        d2o_budget: T.Buffer((2,), "int32"),
        acc: T.Buffer((1, H, N), "float32"),
        d2o_tau: T.Buffer((2,), "float32"),
    ):
        T.func_attr(attrs)
        body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, d2o_budget, acc,
             d2o_tau)

    return d2o_evict
