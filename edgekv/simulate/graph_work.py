"""Work counted from a compiled module's own graph (needs TVM): FLOPs and bytes moved per call
of ``prefill_block`` and ``decode``.

The Relax functions are legalised (every operator becomes a ``call_tir`` of a TIR PrimFunc,
the custom eviction and attention kernels already are); FLOPs are TVM's own
``estimate_tir_flops`` of each called PrimFunc, bytes are the sizes of each call's input and
output tensors (weights, caches and intermediates, read or written once per call: an upper
bound on traffic before operator fusion, as no result stays on chip between kernels). Static
shapes make both constant per call. The compiler can store the result in the artifact's
manifest as ``"work"`` (see ``work.work_from_manifest``)."""

from __future__ import annotations

import numpy as np


def _nbytes(sinfo) -> int:
    """Bytes of a tensor struct info (or the sum over a tuple's fields); 0 when symbolic."""
    fields = getattr(sinfo, "fields", None)
    if fields is not None:
        return sum(_nbytes(f) for f in fields)
    shape = getattr(sinfo, "shape", None)
    dtype = getattr(sinfo, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        dims = [int(x) for x in shape.values]
    except (TypeError, AttributeError, ValueError):
        return 0
    return int(np.prod(dims, dtype=np.int64)) * np.dtype(str(dtype)).itemsize


def _type_of(expr):
    for attr in ("ty", "struct_info", "checked_type"):
        try:
            t = getattr(expr, attr, None)
        except Exception:  # noqa: BLE001 - some TVM versions raise for an unset type
            t = None
        if t is not None:
            return t
    return None


def count_function(mod, name: str) -> dict:
    """{"flops", "bytes", "kernels", "unestimated": [...]} for one Relax function of ``mod``."""
    import tvm
    from tvm import relax
    from tvm.s_tir.analysis import estimate_tir_flops

    legal = relax.transform.LegalizeOps()(tvm.IRModule({name: mod[name], **{gv.name_hint: f for gv, f in mod.functions.items()
                                                                            if isinstance(f, tvm.tirx.PrimFunc)}}))
    func = legal[name]
    call_tir_ops = {tvm.ir.Op.get("relax.call_tir")}
    for extra in ("relax.call_tir_inplace", "relax.call_tir_with_grad"):
        try:
            call_tir_ops.add(tvm.ir.Op.get(extra))
        except Exception:  # noqa: BLE001 - op not registered in this TVM
            pass
    flops = 0.0
    nbytes = 0
    kernels = 0
    unestimated: list[str] = []
    cache: dict[str, float | None] = {}

    def visit(expr) -> None:
        nonlocal flops, nbytes, kernels
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for b in block.bindings:
                    visit(b.value)
            return
        if isinstance(expr, relax.If):
            visit(expr.true_branch)
            return
        if not isinstance(expr, relax.Call) or expr.op not in call_tir_ops:
            return
        gv = expr.args[0]
        kernels += 1
        key = gv.name_hint
        if key not in cache:
            try:
                cache[key] = float(estimate_tir_flops(tvm.IRModule({"main": legal[gv]})))
            except Exception:  # noqa: BLE001 - data-dependent loops, extern calls
                cache[key] = None
        if cache[key] is None:
            unestimated.append(key)
        else:
            flops += cache[key]
        args = expr.args[1]
        for a in getattr(args, "fields", [args]):
            nbytes += _nbytes(_type_of(a))
        nbytes += _nbytes(_type_of(expr))

    visit(func.body)
    return {"flops": flops, "bytes": nbytes, "kernels": kernels, "unestimated": sorted(set(unestimated))}


def count_module(mod) -> dict:
    """The manifest's ``"work"`` entry for a lowered edgekv module."""
    out = {name: count_function(mod, name) for name in ("prefill_block", "decode")}
    out["method"] = ("legalised Relax graph: FLOPs from TVM estimate_tir_flops per kernel, bytes = each "
                     "kernel's input + output tensors (unfused upper bound)")
    return out
