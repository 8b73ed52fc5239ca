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
from typing import Any, Callable, ClassVar

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


# Compiled kernels beyond K/V — the one mechanism for policies that need the block's queries
# and/or per-entry state (SnapKV, SnapKV++, TOVA, H2O, DapQ and D2O).
#
# ``kernel_inputs`` names extra graph tensors the block-cache pass hands to the policy's kernels
# (``edgekv/compiler/block_cache.py`` knows how to get each one at an attention site):
KERNEL_INPUTS: dict[str, str] = {
    "queries": "q [1, Hq, B, d] float32: the block's post-RoPE queries (query head h reads KV head "
               "h // (Hq / H)); rows >= n_valid are padding",
}
# A policy with ``kernel_inputs`` gets two more keyword arguments in every kernel builder:
# ``num_q_heads`` (Hq) and ``sm_scale`` (the attention's softmax scale, 1/sqrt(d) in HF models).
#
# ``entry_state`` (names, also used by the eager engine) becomes, per layer, ONE extra cache
# tensor ``state [S, H, N] float32`` (S = len(entry_state), state s = entry_state[s], row order =
# the K/V rows), allocated by the runtime beside K/V/pos/fill and listed in the manifest. Per
# step and layer the compiled graph then runs, in this order:
#
#   observe(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, *inputs, state,
#           out cand_state [S, H, N + B])
#       EVERY step (blocks and decode, with or without eviction): the state of every candidate
#       c < fill + n_valid after this step (cache rows c < fill read state[:, :, c]; block rows
#       start from 0 — as ``LayerCache.write`` zeroes them). Rows ≥ fill of ``state`` are stale:
#       never read them. Policies with ``observes_every_step`` do their per-step update here.
#   score(k_cache, ..., n_valid, *inputs, cand_state, out score [H, N + B])
#       as for every policy (only read when fill + n_valid > N); without ``entry_state`` the
#       ``cand_state`` argument is absent, without ``kernel_inputs`` so are the inputs.
#   select(k_cache, ..., n_valid, score, state, cand_state)       in place on k, v, pos, fill, state
#       the generic top-N + compaction: ``cand_state`` rows are appended / compacted into
#       ``state`` with the same kept indices as K/V/pos.
#
# The GPU versions (``gpu_evict_kernel`` / ``gpu_observe_kernel``, in the policy's file beside the
# CPU builders) take the same arguments.
#
# Two further extension points, for what the generic observe → score → select cannot express:
#
# Pseudo rows (DapQ). ``max_extra_tokens`` = w > 0 (with ``prepare`` / ``extra_tokens``, the same
# methods the engine calls) makes the compiled prefill step B + w rows long: the last w rows are
# the policy's pseudo tokens, filled by the host runtime every step; the block attention hides
# them from the real rows, select never stores them, the score kernel reads their queries through
# ``kernel_inputs`` (``edgekv/compiler/pseudo_rows.py``).
#
# Per-layer site hooks (D2O: per-layer budgets, merge-on-evict). ``emit_site_eviction(bb, kernel,
# site, spec, block, caches, inputs, k_blk, v_blk, pos_blk, n_valid) -> (new caches, extra
# outputs)`` replaces observe + score + select at every attention site; ``caches`` are the layer's
# tensors of ``block_cache.cache_layout`` — k, v, pos, fill, the generic ``state`` (if
# ``entry_state``) and then ``compiled_state``: per-layer tensors ``(name, "entry" | length,
# dtype)`` allocated by the runtime and listed in the manifest's ``cache_fields``. ``gpu_kernel(name,
# func, policy_params, sm_scales) -> (kind, PrimFunc) | None`` gives the GPU versions of the
# kernels the hook emitted. ``compiled_state_init(budget) -> {field: array}`` gives a field's
# contents at the start of every prompt when they are not zeros (written into the artifact; every
# runtime restores them on reset). Per-layer values that depend on the prompt come from a
# compiled per-prompt function: ``emit_prepare(bb, kernel, probe, caches, n_valid, prompt_len,
# budget)`` (``compiler/prepare.py`` builds ``prepare`` around it; D2O's first-block probe writes
# ``d2o_budget``), run by the runtimes before a prompt longer than ``prepare_min_prompt(budget)``.


# Decode-step attention. A policy may replace the attention of a decode step (B = 1, after the new
# token's K/V are written at row n − 1, before the step's eviction) with its own — RocketKV's sparse
# attention over a selected subset of the cache — through ``decode_attention`` (eager engine);
# returning None keeps the engine's dense attention, so every other policy runs bit-identically.
# State a policy derives from the cached keys (RocketKV's page min/max) is kept in step with the
# cache through ``after_step``, which the engine calls after every layer's step, saying whether the
# eviction reordered the rows. Compiled, the same policy sets ``emit_decode_attention`` (its kernel
# in the ``decode`` function) and keeps the derived state as ``compiled_state``, updated by its
# ``emit_site_eviction`` after the step's select.


class PolicyError(ValueError):
    """A policy cannot run with the given budget / arguments; the message says how to fix it."""


class UnsupportedPolicyError(PolicyError):
    """The policy exists but has no compiled (TIR) kernel yet; it runs only in the eager engine."""


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
    # its CPU score kernel takes ``question_rows`` (the step's last rows may be a question's:
    # `edgekv compile --question-rows`, ``compiler/pseudo_rows.py``)
    question_kernels: ClassVar[bool] = False
    # Called on every step, even without eviction (to accumulate per-entry state).
    observes_every_step: ClassVar[bool] = False
    # Per-entry float state kept beside K/V and compacted with them, e.g. H2O's column sums.
    entry_state: ClassVar[tuple[str, ...]] = ()
    # The compiled face of the policy: a TIR score-kernel builder defined in the policy's own
    # file, ``build(num_kv_heads, budget, block, head_dim, dtype, **kernel_params(budget))``
    # returning a PrimFunc (or None: append only, no scores). None here = no compiled kernel.
    # Builders import tvm lazily (tvm is the optional ``compile`` extra).
    evict_kernel: ClassVar[Callable[..., Any] | None] = None
    # ---- compiled-kernel extension points (see "Compiled kernels beyond K/V" below) ----
    # Extra graph tensors the compiled kernels take after the common eight, in this order; names
    # from ``KERNEL_INPUTS``. Non-empty → the builders also get ``num_q_heads`` and ``sm_scale``.
    kernel_inputs: ClassVar[tuple[str, ...]] = ()
    # Builder of the per-step state-update kernel (required when ``entry_state`` is non-empty):
    # ``build(num_kv_heads, budget, block, head_dim, dtype, **kernel_params, **site)``.
    observe_kernel: ClassVar[Callable[..., Any] | None] = None
    # Their GPU versions (same arguments, same PrimFunc signature: ``compiler/kernels/signature.py``),
    # swapped in by ``gpu_schedule.ReplaceKernels`` for GPU targets; None: no GPU build of this policy.
    gpu_evict_kernel: ClassVar[Callable[..., Any] | None] = None
    gpu_observe_kernel: ClassVar[Callable[..., Any] | None] = None
    # Per-layer site hooks (see "Per-layer site hooks" above; D2O): the pass's per-site emitter,
    # the per-layer cache tensors after k, v, pos, fill (and state), and the GPU kernel lookup.
    emit_site_eviction: ClassVar[Callable[..., Any] | None] = None
    compiled_state: ClassVar[tuple[tuple[str, Any, str], ...]] = ()
    gpu_kernel: ClassVar[Callable[..., Any] | None] = None
    # Compiled decode attention (see "Decode-step attention" above): ``emit(bb, kernel, site, spec,
    # caches, q, k_blk, v_blk) -> out [1, Hq, 1, d]`` replaces the block attention of the compiled
    # ``decode`` function at every site (prefill stays dense); ``caches`` as for ``emit_site_eviction``.
    emit_decode_attention: ClassVar[Callable[..., Any] | None] = None
    # ``emit(bb, kernel, site, spec, block, kept, own, n_valid) -> own'``: after the generic select at
    # every site, bring the policy's ``compiled_state`` tensors ``own`` in step with the compacted
    # cache ``kept`` (k, v, pos, fill[, state]); RocketKV's page summaries.
    emit_after_select: ClassVar[Callable[..., Any] | None] = None

    def compiled_state_init(self, budget: int) -> dict[str, Any]:
        """Initial contents of ``compiled_state`` fields that do not start as zeros (one layer's)."""
        return {}

    def prepare_min_prompt(self, budget: int) -> int | None:
        """Prompts longer than this run the compiled ``prepare`` function first; None: never."""
        return None

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

    def kernel_params(self, budget: int) -> dict[str, Any]:
        """The parameters as ``evict_kernel`` takes them at budget N (e.g. fractions → counts)."""
        raise UnsupportedPolicyError(f"policy '{self.name}' has no compiled kernel yet; "
                                     f"compiled policies: {', '.join(compiled_policy_names())}")


def compiled_policy_names() -> list[str]:
    """Names of the registered policies that have a compiled kernel (``evict_kernel`` set)."""
    from . import REGISTRY

    return sorted(n for n, cls in REGISTRY.items() if cls.evict_kernel is not None)


def gpu_policy_names() -> list[str]:
    """The compiled policies that also build for GPU targets: a GPU score kernel
    (``gpu_evict_kernel``), GPU versions of their own site kernels (``gpu_kernel``), or no score
    kernel at all (``full``: attention and append only)."""
    from . import REGISTRY

    def builds(n: str) -> bool:
        cls = REGISTRY[n]
        if cls.emit_decode_attention is not None or cls.emit_after_select is not None:
            return False  # no GPU versions of those hooks' kernels yet
        if cls.emit_site_eviction is not None:
            return cls.gpu_kernel is not None
        return cls.gpu_evict_kernel is not None or n == "full"

    return [n for n in compiled_policy_names() if builds(n)]


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
