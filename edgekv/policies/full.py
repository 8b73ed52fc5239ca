"""`full`: no eviction. The oracle for every other policy: with N ≥ prompt + output every
policy must reduce to it. Refuses when the cache would have to evict."""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionContext, Policy, PolicyError, Selection, keep_all


def build_full_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32"):
    """No score kernel: the cache is appended to (the shared select/compaction kernel with
    ``with_score=False``) and the host refuses a run that would overflow N."""
    return None


@dataclass
class FullPolicy(Policy):
    name = "full"
    summary = "keeps every entry, no eviction (the reference); refuses a sequence longer than N"
    evict_kernel = staticmethod(build_full_evict_kernel)

    def kernel_params(self, budget: int) -> dict:
        return {}

    def select(self, ctx: EvictionContext) -> Selection:
        if ctx.must_evict:
            raise PolicyError(
                f"policy 'full' never evicts, but layer {ctx.layer} needs {ctx.n} cache entries "
                f"and the budget is {ctx.budget}; use --budget {ctx.n} or more (prompt + output), "
                "or choose an evicting policy"
            )
        return keep_all(ctx)
