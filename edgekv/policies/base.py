"""The one interface every eviction policy plugs into.

The engine calls a policy once per layer whenever cache ⊕ block holds more than the
budget N entries (and, for policies that ask, on every step so they can update per-entry
state). The policy sees only tensors of that layer — never the model — and answers with
the indices to keep per KV head. The engine gathers K, V, positions and the policy's own
per-entry state with those indices, so a policy never manages memory.

Shapes (batch 1; H = KV heads, Hq = query heads, n = cache entries + block entries,
b = block length, d = head dim):

    keys, values     [H, n, d]   post-RoPE, the first ``n_cache`` rows are the old cache
    positions        [H, n]      original token positions (kept across eviction)
    queries          [Hq, b, d]  post-RoPE block queries (only when ``needs_queries``)
    query_positions  [b]
    extra_queries    [Hq, e, d]  pseudo queries a policy asked the engine to run (DapQ)
    extra_keys       [H, e, d]   their keys (for a softmax over candidates ⊕ pseudo rows)
    state[name]      [H, n]      per-entry float state declared in ``entry_state``

Ties are broken toward the earlier candidate index (i.e. the older entry): see
``topk_keep`` — the compiled kernels use the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch


@dataclass
class EvictionContext:
    layer: int
    num_layers: int
    budget: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    n_cache: int
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    extra_queries: torch.Tensor | None = None
    extra_query_positions: torch.Tensor | None = None
    extra_keys: torch.Tensor | None = None  # [H, e, d] the pseudo rows' keys (never stored)
    # the extra rows are the question (`--question`): its tokens after the document, at their true
    # future positions; query-aware policies score with them (``attention_rows.scoring_rows``)
    extra_is_question: bool = False
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    is_prefill: bool = True
    scale: float | None = None

    @property
    def n(self) -> int:
        return self.keys.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    @property
    def must_evict(self) -> bool:
        return self.n > self.budget


@dataclass
class Selection:
    """What a policy answers: kept candidate indices per KV head, [H, k] with k ≤ N.

    ``keys``/``values`` optionally replace the gathered rows (merge-on-evict policies such as
    D2O fold evicted entries into kept ones); they must have shape [H, k, d].
    """

    kept: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


# A policy's compiled face (TIR kernels, Relax emitters, ``kernel_params``) is the compiler's:
# ``edgekv/compiler/policy_kernels/<policy>.py``, registered by the policy's name. The compiler
# reads this class's engine-side declarations (``entry_state``, ``max_extra_tokens``, ``prepare``,
# ``extra_tokens``); nothing here imports the compiler.


# Decode-step attention. A policy may replace the attention of a decode step (B = 1, after the new
# token's K/V are written at row n − 1, before the step's eviction) with its own — RocketKV's sparse
# attention over a selected subset of the cache — through ``decode_attention`` (eager engine);
# returning None keeps the engine's dense attention, so every other policy runs bit-identically.
# State a policy derives from the cached keys (RocketKV's page min/max) is kept in step with the
# cache through ``after_step``, which the engine calls after every layer's step, saying whether the
# eviction reordered the rows. (Compiled, the policy's face in ``compiler/policy_kernels`` emits the
# decode function's attention kernel and keeps the derived state as cache tensors.)


from ..errors import PolicyError  # noqa: E402,F401  (declared in edgekv.errors: `edgekv --help` loads no torch)


@dataclass
class Policy:
    """Base class. Subclasses are dataclasses whose fields are the paper's defaults."""

    name: ClassVar[str] = "base"
    # what the policy does, in one line (`edgekv policies`)
    summary: ClassVar[str] = ""
    # The engine passes the block's queries (post-RoPE) only to policies that need them.
    needs_queries: ClassVar[bool] = False
    # scores with the question's rows when the engine appends them (`--question`); query-agnostic
    # policies leave this False and run unchanged
    uses_question: ClassVar[bool] = False
    # Called on every step, even without eviction (to accumulate per-entry state).
    observes_every_step: ClassVar[bool] = False
    # Per-entry float state kept beside K/V and compacted with them, e.g. H2O's column sums.
    entry_state: ClassVar[tuple[str, ...]] = ()

    def check_budget(self, budget: int, block: int) -> None:
        """Raise PolicyError if this policy cannot run with budget N and block B."""

    def prepare(self, prompt_ids: torch.Tensor, model: Any) -> None:
        """Called once before prefill with the whole prompt (DapQ builds pseudo tokens here)."""

    def state_dict(self) -> dict[str, Any]:
        """The per-prompt state a saved cache needs to continue (JSON-able); most policies keep
        theirs in the cache itself."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (loading a saved cache)."""

    def prepare_continuation(self, ids: torch.Tensor, start: int, model: Any) -> None:
        """Called before a prefill that continues a sequence at position ``start`` (a question
        after a document, or a saved cache): the per-prompt state stays (D2O's budgets);
        DapQ builds its pseudo tokens from the continuation."""

    def extra_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token ids, positions) the engine appends to blocks that evict; their K/V never
        enter the cache and they never influence real tokens (they come last, causally)."""
        return None

    def layer_budget(self, layer: int, budget: int) -> int:
        """The budget for one layer (≤ the global N that sized the buffers)."""
        return budget

    def select(self, ctx: EvictionContext) -> Selection:
        raise NotImplementedError

    def observe(self, ctx: EvictionContext) -> None:
        """Update per-entry state in ``ctx.state`` in place (for ``observes_every_step``)."""

    def check_model(self, config: Any) -> None:
        """Raise PolicyError if this policy cannot run on a model of this geometry (a
        ``ModelConfig``: head dim, heads); the eager engine calls it once, after ``check_budget``."""

    def decode_attention(self, layer: int, q: torch.Tensor, cache: Any, n: int, *, budget: int,
                         scale: float) -> torch.Tensor | None:
        """The attention output [Hq, 1, d] of one decode step of ``layer``, or None (the default) for
        the engine's dense attention over the cache's first ``n`` rows. ``q`` [Hq, 1, d] post-RoPE;
        ``cache`` the layer's ``LayerCache``, holding the new token at row n − 1 (nothing evicted yet);
        ``budget`` the engine's N; ``scale`` the softmax scale."""
        return None

    def replaces_decode_attention(self) -> bool:
        """Whether this policy replaces a decode step's attention (overrides ``decode_attention``)."""
        return type(self).decode_attention is not Policy.decode_attention

    def after_step(self, layer: int, cache: Any, compacted: bool, *, budget: int) -> None:
        """Called after every step of every layer (blocks and decode) once ``cache.length`` rows are
        live; ``compacted``: the step's eviction moved rows (derived per-layer state must be rebuilt);
        ``budget`` the engine's N."""

    def decode_bytes_per_step(self, fill: int, head_dim: int, budget: int, *, num_kv_heads: int = 1,
                              num_layers: int = 1, dtype_bytes: int = 4) -> int:
        """KV-cache bytes one decode step's attention reads when the cache holds ``fill`` entries per
        layer and KV head (the new token included): dense attention reads every K and V row."""
        return num_layers * num_kv_heads * fill * 2 * head_dim * dtype_bytes

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def topk_keep(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores per row, ties toward the lower index, sorted ascending.

    A stable descending sort gives the documented tie rule regardless of torch.topk's
    implementation-defined order among equal values.
    """
    k = min(k, score.shape[-1])
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def keep_all(ctx: EvictionContext) -> Selection:
    idx = torch.arange(ctx.n, device=ctx.keys.device).expand(ctx.num_kv_heads, ctx.n)
    return Selection(kept=idx.contiguous())


def protect_recent(score: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Force the ``window`` most recent positions to be kept (score +inf)."""
    if window <= 0:
        return score
    newest = positions.max(dim=-1, keepdim=True).values
    return score.masked_fill(positions > newest - window, float("inf"))


def protect_sinks(score: torch.Tensor, positions: torch.Tensor, sinks: int) -> torch.Tensor:
    """Force the first ``sinks`` token positions (attention sinks) to be kept (score +inf)."""
    if sinks <= 0:
        return score
    return score.masked_fill(positions < sinks, float("inf"))
