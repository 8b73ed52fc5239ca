"""Fidelity to the full cache: teacher-forced next-token distributions under eviction vs
the full cache, and greedy continuations.

A fidelity prompt is ``length`` tokens of natural text, split into a context (the first
``length - window`` tokens) and a scored window. The engine prefills the context under the
policy (block-wise with B, or as one block), which evicts it down to N; then the window is
teacher-forced on top of that cache in chunks of min(B, 128) tokens (``engine.step(all_logits=True)``,
no pseudo rows, evicting after each chunk) and its next-token distributions are compared
with the full cache's. A policy that replaces decode's attention (RocketKV's sparse stage 2,
``Policy.replaces_decode_attention``) is teacher-forced one token at a time through
``engine.decode``, so the scored window sees the attention decode would use. (Scoring the window inside a one-block prefill would be meaningless:
a single block attends to the whole prompt before anything is evicted.)

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


def run_trace(engine: BlockEngine, ids: torch.Tensor, eval_start: int, greedy_tokens: int, progress=None,
              chunk: int = 128) -> FidelityTrace:
    """Prefill the context ``ids[:eval_start]`` (block-wise, or as one block: the engine's B),
    then teacher-force the rest of the text in chunks of ``chunk`` tokens (as decode would
    see it, after the context was evicted), then decode greedily."""
    logits = engine.prefill(ids[:eval_start], progress=progress)
    scored = [logits[None]]
    rest = ids[eval_start:]
    chunk = min(chunk, engine.block)  # the cache has room for N + B entries
    if engine.policy.replaces_decode_attention():  # its decode steps attend differently from a block's rows
        for token in rest.tolist():
            scored.append(engine.decode(token)[None])
            if progress is not None:
                progress(1)
    else:
        for start in range(0, rest.numel(), chunk):
            piece = rest[start : start + chunk]
            scored.append(engine.step(piece, all_logits=True))
            if progress is not None:
                progress(piece.numel())
    everything = torch.cat(scored)
    last = everything[-1].clone()
    scored_logits = everything[:-1].clone()  # position t predicts token t + 1 of the text
    del everything, scored
    greedy: list[int] = []
    for i in range(greedy_tokens):
        token = int(torch.argmax(last))
        greedy.append(token)
        if i < greedy_tokens - 1:
            last = engine.decode(token)
    return FidelityTrace(logits=scored_logits, greedy=greedy)


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
