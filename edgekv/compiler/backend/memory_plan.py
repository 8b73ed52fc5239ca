"""The static memory plan of a lowered module: what the manifest's ``memory_plan`` records and
``--mem-limit`` checks (``pipeline.py``)."""

from __future__ import annotations

import numpy as np

from ...artifact import Keys
from ...artifact.params_file import stored_bytes
from ..passes.attention_sites import _arg_vars, op_name, shape_of
from ..passes.rewrite_block_cache import cache_layout


def memory_plan(lowered, budget: int, policy: str = "full", policy_params: dict | None = None,
                kv_dtype: str = "fp32", layer_budgets: list[int] | None = None) -> dict[str, int]:
    """Static plan in bytes: weights as stored (each array padded to the params file's 64-byte
    alignment: the bytes a runtime maps) and caches exactly (K, V — int8: codes and scales —, positions,
    fill and the policy's state, ``rewrite_block_cache.cache_layout``); activations as the peak of live
    intermediate tensors of ``prefill_block`` in binding order (before fusion: an upper bound
    of what TVM's static block-memory planner allocates, which reuses storage). ``layer_budgets``:
    each layer's cache rows where they differ (a local layer's window, ``BlockCacheSpec.site_budget``)."""
    weights = sum(stored_bytes(int(a.nbytes)) for _, a in lowered.params)  # what a runtime maps
    rows = layer_budgets or [budget] * len(lowered.sites)
    cache = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for s in lowered.sites
                for _, shape, dt in cache_layout(s.num_kv_heads, s.head_dim, rows[s.index], policy, "float32",
                                                 policy_params, kv_dtype))
    func = lowered.mod["prefill_block"]
    params = set(func.params)
    size: dict = {}
    last_use: dict = {}
    order = []
    for block in func.body.blocks:
        for b in block.bindings:
            i = len(order)
            order.append(b.var)
            shp = shape_of(b.var)
            aliasing = type(b.value).__name__ in ("TupleGetItem", "Var", "DataflowVar")  # views, not new memory
            # a transposed weight feeds a matmul that FuseTransposeMatmul fuses: never materialised
            aliasing = aliasing or (op_name(b.value) == "relax.permute_dims" and b.value.args[0] in params)
            if shp is not None and not aliasing:
                dt = str(b.var.ty.dtype)
                size[b.var] = int(np.prod(shp, dtype=np.int64)) * np.dtype(dt).itemsize
            for a in _arg_vars(b.value):
                last_use[a] = i
    frees: dict[int, list] = {}
    for v, i in last_use.items():
        if v in size and v not in params:
            frees.setdefault(i, []).append(v)
    live = peak = 0
    for i, v in enumerate(order):
        if v in size:
            live += size[v]
        peak = max(peak, live)
        for u in frees.get(i, []):
            live -= size[u]
    P = Keys.MemoryPlan
    return {P.WEIGHTS_BYTES: weights, P.CACHE_BYTES: cache, P.ACTIVATION_BYTES: int(peak),
            P.TOTAL_BYTES: int(weights + cache + peak)}
