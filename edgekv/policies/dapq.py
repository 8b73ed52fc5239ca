"""`dapq` — DapQ, decoding-aligned pseudo queries (Tian, Su, Li, Zhang 2026, arXiv 2603.11564).

Definition. ``w`` pseudo tokens are appended after the prompt at the positions the first ``w``
generated tokens will take, ``n … n+w−1`` (n = prompt length); their content is the first ``a`` and
the last ``w − a`` prompt tokens ("where matters more than what"). In every layer the pseudo rows'
post-RoPE queries attend (softmax per row, causal by position) over the prompt keys ⊕ the pseudo keys;
a candidate's score is the sum over the w pseudo rows of the probability it gets, averaged over the G
query heads of its KV group; the top N candidates are kept per KV head. Pseudo K/V are never stored
and the first output token comes from the last real prompt row (decoding starts at position n).

Defaults (paper §5.1, digest §2.9): ``window`` w = 32, ``prefix`` a = 4 (first 4 + last 28),
``softmax_over="prompt+pseudo"``, no protected recent window (``keep_recent=0``), final-aligned
positions. Pooling, which the paper does not name, is ours, chosen by measurement (issue 16,
``tools/experiments/check_snapkv_pooling.py --study dapq``, docs/policies.md): max pooling over κ = 63
candidates (SnapKV++'s), because without it DapQ keeps the needle's attended tokens but too few
of their neighbours — long passkeys 1 of 12 without pooling, 12 of 12 with it, at N = 512 on
2K/4K prompts, one block and block-wise; fidelity to the full cache stays SnapKV++'s (mean KL
0.042 vs 0.025 unpooled at N = 256..1K). ``kernel=1`` is the unpooled variant.

Block-wise adaptation (digest §7.3): the pseudo tokens are built once in ``prepare`` from the whole
prompt (known up front) and appended, at positions n … n+w−1, to every block that triggers an
eviction; they see the evicted cache ⊕ the whole block; the candidates cache ⊕ block are re-scored
from scratch at every eviction (stateless). ``positions="block"`` is the digest's block-aligned
variant (e … e+w−1, e = end of the current block). One block covering the prompt is the paper's
single-shot DapQ exactly.

Deviations: the paper evicts only once, after prefill; the engine keeps the cache at N while decoding,
and there (no pseudo rows: a step with B = 1) the observers are the block's own last min(w, b) real
queries — while decoding, that is the true decoding query the pseudo queries stand in for. The
softmax domain, pooling and GQA reduction are not stated by the paper (digest §2.9); they are switches.

Engine contract: ``max_extra_tokens`` (= window) sizes the cache tail; the pseudo rows' queries and keys
arrive as ``ctx.extra_queries`` / ``ctx.extra_keys`` (without the keys, e.g. a hand-built ctx, the
softmax runs over the candidates alone). Cost: w extra tokens through every layer per evicting block
(+25 % linear-layer work at w = 32, B = 128) and a [Hq, w, N + B + w] attention tile per layer.

Compiled (``edgekv/compiler/policy_kernels/dapq.py``): ``build_dapq_evict_kernel`` (CPU) and
``build_dapq_evict_kernel_gpu`` (GPU) score from the step's post-RoPE queries, one pseudo row's
attention at a time; the compiled prefill step carries the pseudo rows as its last w rows
(``edgekv/compiler/passes/pseudo_rows.py``, docs/COMPILER.md "Pseudo rows"), on every prefill block.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .attention_rows import attention_rows, group_reduce, require_queries
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, protect_recent, topk_keep
from .snapkv import pool_scores


def pseudo_token_ids(prompt_ids: torch.Tensor, window: int, prefix: int) -> torch.Tensor:
    """The pseudo tokens' content: the first ``prefix`` and the last ``window − prefix`` prompt tokens
    (fewer when the prompt is shorter than either part)."""
    x = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    n = x.numel()
    head = x[: min(prefix, n)]
    tail_len = min(window - prefix, n)
    tail = x[n - tail_len :] if tail_len > 0 else x[:0]
    return torch.cat([head, tail])


def dapq_scores(
    keys: torch.Tensor,
    positions: torch.Tensor,
    pseudo_queries: torch.Tensor,
    pseudo_positions: torch.Tensor,
    pseudo_keys: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """DapQ's score, [Hq, n] fp32: Σ over the pseudo rows of their attention over the n candidates.

    keys [H, n, d], positions [H, n]; pseudo_queries [Hq, w, d], pseudo_positions [w].
    With ``pseudo_keys`` [H, w, d] the softmax runs over candidates ⊕ pseudo rows (causal among the
    pseudo rows) and only the candidates' columns are summed; without, over the candidates alone.
    Only the w pseudo rows of the attention matrix are computed.
    """
    n = keys.shape[1]
    if pseudo_keys is not None:
        pk_pos = pseudo_positions.to(positions.dtype)[None, :].expand(keys.shape[0], -1)
        keys = torch.cat([keys, pseudo_keys.to(keys.dtype)], dim=1)
        positions = torch.cat([positions, pk_pos], dim=1)
    probs = attention_rows(keys, positions, pseudo_queries, pseudo_positions, scale)  # [Hq, w, n(+w)]
    return probs[:, :, :n].sum(dim=1)


@dataclass
class DapQPolicy(Policy):
    name = "dapq"
    summary = "DapQ: scores entries with pseudo queries at the positions the answer will take"
    needs_queries = True  # only used when a step has no pseudo rows (decoding)
    uses_question = True  # the question replaces the pseudo rows (`--question`)
    window: int = 32
    prefix: int = 4
    positions: str = "final"
    softmax_over: str = "prompt+pseudo"
    kernel: int = 63  # max pooling over 63 candidates: ours, measured (the paper names no pooling)
    pooling: str = "max"
    keep_recent: int = 0

    def __post_init__(self) -> None:
        # Per-prompt state (not parameters): set by prepare().
        self._pseudo: tuple[torch.Tensor, torch.Tensor] | None = None
        self._engine = None
        self._prompt_len = 0

    # The engine sizes each cache's tail for the pseudo rows from this (read on the instance).
    @property
    def max_extra_tokens(self) -> int:
        return self.window

    def check_budget(self, budget: int, block: int) -> None:
        if self.window < 1:
            raise PolicyError("dapq: window must be ≥ 1 pseudo token (e.g. --policy-arg window=32)")
        if not 0 <= self.prefix <= self.window:
            raise PolicyError(f"dapq: prefix must be within [0, window={self.window}] (got {self.prefix})")
        if self.positions not in ("final", "block"):
            raise PolicyError(f"dapq: positions must be final or block (got {self.positions!r})")
        if self.softmax_over not in ("prompt+pseudo", "prompt"):
            raise PolicyError(f"dapq: softmax_over must be prompt+pseudo or prompt (got {self.softmax_over!r})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise PolicyError(f"dapq: the pooling kernel must be odd and ≥ 1 (got {self.kernel})")
        if self.pooling not in ("avg", "max"):
            raise PolicyError(f"dapq: pooling must be avg or max (got {self.pooling!r})")
        if not 0 <= self.keep_recent < budget:
            raise PolicyError(f"dapq: keep_recent must be within [0, budget={budget}) (got {self.keep_recent})")

    # ---- pseudo tokens ---------------------------------------------------------------------
    def prepare(self, prompt_ids: torch.Tensor, model: Any) -> None:
        """Build the pseudo tokens once from the whole prompt; ``model`` is the engine."""
        ids = pseudo_token_ids(prompt_ids, self.window, self.prefix)
        n = int(torch.as_tensor(prompt_ids).numel())
        self._prompt_len = n
        self._pseudo = (ids, torch.arange(n, n + ids.numel(), dtype=torch.long))
        try:
            self._engine = weakref.ref(model) if model is not None else None
        except TypeError:
            self._engine = None

    def prepare_continuation(self, ids: torch.Tensor, start: int, model: Any) -> None:
        """A continuation (position ``start`` on): pseudo tokens from its own tokens, after its end."""
        self.prepare(ids, model)
        end = start + self._prompt_len
        self._prompt_len = end
        self._pseudo = (self._pseudo[0], torch.arange(end, end + self._pseudo[0].numel(), dtype=torch.long))

    def extra_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._pseudo is None:
            return None
        ids, pos = self._pseudo
        if self.positions == "block":  # e … e+w−1, e = end of the block about to run
            engine = self._engine() if self._engine is not None else None
            if engine is None:
                raise PolicyError("dapq: positions=block needs the engine passed to prepare()")
            end = min(engine.position + engine.block, self._prompt_len)
            pos = torch.arange(end, end + ids.numel(), dtype=torch.long)
        return ids, pos

    # ---- scoring ---------------------------------------------------------------------------
    def observers(self, ctx: EvictionContext):
        """(queries, positions, keys or None) of the observation rows for this eviction."""
        if ctx.extra_queries is not None and ctx.extra_queries.shape[1] > 0:
            # Without the pseudo keys (a caller other than the engine) the softmax runs over the
            # candidates alone.
            keys = ctx.extra_keys if self.softmax_over == "prompt+pseudo" else None
            return ctx.extra_queries, ctx.extra_query_positions, keys
        # No pseudo rows (decoding, or a step run without them): the block's own last w queries,
        # whose keys are candidates already.
        queries, query_positions = require_queries(ctx, self.name)
        w = min(self.window, queries.shape[1])
        return queries[:, -w:], query_positions[-w:], None

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: group-mean summed pseudo-query attention, optionally pooled."""
        queries, query_positions, pseudo_keys = self.observers(ctx)
        per_q_head = dapq_scores(ctx.keys, ctx.positions, queries, query_positions, pseudo_keys, ctx.scale)
        score = group_reduce(per_q_head, ctx.num_kv_heads, "mean")
        score = pool_scores(score, self.kernel, self.pooling)
        return protect_recent(score, ctx.positions, self.keep_recent)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
