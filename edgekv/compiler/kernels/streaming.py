"""TIR score kernel for ``streaming`` (StreamingLLM): score = the candidate's position
(newer = higher), +inf for the first ``sinks`` positions. Same definition as
``StreamingPolicy.score`` in ``edgekv/policies/streaming.py``."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype


def build_streaming_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                 dtype: str = "float32", sinks: int = 4):
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S = int(sinks)

    @T.prim_func(private=True, s_tir=True)
    def streaming_score(
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
        for h, i in T.grid(H, NB):
            with T.sblock("score"):
                nf: T.let[T.int32] = fill[0]
                if i < nf:
                    score[h, i] = T.if_then_else(pos_cache[h, i] < S, T.float32("inf"), T.Cast("float32", pos_cache[h, i]))
                elif i < nf + n_valid[0]:
                    score[h, i] = T.if_then_else(pos_blk[i - nf] < S, T.float32("inf"), T.Cast("float32", pos_blk[i - nf]))
                else:
                    score[h, i] = T.float32("-inf")

    return streaming_score
