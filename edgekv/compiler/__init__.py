"""The compiler: frontend (export / ONNX → Relax) → passes (block cache, weight layout, ...) →
backend (schedules, codegen, artifact). ``pipeline.py`` lists every step in order; ``driver.py``
checks a request once and runs it for any target.

Public entry points:
    compile_model(model, policy, budget, block=128, target="host", out_dir=None) -> BuildResult
    import_model(model, block, extra_rows=0)        (the exported module: several compiles share it)
    lower(model, spec, block) -> Lowered            (IRModule after the passes, no codegen)
    find_attention_sites(relax_function)            (raises AttentionMatchError)
"""

from .backend.artifact_writer import BuildResult
from .backend.target import resolve_target
from .driver import compile_model
from .errors import CompileError
from .frontend.export import import_model
from .passes.attention_sites import AttentionMatchError, AttentionSite, find_attention_sites
from .passes.hoist_last_token import HoistLastTokenGather
from .passes.rewrite_block_cache import BlockCacheSpec, RewriteBlockCache
from .pipeline import lower

__all__ = [
    "AttentionMatchError", "AttentionSite", "BlockCacheSpec", "BuildResult", "CompileError", "HoistLastTokenGather",
    "RewriteBlockCache", "compile_model", "find_attention_sites", "import_model", "lower", "resolve_target",
]
