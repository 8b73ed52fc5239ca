"""The per-prompt ``prepare`` function: what a policy computes once per prompt before its first
block, compiled like everything else (no policy code in the runtimes).

A policy whose compiled face (``compiler/policy_kernels``) declares ``emit_prepare`` (D2O:
per-layer budgets from the first block's attention) gets a third entry function, added after the weight-layout passes so that it passes
the weights to ``prefill_block`` exactly as that function takes them::

    prepare(tokens, positions, n_valid, prompt_len[1] int64, caches..., weights...)
        probe = prefill_block(tokens, positions, n_valid, caches..., weights...)   # the first block
        caches = emit_prepare(probe, ...)               # e.g. writes d2o_budget, empties the cache
        return (probe logits, caches...)

The runtimes run it after a reset when the prompt is longer than ``prepare_min_prompt`` (the
manifest's ``prepare.min_prompt``, the program's ``prepare_min_prompt`` setting), with the prompt's
first block in the inputs. ``backend/program.py`` inlines the ``prefill_block`` call into the flat program.
"""

from __future__ import annotations

from typing import Any

PREPARE = "prepare"


def add_prepare_function(mod, policy: Any, budget: int):
    """``mod`` with ``prepare`` added when the policy needs one for this budget; else ``mod``."""
    import tvm
    from tvm import relax

    from ..policy_kernels import KERNELS, prepare_min_prompt

    face = KERNELS.get(policy.name)
    emit = face.emit_prepare if face is not None else None
    if emit is None or prepare_min_prompt(policy, budget) is None:
        return mod
    prefill_gv = mod.get_global_var("prefill_block")
    prefill = mod[prefill_gv]
    num_input = int(prefill.attrs["num_input"])
    layers = int(prefill.attrs["edgekv.num_layers"])
    inputs = list(prefill.params[:3])
    cache_params = list(prefill.params[3:num_input])
    fields = len(cache_params) // layers
    params = [relax.Var(p.name, p.ty) for p in inputs] + [relax.Var("prompt_len", relax.TensorType((1,), "int64"))] + \
             [relax.Var(p.name, p.ty) for p in prefill.params[3:]]
    prompt_len = params[3]
    bb = relax.BlockBuilder(mod)
    kernels: dict = {}

    def kernel(key, builder):
        if key not in kernels:
            kernels[key] = bb.add_func(builder(), f"{PREPARE}_{key}")
        return kernels[key]

    attrs = {"num_input": num_input + 1, "edgekv.num_layers": layers}
    with bb.function(PREPARE, params, attrs=attrs, pure=False):
        probe_call = bb.emit(relax.Call(prefill_gv, params[:3] + params[4:]), "probe")
        n_out = len(prefill.ret_ty.fields) if hasattr(prefill, "ret_ty") else None
        probe = [bb.emit(relax.TupleGetItem(probe_call, i)) for i in range(_tuple_len(prefill, n_out))]
        caches = [probe[1 + layer * fields: 1 + (layer + 1) * fields] for layer in range(layers)]
        new = emit(bb, kernel, policy, probe, caches, params[2], prompt_len, budget)
        out = bb.emit(relax.Tuple([probe[0]] + [v for layer in new for v in layer]))
        bb.emit_func_output(out)
    out_mod = bb.get()
    func = out_mod[PREPARE].with_attr("relax.force_pure", True)
    out_mod[out_mod.get_global_var(PREPARE)] = func
    return tvm.ir.transform.Sequential([relax.transform.Normalize()])(out_mod)


def _tuple_len(func, hint) -> int:
    """Number of fields of the function's returned tuple."""
    ty = func.body.body.ty if hasattr(func.body.body, "ty") else None
    fields = getattr(ty, "fields", None)
    if fields is not None:
        return len(fields)
    if hint is not None:
        return hint
    raise RuntimeError("prefill_block does not return a tuple")
