"""TIR score kernel for ``lagkv`` (Liang et al. 2025), the same definition as
``LagKVPolicy.score`` in ``edgekv/policies/lagkv.py``. Per KV head over the n candidates:

  * sinks [0, S): +inf;
  * P = ⌊(n − S)/L⌋ full partitions of lag L after the sinks; partitions 0 … P−2 are scored:
    per Z ∈ {K, V}, min-max normalise partition p by the per-channel range of partition p+1
    (range clamped to ≥ eps), take the std over channels of each token (unbiased by default),
    softmax over the L tokens; raw = s_K + w·s_V. The selection score of a scored token is its
    rank inside its partition, (L − 1 − #better)/L, "better" = higher raw, ties to the lower index;
  * the tail (last partition + remainder, or everything when P < 2): 2 + i/n (newer higher).

No queries or attention probabilities are used. Cost O(n·(L + d)) per head (the in-partition
rank is O(L²) per partition)."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype


def build_lagkv_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                             dtype: str = "float32", sinks: int = 16, lag: int = 128,
                             value_weight: float = 1.0, unbiased_std: bool = True, eps: float = 1e-6):
    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S, L = int(sinks), int(lag)
    WV = float(value_weight)
    EPS = float(eps)
    DDOF = float(D - 1) if (unbiased_std and D > 1) else float(D)

    @T.prim_func(private=True, s_tir=True)
    def lagkv_score(
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
            with T.sblock("lagkv"):
                # explicit regions: automatic inference would reference the block's own let vars
                T.reads(k_cache[h, 0:N, 0:D], v_cache[h, 0:N, 0:D], fill[0:1], k_blk[0, h, 0:B, 0:D],
                        v_blk[0, h, 0:B, 0:D], n_valid[0:1])
                T.writes(score[h, 0:NB])
                raw = T.sblock_alloc_buffer((NB,), "float32")
                part = T.sblock_alloc_buffer((L,), "float32")
                lo = T.sblock_alloc_buffer((D,), "float32")
                hi = T.sblock_alloc_buffer((D,), "float32")
                zb = T.sblock_alloc_buffer((D,), "float32")
                acc = T.sblock_alloc_buffer((2,), "float32")
                mx = T.sblock_alloc_buffer((1,), "float32")
                better = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                start: T.let[T.int32] = T.min(S, n)
                P: T.let[T.int32] = (n - start) // L
                scored_end: T.let[T.int32] = T.if_then_else(P >= 2, start + (P - 1) * L, start)
                if n > N:
                    for i in T.serial(NB):
                        if i < start:
                            score[h, i] = T.float32("inf")
                        elif i < scored_end:
                            score[h, i] = T.float32(0)
                        elif i < n:
                            score[h, i] = T.float32(2) + T.Cast("float32", i) / T.Cast("float32", n)
                        else:
                            score[h, i] = T.float32("-inf")
                    for i in T.serial(NB):
                        raw[i] = T.float32(0)
                    for p in T.serial(T.max(P - 1, 0)):
                        for z in T.serial(2):
                            # per-channel range of the reference partition p + 1
                            for c in T.serial(D):
                                lo[c] = T.float32("inf")
                                hi[c] = T.float32("-inf")
                            for t in T.serial(L):
                                for c in T.serial(D):
                                    zb[c] = T.if_then_else(
                                        z == 0,
                                        T.if_then_else(start + (p + 1) * L + t < nf,
                                                       k_cache[h, T.min(start + (p + 1) * L + t, N - 1), c],
                                                       k_blk[0, h, T.max(start + (p + 1) * L + t - nf, 0), c]),
                                        T.if_then_else(start + (p + 1) * L + t < nf,
                                                       v_cache[h, T.min(start + (p + 1) * L + t, N - 1), c],
                                                       v_blk[0, h, T.max(start + (p + 1) * L + t - nf, 0), c]))
                                    lo[c] = T.min(lo[c], zb[c])
                                    hi[c] = T.max(hi[c], zb[c])
                            # std over channels of each normalised token of partition p
                            for t in T.serial(L):
                                acc[0] = T.float32(0)
                                for c in T.serial(D):
                                    zb[c] = (T.if_then_else(
                                        z == 0,
                                        T.if_then_else(start + p * L + t < nf, k_cache[h, T.min(start + p * L + t, N - 1), c],
                                                       k_blk[0, h, T.max(start + p * L + t - nf, 0), c]),
                                        T.if_then_else(start + p * L + t < nf, v_cache[h, T.min(start + p * L + t, N - 1), c],
                                                       v_blk[0, h, T.max(start + p * L + t - nf, 0), c]))
                                        - lo[c]) / T.max(hi[c] - lo[c], T.float32(EPS))
                                    acc[0] = acc[0] + zb[c]
                                acc[0] = acc[0] / T.float32(D)
                                acc[1] = T.float32(0)
                                for c in T.serial(D):
                                    acc[1] = acc[1] + (zb[c] - acc[0]) * (zb[c] - acc[0])
                                part[t] = T.sqrt(acc[1] / T.float32(DDOF))
                            # softmax over the L tokens, accumulated into raw
                            mx[0] = T.float32("-inf")
                            for t in T.serial(L):
                                mx[0] = T.max(mx[0], part[t])
                            acc[0] = T.float32(0)
                            for t in T.serial(L):
                                part[t] = T.exp(part[t] - mx[0])
                                acc[0] = acc[0] + part[t]
                            for t in T.serial(L):
                                raw[start + p * L + t] = raw[start + p * L + t] + T.if_then_else(
                                    z == 0, T.float32(1), T.float32(WV)) * (part[t] / acc[0])
                        # rank inside the partition: (L - 1 - #better) / L
                        for t in T.serial(L):
                            better[0] = 0
                            for u in T.serial(L):
                                if raw[start + p * L + u] > raw[start + p * L + t]:
                                    better[0] = better[0] + 1
                                elif raw[start + p * L + u] == raw[start + p * L + t]:
                                    if u < t:
                                        better[0] = better[0] + 1
                            score[h, start + p * L + t] = T.Cast("float32", L - 1 - better[0]) / T.float32(L)

    return lagkv_score
