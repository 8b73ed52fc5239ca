"""GPU decode only: the combined gate / up GEMV (``combine_projections.py``) and the SiLU(gate) · up
product that follows it as one kernel. FuseOps cannot put that product into the GEMV's epilogue: it
reads two outputs of the GEMV (rows j and I + j), not one. Here one work-group computes both dot
products of its output j (a cross-work-item reduction over K for each) and writes
``g · sigmoid(g) · u`` — the model's operations in its order — so the decode MLP is two launches
(this and down_proj + the residual add) instead of three.

``FuseGateUpSiLU.fused`` counts the rewrites."""

from __future__ import annotations

import tvm
from tvm import relax

from ..kernels.quant_dense import _dequantized
from ..relax_util import SKIP, rebuild_function, rewrite_named_functions
from .attention_sites import _arg_vars, op_name, shape_of

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
THREADS = 64  # work-items per output (dlight's GEMV rule uses 64 on these targets too)


def build_gate_up_silu(fmt, K: int, I: int):
    """``out[0, 0, j] = silu(Σ_k a·Wg[j]) · Σ_k a·Wu[j]`` over the row-concatenated gate / up
    blocks (rows 0..I gate, I..2I up), scheduled: a work-group per output j, ``THREADS`` work-items
    splitting K, the two sums reduced across them."""
    from tvm import s_tir, te, tirx

    a = te.placeholder((1, 1, K), "float32", name="a")
    weights, value = _dequantized(fmt, K, 2 * I)
    r = te.reduce_axis((0, K), name="k")
    y = te.compute((2, I), lambda c, j: te.sum(a[0, 0, r] * value(c * I + j, r), axis=r), name="gate_up")
    gate = lambda j: y[0, j]  # noqa: E731
    out = te.compute((1, 1, I), lambda _b, _t, j: gate(j) * tirx.sigmoid(gate(j)) * y[1, j], name="silu_up")
    func = te.create_prim_func([a, *weights, out]).without_attr("global_symbol")
    sch = s_tir.Schedule(func)
    blk, epi = sch.get_sblock("gate_up"), sch.get_sblock("silu_up")
    j = sch.fuse(*sch.get_loops(epi))
    sch.bind(j, "blockIdx.x")
    sch.compute_at(blk, j)  # both sums of output j, under its work-group
    c, k = sch.get_loops(blk)[-2:]
    _, ki = sch.split(k, factors=[None, THREADS])
    sch.bind(ki, "threadIdx.x")  # the reduction across the work-items (TVM lowers it to an allreduce)
    sch.set_scope(blk, 0, "local")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


def _begin(slice_call) -> list[int] | None:
    """The begin offsets of a ``strided_slice`` (a tuple of prim values), else None."""
    begin = slice_call.args[2]
    try:
        return [int(f.value) for f in begin.fields]
    except (AttributeError, TypeError):
        return None


def _value(values, v):
    return values.get(v) if isinstance(v, relax.Var) else None


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.FuseGateUpSiLU")
class FuseGateUpSiLU:
    def __init__(self, functions: list[str]):
        self.functions = list(functions)
        self.fused = 0

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return rewrite_named_functions(mod, self.functions, self._rewrite)

    def _rewrite(self, mod, name):
        from ..quant_formats import Q4_1, Q8_0

        func = mod[name]
        values = {}
        for block in func.body.blocks:
            for b in block.bindings:
                values[b.var] = b.value
        found = {}  # product var → (x, weights, fmt, K, I)

        def through_reshape(v):
            val = _value(values, v)
            return val.args[0] if op_name(val) == "relax.reshape" else v

        for var, val in values.items():
            if op_name(val) != "relax.multiply":
                continue
            for m, u3 in (val.args, val.args[::-1]):
                mv = _value(values, m)
                if op_name(mv) != "relax.multiply":
                    continue
                g3, s = mv.args
                sv = _value(values, s)
                if op_name(sv) != "relax.sigmoid" or not sv.args[0].same_as(g3):
                    continue
                gs, us = _value(values, through_reshape(g3)), _value(values, through_reshape(u3))
                if op_name(gs) != "relax.strided_slice" or op_name(us) != "relax.strided_slice":
                    continue
                y = gs.args[0]
                if not us.args[0].same_as(y):
                    continue
                call = _value(values, y)
                if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
                    continue
                args = list(call.args[1].fields)
                fmt = {"uint8": Q4_1, "int8": Q8_0}.get(str(args[1].ty.dtype))
                xs, ys, out = shape_of(args[0]), shape_of(y), shape_of(var)
                if fmt is None or xs is None or ys is None or out is None or xs != (1, xs[-1]) or out[:-1] != (1, 1):
                    continue
                I = out[-1]
                g_slice, u_slice = _begin(gs), _begin(us)
                if ys != (1, 2 * I) or g_slice != [0] or u_slice != [I] or shape_of(through_reshape(g3)) != (1, I):
                    continue
                x = through_reshape(args[0])
                if shape_of(x) != (1, 1, xs[-1]):
                    continue
                found[var] = (x, args[1:], fmt, xs[-1], I)
                break
        if not found:
            return mod
        kernels = {}

        def rewrite(b, vmap, bb):
            if b.var not in found:
                return None
            x, ws, fmt, K, I = found[b.var]
            key = (fmt.name, K, I)
            if key not in kernels:
                kernels[key] = bb.add_func(build_gate_up_silu(fmt, K, I), f"gate_up_silu_{fmt.name}_k{K}_i{I}_gpu")
            self.fused += 1
            return relax.call_tir(kernels[key], [vmap.get(x, x), *[vmap.get(w, w) for w in ws]],
                                  relax.TensorType((1, 1, I), "float32"))

        return rebuild_function(mod, name, list(func.params), rewrite)
