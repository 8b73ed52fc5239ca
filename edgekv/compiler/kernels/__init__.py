"""Shared TIR kernels placed into the graph by the block-cache pass, and the lookup of each
policy's own score kernel.

A policy's *score kernel* lives in its policy file (``edgekv/policies/<policy>.py``) next to
its reference scorer: ``<Policy>.evict_kernel`` is ``build_<policy>_evict_kernel(num_kv_heads,
budget, block, head_dim, dtype, **policy.kernel_params(budget))`` and returns the score
PrimFunc (see ``common`` for the shared signature) or ``None`` (``full``: append only).
Kernels shared by all policies stay here: top-N selection + compaction (``select``), block
attention over cache ⊕ block (``attention``), the attention-row helpers of the query-based
policies (``attention_scores``) and the conventions (``common``).

Policies that declare ``kernel_inputs`` (e.g. the block's queries) and/or ``entry_state`` get
the extra arguments and the ``observe`` kernel described in ``edgekv.policies.base`` ("Compiled
kernels beyond K/V"); ``kernel_spec`` is what the block-cache pass asks about a policy.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from ...policies import REGISTRY
from ...policies.base import UnsupportedPolicyError, compiled_policy_names
from .attention import build_block_attention_kernel
from .select import build_select_compact_kernel

__all__ = ["UnsupportedPolicyError", "KernelSpec", "build_attention", "build_observe", "build_score", "build_select",
           "compiled_policy_names", "kernel_spec", "policy_tag"]


def policy_tag(policy: str) -> str:
    """The policy name as it appears in kernel function names: ``+`` → ``p``, other non
    alphanumerics dropped (``snapkv++`` → ``snapkvpp``)."""
    return re.sub(r"[^A-Za-z0-9]", "", policy.replace("+", "p"))


@dataclass(frozen=True)
class KernelSpec:
    """What the compiled graph needs for one policy (from its ``Policy`` class variables)."""

    policy: str
    inputs: tuple[str, ...]  # Policy.kernel_inputs
    state: tuple[str, ...]  # Policy.entry_state (packed as one [S, H, N] cache tensor per layer)
    has_observe: bool

    @property
    def num_state(self) -> int:
        return len(self.state)

    @property
    def needs_site(self) -> bool:
        """Builders get ``num_q_heads`` / ``sm_scale`` (policies with kernel inputs)."""
        return bool(self.inputs)


def kernel_spec(policy: str) -> KernelSpec:
    cls = REGISTRY.get(policy)
    if cls is None:
        raise UnsupportedPolicyError(f"unknown policy '{policy}'")
    from ...policies.base import KERNEL_INPUTS

    unknown = [i for i in cls.kernel_inputs if i not in KERNEL_INPUTS]
    if unknown:
        raise ValueError(f"policy '{policy}' asks for kernel inputs {unknown}; known: {', '.join(KERNEL_INPUTS)}")
    if cls.emit_site_eviction is not None:
        # the policy wires its own site kernels (D2O): it gets the inputs and the generic state
        # tensor in its cache, but no generic observe / score / select, so needs no observe kernel
        return KernelSpec(policy, tuple(cls.kernel_inputs), tuple(cls.entry_state), False)
    if cls.entry_state and cls.evict_kernel is not None and cls.observe_kernel is None:
        raise UnsupportedPolicyError(f"policy '{policy}' keeps per-entry state but has no observe kernel")
    return KernelSpec(policy, tuple(cls.kernel_inputs), tuple(cls.entry_state), cls.observe_kernel is not None)


def site_params(policy: str, num_q_heads: int, sm_scale: float) -> dict[str, Any]:
    """Keyword arguments a policy's builders get besides ``kernel_params`` (see KernelSpec.needs_site)."""
    return {"num_q_heads": int(num_q_heads), "sm_scale": float(sm_scale)} if kernel_spec(policy).needs_site else {}


# Kernels are immutable PrimFuncs and TVMScript parsing costs ~0.1–0.3 s each: build each
# distinct (shape, parameter) combination once per process.
@functools.lru_cache(maxsize=256)
def build_attention(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype="float32", extra_rows=0,
                    cores=1):
    return build_block_attention_kernel(num_q_heads, num_kv_heads, budget, block, head_dim, sm_scale, dtype,
                                        extra_rows, cores)


def build_score(policy: str, num_kv_heads, budget, block, head_dim, dtype="float32", params: dict[str, Any] | None = None):
    """The score PrimFunc of the registered policy ``policy`` (None for ``full``)."""
    return _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, tuple(sorted((params or {}).items())))


@functools.lru_cache(maxsize=256)
def _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, params):
    cls = REGISTRY.get(policy)
    builder = cls.evict_kernel if cls is not None else None
    if builder is None:
        raise UnsupportedPolicyError(
            f"policy '{policy}' has no compiled kernel yet; compiled policies: {', '.join(compiled_policy_names())}")
    return builder(num_kv_heads, budget, block, head_dim, dtype, **dict(params))


def build_observe(policy: str, num_kv_heads, budget, block, head_dim, dtype="float32",
                  params: dict[str, Any] | None = None):
    """The state-update PrimFunc of ``policy`` (``Policy.observe_kernel``); ``params`` include the
    site parameters (``site_params``) when the policy takes them."""
    return _build_observe(policy, num_kv_heads, budget, block, head_dim, dtype, tuple(sorted((params or {}).items())))


@functools.lru_cache(maxsize=256)
def _build_observe(policy, num_kv_heads, budget, block, head_dim, dtype, params):
    cls = REGISTRY.get(policy)
    if cls is None or cls.observe_kernel is None:
        raise UnsupportedPolicyError(f"policy '{policy}' has no compiled observe kernel")
    return cls.observe_kernel(num_kv_heads, budget, block, head_dim, dtype, **dict(params))


@functools.lru_cache(maxsize=256)
def build_select(num_kv_heads, budget, block, head_dim, dtype="float32", with_score=True, num_state=0):
    return build_select_compact_kernel(num_kv_heads, budget, block, head_dim, dtype, with_score, num_state)
