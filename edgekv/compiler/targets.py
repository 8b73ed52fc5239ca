"""Builds for device targets: CUDA, OpenCL (Adreno/Mali), Metal, Hexagon, Android CPU, aarch64 Linux.

``build_for_target(model, policy, budget, block, target="cuda", out_dir=...)`` writes the same
artifact directory as ``build.compile_model`` (``model.tar``, ``params.safetensors``,
``manifest.json``) plus the generated device code beside it (``device/``: the CUDA / OpenCL /
Metal source, or the object files for LLVM cross targets), and a ``device`` section in the
manifest: which function runs where, the kernel sizes, and — where a toolchain that is not
here is needed to finish the build (Android NDK, Xcode, Hexagon SDK) — what to run with it
(``python -m edgekv.compiler.targets finish <dir>``). Nothing here needs the device.

GPU targets: ``gpu_schedule.ReplaceKernels`` puts the thread-bound edgekv kernels in place,
``gpu_schedule.gpu_pipeline`` runs dlight for the rest and refuses any function left on the host.
LLVM cross targets (Android CPU, aarch64 Linux, Hexagon) use the host CPU pipeline
(``cpu_schedule``) and, like the host build, write ``program.ekv`` for the native runtime; after
``finish`` links the library, an aarch64 artifact runs in ``runtime/``'s ``edgekv-run`` built for
aarch64 (docs/NATIVE.md).

Profiles: ``compile/<name>.json`` with ``target`` (TVM target dict), optional ``host``
(target dict for the VM's host code), ``demote_float64``, ``device_source`` and ``toolchain``
(``env``: the variable holding the compiler command ``finish`` links with; ``link_flags``: added
after the objects, e.g. ``-lm``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ..memory import check_kv_dtype
from .build import (MANIFEST, BuildResult, CompileError, build_manifest, memory_plan, policy_kernel_params,
                    resolve_target, sha256_file, write_artifact)


class ToolchainNeededWarning(UserWarning):
    """The artifact is written, but a toolchain that is not here must link it for the device."""


DEVICE_TARGETS = ("cuda", "opencl", "opencl-host", "metal", "hexagon", "android-cpu", "aarch64-linux")
NATIVE_DEVICES = ("opencl",)  # GPU kinds the native runtime runs (runtime/src/device_opencl.c)
DEVICE_DIR = "device"
NO_FP64_KINDS = ("metal", "opencl", "vulkan", "webgpu")  # default of a profile's demote_float64
_SOURCE_SUFFIX = {"cuda": "cu", "opencl": "cl", "metal": "metal"}


def is_device_profile(profile: dict) -> bool:
    """A profile that builds for another machine (needs this module rather than the host path)."""
    tgt = profile.get("target", {})
    return tgt.get("kind") != "llvm" or "mtriple" in tgt or "host" in profile


def device_target(target: str | dict) -> tuple[dict, dict, dict | None]:
    """(profile, target dict, host target dict or None) for a profile name, path or dict."""
    if isinstance(target, dict) and "target" in target:
        profile = dict(target)
    else:
        profile, _ = resolve_target(target)
    tgt = dict(profile["target"])
    host = dict(profile["host"]) if profile.get("host") else None
    return profile, tgt, host


def _tvm_target(tgt: dict, host: dict | None):
    import tvm

    return tvm.target.Target(tgt, host=host) if host else tvm.target.Target(tgt)


def check_policy_builds_for(policy: Any, tgt: dict, kv_dtype: str = "fp32", question_rows: int = 0) -> None:
    """Refuse, before any work, a GPU build of a policy that has no GPU kernels (RocketKV's stage 2),
    of an int8 KV cache or of question rows (their kernels are CPU loops)."""
    from .gpu_schedule import is_gpu_target
    from .policy_kernels import gpu_policy_names
    from .pseudo_rows import check_question_rows

    check_question_rows(policy, question_rows)
    if is_gpu_target(tgt) and question_rows:
        raise CompileError(f"--question-rows has no GPU kernels yet, so it cannot be compiled for {tgt.get('kind')}; "
                           "compile it for a CPU target (host, aarch64-linux, android-cpu), or drop --question-rows")

    if is_gpu_target(tgt) and kv_dtype != "fp32":
        raise CompileError(f"--kv-dtype {kv_dtype} has no GPU kernels yet, so it cannot be compiled for "
                           f"{tgt.get('kind')}; compile the int8 cache for a CPU target (host, aarch64-linux, "
                           "android-cpu), or compile for the GPU with --kv-dtype fp32")
    if is_gpu_target(tgt) and policy.name not in gpu_policy_names():
        raise CompileError(f"policy '{policy.name}' has no GPU kernels yet, so it cannot be compiled for "
                           f"{tgt.get('kind')}; compile it for a CPU target (host, aarch64-linux, android-cpu), "
                           f"or pick a policy with GPU kernels: {', '.join(gpu_policy_names())}")


def lower_for_target(model: Any, policy: Any, budget: int, block: int, imported=None, cores: int = 1,
                     kv_dtype: str = "fp32", question_rows: int = 0):
    """Export + edgekv passes (the target-independent part); returns (Lowered, spec). ``cores``: the
    CPU target's threads (the attention kernel's row tiles); GPU targets replace that kernel.
    ``kv_dtype``: how the caches store K and V (``memory.KV_DTYPES``). ``question_rows``: room for a
    question of that many tokens scoring the blocks (``pseudo_rows.py``)."""
    from .block_cache import BlockCacheSpec
    from .pipeline import Lowered, check_imported_rows, import_model, lower_module, param_layout
    from .pseudo_rows import check_question_rows, extra_rows

    check_question_rows(policy, int(question_rows))

    if budget <= 0 or block <= 0:
        raise CompileError("budget and block must be positive token counts")
    policy.check_budget(budget, block)
    policy.check_model(model.config)  # e.g. RocketKV's channels ≤ the head dim
    spec = BlockCacheSpec(budget=budget, policy=policy.name, policy_params=policy_kernel_params(policy, budget),
                          extra_rows=max(extra_rows(policy), int(question_rows)), question_rows=int(question_rows),
                          cores=int(cores), kv_dtype=check_kv_dtype(kv_dtype))
    mod, params, timings = imported if imported is not None else import_model(model, block, spec.extra_rows)
    check_imported_rows(mod, block, spec.extra_rows)
    timings = dict(timings)
    t0 = time.perf_counter()
    mod, sites, transposed = lower_module(mod, spec)
    timings["passes_s"] = time.perf_counter() - t0
    return Lowered(mod=mod, params=param_layout(params, transposed), sites=sites, timings=timings), spec


def compile_lowered(lowered, spec, profile: dict, tgt: dict, host: dict | None,
                    sink: dict | None = None) -> tuple[Any, dict]:
    """``tvm.compile`` the lowered module for the profile; returns (executable, device info).

    CPU targets (LLVM cross builds: android-cpu, aarch64-linux, hexagon) and OpenCL: the Relax
    module after TVM's pipeline — what ``program.write_program`` turns into ``program.ekv`` for
    the native runtime — is stored in ``sink["mod"]`` when ``sink`` is given; for OpenCL also each
    device kernel's launch description in ``sink["device_kernels"]`` (``device_kernels.py``).
    Other GPU targets (CUDA, Metal) leave it empty: the native runtime has no device for them."""
    import tvm

    from .gpu_schedule import CheckAllOnDevice, ReplaceKernels, demote_float64, gpu_pipeline, is_gpu_target

    mod = lowered.mod
    target = _tvm_target(tgt, host)
    info: dict[str, Any] = {"kind": tgt["kind"]}
    if profile.get("demote_float64", tgt.get("kind") in NO_FP64_KINDS):
        mod = demote_float64(mod)
        info["float64_demoted"] = True
    if is_gpu_target(tgt):
        scales = {(s.num_q_heads, s.num_kv_heads, s.head_dim): s.sm_scale for s in lowered.sites}
        rk = ReplaceKernels(spec.policy, spec.policy_params, scales)
        mod = rk(mod)
        check = CheckAllOnDevice()
        if sink is not None and tgt["kind"] in NATIVE_DEVICES:
            from .device_kernels import record_device_kernels
            from .program import capture_final_module

            pipeline = capture_final_module(lambda t: gpu_pipeline(t, check), sink)(target)
            with record_device_kernels(tgt["kind"]) as kernels:
                ex = tvm.compile(mod, target=target, relax_pipeline=pipeline)
            sink["device_kernels"] = kernels
        else:
            ex = tvm.compile(mod, target=target, relax_pipeline=gpu_pipeline(target, check))
        info["edgekv_kernels"] = rk.replaced
        info["device_functions"] = check.device_functions
        info["symbolic_shapes"] = check.symbolic
    else:
        from .cpu_schedule import cpu_pipeline
        from .program import capture_final_module

        pipeline = capture_final_module(cpu_pipeline, sink)(target) if sink is not None else cpu_pipeline(target)
        ex = tvm.compile(mod, target=target, relax_pipeline=pipeline)
    return ex, info


def device_code(ex, tgt: dict) -> dict[str, bytes]:
    """The generated device code of an executable: ``{file name: bytes}`` — the GPU source for
    GPU targets, the object files (what ``export_library`` puts in the .tar) for LLVM ones."""
    host = ex.mod.imports[0] if ex.mod.imports else ex.mod
    out: dict[str, bytes] = {}
    for i, m in enumerate(host.imports):
        if m.kind in _SOURCE_SUFFIX:
            out[f"kernels{'' if i == 0 else i}.{_SOURCE_SUFFIX[m.kind]}"] = m.inspect_source().encode()
    if tgt.get("kind") == "llvm":
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "lib.tar"
            ex.export_library(str(path))
            with tarfile.open(path) as tf:
                for member in tf.getmembers():
                    if member.isfile() and member.name.endswith(".o"):
                        out[member.name] = tf.extractfile(member).read()
    return out


def host_functions_on_host(ex) -> list[str]:
    """Kernels the host code runs itself (CPU loops in a GPU build): parallel lambdas and host
    functions with float arithmetic. Empty for a correct GPU build."""
    host = ex.mod.imports[0] if ex.mod.imports else ex.mod
    ll = host.inspect_source("ll")
    bad = []
    if "__tvm_parallel_lambda" in ll:
        bad.append("__tvm_parallel_lambda")
    for m in re.finditer(r"define [^@]*@([\w.]+_compute_)\(.*?\n}\n", ll, re.S):
        body = m.group(0)
        if re.search(r"\b(fadd|fmul|fdiv|fcmp)\b", body):
            bad.append(m.group(1))
    return bad


def elf_machine(obj: bytes) -> int | None:
    if obj[:4] != b"\x7fELF":
        return None
    little = obj[5] == 1
    return int.from_bytes(obj[18:20], "little" if little else "big")


def build_for_target(model: Any, policy: Any, budget: int, block: int = 128, target: str | dict = "cuda",
                     out_dir: str | Path | None = None, *, imported=None, progress=None,
                     mem_limit: int | None = None, weights: str | None = None, kv_dtype: str = "fp32",
                     question_rows: int = 0) -> BuildResult:
    """Compile for a device target and (with ``out_dir``) write the complete artifact.

    The manifest's ``device`` section says where each function runs, the generated code sizes
    and ``toolchain.status``: ``complete`` when the artifact loads as is on the device side
    (CUDA: TVM compiles the embedded CUDA C at load), ``needs-toolchain`` when a tool that is
    not part of this build must link it (named in ``toolchain.tool`` / ``toolchain.finish``)."""
    say = progress or (lambda msg: None)
    profile, tgt, host = device_target(target)
    check_policy_builds_for(policy, tgt, kv_dtype, question_rows)
    say("exporting and lowering")
    lowered, spec = lower_for_target(model, policy, budget, block, imported, kv_dtype=kv_dtype,
                                     question_rows=question_rows)
    from .build import lay_out_weights, resolve_weights, weight_layout

    layout = weight_layout(profile, tgt)
    weights = resolve_weights(model, weights, layout)
    weight_info = lay_out_weights(lowered, model, weights, int(tgt.get("num-cores", 1)), layout)
    plan = memory_plan(lowered, budget, policy.name, spec.policy_params, spec.kv_dtype)
    if mem_limit is not None and plan["total_bytes"] > mem_limit:
        raise CompileError(f"the static memory plan needs {plan['total_bytes']} bytes, above the limit {mem_limit}; "
                           "lower --budget or --block")
    from .gpu_schedule import is_gpu_target

    if not is_gpu_target(tgt) or tgt["kind"] in NATIVE_DEVICES:
        # builds the native runtime runs carry the policy's per-prompt function like the host build
        # (D2O's probe → layer budgets) and their program calls it; other GPU builds have no runtime for it
        from .prepare import add_prepare_function

        lowered.mod = add_prepare_function(lowered.mod, policy, budget)
    say(f"compiling with TVM for {profile.get('name', tgt['kind'])}")
    t0 = time.perf_counter()
    final: dict = {}
    ex, info = compile_lowered(lowered, spec, profile, tgt, host, sink=final)
    lowered.timings["tvm_compile_s"] = time.perf_counter() - t0
    code = device_code(ex, tgt)
    info["code"] = {name: len(data) for name, data in code.items()}
    if tgt.get("kind") == "llvm":
        info["elf_machine"] = sorted({elf_machine(d) for d in code.values()} - {None})
        info["device_functions"] = "all (the whole module is compiled for the device CPU/DSP)"
    else:
        stray = host_functions_on_host(ex)
        if stray:
            raise CompileError(f"functions compiled for the host in a {tgt['kind']} build: {', '.join(stray)}")
    tool = dict(profile.get("toolchain", {}))
    needs = "env" in tool
    tool["status"] = "needs-toolchain" if needs else "complete"
    info["toolchain"] = tool
    manifest = build_manifest(model, policy, spec, budget, block, profile, target, tgt, lowered, plan,
                              host=host, device=info, weights=weight_info)
    # a CPU or OpenCL build carries the flat program (program.ekv) the native runtime runs
    result = BuildResult(out_dir=Path(out_dir) if out_dir else None, manifest=manifest, executable=ex,
                         params=lowered.params, final_module=final.get("mod"), policy=policy)
    if "device_kernels" in final:
        source = next(n for n in code if n.endswith("." + _SOURCE_SUFFIX[tgt["kind"]]))
        result.device_kernels = {"kind": tgt["kind"], "source": f"{DEVICE_DIR}/{source}",
                                 "kernels": final["device_kernels"], "kinds": info.get("edgekv_kernels", {})}
        manifest["device"]["native_runtime"] = {"device": tgt["kind"], "kernels": len(final["device_kernels"])}
    result.device_code = code
    if out_dir is not None:
        out = Path(out_dir)
        (out / DEVICE_DIR).mkdir(parents=True, exist_ok=True)
        for name, data in code.items():
            (out / DEVICE_DIR / name).write_bytes(data)
        manifest["device"]["files"] = sorted(f"{DEVICE_DIR}/{n}" for n in code)
        write_artifact(result, lowered.params, tgt, getattr(model, "tokenizer", None))
        msg = toolchain_message(manifest, out)
        say(msg)
        if needs:  # the CLI's progress line is transient: say it where it stays
            warnings.warn(msg, ToolchainNeededWarning, stacklevel=2)
    return result


def toolchain_message(manifest: dict, out_dir: Path | str) -> str:
    dev = manifest["device"]
    tool = dev.get("toolchain", {})
    name = manifest["target"]["profile"]
    if tool.get("status") == "needs-toolchain":
        return (f"{name}: wrote {out_dir} (model.tar, params, manifest, device code). NOT YET LOADABLE ON THE DEVICE: "
                f"{tool.get('needed_for')} needs {tool.get('tool')}; finish with: "
                f"{str(tool.get('finish')).replace('<artifact dir>', str(out_dir))}")
    return f"{name}: wrote {out_dir}; {tool.get('needed_for', 'complete')}"


# Linked into an Android model.so by ``finish``. The TVM-generated objects import a function from
# their loader, TVMFFIErrorSetRaisedFromCStrParts (a kernel's error message). edgekv-run exports
# it from the executable and Python loads the runtime RTLD_GLOBAL, but an app loads
# libedgekv_runtime.so through System.loadLibrary, i.e. without RTLD_GLOBAL, and neither bionic's
# linker nor glibc's resolves a later dlopen()ed library's symbols from such a library: model.so
# would fail to load ("cannot locate symbol"). Making model.so DT_NEEDED libedgekv_runtime.so
# would instead tie it to one file name and, under edgekv-run (which links the runtime
# statically), load a second copy with its own error state. So the symbol is defined inside
# model.so (hidden: the kernels bind to it at link time, nothing is imported) and forwards through
# an exported function-pointer slot, which the runtime fills after dlopen like TVM's other slots
# (runtime/src/kernel_abi.c). An unfilled slot (an older runtime) loses the message, not the
# error: the kernel still returns -1. The other function such objects may import,
# TVMFFIEnvModRegisterSystemLibSymbol (unoptimised builds call it from a constructor), is a no-op
# in the runtime and is defined as one here.
ERROR_SHIM_SLOT = "__TVMFFIErrorSetRaisedFromCStrParts"
ERROR_SHIM_SOURCE = """\
/* edgekv: written by `python -m edgekv.compiler.targets finish` (see ERROR_SHIM_SOURCE there) */
#ifdef __cplusplus
extern "C" {
#endif
typedef void (*edgekv_error_parts_fn)(const char *kind, const char **parts, int num_parts);
__attribute__((visibility("default"))) edgekv_error_parts_fn %(slot)s = 0;
__attribute__((visibility("hidden"))) void TVMFFIErrorSetRaisedFromCStrParts(const char *kind, const char **parts,
                                                                              int num_parts) {
  edgekv_error_parts_fn fn = %(slot)s;
  if (fn != 0) fn(kind, parts, num_parts);
}
/* objects built unoptimised register their kernels from a constructor (a "system lib"), at dlopen,
 * before any slot can be filled; the runtime finds kernels with dlsym, and its own is a no-op too */
__attribute__((visibility("hidden"))) int TVMFFIEnvModRegisterSystemLibSymbol(const char *name, void *symbol) {
  (void)name;
  (void)symbol;
  return 0;
}
#ifdef __cplusplus
}
#endif
""" % {"slot": ERROR_SHIM_SLOT}


def needs_error_shim(manifest: dict) -> bool:
    """Android builds (android-cpu, opencl): their model.so is dlopen()ed by an app's runtime."""
    target = manifest.get("target", {})
    triples = [str((target.get(k) or {}).get("mtriple", "")) for k in ("tvm", "host")]
    return any("android" in t for t in triples) or target.get("profile") in ("android-cpu", "opencl")


def finish(out_dir: str | Path) -> Path:
    """Link ``model.tar`` into ``model.so`` with the toolchain named by the profile's ``env``
    variable (the NDK / cross gcc / Xcode / Hexagon SDK compiler command), and record it: the
    manifest's file entries and hashes, and — where the artifact has a native program — the
    library's name, size and CRC-32 in ``program.ekv``'s settings, which the native runtime checks
    at load. The tar stays (``files.library_objects``), so finishing again relinks it."""
    from ..artifact import crc32_file
    from ..artifact import program_file as pf

    out = Path(out_dir)
    manifest = json.loads((out / MANIFEST).read_text())
    tool = manifest.get("device", {}).get("toolchain", {})
    env = tool.get("env")
    if not env:
        raise CompileError(f"{out}: this artifact needs no toolchain step ({tool.get('needed_for', 'complete')})")
    cc = os.environ.get(env)
    if not cc:
        raise CompileError(f"set {env} to the compiler command ({tool.get('tool')}); e.g. {tool.get('finish')}")
    files = manifest["files"]
    tar = out / (files.get("library_objects") or files["library"])["name"]
    if tar.suffix != ".tar" or not tar.is_file():
        raise CompileError(f"{out}: no model.tar of object files to link ({tar.name} is the library); recompile")
    so = out / "model.so"
    part = out / "model.so.part"
    with tempfile.TemporaryDirectory() as d:
        objs = []
        with tarfile.open(tar) as tf:  # the object files only, each under its base name
            for m in tf.getmembers():
                if m.isfile() and m.name.endswith(".o"):
                    path = Path(d) / Path(m.name).name
                    path.write_bytes(tf.extractfile(m).read())
                    objs.append(str(path))
        objs.sort()
        if not objs:
            raise CompileError(f"{tar} holds no object files; recompile the artifact")
        shim = []
        if needs_error_shim(manifest):  # compiled as C whatever the driver (the NDK's is clang++)
            (Path(d) / "edgekv_error_shim.c").write_text(ERROR_SHIM_SOURCE)
            shim = ["-x", "c", str(Path(d) / "edgekv_error_shim.c"), "-x", "none"]
        cmd = (shlex.split(cc) + ["-shared", "-fPIC", "-o", str(part)] + objs + shim
               + list(tool.get("link_flags", [])))
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise CompileError(f"{env}={cc}: cannot run it ({exc}); {tool.get('tool')}") from None
        if r.returncode != 0:
            part.unlink(missing_ok=True)
            raise CompileError(f"{env}={cc} failed to link {tar.name} (exit {r.returncode}):\n"
                               f"{(r.stderr or r.stdout)[-3000:]}")
    part.replace(so)
    files["library_objects"] = {"name": tar.name, "sha256": sha256_file(tar)}
    files["library"] = {"name": so.name, "sha256": sha256_file(so)}
    if files.get("program"):
        # the program names the library and holds its size and CRC-32: the runtime refuses a
        # library that does not match them
        path = out / files["program"]["name"]
        prog = pf.read(path)
        prog.settings.update({"library_name": so.name, "library_bytes": so.stat().st_size,
                              "library_crc32": crc32_file(so)})
        size = pf.write(prog, path)
        files["program"]["sha256"] = sha256_file(path)
        if isinstance(manifest.get("program"), dict):
            manifest["program"]["bytes"] = size
    manifest["device"]["toolchain"]["status"] = "finished"
    manifest["device"]["toolchain"]["linked_with"] = cc
    tmp = out / (MANIFEST + ".part")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    tmp.replace(out / MANIFEST)
    return so


def check_cuda_source(source: str, arch: str = "sm_80", nvcc: str = "nvcc") -> dict:
    """Compile generated CUDA C with nvcc (no GPU needed) to prove it is valid for ``arch``;
    returns {cubin_bytes, seconds}. Raises CompileError with nvcc's message on failure."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cu"
        src.write_text(source)
        t0 = time.perf_counter()
        r = subprocess.run([nvcc, "-w", f"-arch={arch}", "-cubin", "-o", str(Path(d) / "k.cubin"), str(src)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError(f"nvcc rejected the generated CUDA source:\n{r.stderr[-3000:]}")
        return {"cubin_bytes": (Path(d) / "k.cubin").stat().st_size, "seconds": time.perf_counter() - t0}


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "finish":
        try:
            print(f"wrote {finish(argv[1])}")
        except CompileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m edgekv.compiler.targets finish <artifact dir>", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
