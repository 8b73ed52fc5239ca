"""OpenCL: no vector gather of 8-bit integers (a schedule fix applied after dlight).

TVM's C code generator prints a vector load of int8/uint8 lanes that is not one contiguous run
(a gather, or a strided run) by packing the lanes into an ``int`` with shifts — CUDA's
``char4`` idiom. In OpenCL C that is invalid: ``(int) >> (uchar8)`` does not compile ("requested
shift is a vector of type 'uchar8' but the first operand is not a vector"). dlight's Android
schedules (chosen when the target's host triple names ``android``, i.e. ``--target opencl``)
vectorise the q4 dequantisation 8-wide, and q4 quants are read at ``k // 2`` (two nibbles a
byte): a gather. The x86 host form (``opencl-host``) gets dlight's generic schedules, which do
not vectorise there, so its source built and the phone's did not.

``DevectorizeByteGathers`` keeps every vectorised loop whose 8-bit reads are contiguous (or
invariant) along it, and turns the others into unrolled loops: the same work per thread, scalar
byte loads, valid OpenCL C. It runs on OpenCL targets only (CUDA's code generator handles the
packed form)."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.sym import detect_linear_equation


def _coefficient(expr, var) -> int | None:
    """The constant coefficient of ``var`` in ``expr`` when ``expr`` is linear in it, else None."""
    coeffs = detect_linear_equation(expr, [var])
    if len(coeffs) != 2 or not isinstance(coeffs[0], tirx.IntImm):
        return None
    return int(coeffs[0].value)


def _byte_read_is_gather(region, block_vars, steps) -> bool:
    """Whether reading ``region`` as the loop steps (block var → its step along the loop) is
    anything but one contiguous run (or the same element)."""
    last = len(region) - 1
    for dim, rng in enumerate(region):
        coeffs = detect_linear_equation(rng.min, block_vars)
        if len(coeffs) != len(block_vars) + 1:
            return True  # not linear in the block's iterators (k // 2): a gather
        step = 0
        for c, s in zip(coeffs[:-1], steps):
            if s == 0:
                continue
            if not isinstance(c, tirx.IntImm):
                return True
            step += int(c.value) * s
        if step != (1 if dim == last else 0) and not (dim == last and step == 0):
            return True
    return False


def _is_byte_int(dtype) -> bool:
    d = str(dtype)
    return d in ("int8", "uint8")


def devectorize_byte_gathers(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, int]:
    """``func`` with every vectorised loop over a gathered 8-bit read unrolled instead, and how many."""
    sch = s_tir.Schedule(func)
    changed = 0
    stack = list(sch.get_child_blocks(sch.get_sblock("root"))) if _has_root(sch) else []
    while stack:
        block = stack.pop()
        stack.extend(sch.get_child_blocks(block))
        stmt = sch.get(block)
        reads = [r for r in stmt.reads if _is_byte_int(r.source.dtype)]
        if not reads:
            continue
        realize = get_sblockrealize(sch, block)
        block_vars = [iv.var for iv in stmt.iter_vars]
        for loop in sch.get_loops(block):
            node = sch.get(loop)
            if node.kind != tirx.ForKind.VECTORIZED:
                continue
            steps = [_coefficient(v, node.loop_var) for v in realize.iter_values]
            gather = any(s is None for s in steps) or any(
                _byte_read_is_gather(r.region, block_vars, steps) for r in reads)
            if gather:
                sch.unroll(loop)
                changed += 1
    return sch.mod["main"], changed


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001 - a PrimFunc without a root block (hand-written, no blocks)
        return False


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.DevectorizeByteGathers")
class DevectorizeByteGathers:
    """The module pass: ``devectorized`` records ``{PrimFunc: loops unrolled}``."""

    def __init__(self):
        self.devectorized: dict[str, int] = {}

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or "T.vectorized" not in func.script():
                continue
            new, n = devectorize_byte_gathers(func)
            if n:
                updates[gv] = new
                self.devectorized[gv.name_hint] = n
        for gv, func in updates.items():
            mod[gv] = func
        return mod
