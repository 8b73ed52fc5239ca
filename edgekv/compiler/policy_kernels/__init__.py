"""Each eviction policy's compiled face, registered by the policy's name (one line each), and the
lookup the compiler asks about a policy.

A policy's torch definition lives in ``edgekv/policies/<policy>.py``; its compiled face — TIR score
(and observe) kernels, their GPU versions, Relax emitters, prepare kernels, and ``kernel_params``
mapping the policy's settings to the builders' — in ``compiler/policy_kernels/<policy>.py`` as a
``PolicyKernels`` (``face.py``, which writes down the contract). The compiler imports policies;
policies never import the compiler. Builders import tvm lazily, so this registry (and ``edgekv
policies``) works without tvm. A registered policy without a face runs in the eager engine only,
and ``edgekv compile`` refuses it with ``UnsupportedPolicyError``.

What both runtimes need at run time (the cache layout, ``cache_init``, ``prepare.min_prompt``,
``kernel_params``) reaches them through the artifact's manifest, never from here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from ...policies import REGISTRY as POLICIES
from . import d2o, dapq, full, h2o, keydiff, lagkv, reconstruct, rocketkv, snapkv, snapkv_pp, streaming, tova
from .face import KERNEL_INPUTS, PolicyKernels, UnsupportedPolicyError

KERNELS: dict[str, PolicyKernels] = {
    "full": full.KERNELS,
    "streaming": streaming.KERNELS,
    "keydiff": keydiff.KERNELS,
    "lagkv": lagkv.KERNELS,
    "snapkv": snapkv.KERNELS,
    "snapkv++": snapkv_pp.KERNELS,
    "rocketkv": rocketkv.KERNELS,
    "tova": tova.KERNELS,
    "h2o": h2o.KERNELS,
    "dapq": dapq.KERNELS,
    "d2o": d2o.KERNELS,
    "reconstruct": reconstruct.KERNELS,
}

__all__ = ["KERNELS", "KERNEL_INPUTS", "KernelSpec", "PolicyKernels", "UnsupportedPolicyError", "build_observe",
           "build_score", "compiled_policy_names", "compiled_state_init", "gpu_policy_names", "kernel_params",
           "kernel_spec", "policy_kernels", "policy_tag", "prepare_min_prompt", "question_policy_names",
           "site_params"]


def compiled_policy_names() -> list[str]:
    """Names of the registered policies that have a compiled face."""
    return sorted(n for n in KERNELS if n in POLICIES)


def gpu_policy_names() -> list[str]:
    """The compiled policies that also build for GPU targets (``PolicyKernels.builds_for_gpu``)."""
    return [n for n in compiled_policy_names() if KERNELS[n].builds_for_gpu()]


def question_policy_names() -> list[str]:
    """The compiled policies whose score kernels take question rows (``--question-rows``), in the
    policy registry's order."""
    return [n for n in POLICIES if n in KERNELS and KERNELS[n].question_kernels]


def policy_kernels(policy: str) -> PolicyKernels:
    """The compiled face of the registered policy ``policy``; refused when it has none."""
    face = KERNELS.get(policy)
    if face is None or policy not in POLICIES:
        raise UnsupportedPolicyError(
            f"policy '{policy}' has no compiled kernel yet; compiled policies: {', '.join(compiled_policy_names())}")
    return face


def kernel_params(policy: Any, budget: int) -> dict[str, Any]:
    """The policy's parameters as its kernel builders take them at budget N."""
    return policy_kernels(policy.name).kernel_params(policy, budget)


def compiled_state_init(policy: Any, budget: int) -> dict[str, Any]:
    """Initial contents of the policy's ``compiled_state`` fields that do not start as zeros (one layer's)."""
    return policy_kernels(policy.name).compiled_state_init(policy, budget)


def prepare_min_prompt(policy: Any, budget: int) -> int | None:
    """Prompts longer than this run the compiled ``prepare`` function first; None: never."""
    return policy_kernels(policy.name).prepare_min_prompt(policy, budget)


def policy_tag(policy: str) -> str:
    """The policy name as it appears in kernel function names: ``+`` → ``p``, other non
    alphanumerics dropped (``snapkv++`` → ``snapkvpp``)."""
    return re.sub(r"[^A-Za-z0-9]", "", policy.replace("+", "p"))


@dataclass(frozen=True)
class KernelSpec:
    """What the compiled graph needs for one policy (its face and the policy's ``entry_state``)."""

    policy: str
    inputs: tuple[str, ...]  # PolicyKernels.kernel_inputs
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
    cls = POLICIES.get(policy)
    if cls is None:
        raise UnsupportedPolicyError(f"unknown policy '{policy}'")
    face = policy_kernels(policy)
    unknown = [i for i in face.kernel_inputs if i not in KERNEL_INPUTS]
    if unknown:
        raise ValueError(f"policy '{policy}' asks for kernel inputs {unknown}; known: {', '.join(KERNEL_INPUTS)}")
    if face.emit_site_eviction is not None:
        # the policy wires its own site kernels (D2O): it gets the inputs and the generic state
        # tensor in its cache, but no generic observe / score / select, so needs no observe kernel
        return KernelSpec(policy, tuple(face.kernel_inputs), tuple(cls.entry_state), False)
    if cls.entry_state and face.observe_kernel is None:
        raise UnsupportedPolicyError(f"policy '{policy}' keeps per-entry state but has no observe kernel")
    return KernelSpec(policy, tuple(face.kernel_inputs), tuple(cls.entry_state), face.observe_kernel is not None)


def site_params(policy: str, num_q_heads: int, sm_scale: float) -> dict[str, Any]:
    """Keyword arguments a policy's builders get besides ``kernel_params`` (see KernelSpec.needs_site)."""
    return {"num_q_heads": int(num_q_heads), "sm_scale": float(sm_scale)} if kernel_spec(policy).needs_site else {}


# Kernels are immutable PrimFuncs and TVMScript parsing costs ~0.1–0.3 s each: build each
# distinct (shape, parameter) combination once per process.
def build_score(policy: str, num_kv_heads, budget, block, head_dim, dtype="float32", params: dict[str, Any] | None = None):
    """The score PrimFunc of the registered policy ``policy`` (None for ``full``: append only)."""
    return _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, tuple(sorted((params or {}).items())))


@functools.lru_cache(maxsize=256)
def _build_score(policy, num_kv_heads, budget, block, head_dim, dtype, params):
    builder = policy_kernels(policy).evict_kernel
    return None if builder is None else builder(num_kv_heads, budget, block, head_dim, dtype, **dict(params))


def build_observe(policy: str, num_kv_heads, budget, block, head_dim, dtype="float32",
                  params: dict[str, Any] | None = None):
    """The state-update PrimFunc of ``policy`` (``PolicyKernels.observe_kernel``); ``params`` include the
    site parameters (``site_params``) when the policy takes them."""
    return _build_observe(policy, num_kv_heads, budget, block, head_dim, dtype, tuple(sorted((params or {}).items())))


@functools.lru_cache(maxsize=256)
def _build_observe(policy, num_kv_heads, budget, block, head_dim, dtype, params):
    face = KERNELS.get(policy)
    if face is None or face.observe_kernel is None:
        raise UnsupportedPolicyError(f"policy '{policy}' has no compiled observe kernel")
    return face.observe_kernel(num_kv_heads, budget, block, head_dim, dtype, **dict(params))
