"""TIR score kernel for ``keydiff`` (Park et al. 2025), the same definition as
``keydiff_scores`` in ``edgekv/policies/keydiff.py``: per KV head, over all candidates
(cache ⊕ valid block rows)

    k̂_i = k_i / max(‖k_i‖, eps),  μ = mean_i k̂_i,  μ̂ = μ / max(‖μ‖, eps),  s_i = −k̂_i · μ̂

with the optional recent window (``recent`` most recent positions pinned to +inf). No queries
and no attention probabilities are read."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype


def build_keydiff_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                               dtype: str = "float32", recent: int = 0, eps: float = 1e-6):
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    EPS = float(eps)
    W = int(recent)

    @T.prim_func(private=True, s_tir=True)
    def keydiff_score(
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
        T.func_attr({"tirx.noalias": True})
        for h in T.parallel(H):
            with T.sblock("keydiff"):
                anchor = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                red = T.sblock_alloc_buffer((1,), "float32")
                newest = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                if n > N:
                    for c in T.serial(D):
                        anchor[c] = T.float32(0)
                    for i in T.serial(NB):
                        if i < n:
                            for c in T.serial(D):
                                kv[c] = T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c],
                                                       k_blk[0, h, T.max(i - nf, 0), c])
                            red[0] = T.float32(0)
                            for c in T.serial(D):
                                red[0] = red[0] + kv[c] * kv[c]
                            red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                            for c in T.serial(D):
                                anchor[c] = anchor[c] + kv[c] / red[0]
                    for c in T.serial(D):
                        anchor[c] = anchor[c] / T.Cast("float32", n)
                    red[0] = T.float32(0)
                    for c in T.serial(D):
                        red[0] = red[0] + anchor[c] * anchor[c]
                    red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                    for c in T.serial(D):
                        anchor[c] = anchor[c] / red[0]
                    newest[0] = pos_blk[T.max(n_valid[0] - 1, 0)]
                    for i in T.serial(NB):
                        if i < n:
                            for c in T.serial(D):
                                kv[c] = T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c],
                                                       k_blk[0, h, T.max(i - nf, 0), c])
                            red[0] = T.float32(0)
                            for c in T.serial(D):
                                red[0] = red[0] + kv[c] * kv[c]
                            red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                            score[h, i] = T.float32(0)
                            for c in T.serial(D):
                                score[h, i] = score[h, i] - (kv[c] / red[0]) * anchor[c]
                            if W > 0:
                                if T.if_then_else(i < nf, pos_cache[h, T.min(i, N - 1)],
                                                  pos_blk[T.max(i - nf, 0)]) > newest[0] - W:
                                    score[h, i] = T.float32("inf")
                        else:
                            score[h, i] = T.float32("-inf")

    return keydiff_score
