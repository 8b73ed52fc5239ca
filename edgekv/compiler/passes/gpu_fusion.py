"""GPU builds only: rewrite the block-step functions so that TVM's FuseOps puts more into each
kernel — on a GPU every kernel is a launch, and a decode token of a small model is mostly launches.

Two rewrites, each leaving every value computed as before (same operations, same order within
an element; only how the operations are grouped into kernels changes):

* **Quantised GEMVs on the activations' own shape.** torch.export writes ``linear`` on a
  ``[1, T, K]`` activation as ``reshape → [T, K]``, the matmul, ``reshape → [1, T, N]``; the
  quantised GPU matmul (``kernels/quant_dense.build_gpu_quant_matmul``) then sits between two
  reshapes. FuseOps fuses only elementwise consumers into a matmul's epilogue, and a reshape is
  not one, so the residual add after ``o_proj`` / ``down_proj`` and the SiLU·up product after
  ``up_proj`` each became a kernel of their own. Here the matmul takes the ``[1, T, K]``
  activation and writes ``[1, T, N]`` (a kernel of the same definition over a leading 1), both
  reshapes go, and those elementwise ops join the matmul as its epilogue (dlight's GEMV and
  Matmul rules schedule epilogues). Decode GEMVs only (T = 1): the prefill GEMMs keep their
  reshapes, as dlight's Matmul rule with a fused epilogue ran them 3x slower on PoCL, and a
  GEMM's launch is shared by a whole block.
* **RMSNorm as one operator.** HF's ``w · (x · rsqrt(mean(x², -1) + eps))`` chain became two
  kernels (FuseOps does not fuse the square into the mean's reduction); ``nn.rms_norm`` computes
  the same expression (the sum of squares over the row, / K, + eps, rsqrt, · x, · w) in one.

``FuseForGPU.folded`` counts the rewrites (for the manifest and tests)."""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from ..kernels.quant_dense import build_gpu_quant_matmul
from ..quant_formats import Q4_1, Q8_0
from ..relax_util import SKIP, rebuild_function
from .attention_sites import _arg_vars, op_name, shape_of

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _quant_matmul(value) -> tuple[Any, int, int] | None:
    """(format, K, N) of a call to a quantised GPU matmul (``QuantizeWeights(gpu=True)``), else None."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
        return None
    name = value.args[0].name_hint
    if not (name.startswith("matmul_") and name.endswith("_gpu") and ("_gemv_" in name or "_gemm_" in name)):
        return None
    args = list(value.args[1].fields)
    dtype = str(args[1].ty.dtype)
    fmt = {"uint8": Q4_1, "int8": Q8_0}.get(dtype)
    xs, out = shape_of(args[0]), shape_of(value)
    if fmt is None or xs is None or out is None or (len(args) == 4) != fmt.has_min:
        return None
    return fmt, xs[-1], out[-1]


def _const(e) -> float | None:
    """The value of a scalar constant, else None."""
    if type(e).__name__ not in ("Constant", "GenericConst"):
        return None
    arr = (e.value if hasattr(e, "value") else e.data).numpy()
    return float(arr.reshape(())) if arr.size == 1 else None


def _rms_norm_chain(value, defs: dict) -> tuple[Any, Any, float] | None:
    """(x, weight, eps) when ``value`` ends HF's RMSNorm over the last axis,
    ``w · (x · rsqrt(mean(x², -1) + eps))`` (either operand order of the outer products), else None."""
    if op_name(value) != "relax.multiply":
        return None
    for inner, w in (value.args, value.args[::-1]):
        v = defs.get(inner)
        if op_name(v) != "relax.multiply" or not isinstance(w, relax.Var) or w in defs:
            continue  # the weight is a function input (a parameter), not a computed value
        for x, r in (v.args, v.args[::-1]):
            rs = defs.get(r)
            if op_name(rs) != "relax.rsqrt":
                continue
            add = defs.get(rs.args[0])
            if op_name(add) != "relax.add":
                continue
            mean, eps = add.args
            m = defs.get(mean)
            if op_name(m) != "relax.mean" or _const(eps) is None:
                continue
            sq = defs.get(m.args[0])
            if not (op_name(sq) == "relax.power" and sq.args[0].same_as(x) and _const(sq.args[1]) == 2.0):
                continue
            xs = shape_of(x)
            if (xs is None or [int(a) for a in m.attrs.axis] not in ([-1], [len(xs) - 1]) or not m.attrs.keepdims
                    or shape_of(w) != xs[-1:]):
                continue
            return x, w, _const(eps)
    return None


class _Plan:
    """What to rewrite in one function: found before it is rebuilt (bindings come in order)."""

    def __init__(self, func: relax.Function):
        self.value: dict = {}  # var → bound value
        self.uses: dict = {}  # var → [(binding var, value)]
        for block in func.body.blocks:
            for b in block.bindings:
                self.value[b.var] = b.value
                for a in _arg_vars(b.value):
                    self.uses.setdefault(a, []).append((b.var, b.value))
        for a in _arg_vars(func.body.body):
            self.uses.setdefault(a, []).append((None, None))
        self.matmuls: dict = {}  # matmul var → (activation var, format, K, N, out shape, reshape-after var)
        for var, value in self.value.items():
            q = _quant_matmul(value)
            if q is None:
                continue
            x2 = value.args[1].fields[0]
            x3 = self._reshape_source(x2)
            after = self.uses.get(var, [])
            if x3 is None or len(after) != 1 or op_name(after[0][1]) != "relax.reshape":
                continue
            xs3, out3 = shape_of(x3), shape_of(after[0][0])
            if xs3 is None or out3 is None or xs3[:-1] != out3[:-1] or xs3[-1] != q[1] or out3[-1] != q[2]:
                continue
            if xs3[-2] != 1:  # GEMVs only: dlight's Matmul rule with an epilogue made the prefill GEMMs
                continue      # 3x slower on PoCL (docs/results/opencl_launches.md); a GEMM's launch is amortised
            self.matmuls[var] = (x3, *q, out3, after[0][0])
        folded = set(self.matmuls)
        self.dropped = {v for v in self.value  # activation reshapes whose every use is a folded matmul
                        if op_name(self.value[v]) == "relax.reshape" and self.uses.get(v)
                        and all(u in folded for u, _ in self.uses[v])}
        self.aliases = {m[5]: var for var, m in self.matmuls.items()}  # reshape-after → the matmul

    def _reshape_source(self, x):
        v = self.value.get(x)
        if op_name(v) != "relax.reshape":
            return None
        src = v.args[0]
        return src if isinstance(src, relax.Var) else None


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.FuseForGPU")
class FuseForGPU:
    def __init__(self, functions: list[str]):
        self.functions = list(functions)
        self.folded: dict[str, int] = {"matmul_reshapes": 0, "rms_norms": 0}

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        kernels: dict = {}
        for name in self.functions:
            if name not in [gv.name_hint for gv in mod.get_global_vars()]:
                continue
            plan = _Plan(mod[name])
            mod = rebuild_function(mod, name, list(mod[name].params), self._rewriter(plan, kernels))
        # the reshaped matmuls' old kernels are no longer called: drop them (and nothing else)
        entries = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
        return relax.transform.DeadCodeElimination(entries)(mod)

    def _rewriter(self, plan: _Plan, kernels: dict):
        def rewrite(b, vmap, bb):
            if b.var in plan.dropped:
                return SKIP
            if b.var in plan.aliases:
                return vmap[plan.aliases[b.var]]
            if b.var in plan.matmuls:
                x3, fmt, K, N, out3, _ = plan.matmuls[b.var]
                xs3 = shape_of(x3)
                key = (fmt.name, xs3, K, N)
                if key not in kernels:
                    tag = "gemv" if xs3[-2] == 1 else "gemm"
                    # int64 extents, as LegalizeOps writes them: FuseTIR maps a fused neighbour's
                    # buffer onto this kernel's only when the two buffer types are equal
                    i64 = [tvm.tirx.IntImm("int64", x) for x in (*xs3, K, N)]
                    kernels[key] = bb.add_func(build_gpu_quant_matmul(i64[:-2], fmt, i64[-2], i64[-1]),
                                               f"matmul_{fmt.name}_{tag}_m{xs3[-2]}_k{K}_n{N}_gpu")
                weights = [vmap.get(a, a) for a in list(b.value.args[1].fields)[1:]]
                self.folded["matmul_reshapes"] += 1
                return bb.emit(relax.call_tir(kernels[key], [vmap.get(x3, x3), *weights],
                                              relax.TensorType(out3, "float32")), b.var.name)
            norm = _rms_norm_chain(b.value, plan.value)
            if norm is not None:
                x, w, eps = norm
                self.folded["rms_norms"] += 1
                # the chain's intermediate values lose their uses; DeadCodeElimination drops them
                return relax.op.nn.rms_norm(vmap.get(x, x), vmap.get(w, w), axes=[-1], epsilon=eps)
            return None

        return rewrite
