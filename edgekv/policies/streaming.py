"""`streaming` — StreamingLLM (Xiao et al. 2023): keep `sinks` attention-sink tokens (the
first positions) plus the most recent N − sinks entries. Positions are not re-indexed
(DESIGN: tokens keep their original RoPE positions), unlike the original paper's
cache-slot re-indexing. Score-free, so block-wise and one-shot give the same set."""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, protect_sinks, topk_keep


@dataclass
class StreamingPolicy(Policy):
    name = "streaming"
    summary = "StreamingLLM: keeps the first `sinks` tokens and the most recent ones"
    sinks: int = 4

    def check_budget(self, budget: int, block: int) -> None:
        if self.sinks < 0:
            raise PolicyError("streaming: sinks must be ≥ 0 (e.g. --policy-arg sinks=4)")
        if budget <= self.sinks:
            raise PolicyError(
                f"streaming: budget {budget} leaves no room for a recent window beside "
                f"{self.sinks} sinks; use a budget above {self.sinks} or fewer sinks"
            )

    def score(self, ctx: EvictionContext):
        """Recency as the score (newer = higher), sinks pinned to +inf."""
        return protect_sinks(ctx.positions.float(), ctx.positions, self.sinks)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
