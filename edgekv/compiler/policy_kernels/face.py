"""A policy's compiled face: what the compiler builds for one eviction policy, beside the policy's
torch definition in ``edgekv/policies/<policy>.py``.

One ``PolicyKernels`` per compiled policy, in ``compiler/policy_kernels/<policy>.py``, registered by
the policy's name in ``compiler/policy_kernels/__init__.py``. Every builder and emitter imports tvm
lazily (tvm is the optional ``compile`` extra), so the registry imports without it.

The generic mechanism (observe → score → select), for policies that need the block's queries and/or
per-entry state (SnapKV, SnapKV++, TOVA, H2O, DapQ and D2O):

``kernel_inputs`` names extra graph tensors the block-cache pass hands to the policy's kernels
after the common eight (``KERNEL_INPUTS``; ``compiler/passes/rewrite_block_cache.py`` knows how to get each one at
an attention site). A policy with ``kernel_inputs`` gets two more keyword arguments in every kernel
builder: ``num_q_heads`` (Hq) and ``sm_scale`` (the attention's softmax scale, 1/sqrt(d) in HF models).

The policy's ``entry_state`` (names, also used by the eager engine) becomes, per layer, ONE extra cache
tensor ``state [S, H, N] float32`` (S = len(entry_state), state s = entry_state[s], row order = the
K/V rows), allocated by the runtime beside K/V/pos/fill and listed in the manifest. Per step and
layer the compiled graph then runs, in this order:

  observe(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, *inputs, state,
          out cand_state [S, H, N + B])
      EVERY step (blocks and decode, with or without eviction): the state of every candidate
      c < fill + n_valid after this step (cache rows c < fill read state[:, :, c]; block rows
      start from 0 — as ``LayerCache.write`` zeroes them). Rows ≥ fill of ``state`` are stale:
      never read them. Policies with ``observes_every_step`` do their per-step update here.
  score(k_cache, ..., n_valid, *inputs, cand_state, out score [H, N + B])
      as for every policy (only read when fill + n_valid > N); without ``entry_state`` the
      ``cand_state`` argument is absent, without ``kernel_inputs`` so are the inputs.
  select(k_cache, ..., n_valid, score, state, cand_state)       in place on k, v, pos, fill, state
      the generic top-N + compaction: ``cand_state`` rows are appended / compacted into
      ``state`` with the same kept indices as K/V/pos.

The GPU versions (``gpu_evict_kernel`` / ``gpu_observe_kernel``) take the same arguments.

Pseudo rows (DapQ). A policy's ``max_extra_tokens`` = w > 0 (with ``prepare`` / ``extra_tokens``, the
same methods the engine calls) makes the compiled prefill step B + w rows long: the last w rows are
the policy's pseudo tokens, filled by the host runtime every step; the block attention hides them
from the real rows, select never stores them, the score kernel reads their queries through
``kernel_inputs`` (``compiler/passes/pseudo_rows.py``).

Per-layer site hooks (D2O: per-layer budgets, merge-on-evict). ``emit_site_eviction(bb, kernel, site,
spec, block, caches, inputs, k_blk, v_blk, pos_blk, n_valid) -> (new caches, extra outputs)`` replaces
observe + score + select at every attention site; ``caches`` are the layer's tensors of
``block_cache.cache_layout`` — k, v, pos, fill, the generic ``state`` (if ``entry_state``) and then
``compiled_state``: per-layer tensors ``(name, "entry" | length | shape_fn, dtype)`` allocated by the
runtime and listed in the manifest's ``cache_fields``. ``gpu_kernel(name, func, policy_params,
sm_scales) -> (kind, PrimFunc) | None`` gives the GPU versions of the kernels the hook emitted.
``compiled_state_init(policy, budget) -> {field: array}`` gives a field's contents at the start of
every prompt when they are not zeros (written into the artifact's manifest; every runtime restores
them on reset). Per-layer values that depend on the prompt come from a compiled per-prompt function:
``emit_prepare(bb, kernel, policy, probe, caches, n_valid, prompt_len, budget)`` (``compiler/passes/add_prepare_function.py``
builds ``prepare`` around it; D2O's first-block probe writes ``d2o_budget``), run by the runtimes
before a prompt longer than ``prepare_min_prompt(policy, budget)`` (the manifest's ``prepare.min_prompt``).

Decode-step attention (RocketKV). The eager engine calls the policy's ``decode_attention`` /
``after_step``; compiled, ``emit_decode_attention(bb, kernel, site, spec, caches, q, k_blk, v_blk) ->
out [1, Hq, 1, d]`` replaces the block attention of the compiled ``decode`` function at every site
(prefill stays dense), and ``emit_after_select(bb, kernel, site, spec, block, kept, own, n_valid) ->
own'`` brings the policy's ``compiled_state`` tensors ``own`` in step with the compacted cache
``kept`` (k, v, pos, fill[, state]) after the generic select, at every site.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...policies.base import PolicyError

# The graph tensors a policy's kernels may take after the common eight (``kernel_inputs``).
KERNEL_INPUTS: dict[str, str] = {
    "queries": "q [1, Hq, B, d] float32: the block's post-RoPE queries (query head h reads KV head "
               "h // (Hq / H)); rows >= n_valid are padding",
}


class UnsupportedPolicyError(PolicyError):
    """The policy exists but has no compiled (TIR) kernel yet; it runs only in the eager engine."""


def _no_params(policy: Any, budget: int) -> dict[str, Any]:
    return {}


def _zeros(policy: Any, budget: int) -> dict[str, Any]:
    return {}


def _never(policy: Any, budget: int) -> int | None:
    return None


@dataclass(frozen=True)
class PolicyKernels:
    """One policy's compiled face (the module docstring gives each hook's contract)."""

    # ``kernel_params(policy, budget)``: the policy's settings as its builders take them at budget N
    # (fractions → counts, auto lag → L); also the manifest's ``policy.kernel_params``
    kernel_params: Callable[[Any, int], dict[str, Any]] = _no_params
    # the score kernel: ``build(num_kv_heads, budget, block, head_dim, dtype, **kernel_params[, **site])``
    # → PrimFunc; None: no score kernel (``full``: append only, or a policy with ``emit_site_eviction``)
    evict_kernel: Callable[..., Any] | None = None
    # the per-step state-update kernel (required with the policy's ``entry_state``), same arguments
    observe_kernel: Callable[..., Any] | None = None
    # their GPU versions (same arguments, same PrimFunc signature: ``compiler/kernels/signature.py``),
    # swapped in by ``gpu_schedule.ReplaceKernels`` for GPU targets
    gpu_evict_kernel: Callable[..., Any] | None = None
    gpu_observe_kernel: Callable[..., Any] | None = None
    # extra graph tensors after the common eight, in this order (names from ``KERNEL_INPUTS``)
    kernel_inputs: tuple[str, ...] = ()
    # the CPU score kernel takes ``question_rows`` (`edgekv compile --question-rows`)
    question_kernels: bool = False
    # per-layer site hooks (D2O) and the per-layer cache tensors after k, v, pos, fill (and state)
    emit_site_eviction: Callable[..., Any] | None = None
    compiled_state: tuple[tuple[str, Any, str], ...] = ()
    gpu_kernel: Callable[..., Any] | None = None
    compiled_state_init: Callable[[Any, int], dict[str, Any]] = _zeros
    emit_prepare: Callable[..., Any] | None = None
    prepare_min_prompt: Callable[[Any, int], int | None] = _never
    # compiled decode attention and the state hook after the generic select (RocketKV)
    emit_decode_attention: Callable[..., Any] | None = None
    emit_after_select: Callable[..., Any] | None = None

    def builds_for_gpu(self) -> bool:
        """GPU versions of every kernel this face places: a GPU score kernel (and observe kernel), GPU
        versions of its own site kernels (``gpu_kernel``), or no score kernel at all (``full``)."""
        if self.emit_decode_attention is not None or self.emit_after_select is not None:
            return False  # no GPU versions of those hooks' kernels yet
        if self.emit_site_eviction is not None:
            return self.gpu_kernel is not None
        return self.evict_kernel is None or self.gpu_evict_kernel is not None
