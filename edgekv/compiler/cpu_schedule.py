"""A first CPU schedule for the legalized GEMMs (runs inside the Relax pipeline, after FuseTIR).

TVM's default CPU lowering runs every legalized ``matmul`` as a scalar, single-threaded
i-j-k loop nest (~1 GFLOP/s here); on SmolLM2 the GEMMs were 97 % of a compiled block. This
pass schedules each PrimFunc whose only block is a 2-D/3-D matmul-like reduction
``C[.., i, j] += A[.., i, k] * W[.., k, j]`` (spatial..., reduction last):

    parallel(fused outer spatial, j-outer) → k → i-inner (unrolled) → j-inner (vectorized)

with the reduction's init split off. Anything that does not fit is left untouched (the
schedule is attempted on a copy and dropped on any error), so it never changes results —
only speed. Weight pre-packing, register blocking proper and attention schedules are later work.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

VEC = 16  # fp32 lanes of one AVX-512 register
JTILE = 32
ITILE = 4


def _int(x) -> int | None:
    try:
        return int(x)
    except TypeError:
        return None


def schedule_matmul(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    root = sch.get_sblock("root") if _has_root(sch) else None
    blocks = sch.get_child_blocks(root) if root is not None else []
    if len(blocks) != 1:
        return None
    block = blocks[0]
    stmt = sch.get(block)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    if len(kinds) < 3 or kinds[-1] != tirx.IterVar.CommReduce or any(k != tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    if stmt.init is None:
        return None
    loops = sch.get_loops(block)
    if len(loops) != len(kinds):
        return None
    extents = [_int(sch.get(l).extent) for l in loops]
    if any(e is None for e in extents):
        return None
    *outer, i, j, k = loops
    ei, ej = extents[-3], extents[-2]
    if ej % JTILE:
        return None
    jo, ji = sch.split(j, factors=[None, JTILE])
    if ei % ITILE == 0 and ei >= ITILE:
        io, ii = sch.split(i, factors=[None, ITILE])
        sch.reorder(*outer, io, jo, k, ii, ji)
        par = sch.fuse(*outer, io, jo)
        sch.unroll(ii)
    else:
        sch.reorder(*outer, i, jo, k, ji)
        par = sch.fuse(*outer, i, jo)
    ji_o, ji_i = sch.split(ji, factors=[None, VEC])
    sch.vectorize(ji_i)
    sch.parallel(par)
    sch.decompose_reduction(block, k)
    return sch.mod["main"]


def schedule_nt_matmul(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """``C[i, j] += A[i, k] * W[j, k]`` (what FuseTransposeMatmul makes of a tied LM head):
    both operands are contiguous in k, so run dot products, parallel over the output."""
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        return None
    block = blocks[0]
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    loops = sch.get_loops(block)
    if len(loops) != len(kinds) or kinds[-1] != tirx.IterVar.CommReduce:
        return None
    par = sch.fuse(*loops[:-1])
    sch.parallel(par)
    return sch.mod["main"]


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.ScheduleCPUMatmul")
class ScheduleCPUMatmul:
    def __init__(self):
        self.scheduled: list[str] = []

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or "matmul" not in gv.name_hint:
                continue
            try:
                new = schedule_nt_matmul(func) if gv.name_hint.startswith("NT_matmul") else schedule_matmul(func)
            except Exception:  # noqa: BLE001 - an unschedulable function stays as it was
                new = None
            if new is not None:
                updates[gv] = new.with_attr("tirx.is_scheduled", True)
                self.scheduled.append(gv.name_hint)
        for gv, func in updates.items():
            mod[gv] = func
        return mod


def cpu_pipeline(target):
    """The Relax CPU pipeline of TVM 0.27 with ``ScheduleCPUMatmul`` after FuseTIR."""
    from tvm.relax.backend.cpu_generic import pipeline as P

    @tvm.transform.module_pass(opt_level=0, name="edgekv.CPUPipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(
                P.library_dispatch_passes(target) + [relax.transform.FuseTransposeMatmul()]
                + P.legalize_passes(target) + [ScheduleCPUMatmul()]
                + P.dataflow_lower_passes(target) + P.finalize_passes(target))
            return seq(mod)

    return _pipeline
