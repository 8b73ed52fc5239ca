"""The compiler pipeline, in order:

  0. ``export.py``            torch.export the plain forward at T = B and T = 1, import both
                              with ``relax.frontend.torch`` (functions ``prefill_src``, ``decode_src``)
  1. ``block_cache.py``       RewriteBlockCache: attention sites → block attention + eviction
                              kernels over explicit caches; ``prefill_block`` and ``decode``
  2. ``last_token.py``        HoistLastTokenGather: LM head on the last valid row only
  3. (TVM) DeadCodeElimination: drops the dead softmax/mask subgraphs and the full LM head
  3b. ``pretranspose.py``     PretransposeWeights: linear weights stored as Wᵀ (no per-call transposes)
  3c. ``pack_weights.py``    PackWeights (host CPU builds, run by ``build.py``): each linear weight
                              as [N/NR, K, NR] column panels, its matmuls as the packed GEMM/GEMV;
      ``quantize_weights.py`` or, for ``--weights q4|q8``, QuantizeWeights: the same weights as
                              Q4_1/Q8_0 block panels (the embedding / tied head as Q8_0 rows) and
                              kernels that dequantise as they read
  4. ``build.py``             tvm.compile: TVM's Relax CPU pipeline with ``cpu_schedule.py``
                              (ScheduleCPU: one rule per kernel kind — register-blocked dense
                              GEMM/GEMV, generic matmul, NT matmul, fused elementwise) after FuseTIR, LLVM codegen,
                              and the artifact

``lower(model, ...)`` runs 0–3 and returns the IRModule plus what the artifact records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax

from .attention_sites import AttentionSite
from .block_cache import BlockCacheSpec, RewriteBlockCache
from .export import export_plain_forward, import_to_relax
from .last_token import HoistLastTokenGather
from .pretranspose import SUFFIX, PretransposeWeights

FUNCTIONS = ("prefill_block", "decode")


@dataclass
class Lowered:
    mod: tvm.IRModule
    params: list[tuple[str, Any]]  # (name, numpy array) in function-argument order
    sites: list[AttentionSite]
    timings: dict[str, float] = field(default_factory=dict)


def passes(spec: BlockCacheSpec) -> list:
    rewrite = RewriteBlockCache(spec, [("prefill_src", "prefill_block", None), ("decode_src", "decode", 1)])
    return [rewrite, HoistLastTokenGather(list(FUNCTIONS)), relax.transform.DeadCodeElimination(list(FUNCTIONS)),
            PretransposeWeights(list(FUNCTIONS))]


def import_model(model: Any, block: int, extra_rows: int = 0) -> tuple[tvm.IRModule, list[tuple[str, Any]], dict[str, float]]:
    """Export the prefill step at T = ``block`` + ``extra_rows`` (pseudo rows, ``pseudo_rows.py``)
    and decode at T = 1, and import both."""
    t0 = time.perf_counter()
    mod_b, params = import_to_relax(export_plain_forward(model, block + extra_rows))
    mod_1, params_1 = import_to_relax(export_plain_forward(model, 1))
    t1 = time.perf_counter()
    if [n for n, _ in params] != [n for n, _ in params_1]:
        raise RuntimeError("the block and decode exports disagree on their weight inputs")
    mod = tvm.IRModule({"prefill_src": mod_b["main"], "decode_src": mod_1["main"]})
    return mod, params, {"export_import_s": t1 - t0}


def check_imported_rows(mod: tvm.IRModule, block: int, extra: int) -> None:
    """Refuse an ``imported`` module exported at another step size than this build needs."""
    from .build import CompileError

    rows = int(mod["prefill_src"].params[0].ty.shape[1])
    if rows != block + extra:
        need = f"B + {extra} pseudo rows = {block + extra}" if extra else f"B = {block}"
        raise CompileError(f"the imported module's prefill step has {rows} rows, this build needs {need}; "
                           f"import it with pipeline.import_model(model, {block}, extra_rows={extra})")


def lower_module(mod: tvm.IRModule, spec: BlockCacheSpec) -> tuple[tvm.IRModule, list[AttentionSite], set[str]]:
    """Run the passes; returns the module, the attention sites and the names of the weights
    the module now takes transposed (see ``param_layout``)."""
    seq = passes(spec)
    for p in seq:
        mod = p(mod)
    return mod, seq[0].sites["prefill_block"], seq[-1].transposed


def param_layout(params: list[tuple[str, Any]], transposed: set[str]) -> list[tuple[str, Any]]:
    """The weight arrays as the lowered functions take them (transposed ones renamed ``name.T``)."""
    import numpy as np

    return [(n + SUFFIX, np.ascontiguousarray(a.T)) if n in transposed else (n, a) for n, a in params]


def lower(model: Any, spec: BlockCacheSpec, block: int) -> Lowered:
    mod, params, timings = import_model(model, block)
    t0 = time.perf_counter()
    mod, sites, transposed = lower_module(mod, spec)
    timings["passes_s"] = time.perf_counter() - t0
    return Lowered(mod=mod, params=param_layout(params, transposed), sites=sites, timings=timings)
