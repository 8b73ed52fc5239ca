"""`full`: no eviction. The oracle for every other policy: with N ≥ prompt + output every
policy must reduce to it. Refuses when the cache would have to evict."""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionContext, Policy, PolicyError, Selection, keep_all


@dataclass
class FullPolicy(Policy):
    name = "full"
    summary = "keeps every entry, no eviction (the reference); refuses a sequence longer than N"

    def select(self, ctx: EvictionContext) -> Selection:
        if ctx.must_evict:
            raise PolicyError(
                f"policy 'full' never evicts, but layer {ctx.layer} needs {ctx.n} cache entries "
                f"and the budget is {ctx.budget}; use --budget {ctx.n} or more (prompt + output), "
                "or choose an evicting policy"
            )
        return keep_all(ctx)
