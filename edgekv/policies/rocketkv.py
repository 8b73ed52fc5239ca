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
plan; a byte budget turned into N does not count them yet (either path). Compiled for CPU targets
(``edgekv/compiler/policy_kernels/rocketkv.py``); GPU targets have no stage-2 kernels yet and are
refused. RocketKV's p = 1 special case (store Kᵀ, no min/max) is the same arithmetic here: pages of
one row.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import PolicyError, topk_keep
from .snapkv_pp import SnapKVPlusPlusPolicy

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


@dataclass
class RocketKVPolicy(SnapKVPlusPlusPolicy):
    name = "rocketkv"
    summary = "RocketKV: SnapKV++ eviction plus top-k sparse decode attention chosen from page min/max keys"
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
