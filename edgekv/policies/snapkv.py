"""`snapkv` — SnapKV (Li et al. 2024, arXiv 2404.14469), as the KeyDiff paper runs it (§B.2).

Definition. The observation window is the last ``w`` queries. Each window query's attention over
all n candidates (softmax per query row, causal by position) is summed over the window rows; under
GQA the sums of the query heads that share a KV head are averaged, giving one score per KV head and
candidate. The scores of the non-window candidates are smoothed along the sequence by average pooling
(kernel κ, stride 1, zero padding of κ//2 that counts in the mean, i.e. ``F.avg_pool1d``), and the top
N − w of them are kept together with the w window tokens, which are always kept (score +inf).

Defaults: w = 32, κ = 7, average pooling — the LongBench setting of the SnapKV paper that KeyDiff's
baseline uses (the SnapKV code's class defaults are w = 64, κ = 5; kvpress's SnapKVPress also
defaults to 64 / 5).

Block-wise adaptation: the window is the last w tokens of the *current* block (clipped to the block
length b, so decoding with B = 1 uses the newest token alone); candidates are the evicted cache ⊕ the
block, pooled in the cache's compacted order (which is position order with gaps). With one block
covering the whole prompt this is the paper's one-shot SnapKV exactly.

Deviations from the paper: selection is per KV head with the group average (the paper's code selects
per query head, storing a shared KV token once per head); the budget N counts the window (as the
paper's ``max_capacity_prompt``); pooling runs over compacted order, blurring across evicted gaps.
Agreement with kvpress 0.5.5 ``SnapKVPress.score`` is tested: equal scores (up to the factor w: it
averages the window rows) and equal kept sets on the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention_rows import attention_rows, group_reduce, scoring_rows
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, topk_keep


def window_size(ctx: EvictionContext, window: int) -> int:
    """The observation window among the candidates, always kept: ``window`` clipped to the block
    length — none when the question's rows vote (they are not candidates)."""
    return 0 if ctx.extra_is_question else min(window, ctx.queries.shape[1])


def window_votes(ctx: EvictionContext, window: int, policy: str) -> torch.Tensor:
    """Σ over the last ``window`` scoring rows (the block's, or the question's: ``scoring_rows``)
    of their attention over all candidates: [Hq, n] fp32."""
    queries, query_positions = scoring_rows(ctx, policy)
    w = min(window, queries.shape[1])
    probs = attention_rows(ctx.keys, ctx.positions, queries[:, -w:], query_positions[-w:], ctx.scale)
    return probs.sum(dim=1)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth [H, m] scores along the sequence: stride 1, padding κ//2 (odd κ keeps the length m).

    ``avg``: sum of the in-range neighbours divided by κ (padding counts as zeros, as ``F.avg_pool1d``
    and the SnapKV code). ``max``: max of the in-range neighbours (``F.max_pool1d``, RocketKV's code).
    """
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    x = scores[:, None, :]
    if pooling == "avg":
        return F.avg_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    if pooling == "max":
        return F.max_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    raise PolicyError(f"unknown pooling {pooling!r}; use avg or max")


def protect_window(pooled: torch.Tensor, w: int) -> torch.Tensor:
    """[H, n − w] pooled scores ⊕ +inf for the w window tokens (the last w candidates) -> [H, n]."""
    pinned = torch.full((pooled.shape[0], w), float("inf"), dtype=pooled.dtype, device=pooled.device)
    return torch.cat([pooled, pinned], dim=1)


def check_window_args(policy: str, window: int, kernel: int, pooling: str, budget: int, block: int) -> None:
    if window < 1:
        raise PolicyError(f"{policy}: window must be ≥ 1 (e.g. --policy-arg window=32)")
    if kernel < 1 or kernel % 2 == 0:
        raise PolicyError(f"{policy}: the pooling kernel must be odd and ≥ 1 (got {kernel}); e.g. 7")
    if pooling not in ("avg", "max"):
        raise PolicyError(f"{policy}: pooling must be avg or max (got {pooling!r})")
    kept_window = min(window, block)
    if budget <= kept_window:
        raise PolicyError(
            f"{policy}: budget {budget} leaves no room beside the {kept_window}-token observation window "
            f"that is always kept; use a budget above {kept_window} or a smaller window"
        )


def window_select(ctx: EvictionContext, score: torch.Tensor, window: int, policy: str) -> Selection:
    w = window_size(ctx, window)
    if ctx.budget < w:
        raise PolicyError(f"{policy}: budget {ctx.budget} cannot hold the {w}-token observation window")
    return Selection(kept=topk_keep(score, ctx.budget))


@dataclass
class SnapKVPolicy(Policy):
    name = "snapkv"
    summary = "SnapKV: keeps what the last `window` queries attend to most (pooled scores)"
    needs_queries = True
    uses_question = True
    window: int = 32
    kernel: int = 7
    pooling: str = "avg"

    def check_budget(self, budget: int, block: int) -> None:
        check_window_args(self.name, self.window, self.kernel, self.pooling, budget, block)

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: pooled group-mean window attention; the window itself +inf."""
        votes = group_reduce(window_votes(ctx, self.window, self.name), ctx.num_kv_heads, "mean")
        w = window_size(ctx, self.window)
        pooled = pool_scores(votes[:, : ctx.n - w], self.kernel, self.pooling)
        return protect_window(pooled, w)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return window_select(ctx, self.score(ctx), self.window, self.name)
