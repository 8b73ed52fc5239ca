"""The compiler pipeline: every step of a compile, in order, with the target's choices inline.

``compile_pipeline`` runs, for one policy, budget N, block B and target:

  0. frontend           ``frontend/export.py``: torch.export the plain forward at T = B (+ extra
                        rows) and T = 1 and import both into Relax (``prefill_src``, ``decode_src``);
                        an ONNX file's graph comes from ``frontend/onnx_model.py`` instead
  1. block cache        ``passes/rewrite_block_cache.py``: attention sites → block attention and
                        eviction kernels over explicit caches; functions ``prefill_block``, ``decode``.
                        Inside it: an int8 cache (``passes/int8_cache.py``, ``--kv-dtype int8``) and
                        pseudo / question rows (``passes/pseudo_rows.py``, DapQ and ``--question-rows``)
  2. last token         ``passes/hoist_last_token.py``: the LM head on the last valid row only
  3. dead code          TVM's DeadCodeElimination: drops the dead softmax/mask subgraphs, the full head
  4. pretranspose       ``passes/pretranspose_weights.py``: linear weights stored as Wᵀ
  5. weight layout      this CPU, fp32: ``passes/pack_weights.py`` (column panels, packed GEMM/GEMV);
                        q4 / q8: ``passes/quantize_weights.py`` (block panels on CPUs, rows on GPUs);
                        otherwise fp32 as TVM lays it out; GPUs then: sibling projections (q/k/v,
                        gate/up) as one matmul over concatenated weights (``passes/combine_projections.py``)
  6. memory plan        ``backend/memory_plan.py``; refused above ``--mem-limit``
  7. prepare            ``passes/add_prepare_function.py``: the policy's per-prompt function, for
                        builds the native runtime runs (CPU targets and OpenCL)
  8. schedule, codegen  fp64 → fp32 where the device lacks fp64 (``backend/gpu_schedule.py``); GPUs:
                        fewer launches (``passes/gate_up_silu.py``: the decode gate/up GEMV and SiLU·up as one
                        kernel; ``passes/gpu_fusion.py``: matmuls without their reshapes so
                        the adds join their epilogues, RMSNorm as one kernel; ``passes/norm_gemv.py``:
                        decode RMSNorm folded into the q/k/v GEMV + RoPE and the gate/up kernel; the
                        two decode fusions are ``gpu_schedule`` profile choices), edgekv's GPU kernels
                        in place (ReplaceKernels), dlight for the rest (the GEMV rule: the target
                        profile's ``gpu_schedule.gemv``), nothing
                        left on the host (CheckAllOnDevice); CPUs: ``backend/cpu_schedule.py``; then
                        ``tvm.compile``, keeping the final Relax module for ``program.ekv``

``lower(model, spec, block)`` runs steps 0–4 only (the target-independent part).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import tvm
from tvm import relax

from ..artifact import Keys
from .errors import CompileError
from .frontend.export import check_imported_rows, import_model
from .passes.attention_sites import AttentionSite
from .passes.hoist_last_token import HoistLastTokenGather
from .passes.pretranspose_weights import SUFFIX, PretransposeWeights
from .passes.pseudo_rows import extra_rows
from .passes.rewrite_block_cache import BlockCacheSpec, RewriteBlockCache, layer_windows
from .policy_kernels import kernel_params

FUNCTIONS = ("prefill_block", "decode")


@dataclass
class Lowered:
    mod: tvm.IRModule
    params: list[tuple[str, Any]]  # (name, numpy array) in function-argument order
    sites: list[AttentionSite]
    timings: dict[str, float] = field(default_factory=dict)
    combined_projections: int = 0  # matmuls merged into a sibling's (GPU builds, ``combine_projections``)


@dataclass
class Compiled:
    """What ``compile_pipeline`` hands the driver to check and write."""

    lowered: Lowered
    spec: BlockCacheSpec
    plan: dict  # the static memory plan (manifest "memory_plan")
    weights: dict  # the manifest's "weights" entry
    executable: Any  # tvm.relax.VMExecutable
    final_module: Any  # the Relax module after TVM's pipeline (program.ekv); None for CUDA / Metal
    device: dict  # what scheduling did (a device build's manifest "device" section starts from it)
    device_kernels: dict | None  # a native GPU build's {name: DeviceKernel}


def block_cache_spec(policy: Any, budget: int, *, cores: int = 1, kv_dtype: str = "fp32",
                     question_rows: int = 0, config: Any = None) -> BlockCacheSpec:
    """What the block-cache pass needs: the policy's kernel parameters, the extra rows of the
    prefill step (the policy's pseudo rows or a question, whichever is more), the CPU's threads
    (the attention kernel's row tiles), the cache's K/V format and, from the model's description
    (``config``), each layer's sliding window (a local layer's cache kind)."""
    from ..memory import check_kv_dtype

    return BlockCacheSpec(budget=budget, policy=policy.name, policy_params=kernel_params(policy, budget),
                          extra_rows=max(extra_rows(policy), int(question_rows)), question_rows=int(question_rows),
                          cores=int(cores), kv_dtype=check_kv_dtype(kv_dtype),
                          layer_windows=layer_windows(config) if config is not None else ())


def relax_passes(spec: BlockCacheSpec) -> list:
    """Steps 1–4: the target-independent Relax passes, in order."""
    rewrite = RewriteBlockCache(spec, [("prefill_src", "prefill_block", None), ("decode_src", "decode", 1)])
    return [rewrite, HoistLastTokenGather(list(FUNCTIONS)), relax.transform.DeadCodeElimination(list(FUNCTIONS)),
            PretransposeWeights(list(FUNCTIONS))]


def lower_module(mod: tvm.IRModule, spec: BlockCacheSpec) -> tuple[tvm.IRModule, list[AttentionSite], set[str]]:
    """Run steps 1–4; returns the module, the attention sites and the names of the weights the
    module now takes transposed (see ``param_layout``)."""
    seq = relax_passes(spec)
    for p in seq:
        mod = p(mod)
    return mod, seq[0].sites["prefill_block"], seq[-1].transposed


def param_layout(params: list[tuple[str, Any]], transposed: set[str]) -> list[tuple[str, Any]]:
    """The weight arrays as the lowered functions take them (transposed ones renamed ``name.T``).

    A transposed weight is a *view* (``a.T``), not a copy: the weight layout (step 5) reads it as
    it is — Q4_K/Q6_K blocks come from the source file and never touch it, Q4_1 quantisation and
    fp32 panels read it once — and ``contiguous_params`` copies what is left, one tensor at a time.
    Copying every linear weight here held a second fp32 model (4.9 GiB for a 1.5B) through step 5."""
    return [(n + SUFFIX, a.T) if n in transposed else (n, a) for n, a in params]


def contiguous_params(params: list[tuple[str, Any]]) -> None:
    """Make every array of ``params`` C-contiguous in place, one at a time (the params file and
    TVM take contiguous arrays), so that at most one copy is alive beside the views."""
    import numpy as np

    from .frontend.weight_arrays import materialize

    materialize(params)  # weights still in their file (the F32 norms and biases of a K-quant GGUF)
    for i, (n, a) in enumerate(params):
        if isinstance(a, np.ndarray) and not a.flags["C_CONTIGUOUS"]:
            params[i] = (n, np.ascontiguousarray(a))


def lower(model: Any, spec: BlockCacheSpec, block: int, imported=None) -> Lowered:
    """Steps 0–4: the module and weights before any target's choices."""
    mod, params, timings = imported if imported is not None else import_model(model, block, spec.extra_rows)
    check_imported_rows(mod, block, spec.extra_rows)
    timings = dict(timings)
    t0 = time.perf_counter()
    mod, sites, transposed = lower_module(mod, spec)
    timings["passes_s"] = time.perf_counter() - t0
    return Lowered(mod=mod, params=param_layout(params, transposed), sites=sites, timings=timings)


def lay_out_weights(lowered: Lowered, model: Any, weights: str, cores: int, layout: str | None,
                    activations: str = "fp32", isa: str = "generic") -> dict[str, Any]:
    """Step 5: the weights as the target's kernels read them (``layout``: ``target.weight_layout``)
    — fp32 column panels on this CPU (``pack_weights.py``; elsewhere fp32 stays as TVM lays it
    out) or quantised blocks (``quantize_weights.py``) — rewriting ``lowered.mod`` and
    ``lowered.params`` in place. Returns the manifest's ``weights`` entry. ``activations``: the
    decode GEMVs' x (fp32, or int8 on the ``isa`` path: ``kernels/int8_gemv.py``)."""
    info = _lay_out_weights(lowered, model, weights, cores, layout, activations, isa)
    contiguous_params(lowered.params)
    return info


def _lay_out_weights(lowered: Lowered, model: Any, weights: str, cores: int, layout: str | None,
                     activations: str, isa: str) -> dict[str, Any]:
    W = Keys.Weights
    if weights == "fp32":  # every weight is read as fp32: take those still in their file now
        from .frontend.weight_arrays import materialize

        materialize(lowered.params)
    if weights == "fp32" and layout != "host":
        return {W.FORMAT: "fp32", W.TENSORS: {"fp32": len(lowered.params)}}
    if weights == "fp32":
        from .passes.pack_weights import PackWeights, pack_params

        packer = PackWeights(list(FUNCTIONS), cores)
        lowered.mod = packer(lowered.mod)
        lowered.params = pack_params(lowered.params, packer.packed)
        return {W.FORMAT: "fp32", W.TENSORS: {"fp32": len(lowered.params)}}
    from .passes.quantize_weights import QuantizeWeights, quantize_params
    from .quant_formats import GROUP, open_source_blocks

    source = open_source_blocks(model)
    quantizer = QuantizeWeights(list(FUNCTIONS), cores, weights, gpu=layout == "gpu", source=source,
                                activations=activations, isa=isa)
    lowered.mod = quantizer(lowered.mod)
    lowered.params, origin = quantize_params(lowered.params, quantizer.plan, source)
    kinds: dict[str, int] = {}
    for q in quantizer.plan.values():
        kinds[q.fmt.ggml] = kinds.get(q.fmt.ggml, 0) + 1
    kinds["fp32"] = len([n for n, a in lowered.params if str(getattr(a, "dtype", "")) == "float32"])
    return {W.FORMAT: weights, W.GROUP: GROUP, W.SCALE_DTYPE: "float32" if layout == "gpu" else "float16",
            W.LAYOUT: "rows" if layout == "gpu" else "panels", W.TENSORS: kinds,
            # blocks taken from the source GGUF as they are, and tensors quantised here from fp32
            W.BLOCKS_FROM_SOURCE: origin["gguf"], W.QUANTIZED_HERE: origin["quantized"],
            W.BYTES: int(sum(int(a.nbytes) for _, a in lowered.params)),
            W.DECODE_ACTIVATIONS: f"int8/{isa}" if activations == "int8" else "fp32"}


def combine_projections(lowered: Lowered) -> None:
    """Step 5, GPU builds: q/k/v and gate/up as one matmul each over their weights concatenated
    (``passes/combine_projections.py``), rewriting ``lowered.mod`` and ``lowered.params`` in place."""
    from .passes.combine_projections import CombineProjections, combine_params

    combiner = CombineProjections(list(FUNCTIONS))
    lowered.mod = combiner(lowered.mod)
    lowered.params = combine_params(lowered.params, combiner.groups)
    lowered.combined_projections = combiner.combined


def compile_pipeline(model: Any, policy: Any, budget: int, block: int, target, *, weights: str,
                     kv_dtype: str = "fp32", question_rows: int = 0, decode_activations: str = "fp32",
                     imported=None, mem_limit: int | None = None,
                     say: Callable[[str], None] = lambda msg: None) -> Compiled:
    """Steps 0–8 for a resolved ``target`` (``backend.target.CompileTarget``) and weight format;
    the driver (``driver.py``) has checked the request."""
    from .backend.memory_plan import memory_plan
    from .passes.add_prepare_function import add_prepare_function

    # 0–4: frontend and the target-independent passes; the spec carries the int8 cache and the
    # pseudo / question rows into the block-cache pass
    say("exporting and lowering")
    spec = block_cache_spec(policy, budget, cores=target.cores, kv_dtype=kv_dtype, question_rows=question_rows,
                            config=getattr(model, "config", None))
    lowered = lower(model, spec, block, imported)

    # 5: weight layout
    say(f"laying out the weights ({weights})")
    isa = "generic"
    if decode_activations == "int8":
        from .kernels.int8_gemv import int8_isa

        isa = int8_isa(target.tvm)
    with target.tvm_target():  # the CPU kernels' register tiles are sized for it (kernels/register_tile.py)
        weight_info = lay_out_weights(lowered, model, weights, target.cores, target.weight_layout, decode_activations,
                                      isa)
    if target.is_gpu:  # GPUs: sibling projections as one matmul (one launch) over the stored arrays
        combine_projections(lowered)

    # 6: memory plan
    plan = memory_plan(lowered, budget, policy.name, spec.policy_params, spec.kv_dtype,
                       [spec.site_budget(s.index) for s in lowered.sites])
    P = Keys.MemoryPlan
    if mem_limit is not None and plan[P.TOTAL_BYTES] > mem_limit:
        q4 = weights == "q4" or target.weight_layout is None
        raise CompileError(f"the static memory plan needs {plan[P.TOTAL_BYTES]} bytes (weights {plan[P.WEIGHTS_BYTES]}, "
                           f"cache {plan[P.CACHE_BYTES]}, activations {plan[P.ACTIVATION_BYTES]}), above the limit "
                           f"{mem_limit}; lower --budget or --block" + ("" if q4 else ", or use --weights q4"))

    # 7: the policy's per-prompt function (D2O's probe → layer budgets), over the final weight
    # layout; builds without a runtime for it (CUDA, Metal) leave it out
    if target.native_runtime:
        lowered.mod = add_prepare_function(lowered.mod, policy, budget)

    # 8: scheduling and code generation
    say("compiling with TVM" + ("" if target.is_host else f" for {target.name}"))
    t0 = time.perf_counter()
    ex, final, device = schedule_and_build(lowered, spec, target)
    lowered.timings["tvm_compile_s"] = time.perf_counter() - t0
    return Compiled(lowered=lowered, spec=spec, plan=plan, weights=weight_info, executable=ex,
                    final_module=final.get("mod"), device=device, device_kernels=final.get("device_kernels"))


def schedule_and_build(lowered: Lowered, spec: BlockCacheSpec, target) -> tuple[Any, dict, dict]:
    """Step 8: ``tvm.compile`` with the target's schedules. Returns (executable, {"mod": the Relax
    module after TVM's pipeline, "device_kernels": a native GPU build's kernels}, device info).

    CPU targets and OpenCL keep the final module — what ``backend/program.py`` writes as
    ``program.ekv`` for the native runtime — and OpenCL each device kernel's launch description
    (``backend/device_kernels.py``); other GPU targets (CUDA, Metal) have no native runtime."""
    from .backend.cpu_schedule import cpu_pipeline
    from .backend.gpu_schedule import (CheckAllOnDevice, ReplaceKernels, block_attention_of, demote_float64, fusions_of,
                                       gemv_schedule_of, gpu_pipeline)
    from .backend.program import capture_final_module
    from .passes.gate_up_silu import FuseGateUpSiLU
    from .passes.gpu_fusion import FuseForGPU
    from .passes.norm_gemv import FuseNormIntoGEMV

    mod = lowered.mod
    tvm_target = target.tvm_target()
    final: dict = {}
    D = Keys.Device
    info: dict[str, Any] = {D.KIND: target.kind}
    if target.demote_float64:
        mod = demote_float64(mod)
        info[D.FLOAT64_DEMOTED] = True
    if not target.is_gpu:
        ex = tvm.compile(mod, target=tvm_target, relax_pipeline=capture_final_module(cpu_pipeline, final)(tvm_target))
        return ex, final, info
    fusions = fusions_of(target.profile)  # decode launches: a profile choice (gpu_schedule.FUSIONS)
    gate_up = FuseGateUpSiLU(["decode"])  # a decode GEMV's launch is per token, a GEMM's per block
    if fusions["gate_up_silu"]:
        mod = gate_up(mod)
    fusion = FuseForGPU(list(FUNCTIONS))
    mod = fusion(mod)
    norm = FuseNormIntoGEMV(["decode"])
    if fusions["norm_gemv"]:
        mod = norm(mod)
    info[D.GPU_FUSION] = dict(fusion.folded, combined_projections=lowered.combined_projections,
                              gate_up_silu=gate_up.fused, **norm.fused)
    scales = {(s.num_q_heads, s.num_kv_heads, s.head_dim): s.sm_scale for s in lowered.sites}
    block_attention = block_attention_of(target.profile)
    replace = ReplaceKernels(spec.policy, spec.policy_params, scales, block_attention)
    mod = replace(mod)
    check = CheckAllOnDevice()
    gemv = gemv_schedule_of(target.profile)
    info[D.GPU_FUSION]["gemv_schedule"] = gemv
    info[D.GPU_FUSION]["block_attention"] = block_attention
    if target.native_runtime:
        from .backend.device_kernels import record_device_kernels

        pipeline = capture_final_module(lambda t: gpu_pipeline(t, check, gemv), final)(tvm_target)
        with record_device_kernels(target.kind) as kernels:
            ex = tvm.compile(mod, target=tvm_target, relax_pipeline=pipeline)
        final["device_kernels"] = kernels
    else:
        ex = tvm.compile(mod, target=tvm_target, relax_pipeline=gpu_pipeline(tvm_target, check, gemv))
    info[D.EDGEKV_KERNELS] = replace.replaced
    info[D.DEVICE_FUNCTIONS] = check.device_functions
    info[D.SYMBOLIC_SHAPES] = check.symbolic
    return ex, final, info
