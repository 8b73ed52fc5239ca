"""LagKV's compiled face (``edgekv/policies/lagkv.py``): its score kernel, CPU and GPU."""

from __future__ import annotations

from .face import PolicyKernels


def _base_score_macro():
    """``base_score(score, h, i, start, scored_end, n)``, shared by the CPU and GPU kernels: the score
    of candidate i before the partitions are ranked — sinks +inf, scored partitions 0 (their ranks
    are added), the unscored tail 2 + i/n (kept, newest highest), padding past n −inf."""
    from tvm.script import tirx as T

    @T.macro
    def base_score(score, h, i, start, scored_end, n):
        if i < start:
            score[h, i] = T.float32("inf")
        elif i < scored_end:
            score[h, i] = T.float32(0)
        elif i < n:
            score[h, i] = T.float32(2) + T.Cast("float32", i) / T.Cast("float32", n)
        else:
            score[h, i] = T.float32("-inf")

    return base_score


def build_lagkv_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                             dtype: str = "float32", sinks: int = 16, lag: int = 128,
                             value_weight: float = 1.0, unbiased_std: bool = True, eps: float = 1e-6):
    """TIR score kernel: the same definition as ``LagKVPolicy.score``; cost O(n·(L + d)) per
    head (the in-partition rank is O(L²) per partition)."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S, L = int(sinks), int(lag)
    WV = float(value_weight)
    EPS = float(eps)
    DDOF = float(D - 1) if (unbiased_std and D > 1) else float(D)
    base_score = _base_score_macro()

    @T.macro
    def lagkv_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
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
                        base_score(score, h, i, start, scored_end, n)
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

    return score_kernel(StepShapes(H, N, B, D), lagkv_score)


def build_lagkv_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                 dtype: str = "float32", sinks: int = 16, lag: int = 128,
                                 value_weight: float = 1.0, unbiased_std: bool = True, eps: float = 1e-6):
    """Two launches. (1) elementwise over (head, candidate): sinks +inf, tail 2 + i/n, beyond n
    −inf, scored partitions 0. (2) one thread block per (head, partition p): threads over
    channels find partition p+1's per-channel min/max (shared), threads over tokens take the
    std of each min-max-normalised token, softmax over the L tokens (shared), K then V
    accumulated into raw (shared), and each token's rank inside the partition is its score."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S, L = int(sinks), int(lag)
    WV = float(value_weight)
    EPS = float(eps)
    DDOF = float(D - 1) if (unbiased_std and D > 1) else float(D)
    base_score = _base_score_macro()
    TPB = 128
    NBLK = (H * NB + TPB - 1) // TPB
    PMAX = max(1, (NB - min(S, NB)) // L - 1)  # most scored partitions any step can have
    NT = 128
    TPT = (L + NT - 1) // NT  # tokens per thread
    CPT = (D + NT - 1) // NT  # channels per thread

    @T.macro
    def lagkv_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                with T.sblock("lagkv_base"):
                    T.reads()
                    T.writes()
                    e: T.let[T.int32] = bx * TPB + tx
                    h: T.let[T.int32] = e // NB
                    i: T.let[T.int32] = e % NB
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    start: T.let[T.int32] = T.min(S, n)
                    P: T.let[T.int32] = (n - start) // L
                    scored_end: T.let[T.int32] = T.if_then_else(P >= 2, start + (P - 1) * L, start)
                    if e < H * NB:
                        if n > N:
                            base_score(score, h, i, start, scored_end, n)
        for bx in T.thread_binding(H * PMAX, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("lagkv_part"):
                    T.reads()
                    T.writes()
                    lo_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    hi_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    part_sh = T.sblock_alloc_buffer((L,), "float32", scope="shared")
                    raw_sh = T.sblock_alloc_buffer((L,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    better = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    h: T.let[T.int32] = bx // PMAX
                    p: T.let[T.int32] = bx % PMAX
                    nf: T.let[T.int32] = fill[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    start: T.let[T.int32] = T.min(S, n)
                    P: T.let[T.int32] = (n - start) // L
                    if n > N:
                        if p < P - 1:
                            for u in T.serial(TPT):
                                if u * NT + tx < L:
                                    raw_sh[u * NT + tx] = T.float32(0)
                            for z in T.serial(2):
                                # per-channel range of the reference partition p + 1
                                for u in T.serial(CPT):
                                    if u * NT + tx < D:
                                        acc[0] = T.float32("inf")
                                        acc[1] = T.float32("-inf")
                                        for t in T.serial(L):
                                            acc[2] = T.if_then_else(
                                                z == 0,
                                                T.if_then_else(start + (p + 1) * L + t < nf,
                                                               k_cache[h, T.min(start + (p + 1) * L + t, N - 1), u * NT + tx],
                                                               k_blk[0, h, T.min(T.max(start + (p + 1) * L + t - nf, 0), B - 1), u * NT + tx]),
                                                T.if_then_else(start + (p + 1) * L + t < nf,
                                                               v_cache[h, T.min(start + (p + 1) * L + t, N - 1), u * NT + tx],
                                                               v_blk[0, h, T.min(T.max(start + (p + 1) * L + t - nf, 0), B - 1), u * NT + tx]))
                                            acc[0] = T.min(acc[0], acc[2])
                                            acc[1] = T.max(acc[1], acc[2])
                                        lo_sh[u * NT + tx] = acc[0]
                                        hi_sh[u * NT + tx] = acc[1]
                                T.tvm_storage_sync("shared")
                                # std over channels of each normalised token of partition p
                                for u in T.serial(TPT):
                                    if u * NT + tx < L:
                                        acc[0] = T.float32(0)
                                        for c in T.serial(D):
                                            acc[0] = acc[0] + (T.if_then_else(
                                                z == 0,
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               k_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               k_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]),
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               v_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               v_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]))
                                                - lo_sh[c]) / T.max(hi_sh[c] - lo_sh[c], T.float32(EPS))
                                        acc[0] = acc[0] / T.float32(D)
                                        acc[1] = T.float32(0)
                                        for c in T.serial(D):
                                            acc[2] = (T.if_then_else(
                                                z == 0,
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               k_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               k_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]),
                                                T.if_then_else(start + p * L + u * NT + tx < nf,
                                                               v_cache[h, T.min(start + p * L + u * NT + tx, N - 1), c],
                                                               v_blk[0, h, T.min(T.max(start + p * L + u * NT + tx - nf, 0), B - 1), c]))
                                                - lo_sh[c]) / T.max(hi_sh[c] - lo_sh[c], T.float32(EPS))
                                            acc[1] = acc[1] + (acc[2] - acc[0]) * (acc[2] - acc[0])
                                        part_sh[u * NT + tx] = T.sqrt(acc[1] / T.float32(DDOF))
                                T.tvm_storage_sync("shared")
                                # softmax over the L tokens (each thread reduces the same values)
                                acc[3] = T.float32("-inf")
                                for t in T.serial(L):
                                    acc[3] = T.max(acc[3], part_sh[t])
                                acc[0] = T.float32(0)
                                for t in T.serial(L):
                                    acc[0] = acc[0] + T.exp(part_sh[t] - acc[3])
                                for u in T.serial(TPT):
                                    if u * NT + tx < L:
                                        raw_sh[u * NT + tx] = raw_sh[u * NT + tx] + T.if_then_else(
                                            z == 0, T.float32(1), T.float32(WV)) * (
                                                T.exp(part_sh[u * NT + tx] - acc[3]) / acc[0])
                                T.tvm_storage_sync("shared")
                            # rank inside the partition: (L - 1 - #better) / L
                            for u in T.serial(TPT):
                                if u * NT + tx < L:
                                    better[0] = 0
                                    acc[0] = raw_sh[u * NT + tx]
                                    for w in T.serial(L):
                                        acc[1] = raw_sh[w]
                                        if acc[1] > acc[0]:
                                            better[0] = better[0] + 1
                                        elif acc[1] == acc[0]:
                                            if w < u * NT + tx:
                                                better[0] = better[0] + 1
                                    score[h, start + p * L + u * NT + tx] = T.Cast("float32", L - 1 - better[0]) / T.float32(L)

    return score_kernel(StepShapes(H, N, B, D), lagkv_score_gpu, gpu=True)



def lagkv_kernel_params(policy, budget: int) -> dict:
    return {"sinks": int(policy.sinks), "lag": int(policy.resolve_lag(budget)), "value_weight": float(policy.value_weight),
            "unbiased_std": bool(policy.unbiased_std), "eps": float(policy.EPS)}


KERNELS = PolicyKernels(
    evict_kernel=build_lagkv_evict_kernel,
    gpu_evict_kernel=build_lagkv_evict_kernel_gpu,
    kernel_params=lagkv_kernel_params,
)
