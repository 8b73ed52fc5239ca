"""The pass: rewrite a plain causal forward into a block step over an explicit, fixed-size cache.

Input: a Relax function ``src(tokens[1, T], positions[1, T], *weights) -> logits[1, T, V]`` as
imported from ``torch.export`` (see ``export.py``), with ``num_input`` = 2.

Output: a function ``name(tokens[T], positions[T], n_valid[1], *caches, *weights)`` returning
``(logits[V] of token n_valid − 1, *caches[, *extra])`` where ``caches`` is, per attention site (layer)
in graph order, ``k[H, N, d], v[H, N, d], pos[H, N] int32, fill[1] int32`` followed by the policy's
compiled state if it has one (``cache_layout``). For decode (``fixed_n_valid=1``) the ``n_valid``
input is dropped. A policy class with ``emit_site_eviction`` (D2O) places its own kernels at each
site instead of score + select, and may add per-site outputs (``extra``, after the caches).

At every attention site (``attention_sites.find_attention_sites``) the pass:
  1. replaces the site's output with the block-attention TIR kernel over cache ⊕ block
     (causal inside the block, padding rows ≥ n_valid masked);
  2. places the policy's score kernel (if any) and the generic top-N select + in-place
     compaction kernel (``call_tir_inplace`` on the four cache tensors), so the cache is
     updated without reallocation.
The attention-probability subgraph (mask, softmax, matmuls) becomes dead and is removed by
dead-code elimination (the next pass in ``pipeline.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import tvm
from tvm import relax

from .attention_sites import AttentionMatchError, AttentionSite, find_attention_sites, shape_of
from ..policies import REGISTRY
from .kernels import build_attention, build_score, build_select

CACHE_FIELDS = ("k", "v", "pos", "fill")


@dataclass
class BlockCacheSpec:
    """What the pass needs besides the graph (nothing model-specific)."""

    budget: int
    policy: str
    policy_params: dict[str, Any] = field(default_factory=dict)
    tokens_input: str = "tokens"
    positions_input: str = "positions"
    dtype: str = "float32"


def substitute(expr, vmap: dict):
    """``expr`` with vars replaced per ``vmap`` (calls, tuples and tuple-gets are rebuilt)."""
    if isinstance(expr, relax.Var):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Call):
        args = [substitute(a, vmap) for a in expr.args]
        return relax.Call(expr.op, args, expr.attrs, list(expr.ty_args) if expr.ty_args else None)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap), expr.index)
    return expr


def policy_cache_state(policy: str) -> tuple:
    """The per-layer state a policy's compiled eviction carries after k, v, pos, fill:
    ``(name, "entry" | length, dtype)`` triples (``<Policy>.compiled_state``; D2O's accumulated
    attention, layer budget and τ)."""
    cls = REGISTRY.get(policy)
    return tuple(getattr(cls, "compiled_state", ())) if cls is not None else ()


def cache_layout(num_kv_heads: int, head_dim: int, budget: int, policy: str, dtype: str = "float32"):
    """One layer's cache tensors in argument order: [(field, shape, dtype)] — k, v, pos, fill,
    then the policy's state (``policy_cache_state``). The manifest and the runtime use the same."""
    H, N, D = num_kv_heads, budget, head_dim
    fields = [("k", (H, N, D), dtype), ("v", (H, N, D), dtype), ("pos", (H, N), "int32"), ("fill", (1,), "int32")]
    for name, length, dt in policy_cache_state(policy):
        fields.append((name, (H, N) if length == "entry" else (int(length),), dt))
    return fields


def cache_types(site: AttentionSite, budget: int, dtype: str, policy: str = "full"):
    return [relax.TensorType(shape, dt) for _, shape, dt in cache_layout(site.num_kv_heads, site.head_dim, budget,
                                                                          policy, dtype)]


def _find_param(func: relax.Function, name: str, what: str):
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    for p in func.params[:num_input]:
        if p.name == name:
            return p
    names = ", ".join(p.name for p in func.params[:num_input])
    raise AttentionMatchError(f"the graph has no {what} input named '{name}' (its inputs: {names})")


def rewrite_function(mod: tvm.IRModule, src: str, dst: str, spec: BlockCacheSpec,
                     fixed_n_valid: int | None = None,
                     on_sites: Callable[[list[AttentionSite]], None] | None = None) -> tvm.IRModule:
    func = mod[src]
    sites = find_attention_sites(func)
    if on_sites:
        on_sites(sites)
    tokens = _find_param(func, spec.tokens_input, "token")
    positions = _find_param(func, spec.positions_input, "position")
    tshape = shape_of(tokens)
    if tshape is None or len(tshape) != 2 or tshape[0] != 1:
        raise AttentionMatchError(f"token input has shape {tshape}, expected [1, T]")
    T = tshape[1]
    for s in sites:
        if s.seq_len != T:
            raise AttentionMatchError(f"attention site {s.index} runs over {s.seq_len} tokens, the input has {T}")
    num_input = int(func.attrs["num_input"])
    weights = list(func.params[num_input:])

    new_tokens = relax.Var("tokens", relax.TensorType((T,), tokens.ty.dtype))
    new_positions = relax.Var("positions", relax.TensorType((T,), positions.ty.dtype))
    n_valid = None if fixed_n_valid is not None else relax.Var("n_valid", relax.TensorType((1,), "int32"))
    cache_vars = []
    site_eviction = getattr(REGISTRY.get(spec.policy), "emit_site_eviction", None)
    extra_outputs = []
    for s in sites:
        layout = cache_layout(s.num_kv_heads, s.head_dim, spec.budget, spec.policy, spec.dtype)
        cache_vars.append([relax.Var(f"{f}_cache_{s.index}", relax.TensorType(shape, dt)) for f, shape, dt in layout])
    new_weights = [relax.Var(w.name, w.ty) for w in weights]
    params = [new_tokens, new_positions] + ([n_valid] if n_valid is not None else [])
    params += [v for cv in cache_vars for v in cv] + new_weights

    bb = relax.BlockBuilder(mod)
    site_by_out = {s.output: s for s in sites}
    vmap = dict(zip(weights, new_weights))
    kernels: dict = {}

    def kernel(key, builder):
        if key not in kernels:
            prim = builder()
            kernels[key] = None if prim is None else bb.add_func(prim, f"{dst}_{key}")
        return kernels[key]

    attrs = {"num_input": len(params) - len(new_weights), "edgekv.num_layers": len(sites)}
    with bb.function(dst, params, attrs=attrs):
        with bb.dataflow():
            vmap[tokens] = bb.emit(relax.op.reshape(new_tokens, (1, T)), "tokens_2d")
            vmap[positions] = bb.emit(relax.op.reshape(new_positions, (1, T)), "positions_2d")
            pos32 = bb.emit(relax.op.astype(new_positions, "int32"), "pos_blk")
            nv = n_valid if n_valid is not None else bb.emit(
                relax.const(np.array([fixed_n_valid], dtype="int32")), "n_valid")
            new_caches = []
            for var, value in _bindings(func):
                site = site_by_out.get(var)
                if site is None:
                    vmap[var] = bb.emit(substitute(value, vmap), var.name)
                    continue
                H, Hq, D, N = site.num_kv_heads, site.num_q_heads, site.head_dim, spec.budget
                kc, vc, pc, fc = cache_vars[site.index][:4]
                q, kb, vb = vmap.get(site.q, site.q), vmap.get(site.k, site.k), vmap.get(site.v, site.v)
                attn_gv = kernel(f"attention_h{Hq}_{H}_d{D}",
                                 lambda: build_attention(Hq, H, N, T, D, site.sm_scale, spec.dtype))
                out = bb.emit(relax.call_tir(attn_gv, [q, kb, vb, kc, vc, fc, nv],
                                             relax.TensorType((1, Hq, T, D), spec.dtype)), f"attn_{site.index}")
                if site.output_layout == "bthd":
                    out = bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3]))
                vmap[var] = bb.emit(relax.op.reshape(out, shape_of(var)), var.name)
                if site_eviction is not None:  # a policy that wires its own kernels (D2O)
                    new, extra = site_eviction(bb, kernel, site, spec, T, cache_vars[site.index], q, kb, vb, pos32, nv)
                    new_caches.append(new)
                    extra_outputs.extend(extra)
                    continue
                score_gv = kernel(f"score_{spec.policy}_h{H}_d{D}",
                                  lambda: build_score(spec.policy, H, N, T, D, spec.dtype, spec.policy_params))
                select_gv = kernel(f"select_h{H}_d{D}_{'score' if score_gv is not None else 'append'}",
                                   lambda: build_select(H, N, T, D, spec.dtype, score_gv is not None))
                args = [kc, vc, pc, fc, kb, vb, pos32, nv]
                if score_gv is not None:
                    score = bb.emit(relax.call_tir(score_gv, args, relax.TensorType((H, N + T), "float32")),
                                    f"score_{site.index}")
                    args = args + [score]
                upd = bb.emit(relax.call_tir_inplace(select_gv, args, [0, 1, 2, 3],
                                                     cache_types(site, N, spec.dtype)), f"evict_{site.index}")
                new_caches.append([bb.emit(relax.TupleGetItem(upd, i), f"{f}_new_{site.index}")
                                   for i, f in enumerate(CACHE_FIELDS)])
            ret = vmap[func.body.body] if isinstance(func.body.body, relax.Var) else substitute(func.body.body, vmap)
            rshape = shape_of(ret)
            if rshape is None or len(rshape) != 3 or rshape[:2] != (1, T):
                raise AttentionMatchError(f"the function returns shape {rshape}, expected logits [1, {T}, vocab]")
            idx = bb.emit(relax.op.subtract(nv, relax.const(1, "int32")), "last_index")
            last = bb.emit(relax.op.take(ret, idx, axis=1), "logits_last")
            logits = bb.emit(relax.op.reshape(last, (rshape[2],)), "logits")
            out = bb.emit_output(relax.Tuple([logits] + [v for cv in new_caches for v in cv] + extra_outputs))
        bb.emit_func_output(out)
    return bb.get()


def _bindings(func: relax.Function):
    for block in func.body.blocks:
        for b in block.bindings:
            yield b.var, b.value


@tvm.ir.transform.module_pass(opt_level=0, name="edgekv.RewriteBlockCache")
class RewriteBlockCache:
    """Module pass: for each (source, target, fixed_n_valid) in ``functions`` add the block-step
    function ``target`` built from ``source`` and remove ``source``."""

    def __init__(self, spec: BlockCacheSpec, functions: list[tuple[str, str, int | None]]):
        self.spec = spec
        self.functions = functions
        self.sites: dict[str, list[AttentionSite]] = {}

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        for src, dst, fixed in self.functions:
            mod = rewrite_function(mod, src, dst, self.spec, fixed,
                                   on_sites=lambda s, dst=dst: self.sites.__setitem__(dst, s))
        for src, _, _ in self.functions:
            mod = without_function(mod, src)
        return mod


def without_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    """``mod`` without the function called ``name``."""
    funcs = {gv: f for gv, f in mod.functions.items() if gv.name_hint != name}
    return tvm.IRModule(funcs, attrs=mod.attrs)
