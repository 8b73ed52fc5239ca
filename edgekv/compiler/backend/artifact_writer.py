"""The artifact writer: the build's result → manifest → artifact directory.

An artifact is a directory (``edgekv/artifact``: the contract with the runtimes):

    model.so | model.tar      the compiled library (``export_library``); .tar for cross targets
    params.safetensors        the weights in the functions' argument order, 64-byte aligned
    program.ekv               the entry functions as flat kernel-call lists (``program.py``)
    tokenizer.ekt, tokenizer/ the tokenizer (binary for the native runtime; HF files for Python)
    manifest.json             what was built and how to check it (see ``build_manifest``)
    device/                   a device build's generated code (``compiler/driver.py``)
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...artifact import (ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, PARAMS_FILE, PROGRAM_FILE, TOKENIZER_DIR,
                         TOKENIZER_FILE, Keys, edgekv_version, sha256_file)
from ..passes.pseudo_rows import extra_rows as policy_pseudo_rows
from ..passes.rewrite_block_cache import cache_layout, layer_cache_kinds
from ..policy_kernels import compiled_state_init, prepare_min_prompt


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
    # a device build's generated code: {file name: bytes} (the GPU source, or the object files)
    device_code: dict | None = None


def versions() -> dict[str, str]:
    import tvm

    return {Keys.Versions.EDGEKV: edgekv_version(), Keys.Versions.TVM: str(tvm.__version__)}


def entry_state_names(lowered) -> list[str]:
    """The policy's per-entry state names the lowered module carries (``edgekv.entry_state``)."""
    func = lowered.mod["prefill_block"]
    names = func.attrs.get("edgekv.entry_state") if func.attrs is not None else None
    return [str(n) for n in names] if names else []


def build_manifest(model: Any, policy: Any, spec: Any, budget: int, block: int, profile: dict, target: Any,
                   tgt: dict, lowered: Any, plan: dict, host: dict | None = None, *, weights: dict | None = None,
                   device: dict | None = None) -> dict[str, Any]:
    """manifest.json of an artifact: model, policy, shapes, functions, plan, versions (host and
    device builds); ``weights``: how they are stored (``Keys.WEIGHTS``), ``device``: a device
    build's section (``Keys.DEVICE``)."""
    cfg = model.config
    state = entry_state_names(lowered)
    kv_dtype = getattr(spec, "kv_dtype", "fp32")
    fields = [(f, dt) for f, _, dt in cache_layout(1, 1, budget, policy.name, "float32", spec.policy_params, kv_dtype)]
    rows = "B + w" if getattr(spec, "extra_rows", 0) else "B"  # w pseudo / question rows last
    pseudo_window = policy_pseudo_rows(policy)
    K = Keys
    manifest: dict[str, Any] = {
        K.FORMAT: ARTIFACT_FORMAT,
        K.FORMAT_VERSION: ARTIFACT_VERSION,
        K.MODEL: {K.Model.ID: model.model_id, K.Model.WEIGHT_HASH: model.weight_hash, K.Model.CONFIG: cfg.to_dict(),
                  K.Model.CHAT: bool(getattr(model, "chat", False)),
                  **({K.Model.SOURCE: model.source_info} if hasattr(model, "source_info") else {})},
        K.POLICY: {K.Policy.NAME: policy.name, K.Policy.PARAMS: policy.params(),
                   K.Policy.KERNEL_PARAMS: spec.policy_params},
        K.BUDGET: budget,
        K.BLOCK: block,
        # pseudo rows after the B real rows of every prefill step (DapQ; compiler/passes/pseudo_rows.py)
        K.EXTRA_ROWS: int(getattr(spec, "extra_rows", 0)),
        # what a runtime puts in them: the first `prefix` and the last rows − prefix prompt tokens,
        # at positions after the prompt ("final") or after the block ("block"); rows after those
        # are padding (position −1)
        K.PSEUDO_ROWS: ({K.PseudoRows.ROWS: pseudo_window, K.PseudoRows.PREFIX: int(getattr(policy, "prefix", 0)),
                         K.PseudoRows.POSITIONS: str(getattr(policy, "positions", "final"))}
                        if pseudo_window else None),
        # the longest question (tokens) that may fill the extra rows instead, at its true positions
        # after the document, to score the blocks with (`--question-rows`; 0: none)
        K.QUESTION_ROWS: int(spec.question_rows),
        K.DTYPE: "float32",
        # how the caches store K and V: fp32, or int8 codes with float16 scales (k_scale, v_scale)
        K.KV_DTYPE: kv_dtype,
        K.TARGET: {K.Target.PROFILE: profile.get("name", str(target)), K.Target.TVM: tgt,
                   **({K.Target.HOST: host} if host else {})},
        K.NUM_LAYERS: len(lowered.sites),
        K.ATTENTION_SITES: [{K.AttentionSite.INDEX: s.index, K.AttentionSite.FORM: s.form,
                             K.AttentionSite.Q_HEADS: s.num_q_heads, K.AttentionSite.KV_HEADS: s.num_kv_heads,
                             K.AttentionSite.HEAD_DIM: s.head_dim, K.AttentionSite.SM_SCALE: s.sm_scale}
                            for s in lowered.sites],
        K.CACHE: [{f: list(shape) for f, shape, _ in cache_layout(s.num_kv_heads, s.head_dim,
                                                                  spec.site_budget(s.index), policy.name,
                                                                  "float32", spec.policy_params, kv_dtype)}
                  for s in lowered.sites],
        # each layer's cache: a global layer keeps the policy's N, a local (sliding-window) layer its window
        K.CACHE_KINDS: [{K.CacheKind.KIND: c["kind"], K.CacheKind.ENTRIES: c["entries"]}
                        for c in layer_cache_kinds(spec, len(lowered.sites))],
        K.CACHE_FIELDS: [[f, dt] for f, dt in fields],
        # names of the policy's per-entry state: rows of the "state" [S, H, N] cache tensor
        K.ENTRY_STATE: state,
        K.FUNCTIONS: {
            K.Functions.PREFILL_BLOCK: {
                K.Function.INPUTS: [f"tokens[{rows}] int64", f"positions[{rows}] int64", "n_valid[1] int32",
                                    "caches (" + ", ".join(f for f, _ in fields) + ") × layers", "weights"],
                K.Function.OUTPUTS: ["logits[V] of token n_valid-1", "caches"]},
            K.Functions.DECODE: {K.Function.INPUTS: ["token[1] int64", "position[1] int64", "caches", "weights"],
                                 K.Function.OUTPUTS: ["logits[V]", "caches"]},
        },
        K.PARAMS: [{K.Param.NAME: n, K.Param.SHAPE: list(a.shape), K.Param.DTYPE: str(a.dtype)}
                   for n, a in lowered.params],
        # cache fields that start a prompt with contents other than zeros (one layer's values)
        K.CACHE_INIT: {k: np.asarray(v).tolist() for k, v in compiled_state_init(policy, budget).items()},
        # the compiled per-prompt function (compiler/passes/add_prepare_function.py): run for prompts longer than this
        K.PREPARE: ({K.Prepare.MIN_PROMPT: int(prepare_min_prompt(policy, budget))}
                    if "prepare" in [gv.name_hint for gv in lowered.mod.get_global_vars()] else None),
        K.MEMORY_PLAN: plan,
        K.VERSIONS: versions(),
        K.TIMINGS: lowered.timings,
    }
    if device is not None:
        manifest[K.DEVICE] = device
    if weights is not None:
        manifest[K.WEIGHTS] = weights
    return manifest


def check_native_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer the native runtime cannot reproduce (UnsupportedTokenizer, a ValueError,
    naming the part and the supported kinds). Cheap: the pipeline's description only."""
    import json

    from .tokenizer_file import UnsupportedTokenizer, tokenizer_kind

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizer(f"{type(tokenizer).__name__} is not backed by HF tokenizers; the native runtime "
                                   "reads only tokenizers' pipelines (tokenizer.ekt cannot be written)")
    try:
        tokenizer_kind(json.loads(backend.to_str()))
    except UnsupportedTokenizer as exc:
        raise UnsupportedTokenizer(f"tokenizer.ekt cannot be written for this model: {exc}") from None


def write_artifact(result: BuildResult, params: list[tuple[str, np.ndarray]], tgt: dict, tokenizer=None) -> None:
    """Write the artifact directory. Every file is written under a temporary name and renamed,
    the manifest last, so an interrupted compile never leaves a directory that looks complete."""
    from ...artifact.params_file import write_params
    from .program import write_program

    out = result.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the directory is not an artifact until it is complete
    # the library is linked here when its host code is for this machine (a CPU build, or a GPU
    # build with this machine as its host: opencl-host); else a .tar that `finish` links
    K, F, E, T = Keys, Keys.Files, Keys.FileEntry, Keys.TvmTarget
    host = (result.manifest.get(K.TARGET) or {}).get(K.Target.HOST)
    host_code = tgt if tgt.get(T.KIND) == "llvm" else (host or {T.KIND: None})
    lib_name = "model.so" if host_code.get(T.KIND) == "llvm" and T.MTRIPLE not in host_code else "model.tar"
    t0 = time.perf_counter()
    result.executable.export_library(str(out / lib_name))
    offsets = write_params(params, out / PARAMS_FILE, {"format": "edgekv-params"})
    result.manifest[K.TIMINGS]["export_library_s"] = time.perf_counter() - t0
    files = result.manifest[K.FILES] = {
        F.LIBRARY: {E.NAME: lib_name, E.SHA256: sha256_file(out / lib_name)},
        F.PARAMS: {E.NAME: PARAMS_FILE, E.SHA256: sha256_file(out / PARAMS_FILE)},
    }
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tok_dir = out / TOKENIZER_DIR
        shutil.rmtree(tok_dir, ignore_errors=True)
        tokenizer.save_pretrained(str(tok_dir))
        files[F.TOKENIZER] = {E.NAME: TOKENIZER_DIR, E.SHA256: {p.name: sha256_file(p) for p in
                                                              sorted(tok_dir.iterdir()) if p.is_file()}}
        from .tokenizer_file import write_tokenizer_file

        # the writer picks the tokenizer's kind (gpt2 / qwen2 / unigram); any other is named in the
        # manifest (and was said as a warning before the export): edgekv-run then takes --prompt-ids
        try:
            info = write_tokenizer_file(tokenizer, out / TOKENIZER_FILE)
        except ValueError as exc:
            result.manifest[K.NATIVE_TOKENIZER] = f"not written: {exc}"
        else:
            files[F.TOKENIZER_FILE] = {E.NAME: TOKENIZER_FILE, E.SHA256: sha256_file(out / TOKENIZER_FILE),
                                       E.FORMAT_VERSION: info.get("format_version")}
            result.manifest[K.NATIVE_TOKENIZER] = f"tokenizer.ekt: {info.get('kind', 'gpt2')}"
    if result.final_module is not None:
        write_program(result, out, offsets, tgt)
        files[F.PROGRAM] = {E.NAME: PROGRAM_FILE, E.SHA256: sha256_file(out / PROGRAM_FILE)}
    tmp = out / (MANIFEST + ".part")
    tmp.write_text(json.dumps(result.manifest, indent=2, default=str))
    tmp.replace(out / MANIFEST)
