"""The pass (host CPU builds): store the linear weights as contiguous column panels.

After ``pretranspose_weights.py`` a linear layer is ``matmul(x, W)`` with W a [K, N] weight input. The
register-blocked GEMM (``kernels/dense.py``) runs one task per NR-wide column panel of W; in the
[K, N] layout a panel is K rows of NR floats N·4 bytes apart, a pattern the hardware
prefetchers do not follow across pages, so in the model — where every block streams all the
weights from memory — the GEMMs ran well below their cache-hot speed. Here every weight whose
every use (in every function) is such a matmul becomes an input of shape [N / NR, K, NR]
(``<name>.P<NR>``), each panel one contiguous block, and its matmuls become calls of the packed
kernels: the register-blocked GEMM for the prefill step, a panel-wise GEMV for decode (one weight
array serves both). NR is the prefill tile's width for this shape and core count
(``dense_tiles``). ``packed`` records {weight input name: NR} so that ``pack_params`` lays the
stored arrays out the same way.

GPU and cross-compiled targets do not run it: their matmuls keep TVM's layouts and schedules.
"""

from __future__ import annotations

import functools
from typing import Any

import tvm
from tvm import relax

from .attention_sites import _arg_vars, op_name, shape_of
from ..relax_util import rebuild_function, swap_weight_params
from ..kernels.dense import VEC, build_dense_kernel, build_packed_gemv_kernel, dense_tiles, pack_weight, packed_shape
from ..kernels.register_tile import vector_registers


def packed_name(name: str, nr: int) -> str:
    return f"{name}.P{nr}"


def _matmul_use(value, weight) -> tuple[tuple, tuple] | None:
    """(x shape, W shape) when ``value`` is ``matmul(x, weight)`` that the packed kernels take:
    fp32, x [(1,) M, K] static, W [K, N] with N a multiple of 16."""
    if op_name(value) != "relax.matmul" or len(value.args) != 2 or not value.args[1].same_as(weight):
        return None
    xs, ws = shape_of(value.args[0]), shape_of(weight)
    if xs is None or ws is None or len(ws) != 2 or len(xs) not in (2, 3) or (len(xs) == 3 and xs[0] != 1):
        return None
    if any(str(v.ty.dtype) != "float32" for v in (value.args[0], weight)) or xs[-1] != ws[0] or ws[1] % VEC:
        return None
    return tuple(int(d) for d in xs), tuple(int(d) for d in ws)


def matmul_weights(mod: tvm.IRModule, functions: list[str]) -> dict[str, list[tuple[tuple, tuple]]]:
    """{weight input name: its uses as (x shape, W shape)} for the weights whose every use is a
    ``matmul(x, W)`` the dense kernels take (``_matmul_use``)."""
    uses: dict[str, list] = {}
    bad: set[str] = set()
    for name in functions:
        func = mod[name]
        weights = {p: p.name for p in func.params[int(func.attrs["num_input"]):]}
        for block in func.body.blocks:
            for b in block.bindings:
                for a in _arg_vars(b.value):
                    if a in weights:
                        use = _matmul_use(b.value, a)
                        if use is None:
                            bad.add(weights[a])
                        else:
                            uses.setdefault(weights[a], []).append(use)
    return {w: us for w, us in uses.items() if w not in bad}


def plan(mod: tvm.IRModule, functions: list[str], cores: int) -> dict[str, int]:
    """{weight input name: NR} for the weights whose every use is a packable matmul."""
    out = {}
    for w, us in matmul_weights(mod, functions).items():
        (xs, (K, N)) = max(us, key=lambda u: u[0][-2])  # the widest M (the prefill step) picks NR
        tiles = dense_tiles(xs[-2], K, N, cores)
        if tiles is not None:
            out[w] = tiles[1]
    return out


# Kernels are immutable PrimFuncs and TVMScript parsing costs ~0.1–0.3 s each (as kernels/__init__'s
# builders): each distinct packed GEMM / GEMV, keyed by every argument of its builder, once per process.
@functools.lru_cache(maxsize=256)
def packed_kernel(xs: tuple[int, ...], ws: tuple[int, int], nr: int, cores: int, regs=None):
    """The scheduled packed kernel of ``matmul(x [xs], W [ws])`` with W in panels of ``nr``. Its
    register tile is sized for the current target; ``regs`` (``register_tile.vector_registers()``)
    keys the memo by it."""
    cs = xs[:-1] + (ws[1],)
    f = (build_packed_gemv_kernel(xs, ws, cs, nr) if xs[-2] == 1
         else build_dense_kernel(xs, ws, cs, cores, packed_nr=nr))
    return f.with_attr("tirx.is_scheduled", True)


def pack_function(mod: tvm.IRModule, name: str, packed: dict[str, int], cores: int) -> tvm.IRModule:
    func = mod[name]
    new_weights = {}
    for p in func.params[int(func.attrs["num_input"]):]:
        if p.name in packed:
            K, N = shape_of(p)
            new_weights[p.name] = relax.Var(packed_name(p.name, packed[p.name]),
                                            relax.TensorType(packed_shape(K, N, packed[p.name]), "float32"))
    params, swap = swap_weight_params(func, new_weights)
    kernels: dict[tuple, Any] = {}

    def kernel(bb, xs, ws, nr):
        key = (xs, ws, nr)
        if key not in kernels:
            tag = "gemv" if xs[-2] == 1 else "gemm"
            # "matmul" in the name: benchmarks and profiles class it with the GEMMs
            kernels[key] = bb.add_func(packed_kernel(xs, ws, nr, cores, vector_registers()),
                                       f"matmul_packed_{tag}_m{xs[-2]}_k{ws[0]}_n{ws[1]}")
        return kernels[key]

    def packed_matmul(b, vmap, bb):
        args = _arg_vars(b.value)
        w = args[1] if len(args) == 2 and op_name(b.value) == "relax.matmul" else None
        if w is None or w not in swap:
            return None
        xs, ws = _matmul_use(b.value, w)
        x = vmap.get(b.value.args[0], b.value.args[0])
        return relax.call_tir(kernel(bb, xs, ws, packed[w.name]), [x, swap[w]],
                              relax.TensorType(xs[:-1] + (ws[1],), "float32"))

    return rebuild_function(mod, name, params, packed_matmul)


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.PackWeights")
class PackWeights:
    def __init__(self, functions: list[str], cores: int = 1):
        self.functions = list(functions)
        self.cores = max(1, int(cores))
        self.packed: dict[str, int] = {}

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        self.packed = plan(mod, self.functions, self.cores)
        for name in self.functions if self.packed else ():
            mod = pack_function(mod, name, self.packed, self.cores)
        return mod


def pack_params(params: list[tuple[str, Any]], packed: dict[str, int]) -> list[tuple[str, Any]]:
    """The weight arrays as the packed functions take them (``<name>.P<NR>``, [N / NR, K, NR])."""
    return [(packed_name(n, packed[n]), pack_weight(a, packed[n])) if n in packed else (n, a) for n, a in params]
