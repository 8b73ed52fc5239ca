"""The compiler: export → Relax → block-cache pass → TVM build → artifact.

Public entry points:
    compile_model(model, policy, budget, block=128, target="host", out_dir=None) -> BuildResult
    lower(model, spec, block) -> Lowered            (IRModule after the passes, no codegen)
    find_attention_sites(relax_function)            (raises AttentionMatchError)

They load on first use (PEP 562), so that importing a tvm-free part of the compiler — the policy
kernel registry, ``compiler.policy_kernels``, which ``edgekv policies`` and the tests list — does
not import tvm.
"""

import importlib

_EXPORTS = {
    "AttentionMatchError": "attention_sites", "AttentionSite": "attention_sites",
    "find_attention_sites": "attention_sites", "BlockCacheSpec": "block_cache", "RewriteBlockCache": "block_cache",
    "BuildResult": "build", "CompileError": "build", "compile_model": "build", "resolve_target": "build",
    "HoistLastTokenGather": "last_token", "lower": "pipeline", "passes": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
