"""Rebuilding one Relax function with some weight inputs replaced: the shared mechanics of the
weight-layout passes (``pretranspose.py``, ``pack_weights.py``)."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

from .block_cache import substitute, without_function

SKIP = object()  # a rewrite's answer: drop the binding (its value must have no other use)


def swap_weight_params(func: relax.Function, new_weights: dict[str, relax.Var]) -> tuple[list, dict]:
    """(the function's parameters with the weight inputs named in ``new_weights`` replaced by
    their new vars, {old var: new var})."""
    num_input = int(func.attrs["num_input"])
    params, swap = list(func.params[:num_input]), {}
    for p in func.params[num_input:]:
        if p.name in new_weights:
            swap[p] = new_weights[p.name]
        params.append(swap.get(p, p))
    return params, swap


def rebuild_function(mod: tvm.IRModule, name: str, params: list,
                     rewrite: Callable[[object, dict, relax.BlockBuilder], object] | None = None) -> tvm.IRModule:
    """``mod`` with function ``name`` rebuilt over ``params`` (same attributes). Every binding is
    emitted again with its vars substituted, unless ``rewrite(binding, vmap, bb)`` answers: an
    existing var (the binding becomes an alias of it, nothing is emitted), ``SKIP`` (dropped: a
    value whose every use the rewrite replaces) or an expression to emit in the binding's place;
    None keeps the binding."""
    func = mod[name]
    bb = relax.BlockBuilder(without_function(mod, name))
    attrs = {k: func.attrs[k] for k in func.attrs.keys() if k != "global_symbol"}
    with bb.function(name, params, attrs=attrs):
        vmap: dict = {}
        with bb.dataflow():
            for block in func.body.blocks:
                for b in block.bindings:
                    new = rewrite(b, vmap, bb) if rewrite is not None else None
                    if new is SKIP:
                        continue
                    if isinstance(new, relax.Var):
                        vmap[b.var] = new
                        continue
                    expr = new if new is not None else substitute(b.value, vmap)
                    emit = bb.emit if isinstance(b.var, relax.DataflowVar) else bb.emit_output
                    vmap[b.var] = emit(expr, b.var.name)
        bb.emit_func_output(substitute(func.body.body, vmap))
    return bb.get()
