"""The compiler: frontend (export / ONNX → Relax) → passes (block cache, weight layout, ...) →
backend (schedules, codegen, artifact). ``pipeline.py`` lists every step in order; ``driver.py``
checks a request once and runs it for any target.

Public entry points:
    compile_model(model, policy, budget, block=128, target="host", out_dir=None) -> BuildResult
    import_model(model, block, extra_rows=0)        (the exported module: several compiles share it)
    lower(model, spec, block) -> Lowered            (IRModule after the passes, no codegen)
    find_attention_sites(relax_function)            (raises AttentionMatchError)

They load on first use (PEP 562), so that importing a tvm-free part of the compiler — the policy
kernel registry, ``compiler.policy_kernels``, which ``edgekv policies`` and the tests list — does
not import tvm.
"""

import importlib

_EXPORTS = {
    "BuildResult": "backend.artifact_writer", "resolve_target": "backend.target", "compile_model": "driver",
    "CompileError": "errors", "import_model": "frontend.export", "AttentionMatchError": "passes.attention_sites",
    "AttentionSite": "passes.attention_sites", "find_attention_sites": "passes.attention_sites",
    "HoistLastTokenGather": "passes.hoist_last_token", "BlockCacheSpec": "passes.rewrite_block_cache",
    "RewriteBlockCache": "passes.rewrite_block_cache", "lower": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
