"""The compiler: export → Relax → block-cache pass → TVM build → artifact.

Public entry points:
    compile_model(model, policy, budget, block=128, target="host", out_dir=None) -> BuildResult
    lower(model, spec, block) -> Lowered            (IRModule after the passes, no codegen)
    find_attention_sites(relax_function)            (raises AttentionMatchError)
"""

from .attention_sites import AttentionMatchError, AttentionSite, find_attention_sites
from .block_cache import BlockCacheSpec, RewriteBlockCache
from .build import BuildResult, CompileError, compile_model, resolve_target
from .last_token import HoistLastTokenGather
from .pipeline import lower, passes

__all__ = [
    "AttentionMatchError", "AttentionSite", "BlockCacheSpec", "BuildResult", "CompileError", "HoistLastTokenGather",
    "RewriteBlockCache", "compile_model", "find_attention_sites", "lower", "passes", "resolve_target",
]
