"""`lagkv` — LagKV (Liang et al., China Merchants Bank AI Lab, arXiv 2504.04704).

Definition. Per layer and per KV head, the candidates (cache ⊕ block, in temporal order)
are laid out as in the paper, starting after S sink entries:

    [ sinks 0..S-1 | partition 0 | partition 1 | … | partition P-2 | tail ]
                     └────────── scored, L entries each ───────────┘  └ last full partition
                                                                         + remainder: L … 2L−1

With P = ⌊(n − S)/L⌋ full partitions of lag size L, partition p is scored against the next
one, p+1 (its "lag" reference), separately for Z = K and Z = V:

    lo, hi  = per-channel min / max of Z over the L tokens of partition p+1
    Z̄       = (Z_p − lo) / max(hi − lo, ε)          (ε: documented deviation, see below)
    s_Z     = softmax over the L tokens of p of std_channels(Z̄)   (unbiased std, as the
              official code; the paper names neither estimator nor axis)
    s       = s_K + value_weight · s_V               (official code: score_v_ratio = 1)

High s = the token is not coherent with the next chunk = keep. Sinks and the tail are never
evicted while the budget allows. No queries or attention weights are used.

Mapping the paper's ratio to edgekv's fixed budget N (the RULER / KVPress way, paper Eq. 13:
"the retention ratio of each window adapts to the target size"): at every eviction event
the whole candidate set is compressed once, exactly like KVPress ``LagKVPress`` with
``n_kept = N``. Each scored token's selection score is its normalised rank inside its
partition, (rank ascending)/L ∈ [0, 1); sinks get +inf and the tail a recency score in
(2, 3); then the global top-N is kept. Equal ranks across partitions split the evictions
evenly over the scored partitions (±1, extra slots to the older partitions by the lower-index
tie rule), i.e. every partition keeps ⌊r·L⌋ or ⌈r·L⌉ with r = (N − S − |tail|)/(n − S − |tail|).
If n − S < 2L (no partition has a reference) the policy falls back to sinks + most recent,
as KVPress does.

Defaults. ``sinks = 16`` (paper ablations and official code; KVPress uses 4).
``lag = 0`` means auto: L = min(1024, N // 8), at least 1 and at most (N − S)/2. This gives
the paper's default L = 1024 at N = 8K, KVPress's/RULER's L = 128 at N = 1K, 16 at N = 128;
the protected tail is then 12.5–25 % of N, and N ≥ S + 2L always holds, so the tail never
crowds out the scored entries. An explicit ``lag`` must satisfy N ≥ sinks + 2·lag.
``value_weight = 1.0``, ``unbiased_std = True`` (official code).

Block-wise adaptation / deviations. (1) Re-scoring: the paper never re-scores its
compressed region, whose size then grows with the sequence; a fixed N forces re-eviction,
so earlier survivors are re-partitioned (L consecutive survivors per partition) and
re-scored at every event. In decode (n = N + 1) the evicted entry is the lowest-ranked one
of the newest scored partition (the one just leaving the tail), like the paper's recursion.
(2) ε = 1e-6 clamps the per-channel range: the paper divides by max − min, which gives
inf/NaN for a constant reference channel. (3) Scores are computed in fp32. (4) Ties go to the
lower candidate index (older entry). (5) The tail is over budget only when N < S + 2L
(refused by ``check_budget``); ``select`` then keeps its newest entries first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, topk_keep

PAPER_LAG = 1024  # official code default (``lag_size=1024``); cap of the auto lag


def lag_chunk_scores(z: torch.Tensor, lag: int, unbiased: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Paper Eq. 7–10 for one of K or V: z [..., P·L, d] with P ≥ 2 → [..., P−1, L] (fp32).

    Partition p (of P−1 scored ones) is min-max normalised per channel by partition p+1,
    reduced to the std over channels per token, and softmaxed over its L tokens.
    """
    d = z.shape[-1]
    zp = z.float().unflatten(-2, (-1, lag))  # [..., P, L, d]
    cur, ref = zp[..., :-1, :, :], zp[..., 1:, :, :]
    lo = ref.amin(dim=-2, keepdim=True)
    hi = ref.amax(dim=-2, keepdim=True)
    z_bar = (cur - lo) / (hi - lo).clamp_min(eps)
    std = z_bar.std(dim=-1, correction=1 if (unbiased and d > 1) else 0)
    return std.softmax(dim=-1)


def within_partition_rank(raw: torch.Tensor) -> torch.Tensor:
    """[..., L] scores → normalised ascending rank / L ∈ [0, 1); equal scores rank the lower
    index higher (the tie rule of ``topk_keep``)."""
    L = raw.shape[-1]
    order = torch.sort(raw, dim=-1, descending=True, stable=True).indices  # best first
    pos = torch.empty_like(order)
    pos.scatter_(-1, order, torch.arange(L, device=raw.device).expand_as(order))
    return (L - 1 - pos).float() / L


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

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes, score_kernel

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

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes, score_kernel

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


@dataclass
class LagKVPolicy(Policy):
    name = "lagkv"
    summary = "LagKV: scores each partition of tokens against the next one's min/max statistics; no attention scores"
    evict_kernel = staticmethod(build_lagkv_evict_kernel)
    gpu_evict_kernel = staticmethod(build_lagkv_evict_kernel_gpu)
    EPS = 1e-6  # guard on the per-channel range max − min (not a paper parameter)

    # First entries that are never evicted (attention sinks). Paper / official code: 16.
    sinks: int = 16
    # Lag size L (tokens per partition). 0 = auto: min(1024, N // 8), at most (N − sinks) / 2.
    lag: int = 0
    # Weight of the value score: s = s_K + value_weight · s_V. Official code: 1.0.
    value_weight: float = 1.0
    # Unbiased std over channels (divide by d − 1), as torch's default in the official code.
    unbiased_std: bool = True

    def resolve_lag(self, budget: int) -> int:
        if self.lag > 0:
            return int(self.lag)
        return max(1, min(PAPER_LAG, budget // 8, (budget - self.sinks) // 2))

    def kernel_params(self, budget: int) -> dict:
        return {"sinks": int(self.sinks), "lag": int(self.resolve_lag(budget)), "value_weight": float(self.value_weight),
                "unbiased_std": bool(self.unbiased_std), "eps": float(self.EPS)}

    def check_budget(self, budget: int, block: int) -> None:
        if self.sinks < 0:
            raise PolicyError("lagkv: sinks must be ≥ 0 (e.g. --policy-arg sinks=16)")
        if self.lag < 0:
            raise PolicyError("lagkv: lag must be ≥ 0 (0 = automatic: min(1024, budget // 8))")
        if not self.value_weight >= 0:
            raise PolicyError("lagkv: value_weight must be ≥ 0 (1.0 = paper, 0 = keys only)")
        L = self.resolve_lag(budget)
        if budget < self.sinks + 2 * L:
            hint = (
                f"use --policy-arg lag={max(1, (budget - self.sinks) // 2)} or less, or lag=0 (automatic)"
                if self.lag > 0 and budget >= self.sinks + 2
                else f"use a budget of at least {self.sinks + 2 * L} or fewer sinks"
            )
            raise PolicyError(
                f"lagkv: budget {budget} cannot hold {self.sinks} sinks plus a tail of up to "
                f"2·lag − 1 = {2 * L - 1} entries and still choose any token; {hint}"
            )

    def raw_scores(self, ctx: EvictionContext) -> tuple[torch.Tensor, int, int]:
        """Paper score s = s_K + w·s_V of the scored partitions, [H, P−1, L] (fp32), plus the
        scored region [start, end). Empty [H, 0, L] when no partition has a reference."""
        n = ctx.n
        L = self.resolve_lag(ctx.budget)
        start = min(self.sinks, n)
        P = (n - start) // L
        if P < 2:
            return ctx.keys.new_zeros((ctx.num_kv_heads, 0, L), dtype=torch.float32), start, start
        stop = start + P * L
        s = lag_chunk_scores(ctx.keys[:, start:stop], L, self.unbiased_std, self.EPS)
        if self.value_weight != 0:
            s = s + self.value_weight * lag_chunk_scores(ctx.values[:, start:stop], L, self.unbiased_std, self.EPS)
        return s, start, start + (P - 1) * L

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] selection score: sinks +inf, tail (and everything when nothing is scorable)
        2 + i/n (newer higher), scored entries their within-partition rank / L ∈ [0, 1)."""
        H, n = ctx.num_kv_heads, ctx.n
        idx = torch.arange(n, device=ctx.keys.device, dtype=torch.float32)
        score = (2.0 + idx / n).expand(H, n).clone()
        raw, start, end = self.raw_scores(ctx)
        score[:, :start] = float("inf")
        if end > start:
            score[:, start:end] = within_partition_rank(raw).reshape(H, end - start)
        return score

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
