"""Fidelity to the full cache: teacher-forced next-token distributions under eviction vs
the full cache, and greedy continuations.

A fidelity prompt is ``length`` tokens of natural text. The engine prefills it block-wise
under the policy and returns every position's logits (``prefill(all_logits=True)``); the
positions from ``eval_start`` on (the last ``window`` tokens, where every budget of the
sweep has already evicted) are compared with the full cache's:

- ``top1_agreement``: fraction of positions whose argmax token is the same;
- ``mean_kl``: mean over positions of KL(p_full ‖ p_policy) in nats;
- ``greedy_*``: from the end of the text, ``greedy_tokens`` tokens are decoded greedily
  (B = 1, evicting as it goes) under the policy and under the full cache;
  ``greedy_prefix_match`` = matching tokens before the first divergence / greedy_tokens,
  ``greedy_token_agreement`` = position-wise matches / greedy_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import BlockEngine


@dataclass
class FidelityTrace:
    """What one engine run leaves for scoring: scored logits and a greedy continuation."""

    logits: torch.Tensor  # [window, vocab] float32
    greedy: list[int]


def run_trace(engine: BlockEngine, ids: torch.Tensor, eval_start: int, greedy_tokens: int, progress=None) -> FidelityTrace:
    logits = engine.prefill(ids, progress=progress, all_logits=True)
    last = logits[-1].clone()
    scored = logits[eval_start:].clone()
    del logits
    greedy: list[int] = []
    for i in range(greedy_tokens):
        token = int(torch.argmax(last))
        greedy.append(token)
        if i < greedy_tokens - 1:
            last = engine.decode(token)
    return FidelityTrace(logits=scored, greedy=greedy)


def compare(reference: FidelityTrace, other: FidelityTrace) -> dict:
    """Fidelity metrics of ``other`` against the full-cache ``reference`` (plain floats)."""
    if reference.logits.shape != other.logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference.logits.shape)} vs {tuple(other.logits.shape)}")
    ref_lp = torch.log_softmax(reference.logits.double(), dim=-1)
    oth_lp = torch.log_softmax(other.logits.double(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - oth_lp)).sum(-1).clamp_min(0.0)  # tiny negatives are rounding
    top1 = (reference.logits.argmax(-1) == other.logits.argmax(-1)).double()
    g = len(reference.greedy)
    same = [a == b for a, b in zip(reference.greedy, other.greedy)]
    prefix = next((i for i, s in enumerate(same) if not s), g)
    return {
        "positions": int(reference.logits.shape[0]),
        "top1_agreement": float(top1.mean()),
        "mean_kl": float(kl.mean()),
        "median_kl": float(kl.median()),
        "max_kl": float(kl.max()),
        "greedy_tokens": g,
        "greedy_prefix_match": prefix / g if g else 1.0,
        "greedy_token_agreement": sum(same) / g if g else 1.0,
    }
