"""The pass (host CPU builds, ``--weights q4|q8``): store the weights as quantised blocks and
call kernels that dequantise as they read (``kernels/quant_dense.py``; formats in ``quant_formats.py``).

It runs where ``pack_weights.py`` runs for fp32 and takes the same weights: every weight whose
every use is a packable ``matmul(x, W)`` (the linear layers, and an untied LM head) becomes
column panels of quants, scales (and minima) — three inputs ``<name>.<fmt>p<NR>.{q,d,m}`` in
place of one — and its matmuls become the quantised GEMM (prefill) or GEMV (decode). The
embedding table, when its every use is the token lookup ``take(E, ids, axis=0)`` or the tied LM
head ``matmul(x, permute_dims(E))``, becomes Q8_0 rows ``<name>.q8.{q,d}`` with a dequantising
lookup and an NT GEMV. Weights it cannot take stay fp32 (recorded in ``plan``).

``plan`` maps each replaced weight input to (kind, format, K, N, NR); ``quantize_params`` lays
the stored arrays out to match, taking the blocks from the source GGUF where it has them.

``activations="int8"`` (``--decode-activations int8``, CPU builds): the decode GEMVs that have an
int8-activation kernel (``kernels/int8_gemv.py``: Q4_1, Q4_K and Q6_K panels, the Q8_0 tied head)
quantise x per 32 and multiply integers, on the ``isa`` path (``int8_gemv.int8_isa``); the prefill
GEMMs and every other GEMV (Q8_0 / Q5_0 panels) keep fp32 activations.

GPU builds (``gpu=True``) keep the blocks row by row with float32 scales and call unscheduled
dequantise + matmul / gather definitions that dlight schedules (``quant_dense.build_gpu_*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .attention_sites import _arg_vars, op_name, shape_of
from ..kernels.int8_gemv import (INT8_KFORMATS, build_kquant_int8_gemv_kernel, build_q4_int8_gemv_kernel,
                                 build_q8_int8_gemv_nt_kernel)
from ..kernels.kquant_dense import build_kquant_gemm_kernel, build_kquant_gemv_kernel
from ..kernels.quant_dense import (build_gpu_quant_matmul, build_gpu_quant_take, build_q8_gemv_nt_kernel,
                                  build_q8_take_kernel, build_quant_gemm_kernel, build_quant_gemv_kernel,
                                  gpu_row_shapes)
from .pack_weights import _matmul_use, matmul_weights
from .pack_weights import plan as packable_weights
from .pretranspose_weights import SUFFIX
from ..kquant_formats import KFormat, kpanel_arrays, kpanel_shapes
from ..quant_formats import (EMBEDDING_FORMAT, GROUP, LINEAR_FORMAT, Q4_1, WeightFormat, panel_arrays, panel_shapes,
                            row_arrays, weight_blocks)
from ..relax_util import SKIP, rebuild_function


DECODE_ACTIVATIONS = ("fp32", "int8")  # --decode-activations


@dataclass(frozen=True)
class Quantized:
    kind: str  # "linear" (stored Wᵀ [K, N]) | "rows" (the [V, K] embedding table)
    fmt: WeightFormat | KFormat  # a KFormat: the source GGUF's own K-quant / Q5_0 blocks (CPU linear)
    k: int
    n: int
    nr: int = 0  # CPU linear: the panel width
    gpu: bool = False  # row layout, float32 scales (GPU builds)

    def inputs(self, name: str) -> list[tuple[str, tuple[int, ...], str]]:
        """(input name, shape, dtype) of the arrays that replace weight input ``name``."""
        base = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name
        if isinstance(self.fmt, KFormat):
            shapes = kpanel_shapes(self.fmt, self.k, self.n, self.nr)
            return [(f"{base}.{self.fmt.name}p{self.nr}.{part}", s, dt) for part, (s, dt) in zip(self.fmt.parts, shapes)]
        if self.gpu:
            shapes, tag = gpu_row_shapes(self.fmt, self.k, self.n), f"{self.fmt.name}r"
        elif self.kind == "linear":
            shapes = panel_shapes(self.fmt, self.k, self.n, self.nr)
            tag = f"{self.fmt.name}p{self.nr}"
        else:
            shapes = [((self.n, self.k), self.fmt.quant_dtype), ((self.n, self.k // GROUP), "float16")]
            tag = self.fmt.name
        return [(f"{base}.{tag}.{part}", s, dt) for part, (s, dt) in zip("qdm", shapes)]

    def arrays(self, blocks) -> list[np.ndarray]:
        """The stored arrays of these blocks, in ``inputs`` order."""
        if isinstance(self.fmt, KFormat):
            return kpanel_arrays(blocks, self.nr)
        if self.gpu:
            return row_arrays(blocks, gpu=True)
        return panel_arrays(blocks, self.nr) if self.kind == "linear" else row_arrays(blocks)


def hf_name(param_name: str) -> str:
    """The HF weight name behind an exported input (``p_w_model__layers__0__mlp__up_proj__weight.T``)."""
    n = param_name[:-len(SUFFIX)] if param_name.endswith(SUFFIX) else param_name
    n = n[len("p_w_"):] if n.startswith("p_w_") else n
    return n.replace("__", ".")


def _is_transpose_of(value, var) -> bool:
    return (op_name(value) == "relax.permute_dims" and value.args[0].same_as(var)
            and [int(a) for a in value.attrs.axes] == [1, 0])


def _table_plan(mod: tvm.IRModule, functions: list[str], gpu: bool) -> dict[str, Quantized]:
    """The [V, K] tables whose every use is a row lookup or a transposed matmul (the tied head)."""
    ok: dict[str, bool] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for name in functions:
        func = mod[name]
        weights = {p: p.name for p in func.params[int(func.attrs["num_input"]):]}
        transposes: dict = {}  # var bound to permute_dims(table) → table var
        for block in func.body.blocks:
            for b in block.bindings:
                for a in _arg_vars(b.value):
                    if a in weights:
                        s = shape_of(a)
                        good = (s is not None and len(s) == 2 and str(a.ty.dtype) == "float32"
                                and ((op_name(b.value) == "relax.take" and b.value.args[0].same_as(a)
                                      and int(b.value.attrs.axis) == 0)
                                     or _is_transpose_of(b.value, a)))
                        if _is_transpose_of(b.value, a):
                            transposes[b.var] = a
                        ok[weights[a]] = ok.get(weights[a], True) and good
                        shapes[weights[a]] = s
                    elif a in transposes:  # the transpose must feed matmul(x, Eᵀ) with x [(1,) M, K]
                        xs = shape_of(b.value.args[0]) if b.value.args else None
                        good = (op_name(b.value) == "relax.matmul" and b.value.args[1].same_as(a)
                                and xs is not None and len(xs) in (2, 3))
                        ok[weights[transposes[a]]] = ok[weights[transposes[a]]] and good
    out = {}
    for w, good in ok.items():
        if good and shapes[w][1] % GROUP == 0 and shapes[w][0] % 4 == 0:
            out[w] = Quantized("rows", EMBEDDING_FORMAT, shapes[w][1], shapes[w][0], gpu=gpu)
    return out


def plan(mod: tvm.IRModule, functions: list[str], cores: int, weights: str, gpu: bool = False,
         source=None) -> dict[str, Quantized]:
    """``source`` (``quant_formats.GGUFBlocks``): in a q4 CPU build a linear weight the file holds
    as Q4_1, Q8_0, Q4_K, Q6_K or Q5_0 keeps that format (its blocks, exactly); the rest are Q4_1."""
    fmt = LINEAR_FORMAT[weights]
    out: dict[str, Quantized] = {}
    linear = ({w: 0 for w in matmul_weights(mod, functions)} if gpu else packable_weights(mod, functions, cores))
    for name, nr in linear.items():
        p = next(p for p in mod[functions[0]].params if p.name == name)
        K, N = shape_of(p)
        own = source.kept_format(hf_name(name), (N, K)) if source is not None and fmt is Q4_1 and not gpu else None
        out[name] = Quantized("linear", own or fmt, K, N, nr, gpu)
    out.update(_table_plan(mod, functions, gpu))
    return out


def int8_decode_kernel(q: Quantized) -> bool:
    """Whether a GEMV over ``q`` has an int8-activation kernel (``kernels/int8_gemv.py``)."""
    if q.gpu:
        return False
    if isinstance(q.fmt, KFormat):
        return q.fmt.ggml in INT8_KFORMATS
    return q.fmt is Q4_1 if q.kind == "linear" else q.fmt.ggml == "Q8_0"


def quantize_function(mod: tvm.IRModule, name: str, quantized: dict[str, Quantized], activations: str = "fp32",
                      isa: str = "generic") -> tvm.IRModule:
    func = mod[name]
    num_input = int(func.attrs["num_input"])
    params, parts = list(func.params[:num_input]), {}
    for p in func.params[num_input:]:
        if p.name in quantized:
            parts[p] = [relax.Var(n, relax.TensorType(s, dt)) for n, s, dt in quantized[p.name].inputs(p.name)]
            params += parts[p]
        else:
            params.append(p)
    transposed: dict = {}  # var of permute_dims(table) → table var
    kernels: dict[tuple, Any] = {}

    def kernel(bb, key, build, fname, q):
        if key not in kernels:
            f = build()
            if not q.gpu:  # the CPU kernels are scheduled; dlight schedules the GPU ones
                # opaque to FuseOps: a fused neighbour (the ids' reshape) would not match the kernel's buffers
                f = f.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)
            kernels[key] = bb.add_func(f, fname + ("_gpu" if q.gpu else ""))
        return kernels[key]

    def rewrite(b, vmap, bb):
        v = b.value
        args = _arg_vars(v)
        if not any(a in parts or a in transposed for a in args):
            return None
        if op_name(v) == "relax.permute_dims":  # the tied head's transpose: its matmul reads the rows
            transposed[b.var] = args[0]
            return SKIP
        if op_name(v) == "relax.take":
            table, q = args[0], quantized[args[0].name]
            ids = vmap.get(v.args[1], v.args[1])
            n_ids, ids_dt = shape_of(v.args[1])[0], str(v.args[1].ty.dtype)
            build = ((lambda: build_gpu_quant_take(n_ids, ids_dt, q.fmt, q.n, q.k)) if q.gpu else
                     (lambda: build_q8_take_kernel(n_ids, ids_dt, q.n, q.k)))
            f = kernel(bb, ("take", n_ids, ids_dt, q), build, f"take_q8_t{n_ids}_v{q.n}_k{q.k}", q)
            return relax.call_tir(f, [*parts[table], ids], relax.TensorType((n_ids, q.k), "float32"))
        if op_name(v) != "relax.matmul":
            raise RuntimeError(f"a quantised weight has a use the plan did not allow: {op_name(v)}")
        x = vmap.get(v.args[0], v.args[0])
        xs = shape_of(v.args[0])
        if v.args[1] in transposed:  # tied LM head
            table = transposed[v.args[1]]
            q = quantized[table.name]
            cs = xs[:-1] + (q.n,)
            x8 = activations == "int8" and xs[-2] == 1 and int8_decode_kernel(q)
            build = ((lambda: build_gpu_quant_matmul(xs, q.fmt, q.k, q.n)) if q.gpu else
                     (lambda: build_q8_int8_gemv_nt_kernel(xs, cs, q.n, q.k, isa)) if x8 else
                     (lambda: build_q8_gemv_nt_kernel(xs, cs, q.n, q.k)))
            f = kernel(bb, ("nt", xs, q, x8), build, f"matmul_nt_q8_m{xs[-2]}_k{q.k}_n{q.n}" + ("_x8" if x8 else ""), q)
            return relax.call_tir(f, [x, *parts[table]], relax.TensorType(cs, "float32"))
        w = v.args[1]
        q = quantized[w.name]
        xs, _ = _matmul_use(v, w)
        cs = xs[:-1] + (q.n,)
        gemv = xs[-2] == 1
        x8 = gemv and activations == "int8" and int8_decode_kernel(q)
        if x8 and isinstance(q.fmt, KFormat):
            build = lambda: build_kquant_int8_gemv_kernel(xs, cs, q.fmt, q.k, q.n, q.nr, isa)  # noqa: E731
        elif x8:
            build = lambda: build_q4_int8_gemv_kernel(xs, cs, q.fmt, q.k, q.n, q.nr, isa)  # noqa: E731
        elif isinstance(q.fmt, KFormat):
            build = ((lambda: build_kquant_gemv_kernel(xs, cs, q.fmt, q.k, q.n, q.nr)) if gemv else  # noqa: E731
                     (lambda: build_kquant_gemm_kernel(xs, cs, q.fmt, q.k, q.n, q.nr)))
        elif q.gpu:
            build = lambda: build_gpu_quant_matmul(xs, q.fmt, q.k, q.n)  # noqa: E731
        elif gemv:
            build = lambda: build_quant_gemv_kernel(xs, cs, q.fmt, q.k, q.n, q.nr)  # noqa: E731
        else:
            build = lambda: build_quant_gemm_kernel(xs, cs, q.fmt, q.k, q.n, q.nr)  # noqa: E731
        tag = "gemv" if gemv else "gemm"
        # "matmul" in the name: benchmarks and profiles class it with the GEMMs
        f = kernel(bb, (tag, xs, q, x8), build, f"matmul_{q.fmt.name}_{tag}_m{xs[-2]}_k{q.k}_n{q.n}" + ("_x8" if x8 else ""), q)
        return relax.call_tir(f, [x, *parts[w]], relax.TensorType(cs, "float32"))

    return rebuild_function(mod, name, params, rewrite)


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.QuantizeWeights")
class QuantizeWeights:
    def __init__(self, functions: list[str], cores: int, weights: str, gpu: bool = False, source=None,
                 activations: str = "fp32", isa: str = "generic"):
        if weights not in LINEAR_FORMAT:
            raise ValueError(f"unknown weight format {weights!r}")
        if activations not in DECODE_ACTIVATIONS:
            raise ValueError(f"unknown decode activations {activations!r}: one of {', '.join(DECODE_ACTIVATIONS)}")
        self.activations = activations  # the decode GEMVs' x: fp32, or int8 blocks (kernels/int8_gemv.py)
        self.isa = isa  # int8_gemv.int8_isa of the target
        self.functions = list(functions)
        self.cores = max(1, int(cores))
        self.weights = weights
        self.gpu = gpu
        self.source = source  # quant_formats.GGUFBlocks: the file whose own formats a q4 build keeps
        self.plan: dict[str, Quantized] = {}

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        self.plan = plan(mod, self.functions, self.cores, self.weights, self.gpu, self.source)
        for name in self.functions if self.plan else ():
            mod = quantize_function(mod, name, self.plan, self.activations, self.isa)
        return mod


def quantize_params(params: list[tuple[str, Any]], quantized: dict[str, Quantized], source=None,
                    progress=None) -> tuple[list[tuple[str, Any]], dict[str, int]]:
    """The stored arrays for the quantised module (in the same input order), and how many tensors
    came from the source file's own blocks ("gguf") or were quantised here ("quantized").
    ``source``: ``quant_formats.GGUFBlocks`` of the model's file, or None."""
    out: list[tuple[str, Any]] = []
    origin = {"gguf": 0, "quantized": 0}
    for i, (name, a) in enumerate(params):
        q = quantized.get(name)
        if q is None:
            out.append((name, a))
            continue
        if progress is not None:
            progress(i, len(params))
        if isinstance(q.fmt, KFormat):  # the plan chose it because the file has it: taken as it is
            blocks = source.get(hf_name(name), q.fmt, (q.n, q.k))
            if blocks is None:
                raise RuntimeError(f"{hf_name(name)}: planned as the source's {q.fmt.ggml} blocks, which it lacks")
        else:  # read here, not before: a weight still in its file (weight_arrays.FileWeight) is read only if needed
            blocks = weight_blocks(a.T if q.kind == "linear" else a, q.fmt, source, hf_name(name))
        origin[blocks.source] += 1
        for (n, shape, dt), arr in zip(q.inputs(name), q.arrays(blocks)):
            if tuple(arr.shape) != tuple(shape) or str(arr.dtype) != dt:
                raise RuntimeError(f"{n}: built {arr.shape} {arr.dtype}, the kernels take {shape} {dt}")
            out.append((n, arr))
    return out, origin
