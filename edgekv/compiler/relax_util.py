"""Generic Relax helpers the passes share: substituting vars in an expression, dropping a
function from a module, and rebuilding one function with some weight inputs replaced (the
mechanics of the weight-layout passes ``passes/pretranspose_weights.py``, ``passes/pack_weights.py``
and ``passes/quantize_weights.py``)."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

SKIP = object()  # a rewrite's answer: drop the binding (its value must have no other use)


def substitute(expr, vmap: dict):
    """``expr`` with vars replaced per ``vmap`` (calls, tuples and tuple-gets are rebuilt)."""
    if isinstance(expr, relax.Var):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Call):
        args = [substitute(a, vmap) for a in expr.args]
        return relax.Call(expr.op, args, expr.attrs, list(expr.ty_args) if expr.ty_args else None)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap), expr.index)
    return expr


def without_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    """``mod`` without the function called ``name``."""
    funcs = {gv: f for gv, f in mod.functions.items() if gv.name_hint != name}
    return tvm.IRModule(funcs, attrs=mod.attrs)


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
    out = bb.get()
    same_params = len(params) == len(func.params) and all(a.same_as(b) for a, b in zip(params, func.params))
    if not same_params:  # a new signature needs its new GlobalVar (nothing calls such a function yet)
        return out
    # keep the function's own GlobalVar: another function that calls it (D2O's `prepare` calls
    # `prefill_block`) still holds that one, and two GlobalVars of one name fail the VM build
    old_gv, new_gv = mod.get_global_var(name), out.get_global_var(name)
    funcs = {gv: f for gv, f in out.functions.items() if gv.name_hint != name}
    funcs[old_gv] = out[new_gv]
    return tvm.IRModule(funcs, attrs=out.attrs)


def rewrite_named_functions(mod: tvm.IRModule, functions: list[str], rewrite) -> tvm.IRModule:
    """``rewrite(mod, name)`` for each of ``functions`` the module has, then what the rewrites left
    unused removed from every Relax function (the fusion passes' shared ``transform_module``)."""
    names = [gv.name_hint for gv in mod.get_global_vars()]
    for name in functions:
        if name in names:
            mod = rewrite(mod, name)
    entries = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
    return relax.transform.DeadCodeElimination(entries)(mod)
