"""`tova` — TOVA, Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State
RNNs", arXiv 2401.06104), as the KeyDiff paper runs it (§A.1, §B.2).

Definition. Keep the N candidates with the highest attention from the *last* query (softmax over
all n candidates, causal by position; the last query sees every candidate, itself included). Under
GQA the last row's probabilities are averaged over the query heads of each KV group, so every KV head
keeps its own set (``heads="group"``, the KeyDiff baseline and edgekv's per-head selection).
``heads="layer"`` averages over *all* query heads and keeps one set shared by every KV head: that is
what the official TOVA code (``tova_cache.py``: mean over heads, one top-k) and kvpress's TOVAPress do.
(In ``layer`` mode candidate j is the same token in every KV head, since every eviction keeps the
same indices for all heads.)

Defaults: ``heads="group"``; no parameters otherwise (no sinks, no recent window).

Block-wise adaptation: the last query is the last token of the current block; the other b − 1 block
queries play no part. With B = 1 (decoding) this is the paper's per-step TOVA; with one block over the
prompt it is one-shot TOVA.

Deviations: none in the score. Unlike kvpress, the newest token is not pinned (the official code does
not pin it either; it normally wins on its own self-attention). kvpress 0.5.5 TOVAPress agrees with
``heads="layer"`` on every score but the newest token's (which it replaces by max + 1) — tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_rows import attention_rows, group_reduce, scoring_rows
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, topk_keep


@dataclass
class TOVAPolicy(Policy):
    name = "tova"
    summary = "TOVA: keeps what the last query attends to most"
    needs_queries = True
    uses_question = True
    heads: str = "group"

    def check_budget(self, budget: int, block: int) -> None:
        if self.heads not in ("group", "layer"):
            raise PolicyError(f"tova: heads must be group or layer (got {self.heads!r})")
        if budget < 1:
            raise PolicyError("tova: the budget must be at least 1 token")

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: the last block query's attention, averaged over the group (or all) query heads."""
        queries, query_positions = scoring_rows(ctx, self.name)  # the block's, or the question's last row
        last = attention_rows(ctx.keys, ctx.positions, queries[:, -1:], query_positions[-1:], ctx.scale)[:, 0]
        if self.heads == "group":
            return group_reduce(last, ctx.num_kv_heads, "mean")
        if self.heads == "layer":
            return last.mean(dim=0, keepdim=True).expand(ctx.num_kv_heads, -1).contiguous()
        raise PolicyError(f"tova: heads must be group or layer (got {self.heads!r})")

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
