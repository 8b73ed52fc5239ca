"""GPU decode only: RMSNorm folded into the quantised GEMV that reads it, with the GEMV's consumers in
the same kernel (``kernels/norm_gemv.py``). Runs after ``FuseForGPU`` (which makes HF's RMSNorm chain
one ``nn.rms_norm``) and ``FuseGateUpSiLU``. Two rewrites, each where TVM's fusion leaves several
launches:

* ``rms_norm → reshape → q/k/v GEMV → three slices → (reshape, reshape, permute) → RoPE on q and k``
  (the combined projection of ``combine_projections.py``, torch.export's RoPE chain
  ``x · cos + concat(−x[d/2:], x[:d/2]) · sin``): one ``norm_qkv_rope`` kernel writing q, k
  (rotated) and v in the ``[1, heads, 1, d]`` layout the attention reads — five launches to one;
* ``rms_norm → gate_up_silu`` (``gate_up_silu.py``): one ``norm_gate_up_silu`` kernel — two to one.

Only where every intermediate value has no other use; anything else stays as it is.
``FuseNormIntoGEMV.fused`` counts the rewrites by kind."""

from __future__ import annotations

import tvm
from tvm import relax

from ..kernels.norm_gemv import build_norm_gate_up_silu_gpu, build_norm_qkv_rope_gpu
from ..quant_formats import Q4_1, Q8_0
from ..relax_util import SKIP, rebuild_function, rewrite_named_functions
from .attention_sites import _arg_vars, op_name, shape_of

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _ints(tup) -> list[int] | None:
    try:
        return [int(f.value) for f in tup.fields]
    except (AttributeError, TypeError):
        return None


class _Graph:
    def __init__(self, func: relax.Function):
        self.value: dict = {}
        self.uses: dict = {}
        self.order: dict = {}  # var → its binding's index (a parameter: absent, i.e. first)
        for block in func.body.blocks:
            for b in block.bindings:
                self.value[b.var] = b.value
                self.order[b.var] = len(self.order)
                for a in _arg_vars(b.value):
                    self.uses.setdefault(a, []).append(b.var)
        for a in _arg_vars(func.body.body):
            self.uses.setdefault(a, []).append(None)

    def of(self, v):
        return self.value.get(v) if isinstance(v, relax.Var) else None

    def only_use(self, v):
        u = self.uses.get(v, [])
        return u[0] if len(u) == 1 else None

    def rms_norm(self, v):
        """(x, weight, eps) when ``v`` is ``nn.rms_norm(x [1, 1, K], w [K])`` over the last axis."""
        val = self.of(v)
        if op_name(val) != "relax.nn.rms_norm":
            return None
        x, w = val.args[0], val.args[1]
        xs = shape_of(x)
        if xs is None or len(xs) != 3 or xs[:2] != (1, 1) or [int(a) for a in val.attrs.axes] not in ([-1], [2]):
            return None
        return x, w, float(val.attrs.epsilon)


def _fmt(weights) -> object | None:
    fmt = {"uint8": Q4_1, "int8": Q8_0}.get(str(weights[0].ty.dtype))
    if fmt is None or len(weights) != (3 if fmt.has_min else 2):
        return None
    return fmt


def _head_view(g: _Graph, sl, chain: list):
    """The ``[1, h, 1, d]`` permuted view of a slice (reshape [1, 1, n] → reshape [1, 1, h, d] →
    permute [0, 2, 1, 3]), each step the only use of the one before; appends the steps to ``chain``."""
    r1 = g.only_use(sl)
    if r1 is None or op_name(g.of(r1)) != "relax.reshape":
        return None
    r2 = g.only_use(r1)
    if r2 is None or op_name(g.of(r2)) != "relax.reshape":
        return None
    p = g.only_use(r2)
    pv = g.of(p) if p is not None else None
    if op_name(pv) != "relax.permute_dims" or [int(a) for a in pv.attrs.axes] != [0, 2, 1, 3]:
        return None
    s = shape_of(p)
    if s is None or len(s) != 4 or s[0] != 1 or s[2] != 1:
        return None
    chain += [r1, r2]
    return p


def _rope(g: _Graph, t, chain: list):
    """(out, cos, sin) when ``t``'s uses are exactly HF's RoPE chain ending in ``out``:
    ``t·cos + concat(−t[..., d/2:], t[..., :d/2]) · sin``; appends the chain's steps (and t)."""
    d = shape_of(t)[-1]
    uses = g.uses.get(t, [])
    if len(uses) != 3:
        return None
    mul = hi = lo = None
    for u in uses:
        val = g.of(u)
        if op_name(val) == "relax.multiply" and val.args[0].same_as(t):
            mul = u
        elif op_name(val) == "relax.strided_slice" and _ints(val.args[1]) in ([3], [-1]):
            b, e = _ints(val.args[2]), _ints(val.args[3])
            if b == [d // 2] and e is not None and e[0] >= d:
                hi = u
            elif b == [0] and e == [d // 2]:
                lo = u
    if None in (mul, hi, lo):
        return None
    cos = g.of(mul).args[1]
    neg = g.only_use(hi)
    if neg is None or op_name(g.of(neg)) != "relax.negative":
        return None
    cat = g.only_use(neg)
    if cat is None or g.only_use(lo) != cat:
        return None
    cv = g.of(cat)
    if op_name(cv) != "relax.concat" or int(cv.attrs.axis) not in (-1, 3):
        return None
    parts = list(cv.args[0].fields) if isinstance(cv.args[0], relax.Tuple) else None
    if parts is None or len(parts) != 2 or not parts[0].same_as(neg) or not parts[1].same_as(lo):
        return None
    ms = g.only_use(cat)
    msv = g.of(ms) if ms is not None else None
    if op_name(msv) != "relax.multiply" or not msv.args[0].same_as(cat):
        return None
    sin = msv.args[1]
    out = g.only_use(mul)
    ov = g.of(out) if out is not None else None
    if op_name(ov) != "relax.add" or g.only_use(ms) != out:
        return None
    if not ((ov.args[0].same_as(mul) and ov.args[1].same_as(ms)) or (ov.args[0].same_as(ms) and ov.args[1].same_as(mul))):
        return None
    for v in (cos, sin):
        if shape_of(v) != (1, 1, 1, d):
            return None
    chain += [t, mul, hi, lo, neg, cat, ms]
    return out, cos, sin


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.FuseNormIntoGEMV")
class FuseNormIntoGEMV:
    def __init__(self, functions: list[str]):
        self.functions = list(functions)
        self.fused = {"norm_qkv_rope": 0, "norm_gate_up_silu": 0}

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return rewrite_named_functions(mod, self.functions, self._rewrite)

    def _qkv(self, g: _Graph, y, val):
        """The plan of the q/k/v rewrite at GEMV ``y``, else None."""
        name = val.args[0].name_hint
        if not (name.startswith("matmul_") and name.endswith("_gpu") and "_gemv_" in name):
            return None
        args = list(val.args[1].fields)
        fmt = _fmt(args[1:])
        x2 = args[0]
        rv = g.of(x2)
        if fmt is None or op_name(rv) != "relax.reshape" or g.only_use(x2) is None:
            return None
        nrm = rv.args[0]
        norm = g.rms_norm(nrm)
        if norm is None or g.only_use(nrm) != x2:
            return None
        x, w, eps = norm
        K = shape_of(x)[-1]
        uses = g.uses.get(y, [])
        slices = {}
        for u in uses:
            sv = g.of(u)
            if op_name(sv) != "relax.strided_slice" or _ints(sv.args[1]) != [1]:
                return None
            b, e = _ints(sv.args[2]), _ints(sv.args[3])
            if b is None or e is None:
                return None
            slices[b[0]] = (u, e[0])
        if len(slices) != 3 or 0 not in slices:
            return None
        chain = [nrm, x2, *[u for u, _ in slices.values()]]
        (sq, eq), = [slices[0]]
        qv = _head_view(g, sq, chain)
        if qv is None or eq not in slices:
            return None
        sk, ek = slices[eq]
        kv = _head_view(g, sk, chain)
        if kv is None or ek not in slices:
            return None
        svv, ev = slices[ek]
        vv = _head_view(g, svv, chain)
        N = shape_of(y)[-1]
        if vv is None or ev != N:
            return None
        (_, Hq, _, D), (_, H, _, Dk), (_, Hv, _, Dv) = shape_of(qv), shape_of(kv), shape_of(vv)
        if not (D == Dk == Dv and H == Hv and eq == Hq * D and ek == (Hq + H) * D and D % 2 == 0):
            return None
        rq = _rope(g, qv, chain)
        rk = _rope(g, kv, chain)
        if rq is None or rk is None or not (rq[1].same_as(rk[1]) and rq[2].same_as(rk[2])):
            return None
        if any(g.order.get(v, -1) > g.order[y] for v in (x, w, rq[1], rq[2])):
            return None  # the fused kernel is emitted where the GEMV was: its inputs must exist there
        chain.append(vv)  # aliased, not dropped
        return dict(x=x, w=w, eps=eps, weights=args[1:], fmt=fmt, K=K, Hq=Hq, H=H, D=D, cos=rq[1], sin=rq[2],
                    outs=(rq[0], rk[0], vv), drop=[c for c in chain if c is not vv])

    def _gate_up(self, g: _Graph, z, val):
        name = val.args[0].name_hint
        if not (name.startswith("gate_up_silu_") and name.endswith("_gpu")):
            return None
        args = list(val.args[1].fields)
        fmt = _fmt(args[1:])
        norm = g.rms_norm(args[0])
        if fmt is None or norm is None or g.only_use(args[0]) != z:
            return None
        x, w, eps = norm
        return dict(x=x, w=w, eps=eps, weights=args[1:], fmt=fmt, K=shape_of(x)[-1], I=shape_of(z)[-1],
                    drop=[args[0]])

    def _rewrite(self, mod, name):
        g = _Graph(mod[name])
        qkv, gate_up = {}, {}
        for var, val in g.value.items():
            if isinstance(val, relax.Call) and val.op.same_as(_CALL_TIR):
                plan = self._qkv(g, var, val)
                if plan is not None:
                    qkv[var] = plan
                    continue
                plan = self._gate_up(g, var, val)
                if plan is not None:
                    gate_up[var] = plan
        if not qkv and not gate_up:
            return mod
        drop = {v for p in [*qkv.values(), *gate_up.values()] for v in p["drop"]}
        alias = {}  # an output var of the chain → (the plan's GEMV var, index)
        for y, p in qkv.items():
            for i, o in enumerate(p["outs"]):
                alias[o] = (y, i)
        kernels: dict = {}
        fused: dict = {}

        def sub(v, vmap):
            return vmap.get(v, v)

        def rewrite(b, vmap, bb):
            if b.var in drop:
                return SKIP
            if b.var in alias:
                y, i = alias[b.var]
                return relax.TupleGetItem(fused[y], i)
            if b.var in qkv:
                p = qkv[b.var]
                key = ("qkv", p["fmt"].name, p["K"], p["Hq"], p["H"], p["D"], p["eps"])
                if key not in kernels:
                    kernels[key] = bb.add_func(
                        build_norm_qkv_rope_gpu(p["fmt"], p["K"], p["Hq"], p["H"], p["D"], p["eps"]),
                        f"norm_qkv_rope_{p['fmt'].name}_k{p['K']}_h{p['Hq']}_{p['H']}_d{p['D']}_gpu")
                shapes = [(1, p["Hq"], 1, p["D"]), (1, p["H"], 1, p["D"]), (1, p["H"], 1, p["D"])]
                call = relax.call_tir(kernels[key], [sub(p["x"], vmap), sub(p["w"], vmap),
                                                     *[sub(a, vmap) for a in p["weights"]],
                                                     sub(p["cos"], vmap), sub(p["sin"], vmap)],
                                      [relax.TensorType(s, "float32") for s in shapes])
                fused[b.var] = bb.emit(call, "qkv_rope")
                self.fused["norm_qkv_rope"] += 1
                return fused[b.var]
            if b.var in gate_up:
                p = gate_up[b.var]
                key = ("gate_up", p["fmt"].name, p["K"], p["I"], p["eps"])
                if key not in kernels:
                    kernels[key] = bb.add_func(build_norm_gate_up_silu_gpu(p["fmt"], p["K"], p["I"], p["eps"]),
                                               f"norm_gate_up_silu_{p['fmt'].name}_k{p['K']}_i{p['I']}_gpu")
                self.fused["norm_gate_up_silu"] += 1
                return relax.call_tir(kernels[key], [sub(p["x"], vmap), sub(p["w"], vmap),
                                                     *[sub(a, vmap) for a in p["weights"]]],
                                      relax.TensorType((1, 1, p["I"]), "float32"))
            return None

        return rebuild_function(mod, name, list(mod[name].params), rewrite)
