"""GPU builds only: sibling projections that read the same activation — q, k and v of a layer,
gate and up of its MLP — become one matmul over their weights concatenated along the output
dimension, and each old result a slice of its output. On a GPU every kernel is a launch; three
GEMVs of a decode token become one (the slices are injective and FuseOps puts each into its
consumer's kernel: RoPE for q and k, the SiLU·up product for gate and up).

Runs after the weight layout (step 5, ``pipeline.lay_out_weights``), on the arrays as they are
stored, so that the memory plan and the weights file see the combined inputs:

* quantised weights (``QuantizeWeights(gpu=True)``: row-blocked ``q``, ``d`` (and ``m``) arrays of
  ``N`` rows each, one row per output) are concatenated row-wise: every output row keeps its
  own blocks and scales, so each output is computed exactly as before (same blocks, same sum);
* fp32 weights (stored Wᵀ, ``[K, N]``) are concatenated along their columns.

Only weights that are function inputs, used by that one matmul in every function, with the same
siblings in every function, are combined. ``combine_params`` lays out the stored arrays to match
``CombineProjections.groups``; ``CombineProjections.combined`` counts the matmuls replaced."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..kernels.quant_dense import build_gpu_quant_matmul
from ..quant_formats import Q4_1, Q8_0
from ..relax_util import rebuild_function
from .attention_sites import _arg_vars, op_name, shape_of

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@dataclass(frozen=True)
class Site:
    """One matmul ``x · W`` whose weight inputs are ``weights`` (fp32: one ``[K, N]`` array;
    quantised: the row arrays ``q, d(, m)``)."""

    var: Any  # the binding's var
    x: Any  # the activation as the matmul reads it
    source: Any  # the activation behind a reshape (siblings read reshapes of one value)
    fmt: Any  # a quant_formats.WeightFormat, or None for fp32
    k: int
    n: int
    weights: tuple[str, ...]

    @property
    def signature(self) -> tuple:
        return (self.source, shape_of(self.x), None if self.fmt is None else self.fmt.name, self.k)


def _site(var, value, values: dict, weight_names: set[str]) -> Site | None:
    """The matmul bound to ``var`` when its weights are function inputs, else None."""
    if isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR):
        name = value.args[0].name_hint
        if not (name.startswith("matmul_") and name.endswith("_gpu") and ("_gemv_" in name or "_gemm_" in name)):
            return None  # (matmul_nt_*: the tied LM head reads the embedding table)
        args = list(value.args[1].fields)
        fmt = {"uint8": Q4_1, "int8": Q8_0}.get(str(args[1].ty.dtype))
        xs, out = shape_of(args[0]), shape_of(var)
        if fmt is None or xs is None or out is None or len(args) != (4 if fmt.has_min else 3):
            return None
        fmt, x, ws = fmt, args[0], args[1:]
        k, n = xs[-1], out[-1]
    elif op_name(value) == "relax.matmul":
        x, w = value.args
        ws, fmt = [w], None
        s = shape_of(w)
        if s is None or len(s) != 2 or str(w.ty.dtype) != "float32" or str(var.ty.dtype) != "float32":
            return None
        k, n = s
    else:
        return None
    if not (isinstance(x, relax.Var) and all(isinstance(w, relax.Var) and w.name in weight_names for w in ws)):
        return None
    src = values.get(x)
    source = src.args[0] if op_name(src) == "relax.reshape" and isinstance(src.args[0], relax.Var) else x
    return Site(var, x, source, fmt, int(k), int(n), tuple(w.name for w in ws))


def _sibling_groups(func: relax.Function) -> tuple[list[list[Site]], dict[str, int]]:
    """(groups of two or more matmuls reading one activation, in binding order; how many uses
    each weight input has in the function)."""
    weight_names = {p.name for p in func.params[int(func.attrs["num_input"]):]}
    values: dict = {}
    uses: dict[str, int] = {}
    by_signature: dict[tuple, list[Site]] = {}
    for block in func.body.blocks:
        for b in block.bindings:
            values[b.var] = b.value
            for a in _arg_vars(b.value):
                if a.name in weight_names:
                    uses[a.name] = uses.get(a.name, 0) + 1
            s = _site(b.var, b.value, values, weight_names)
            if s is not None:
                by_signature.setdefault(s.signature, []).append(s)
    return [g for g in by_signature.values() if len(g) > 1], uses


def _combined_name(names: list[str]) -> str:
    """``a.q_proj.w`` + ``a.k_proj.w`` → ``a.q_k_proj.w``: the members' names, their common head
    and tail written once (names stay readable in the manifest and the weights file; an input's
    name reaches the OpenCL source as a parameter name, so it joins with ``_``)."""
    head = os.path.commonprefix(names)
    tail = os.path.commonprefix([n[len(head):][::-1] for n in names])[::-1]
    return head + "_".join(n[len(head):len(n) - len(tail)] for n in names) + tail


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.CombineProjections")
class CombineProjections:
    def __init__(self, functions: list[str]):
        self.functions = list(functions)
        # each group: ([member weight-input names per member], [combined input name per part], axis)
        self.groups: list[tuple[list[tuple[str, ...]], list[str], int]] = []
        self.combined: int = 0  # matmuls replaced (one per member, in every function)

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        names = [gv.name_hint for gv in mod.get_global_vars()]
        functions = [f for f in self.functions if f in names]
        if not functions:
            return mod
        found = [_sibling_groups(mod[f]) for f in functions]
        # a group is combined when every function that uses any of its weights has exactly these
        # siblings, each weight used once (by its own matmul)
        chosen: list[tuple] = []
        for groups, _ in found:
            for g in groups:
                key = tuple(s.weights for s in g)
                if key not in chosen and all(self._same_everywhere(key, fg, uses) for fg, uses in found):
                    chosen.append(key)
        for key in chosen:
            parts = [_combined_name([ws[i] for ws in key]) for i in range(len(key[0]))]
            # fp32 has one input per matmul (Wᵀ, [K, N]: join columns); quantised ones two or
            # three row arrays ([N, ...]: join rows)
            self.groups.append((list(key), parts, 1 if len(key[0]) == 1 else 0))
        for f, (groups, _) in zip(functions, found):
            mod = self._rewrite(mod, f, [g for g in groups if tuple(s.weights for s in g) in chosen])
        entries = [gv.name_hint for gv, fn in mod.functions.items() if isinstance(fn, relax.Function)]
        return relax.transform.DeadCodeElimination(entries)(mod)

    @staticmethod
    def _same_everywhere(key: tuple, groups: list[list[Site]], uses: dict[str, int]) -> bool:
        weights = [w for ws in key for w in ws]
        if not any(uses.get(w) for w in weights):
            return True  # a function without these weights
        return (any(tuple(s.weights for s in g) == key for g in groups)
                and all(uses.get(w) == 1 for w in weights))

    def _rewrite(self, mod: tvm.IRModule, name: str, groups: list[list[Site]]) -> tvm.IRModule:
        func = mod[name]
        num_input = int(func.attrs["num_input"])
        by_key = {tuple(m): parts for m, parts, _ in self.groups}
        first = {g[0].weights[0]: g for g in groups}
        later = {s.weights[0] for g in groups for s in g[1:]}
        params = list(func.params[:num_input])
        combined_vars: dict[int, list] = {}  # id(group) → combined input vars
        for p in func.params[num_input:]:
            if p.name in first:
                g = first[p.name]
                old = {q.name: q for q in func.params[num_input:]}
                new = []
                for i, part in enumerate(by_key[tuple(s.weights for s in g)]):
                    member_shapes = [shape_of(old[s.weights[i]]) for s in g]
                    if g[0].fmt is None:  # fp32 Wᵀ: [K, ΣN]
                        shape = (member_shapes[0][0], sum(ms[1] for ms in member_shapes))
                    else:  # quantised rows: [ΣN, ...]
                        shape = (sum(ms[0] for ms in member_shapes), *member_shapes[0][1:])
                    new.append(relax.Var(part, relax.TensorType(shape, str(old[g[0].weights[i]].ty.dtype))))
                combined_vars[id(g)] = new
                params += new
            elif any(p.name in s.weights for g in groups for s in g):
                continue
            else:
                params.append(p)
        site_of = {s.var: (g, i) for g in groups for i, s in enumerate(g)}
        outputs: dict[int, Any] = {}

        def rewrite(b, vmap, bb):
            if b.var not in site_of:
                return None
            g, i = site_of[b.var]
            if i == 0:
                lead = g[0]
                x = vmap.get(lead.x, lead.x)
                total = sum(s.n for s in g)
                out_shape = shape_of(lead.var)[:-1] + (total,)
                ws = combined_vars[id(g)]
                if lead.fmt is None:
                    call = relax.op.matmul(x, ws[0])
                else:
                    xs = shape_of(lead.x)
                    tag = "gemv" if xs[-2] == 1 else "gemm"
                    kernel = bb.add_func(build_gpu_quant_matmul(xs, lead.fmt, lead.k, total),
                                         f"matmul_{lead.fmt.name}_{tag}_m{xs[-2]}_k{lead.k}_n{total}_gpu")
                    call = relax.call_tir(kernel, [x, *ws], relax.TensorType(out_shape, "float32"))
                outputs[id(g)] = bb.emit(call, "_".join(s.var.name for s in g))
                self.combined += len(g)
            begin = sum(s.n for s in g[:i])
            return relax.op.strided_slice(outputs[id(g)], axes=[len(shape_of(b.var)) - 1], begin=[begin],
                                          end=[begin + g[i].n])

        return rebuild_function(mod, name, params, rewrite)


def combine_params(params: list[tuple[str, Any]], groups) -> list[tuple[str, Any]]:
    """The stored arrays for the combined module (same input order as its functions): each
    group's members concatenated (``CombineProjections.groups``) in place of its first member."""
    arrays = dict(params)
    first, member = {}, set()
    for members, parts, axis in groups:
        first[members[0][0]] = (members, parts, axis)
        member.update(w for ws in members for w in ws)
    out = []
    for name, a in params:
        if name in first:
            members, parts, axis = first[name]
            for i, part in enumerate(parts):
                out.append((part, np.ascontiguousarray(np.concatenate([arrays[ws[i]] for ws in members], axis=axis))))
        elif name not in member:
            out.append((name, a))
    return out
