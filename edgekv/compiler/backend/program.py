"""Export the compiled entry functions as the artifact's flat program (``program.ekv``).

After TVM's Relax pipeline (``cpu_schedule.cpu_pipeline`` ends with the VM lowering passes:
``StaticPlanBlockMemory``, ``VMBuiltinLower``, ``VMShapeLower``) each entry function is
straight-line code over a handful of VM builtins and calls of compiled kernels:

    storage = R.vm.alloc_storage(R.shape([bytes]), ...)          the static memory plan
    x = R.vm.alloc_tensor(storage, offset, R.shape(s), dtype)      a tensor placed in a storage
    y = R.call_packed("vm.builtin.reshape", x, R.shape(s2))         a view
    kernel(a, b, metadata["ir.GenericConst"][i], out)              a kernel call (destination passing)
    check_tensor_info / match_shape / null_value / kill_object     checks and bookkeeping: dropped

``capture_final_module`` wraps the Relax pipeline to keep that module; ``build_program`` walks
it into ``program_file.Program``: buffers (inputs, caches, weights at their offsets in the
params file, constants, arena tensors at their storage's arena offset, views), kernel calls
with their arguments, and each function's inputs and outputs. Anything else in the function
is refused with what was found, so a TVM change cannot silently produce a wrong program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...artifact import Keys, Manifest
from ...artifact import program_file as pf

SKIPPED_BUILTINS = ("vm.builtin.check_tensor_info", "vm.builtin.match_shape")
# a GPU program's arena regions start at multiples of this: a device places an arena tensor as a
# sub-buffer, whose offset must be a multiple of the device's CL_DEVICE_MEM_BASE_ADDR_ALIGN (given
# in bits): 512 bytes on NVIDIA (4096 bits), 256 on AMD, 128 on PoCL, Intel, Adreno and Mali. The
# largest of them, so that one artifact fits every one; the runtime still refuses a device that
# asks for more (docs/TARGETS.md, "Arena alignment").
DEVICE_ARENA_ALIGN = 512
# the kinds of edgekv GPU kernels flagged as eviction kernels in a GPU program (DKERNEL_EVICTION)
EVICTION_KINDS = ("score", "select", "observe", "prepare")


class ProgramExportError(RuntimeError):
    """The compiled module holds something the flat program cannot express."""


def capture_final_module(pipeline_factory: Callable[[Any], Any], sink: dict) -> Callable[[Any], Any]:
    """A Relax pipeline factory like ``pipeline_factory`` that also stores its output module in
    ``sink["mod"]`` (what TVM turns into VM bytecode)."""
    import tvm

    def factory(target):
        inner = pipeline_factory(target)

        @tvm.transform.module_pass(opt_level=0, name="edgekv.CaptureFinalModule")
        def _capture(mod, _ctx):
            out = inner(mod)
            sink["mod"] = out
            return out

        return _capture

    return factory


@dataclass
class FunctionLayout:
    """How a function's parameters map to program buffers: ``inputs`` named inputs first, then
    ``layers`` × ``fields`` cache tensors (layer-major), then the weights."""

    name: str
    inputs: int


def _shape_of(expr) -> tuple[int, ...]:
    return tuple(int(v) for v in expr.values)


def _dtype_str(dt) -> str:
    s = str(dt)
    return "bool" if s == "bool" else s


def _tensor_type(var) -> tuple[tuple[int, ...], str]:
    ty = var.ty
    return tuple(int(d) for d in ty.shape.values), str(ty.dtype)


class _Walker:
    def __init__(self, mod, prog: pf.Program, weight_offsets: dict[str, tuple[int, int]], weight_names: list[str],
                 num_layers: int, cache_fields: list[tuple[str, str]], region_align: int = pf.ALIGN):
        self.mod = mod
        self.region_align = region_align
        self.prog = prog
        self.weight_offsets = weight_offsets
        self.weight_names = weight_names
        self.num_layers = num_layers
        self.cache_fields = cache_fields
        self.cache_ids: dict[tuple[int, int], int] = {}
        self.weight_ids: dict[str, int] = {}
        self.const_ids: dict[int, int] = {}
        self.arena_bytes = 0

    def _add(self, buf: pf.Buffer) -> int:
        self.prog.buffers.append(buf)
        return len(self.prog.buffers) - 1

    def cache_buffer(self, layer: int, field: int, var) -> int:
        key = (layer, field)
        if key not in self.cache_ids:
            shape, dtype = _tensor_type(var)
            name = f"{self.cache_fields[field][0]}_cache_{layer}"
            self.cache_ids[key] = self._add(pf.Buffer(pf.CACHE, dtype, shape, name, layer, field))
        return self.cache_ids[key]

    def weight_buffer(self, name: str, var) -> int:
        if name not in self.weight_ids:
            shape, dtype = _tensor_type(var)
            off, size = self.weight_offsets[name]
            if size != pf.nbytes(shape, dtype):
                raise ProgramExportError(f"weight {name}: {size} bytes in the params file, the function takes "
                                         f"{shape} {dtype}")
            self.weight_ids[name] = self._add(pf.Buffer(pf.WEIGHT, dtype, shape, name, off, size))
        return self.weight_ids[name]

    def constant_buffer(self, const) -> int:
        arr = np.ascontiguousarray(const.value.numpy())
        key = hash((arr.dtype.str, arr.shape, arr.tobytes()))  # equal constants share one buffer
        if key not in self.const_ids:
            off = self.prog.add_constant(arr.tobytes())
            dtype = "bool" if arr.dtype == np.bool_ else str(arr.dtype)
            self.const_ids[key] = self._add(pf.Buffer(pf.CONSTANT, dtype, tuple(arr.shape), f"const{len(self.const_ids)}",
                                                      off, arr.nbytes))
        return self.const_ids[key]

    # ---- one function -----------------------------------------------------------------------
    def function(self, name: str, n_inputs: int) -> pf.Function:
        from tvm import relax

        func = self.mod[name]
        fn = pf.Function(name)
        env: dict = {}
        params = list(func.params)
        n_cache = self.num_layers * len(self.cache_fields)
        num_input = int(func.attrs["num_input"]) if func.attrs is not None and "num_input" in func.attrs else n_inputs
        if num_input != n_inputs + n_cache:
            raise ProgramExportError(f"{name}: {num_input} inputs, expected {n_inputs} + {n_cache} cache tensors")
        if len(params) != num_input + len(self.weight_names):
            raise ProgramExportError(f"{name}: {len(params) - num_input} weight parameters, the params file has "
                                     f"{len(self.weight_names)}")
        for i, p in enumerate(params[:n_inputs]):
            shape, dtype = _tensor_type(p)
            env[p] = self._add(pf.Buffer(pf.INPUT, dtype, shape, p.name))
            fn.inputs.append(env[p])
        for i, p in enumerate(params[n_inputs:num_input]):
            env[p] = self.cache_buffer(i // len(self.cache_fields), i % len(self.cache_fields), p)
        for p, wname in zip(params[num_input:], self.weight_names):
            env[p] = self.weight_buffer(wname, p)
        ret, top = self._body(name, func, env, fn, 0)
        self.arena_bytes = max(self.arena_bytes, top)
        fn.outputs = list(ret) if isinstance(ret, tuple) else [ret]
        return fn

    def _body(self, name, func, env, fn, top):
        """Walk a function's bindings into ``fn``'s calls; its storages go into the arena from
        ``top`` on. Returns (what it returns, the new top)."""
        storages: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                top = self._binding(name, binding, env, storages, fn, top)
        ret = env.get(func.body.body)
        if ret is None:
            raise ProgramExportError(f"{name}: its return value is not a tensor or tuple the program knows")
        return ret, top

    def _binding(self, fname, binding, env, storages, fn, top) -> int:
        import tvm
        from tvm import relax

        var, value = binding.var, binding.value
        where = f"{fname}: {var.name} = {type(value).__name__}"
        if isinstance(value, relax.Var):
            env[var] = env[value]
        elif isinstance(value, relax.Tuple):
            env[var] = tuple(env[f] for f in value.fields)
        elif isinstance(value, relax.TupleGetItem):
            env[var] = env[value.tuple_value][value.index]
        elif isinstance(value, relax.Call):
            op = value.op
            if isinstance(op, relax.ExternFunc):
                sym = str(op.global_symbol)
                if sym in SKIPPED_BUILTINS:
                    return top
                if sym == "vm.builtin.reshape":
                    base = env[value.args[0]]
                    shape = _shape_of(value.args[1])
                    dtype = self.prog.buffers[base].dtype
                    if pf.nbytes(shape, dtype) > self.prog.buffers[base].nbytes:
                        raise ProgramExportError(f"{where}: reshape to {shape} is larger than its base")
                    env[var] = self._add(pf.Buffer(pf.VIEW, dtype, shape, var.name, base))
                    return top
                raise ProgramExportError(f"{where}: the VM builtin {sym} has no place in a flat program")
            if isinstance(op, tvm.ir.Op):
                if op.name in ("relax.null_value", "relax.vm.kill_object"):
                    return top
                if op.name == "relax.vm.alloc_storage":
                    size = _shape_of(value.args[0])
                    if len(size) != 1 or str(value.args[2].value) != "uint8":
                        raise ProgramExportError(f"{where}: storage of {size} {value.args[2]} (expected bytes)")
                    at = pf.align(top, self.region_align)
                    storages[var] = (at, size[0])
                    return at + size[0]
                if op.name == "relax.vm.alloc_tensor":
                    base, size = storages[value.args[0]]
                    offset = int(value.args[1].value) if hasattr(value.args[1], "value") else int(value.args[1])
                    shape = _shape_of(value.args[2])
                    dtype = _dtype_str(value.args[3].value)
                    nb = pf.nbytes(shape, dtype)
                    if offset % pf.ALIGN or offset + nb > size:
                        raise ProgramExportError(f"{where}: tensor of {nb} bytes at offset {offset} of a {size}-byte "
                                                 "storage")
                    env[var] = self._add(pf.Buffer(pf.ARENA, dtype, shape, var.name, base + offset, nb))
                    return top
                raise ProgramExportError(f"{where}: operator {op.name} left in the compiled function")
            if isinstance(op, tvm.ir.GlobalVar):
                callee = self.mod[op]
                if isinstance(callee, relax.Function):  # another entry function (prepare's probe): inline it
                    inner = {p: env[a] for p, a in zip(callee.params, value.args)}
                    if len(inner) != len(callee.params) or any(isinstance(v, tuple) for v in inner.values()):
                        raise ProgramExportError(f"{where}: calls {op.name_hint} with arguments the program cannot bind")
                    env[var], top = self._body(f"{fname} → {op.name_hint}", callee, inner, fn, top)
                    return top
                if not isinstance(callee, tvm.tirx.PrimFunc):
                    raise ProgramExportError(f"{where}: calls {op.name_hint}, neither a kernel nor an entry function")
                args = [self._arg(where, a, env) for a in value.args]
                fn.calls.append(pf.Call(self.prog.kernel_index(op.name_hint), args))
                return top
            raise ProgramExportError(f"{where}: call of {type(op).__name__}")
        else:
            raise ProgramExportError(f"{where}: not a construct of a flat program")
        return top

    def _arg(self, where, a, env):
        import tvm
        from tvm import relax

        if isinstance(a, relax.Var):
            ref = env[a]
            if isinstance(ref, tuple):
                raise ProgramExportError(f"{where}: passes a tuple to a kernel")
            return (pf.ARG_BUFFER, ref)
        if isinstance(a, tvm.ir.GenericConst) and hasattr(a.value, "numpy"):
            return (pf.ARG_BUFFER, self.constant_buffer(a))
        if isinstance(a, relax.PrimValue):
            v = a.value
            if isinstance(v, tvm.tirx.IntImm):
                return (pf.ARG_INT, int(v.value))
            if isinstance(v, tvm.tirx.FloatImm):
                return (pf.ARG_FLOAT, float(v.value))
        raise ProgramExportError(f"{where}: kernel argument {type(a).__name__} ({a}) is not a tensor or a scalar")


def build_program(mod, *, functions: list[tuple[str, int]], params: list[tuple[str, Any]],
                  weight_offsets: dict[str, tuple[int, int]], num_layers: int, cache_fields: list[tuple[str, str]],
                  cache_init: dict[str, bytes] | None = None, settings: dict[str, Any],
                  region_align: int = pf.ALIGN) -> pf.Program:
    """Walk ``functions`` [(name, number of named inputs)] of the final Relax module into a program.
    ``params``: the weights in argument order; ``weight_offsets``: where ``params_file`` put them;
    ``cache_fields``: one layer's [(field, dtype)]; ``cache_init``: a field's initial bytes (one
    layer's tensor) when it does not start as zeros; ``region_align``: where arena regions start."""
    prog = pf.Program(settings=dict(settings))
    walker = _Walker(mod, prog, weight_offsets, [n for n, _ in params], num_layers, cache_fields, region_align)
    for name, n_inputs in functions:
        prog.functions.append(walker.function(name, n_inputs))
    for fname, _ in cache_fields:
        init = (cache_init or {}).get(fname)
        prog.cache_fields.append(pf.CacheField(fname, pf.FIELD_ROLES.get(fname, pf.ROLE_STATE),
                                               prog.add_constant(init) if init is not None else None))
    prog.settings["arena_bytes"] = pf.align(walker.arena_bytes, region_align)
    return prog


# ---- the artifact's program file -------------------------------------------------------------
# CPU features the native runtime can test (runtime/src/cpu_check.c); a library built with any
# of them refuses to load on a CPU without it
X86_FEATURES = ("sse4.1", "sse4.2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi", "bmi2", "avx512f", "avx512dq",
                "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512vbmi2", "avx512vnni",
                "avx512bitalg", "avx512vpopcntdq", "avx512bf16", "avx512fp16", "avxvnni", "gfni", "vaes", "vpclmulqdq",
                "amx-tile", "amx-int8", "amx-bf16")


def target_arch(tgt: dict) -> tuple[str, str]:
    """(architecture, triple) the library's code is for: the target's mtriple, else this machine."""
    from tvm.target import codegen

    triple = str(tgt.get("mtriple") or codegen.llvm_get_system_triple())
    arch = triple.split("-")[0]
    return {"arm64": "aarch64"}.get(arch, arch), triple


def required_cpu_features(tgt: dict) -> list[str]:
    """The CPU features LLVM may use for this target that the runtime checks before loading."""
    import tvm
    from tvm.target import codegen

    arch, _ = target_arch(tgt)
    if tgt.get("kind") != "llvm" or arch != "x86_64":
        return []
    enabled = set(codegen.llvm_get_cpu_features(tvm.target.Target(tgt)))
    return [f for f in X86_FEATURES if f in enabled]


def program_settings(m: Manifest, tgt: dict, policy: Any) -> dict[str, Any]:
    cfg = m.model_config
    arch, triple = target_arch(tgt)
    settings: dict[str, Any] = {
        "model_id": m.model_id,
        "weight_hash": m.weight_hash,
        "edgekv_version": m.versions[Keys.Versions.EDGEKV],
        "tvm_version": m.versions[Keys.Versions.TVM],
        "policy": m.policy_name,
        "policy_params": __import__("json").dumps(m.policy_params, sort_keys=True),
        "num_layers": int(m.num_layers),
        "vocab_size": int(cfg["vocab_size"]),
        "max_position": int(cfg["max_position"]),
        "budget": int(m.budget),
        "block": int(m.block),
        "chat": int(m.chat),
        # a policy that never evicts runs out of entries: the runtime refuses rather than overwrite
        "evicts": int(m.policy_name != "full"),
        "target_profile": str(m.target.profile),
        "target_arch": arch,
        "target_triple": triple,
        "cpu_features": ",".join(required_cpu_features(tgt)),
        "compiled_cores": int(tgt.get(Keys.TvmTarget.NUM_CORES, 1)),
        "plan_weights_bytes": int(m.memory_plan.weights_bytes),
        "plan_cache_bytes": int(m.memory_plan.cache_bytes),
    }
    # extra rows after the B real rows of every prefill step (passes/pseudo_rows.py): DapQ's first
    # `pseudo_window` of them hold the first `prefix` and the last window - prefix prompt tokens,
    # at positions after the prompt ("final") or after the block; a question (`question_rows`)
    # takes their place; the rest are padding at position -1
    w = int(m.extra_rows)
    settings["pseudo_rows"] = w
    settings["question_rows"] = int(m.question_rows)
    if w:
        settings["pseudo_window"] = m.pseudo_window
        settings["pseudo_prefix"] = int(getattr(policy, "prefix", 0))
        settings["pseudo_positions"] = str(getattr(policy, "positions", "final"))
    if settings.get("pseudo_positions") == "reconstruct":
        # `--compress reconstruct`: each block's rows are the repeat prompt (first before block 0,
        # later + the previous block's last `tail` tokens after), the suffix, then the block, at the
        # positions after the block (runtime/src/reconstruct.c); ids as comma-separated decimals
        kp = m.raw[Keys.POLICY][Keys.Policy.KERNEL_PARAMS]
        for part in ("first", "later", "suffix"):
            settings[f"reconstruct_{part}"] = ",".join(str(int(i)) for i in kp[part])
        settings["reconstruct_tail"] = int(kp["tail"])
    return settings


def cache_init(m: Manifest) -> dict[str, bytes]:
    """Cache fields that do not start as zeros: one layer's initial bytes (the manifest's
    ``cache_init``, from the policy's ``compiled_state_init``: D2O's per-layer budget)."""
    dtypes = dict(m.cache_fields)
    return {name: np.asarray(values, dtype=dtypes[name]).tobytes() for name, values in m.cache_init.items()}


def _device_kernels_called(source: str, recorded: dict) -> list:
    """The recorded launch descriptions of every kernel in the device source, refusing a build
    with a kernel TVM did not hand to the recorder (the runtime could not launch it)."""
    import re

    # OpenCL C names its kernels `__kernel void name(`, PTX `.entry name(` (cuda-host)
    names = sorted(set(re.findall(r"__kernel\s+void\s+(\w+)\s*\(", source) + re.findall(r"\.entry\s+(\w+)\s*\(", source)))
    missing = [n for n in names if n not in recorded]
    if not names or missing:
        raise ProgramExportError(f"device kernels without a launch description: {', '.join(missing) or 'all'}")
    return [recorded[n] for n in names]


def write_program(result, out, weight_offsets: dict[str, tuple[int, int]], tgt: dict) -> None:
    """Write ``program.ekv`` for a build (``artifact_writer.write_artifact``), after the library, the params
    and the tokenizer file, whose sizes and CRC-32s it records."""
    from ...artifact import PROGRAM_FILE, crc32_file

    manifest = result.manifest  # the build's own dict, written here; read through the typed reader
    m = Manifest.from_json(manifest)
    settings = program_settings(m, tgt, result.policy)
    F = Keys.Files
    for key, entry in m.files.items():
        if key in (F.LIBRARY, F.PARAMS, F.TOKENIZER_FILE):  # the settings the native runtime checks them by
            path = out / entry.name
            settings[f"{key}_name"] = entry.name
            settings[f"{key}_bytes"] = path.stat().st_size
            settings[f"{key}_crc32"] = crc32_file(path)
    fields = list(m.cache_fields)
    functions = [("prefill_block", 3), ("decode", 2)]
    if m.prepare_min_prompt is not None:
        functions.append(("prepare", 4))
        settings["prepare_min_prompt"] = int(m.prepare_min_prompt)
    device = getattr(result, "device_kernels", None)  # a GPU build: {"kind", "source", "kernels", "arch"}
    if device is not None:
        source = out / device["source"]
        settings.update({"device": device["kind"], "device_source_name": device["source"],
                         "device_source_bytes": source.stat().st_size, "device_source_crc32": crc32_file(source),
                         "arena_align": DEVICE_ARENA_ALIGN})
        if device.get("arch"):  # cuda-host: the PTX's GPU generation (the runtime checks the GPU's)
            settings["device_arch"] = device["arch"]
    prog = build_program(result.final_module, functions=functions, params=result.params,
                         weight_offsets=weight_offsets, num_layers=int(m.num_layers), cache_fields=fields,
                         cache_init=cache_init(m), settings=settings,
                         region_align=DEVICE_ARENA_ALIGN if device is not None else pf.ALIGN)
    if device is not None:
        import re

        called = _device_kernels_called((out / device["source"]).read_text(), device["kernels"])
        kinds = device.get("kinds") or {}  # PrimFunc → the kind of edgekv kernel it is (ReplaceKernels)
        prog.device_kernels = [pf.DeviceKernel(k.name, k.args, k.tags, pf.DKERNEL_EVICTION if kinds.get(
            re.sub(r"_kernel(_\d+)?$", "", k.name)) in EVICTION_KINDS else 0) for k in called]
    manifest[Keys.MEMORY_PLAN][Keys.MemoryPlan.ARENA_BYTES] = prog.settings["arena_bytes"]
    size = pf.write(prog, out / PROGRAM_FILE)
    P = Keys.Program
    manifest[Keys.PROGRAM] = {P.FUNCTIONS: {f.name: len(f.calls) for f in prog.functions}, P.KERNELS: len(prog.kernels),
                              P.BUFFERS: len(prog.buffers), P.BYTES: size, P.ARENA_BYTES: prog.settings["arena_bytes"]}
