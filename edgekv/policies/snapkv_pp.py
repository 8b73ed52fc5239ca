"""`snapkv++` — SnapKV++, the first (permanent-eviction) stage of RocketKV (Behnam et al. 2025,
arXiv 2502.14051 v1, §3.3; digest: shared/research/seed-rocketkv.md §2).

Definition. As SnapKV, with the two changes of RocketKV §3.3:
- GQA: the window-summed attention of the G query heads of a group is *summed* (one token set per
  KV head, shared by the group);
- pooling: max pooling (RocketKV's code; v1 only says "pooling") with a large, length-adaptive kernel
  κ(L) = ``kernel_short`` if L < ``long_threshold`` else ``kernel_long``.
The w window tokens are always kept; the top N − w of the pooled scores of the others fill the rest.

Defaults: w = 32, κ = 63 / 511, T = 48K (the paper's Llama3.1-8B threshold; LongChat uses 12K,
Mistral ∞), max pooling. ``kernel`` > 0 fixes κ instead (the digest §9.3(c) suggests scaling κ to the
budget on edge budgets of 256–1024, where 63 is a large share of the cache).

Block-wise adaptation: the window is the last w tokens of the current block (clipped to the block
length); L is the number of tokens processed so far (newest query position + 1), which is the prompt
length when one block covers the prompt — then this is RocketKV's stage 1 exactly. Scores are re-made
from scratch at each eviction (no accumulation), pooled over the compacted cache order.

Deviations: RocketKV runs this once after a dense prefill and sizes N from its traffic split
(N₁ = √(S·B)); here N is the edgekv budget and eviction runs after every block. The window's own
scores are excluded from pooling (as RocketKV's and SnapKV's code slice them off first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_rows import group_reduce
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all
from .snapkv import check_window_args, pool_scores, protect_window, window_select, window_size, window_votes


@dataclass
class SnapKVPlusPlusPolicy(Policy):
    name = "snapkv++"
    summary = "SnapKV++ (RocketKV stage 1): SnapKV with group-summed scores and wide max pooling"
    needs_queries = True
    uses_question = True
    window: int = 32
    kernel_short: int = 63
    kernel_long: int = 511
    long_threshold: int = 48 * 1024
    kernel: int = 0
    pooling: str = "max"

    def check_budget(self, budget: int, block: int) -> None:
        if self.kernel < 0:
            raise PolicyError(f"{self.name}: kernel must be 0 (adaptive) or an odd size ≥ 1")
        kernels = (self.kernel,) if self.kernel else (self.kernel_short, self.kernel_long)
        for k in kernels:
            check_window_args(self.name, self.window, k, self.pooling, budget, block)

    def kernel_for(self, length: int) -> int:
        """κ(L): the fixed ``kernel`` when set, else short below ``long_threshold`` tokens, long from it."""
        if self.kernel > 0:
            return self.kernel
        return self.kernel_short if length < self.long_threshold else self.kernel_long

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: max-pooled group-summed window attention; the window itself +inf."""
        votes = group_reduce(window_votes(ctx, self.window, self.name), ctx.num_kv_heads, "sum")
        w = window_size(ctx, self.window)
        seen = int(ctx.query_positions.max()) + 1
        pooled = pool_scores(votes[:, : ctx.n - w], self.kernel_for(seen), self.pooling)
        return protect_window(pooled, w)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return window_select(ctx, self.score(ctx), self.window, self.name)
