"""`rocketkv` — RocketKV (Behnam et al. 2025, arXiv 2502.14051 v1): SnapKV++ eviction (stage 1) plus
hybrid sparse attention at every decode step (stage 2) (§3.4; digest: shared/research/seed-rocketkv.md
§3, budget split §3.3 / §4, checklist §9.1 items 8–14).

Definition. Stage 1 is ``snapkv++`` unchanged (per block during prefill, and at each decode step once
the cache is full — edgekv's hard cap). Stage 2 replaces a decode step's attention, per layer and KV
head j (the G query heads q_g of its group share one selection):
- summaries (digest §3.1 step 1): the kept keys, in the cache's compacted row order, are cut into pages
  of p consecutive rows; for each page the element-wise min and max over its rows, stored channel-major
  ``[H, d, pages]`` (+inf / −inf past the last row). A decode step folds its new key into the page
  it lands in (min = min(min, k), max = max(max, k)); an eviction reorders rows, so the summaries of
  that layer are rebuilt from the kept keys (``PageSummaries``);
- channels (step 2a): I = the r largest channels of Σ_g |q_g|; per channel the group sign
  σ_i = sign(Σ_g q_g[i]), strictly positive → the page max, else the page min (RocketKV's code);
- approximate scores (step 2b): per head z_g[page] = Σ_{i∈I} q_g[i]·K̂[i, page], each token gets its
  page's score, π_g = softmax(z_g / τ_g) over the tokens with SparQ's temperature
  τ_g = sqrt(d·‖q_g[I]‖₁ / ‖q_g‖₁), π = Σ_g π_g; the k tokens of highest π are selected (ties toward
  the older row, ``topk_keep``), one set per KV head;
- attention (step 3): exact softmax attention of each q_g over those k tokens only (scale 1/sqrt(d)).
Nothing is always included: plain RocketKV forces no recent or sink tokens (digest §3.2 notes; the
newest token is selected only if its page scores). With k ≥ the cache length stage 2 is skipped:
every row is selected and the engine's dense attention runs, exactly.

Budgets. edgekv's N is stage 1's capacity N₁ (memory, permanent retention). Stage 2 has its own
*traffic* budget B: KV-pair equivalents read per decode step per layer and KV head, the summary reads
included (paper §3.5, §4.1). Its ratio c₂ = N / B is the paper's √c (each stage compresses by √c,
digest §3.3); the sequence length S that would fix √c is not known when N and the compiled shapes are,
so B is a knob: ``traffic`` = 0 means B = ⌈N / 4⌉ (c₂ = 4, the paper's split for c = 16 — e.g.
SmolLM2's 8K context held at N = 2K). From c₂ and the head dim d, with RocketKV's gpt-fast rounding:
- ``page`` p = min(⌊c₂⌋, ⌈√c₂⌉), at least 1 (= c^¼: half of stage 2's ratio in the sequence dim);
- ``channels`` r = clamp(round(d·p / c₂), 1, d) (d/r = c^¼: the other half, in the head dim), so the
  summary reads ⌈N/p⌉·r values ≈ B/2 KV pairs;
- ``topk`` k = ⌊B/2⌋, at least 1 (the other half of B).
A knob set > 0 is used as given and the later ones are derived from it (r from the given p).
``decode_bytes_per_step`` is the traffic: ⌈n/p⌉·r summary values + k K and V rows, against n K and V
rows for dense decoding (``snapkv++``), with n the rows the step attends over.

Block-wise adaptation. Prefill (every block, including a 1-token last block) attends densely, as in
the paper; the summaries are kept in step with every block's rows so decode starts from them. The new
token's row is summarised before the step attends, so it can be selected.

Deviations. The paper never evicts generated tokens; here stage 1 keeps the cache at N while decoding
(``snapkv++``'s rule) and the summaries are rebuilt after each such eviction. The summaries (2·d values
per page, i.e. 1/p of the K+V bytes) are cache tensors of the compiled model, counted in its memory
plan; a byte budget turned into N does not count them yet (either path). Compiled for CPU targets ("compiled stage
2" below); GPU targets have no stage-2 kernels yet and are refused. RocketKV's p = 1 special case
(store Kᵀ, no min/max) is the same arithmetic here: pages of one row.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import PolicyError, topk_keep
from .snapkv_pp import SnapKVPlusPlusPolicy, build_snapkvpp_evict_kernel

# c₂ = N / B when ``traffic`` is 0 (see the module docstring).
DEFAULT_STAGE2_RATIO = 4


@dataclass(frozen=True)
class Stage2Plan:
    """Stage 2's knobs at one budget and head dim: traffic B, page p, channels r, top-k k."""

    traffic: int
    page: int
    channels: int
    topk: int

    def reads(self, n: int) -> tuple[int, int]:
        """(summary values, K/V rows) one KV head reads to attend over n rows: the top-k rows when
        stage 2 runs (k < n), else all n rows and no summaries (dense)."""
        if self.topk >= n:
            return 0, n
        return math.ceil(n / self.page) * self.channels, self.topk

    def traffic_pairs(self, n: int, head_dim: int) -> float:
        """The same in KV-pair equivalents (2·d values each): ≈ B when n ≈ N (digest §9.1 item 12)."""
        summary, rows = self.reads(n)
        return summary / (2 * head_dim) + rows


def stage2_plan(budget: int, head_dim: int, *, traffic: int = 0, page: int = 0, channels: int = 0,
                topk: int = 0) -> Stage2Plan:
    """The paper's even split of the traffic budget (module docstring), knobs > 0 taken as given."""
    b = traffic if traffic > 0 else max(1, math.ceil(budget / DEFAULT_STAGE2_RATIO))
    ratio = budget / b  # c₂
    p = page if page > 0 else max(1, min(math.floor(ratio), math.ceil(math.sqrt(ratio))))
    r = channels if channels > 0 else min(head_dim, max(1, round(head_dim * p / ratio)))
    k = topk if topk > 0 else max(1, b // 2)
    return Stage2Plan(traffic=b, page=p, channels=r, topk=k)


def page_minmax(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference summaries of keys [H, n, d]: (min, max) [H, d, ⌈n/p⌉] over pages of p rows
    (a last partial page over its rows only)."""
    h, n, d = keys.shape
    pages = math.ceil(n / page)
    pad = pages * page - n
    k = keys.transpose(1, 2)  # [H, d, n]
    lo = F.pad(k, (0, pad), value=float("inf")).view(h, d, pages, page).amin(-1)
    hi = F.pad(k, (0, pad), value=float("-inf")).view(h, d, pages, page).amax(-1)
    return lo, hi


class PageSummaries:
    """One layer's page-wise element-wise min / max of its cached keys, channel-major as the paper
    stores them (so the r chosen channels are r rows): ``kmin`` / ``kmax`` [H, d, ⌈capacity/p⌉],
    +inf / −inf on pages (and the tail of the last page) that hold no row. ``rows`` = cache rows
    summarised. Bound to the cache's stored key buffer [H, capacity, d] (fp32 keys, or int8 codes): a
    new buffer (a reset engine, a loaded snapshot) rebuilds."""

    def __init__(self, stored_keys: torch.Tensor, page: int):
        h, capacity, d = stored_keys.shape
        self.page = page
        self.kmin = torch.full((h, d, math.ceil(capacity / page)), float("inf"), dtype=torch.float32)
        self.kmax = torch.full_like(self.kmin, float("-inf"))
        self.rows = 0
        self._buffer = weakref.ref(stored_keys)

    def bound_to(self, stored_keys: torch.Tensor) -> bool:
        return self._buffer() is stored_keys

    def pages(self, n: int | None = None) -> int:
        """Pages holding rows [0, n) (default: the summarised rows)."""
        return math.ceil((self.rows if n is None else n) / self.page)

    def append(self, keys: torch.Tensor, end: int) -> None:
        """Fold rows [rows, end) of ``keys`` (the cache's rows as read) into the pages they land in
        (only those pages change)."""
        start = self.rows
        if end <= start:
            return
        new = keys[:, start:end].transpose(1, 2)  # [H, d, m]
        page_of = (torch.arange(start, end) // self.page).expand_as(new)
        self.kmin.scatter_reduce_(2, page_of, new, "amin", include_self=True)
        self.kmax.scatter_reduce_(2, page_of, new, "amax", include_self=True)
        self.rows = end

    def rebuild(self, keys: torch.Tensor, n: int) -> None:
        """Summaries of rows [0, n) of ``keys`` from scratch (after an eviction moved rows)."""
        self.kmin.fill_(float("inf"))
        self.kmax.fill_(float("-inf"))
        if n:  # whole pages at once: a reduction over a reshaped view, cheaper than a scatter per row
            lo, hi = page_minmax(keys[:, :n], self.page)
            self.kmin[:, :, : lo.shape[-1]] = lo
            self.kmax[:, :, : hi.shape[-1]] = hi
        self.rows = n


def select_channels(group_queries: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2a. group_queries [H, G, d] → (I [H, r] the r largest channels of Σ_g |q_g| — ties toward the
    lower channel —, positive [H, r]: Σ_g q_g[i] > 0, i.e. the page max is read, else the min)."""
    magnitude = group_queries.abs().sum(dim=1)
    chosen = torch.sort(magnitude, dim=-1, descending=True, stable=True).indices[:, :channels]
    positive = group_queries.sum(dim=1).gather(1, chosen) > 0
    return chosen, positive


def approximate_page_scores(group_queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                            chosen: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Step 2b, per page: z [H, G, P] = Σ_{i∈I} q_g[i]·K̂[i, page], K̂ the page max where the group sign
    is positive, else the min; kmin / kmax [H, d, P] (the pages to score)."""
    pages = kmin.shape[-1]
    rows = chosen[:, :, None].expand(-1, -1, pages)
    k_hat = torch.where(positive[:, :, None], kmax.gather(1, rows), kmin.gather(1, rows))  # [H, r, P]
    q_chosen = group_queries.gather(2, chosen[:, None, :].expand(-1, group_queries.shape[1], -1))  # [H, G, r]
    return torch.einsum("hgr,hrp->hgp", q_chosen, k_hat)


def token_weights(group_queries: torch.Tensor, page_scores: torch.Tensor, chosen: torch.Tensor, page: int,
                  n: int) -> torch.Tensor:
    """π [H, n]: each token takes its page's score, softmax over the n tokens per query head at SparQ's
    temperature τ_g = sqrt(d·‖q_g[I]‖₁ / ‖q_g‖₁), summed over the group's heads."""
    d = group_queries.shape[-1]
    per_token = page_scores.repeat_interleave(page, dim=-1)[..., :n]  # [H, G, n]
    q_chosen = group_queries.gather(2, chosen[:, None, :].expand(-1, group_queries.shape[1], -1))
    share = q_chosen.abs().sum(-1) / group_queries.abs().sum(-1).clamp_min(torch.finfo(group_queries.dtype).tiny)
    # a zero query has no direction: its scores are all 0 and any positive τ gives the uniform softmax
    tau = (d * share).sqrt().clamp_min(torch.finfo(group_queries.dtype).eps)
    return torch.softmax(per_token / tau[..., None], dim=-1).sum(dim=1)


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

    from ..compiler.kernels.attention import vexp
    from ..compiler.kernels.common import lane_tree_sum
    from ..compiler.kernels.select import evicted_mask_macro

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


@dataclass
class RocketKVPolicy(SnapKVPlusPlusPolicy):
    name = "rocketkv"
    summary = "RocketKV: SnapKV++ eviction plus top-k sparse decode attention chosen from page min/max keys"
    # compiled: stage 1's score kernel (SnapKV++'s) and the generic select, then the summaries kernel
    # (``emit_after_select``); stage 2 replaces the decode function's attention. No GPU versions yet
    # (a GPU target is refused, saying so).
    evict_kernel = staticmethod(build_rocketkv_evict_kernel)
    gpu_evict_kernel = None
    gpu_kernel = None
    emit_decode_attention = staticmethod(emit_rocketkv_decode_attention)
    emit_after_select = staticmethod(emit_rocketkv_summaries)
    compiled_state = (("rk_kmin", summary_shape, "float32"), ("rk_kmax", summary_shape, "float32"))
    traffic: int = 0
    page: int = 0
    channels: int = 0
    topk: int = 0

    def __post_init__(self):
        # derived per-layer state (not parameters: kept out of ``params()`` and snapshots, which
        # rebuild it from the keys): layer → PageSummaries, and what the last decode step selected
        self._summaries: dict[int, PageSummaries] = {}
        self.last_selected: dict[int, torch.Tensor] = {}  # layer → [H, k] row indices into the step's n rows
        self.last_fill: dict[int, int] = {}  # layer → n, the rows the last decode step attended over

    # ---- arguments ----------------------------------------------------------------------------
    def check_budget(self, budget: int, block: int) -> None:
        super().check_budget(budget, block)
        for arg in ("traffic", "page", "channels", "topk"):
            if getattr(self, arg) < 0:
                raise PolicyError(f"{self.name}: {arg}={getattr(self, arg)} is negative; use a positive count, or "
                                  f"--policy-arg {arg}=0 to derive it from the budget (docs/policies.md, rocketkv)")
        if self.page > budget:
            raise PolicyError(f"{self.name}: page={self.page} is larger than the budget N={budget}, so one page would "
                              f"summarise the whole cache; use page ≤ {budget} (a few tokens, e.g. --policy-arg "
                              f"page=4), or page=0 to derive it")
        if self.topk > budget + 1:
            raise PolicyError(f"{self.name}: topk={self.topk} is more than the {budget + 1} rows a decode step can "
                              f"attend over (N + the new token); use topk ≤ {budget + 1} — topk={budget + 1} is "
                              f"dense attention — or topk=0 to derive it (traffic / 2)")

    def check_model(self, config) -> None:
        self._check_head_dim(config.head_dim)

    def _check_head_dim(self, head_dim: int) -> None:
        if self.channels > head_dim:
            raise PolicyError(f"{self.name}: channels={self.channels} is more than this model's head dim "
                              f"{head_dim}; use channels ≤ {head_dim} (e.g. --policy-arg "
                              f"channels={max(1, head_dim // 2)}), or channels=0 to derive it")

    def kernel_params(self, budget: int) -> dict:
        """SnapKV++'s settings (stage 1) and stage 2's: the page size resolved at budget N (it sizes
        the summaries); traffic / channels / topk as given (0: derived per site by ``plan`` — top-k
        from the traffic, channels from the head dim)."""
        plan = stage2_plan(budget, 1, traffic=self.traffic, page=self.page, topk=self.topk)
        return {**super().kernel_params(budget), "traffic": int(self.traffic), "page": int(plan.page),
                "channels": int(self.channels), "topk": int(self.topk)}

    def plan(self, budget: int, head_dim: int) -> Stage2Plan:
        """Stage 2's knobs at budget N and head dim d (the module docstring's split)."""
        return stage2_plan(budget, head_dim, traffic=self.traffic, page=self.page, channels=self.channels,
                           topk=self.topk)

    # ---- summaries ----------------------------------------------------------------------------
    def summaries(self, layer: int) -> PageSummaries | None:
        """The layer's page min / max (None before its first step)."""
        return self._summaries.get(layer)

    def _sync(self, layer: int, cache, n: int, page: int, compacted: bool = False,
              keys: torch.Tensor | None = None) -> PageSummaries:
        """Bring the layer's summaries to the cache's first n rows: fold in rows appended since the
        last call; rebuild after a compaction, or for a new buffer (reset engine, loaded snapshot).
        ``keys``: rows [0, n) as the step read them (an int8 cache dequantises on every read)."""
        stored = cache.stored_tensors()[0]
        s = self._summaries.get(layer)
        if s is None or not s.bound_to(stored) or s.page != page:
            s = self._summaries[layer] = PageSummaries(stored, page)
            compacted = True
        if not compacted and n == s.rows:
            return s  # nothing appended, nothing moved
        keys = cache.view(n)[0] if keys is None else keys
        if compacted or n < s.rows:
            s.rebuild(keys, n)
        else:
            s.append(keys, n)
        return s

    def after_step(self, layer: int, cache, compacted: bool, *, budget: int) -> None:
        # every block's rows (and a decode step's eviction) reach the summaries as they happen, so
        # decode finds them current and a compaction costs one rebuild, not one per later step
        head_dim = cache.stored_tensors()[0].shape[-1]
        self._sync(layer, cache, cache.length, self.plan(budget, head_dim).page, compacted)

    # ---- stage 2 ------------------------------------------------------------------------------
    def decode_attention(self, layer: int, q: torch.Tensor, cache, n: int, *, budget: int,
                         scale: float) -> torch.Tensor | None:
        keys, values, _ = cache.view(n)
        num_kv, _, d = keys.shape
        self._check_head_dim(d)  # an engine that skipped check_model
        plan = self.plan(budget, d)
        summaries = self._sync(layer, cache, n, plan.page, keys=keys)
        self.last_fill[layer] = n
        if plan.topk >= n:  # every row selected: this is dense attention, left to the engine as is
            self.last_selected[layer] = torch.arange(n).expand(num_kv, n)
            return None
        group_queries = q[:, 0].reshape(num_kv, -1, d)  # [H, G, d]: consecutive query heads share a KV head
        chosen, positive = select_channels(group_queries, plan.channels)
        pages = summaries.pages(n)
        scores = approximate_page_scores(group_queries, summaries.kmin[:, :, :pages], summaries.kmax[:, :, :pages],
                                         chosen, positive)
        selected = topk_keep(token_weights(group_queries, scores, chosen, plan.page, n), plan.topk)  # [H, k]
        self.last_selected[layer] = selected
        heads = torch.arange(num_kv)[:, None]
        return F.scaled_dot_product_attention(q[None], keys[heads, selected][None], values[heads, selected][None],
                                              scale=scale, enable_gqa=True)[0]

    def decode_bytes_per_step(self, fill: int, head_dim: int, budget: int, *, num_kv_heads: int = 1,
                              num_layers: int = 1, dtype_bytes: int = 4) -> int:
        """Bytes one decode step reads with the cache at ``fill`` rows (the new token included): one of
        min / max per chosen channel and page, plus K and V of the top-k rows; dense when k ≥ fill."""
        summary, rows = self.plan(budget, head_dim).reads(fill)
        return num_layers * num_kv_heads * (summary + rows * 2 * head_dim) * dtype_bytes
