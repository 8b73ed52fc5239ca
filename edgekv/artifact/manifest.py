"""manifest.json: every key the compiler writes and a runtime reads, defined once.

As gguf-py's ``constants.py`` names GGUF's keys, ``Keys`` names the manifest's: one class per
JSON object (``Keys`` the top level, ``Keys.Model`` the ``model`` object, ...), one string
constant per key. ``SCHEMA`` gives each key its JSON type and its meaning; ``Manifest.from_json``
checks a manifest against it and hands back typed fields, so a damaged manifest (``block: [128]``,
``budget: "abc"``) is refused with the field's name and the command that remakes it instead of a
traceback deep in a runtime. The Android app's readers use the same names from
``android/src/com/edgekv/demo/ManifestKeys.java``, generated from this module
(``python -m edgekv.artifact.manifest_java``); the native runtime reads no manifest, only
``program.ekv``.

Keys the writer adds that no reader depends on are defined too (their meaning is the
documentation); objects whose keys are someone else's vocabulary — the model's config, a
policy's parameters, a TVM target, the timings — are checked as objects and left open.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArtifactError

MANIFEST = "manifest.json"
ARTIFACT_FORMAT = "edgekv-artifact"  # the value of ``format``
ARTIFACT_VERSION = 2  # the value of ``format_version``; 2: aligned params, program.ekv, tokenizer.ekt


class Keys:
    """The top level of manifest.json; each nested class is one of its objects."""

    FORMAT = "format"
    FORMAT_VERSION = "format_version"
    MODEL = "model"
    POLICY = "policy"
    BUDGET = "budget"
    BLOCK = "block"
    EXTRA_ROWS = "extra_rows"
    PSEUDO_ROWS = "pseudo_rows"
    QUESTION_ROWS = "question_rows"
    DTYPE = "dtype"
    KV_DTYPE = "kv_dtype"
    TARGET = "target"
    NUM_LAYERS = "num_layers"
    ATTENTION_SITES = "attention_sites"
    CACHE = "cache"
    CACHE_KINDS = "cache_kinds"
    CACHE_FIELDS = "cache_fields"
    ENTRY_STATE = "entry_state"
    FUNCTIONS = "functions"
    PARAMS = "params"
    CACHE_INIT = "cache_init"
    PREPARE = "prepare"
    MEMORY_PLAN = "memory_plan"
    VERSIONS = "versions"
    TIMINGS = "timings"
    WEIGHTS = "weights"
    DEVICE = "device"
    FILES = "files"
    PROGRAM = "program"
    NATIVE_TOKENIZER = "native_tokenizer"
    WORK = "work"

    class Model:
        ID = "id"
        WEIGHT_HASH = "weight_hash"
        CONFIG = "config"
        CHAT = "chat"
        SOURCE = "source"

    class Policy:
        NAME = "name"
        PARAMS = "params"
        KERNEL_PARAMS = "kernel_params"

    class PseudoRows:
        ROWS = "rows"
        PREFIX = "prefix"
        POSITIONS = "positions"

    class Target:
        PROFILE = "profile"
        TVM = "tvm"
        HOST = "host"

    class TvmTarget:  # TVM's own target keys, the ones edgekv reads
        KIND = "kind"
        MTRIPLE = "mtriple"
        NUM_CORES = "num-cores"

    class CacheKind:  # one layer's entry of ``cache_kinds``
        KIND = "kind"
        ENTRIES = "entries"

    class AttentionSite:
        INDEX = "index"
        FORM = "form"
        Q_HEADS = "q_heads"
        KV_HEADS = "kv_heads"
        HEAD_DIM = "head_dim"
        SM_SCALE = "sm_scale"

    class Functions:  # the entry functions, in ``functions``, ``work`` and ``program.functions``
        PREFILL_BLOCK = "prefill_block"
        DECODE = "decode"

    class Function:
        INPUTS = "inputs"
        OUTPUTS = "outputs"

    class Param:
        NAME = "name"
        SHAPE = "shape"
        DTYPE = "dtype"

    class Prepare:
        MIN_PROMPT = "min_prompt"

    class MemoryPlan:
        WEIGHTS_BYTES = "weights_bytes"
        CACHE_BYTES = "cache_bytes"
        ACTIVATION_BYTES = "activation_bytes"
        TOTAL_BYTES = "total_bytes"
        ARENA_BYTES = "arena_bytes"

    class Versions:
        EDGEKV = "edgekv"
        TVM = "tvm"

    class Weights:
        FORMAT = "format"
        GROUP = "group"
        SCALE_DTYPE = "scale_dtype"
        LAYOUT = "layout"
        TENSORS = "tensors"
        BLOCKS_FROM_SOURCE = "blocks_from_source"
        QUANTIZED_HERE = "quantized_here"
        BYTES = "bytes"
        DECODE_ACTIVATIONS = "decode_activations"

    class Device:
        KIND = "kind"
        FLOAT64_DEMOTED = "float64_demoted"
        EDGEKV_KERNELS = "edgekv_kernels"
        DEVICE_FUNCTIONS = "device_functions"
        SYMBOLIC_SHAPES = "symbolic_shapes"
        GPU_FUSION = "gpu_fusion"
        CODE = "code"
        ELF_MACHINE = "elf_machine"
        TOOLCHAIN = "toolchain"
        NATIVE_RUNTIME = "native_runtime"
        FILES = "files"
        PTX = "ptx"  # cuda-host: how the kernels' PTX was made (Keys.Ptx)

    class Toolchain:  # the target profile's ``toolchain`` (compile/*.json) plus what the build adds
        STATUS = "status"
        TOOL = "tool"
        ENV = "env"
        FINISH = "finish"
        NEEDED_FOR = "needed_for"
        LINK_FLAGS = "link_flags"
        CHECK_HERE = "check_here"
        LINKED_WITH = "linked_with"

    class NativeRuntime:
        DEVICE = "device"
        KERNELS = "kernels"

    class Ptx:
        ARCH = "arch"
        NVRTC = "nvrtc"

    class Files:
        LIBRARY = "library"
        LIBRARY_OBJECTS = "library_objects"
        PARAMS = "params"
        PROGRAM = "program"
        TOKENIZER = "tokenizer"
        TOKENIZER_FILE = "tokenizer_file"

    class FileEntry:
        NAME = "name"
        SHA256 = "sha256"
        FORMAT_VERSION = "format_version"

    class Program:
        FUNCTIONS = "functions"
        KERNELS = "kernels"
        BUFFERS = "buffers"
        BYTES = "bytes"
        ARENA_BYTES = "arena_bytes"

    class Work(Functions):  # one count per entry function
        METHOD = "method"

    class WorkCount:
        FLOPS = "flops"
        BYTES = "bytes"
        KERNELS = "kernels"
        UNESTIMATED = "unestimated"


class ToolchainStatus:
    """Values of ``device.toolchain.status``."""

    COMPLETE = "complete"  # loads on the device as written
    NEEDS_TOOLCHAIN = "needs-toolchain"  # model.tar: link it with ``finish`` and the named tool
    FINISHED = "finished"  # linked by ``finish``


# ---- types and meanings ------------------------------------------------------------------------

INT, NUMBER, STR, BOOL, OBJECT, LIST, ANY = "int", "number", "str", "bool", "object", "list", "any"
_KIND_WORDS = {INT: "an integer", NUMBER: "a number", STR: "a string", BOOL: "true or false", OBJECT: "an object",
               LIST: "a list", ANY: "any value"}


@dataclass(frozen=True)
class Field:
    """One key of one object: its JSON type(s), its meaning, and the object class (``Keys.X``)
    naming the keys of its value (an object) or of its items (a list of objects), or of each
    value (``each``: an object of objects, such as ``files``)."""

    key: str
    kind: str | tuple[str, ...]
    meaning: str
    required: bool = False
    nullable: bool = False
    keys: type | None = None
    each: bool = False


K = Keys
SCHEMA: dict[type, tuple[Field, ...]] = {
    K: (
        Field(K.FORMAT, STR, f'always "{ARTIFACT_FORMAT}"', required=True),
        Field(K.FORMAT_VERSION, INT, f"the artifact format; this edgekv reads {ARTIFACT_VERSION}", required=True),
        Field(K.MODEL, OBJECT, "the model compiled in", required=True, keys=K.Model),
        Field(K.POLICY, OBJECT, "the eviction policy compiled in", required=True, keys=K.Policy),
        Field(K.BUDGET, INT, "N: KV entries kept per layer and KV head", required=True),
        Field(K.BLOCK, INT, "B: prompt tokens per prefill step", required=True),
        Field(K.EXTRA_ROWS, INT, "w: pseudo or question rows after the B real rows of each prefill step (0: none)"),
        Field(K.PSEUDO_ROWS, OBJECT, "what a runtime puts in the extra rows (DapQ's pseudo queries); null: none",
              nullable=True, keys=K.PseudoRows),
        Field(K.QUESTION_ROWS, INT, "the longest question (tokens) that may fill the extra rows instead (0: none)"),
        Field(K.DTYPE, STR, "the compute dtype (float32)"),
        Field(K.KV_DTYPE, STR, "how the caches store K and V: fp32, or int8 codes with float16 scales"),
        Field(K.TARGET, OBJECT, "what the artifact was compiled for", keys=K.Target),
        Field(K.NUM_LAYERS, INT, "attention sites rewritten (layers)"),
        Field(K.ATTENTION_SITES, LIST, "each rewritten attention site's geometry", keys=K.AttentionSite),
        Field(K.CACHE, LIST, "per layer: cache field → shape"),
        Field(K.CACHE_KINDS, LIST, "per layer: its cache's kind (global: the policy's N entries; local: a "
              "sliding-window layer's newest `window` entries, no policy) and its entries", keys=K.CacheKind),
        Field(K.CACHE_FIELDS, LIST, "the cache tensors of one layer, in argument order, as [name, dtype] pairs"),
        Field(K.ENTRY_STATE, LIST, "names of the policy's per-entry state: rows of the state [S, H, N] tensor"),
        Field(K.FUNCTIONS, OBJECT, "the entry functions' inputs and outputs, for people", keys=K.Functions),
        Field(K.PARAMS, LIST, "the weights in argument order", keys=K.Param),
        Field(K.CACHE_INIT, OBJECT, "cache fields that start a prompt with contents other than zeros (one layer)"),
        Field(K.PREPARE, OBJECT, "the compiled per-prompt function (compiler/passes/add_prepare_function.py); null: none",
              nullable=True, keys=K.Prepare),
        Field(K.MEMORY_PLAN, OBJECT, "the static memory plan in bytes", keys=K.MemoryPlan),
        Field(K.VERSIONS, OBJECT, "the versions that built the artifact", keys=K.Versions),
        Field(K.TIMINGS, OBJECT, "seconds per compile stage, for people"),
        Field(K.WEIGHTS, OBJECT, "how the weights are stored", keys=K.Weights),
        Field(K.DEVICE, OBJECT, "device builds: where functions run, generated code, the toolchain step",
              keys=K.Device),
        Field(K.FILES, OBJECT, "the artifact's files with their sha256", keys=K.Files),
        Field(K.PROGRAM, OBJECT, "the flat program (program.ekv) the native runtime runs", keys=K.Program),
        Field(K.NATIVE_TOKENIZER, STR, "the kind of tokenizer.ekt written (gpt2, qwen2 or unigram), or 'not written: ' and why"),
        Field(K.WORK, OBJECT, "FLOPs and bytes per entry-function call, counted from the graph (edgekv simulate)",
              keys=K.Work),
    ),
    K.Model: (
        Field(K.Model.ID, STR, "the model's name", required=True),
        Field(K.Model.WEIGHT_HASH, STR, "sha256 of the source weights"),
        Field(K.Model.CONFIG, OBJECT, "the model geometry (models.config.ModelConfig)", required=True),
        Field(K.Model.CHAT, BOOL, "prompts go through the chat template"),
        Field(K.Model.SOURCE, OBJECT, "where the weights came from (an ONNX or GGUF file)"),
    ),
    K.Policy: (
        Field(K.Policy.NAME, STR, "the policy's registry name", required=True),
        Field(K.Policy.PARAMS, OBJECT, "the policy's parameters, as `--policy-arg` takes them"),
        Field(K.Policy.KERNEL_PARAMS, OBJECT, "the parameters its kernels were built with"),
    ),
    K.PseudoRows: (
        Field(K.PseudoRows.ROWS, INT, "rows filled with prompt tokens"),
        Field(K.PseudoRows.PREFIX, INT, "the first rows take the prompt's first tokens, the rest its last ones"),
        Field(K.PseudoRows.POSITIONS, STR, "positions after the prompt (final) or after the block (block)"),
    ),
    K.Target: (
        Field(K.Target.PROFILE, STR, "the target profile's name (compile/<name>.json)"),
        Field(K.Target.TVM, OBJECT, "the TVM target the kernels were built for", keys=K.TvmTarget),
        Field(K.Target.HOST, OBJECT, "the TVM target of the host code of a device build", keys=K.TvmTarget),
    ),
    K.TvmTarget: (
        Field(K.TvmTarget.KIND, STR, "llvm, cuda, opencl, metal, ..."),
        Field(K.TvmTarget.MTRIPLE, STR, "the cross-compile triple; absent: this machine"),
        Field(K.TvmTarget.NUM_CORES, INT, "worker threads the kernels were built for"),
    ),
    K.CacheKind: (
        Field(K.CacheKind.KIND, STR, "global or local", required=True),
        Field(K.CacheKind.ENTRIES, INT, "KV entries the layer's cache keeps per KV head (N, or the window)",
              required=True),
    ),
    K.AttentionSite: (
        Field(K.AttentionSite.INDEX, INT, "the layer"),
        Field(K.AttentionSite.FORM, STR, "the attention pattern that was matched"),
        Field(K.AttentionSite.Q_HEADS, INT, "query heads"),
        Field(K.AttentionSite.KV_HEADS, INT, "KV heads"),
        Field(K.AttentionSite.HEAD_DIM, INT, "head dimension"),
        Field(K.AttentionSite.SM_SCALE, NUMBER, "the softmax scale"),
    ),
    K.Functions: (
        Field(K.Functions.PREFILL_BLOCK, OBJECT, "one prefill step of B (+ w) tokens", keys=K.Function),
        Field(K.Functions.DECODE, OBJECT, "one decode step", keys=K.Function),
    ),
    K.Function: (
        Field(K.Function.INPUTS, LIST, "the arguments, described"),
        Field(K.Function.OUTPUTS, LIST, "the results, described"),
    ),
    K.Param: (
        Field(K.Param.NAME, STR, "the weight's name in params.safetensors", required=True),
        Field(K.Param.SHAPE, LIST, "its shape as stored"),
        Field(K.Param.DTYPE, STR, "its dtype as stored"),
    ),
    K.Prepare: (
        Field(K.Prepare.MIN_PROMPT, INT, "run it for prompts longer than this (tokens)", required=True),
    ),
    K.MemoryPlan: (
        Field(K.MemoryPlan.WEIGHTS_BYTES, INT, "weights as mapped (each array 64-byte aligned)", required=True),
        Field(K.MemoryPlan.CACHE_BYTES, INT, "all layers' caches", required=True),
        Field(K.MemoryPlan.ACTIVATION_BYTES, INT, "peak live intermediates of prefill_block", required=True),
        Field(K.MemoryPlan.TOTAL_BYTES, INT, "weights + cache + activations", required=True),
        Field(K.MemoryPlan.ARENA_BYTES, INT, "the native program's activation arena"),
    ),
    K.Versions: (
        Field(K.Versions.EDGEKV, STR, "the edgekv that compiled it: a runtime of another version refuses it"),
        Field(K.Versions.TVM, STR, "the TVM that compiled it: HostRuntime refuses another"),
    ),
    K.Weights: (
        Field(K.Weights.FORMAT, STR, "fp32, q8 or q4"),
        Field(K.Weights.GROUP, INT, "weights per quantisation block"),
        Field(K.Weights.SCALE_DTYPE, STR, "the dtype of the block scales"),
        Field(K.Weights.LAYOUT, STR, "panels (CPU kernels) or rows (GPU kernels)"),
        Field(K.Weights.TENSORS, OBJECT, "tensors per storage kind (Q4_1, Q8_0, fp32, ...)"),
        Field(K.Weights.BLOCKS_FROM_SOURCE, INT, "tensors whose blocks come from the source GGUF as they are"),
        Field(K.Weights.QUANTIZED_HERE, INT, "tensors quantised here from fp32"),
        Field(K.Weights.BYTES, INT, "the stored weights' bytes"),
        Field(K.Weights.DECODE_ACTIVATIONS, STR, "the decode GEMVs' activations: fp32, or int8 (x quantised per 32, "
              "integer dot products; --decode-activations), with the kernels' path: int8/avx2, int8/generic"),
    ),
    K.Device: (
        Field(K.Device.KIND, STR, "the device kind (the TVM target kind)"),
        Field(K.Device.FLOAT64_DEMOTED, BOOL, "float64 arithmetic was demoted to float32 for the device"),
        Field(K.Device.EDGEKV_KERNELS, OBJECT, "PrimFunc → the kind of edgekv kernel that replaced it"),
        Field(K.Device.DEVICE_FUNCTIONS, (LIST, STR), "the functions compiled for the device"),
        Field(K.Device.SYMBOLIC_SHAPES, OBJECT, "PrimFunc → its symbolic shape variables"),
        Field(K.Device.GPU_FUSION, OBJECT, "GPU builds: what passes/gpu_fusion.py rewrote (rewrite → count)"),
        Field(K.Device.CODE, OBJECT, "generated code file → bytes"),
        Field(K.Device.ELF_MACHINE, LIST, "the ELF machines of the generated objects"),
        Field(K.Device.TOOLCHAIN, OBJECT, "the toolchain step that makes it loadable", keys=K.Toolchain),
        Field(K.Device.NATIVE_RUNTIME, OBJECT, "the device kernels the native runtime runs", keys=K.NativeRuntime),
        Field(K.Device.FILES, LIST, "the generated code files, under device/"),
        Field(K.Device.PTX, OBJECT, "cuda-host: the PTX's arch (compute_<digits>) and the NVRTC that wrote it",
              keys=K.Ptx),
    ),
    K.Toolchain: (
        Field(K.Toolchain.STATUS, STR, "complete, needs-toolchain or finished (ToolchainStatus)"),
        Field(K.Toolchain.TOOL, STR, "the tool that links it"),
        Field(K.Toolchain.ENV, STR, "the variable naming that tool's command"),
        Field(K.Toolchain.FINISH, STR, "the command that finishes the artifact"),
        Field(K.Toolchain.NEEDED_FOR, STR, "what the step is for"),
        Field(K.Toolchain.LINK_FLAGS, LIST, "extra link flags"),
        Field(K.Toolchain.CHECK_HERE, STR, "a tool that checks the device code on this machine"),
        Field(K.Toolchain.LINKED_WITH, STR, "the command that linked it (finished)"),
    ),
    K.NativeRuntime: (
        Field(K.NativeRuntime.DEVICE, STR, "the native runtime's device (opencl, cuda)"),
        Field(K.NativeRuntime.KERNELS, INT, "device kernels in the program"),
    ),
    K.Ptx: (
        Field(K.Ptx.ARCH, STR, "the GPU generation the PTX targets (sm_80: compute_80, JITted forward)"),
        Field(K.Ptx.NVRTC, STR, "the NVRTC version that wrote it (the driver must be at least as new)"),
    ),
    K.Files: (
        Field(K.Files.LIBRARY, OBJECT, "model.so (or model.tar until finished)", keys=K.FileEntry),
        Field(K.Files.LIBRARY_OBJECTS, OBJECT, "model.tar kept after finish links it", keys=K.FileEntry),
        Field(K.Files.PARAMS, OBJECT, "params.safetensors", keys=K.FileEntry),
        Field(K.Files.PROGRAM, OBJECT, "program.ekv (native runtime builds)", keys=K.FileEntry),
        Field(K.Files.TOKENIZER, OBJECT, "the HF tokenizer directory", keys=K.FileEntry),
        Field(K.Files.TOKENIZER_FILE, OBJECT, "tokenizer.ekt (native runtime)", keys=K.FileEntry),
    ),
    K.FileEntry: (
        Field(K.FileEntry.NAME, STR, "the path inside the artifact directory", required=True),
        Field(K.FileEntry.SHA256, (STR, OBJECT), "its sha256; a directory: file name → sha256"),
        Field(K.FileEntry.FORMAT_VERSION, ANY, "the file's own format version"),
    ),
    K.Program: (
        Field(K.Program.FUNCTIONS, OBJECT, "function → kernel calls"),
        Field(K.Program.KERNELS, INT, "kernels"),
        Field(K.Program.BUFFERS, INT, "planned buffers"),
        Field(K.Program.BYTES, INT, "program.ekv's size"),
        Field(K.Program.ARENA_BYTES, INT, "the activation arena"),
    ),
    K.Work: (
        Field(K.Work.PREFILL_BLOCK, OBJECT, "one prefill step", keys=K.WorkCount),
        Field(K.Work.DECODE, OBJECT, "one decode step", keys=K.WorkCount),
        Field(K.Work.METHOD, STR, "how it was counted"),
    ),
    K.WorkCount: (
        Field(K.WorkCount.FLOPS, NUMBER, "floating-point operations per call", required=True),
        Field(K.WorkCount.BYTES, NUMBER, "bytes moved per call (unfused upper bound)", required=True),
        Field(K.WorkCount.KERNELS, INT, "kernels called"),
        Field(K.WorkCount.UNESTIMATED, LIST, "kernels TVM could not count"),
    ),
}
del K


def key_classes() -> list[type]:
    """``Keys`` and its nested classes, each once."""
    return [Keys] + [v for v in vars(Keys).values() if isinstance(v, type)]


def constants(cls: type) -> dict[str, str]:
    """A key class's constants, inherited ones included: NAME → key."""
    return {n: getattr(cls, n) for n in dir(cls) if n.isupper() and isinstance(getattr(cls, n), str)}


def undefined_keys(data: dict, cls: type = Keys, where: str = "") -> list[str]:
    """Keys in ``data`` that ``SCHEMA`` does not define (dotted paths), inside objects whose keys
    edgekv owns: for a test that holds the writer to this module."""
    fields = {f.key: f for f in SCHEMA[cls]}
    out = []
    for key, value in data.items():
        path = f"{where}{key}"
        f = fields.get(key)
        if f is None:
            out.append(path)
        elif f.keys is not None and f.keys is not Keys.TvmTarget:  # TVM's keys are TVM's
            for item in (value if isinstance(value, list) else [value]):
                if isinstance(item, dict):
                    out += undefined_keys(item, f.keys, path + ".")
    return out


# ---- the typed reader --------------------------------------------------------------------------

def _is(value: Any, kind: str) -> bool:
    # numbers.*: the writer's own dict (BuildResult.manifest) may hold numpy scalars
    if kind == INT:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == OBJECT:
        return isinstance(value, dict)
    if kind == LIST:
        return isinstance(value, list)
    return True


def _recompile(source: str) -> str:
    where = Path(source).parent if source.endswith(MANIFEST) else "DIR"
    return f"recompile the artifact (edgekv compile ... -o {where})"


def _check(obj: dict, cls: type, where: str, source: str) -> None:
    for f in SCHEMA[cls]:
        path = f"{where}{f.key}"
        if f.key not in obj:
            if f.required:
                raise ArtifactError(f"{source} has no '{path}' ({f.meaning}); {_recompile(source)}")
            continue
        value = obj[f.key]
        kinds = f.kind if isinstance(f.kind, tuple) else (f.kind,)
        if value is None and f.nullable:
            continue
        if not any(_is(value, k) for k in kinds):
            got = "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"
            raise ArtifactError(f"{source}: '{path}' is {got}, expected {' or '.join(_KIND_WORDS[k] for k in kinds)} "
                                f"({f.meaning}); the manifest is damaged or was not written by edgekv: "
                                f"{_recompile(source)}")
        if f.keys is None:
            continue
        if isinstance(value, dict):
            _check(value, f.keys, path + ".", source)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise ArtifactError(f"{source}: '{path}[{i}]' is {type(item).__name__}, expected an object "
                                        f"({f.meaning}); {_recompile(source)}")
                _check(item, f.keys, f"{path}[{i}].", source)


def _cache_fields(value: list | None, source: str) -> list[tuple[str, str]] | None:
    if value is None:
        return None
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value):
        raise ArtifactError(f"{source}: '{Keys.CACHE_FIELDS}' is not a list of [name, dtype] pairs; the manifest is "
                            f"damaged or was not written by edgekv: {_recompile(source)}")
    return [(name, dtype) for name, dtype in value]


@dataclass(frozen=True)
class BuildTarget:
    profile: str | None
    tvm: dict
    host: dict | None

    @property
    def kind(self) -> str | None:
        return self.tvm.get(Keys.TvmTarget.KIND)

    @property
    def mtriple(self) -> str | None:
        return self.tvm.get(Keys.TvmTarget.MTRIPLE)


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    cache_bytes: int
    activation_bytes: int
    total_bytes: int
    arena_bytes: int | None = None


@dataclass(frozen=True)
class FileEntry:
    name: str
    sha256: str | dict | None


@dataclass(frozen=True)
class Manifest:
    """A checked manifest.json. ``raw`` is the JSON object itself (what the writer wrote and the
    readers not yet typed take); the fields are the values readers use, with the defaults old
    artifacts imply for keys added since."""

    raw: dict = field(repr=False)
    format_version: int
    model_id: str
    model_config: dict
    weight_hash: str | None
    chat: bool
    policy_name: str
    policy_params: dict
    budget: int
    block: int
    extra_rows: int
    question_rows: int
    pseudo_rows: dict | None
    dtype: str
    kv_dtype: str
    target: BuildTarget
    num_layers: int | None
    memory_plan: MemoryPlan | None
    files: dict[str, FileEntry]
    versions: dict[str, str]
    device: dict
    weights: dict | None
    work: dict | None
    prepare_min_prompt: int | None
    cache_fields: list[tuple[str, str]] | None  # None: an artifact from before policies carried state
    cache_init: dict[str, list]

    @property
    def toolchain(self) -> dict:
        return self.device.get(Keys.Device.TOOLCHAIN) or {}

    @property
    def cache_kinds(self) -> list[tuple[str, int]]:
        """Every layer's (kind, entries): ``cache_kinds``, or every layer global with N (older artifacts)."""
        kinds = self.raw.get(Keys.CACHE_KINDS)
        if kinds is None:
            return [("global", int(self.budget))] * int(self.num_layers or 0)
        return [(str(k[Keys.CacheKind.KIND]), int(k[Keys.CacheKind.ENTRIES])) for k in kinds]

    @property
    def pseudo_window(self) -> int:
        """Extra rows that hold pseudo queries (``pseudo_rows.rows``; 0: none)."""
        return int((self.pseudo_rows or {}).get(Keys.PseudoRows.ROWS, 0))

    @classmethod
    def from_json(cls, data: Any, source: str = MANIFEST) -> "Manifest":
        """Check ``data`` (the parsed manifest.json) against ``SCHEMA``: an ``ArtifactError``
        naming the first field that is missing or of the wrong type, and saying to recompile.
        The format version is ``read``'s check, not this one."""
        if not isinstance(data, dict):
            raise ArtifactError(f"{source} is not an edgekv artifact manifest (a {type(data).__name__}, "
                                "not an object)")
        _check(data, Keys, "", source)
        K = Keys
        model, policy = data[K.MODEL], data[K.POLICY]
        target = data.get(K.TARGET) or {}
        plan = data.get(K.MEMORY_PLAN)
        prepare = data.get(K.PREPARE)
        return cls(
            raw=data,
            format_version=data[K.FORMAT_VERSION],
            model_id=model[K.Model.ID], model_config=model[K.Model.CONFIG],
            weight_hash=model.get(K.Model.WEIGHT_HASH), chat=bool(model.get(K.Model.CHAT)),
            policy_name=policy[K.Policy.NAME], policy_params=dict(policy.get(K.Policy.PARAMS) or {}),
            budget=data[K.BUDGET], block=data[K.BLOCK],
            extra_rows=data.get(K.EXTRA_ROWS, 0), question_rows=data.get(K.QUESTION_ROWS, 0),
            pseudo_rows=data.get(K.PSEUDO_ROWS),
            dtype=data.get(K.DTYPE, "float32"), kv_dtype=data.get(K.KV_DTYPE, "fp32"),
            target=BuildTarget(target.get(K.Target.PROFILE), target.get(K.Target.TVM) or {}, target.get(K.Target.HOST)),
            num_layers=data.get(K.NUM_LAYERS),
            memory_plan=None if plan is None else MemoryPlan(
                plan[K.MemoryPlan.WEIGHTS_BYTES], plan[K.MemoryPlan.CACHE_BYTES],
                plan[K.MemoryPlan.ACTIVATION_BYTES], plan[K.MemoryPlan.TOTAL_BYTES],
                plan.get(K.MemoryPlan.ARENA_BYTES)),
            files={k: FileEntry(e[K.FileEntry.NAME], e.get(K.FileEntry.SHA256))
                   for k, e in (data.get(K.FILES) or {}).items() if isinstance(e, dict)},
            versions=dict(data.get(K.VERSIONS) or {}),
            device=data.get(K.DEVICE) or {},
            weights=data.get(K.WEIGHTS), work=data.get(K.WORK),
            prepare_min_prompt=None if prepare is None else prepare[K.Prepare.MIN_PROMPT],
            cache_fields=_cache_fields(data.get(K.CACHE_FIELDS), source),
            cache_init=dict(data.get(K.CACHE_INIT) or {}),
        )

    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        """``path/manifest.json``, refused (``ArtifactError``) when the directory or the file is
        missing, the JSON is corrupt, it is not an edgekv manifest, its format version is not
        this edgekv's, or a field is missing or of the wrong type."""
        path = Path(path)
        mf = path / MANIFEST
        if not path.is_dir():
            raise ArtifactError(f"{path} is not an artifact directory (run `edgekv compile ... -o {path}` first)")
        if not mf.exists():
            raise ArtifactError(f"{path} has no {MANIFEST}; it is not an edgekv artifact or it is incomplete")
        try:
            data = json.loads(mf.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{mf} is corrupt ({exc})") from None
        if not isinstance(data, dict) or data.get(Keys.FORMAT) != ARTIFACT_FORMAT:
            fmt = data.get(Keys.FORMAT) if isinstance(data, dict) else None
            raise ArtifactError(f"{mf} is not an edgekv artifact manifest (format={fmt!r})")
        version = data.get(Keys.FORMAT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool):
            got = "missing" if version is None else f"{type(version).__name__} {json.dumps(version)[:40]}"
            raise ArtifactError(f"{mf}: '{Keys.FORMAT_VERSION}' is {got}, expected an integer (the artifact format); "
                                f"the manifest is damaged or was not written by edgekv: {_recompile(str(mf))}")
        if version != ARTIFACT_VERSION:
            raise ArtifactError(f"artifact format version {data.get(Keys.FORMAT_VERSION)} is not supported by this "
                                f"edgekv (expects {ARTIFACT_VERSION}); recompile it")
        return cls.from_json(data, str(mf))
