"""Build: lower → ``tvm.compile`` → artifact directory.

An artifact is a directory (``edgekv/artifact``: the contract with the runtimes):

    model.so | model.tar      the compiled library (``export_library``); .tar for cross targets
    params.safetensors        the weights in the functions' argument order, 64-byte aligned
    program.ekv               the entry functions as flat kernel-call lists (``program.py``)
    tokenizer.ekt, tokenizer/ the tokenizer (binary for the native runtime; HF files for Python)
    manifest.json             what was built and how to check it (see ``build_manifest``)

``compile_model(model, policy, budget, block, target="host", out_dir=...)`` is the public entry.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import (ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, PARAMS_FILE, PROGRAM_FILE, TOKENIZER_DIR,
                        TOKENIZER_FILE, edgekv_version, sha256_file)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO_ROOT / "compile"


class CompileError(ValueError):
    """Compilation cannot proceed; the message says why and what to change."""


@dataclass
class BuildResult:
    out_dir: Path
    manifest: dict
    executable: Any  # tvm.relax.VMExecutable (kept for in-process use and tests)
    params: list = None  # [(name, numpy array)] in argument order
    final_module: Any = None  # the Relax module after TVM's pipeline: what program.py exports
    policy: Any = None
    # a GPU build the native runtime runs: {"kind": "opencl", "source": device file, "kernels": {name: DeviceKernel}}
    device_kernels: Any = None


def versions() -> dict[str, str]:
    import tvm

    return {"edgekv": edgekv_version(), "tvm": str(tvm.__version__)}


def _profile_path(target: str) -> Path | None:
    p = Path(target)
    if p.suffix == ".json" and p.exists():
        return p
    cand = PROFILE_DIR / f"{target}.json"
    return cand if cand.exists() else None


def resolve_target(target: str | dict = "host") -> tuple[dict, dict]:
    """A target profile name (``compile/<name>.json``), a JSON path, a target dict, or a TVM
    target kind such as ``llvm``. Returns (profile, resolved TVM target dict); ``"host"`` values
    for ``mcpu`` / ``num-cores`` become this machine's CPU (from LLVM) and core count."""
    if isinstance(target, dict):
        profile = {"name": "custom", "target": dict(target)}
    else:
        path = _profile_path(target)
        if path is not None:
            profile = json.loads(path.read_text())
        elif target == "llvm":
            profile = json.loads((PROFILE_DIR / "host.json").read_text())
        else:
            known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise CompileError(f"unknown target '{target}'; known profiles in compile/: {', '.join(known)} "
                               "(or a path to a profile .json)")
    tgt = dict(profile["target"])
    if tgt.get("kind") == "llvm":
        if tgt.get("mcpu") == "host":
            from tvm.target import codegen

            tgt["mcpu"] = str(codegen.llvm_get_system_cpu())
        if tgt.get("num-cores") == "host":
            tgt["num-cores"] = int(os.cpu_count() or 1)
    return profile, tgt


def policy_kernel_params(policy: Any, budget: int) -> dict[str, Any]:
    """The policy's parameters as its kernel builders take them (its compiled face's
    ``kernel_params``, ``compiler/policy_kernels``; raises ``UnsupportedPolicyError`` without one)."""
    from .policy_kernels import kernel_params

    return kernel_params(policy, budget)


def entry_state_names(lowered) -> list[str]:
    """The policy's per-entry state names the lowered module carries (``edgekv.entry_state``)."""
    func = lowered.mod["prefill_block"]
    names = func.attrs.get("edgekv.entry_state") if func.attrs is not None else None
    return [str(n) for n in names] if names else []


def memory_plan(lowered, budget: int, policy: str = "full", policy_params: dict | None = None,
                kv_dtype: str = "fp32") -> dict[str, int]:
    """Static plan in bytes: weights as stored (each array padded to the params file's 64-byte
    alignment: the bytes a runtime maps) and caches exactly (K, V — int8: codes and scales —, positions,
    fill and the policy's state, ``block_cache.cache_layout``); activations as the peak of live
    intermediate tensors of ``prefill_block`` in binding order (before fusion: an upper bound
    of what TVM's static block-memory planner allocates, which reuses storage)."""
    from .attention_sites import _arg_vars, op_name, shape_of
    from .block_cache import cache_layout

    from ..artifact.params_file import stored_bytes

    weights = sum(stored_bytes(int(a.nbytes)) for _, a in lowered.params)  # what a runtime maps
    cache = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for s in lowered.sites
                for _, shape, dt in cache_layout(s.num_kv_heads, s.head_dim, budget, policy, "float32", policy_params,
                                                 kv_dtype))
    func = lowered.mod["prefill_block"]
    params = set(func.params)
    size: dict = {}
    last_use: dict = {}
    order = []
    for block in func.body.blocks:
        for b in block.bindings:
            i = len(order)
            order.append(b.var)
            shp = shape_of(b.var)
            aliasing = type(b.value).__name__ in ("TupleGetItem", "Var", "DataflowVar")  # views, not new memory
            # a transposed weight feeds a matmul that FuseTransposeMatmul fuses: never materialised
            aliasing = aliasing or (op_name(b.value) == "relax.permute_dims" and b.value.args[0] in params)
            if shp is not None and not aliasing:
                dt = str(b.var.ty.dtype)
                size[b.var] = int(np.prod(shp, dtype=np.int64)) * np.dtype(dt).itemsize
            for a in _arg_vars(b.value):
                last_use[a] = i
    frees: dict[int, list] = {}
    for v, i in last_use.items():
        if v in size and v not in params:
            frees.setdefault(i, []).append(v)
    live = peak = 0
    for i, v in enumerate(order):
        if v in size:
            live += size[v]
        peak = max(peak, live)
        for u in frees.get(i, []):
            live -= size[u]
    return {"weights_bytes": weights, "cache_bytes": cache, "activation_bytes": int(peak),
            "total_bytes": int(weights + cache + peak)}


def weight_layout(profile: dict, tgt: dict) -> str | None:
    """How a target's build lays out its weights: ``host`` (this CPU: fp32 panels or quantised
    panels), ``cpu`` (a cross-compiled CPU: fp32 as TVM lays it out, quantised panels), ``gpu``
    (quantised rows that dlight schedules), or None where quantised weights have no kernels yet
    (Hexagon: its float16 conversions are untested)."""
    from .gpu_schedule import is_gpu_target

    if is_gpu_target(tgt):
        return "gpu"
    if tgt.get("kind") != "llvm" or "hexagon" in str(tgt.get("mtriple", "")):
        return None
    return "cpu" if (profile.get("host") or "mtriple" in tgt) else "host"


def resolve_weights(model: Any, weights: str | None, layout: str | None) -> str:
    """The weight format of a build: ``weights`` when given, else q4 for a 4-bit source
    (``quant_formats.default_weights``) and fp32 otherwise; fp32 where the target has no
    quantised kernels (``weight_layout`` None), and asking for more there is refused."""
    from .quant_formats import WEIGHT_CHOICES, default_weights

    if weights is None:
        return default_weights(model) if layout is not None else "fp32"
    if weights not in WEIGHT_CHOICES:
        raise CompileError(f"--weights {weights!r} is not a weight format; use one of {', '.join(WEIGHT_CHOICES)}")
    if weights != "fp32" and layout is None:
        raise CompileError(f"--weights {weights} has no kernels for this target yet; compile it with --weights fp32")
    return weights


def compile_model(model: Any, policy: Any, budget: int, block: int = 128, target: str | dict = "host",
                  out_dir: str | Path | None = None, *, mem_limit: int | None = None,
                  progress=None, imported=None, weights: str | None = None, kv_dtype: str = "fp32",
                  question_rows: int = 0) -> BuildResult:
    """Compile ``model`` (a ``LoadedModel``, or an ``onnx_model.OnnxModel`` whose graph and weights come
    from an ONNX file) with ``policy`` (a ``Policy`` instance) at budget N
    and block B for ``target``; write the artifact to ``out_dir`` when given.

    ``imported`` (from ``pipeline.import_model(model, block)``) skips the torch export, so
    several policies can be compiled from one export. ``weights``: q4 | q8 | fp32
    (``resolve_weights``; None: the model's default). ``kv_dtype``: how the caches store K and V,
    fp32 or int8 (``memory.KV_DTYPES``; int8: CPU targets). ``question_rows``: room for a document's
    question of that many tokens to score the blocks (query-aware policies, CPU targets)."""
    import tvm

    from .pseudo_rows import check_question_rows

    if budget <= 0 or block <= 0:
        raise CompileError("budget and block must be positive token counts")
    policy.check_budget(budget, block)
    policy.check_model(model.config)  # e.g. RocketKV's channels ≤ the head dim
    check_question_rows(policy, int(question_rows))
    profile, tgt = resolve_target(target)
    if imported is None and hasattr(model, "import_graph"):  # an ONNX file (onnx_model.OnnxModel)
        (progress or (lambda msg: None))("importing the ONNX graph")
        imported = model.import_graph(block)
    layout = weight_layout(profile, tgt)
    weights = resolve_weights(model, weights, layout)
    if layout != "host":
        # GPU / NPU / cross-compiled CPU targets (compile/cuda.json, opencl, metal, hexagon, android-cpu)
        from .targets import build_for_target

        return build_for_target(model, policy, budget, block, profile if isinstance(target, dict) else target,
                                out_dir, imported=imported, progress=progress, mem_limit=mem_limit, weights=weights,
                                kv_dtype=kv_dtype, question_rows=question_rows)
    from .targets import lower_for_target

    say = progress or (lambda msg: None)
    say("exporting and lowering")
    lowered, spec = lower_for_target(model, policy, budget, block, imported, cores=int(tgt.get("num-cores", 1)),
                                     kv_dtype=kv_dtype, question_rows=question_rows)
    say(f"laying out the weights ({weights})")
    weight_info = lay_out_weights(lowered, model, weights, spec.cores, "host")
    plan = memory_plan(lowered, budget, policy.name, spec.policy_params, spec.kv_dtype)
    if mem_limit is not None and plan["total_bytes"] > mem_limit:
        raise CompileError(f"the static memory plan needs {plan['total_bytes']} bytes (weights {plan['weights_bytes']}, "
                           f"cache {plan['cache_bytes']}, activations {plan['activation_bytes']}), above the limit "
                           f"{mem_limit}; lower --budget or --block" + ("" if weights == "q4" else ", or use --weights q4"))
    # the policy's per-prompt function (D2O's probe → layer budgets), over the final weight layout
    from .prepare import add_prepare_function

    lowered.mod = add_prepare_function(lowered.mod, policy, budget)
    say("compiling with TVM")
    t0 = time.perf_counter()
    target_obj = tvm.target.Target(tgt)
    from .cpu_schedule import cpu_pipeline
    from .program import capture_final_module

    final: dict = {}
    ex = tvm.compile(lowered.mod, target=target_obj,
                     relax_pipeline=capture_final_module(cpu_pipeline, final)(target_obj))
    lowered.timings["tvm_compile_s"] = time.perf_counter() - t0
    manifest = build_manifest(model, policy, spec, budget, block, profile, target, tgt, lowered, plan,
                              weights=weight_info)
    result = BuildResult(out_dir=Path(out_dir) if out_dir else None, manifest=manifest, executable=ex,
                         params=lowered.params, final_module=final.get("mod"), policy=policy)
    if out_dir is not None:
        write_artifact(result, lowered.params, tgt, getattr(model, "tokenizer", None))
    return result


def compile_or_reuse(model: Any, policy: Any, budget: int, block: int, out_dir: str | Path, *, rebuild: bool = False,
                     kv_dtype: str = "fp32", **kwargs) -> Path:
    """The artifact at ``out_dir``: reused while its manifest matches the model, policy (name and
    parameters), N, B and KV format, else (or with ``rebuild``, after a kernel changed) compiled
    anew — for benchmark tools that run several artifacts of one model."""
    out = Path(out_dir)
    manifest = out / MANIFEST
    if manifest.exists() and not rebuild:
        m = json.loads(manifest.read_text())
        if (m["policy"]["name"], m["policy"]["params"], m["budget"], m["block"], m.get("kv_dtype", "fp32"),
                m["model"]["weight_hash"]) == (policy.name, json.loads(json.dumps(policy.params())), budget, block,
                                               kv_dtype, model.weight_hash):
            return out
    compile_model(model, policy, budget, block, out_dir=out, kv_dtype=kv_dtype, **kwargs)
    return out


def lay_out_weights(lowered, model: Any, weights: str, cores: int, layout: str) -> dict[str, Any]:
    """The weights as the target's kernels read them (``layout``: ``weight_layout``) — fp32
    column panels on the host (``pack_weights.py``; elsewhere fp32 stays as TVM lays it out) or
    quantised blocks (``quantize_weights.py``) — rewriting ``lowered.mod`` and ``lowered.params``
    in place. Returns the manifest's ``weights`` entry."""
    from .pipeline import FUNCTIONS

    if weights == "fp32" and layout != "host":
        return {"format": "fp32", "tensors": {"fp32": len(lowered.params)}}
    if weights == "fp32":
        from .pack_weights import PackWeights, pack_params

        packer = PackWeights(list(FUNCTIONS), cores)
        lowered.mod = packer(lowered.mod)
        lowered.params = pack_params(lowered.params, packer.packed)
        return {"format": "fp32", "tensors": {"fp32": len(lowered.params)}}
    from .quant_formats import GROUP, open_source_blocks
    from .quantize_weights import QuantizeWeights, quantize_params

    quantizer = QuantizeWeights(list(FUNCTIONS), cores, weights, gpu=layout == "gpu")
    lowered.mod = quantizer(lowered.mod)
    lowered.params, origin = quantize_params(lowered.params, quantizer.plan, open_source_blocks(model))
    kinds: dict[str, int] = {}
    for q in quantizer.plan.values():
        kinds[q.fmt.ggml] = kinds.get(q.fmt.ggml, 0) + 1
    kinds["fp32"] = len([n for n, a in lowered.params if str(getattr(a, "dtype", "")) == "float32"])
    return {"format": weights, "group": GROUP, "scale_dtype": "float32" if layout == "gpu" else "float16",
            "layout": "rows" if layout == "gpu" else "panels", "tensors": kinds,
            # blocks taken from the source GGUF as they are, and tensors quantised here from fp32
            "blocks_from_source": origin["gguf"], "quantized_here": origin["quantized"],
            "bytes": int(sum(int(a.nbytes) for _, a in lowered.params))}


def build_manifest(model: Any, policy: Any, spec: Any, budget: int, block: int, profile: dict, target: Any,
                   tgt: dict, lowered: Any, plan: dict, host: dict | None = None, **extra: Any) -> dict[str, Any]:
    """manifest.json of an artifact: model, policy, shapes, functions, plan, versions (host and device builds)."""
    from .block_cache import cache_layout

    cfg = model.config
    state = entry_state_names(lowered)
    kv_dtype = getattr(spec, "kv_dtype", "fp32")
    fields = [(f, dt) for f, _, dt in cache_layout(1, 1, budget, policy.name, "float32", spec.policy_params, kv_dtype)]
    rows = "B + w" if getattr(spec, "extra_rows", 0) else "B"  # w pseudo / question rows last
    from .policy_kernels import compiled_state_init, prepare_min_prompt
    from .pseudo_rows import extra_rows as policy_pseudo_rows

    pseudo_window = policy_pseudo_rows(policy)
    manifest: dict[str, Any] = {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_VERSION,
        "model": {"id": model.model_id, "weight_hash": model.weight_hash, "config": cfg.to_dict(),
                  "chat": bool(getattr(model, "chat", False)),
                  **({"source": model.source_info} if hasattr(model, "source_info") else {})},
        "policy": {"name": policy.name, "params": policy.params(), "kernel_params": spec.policy_params},
        "budget": budget,
        "block": block,
        # pseudo rows after the B real rows of every prefill step (DapQ; compiler/pseudo_rows.py)
        "extra_rows": int(getattr(spec, "extra_rows", 0)),
        # what a runtime puts in them: the first `prefix` and the last rows − prefix prompt tokens,
        # at positions after the prompt ("final") or after the block ("block"); rows after those
        # are padding (position −1)
        "pseudo_rows": ({"rows": pseudo_window, "prefix": int(getattr(policy, "prefix", 0)),
                         "positions": str(getattr(policy, "positions", "final"))} if pseudo_window else None),
        # the longest question (tokens) that may fill the extra rows instead, at its true positions
        # after the document, to score the blocks with (`--question-rows`; 0: none)
        "question_rows": int(spec.question_rows),
        "dtype": "float32",
        # how the caches store K and V: fp32, or int8 codes with float16 scales (k_scale, v_scale)
        "kv_dtype": kv_dtype,
        "target": {"profile": profile.get("name", str(target)), "tvm": tgt, **({"host": host} if host else {})},
        "num_layers": len(lowered.sites),
        "attention_sites": [{"index": s.index, "form": s.form, "q_heads": s.num_q_heads, "kv_heads": s.num_kv_heads,
                             "head_dim": s.head_dim, "sm_scale": s.sm_scale} for s in lowered.sites],
        "cache": [{f: list(shape) for f, shape, _ in cache_layout(s.num_kv_heads, s.head_dim, budget, policy.name,
                                                                  "float32", spec.policy_params, kv_dtype)}
                  for s in lowered.sites],
        "cache_fields": [[f, dt] for f, dt in fields],
        # names of the policy's per-entry state: rows of the "state" [S, H, N] cache tensor
        "entry_state": state,
        "functions": {
            "prefill_block": {"inputs": [f"tokens[{rows}] int64", f"positions[{rows}] int64", "n_valid[1] int32",
                                         "caches (" + ", ".join(f for f, _ in fields) + ") × layers",
                                         "weights"],
                              "outputs": ["logits[V] of token n_valid-1", "caches"]},
            "decode": {"inputs": ["token[1] int64", "position[1] int64", "caches", "weights"],
                       "outputs": ["logits[V]", "caches"]},
        },
        "params": [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype)} for n, a in lowered.params],
        # cache fields that start a prompt with contents other than zeros (one layer's values)
        "cache_init": {k: np.asarray(v).tolist() for k, v in compiled_state_init(policy, budget).items()},
        # the compiled per-prompt function (compiler/prepare.py): run for prompts longer than this
        "prepare": ({"min_prompt": int(prepare_min_prompt(policy, budget))}
                    if "prepare" in [gv.name_hint for gv in lowered.mod.get_global_vars()] else None),
        "memory_plan": plan,
        "versions": versions(),
        "timings": lowered.timings,
    }
    manifest.update(extra)
    return manifest


def write_artifact(result: BuildResult, params: list[tuple[str, np.ndarray]], tgt: dict, tokenizer=None) -> None:
    """Write the artifact directory. Every file is written under a temporary name and renamed,
    the manifest last, so an interrupted compile never leaves a directory that looks complete."""
    from ..artifact.params_file import write_params
    from .program import write_program

    out = result.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the directory is not an artifact until it is complete
    # the library is linked here when its host code is for this machine (a CPU build, or a GPU
    # build with this machine as its host: opencl-host); else a .tar that `finish` links
    host = (result.manifest.get("target") or {}).get("host")
    host_code = tgt if tgt.get("kind") == "llvm" else (host or {"kind": None})
    lib_name = "model.so" if host_code.get("kind") == "llvm" and "mtriple" not in host_code else "model.tar"
    t0 = time.perf_counter()
    result.executable.export_library(str(out / lib_name))
    offsets = write_params(params, out / PARAMS_FILE, {"format": "edgekv-params"})
    result.manifest["timings"]["export_library_s"] = time.perf_counter() - t0
    files = result.manifest["files"] = {
        "library": {"name": lib_name, "sha256": sha256_file(out / lib_name)},
        "params": {"name": PARAMS_FILE, "sha256": sha256_file(out / PARAMS_FILE)},
    }
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tok_dir = out / TOKENIZER_DIR
        shutil.rmtree(tok_dir, ignore_errors=True)
        tokenizer.save_pretrained(str(tok_dir))
        files["tokenizer"] = {"name": TOKENIZER_DIR, "sha256": {p.name: sha256_file(p) for p in
                                                                 sorted(tok_dir.iterdir()) if p.is_file()}}
        from .tokenizer_file import write_tokenizer_file

        try:
            info = write_tokenizer_file(tokenizer, out / TOKENIZER_FILE)
        except ValueError as exc:  # a tokenizer the native runtime cannot reproduce: Python runs only
            result.manifest["native_tokenizer"] = f"not written: {exc}"
        else:
            files["tokenizer_file"] = {"name": TOKENIZER_FILE, "sha256": sha256_file(out / TOKENIZER_FILE),
                                       "format_version": info.get("format_version")}
    if result.final_module is not None:
        write_program(result, out, offsets, tgt)
        files["program"] = {"name": PROGRAM_FILE, "sha256": sha256_file(out / PROGRAM_FILE)}
    tmp = out / (MANIFEST + ".part")
    tmp.write_text(json.dumps(result.manifest, indent=2, default=str))
    tmp.replace(out / MANIFEST)
