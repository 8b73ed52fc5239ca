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

    # squared norms and dot products as LANES partial sums (vectorisable), cache rows and
    # block rows in separate loops (no per-element select between the two sources)
    LANES = 16 if D % 16 == 0 else (8 if D % 8 == 0 else 1)
    CH = D // LANES

    @T.macro
    def row_norm(src, red, part):
        for l in T.vectorized(LANES):
            part[l] = T.float32(0)
        for c0 in T.serial(CH):
            for l in T.vectorized(LANES):
                part[l] = part[l] + src[c0 * LANES + l] * src[c0 * LANES + l]
        red[0] = T.float32(0)
        for l in T.serial(LANES):
            red[0] = red[0] + part[l]
        red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))

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
                T.reads(k_cache[h, 0:N, 0:D], pos_cache[h, 0:N], fill[0:1], k_blk[0, h, 0:B, 0:D], pos_blk[0:B],
                        n_valid[0:1])
                T.writes(score[h, 0:NB])
                anchor = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                part = T.sblock_alloc_buffer((LANES,), "float32")
                red = T.sblock_alloc_buffer((1,), "float32")
                newest = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                if n > N:
                    for c in T.vectorized(D):
                        anchor[c] = T.float32(0)
                    for i in T.serial(N):
                        if i < nf:
                            for c in T.vectorized(D):
                                kv[c] = k_cache[h, i, c]
                            row_norm(kv, red, part)
                            for c in T.vectorized(D):
                                anchor[c] = anchor[c] + kv[c] / red[0]
                    for i in T.serial(B):
                        if i < nv:
                            for c in T.vectorized(D):
                                kv[c] = k_blk[0, h, i, c]
                            row_norm(kv, red, part)
                            for c in T.vectorized(D):
                                anchor[c] = anchor[c] + kv[c] / red[0]
                    for c in T.vectorized(D):
                        anchor[c] = anchor[c] / T.Cast("float32", n)
                    row_norm(anchor, red, part)
                    for c in T.vectorized(D):
                        anchor[c] = anchor[c] / red[0]
                    newest[0] = pos_blk[T.max(nv - 1, 0)]
                    for i in T.serial(NB):
                        score[h, i] = T.float32("-inf")
                    for i in T.serial(N):
                        if i < nf:
                            for c in T.vectorized(D):
                                kv[c] = k_cache[h, i, c]
                            row_norm(kv, red, part)
                            for l in T.vectorized(LANES):
                                part[l] = T.float32(0)
                            for c0 in T.serial(CH):
                                for l in T.vectorized(LANES):
                                    part[l] = part[l] + (kv[c0 * LANES + l] / red[0]) * anchor[c0 * LANES + l]
                            score[h, i] = T.float32(0)
                            for l in T.serial(LANES):
                                score[h, i] = score[h, i] - part[l]
                            if W > 0:
                                if pos_cache[h, i] > newest[0] - W:
                                    score[h, i] = T.float32("inf")
                    for i in T.serial(B):
                        if i < nv:
                            for c in T.vectorized(D):
                                kv[c] = k_blk[0, h, i, c]
                            row_norm(kv, red, part)
                            for l in T.vectorized(LANES):
                                part[l] = T.float32(0)
                            for c0 in T.serial(CH):
                                for l in T.vectorized(LANES):
                                    part[l] = part[l] + (kv[c0 * LANES + l] / red[0]) * anchor[c0 * LANES + l]
                            score[h, nf + i] = T.float32(0)
                            for l in T.serial(LANES):
                                score[h, nf + i] = score[h, nf + i] - part[l]
                            if W > 0:
                                if pos_blk[i] > newest[0] - W:
                                    score[h, nf + i] = T.float32("inf")

    return keydiff_score
