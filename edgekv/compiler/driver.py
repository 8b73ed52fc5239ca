"""The driver: one ``compile_model`` for every target — check the request once, run the pipeline
(``pipeline.py``), check what it built, write the artifact (``backend/artifact_writer.py``).

``compile_model(model, policy, budget, block, target="host", out_dir=...)`` is the public entry.
A build for this machine's CPU (the ``host`` profile) writes the artifact the runtimes load as is.
A build for another device (CUDA, OpenCL for Adreno/Mali, Metal, Hexagon, Android CPU, aarch64
Linux: ``edgekv/profiles/targets/``) writes the same artifact plus the generated device code
beside it (``device/``: the CUDA / OpenCL / Metal source, or the object files for LLVM cross
targets) and a ``device`` section in the manifest: which function runs where, the kernel sizes,
and — where a toolchain that is not here is needed to finish the build (Android NDK, Xcode,
Hexagon SDK) — what to run with it (``python -m edgekv.compiler.backend.finish <dir>``). Nothing
here needs the device. CPU and OpenCL builds carry ``program.ekv`` for the native runtime; after
``finish`` links the library, an aarch64 artifact runs in ``runtime/``'s ``edgekv-run`` built for
aarch64 (docs/NATIVE.md).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..artifact import ArtifactError, Keys, Manifest
from ..artifact.manifest import ToolchainStatus
from .backend.artifact_writer import BuildResult, build_manifest, write_artifact
from .backend.target import CompileTarget, is_gpu_target
from .errors import CompileError, ToolchainNeededWarning
from .frontend.export import check_exportable
from .passes.pseudo_rows import check_question_rows


def check_policy_builds_for(policy: Any, tgt: dict, kv_dtype: str = "fp32", question_rows: int = 0) -> None:
    """Refuse, before any work, a GPU build of a policy that has no GPU kernels (RocketKV's stage 2),
    of an int8 KV cache or of question rows (their kernels are CPU loops)."""
    from .policy_kernels import gpu_policy_names

    if not is_gpu_target(tgt):
        return
    if question_rows:
        raise CompileError(f"--question-rows has no GPU kernels yet, so it cannot be compiled for {tgt.get('kind')}: "
                           "the GPU score / observe kernels (kernels/attention_scores.py *_gpu for SnapKV, SnapKV++, "
                           "TOVA and H2O; policy_kernels/dapq.py build_dapq_evict_kernel_gpu) score with the block's "
                           "own rows or DapQ's pseudo rows and take no question_rows: they neither read the question's "
                           "rows after the block nor skip the padding rows at position -1, as the CPU kernels do; "
                           "compile it for a CPU target (host, aarch64-linux, android-cpu), or drop --question-rows")
    if kv_dtype != "fp32":
        raise CompileError(f"--kv-dtype {kv_dtype} has no GPU kernels yet, so it cannot be compiled for "
                           f"{tgt.get('kind')}: the int8 cache's store, dequantise, round-trip and position-copy "
                           "kernels (kernels/kv_int8.py) are CPU loops with no *_gpu version, and the GPU attention, "
                           "score and select kernels read an fp32 cache; compile the int8 cache for a CPU target "
                           "(host, aarch64-linux, android-cpu), or compile for the GPU with --kv-dtype fp32")
    if policy.name not in gpu_policy_names():
        raise CompileError(f"policy '{policy.name}' has no GPU kernels yet, so it cannot be compiled for "
                           f"{tgt.get('kind')}{_missing_gpu_kernels(policy.name)}; compile it for a CPU target "
                           "(host, aarch64-linux, android-cpu), "
                           f"or pick a policy with GPU kernels: {', '.join(gpu_policy_names())}")


def check_local_layers(config: Any, policy: Any, budget: int, tgt: dict, kv_dtype: str = "fp32",
                       question_rows: int = 0) -> None:
    """Refuse, before any work, what a model with sliding-window ("local") layers cannot be compiled
    with yet, naming the missing piece; and a budget below the window (the window is the floor)."""
    from ..budget import BudgetError, check_window_floor
    from .passes.pseudo_rows import extra_rows
    from .policy_kernels import KERNELS

    local = [i for i, kind in enumerate(getattr(config, "layer_kinds", ()) or ()) if kind == "local"]
    if not local:
        return
    try:
        check_window_floor(config, budget)
    except BudgetError as exc:
        raise CompileError(str(exc)) from None
    what = f"this model's {len(local)} sliding-window layers (window {config.sliding_window})"
    if is_gpu_target(tgt):
        raise CompileError(f"{what} have no GPU kernels yet: the window-masked attention and the ring write "
                           "(kernels/attention.py with window, kernels/window.py) are CPU kernels; compile it for a CPU "
                           "target (host, aarch64-linux, android-cpu)")
    if kv_dtype != "fp32":
        raise CompileError(f"--kv-dtype {kv_dtype} is not compiled for {what} yet: the int8 cache's read / write "
                           "(passes/int8_cache.py) wraps only the global layers' step; compile with --kv-dtype fp32")
    if question_rows or extra_rows(policy):
        rows = "--question-rows" if question_rows else f"policy '{policy.name}''s pseudo rows"
        raise CompileError(f"{rows} are not compiled for {what} yet: the window-masked attention takes no rows after "
                           "the block; drop --question-rows, or pick a policy without pseudo rows (e.g. keydiff, snapkv)")
    face = KERNELS.get(policy.name)
    hooks = [h for h in ("emit_site_eviction", "emit_prepare", "emit_decode_attention", "emit_after_select")
             if face is not None and getattr(face, h, None) is not None]
    if hooks:
        raise CompileError(f"policy '{policy.name}' is not compiled for {what} yet: its own site hooks "
                           f"({', '.join(hooks)}: policy_kernels/{policy.name}.py) are written for a model whose every "
                           "layer has the policy's cache (D2O's layer budgets are allocated over all layers, not the "
                           "global ones the eager engine uses); pick another policy (e.g. keydiff, snapkv, "
                           "streaming_llm) or run it eagerly: `edgekv run MODEL --policy " + policy.name + "`")


def _missing_gpu_kernels(name: str) -> str:
    """': <what has no GPU version>' for a policy's compiled face (its CPU-only hooks), else ''."""
    from .policy_kernels import KERNELS

    face = KERNELS.get(name)
    if face is None:
        return ""
    missing = []
    if face.evict_kernel is not None and face.gpu_evict_kernel is None:
        missing.append(f"its score kernel ({face.evict_kernel.__name__}: no gpu_evict_kernel in its face)")
    if face.emit_decode_attention is not None:
        missing.append("its own decode attention (emit_decode_attention: a CPU kernel, e.g. RocketKV's stage 2)")
    if face.emit_after_select is not None:
        missing.append("its after-select kernel (emit_after_select: a CPU kernel, e.g. RocketKV's page summaries)")
    return (": " + "; ".join(missing)) if missing else ""


def resolve_weights(model: Any, weights: str | None, layout: str | None) -> str:
    """The weight format of a build: ``weights`` when given, else q4 for a 4-bit source
    (``quant_formats.default_weights``) and fp32 otherwise; fp32 where the target has no
    quantised kernels (``weight_layout`` None), and asking for more there is refused."""
    from .quant_formats import WEIGHT_CHOICES, default_weights, unsupported_types_message

    if weights is None:
        weights = default_weights(model) if layout is not None else "fp32"
    if weights not in WEIGHT_CHOICES:
        raise CompileError(f"--weights {weights!r} is not a weight format; use one of {', '.join(WEIGHT_CHOICES)}")
    if weights != "fp32" and layout is None:
        raise CompileError(f"--weights {weights} has no kernels for this target yet; compile it with --weights fp32")
    if weights != "fp32" and (why := unsupported_types_message(model)):  # before the export
        raise CompileError(why)
    return weights


TVM_BUILD_BYTES = 1 << 30  # TVM's own working set while it schedules and builds (measured: docs/COMPILER.md)


def resolve_decode_activations(activations: str | None, weights: str, layout: str | None) -> str:
    """The decode GEMVs' activations (``--decode-activations``): int8 (x quantised per 32, integer dot
    products: ``kernels/int8_gemv.py``) or fp32. None: ``DEFAULT_DECODE_ACTIVATIONS`` where the build
    has int8 kernels (quantised weights on a CPU), else fp32; int8 asked for elsewhere is refused."""
    from .passes.quantize_weights import DECODE_ACTIVATIONS

    if activations is not None and activations not in DECODE_ACTIVATIONS:
        raise CompileError(f"--decode-activations {activations!r} is not an activation format; use one of "
                           f"{', '.join(DECODE_ACTIVATIONS)}")
    has_int8 = weights != "fp32" and layout in ("host", "cpu")
    if activations is None:
        return DEFAULT_DECODE_ACTIVATIONS if has_int8 else "fp32"
    if activations == "int8" and not has_int8:
        raise CompileError("--decode-activations int8 has kernels for quantised weights on a CPU target only "
                           f"(this build: --weights {weights}, {layout or 'no quantised'} layout); compile with "
                           "--weights q4 on a CPU target, or with --decode-activations fp32")
    return activations


# fp32 or int8: chosen from measurements (docs/COMPILER.md, "int8 decode activations")
DEFAULT_DECODE_ACTIVATIONS = "fp32"


def compile_memory_need(model: Any, weights: str) -> dict[str, int]:
    """The memory a compile still allocates on top of the loaded model, by what takes it: the
    laid-out params (q4 / q8 blocks, or fp32 panels), the largest weight once more (a transposed /
    panelled / quantised copy is made one tensor at a time: ``pipeline.param_layout``) and TVM's
    build. The imports hold views of the loaded weights (``frontend/export.py``): nothing."""
    shapes = model.weight_shapes.values() if hasattr(model, "weight_shapes") else [
        tuple(t.shape) for t in getattr(model, "weights", {}).values()]  # shapes only: weights may stay in their file
    mats = [4 * int(s[0]) * int(s[1]) for s in shapes if len(s) == 2]
    per_fp32 = {"q4": 6.5 / 32, "q8": 8.5 / 32}.get(weights, 1.0)  # Q4_K/Q6_K/Q4_1 ≤ 6.5 bits, Q8_0 8.5
    return {"laid-out params": int(sum(mats) * per_fp32), "one weight in flight": max(mats, default=0),
            "TVM build": TVM_BUILD_BYTES}


def check_compile_memory(model: Any, weights: str) -> None:
    """Refuse before exporting a compile that cannot fit in the memory left (the machine's, or the
    cgroup's / rlimit's this process runs under), with the numbers."""
    from ..memory import available_bytes
    from ..units import human_bytes as h

    need = compile_memory_need(model, weights)
    total = sum(need.values())
    avail, source = available_bytes()
    if total > avail:
        parts = " + ".join(f"{what} {h(b)}" for what, b in need.items())
        raise CompileError(f"compiling {getattr(model, 'model_id', 'the model')} needs about {h(total)} more memory "
                           f"({parts}) on top of the loaded weights, and {h(avail)} is left ({source}); close other "
                           "programs, raise that limit or compile on a machine with more memory (peak measured in "
                           "docs/COMPILER.md)")


def compile_model(model: Any, policy: Any, budget: int, block: int = 128, target: str | dict = "host",
                  out_dir: str | Path | None = None, *, mem_limit: int | None = None,
                  progress=None, imported=None, weights: str | None = None, kv_dtype: str = "fp32",
                  question_rows: int = 0, decode_activations: str | None = None) -> BuildResult:
    """Compile ``model`` (a ``LoadedModel``, or an ``onnx_model.OnnxModel`` whose graph and weights come
    from an ONNX file) with ``policy`` (a ``Policy`` instance) at budget N and block B for
    ``target`` (a profile name, a path to a profile .json, a profile dict, or a TVM target dict);
    write the artifact to ``out_dir`` when given.

    ``imported`` (from ``import_model(model, block)``) skips the torch export, so several policies
    can be compiled from one export. ``weights``: q4 | q8 | fp32 (``resolve_weights``; None: the
    model's default). ``kv_dtype``: how the caches store K and V, fp32 or int8
    (``memory.KV_DTYPES``; int8: CPU targets). ``question_rows``: room for a document's question of
    that many tokens to score the blocks (query-aware policies, CPU targets). ``decode_activations``:
    the decode GEMVs' x, fp32 or int8 (``resolve_decode_activations``; None: the default).

    A device build's manifest has a ``device`` section: where each function runs, the generated
    code sizes and ``toolchain.status``: ``complete`` when the artifact loads as is on the device
    side (CUDA: TVM compiles the embedded CUDA C at load), ``needs-toolchain`` when a tool that is
    not part of this build must link it (named in ``toolchain.tool`` / ``toolchain.finish``)."""
    from .pipeline import compile_pipeline

    say = progress or (lambda msg: None)
    # the request, checked once, before any work
    if budget <= 0 or block <= 0:
        raise CompileError("budget and block must be positive token counts")
    policy.check_budget(budget, block)
    policy.check_model(model.config)  # e.g. RocketKV's channels ≤ the head dim
    if hasattr(policy, "use_tokenizer"):  # reconstruct: its rows' words, from the model's tokenizer
        policy.use_tokenizer(getattr(model, "tokenizer", None))
    check_exportable(model.config)  # a description the compiled forward cannot map
    check_question_rows(policy, int(question_rows))
    tgt = CompileTarget.resolve(target)
    check_local_layers(model.config, policy, budget, tgt.tvm, kv_dtype, int(question_rows))
    check_policy_builds_for(policy, tgt.tvm, kv_dtype, question_rows)
    if tgt.ptx:  # cuda-host: its kernels become PTX with NVRTC; refused before any work without it
        from .backend.cuda_ptx import load_nvrtc

        load_nvrtc()
    tokenizer = getattr(model, "tokenizer", None)
    if out_dir is not None and tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        from .backend.artifact_writer import check_native_tokenizer

        try:  # said before the export, not after the build: the artifact will run without tokenizer.ekt
            check_native_tokenizer(tokenizer)
        except ValueError as exc:
            say(f"warning: {exc}; the artifact runs in Python (edgekv run) and in edgekv-run with --prompt-ids")
    if imported is None and hasattr(model, "import_graph"):  # an ONNX file (onnx_model.OnnxModel)
        say("importing the ONNX graph")
        imported = model.import_graph(block)
    weights = resolve_weights(model, weights, tgt.weight_layout)
    decode_activations = resolve_decode_activations(decode_activations, weights, tgt.weight_layout)
    if imported is None:
        check_compile_memory(model, weights)

    built = compile_pipeline(model, policy, budget, block, tgt, weights=weights, kv_dtype=kv_dtype,
                             question_rows=question_rows, decode_activations=decode_activations, imported=imported, mem_limit=mem_limit, say=say)

    lowered = built.lowered
    if tgt.is_host:
        manifest = build_manifest(model, policy, built.spec, budget, block, tgt.profile, target, tgt.tvm, lowered,
                                  built.plan, weights=built.weights)
        result = BuildResult(out_dir=Path(out_dir) if out_dir else None, manifest=manifest,
                             executable=built.executable, params=lowered.params, final_module=built.final_module,
                             policy=policy)
        if out_dir is not None:
            write_artifact(result, lowered.params, tgt.tvm, getattr(model, "tokenizer", None))
        return result
    return _device_artifact(model, policy, budget, block, target, tgt, built, out_dir, say)


def _device_artifact(model: Any, policy: Any, budget: int, block: int, target: str | dict, tgt: CompileTarget, built,
                     out_dir: str | Path | None, say) -> BuildResult:
    """A device build: check where its code landed, describe it in the manifest's ``device``
    section and write the artifact with the device code beside it."""
    from .backend.device_code import DEVICE_DIR, SOURCE_SUFFIX, device_code, elf_machine, host_functions_on_host
    from .backend.finish import toolchain_message

    ex, info, lowered = built.executable, built.device, built.lowered
    code = device_code(ex, tgt.tvm)
    D, T = Keys.Device, Keys.Toolchain
    if tgt.ptx:  # the kernels the native runtime's CUDA device loads (cuModuleLoadDataEx)
        from .backend.cuda_ptx import compile_ptx, nvrtc_version

        arch = str(tgt.tvm.get("arch", "sm_80"))
        say(f"compiling the CUDA kernels to PTX for {arch} with NVRTC")
        cu = next(n for n in code if n.endswith(".cu"))
        code[cu.removesuffix(".cu") + ".ptx"] = compile_ptx(code[cu].decode(), arch)
        info[D.PTX] = {Keys.Ptx.ARCH: arch, Keys.Ptx.NVRTC: nvrtc_version()}
    info[D.CODE] = {name: len(data) for name, data in code.items()}
    if tgt.kind == "llvm":
        info[D.ELF_MACHINE] = sorted({elf_machine(d) for d in code.values()} - {None})
        info[D.DEVICE_FUNCTIONS] = "all (the whole module is compiled for the device CPU/DSP)"
    else:
        stray = host_functions_on_host(ex)
        if stray:
            raise CompileError(f"functions compiled for the host in a {tgt.kind} build: {', '.join(stray)}")
    tool = dict(tgt.profile.get("toolchain", {}))  # the profile's toolchain keys are the manifest's
    needs = T.ENV in tool
    tool[T.STATUS] = ToolchainStatus.NEEDS_TOOLCHAIN if needs else ToolchainStatus.COMPLETE
    info[D.TOOLCHAIN] = tool
    manifest = build_manifest(model, policy, built.spec, budget, block, tgt.profile, target, tgt.tvm, lowered,
                              built.plan, host=tgt.host, device=info, weights=built.weights)
    # a CPU, OpenCL or cuda-host build carries the flat program (program.ekv) the native runtime runs
    result = BuildResult(out_dir=Path(out_dir) if out_dir else None, manifest=manifest, executable=ex,
                         params=lowered.params, final_module=built.final_module, policy=policy, device_code=code)
    if built.device_kernels is not None:
        suffix = "ptx" if tgt.ptx else SOURCE_SUFFIX[tgt.kind]  # what the runtime's device loads
        source = next(n for n in code if n.endswith("." + suffix))
        result.device_kernels = {"kind": tgt.kind, "source": f"{DEVICE_DIR}/{source}",
                                 "kernels": built.device_kernels, "kinds": info.get(D.EDGEKV_KERNELS, {}),
                                 "arch": str(tgt.tvm.get("arch", "")) if tgt.ptx else None}
        manifest[Keys.DEVICE][D.NATIVE_RUNTIME] = {Keys.NativeRuntime.DEVICE: tgt.kind,
                                                   Keys.NativeRuntime.KERNELS: len(built.device_kernels)}
    if out_dir is not None:
        out = Path(out_dir)
        (out / DEVICE_DIR).mkdir(parents=True, exist_ok=True)
        for name, data in code.items():
            (out / DEVICE_DIR / name).write_bytes(data)
        manifest[Keys.DEVICE][D.FILES] = sorted(f"{DEVICE_DIR}/{n}" for n in code)
        write_artifact(result, lowered.params, tgt.tvm, getattr(model, "tokenizer", None))
        msg = toolchain_message(manifest, out)
        say(msg)
        if needs:  # the CLI's progress line is transient: say it where it stays
            warnings.warn(msg, ToolchainNeededWarning, stacklevel=3)
    return result


def compile_or_reuse(model: Any, policy: Any, budget: int, block: int, out_dir: str | Path, *, rebuild: bool = False,
                     kv_dtype: str = "fp32", **kwargs) -> Path:
    """The artifact at ``out_dir``: reused while its manifest matches the model, policy (name and
    parameters), N, B and KV format, else (or with ``rebuild``, after a kernel changed) compiled
    anew — for benchmark tools that run several artifacts of one model."""
    out = Path(out_dir)
    try:
        m = None if rebuild else Manifest.read(out)
    except ArtifactError:  # none yet, unreadable, or of another format version: compile it
        m = None
    if m is not None and (m.policy_name, m.policy_params, m.budget, m.block, m.kv_dtype, m.weight_hash) == (
            policy.name, json.loads(json.dumps(policy.params())), budget, block, kv_dtype, model.weight_hash):
        return out
    compile_model(model, policy, budget, block, out_dir=out, kv_dtype=kv_dtype, **kwargs)
    return out
