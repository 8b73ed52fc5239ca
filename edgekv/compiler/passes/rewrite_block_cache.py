"""The pass: rewrite a plain causal forward into a block step over an explicit, fixed-size cache.

Input: a Relax function ``src(tokens[1, T], positions[1, T], *weights) -> logits[1, T, V]`` as
imported from ``torch.export`` (see ``frontend/export.py``), with ``num_input`` = 2.

Output: a function ``name(tokens[T], positions[T], n_valid[1], *caches, *weights)`` returning
``(logits[V] of token n_valid − 1, *caches[, *extra])`` where ``caches`` is, per attention site (layer)
in graph order, ``k[H, N, d], v[H, N, d], pos[H, N] int32, fill[1] int32`` followed by the policy's
state (``cache_layout``): for a policy with ``entry_state`` (S names) ``state[S, H, N] float32``,
then the per-layer ``compiled_state`` of a policy that wires its own site kernels. For decode
(``fixed_n_valid=1``) the ``n_valid`` input is dropped. A policy whose compiled face
has ``emit_site_eviction`` (D2O) places its own kernels at each site instead of observe + score +
select, and may add per-site outputs (``extra``, after the caches).

At every attention site (``attention_sites.find_attention_sites``) the pass:
  1. replaces the site's output with the block-attention TIR kernel over cache ⊕ block
     (causal inside the block, padding rows ≥ n_valid masked) — in ``decode``, with the policy's
     ``emit_decode_attention`` kernel when it has one (RocketKV's sparse stage 2);
  2. places the policy's observe kernel (policies with ``entry_state``: the per-candidate state
     after this step, on every step), its score kernel (if any) and the generic top-N select +
     in-place compaction kernel (``call_tir_inplace`` on the cache tensors, state included), so
     the cache is updated without reallocation, then the policy's ``emit_after_select`` hook (if
     any) on its own ``compiled_state`` tensors. The policy's ``kernel_inputs`` (e.g. the block's
     post-RoPE queries) are passed to its observe and score kernels after the common eight
     arguments — the contract is written down in ``compiler/policy_kernels/face.py``.
The attention-probability subgraph (mask, softmax, matmuls) becomes dead and is removed by
dead-code elimination (the next pass in ``pipeline.py``).

With ``BlockCacheSpec.kv_dtype`` "int8" the layer stores int8 codes and float16 scales
(``cache_layout``), and the steps above run unchanged on an fp32 view of it that
``int8_cache.read`` makes before them and ``int8_cache.write`` stores back after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import tvm
from tvm import relax

from ...memory import check_kv_dtype, int8_scale_groups
from ..kernels import build_attention, build_select, build_window
from ..policy_kernels import KERNELS, build_observe, build_score, kernel_spec, policy_tag, site_params
from ..relax_util import substitute, without_function
from . import int8_cache
from .attention_sites import AttentionMatchError, AttentionSite, find_attention_sites, shape_of
from .pseudo_rows import attention_kernel_key, step_extra_rows

CACHE_FIELDS = ("k", "v", "pos", "fill")
STATE_FIELD = "state"


@dataclass
class BlockCacheSpec:
    """What the pass needs besides the graph (nothing model-specific)."""

    budget: int
    policy: str
    policy_params: dict[str, Any] = field(default_factory=dict)
    tokens_input: str = "tokens"
    positions_input: str = "positions"
    dtype: str = "float32"
    # Pseudo rows at the end of every prefill step (DapQ: the window w). The prefill graph is then
    # exported at T = B + w; their K/V never enter the cache (see ``pseudo_rows.py``).
    extra_rows: int = 0
    # Of those, rows that may carry a document's question (``--question-rows``): max(w, Q) extra rows
    # in all; the score kernels then skip padding rows (position −1) and score with the question
    question_rows: int = 0
    # Threads of the CPU target (its ``num-cores``): the attention kernel's row tiles are sized
    # so that its parallel tasks split evenly over them. GPU targets replace that kernel.
    cores: int = 1
    # How the caches store K and V (``memory.KV_DTYPES``): fp32, or int8 codes with float16
    # scales (``int8_cache.py``: the site's kernels then read a dequantised view)
    kv_dtype: str = "fp32"
    # Per attention site (layer, in graph order): its sliding window, 0 for a global layer; empty:
    # every layer global. From the model's description (``ModelConfig.layer_kinds`` and
    # ``sliding_window``, ``layer_windows``): a local layer's cache holds exactly its window, its
    # attention is masked to it and no policy kernel runs there (``kernels/window.py``)
    layer_windows: tuple[int, ...] = ()

    def site_window(self, index: int) -> int:
        """The sliding window of attention site ``index`` (0: a global layer)."""
        return int(self.layer_windows[index]) if self.layer_windows else 0

    def site_budget(self, index: int) -> int:
        """The cache rows of attention site ``index``: its window on a local layer, else N."""
        return self.site_window(index) or self.budget


def layer_windows(config) -> tuple[int, ...]:
    """Every layer's sliding window from a model description (0: global), or () when all are global."""
    kinds = tuple(getattr(config, "layer_kinds", ()) or ())
    if "local" not in kinds:
        return ()
    return tuple(int(config.sliding_window) if kind == "local" else 0 for kind in kinds)


def layer_cache_kinds(spec: "BlockCacheSpec", num_layers: int) -> list[dict]:
    """The manifest's per-layer cache kinds: ``{"kind": "global" | "local", "entries": rows}``."""
    return [{"kind": "local" if spec.site_window(i) else "global", "entries": spec.site_budget(i)}
            for i in range(num_layers)]


def cache_layout(num_kv_heads: int, head_dim: int, budget: int, policy: str, dtype: str = "float32",
                 policy_params: dict | None = None, kv_dtype: str = "fp32"):
    """One layer's cache tensors in argument order: [(field, shape, dtype)] — k, v, pos, fill, then
    the policy's state: for ``Policy.entry_state`` one ``state [S, H, N] float32``, then the
    policy's own per-layer ``compiled_state`` (``(name, "entry" | length | shape_fn, dtype)``
    triples, an "entry" tensor being [H, N], ``shape_fn(H, N, d, kernel_params)`` a shape that
    depends on the policy's settings; D2O: layer budget [2], τ [2]; RocketKV: page summaries
    [H, d, pages]). The pass, the manifest, the memory plan and the runtimes all read this one
    layout; ``policy_params`` are the policy's ``kernel_params(budget)``. ``kv_dtype`` "int8": k and
    v hold int8 codes, and their float16 scales [H, N, ⌈d/32⌉] come last (``int8_cache.py``)."""
    H, N, D = num_kv_heads, budget, head_dim
    kv = "int8" if check_kv_dtype(kv_dtype, "kv_dtype") == "int8" else dtype
    fields = [("k", (H, N, D), kv), ("v", (H, N, D), kv), ("pos", (H, N), "int32"), ("fill", (1,), "int32")]
    face = KERNELS.get(policy)
    if face is not None:
        fields += _policy_fields(face, policy, H, N, D, policy_params)
    if kv_dtype == "int8":
        fields += [(name, (H, N, int8_scale_groups(D)), "float16") for name in int8_cache.SCALE_FIELDS]
    return fields


def _policy_fields(face, policy: str, H: int, N: int, D: int, policy_params: dict | None):
    """The policy's own cache tensors of ``cache_layout``: the entry state, then ``compiled_state``."""
    fields = []
    S = kernel_spec(policy).num_state
    if S:
        fields.append((STATE_FIELD, (S, H, N), "float32"))
    for name, length, dt in face.compiled_state:
        if callable(length):
            if not policy_params:
                raise ValueError(f"policy '{policy}': the shape of its '{name}' cache tensor depends on its settings; "
                                 "pass its kernel_params(budget) as policy_params")
            shape = tuple(int(x) for x in length(H, N, D, policy_params))
        else:
            shape = (H, N) if length == "entry" else (int(length),)
        fields.append((name, shape, dt))
    return fields


def cache_types(site: AttentionSite, budget: int, dtype: str, policy: str = "full", policy_params: dict | None = None):
    return [relax.TensorType(shape, dt) for _, shape, dt in cache_layout(site.num_kv_heads, site.head_dim, budget,
                                                                          policy, dtype, policy_params)]


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
    W = step_extra_rows(spec, T, fixed_n_valid)

    new_tokens = relax.Var("tokens", relax.TensorType((T,), tokens.ty.dtype))
    new_positions = relax.Var("positions", relax.TensorType((T,), positions.ty.dtype))
    n_valid = None if fixed_n_valid is not None else relax.Var("n_valid", relax.TensorType((1,), "int32"))
    kspec = kernel_spec(spec.policy)
    S = kspec.num_state
    fields = [f for f, _, _ in cache_layout(1, 1, spec.budget, spec.policy, spec.dtype, spec.policy_params)]
    cache_vars = []
    face = KERNELS[spec.policy]
    site_eviction = face.emit_site_eviction
    # a policy that replaces decode's attention (RocketKV's sparse stage 2); prefill stays dense
    decode_attention = face.emit_decode_attention if fixed_n_valid is not None else None
    after_select = face.emit_after_select
    extra_outputs = []
    int8 = spec.kv_dtype == "int8"
    if spec.layer_windows and len(spec.layer_windows) != len(sites):
        raise AttentionMatchError(f"the model's description names {len(spec.layer_windows)} layer kinds, the graph "
                                  f"has {len(sites)} attention sites")
    for s in sites:
        layout = cache_layout(s.num_kv_heads, s.head_dim, spec.site_budget(s.index), spec.policy, spec.dtype,
                              spec.policy_params, spec.kv_dtype)
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

    attrs = {"num_input": len(params) - len(new_weights), "edgekv.num_layers": len(sites),
             "edgekv.entry_state": list(kspec.state)}
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
                q, kb, vb = vmap.get(site.q, site.q), vmap.get(site.k, site.k), vmap.get(site.v, site.v)
                # the layer's tensors as the step's kernels read them: as stored, or (int8) an fp32
                # view with K/V dequantised and the block's K/V as the cache will hold them
                stored = cache_vars[site.index]
                caches, kb, vb, pos_before = (int8_cache.read(bb, kernel, site, stored, kb, vb) if int8
                                              else (stored, kb, vb, None))
                kc, vc, pc, fc = caches[:4]
                st = caches[4] if S else None
                window = spec.site_window(site.index)
                if window:  # a local layer: its window, no policy (the policy's tensors pass through)
                    new_caches.append(_local_site(bb, kernel, site, spec, var, window, T, W, caches, q, kb, vb,
                                                  pos32, nv, vmap))
                    continue
                if decode_attention is not None:
                    out = decode_attention(bb, kernel, site, spec, caches, q, kb, vb)
                else:
                    attn_gv = kernel(attention_kernel_key(Hq, H, D, W),
                                     lambda: build_attention(Hq, H, N, T, D, site.sm_scale, spec.dtype, W, spec.cores))
                    out = bb.emit(relax.call_tir(attn_gv, [q, kb, vb, kc, vc, fc, nv],
                                                 relax.TensorType((1, Hq, T, D), spec.dtype)), f"attn_{site.index}")
                if site.output_layout == "bthd":
                    out = bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3]))
                vmap[var] = bb.emit(relax.op.reshape(out, shape_of(var)), var.name)
                # the policy's extra inputs (PolicyKernels.kernel_inputs), in its declared order
                inputs = [_kernel_input(name, site, q) for name in kspec.inputs]
                if site_eviction is not None:  # a policy that wires its own kernels (D2O)
                    new, extra = site_eviction(bb, kernel, site, spec, T, caches, inputs, kb, vb, pos32, nv)
                    new_caches.append(int8_cache.write(bb, kernel, site, new, stored, pos_before) if int8 else new)
                    extra_outputs.extend(extra)
                    continue
                args = [kc, vc, pc, fc, kb, vb, pos32, nv]
                params_ = dict(spec.policy_params)
                params_.update(site_params(spec.policy, Hq, site.sm_scale))
                if spec.question_rows and W:  # the prefill step's extra rows may hold a question
                    params_["question_rows"] = W
                tag = policy_tag(spec.policy) + (f"_h{Hq}_{H}_d{D}" if kspec.needs_site else f"_h{H}_d{D}")
                cand = None
                if S:
                    obs_gv = kernel(f"observe_{tag}",
                                    lambda: build_observe(spec.policy, H, N, T, D, spec.dtype, params_))
                    cand = bb.emit(relax.call_tir(obs_gv, args + inputs + [st],
                                                  relax.TensorType((S, H, N + T), "float32")), f"cand_state_{site.index}")
                score_gv = kernel(f"score_{tag}",
                                  lambda: build_score(spec.policy, H, N, T, D, spec.dtype, params_))
                sel_kind = "score" if score_gv is not None else "append"
                select_gv = kernel(f"select_h{H}_d{D}_{sel_kind}" + (f"_s{S}" if S else ""),
                                   lambda: build_select(H, N, T, D, spec.dtype, score_gv is not None, S))
                sel_args = list(args)
                if score_gv is not None:
                    score = bb.emit(relax.call_tir(score_gv, args + inputs + ([cand] if S else []),
                                                   relax.TensorType((H, N + T), "float32")), f"score_{site.index}")
                    sel_args.append(score)
                inplace = [0, 1, 2, 3]
                if S:
                    inplace.append(len(sel_args))
                    sel_args += [st, cand]
                types = cache_types(site, N, spec.dtype, spec.policy, spec.policy_params)
                upd = bb.emit(relax.call_tir_inplace(select_gv, sel_args, inplace, types[:len(inplace)]),
                              f"evict_{site.index}")
                kept = [bb.emit(relax.TupleGetItem(upd, i), f"{f}_new_{site.index}")
                        for i, f in enumerate(fields[:len(inplace)])]
                # the policy's own per-layer tensors (``compiled_state``), brought in step with the
                # compacted cache by its hook (RocketKV's page summaries), else passed through
                own = caches[len(inplace):]
                if after_select is not None:
                    own = after_select(bb, kernel, site, spec, T, kept, own, nv)
                new = kept + list(own)
                new_caches.append(int8_cache.write(bb, kernel, site, new, stored, pos_before) if int8 else new)
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


def _local_site(bb, kernel, site: AttentionSite, spec: BlockCacheSpec, var, window: int, T: int, W: int, caches,
                q, kb, vb, pos32, nv, vmap) -> list:
    """A sliding-window layer's step: attention over cache ⊕ block masked to the window (a cache slot
    by the position it holds), then the block's rows written into the ring at position mod window, in
    place (``kernels/window.py``). Returns the layer's new caches."""
    H, Hq, D = site.num_kv_heads, site.num_q_heads, site.head_dim
    if W:
        raise AttentionMatchError(f"attention site {site.index} is a sliding-window layer: its step takes no pseudo "
                                  "or question rows")
    kc, vc, pc, fc = caches[:4]
    attn_gv = kernel(attention_kernel_key(Hq, H, D, 0) + f"_ring{window}",
                     lambda: build_attention(Hq, H, window, T, D, site.sm_scale, spec.dtype, 0, spec.cores, window))
    out = bb.emit(relax.call_tir(attn_gv, [q, kb, vb, kc, vc, pc, fc, pos32, nv],
                                 relax.TensorType((1, Hq, T, D), spec.dtype)), f"attn_{site.index}")
    if site.output_layout == "bthd":
        out = bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3]))
    vmap[var] = bb.emit(relax.op.reshape(out, shape_of(var)), var.name)
    keep_gv = kernel(f"ring_h{H}_d{D}_w{window}", lambda: build_window(H, window, T, D, spec.dtype))
    types = [relax.TensorType(shape, dt) for _, shape, dt in
             cache_layout(H, D, window, "full", spec.dtype)[:4]]
    upd = bb.emit(relax.call_tir_inplace(keep_gv, [kc, vc, pc, fc, kb, vb, pos32, nv], [0, 1, 2, 3], types),
                  f"window_{site.index}")
    kept = [bb.emit(relax.TupleGetItem(upd, i), f"{f}_new_{site.index}") for i, f in enumerate(CACHE_FIELDS)]
    return kept + list(caches[4:])


def _kernel_input(name: str, site: AttentionSite, q):
    """The graph tensor behind a ``PolicyKernels.kernel_inputs`` name at one attention site."""
    if name == "queries":
        return q  # [1, Hq, T, D] post-RoPE, as the block-attention kernel takes it
    raise AttentionMatchError(f"no kernel input named {name!r} at attention site {site.index}")


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
