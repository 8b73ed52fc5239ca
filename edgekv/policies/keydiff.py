"""`keydiff` — KeyDiff (Park et al., Qualcomm AI Research, arXiv 2504.15364).

Definition. Per layer and per KV head, over the n candidates (cache ⊕ block):

    k̂_i  = k_i / ‖k_i‖                     (L2-normalised keys)
    μ     = mean_i k̂_i                      ("anchor": mean of the normalised candidate keys)
    s_i   = −cos(μ, k_i)                     (score: high = distinctive)
    keep  = TopK(s, N)                        (ties → the older candidate, see ``topk_keep``)

Values never enter the score; they follow their keys. Queries and attention weights are not
used, so the policy needs no materialised attention (works with fused/SDPA kernels). The
ranking equals that of the exact pairwise form s_i = −Σ_j cos(k_i, k_j) (paper Eq. 7 vs Eq. 8:
−S·1 = n‖μ‖·s), which the tests check.

Defaults (the paper's): no sinks, no recent window (``recent_window=0``).
``recent_window`` is the appendix variant "KeyDiff + 10 % / 20 % recent tokens": a value
in (0, 1) is a fraction of the budget N (⌊f·N⌋ entries), a value ≥ 1 is a token count. The
reserved entries are the most recent positions (score +inf); the other N − w slots are
filled by KeyDiff score, with the anchor still taken over all n candidates.

Block-wise adaptation. This *is* the paper's setting (block prompt processing, B = 128,
fixed N per layer/KV head, decode = B = 1): the anchor is recomputed at every eviction from
the current n = |cache| + |block| candidate keys; it is not a running mean.

Deviations / choices the paper leaves open: scores are computed in fp32 whatever the cache
dtype; an ``EPS`` guard (as in ``F.normalize``) makes zero keys and a zero anchor give score
0 instead of NaN; ties go to the lower candidate index (= older token); keys are the cached
post-RoPE keys; the recent-window mechanics (not described in the paper) are as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, protect_recent, topk_keep


def keydiff_scores(keys: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KeyDiff distinctiveness −cos(anchor, k_i) for keys [..., n, d] → [..., n] (fp32).

    anchor = mean over the n candidates of the L2-normalised keys, per leading index (head).
    Norms below ``eps`` are clamped to ``eps``, so a zero key or a zero anchor scores 0.
    """
    k = keys.float()
    k_hat = k / k.norm(dim=-1, keepdim=True).clamp_min(eps)
    anchor = k_hat.mean(dim=-2, keepdim=True)
    anchor_hat = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(eps)
    return -(k_hat * anchor_hat).sum(dim=-1)


def recent_count(recent_window: float, budget: int) -> int:
    """Entries reserved for the most recent tokens: ⌊f·N⌋ for a fraction f < 1, else the count."""
    if recent_window <= 0:
        return 0
    if recent_window < 1:
        return int(math.floor(recent_window * budget))
    return int(recent_window)


def build_keydiff_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                               dtype: str = "float32", recent: int = 0, eps: float = 1e-6):
    """TIR score kernel: the same definition as ``keydiff_scores``, in three parallel phases —
    (1) every candidate's clamped norm, parallel over (head, chunk of rows); (2) the anchor per
    head (mean of k_i / ‖k_i‖, normalised); (3) the scores, parallel over (head, chunk). With
    only H = 3 KV heads a per-head split leaves a core idle; the chunks keep two or more busy.
    Norms and dot products are 16-lane partial sums folded by a halving tree (vector ops, not
    a chain of 16 dependent scalar adds per row). The summation order differs from torch's, so
    scores differ in the last bits: on SmolLM2 (2K prompt, N = 1K, 240 eviction events, 737,280
    kept entries) one kept entry differed from ``topk_keep`` on the reference scores, a pair
    whose fp64 scores differ by 2.2e-7 relative — a near tie, allowed (< 1e-5 relative;
    docs/COMPILER.md)."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype, lane_tree_sum
    from ..compiler.kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    EPS = float(eps)
    W = int(recent)
    LANES = 16 if D % 16 == 0 else (8 if D % 8 == 0 else 1)
    CH = D // LANES
    RC = 64  # candidate rows per parallel task
    NCH = (NB + RC - 1) // RC
    lane_sum = lane_tree_sum(LANES)

    @T.macro
    def candidate(k_cache, k_blk, h, i, nf, kv):
        # candidate i: cache row i (i < fill) or block row i − fill
        for c in T.vectorized(D):
            kv[c] = T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.max(i - nf, 0), c])

    @T.macro
    def dot(x, y, part):
        for l in T.vectorized(LANES):
            part[l] = T.float32(0)
        for c0 in T.serial(CH):
            for l in T.vectorized(LANES):
                part[l] = part[l] + x[c0 * LANES + l] * y[c0 * LANES + l]
        lane_sum(part)

    @T.macro
    def keydiff_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        norm = T.alloc_buffer((H, NB), "float32")
        anchor = T.alloc_buffer((H, D), "float32")
        if fill[0] + n_valid[0] > N:
            for task in T.parallel(H * NCH):
                with T.sblock("keydiff_norms"):
                    T.reads(k_cache[0:H, 0:N, 0:D], k_blk[0, 0:H, 0:B, 0:D], fill[0:1], n_valid[0:1])
                    T.writes(norm[0:H, 0:NB])
                    kv = T.sblock_alloc_buffer((D,), "float32")
                    part = T.sblock_alloc_buffer((LANES,), "float32")
                    h: T.let[T.int32] = task // NCH
                    for r in T.serial(RC):
                        if (task % NCH) * RC + r < fill[0] + n_valid[0]:
                            candidate(k_cache, k_blk, h, (task % NCH) * RC + r, fill[0], kv)
                            dot(kv, kv, part)
                            norm[h, (task % NCH) * RC + r] = T.max(T.sqrt(part[0]), T.float32(EPS))
            for h in T.parallel(H):
                with T.sblock("keydiff_anchor"):
                    T.reads(k_cache[h, 0:N, 0:D], k_blk[0, h, 0:B, 0:D], norm[h, 0:NB], fill[0:1], n_valid[0:1])
                    T.writes(anchor[h, 0:D])
                    kv = T.sblock_alloc_buffer((D,), "float32")
                    part = T.sblock_alloc_buffer((LANES,), "float32")
                    for c in T.vectorized(D):
                        anchor[h, c] = T.float32(0)
                    for i in T.serial(NB):
                        if i < fill[0] + n_valid[0]:
                            candidate(k_cache, k_blk, h, i, fill[0], kv)
                            for c in T.vectorized(D):
                                anchor[h, c] = anchor[h, c] + kv[c] / norm[h, i]
                    for c in T.vectorized(D):
                        kv[c] = anchor[h, c] / T.Cast("float32", fill[0] + n_valid[0])
                    dot(kv, kv, part)
                    for c in T.vectorized(D):
                        anchor[h, c] = kv[c] / T.max(T.sqrt(part[0]), T.float32(EPS))
            for task in T.parallel(H * NCH):
                with T.sblock("keydiff_scores"):
                    T.reads(k_cache[0:H, 0:N, 0:D], k_blk[0, 0:H, 0:B, 0:D], norm[0:H, 0:NB], anchor[0:H, 0:D],
                            pos_cache[0:H, 0:N], pos_blk[0:B], fill[0:1], n_valid[0:1])
                    T.writes(score[0:H, 0:NB])
                    kv = T.sblock_alloc_buffer((D,), "float32")
                    av = T.sblock_alloc_buffer((D,), "float32")
                    part = T.sblock_alloc_buffer((LANES,), "float32")
                    h: T.let[T.int32] = task // NCH
                    nf: T.let[T.int32] = fill[0]
                    newest: T.let[T.int32] = pos_blk[T.max(n_valid[0] - 1, 0)]
                    for c in T.vectorized(D):
                        av[c] = anchor[h, c]
                    for r in T.serial(RC):
                        i: T.let[T.int32] = (task % NCH) * RC + r
                        if i < NB:
                            score[h, i] = T.float32("-inf")
                            if i < nf + n_valid[0]:
                                candidate(k_cache, k_blk, h, i, nf, kv)
                                for c in T.vectorized(D):
                                    kv[c] = kv[c] / norm[h, i]
                                dot(kv, av, part)
                                score[h, i] = T.float32(0) - part[0]
                                if W > 0:
                                    if T.if_then_else(i < nf, pos_cache[h, T.min(i, N - 1)],
                                                      pos_blk[T.max(i - nf, 0)]) > newest - W:
                                        score[h, i] = T.float32("inf")

    return score_kernel(StepShapes(H, N, B, D), keydiff_score)


def build_keydiff_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                   dtype: str = "float32", recent: int = 0, eps: float = 1e-6):
    """One thread block per KV head, NT threads. Pass 1: per tile of NT candidates each thread
    computes one row's norm (into shared memory), then thread (group, channel) pairs
    accumulate the normalised keys column-wise (coalesced); the per-group partial anchors are
    summed in shared memory and normalised. Pass 2: one thread per candidate, −k̂ · μ̂."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    EPS = float(eps)
    W = int(recent)
    NT = 128 if D <= 128 else D
    GR = max(1, NT // D)  # row groups in the column pass
    TILES = (NB + NT - 1) // NT

    @T.macro
    def keydiff_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("keydiff"):
                    T.reads()
                    T.writes()
                    inv_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    part_sh = T.sblock_alloc_buffer((GR, D), "float32", scope="shared")
                    anchor_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = nf + nv
                    grp: T.let[T.int32] = tx // D
                    ch: T.let[T.int32] = tx % D
                    if n > N:
                        red[1] = T.float32(0)  # this thread's partial anchor for channel ch
                        for it in T.serial((n + NT - 1) // NT):
                            # norm of candidate it*NT + tx
                            red[0] = T.float32(0)
                            if it * NT + tx < n:
                                for c in T.serial(D):
                                    red[0] = red[0] + T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c]) * T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c])
                            inv_sh[tx] = T.max(T.sqrt(red[0]), T.float32(EPS))
                            T.tvm_storage_sync("shared")
                            if grp < GR:
                                for r in T.serial((NT + GR - 1) // GR):
                                    if r * GR + grp < NT:
                                        if it * NT + r * GR + grp < n:
                                            red[1] = red[1] + T.if_then_else(
                                                it * NT + r * GR + grp < nf,
                                                k_cache[h, T.min(it * NT + r * GR + grp, N - 1), ch],
                                                k_blk[0, h, T.min(T.max(it * NT + r * GR + grp - nf, 0), B - 1), ch]
                                            ) / inv_sh[r * GR + grp]
                            T.tvm_storage_sync("shared")
                        if grp < GR:
                            part_sh[grp, ch] = red[1]
                        T.tvm_storage_sync("shared")
                        if tx < D:
                            red[1] = T.float32(0)
                            for gg in T.serial(GR):
                                red[1] = red[1] + part_sh[gg, tx]
                            anchor_sh[tx] = red[1] / T.Cast("float32", n)
                        T.tvm_storage_sync("shared")
                        red[0] = T.float32(0)
                        for c in T.serial(D):
                            red[0] = red[0] + anchor_sh[c] * anchor_sh[c]
                        red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                        T.tvm_storage_sync("shared")
                        if tx < D:
                            anchor_sh[tx] = anchor_sh[tx] / red[0]
                        T.tvm_storage_sync("shared")
                        for it in T.serial(TILES):
                            if it * NT + tx < n:
                                red[0] = T.float32(0)
                                for c in T.serial(D):
                                    red[0] = red[0] + T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c]) * T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c])
                                red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                red[1] = T.float32(0)
                                for c in T.serial(D):
                                    red[1] = red[1] - (T.if_then_else(
                                        it * NT + tx < nf, k_cache[h, T.min(it * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(it * NT + tx - nf, 0), B - 1), c]) / red[0]) * anchor_sh[c]
                                if W > 0:
                                    if T.if_then_else(it * NT + tx < nf, pos_cache[h, T.min(it * NT + tx, N - 1)],
                                                      pos_blk[T.min(T.max(it * NT + tx - nf, 0), B - 1)]) > pos_blk[
                                                          T.max(nv - 1, 0)] - W:
                                        red[1] = T.float32("inf")
                                score[h, it * NT + tx] = red[1]
                            elif it * NT + tx < NB:
                                score[h, it * NT + tx] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, B, D), keydiff_score_gpu, gpu=True)


@dataclass
class KeyDiffPolicy(Policy):
    name = "keydiff"
    summary = "KeyDiff: keeps the keys least similar to their mean (the most diverse); no attention scores needed"
    evict_kernel = staticmethod(build_keydiff_evict_kernel)
    gpu_evict_kernel = staticmethod(build_keydiff_evict_kernel_gpu)
    # Guard for zero-norm keys / a zero anchor (not a paper parameter, hence not a field).
    EPS = 1e-6

    # Share of the budget reserved for the most recent tokens: a fraction in (0, 1) of N, or a
    # count ≥ 1. Paper default 0 (off); the appendix variants use 0.1 and 0.2.
    recent_window: float = 0.0

    def check_budget(self, budget: int, block: int) -> None:
        if self.recent_window < 0 or math.isnan(self.recent_window):
            raise PolicyError(
                "keydiff: recent_window must be ≥ 0 (a fraction of the budget such as 0.1, "
                "or a token count such as 256; 0 turns it off)"
            )
        if self.recent_window >= 1 and self.recent_window != int(self.recent_window):
            raise PolicyError(
                f"keydiff: recent_window={self.recent_window} is neither a fraction (< 1) nor a "
                "whole token count; use e.g. 0.1 or 256"
            )
        w = recent_count(self.recent_window, budget)
        if w > budget:
            raise PolicyError(
                f"keydiff: recent_window reserves {w} entries but the budget is {budget}; "
                f"use recent_window ≤ {budget} (or a fraction such as 0.1)"
            )

    def kernel_params(self, budget: int) -> dict:
        return {"recent": recent_count(float(self.recent_window), budget), "eps": float(self.EPS)}

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: −cos(anchor, k_i), with the recent window (if any) pinned to +inf."""
        score = keydiff_scores(ctx.keys, self.EPS)
        w = recent_count(self.recent_window, ctx.budget)
        return protect_recent(score, ctx.positions, w)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
