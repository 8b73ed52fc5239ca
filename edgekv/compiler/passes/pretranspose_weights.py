"""The pass: store linear weights pre-transposed, so no block transposes them at run time.

The torch importer writes ``F.linear(x, W)`` as ``matmul(x, permute_dims(W, [1, 0]))``; TVM
then materialises Wᵀ on every call (≈0.5 s per SmolLM2 block with the default lowering, and a
weight-sized temporary). When *every* use of a weight input, in every function of the
module, is that transpose, the pass replaces the input by one of the transposed shape (named
``<name>.T``) and drops the transposes. ``transposed`` records which stored arrays the
pipeline must transpose (``compiler/pipeline.py``: ``param_layout``). Weights used otherwise
(e.g. a tied embedding, also read by ``take``) are left alone.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .attention_sites import _arg_vars, op_name, shape_of
from ..relax_util import rebuild_function, swap_weight_params

SUFFIX = ".T"


def _is_transpose_2d(value) -> bool:
    if op_name(value) != "relax.permute_dims":
        return False
    axes = value.attrs.axes
    return axes is not None and [int(a) for a in axes] == [1, 0]


def candidates(mod: tvm.IRModule, functions: list[str]) -> set[str]:
    """Names of weight inputs whose every use (in all ``functions``) is a 2-D transpose."""
    ok: dict[str, bool] = {}
    for name in functions:
        func = mod[name]
        num_input = int(func.attrs["num_input"])
        weights = {p: p.name for p in func.params[num_input:]}
        for block in func.body.blocks:
            for b in block.bindings:
                for a in _arg_vars(b.value):
                    if a in weights:
                        good = _is_transpose_2d(b.value) and len(shape_of(a) or ()) == 2
                        ok[weights[a]] = ok.get(weights[a], True) and good
    return {n for n, good in ok.items() if good}


def pretranspose_function(mod: tvm.IRModule, name: str, names: set[str]) -> tvm.IRModule:
    func = mod[name]
    new_weights = {}
    for p in func.params[int(func.attrs["num_input"]):]:
        if p.name in names:
            s = shape_of(p)
            new_weights[p.name] = relax.Var(p.name + SUFFIX, relax.TensorType((s[1], s[0]), p.ty.dtype))
    params, swap = swap_weight_params(func, new_weights)

    def drop_transpose(b, vmap, bb):
        args = _arg_vars(b.value)
        return swap[args[0]] if _is_transpose_2d(b.value) and args and args[0] in swap else None

    return rebuild_function(mod, name, params, drop_transpose)


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.PretransposeWeights")
class PretransposeWeights:
    def __init__(self, functions: list[str]):
        self.functions = functions
        self.transposed: set[str] = set()

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        self.transposed = candidates(mod, self.functions)
        if not self.transposed:
            return mod
        for name in self.functions:
            mod = pretranspose_function(mod, name, self.transposed)
        return mod
