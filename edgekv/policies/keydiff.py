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


@dataclass
class KeyDiffPolicy(Policy):
    name = "keydiff"
    summary = "KeyDiff: keeps the keys least similar to their mean (the most diverse); no attention scores needed"
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

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: −cos(anchor, k_i), with the recent window (if any) pinned to +inf."""
        score = keydiff_scores(ctx.keys, self.EPS)
        w = recent_count(self.recent_window, ctx.budget)
        return protect_recent(score, ctx.positions, w)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
