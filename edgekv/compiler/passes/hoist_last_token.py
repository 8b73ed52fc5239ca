"""The pass: compute the LM head for the last valid token only.

After ``RewriteBlockCache`` a block-step function ends with

    y = reshape(matmul(reshape(h, [T, H]), W), [1, T, V]);  last = take(y, n_valid − 1, axis=1)

i.e. it projects all T rows to the vocabulary and keeps one. The projection is row-wise, so
the row can be taken first: ``take(h, idx, axis=1)`` → reshape → matmul → reshape, which cuts
the LM-head GEMM from T × H × V to 1 × H × V (for SmolLM2 at B = 128: 3.6 GFLOP → 28 MFLOP per
block). The pass matches only that exact row-wise chain (the weight must not depend on the
function's token/position inputs) and leaves anything else untouched; the dead full
projection is removed by dead-code elimination afterwards.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .attention_sites import Graph, op_name, shape_of
from ..relax_util import substitute, without_function


def _match(graph: Graph, take_var):
    """(h, weight, idx) if take_var = take(reshape(matmul(reshape(h), W)), idx, axis=1), or
    take(matmul(h, W), idx, axis=1) as the ONNX frontend emits a 3-D MatMul."""
    take = graph.producer[take_var]
    if op_name(take) != "relax.take" or int(take.attrs.axis) != 1:
        return None
    y, idx = take.args
    ys = shape_of(y)
    if ys is None or len(ys) != 3 or ys[0] != 1:
        return None
    T, V = ys[1], ys[2]
    r1 = graph.producer.get(y)
    while isinstance(r1, relax.Var):  # alias bindings (gv = lv)
        r1 = graph.producer.get(r1)
    if op_name(r1) == "relax.matmul":  # matmul(h[1, T, H], W[H, V]) without reshapes (ONNX import)
        h, w = r1.args
        ws = shape_of(w)
        if ws is not None and len(ws) == 2 and ws[1] == V and shape_of(h) == (1, T, ws[0]):
            return h, w, idx, r1.attrs
        return None
    if op_name(r1) != "relax.reshape":
        return None
    mm_var = r1.args[0]
    mm = graph.producer.get(mm_var)
    if op_name(mm) != "relax.matmul" or shape_of(mm_var) != (T, V):
        return None
    x2, w = mm.args
    ws = shape_of(w)
    if ws is None or len(ws) != 2 or ws[1] != V:
        return None
    r0 = graph.producer.get(x2)
    if op_name(r0) != "relax.reshape":
        return None
    h = r0.args[0]
    hs = shape_of(h)
    if hs is None or hs != (1, T, ws[0]):
        return None
    return h, w, idx, mm.attrs


def hoist_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    func = mod[name]
    graph = Graph(func)
    # only function inputs that are not weights make the weight "block dependent"; weights are
    # function parameters too, so accept any W whose producer chain has no take/tokens: the
    # matcher above already requires the exact row-wise chain.
    targets = {v: m for v in graph.order if (m := _match(graph, v)) is not None}
    if not targets:
        return mod
    bb = relax.BlockBuilder(without_function(mod, name))
    attrs = {k: func.attrs[k] for k in func.attrs.keys() if k != "global_symbol"} if func.attrs else None
    with bb.function(name, list(func.params), attrs=attrs):
        vmap: dict = {}
        ret = None
        with bb.dataflow():
            for block in func.body.blocks:
                for b in block.bindings:
                    if b.var in targets:
                        h, w, idx, mm_attrs = targets[b.var]
                        H = shape_of(h)[2]
                        row = bb.emit(relax.op.take(vmap.get(h, h), vmap.get(idx, idx), axis=1), "last_hidden")
                        row2 = bb.emit(relax.op.reshape(row, (1, H)))
                        dt = mm_attrs.out_dtype  # None from the ONNX frontend, "void" = the input dtype
                        mm = bb.emit(relax.op.matmul(row2, vmap.get(w, w), out_dtype=None if dt is None else str(dt)))
                        vmap[b.var] = bb.emit(relax.op.reshape(mm, shape_of(b.var)), b.var.name)
                    elif isinstance(b.var, relax.DataflowVar):
                        vmap[b.var] = bb.emit(substitute(b.value, vmap), b.var.name)
                    else:
                        vmap[b.var] = bb.emit_output(substitute(b.value, vmap), b.var.name)
            ret = substitute(func.body.body, vmap)
        bb.emit_func_output(ret)
    out = bb.get()
    return out


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.HoistLastTokenGather")
class HoistLastTokenGather:
    def __init__(self, functions: list[str]):
        self.functions = functions

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        for name in self.functions:
            mod = hoist_function(mod, name)
        return mod
