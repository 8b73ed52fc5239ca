"""RocketKV's compiled face (``edgekv/policies/rocketkv.py``): stage 1 is SnapKV++'s score kernel and
the generic select; then the summaries kernel (``emit_after_select``), and stage 2 replaces the
decode function's attention (``emit_decode_attention``). No GPU versions yet (a GPU target is
refused, saying so)."""

from __future__ import annotations

import math

import torch

from ...policies.rocketkv import Stage2Plan, stage2_plan
from .face import PolicyKernels
from .snapkv_pp import build_snapkvpp_evict_kernel, snapkvpp_kernel_params

# ---- compiled stage 2 -------------------------------------------------------------------------
# The compiled model keeps each layer's summaries as cache state (``compiled_state``):
#   rk_kmin, rk_kmax  [H, d, ⌈(N + 1)/p⌉] float32   page-wise min / max of the cached keys, channel-major;
# a page is valid once its first row is written (that row sets it, later rows fold in), so the
# tensors start as zeros and pages past ``fill`` are never read. After every step's select the
# summaries kernel rebuilds every page when the cache is full (an eviction may have moved rows; the
# eager engine rebuilds only after an actual eviction — the same rows give the same values) and
# otherwise folds in the rows the step appended; the decode step's attention folds its new token
# into that token's page on the fly (it is not in the cache yet), as the eager engine does. The token
# weights are summed page by page (eager: token by token), so near-ties may order differently.


LANES = 16  # fp32 lanes of one AVX-512 register: the vector width of the stage-2 kernels' inner loops


def summary_pages(budget: int, page: int) -> int:
    """Summary columns: pages of p rows over the N cache rows and a decode step's new row, rounded up
    to whole vectors (the page scores run LANES pages at a time; the extra columns are never read)."""
    return -(-math.ceil((budget + 1) / page) // LANES) * LANES


def summary_shape(num_kv_heads: int, budget: int, head_dim: int, params: dict) -> tuple[int, int, int]:
    """[H, d, pages] (``summary_pages``)."""
    return num_kv_heads, head_dim, summary_pages(budget, int(params["page"]))


def build_rocketkv_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                                *, traffic: int, page: int, channels: int, topk: int, **stage1):
    """Stage 1's score kernel: SnapKV++'s (the stage-2 settings are for the decode attention)."""
    return build_snapkvpp_evict_kernel(num_kv_heads, budget, block, head_dim, dtype, **stage1)


def _lanes(d: int) -> int:
    return LANES if d % LANES == 0 else (8 if d % 8 == 0 else 1)


def build_rocketkv_summaries_kernel(num_kv_heads: int, budget: int, head_dim: int, block: int, page: int):
    """``(k_cache, fill, n_valid, kmin, kmax)``, in place on kmin / kmax, after the step's select:
    with the cache full (fill = N) every page is rebuilt from rows [0, N) — key rows are read whole,
    min / max kept per channel as vectors, then written into the page's column; otherwise nothing
    was evicted and the step's appended rows [fill − n_valid, fill) are folded into their pages."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    H, N, D, B, p = num_kv_heads, budget, head_dim, block, int(page)
    P = summary_pages(N, p)
    FULL = math.ceil(N / p)  # pages holding the N rows of a full cache
    LD = _lanes(D)

    @T.prim_func(private=True, s_tir=True)
    def rocketkv_summaries(k_cache: T.Buffer((H, N, D), "float32"), fill: T.Buffer((1,), "int32"),
                           n_valid: T.Buffer((1,), "int32"), kmin: T.Buffer((H, D, P), "float32"),
                           kmax: T.Buffer((H, D, P), "float32")):
        T.func_attr({"tirx.noalias": True})
        for h in T.parallel(H):
            with T.sblock("rocketkv_summaries"):
                T.reads(k_cache[h, 0:N, 0:D], fill[0:1], n_valid[0:1])
                T.writes(kmin[h, 0:D, 0:P], kmax[h, 0:D, 0:P])
                lo = T.sblock_alloc_buffer((LANES, D), "float32")
                hi = T.sblock_alloc_buffer((LANES, D), "float32")
                if fill[0] == N:
                    # LANES pages at a time: whole key rows in, then every channel's LANES page values
                    # out as one vector store (a channel's pages are one row of the summaries)
                    for j0 in T.serial(P // LANES):
                        if j0 * LANES < FULL:
                            for l in T.serial(LANES):
                                for c0 in T.serial(D // LD):  # pages past the rows: empty, as the eager ones
                                    for v in T.vectorized(LD):
                                        lo[l, c0 * LD + v] = T.float32("inf")
                                        hi[l, c0 * LD + v] = T.float32("-inf")
                                if j0 * LANES + l < FULL:
                                    for c0 in T.serial(D // LD):
                                        for v in T.vectorized(LD):
                                            lo[l, c0 * LD + v] = k_cache[h, (j0 * LANES + l) * p, c0 * LD + v]
                                            hi[l, c0 * LD + v] = k_cache[h, (j0 * LANES + l) * p, c0 * LD + v]
                                    for i in T.serial(p - 1):
                                        if (j0 * LANES + l) * p + 1 + i < N:
                                            for c0 in T.serial(D // LD):
                                                for v in T.vectorized(LD):
                                                    lo[l, c0 * LD + v] = T.min(lo[l, c0 * LD + v], k_cache[
                                                        h, (j0 * LANES + l) * p + 1 + i, c0 * LD + v])
                                                    hi[l, c0 * LD + v] = T.max(hi[l, c0 * LD + v], k_cache[
                                                        h, (j0 * LANES + l) * p + 1 + i, c0 * LD + v])
                            for c in T.serial(D):
                                for l in T.vectorized(LANES):
                                    kmin[h, c, j0 * LANES + l] = lo[l, c]
                                    kmax[h, c, j0 * LANES + l] = hi[l, c]
                else:
                    for i in T.serial(B):
                        if i < n_valid[0]:
                            row: T.let[T.int32] = fill[0] - n_valid[0] + i  # the i-th appended row
                            for c in T.serial(D):
                                if row % p == 0:  # the page's first row sets it
                                    kmin[h, c, row // p] = k_cache[h, row, c]
                                    kmax[h, c, row // p] = k_cache[h, row, c]
                                else:
                                    kmin[h, c, row // p] = T.min(kmin[h, c, row // p], k_cache[h, row, c])
                                    kmax[h, c, row // p] = T.max(kmax[h, c, row // p], k_cache[h, row, c])

    return rocketkv_summaries


def build_rocketkv_decode_attention_kernel(num_q_heads: int, num_kv_heads: int, budget: int, head_dim: int,
                                           sm_scale: float, *, page: int, channels: int, topk: int):
    """Stage 2 of one decode step: ``(q [1, Hq, 1, d], k_blk, v_blk [1, H, 1, d], k_cache, v_cache,
    fill, kmin, kmax) -> out [1, Hq, 1, d]`` over the n = fill + 1 candidates (cache rows, then the
    new token), per KV head: the r channels of largest Σ_g |q_g| (ties: the lower channel), page
    scores from the summaries — one contiguous summary row per chosen channel, LANES pages at a time
    (why the paper stores them channel-major); the new token's page gets its key folded in here —,
    each token's weight Σ_g softmax_g(z_g / τ_g) over the n tokens, the top k of them (``select``'s
    bisection: ties keep the older row, as ``topk_keep``), then exact softmax attention over those k
    rows only (gathered first, so K and V are read for them alone). With k ≥ n every row is kept:
    dense attention, as the eager engine runs it then."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.attention import vexp
    from ..kernels.common import lane_tree_sum
    from ..kernels.select import evicted_mask_macro

    Hq, H, N, D = num_q_heads, num_kv_heads, budget, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    G = Hq // H
    NB = N + 1
    NBV = -(-NB // LANES) * LANES  # the kept rows' logits, padded to whole vectors
    p, R, K = int(page), int(channels), int(topk)
    P = summary_pages(N, p)
    LD = _lanes(D)
    scale = float(sm_scale)
    TINY = float(torch.finfo(torch.float32).tiny)
    EPS = float(torch.finfo(torch.float32).eps)
    mark_dropped = evicted_mask_macro(NB)
    lane_sum = lane_tree_sum(LD)

    @T.prim_func(private=True, s_tir=True)
    def rocketkv_decode_attention(q: T.Buffer((1, Hq, 1, D), "float32"), k_blk: T.Buffer((1, H, 1, D), "float32"),
                                  v_blk: T.Buffer((1, H, 1, D), "float32"), k_cache: T.Buffer((H, N, D), "float32"),
                                  v_cache: T.Buffer((H, N, D), "float32"), fill: T.Buffer((1,), "int32"),
                                  kmin: T.Buffer((H, D, P), "float32"), kmax: T.Buffer((H, D, P), "float32"),
                                  out: T.Buffer((1, Hq, 1, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        weight = T.alloc_buffer((H, NB), "float32")
        for h in T.parallel(H):
            with T.sblock("rocketkv_decode"):
                T.reads(q[0, h * G:h * G + G, 0, 0:D], k_blk[0, h, 0, 0:D], v_blk[0, h, 0, 0:D],
                        k_cache[h, 0:N, 0:D], v_cache[h, 0:N, 0:D], fill[0:1], kmin[h, 0:D, 0:P], kmax[h, 0:D, 0:P])
                T.writes(out[0, h * G:h * G + G, 0, 0:D], weight[h, 0:NB])
                magnitude = T.sblock_alloc_buffer((D,), "float32")
                direction = T.sblock_alloc_buffer((D,), "float32")
                chosen = T.sblock_alloc_buffer((R,), "int32")
                taken = T.sblock_alloc_buffer((D,), "int32")
                z = T.sblock_alloc_buffer((P,), "float32")
                page_weight = T.sblock_alloc_buffer((P,), "float32")
                kept = T.sblock_alloc_buffer((NB,), "int32")  # the kept rows' candidate indices
                logit = T.sblock_alloc_buffer((NBV,), "float32")
                krow = T.sblock_alloc_buffer((D,), "float32")
                acc = T.sblock_alloc_buffer((D,), "float32")
                part = T.sblock_alloc_buffer((LD,), "float32")
                red = T.sblock_alloc_buffer((4,), "float32")  # scratch: sums, running max, τ
                key = T.sblock_alloc_buffer((NB,), "int32")
                dropped = T.sblock_alloc_buffer((NB,), "int32")
                lo = T.sblock_alloc_buffer((1,), "int64")
                hi = T.sblock_alloc_buffer((1,), "int64")
                cnt = T.sblock_alloc_buffer((1,), "int32")
                best = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + 1
                pages: T.let[T.int32] = (fill[0] + p) // p  # ⌈n / p⌉
                chunks: T.let[T.int32] = (pages + LANES - 1) // LANES
                newest: T.let[T.int32] = fill[0] // p  # the new token's page
                for c in T.serial(NB):
                    dropped[c] = 0
                if K < n:
                    # channels: the R largest Σ_g |q_g| (a stable descending pick), and the group's sign
                    for c in T.serial(D):
                        magnitude[c] = T.float32(0)
                        direction[c] = T.float32(0)
                        taken[c] = 0
                        for g in T.serial(G):
                            magnitude[c] = magnitude[c] + T.fabs(q[0, h * G + g, 0, c])
                            direction[c] = direction[c] + q[0, h * G + g, 0, c]
                    for t in T.serial(R):
                        best[0] = -1
                        for c in T.serial(D):
                            if taken[c] == 0:
                                if best[0] < 0:
                                    best[0] = c
                                elif magnitude[c] > magnitude[best[0]]:
                                    best[0] = c
                        chosen[t] = best[0]
                        taken[best[0]] = 1
                    for j0 in T.serial(P // LANES):
                        for l in T.vectorized(LANES):
                            page_weight[j0 * LANES + l] = T.float32(0)
                    for g in T.serial(G):
                        # τ_g = sqrt(d · ‖q_g[I]‖₁ / ‖q_g‖₁) (SparQ's temperature)
                        red[0] = T.float32(0)
                        red[1] = T.float32(0)
                        for c in T.serial(D):
                            red[0] = red[0] + T.fabs(q[0, h * G + g, 0, c])
                        for t in T.serial(R):
                            red[1] = red[1] + T.fabs(q[0, h * G + g, 0, chosen[t]])
                        red[3] = T.max(T.sqrt(T.float32(D) * (red[1] / T.max(red[0], T.float32(TINY)))),
                                       T.float32(EPS))
                        # z_g[page] = Σ_{i∈I} q_g[i]·K̂[i, page]: the page max where the group's sign is
                        # positive, else the min
                        for j0 in T.serial(P // LANES):
                            for l in T.vectorized(LANES):
                                z[j0 * LANES + l] = T.float32(0)
                        for t in T.serial(R):
                            if direction[chosen[t]] > T.float32(0):
                                for j0 in T.serial(chunks):
                                    for l in T.vectorized(LANES):
                                        z[j0 * LANES + l] = z[j0 * LANES + l] + q[0, h * G + g, 0, chosen[t]] * kmax[
                                            h, chosen[t], j0 * LANES + l]
                            else:
                                for j0 in T.serial(chunks):
                                    for l in T.vectorized(LANES):
                                        z[j0 * LANES + l] = z[j0 * LANES + l] + q[0, h * G + g, 0, chosen[t]] * kmin[
                                            h, chosen[t], j0 * LANES + l]
                        # the new token's page, with its key folded in (alone when it opens the page)
                        red[0] = T.float32(0)
                        for t in T.serial(R):
                            red[0] = red[0] + q[0, h * G + g, 0, chosen[t]] * T.if_then_else(
                                nf % p == 0, k_blk[0, h, 0, chosen[t]],
                                T.if_then_else(direction[chosen[t]] > T.float32(0),
                                               T.max(kmax[h, chosen[t], newest], k_blk[0, h, 0, chosen[t]]),
                                               T.min(kmin[h, chosen[t], newest], k_blk[0, h, 0, chosen[t]])))
                        z[newest] = red[0]
                        red[2] = T.float32("-inf")
                        for j in T.serial(P):
                            if j < pages:
                                z[j] = z[j] / red[3]
                                red[2] = T.max(red[2], z[j])
                        for j0 in T.serial(chunks):
                            for l in T.vectorized(LANES):
                                z[j0 * LANES + l] = vexp(z[j0 * LANES + l] - red[2])
                        # softmax over the n tokens: page j stands for its min(p, n − j·p) tokens
                        red[0] = T.float32(0)
                        for j in T.serial(P):
                            if j < pages:
                                red[0] = red[0] + T.Cast("float32", T.min(p, n - j * p)) * z[j]
                        for j0 in T.serial(chunks):
                            for l in T.vectorized(LANES):
                                page_weight[j0 * LANES + l] = page_weight[j0 * LANES + l] + z[j0 * LANES + l] / red[0]
                    for c in T.serial(NB):
                        weight[h, c] = T.if_then_else(c < n, page_weight[T.min(c // p, P - 1)], T.float32(0))
                    mark_dropped(weight, h, n, K, key, dropped, lo, hi, cnt)
                # the kept rows, in candidate order
                cnt[0] = 0
                for c in T.serial(NB):
                    if c < n:
                        if dropped[c] == 0:
                            kept[cnt[0]] = c
                            cnt[0] = cnt[0] + 1
                # exact attention over the kept rows
                for g in T.serial(G):
                    red[2] = T.float32("-inf")
                    for i in T.serial(NB):
                        if i < cnt[0]:
                            for d0 in T.serial(D // LD):
                                for l in T.vectorized(LD):
                                    krow[d0 * LD + l] = T.if_then_else(
                                        kept[i] < nf, k_cache[h, T.min(kept[i], N - 1), d0 * LD + l],
                                        k_blk[0, h, 0, d0 * LD + l])
                            for l in T.vectorized(LD):
                                part[l] = T.float32(0)
                            for d0 in T.serial(D // LD):
                                for l in T.vectorized(LD):
                                    part[l] = part[l] + q[0, h * G + g, 0, d0 * LD + l] * krow[d0 * LD + l]
                            lane_sum(part)
                            logit[i] = part[0] * T.float32(scale)
                            red[2] = T.max(red[2], logit[i])
                    for i0 in T.serial(NBV // LANES):  # lanes past the kept rows are never summed
                        if i0 * LANES < cnt[0]:
                            for l in T.vectorized(LANES):
                                logit[i0 * LANES + l] = vexp(logit[i0 * LANES + l] - red[2])
                    red[1] = T.float32(0)
                    for d in T.vectorized(D):
                        acc[d] = T.float32(0)
                    for i in T.serial(NB):
                        if i < cnt[0]:
                            red[1] = red[1] + logit[i]
                            for d0 in T.serial(D // LD):
                                for l in T.vectorized(LD):
                                    acc[d0 * LD + l] = acc[d0 * LD + l] + logit[i] * T.if_then_else(
                                        kept[i] < nf, v_cache[h, T.min(kept[i], N - 1), d0 * LD + l],
                                        v_blk[0, h, 0, d0 * LD + l])
                    for d in T.vectorized(D):
                        out[0, h * G + g, 0, d] = acc[d] / red[1]

    return rocketkv_decode_attention


def _stage2_settings(spec, head_dim: int) -> Stage2Plan:
    params = spec.policy_params
    return stage2_plan(spec.budget, head_dim, traffic=int(params["traffic"]), page=int(params["page"]),
                       channels=int(params["channels"]), topk=int(params["topk"]))


def emit_rocketkv_decode_attention(bb, kernel, site, spec, caches, q, k_blk, v_blk):
    """The block-cache pass's hook (``RocketKVPolicy.emit_decode_attention``): stage 2 in place of
    the decode function's attention at one site; reads the summaries, writes nothing else."""
    from tvm import relax

    H, Hq, D, N = site.num_kv_heads, site.num_q_heads, site.head_dim, spec.budget
    plan = _stage2_settings(spec, D)
    kc, vc, _, fc, kmin, kmax = caches
    gv = kernel(f"rocketkv_attention_h{Hq}_{H}_d{D}", lambda: build_rocketkv_decode_attention_kernel(
        Hq, H, N, D, site.sm_scale, page=plan.page, channels=plan.channels, topk=plan.topk))
    return bb.emit(relax.call_tir(gv, [q, k_blk, v_blk, kc, vc, fc, kmin, kmax],
                                  relax.TensorType((1, Hq, 1, D), "float32")), f"attn_{site.index}")


def emit_rocketkv_summaries(bb, kernel, site, spec, block, kept, own, n_valid):
    """The block-cache pass's hook (``RocketKVPolicy.emit_after_select``) at one site: after stage 1
    (SnapKV++'s score and the generic select), the summaries kernel on the compacted cache ``kept``
    (k, v, pos, fill), in place on ``own`` = (rk_kmin, rk_kmax)."""
    from tvm import relax

    H, D, N = site.num_kv_heads, site.head_dim, spec.budget
    kmin, kmax = own
    page = _stage2_settings(spec, D).page
    gv = kernel(f"rocketkv_summaries_h{H}_d{D}", lambda: build_rocketkv_summaries_kernel(H, N, D, block, page))
    out = bb.emit(relax.call_tir_inplace(gv, [kept[0], kept[3], n_valid, kmin, kmax], [3, 4], [kmin.ty, kmax.ty]),
                  f"summaries_{site.index}")
    return [bb.emit(relax.TupleGetItem(out, i), f"{f}_new_{site.index}") for i, f in enumerate(("rk_kmin", "rk_kmax"))]



def rocketkv_kernel_params(policy, budget: int) -> dict:
    """SnapKV++'s settings (stage 1) and stage 2's: the page size resolved at budget N (it sizes
    the summaries); traffic / channels / topk as given (0: derived per site by ``plan`` — top-k
    from the traffic, channels from the head dim)."""
    plan = stage2_plan(budget, 1, traffic=policy.traffic, page=policy.page, topk=policy.topk)
    return {**snapkvpp_kernel_params(policy, budget), "traffic": int(policy.traffic), "page": int(plan.page),
            "channels": int(policy.channels), "topk": int(policy.topk)}


KERNELS = PolicyKernels(
    evict_kernel=build_rocketkv_evict_kernel,
    kernel_inputs=("queries",),
    question_kernels=True,
    emit_decode_attention=emit_rocketkv_decode_attention,
    emit_after_select=emit_rocketkv_summaries,
    compiled_state=(("rk_kmin", summary_shape, "float32"), ("rk_kmax", summary_shape, "float32")),
    kernel_params=rocketkv_kernel_params,
)
