"""What a run report says about a compiled artifact, read from its manifest: the same for
HostRuntime and NativeRuntime (``Session.describe`` and the memory plan of ``Session.session_stats``)."""

from __future__ import annotations

from ..artifact import Keys, Manifest


def artifact_identity(manifest: Manifest, path, runtime: str, budget: int, block: int) -> dict:
    """The head of a compiled run's report; ``runtime``: "tvm" or "native"."""
    return {"engine": "compiled", "runtime": runtime, "artifact": str(path), "target": manifest.raw[Keys.TARGET],
            "model": manifest.model_id, "weight_sha256": manifest.weight_hash,
            "policy": manifest.policy_name, "policy_params": manifest.policy_params,
            "budget_tokens": budget, "block": block, "kv_dtype": manifest.kv_dtype}


def manifest_memory_plan(manifest: Manifest) -> dict:
    """The compile-time memory plan in a report's names (the native runtime reports its own, exact one)."""
    plan = manifest.memory_plan
    return {"weights": plan.weights_bytes, "kv_cache": plan.cache_bytes,
            "activations": plan.activation_bytes, "total": plan.total_bytes}


def planned_kv_bytes(manifest: Manifest) -> int:
    """The KV cache bytes of the manifest's plan (what a report sets against the full cache)."""
    return manifest.memory_plan.cache_bytes
