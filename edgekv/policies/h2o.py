"""`h2o` — H2O, Heavy-Hitter Oracle (Zhang et al. 2023, arXiv 2306.14048).

Definition. Every cache entry carries its accumulated attention: the sum, over every query that has
attended while the entry was in the cache, of the probability that query gave it (column sums of the
attention matrix, softmax per row over cache ⊕ block, causal by position). Under GQA the column sums
of the query heads of a group are averaged (KeyDiff §B.2), so each KV head keeps its own set. At an
eviction the ``recent`` most recent entries are kept, and the other N − recent slots go to the
"heavy hitters": the highest accumulated attention among the rest. An entry's sum survives eviction
(the engine gathers ``h2o_acc`` with the kept indices) and a new entry starts at 0 before its block.

Defaults: ``recent_ratio`` = 0.5, i.e. recent = ⌊N/2⌋ and N − recent heavy hitters — the paper's
equal split (its runs use 10 % + 10 %, 20 % + 20 % of the sequence). ``recent_ratio=0`` gives pure
accumulated-attention top-N, which is how the KeyDiff digest describes its H2O baseline.

Block-wise adaptation: each step adds the column sums of all b block queries (the block attends
over the evicted cache ⊕ itself), computed a few query rows at a time; decoding adds one row per step.
"Recent" means the highest positions present in that head (= the last entries of the compacted
cache, as in H2O's code). One block over the prompt reproduces H2O's prefill scores.

Engine contract (``observes_every_step``): on every step, for every layer, the engine calls
``observe(ctx)`` with ``ctx.state["h2o_acc"]`` [H, n] (old entries' sums, 0 for the block's entries);
observe adds this block's column sums in place; then, if the cache must shrink, ``select(ctx)`` on the
same ctx; the engine then gathers ``h2o_acc`` with the kept indices. Keep the state in fp32.

Deviations: no sinks (as H2O); the sums are not normalised by how many queries saw an entry (kvpress's
ObservedAttentionPress does normalise), so older entries are favoured, as in H2O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_rows import attention_column_sums, group_reduce, require_queries, scoring_rows
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, topk_keep

STATE = "h2o_acc"


def pin_most_recent(score: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Score +inf for the ``count`` entries with the highest positions in each head."""
    if count <= 0:
        return score
    count = min(count, positions.shape[-1])
    newest_first = torch.sort(positions, dim=-1, descending=True).values
    threshold = newest_first[:, count - 1 : count]
    return score.masked_fill(positions >= threshold, float("inf"))


@dataclass
class H2OPolicy(Policy):
    name = "h2o"
    summary = "H2O: keeps the recent tokens and the heavy hitters (most attention accumulated so far)"
    needs_queries = True
    uses_question = True
    observes_every_step = True
    entry_state = (STATE,)
    recent_ratio: float = 0.5

    def check_budget(self, budget: int, block: int) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise PolicyError(f"h2o: recent_ratio must be within [0, 1] (got {self.recent_ratio})")
        if budget < 1:
            raise PolicyError("h2o: the budget must be at least 1 token")

    def recent_size(self, budget: int) -> int:
        """Entries reserved for the most recent tokens: ⌊N · recent_ratio⌋."""
        return int(budget * self.recent_ratio)

    def increment(self, ctx: EvictionContext) -> torch.Tensor:
        """This step's column sums over all block queries, group-averaged: [H, n] fp32."""
        queries, query_positions = require_queries(ctx, self.name)
        sums = attention_column_sums(ctx.keys, ctx.positions, queries, query_positions, ctx.scale)
        return group_reduce(sums, ctx.num_kv_heads, "mean")

    def observe(self, ctx: EvictionContext) -> None:
        inc = self.increment(ctx)
        acc = ctx.state.get(STATE)
        if acc is None:
            ctx.state[STATE] = inc
            return
        if tuple(acc.shape) != tuple(inc.shape):
            raise PolicyError(
                f"h2o: state {STATE} has shape {tuple(acc.shape)} but the step has {tuple(inc.shape)} "
                "candidates (old entries' sums, then zeros for the block's)"
            )
        acc.add_(inc.to(acc.dtype))
        ctx.state[STATE] = acc

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n]: accumulated attention (after ``observe``), the recent entries pinned to +inf."""
        acc = ctx.state.get(STATE)
        if acc is None:
            raise PolicyError(f"h2o: ctx.state has no {STATE!r}; the engine must call observe() before select()")
        score = acc.to(torch.float32)
        if ctx.extra_is_question:  # the question's attention joins the heavy hitters' (never stored: not observed)
            queries, query_positions = scoring_rows(ctx, self.name)
            score = score + group_reduce(attention_column_sums(ctx.keys, ctx.positions, queries, query_positions,
                                                               ctx.scale), ctx.num_kv_heads, "mean")
        return pin_most_recent(score, ctx.positions, self.recent_size(ctx.budget))

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
