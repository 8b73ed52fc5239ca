"""Block attention over cache ⊕ block, as one TIR kernel.

Query row i of the block (i < n_valid) attends to every valid cache row (they are all older
than the block) and to block rows j ≤ i (causal inside the block). Rows i ≥ n_valid are padding:
their output is zero. Numerically a two-pass softmax per (query head, row): scores into a
local buffer, then max, exp-sum and the weighted sum of V. GQA: query head h reads KV head
h // (Hq / H).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import check_dtype


def build_block_attention_kernel(num_q_heads: int, num_kv_heads: int, budget: int, block: int,
                                 head_dim: int, sm_scale: float, dtype: str = "float32"):
    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    G = Hq // H
    scale = float(sm_scale)
    # q·k as LANES independent partial sums (vectorisable; LLVM will not reorder a float
    # reduction by itself), summed at the end: a different but fixed summation order.
    LANES = 16 if D % 16 == 0 else (8 if D % 8 == 0 else 1)
    CH = D // LANES

    @T.prim_func(private=True, s_tir=True)
    def block_attention(
        q: T.Buffer((1, Hq, B, D), "float32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        fill: T.Buffer((1,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        out: T.Buffer((1, Hq, B, D), "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        for hi in T.parallel(Hq * B):
            with T.sblock("attn"):
                s = T.sblock_alloc_buffer((N + B,), "float32")
                acc = T.sblock_alloc_buffer((D,), "float32")
                red = T.sblock_alloc_buffer((1,), "float32")
                part = T.sblock_alloc_buffer((LANES,), "float32")
                mx = T.sblock_alloc_buffer((1,), "float32")
                tot = T.sblock_alloc_buffer((1,), "float32")
                h: T.let[T.int32] = hi // B
                i: T.let[T.int32] = hi % B
                kh: T.let[T.int32] = h // G
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                if i < nv:
                    mx[0] = T.float32(-3.0e38)
                    for j in T.serial(N):
                        if j < nf:
                            for l in T.vectorized(LANES):
                                part[l] = T.float32(0)
                            for c0 in T.serial(CH):
                                for l in T.vectorized(LANES):
                                    part[l] = part[l] + q[0, h, i, c0 * LANES + l] * k_cache[kh, j, c0 * LANES + l]
                            red[0] = T.float32(0)
                            for l in T.serial(LANES):
                                red[0] = red[0] + part[l]
                            s[j] = red[0] * T.float32(scale)
                            mx[0] = T.max(mx[0], s[j])
                    for j in T.serial(B):
                        if j <= i:
                            for l in T.vectorized(LANES):
                                part[l] = T.float32(0)
                            for c0 in T.serial(CH):
                                for l in T.vectorized(LANES):
                                    part[l] = part[l] + q[0, h, i, c0 * LANES + l] * k_blk[0, kh, j, c0 * LANES + l]
                            red[0] = T.float32(0)
                            for l in T.serial(LANES):
                                red[0] = red[0] + part[l]
                            s[N + j] = red[0] * T.float32(scale)
                            mx[0] = T.max(mx[0], s[N + j])
                    tot[0] = T.float32(0)
                    for c in T.serial(D):
                        acc[c] = T.float32(0)
                    for j in T.serial(N):
                        if j < nf:
                            s[j] = T.exp(s[j] - mx[0])
                            tot[0] = tot[0] + s[j]
                            for c in T.vectorized(D):
                                acc[c] = acc[c] + s[j] * v_cache[kh, j, c]
                    for j in T.serial(B):
                        if j <= i:
                            s[N + j] = T.exp(s[N + j] - mx[0])
                            tot[0] = tot[0] + s[N + j]
                            for c in T.vectorized(D):
                                acc[c] = acc[c] + s[N + j] * v_blk[0, kh, j, c]
                    for c in T.serial(D):
                        out[0, h, i, c] = acc[c] / tot[0]
                else:
                    for c in T.serial(D):
                        out[0, h, i, c] = T.float32(0)

    return block_attention
