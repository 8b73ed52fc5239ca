"""CPU schedules for the legalized kernels, organised like TVM's ``s_tir.dlight``: one *rule*
per kernel kind, tried in order by one pass (``ScheduleCPU``, run inside the Relax pipeline
after FuseTIR, selected for ``llvm`` targets by ``compiler/pipeline.py``). A rule looks at one PrimFunc and
returns a scheduled replacement or ``None``; the first rule that answers wins, and anything no
rule takes (or that fails to schedule: the attempt runs on a copy) stays as it was.

TVM's default CPU lowering runs every legalized ``matmul`` as a scalar, single-threaded
i-j-k loop nest (~1 GFLOP/s here). The rules, in order:

* ``DenseRule``: ``C[(1,) M, N] = A[(1,) M, K] · W[K, N]`` (the pretransposed linear layers,
  prefill GEMMs and decode GEMVs) → the register-blocked kernel of ``kernels/dense.py``
  (parallel over weight panels, MR × NR accumulators in zmm registers, each weight panel
  streamed once per call; M = 1, the decode GEMV: split-K, each task streaming whole rows of
  W — one sequential stream — and the partial rows summed); and ``… · W[N, K]ᵀ`` (the tied LM head after FuseTransposeMatmul)
  → 16-lane partial-sum dot products, 4 columns per step, the table streamed once;
* ``MatmulRule``: any other 2-D/3-D matmul-like reduction ``C[.., i, j] += A[.., i, k] *
  W[.., k, j]`` (odd sizes) → parallel(fused outer, j-outer) → k → i-inner (unrolled) →
  j-inner (vectorized);
* ``NTMatmulRule``: other ``NT_matmul`` functions (K not a multiple of 16) → scalar dot
  products, parallel over the output;
* ``ElementwiseRule``: everything else FuseOps/FuseTIR made (reshapes, RoPE, RMSNorm, SiLU·mul)
  → inline every block that can be, parallel + 16-lane vectorised over the spatial loops
  (``schedule_elementwise``); ``T.sigmoid`` is lowered with a polynomial exp (below).

The hand-written TIR kernels (block attention, eviction score/select) carry their schedule in
their own code (parallel outer loops, vector lanes) and are not touched here.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

VEC = 16  # fp32 lanes of one AVX-512 register


def _lower_sigmoid(call):
    """``T.sigmoid`` as 1 / (1 + e^−x) with the polynomial exp of ``kernels.attention.vexp``:
    LLVM turns the default lowering's ``exp`` into one libm ``expf`` call per lane (SiLU was
    ~2.5 ns per element; ~5× faster so). |error| ≤ 1e-7 absolute."""
    from ..kernels.attention import vexp

    x = call.args[0]
    dt = str(x.ty)
    one = tirx.const(1.0, dt)
    return one / (one + vexp(tirx.const(0.0, dt) - x))


# process-wide for ``llvm`` targets (an intrinsic lowering cannot be scoped to one build); level
# 99 takes precedence over TVM's default rule
tirx.op.register_intrin_lowering("tirx.sigmoid", "llvm", f=_lower_sigmoid, level=99)
JTILE = 32
MIN_PARALLEL_WORK = 1 << 14  # loop iterations below which an elementwise kernel stays serial
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


def schedule_elementwise(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """A fused elementwise / norm / RoPE kernel (what FuseOps + FuseTIR make of the reshapes,
    transposes, casts, RMSNorm and SiLU·mul around the GEMMs). Legalized, every op of the group
    is its own loop nest writing a full-size temporary, single-threaded; here every block that
    can be inlined is (the temporaries vanish), and each remaining one runs parallel over its
    spatial loops with a 16-lane vectorised innermost loop where the extent allows (a block
    with a reduction — RMSNorm's mean — keeps its reduction loop serial inside)."""
    from tvm import s_tir
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base import try_inline

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    infos = normalize_prim_func(sch)
    if not infos:
        return None
    infos = try_inline(sch, list(infos))
    for info in infos:
        block = info.block_rv
        loops = sch.get_loops(block)
        kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
        if len(loops) != len(kinds):
            return None
        spatial = [l for l, k in zip(loops, kinds) if k == tirx.IterVar.DataPar]
        reduce_ = [l for l, k in zip(loops, kinds) if k != tirx.IterVar.DataPar]
        if not spatial or (reduce_ and loops.index(reduce_[0]) < len(spatial)):
            return None  # a reduction loop outside a spatial one: leave the function alone
        work = 1
        for l in loops:
            work *= _int(sch.get(l).extent) or 0
        fused = sch.fuse(*spatial)
        extent = _int(sch.get(fused).extent)
        if extent is None:
            return None
        # a parallel region costs a few µs to wake the pool: not worth it for decode's
        # one-row kernels (hundreds of them per token)
        parallel = work >= MIN_PARALLEL_WORK
        if not reduce_ and extent % VEC == 0 and extent >= 2 * VEC:
            outer, inner = sch.split(fused, factors=[None, VEC])
            if parallel:
                sch.parallel(outer)
            sch.vectorize(inner)
        elif extent > 1 and parallel:
            sch.parallel(fused)
    return sch.mod["main"]


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False


def match_dense(func: tirx.PrimFunc) -> tuple[tuple, tuple, tuple, bool] | None:
    """(A, W, C shapes, transposed) if ``func`` is exactly ``C[(0,) i, j] += A[(0,) i, k] * W[k, j]``
    (transposed = False) or ``… * W[j, k]`` (True: the NT form), fp32."""
    from tvm import s_tir

    if len(func.params) != 3:
        return None
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    if not _has_root(sch):
        return None
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        return None
    stmt = sch.get(blocks[0])
    iv = [v.var for v in stmt.iter_vars]
    kinds = [v.iter_type for v in stmt.iter_vars]
    if kinds[-1] != tirx.IterVar.CommReduce or any(k != tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    body = stmt.body
    if not (isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add)):
        return None
    C = body.buffer
    lhs, rhs = body.value.a, body.value.b
    if not (_loaded(lhs) is not None and _loaded(lhs).same_as(C) and isinstance(rhs, tirx.Mul)):
        return None
    la, lw = rhs.a, rhs.b
    A, W = _loaded(la), _loaded(lw)
    if A is None or W is None:
        return None
    # the function's parameters must be (A, W, C) in this order (the kernel's signature)
    if [b.name for b in (A, W, C)] != [p.name for p in func.params]:
        return None
    if any(str(b.dtype) != "float32" for b in (A, W, C)):
        return None
    shapes = [tuple(_int(d) for d in b.shape) for b in (A, W, C)]
    if any(d is None for sh in shapes for d in sh):
        return None
    a, w, c = shapes
    if len(w) != 2 or len(a) != len(c) or len(a) not in (2, 3) or (len(a) == 3 and (a[0] != 1 or c[0] != 1)):
        return None
    *_, vi, vj, vk = iv
    same = lambda idx, vars_: len(idx) == len(vars_) and all(x.same_as(v) for x, v in zip(idx, vars_))  # noqa: E731
    lead = iv[:-3]  # the extent-1 leading iter var of a 3-D matmul
    if len(lead) != len(a) - 2 or not (same(body.indices, lead + [vi, vj]) and same(la.indices, lead + [vi, vk])):
        return None
    if same(lw.indices, [vk, vj]):
        return a, w, c, False
    if same(lw.indices, [vj, vk]):
        return a, w, c, True
    return None


def _loaded(e):
    """The buffer a load expression reads (TVM 0.27 calls the node ``TensorLoad``), else None."""
    if type(e).__name__ not in ("TensorLoad", "BufferLoad"):
        return None
    src = getattr(e, "source", None)
    return src if src is not None else getattr(e, "buffer", None)


class Rule:
    """One kernel kind: ``apply(func, name)`` → scheduled PrimFunc or None (not this kind)."""

    name = "rule"

    def apply(self, func: tirx.PrimFunc, name: str) -> tirx.PrimFunc | None:
        raise NotImplementedError


class DenseRule(Rule):
    """``cores``: the target's thread count, which the register tile's panel width balances over."""

    name = "dense"

    def __init__(self, cores: int = 1):
        self.cores = max(1, int(cores))

    def apply(self, func, name):
        from ..kernels.dense import VEC, build_dense_kernel, build_dense_nt_kernel, build_gemv_kernel, dense_tiles

        m = match_dense(func)
        if m is None:
            return None
        a, w, c, nt = m
        if nt:
            return build_dense_nt_kernel(a, w, c) if a[-1] % VEC == 0 and w[0] % 4 == 0 else None
        if a[-2] == 1 and w[1] % VEC == 0:
            return build_gemv_kernel(a, w, c)  # decode: split-K, W streamed row-contiguously
        if dense_tiles(a[-2], a[-1], w[1], self.cores) is None:
            return None
        return build_dense_kernel(a, w, c, self.cores)


class MatmulRule(Rule):
    name = "matmul"

    def apply(self, func, name):
        return schedule_matmul(func) if "matmul" in name and not name.startswith("NT_matmul") else None


class NTMatmulRule(Rule):
    name = "nt_matmul"

    def apply(self, func, name):
        return schedule_nt_matmul(func) if name.startswith("NT_matmul") else None


class ElementwiseRule(Rule):
    """Everything else that FuseOps/FuseTIR produced (``fused_*`` and single legalized ops):
    inline, parallelise, vectorise (``schedule_elementwise``). The hand-written edgekv kernels
    carry ``tirx.is_scheduled`` or their own parallel loops and never reach a rule."""

    name = "elementwise"

    def apply(self, func, name):
        if "matmul" in name or "T.parallel(" in func.script():
            return None
        return schedule_elementwise(func)


def default_rules(cores: int = 1) -> tuple[Rule, ...]:
    """The rules in the order they are tried, for a target with ``cores`` threads."""
    return (DenseRule(cores), MatmulRule(), NTMatmulRule(), ElementwiseRule())


DEFAULT_RULES = default_rules()


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.ScheduleCPU")
class ScheduleCPU:
    """Apply the first matching rule to every not-yet-scheduled PrimFunc; ``scheduled`` records
    (function, rule) pairs."""

    def __init__(self, rules=DEFAULT_RULES):
        self.rules = tuple(rules)
        self.scheduled: list[tuple[str, str]] = []

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
                continue
            for rule in self.rules:
                try:
                    new = rule.apply(func, gv.name_hint)
                except Exception:  # noqa: BLE001 - an unschedulable function stays as it was
                    new = None
                if new is not None:
                    attrs = {k: v for k, v in func.attrs.items()} if func.attrs else {}
                    attrs.pop("global_symbol", None)
                    new = new.with_attr("tirx.is_scheduled", True)
                    for k, v in attrs.items():
                        if k not in ("tirx.noalias",):
                            new = new.with_attr(k, v)
                    updates[gv] = new
                    self.scheduled.append((gv.name_hint, rule.name))
                    break
        for gv, func in updates.items():
            mod[gv] = func
        return mod


ScheduleCPUMatmul = ScheduleCPU  # the first version's name


def target_cores(target) -> int:
    """The thread count an ``llvm`` target was built for (its ``num-cores``; 1 when unset)."""
    try:
        return max(1, int(target.attrs.get("num-cores", 1)))
    except Exception:  # noqa: BLE001 - a target without the attribute
        return 1


def cpu_pipeline(target):
    """The Relax CPU pipeline of TVM 0.27 with ``ScheduleCPU`` (the rules above) after FuseTIR."""
    from tvm.relax.backend.cpu_generic import pipeline as P

    @tvm.transform.module_pass(opt_level=0, name="edgekv.CPUPipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(
                P.library_dispatch_passes(target) + [relax.transform.FuseTransposeMatmul()]
                + P.legalize_passes(target) + [ScheduleCPU(default_rules(target_cores(target)))]
                + P.dataflow_lower_passes(target) + P.finalize_passes(target))
            return seq(mod)

    return _pipeline
