"""Finishing a device artifact on a machine with the device's toolchain.

A build for a device whose library a toolchain that is not here must link (Android NDK, Xcode,
Hexagon SDK, a cross gcc: the profile's ``toolchain.env``) writes ``model.tar`` of object files
and says so (``toolchain.status`` = ``needs-toolchain``, ``ToolchainNeededWarning``);
``python -m edgekv.compiler.backend.finish <artifact dir>`` links it into ``model.so`` with
that toolchain and records it in the manifest and ``program.ekv``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ...artifact import MANIFEST, Keys, sha256_file
from ...artifact.manifest import ToolchainStatus
from ..errors import CompileError


def toolchain_message(manifest: dict, out_dir: Path | str) -> str:
    """What a device build wrote and, where a toolchain must link it, the command that finishes it
    (``manifest``: the build's own dict, ``BuildResult.manifest``)."""
    tool, T = manifest[Keys.DEVICE].get(Keys.Device.TOOLCHAIN, {}), Keys.Toolchain
    name = manifest[Keys.TARGET][Keys.Target.PROFILE]
    if tool.get(T.STATUS) == ToolchainStatus.NEEDS_TOOLCHAIN:
        return (f"{name}: wrote {out_dir} (model.tar, params, manifest, device code). NOT YET LOADABLE ON THE DEVICE: "
                f"{tool.get(T.NEEDED_FOR)} needs {tool.get(T.TOOL)}; finish with: "
                f"{str(tool.get(T.FINISH)).replace('<artifact dir>', str(out_dir))}")
    return f"{name}: wrote {out_dir}; {tool.get(T.NEEDED_FOR, 'complete')}"


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
/* edgekv: written by `python -m edgekv.compiler.backend.finish` (see ERROR_SHIM_SOURCE there) */
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
    target = manifest.get(Keys.TARGET, {})
    triples = [str((target.get(k) or {}).get(Keys.TvmTarget.MTRIPLE, "")) for k in (Keys.Target.TVM, Keys.Target.HOST)]
    return any("android" in t for t in triples) or target.get(Keys.Target.PROFILE) in ("android-cpu", "opencl")


def finish(out_dir: str | Path) -> Path:
    """Link ``model.tar`` into ``model.so`` with the toolchain named by the profile's ``env``
    variable (the NDK / cross gcc / Xcode / Hexagon SDK compiler command), and record it: the
    manifest's file entries and hashes, and — where the artifact has a native program — the
    library's name, size and CRC-32 in ``program.ekv``'s settings, which the native runtime checks
    at load. The tar stays (``files.library_objects``), so finishing again relinks it."""
    from ...artifact import crc32_file
    from ...artifact import program_file as pf

    K, T, F, E = Keys, Keys.Toolchain, Keys.Files, Keys.FileEntry
    out = Path(out_dir)
    # the JSON object itself, not a checked Manifest: finish rewrites it and keeps every key as is
    manifest = json.loads((out / MANIFEST).read_text())
    tool = manifest.get(K.DEVICE, {}).get(K.Device.TOOLCHAIN, {})
    env = tool.get(T.ENV)
    if not env:
        raise CompileError(f"{out}: this artifact needs no toolchain step ({tool.get(T.NEEDED_FOR, 'complete')})")
    cc = os.environ.get(env)
    if not cc:
        raise CompileError(f"set {env} to the compiler command ({tool.get(T.TOOL)}); e.g. {tool.get(T.FINISH)}")
    files = manifest[K.FILES]
    tar = out / (files.get(F.LIBRARY_OBJECTS) or files[F.LIBRARY])[E.NAME]
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
               + list(tool.get(T.LINK_FLAGS, [])))
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise CompileError(f"{env}={cc}: cannot run it ({exc}); {tool.get(T.TOOL)}") from None
        if r.returncode != 0:
            part.unlink(missing_ok=True)
            raise CompileError(f"{env}={cc} failed to link {tar.name} (exit {r.returncode}):\n"
                               f"{(r.stderr or r.stdout)[-3000:]}")
    part.replace(so)
    files[F.LIBRARY_OBJECTS] = {E.NAME: tar.name, E.SHA256: sha256_file(tar)}
    files[F.LIBRARY] = {E.NAME: so.name, E.SHA256: sha256_file(so)}
    if files.get(F.PROGRAM):
        # the program names the library and holds its size and CRC-32: the runtime refuses a
        # library that does not match them
        path = out / files[F.PROGRAM][E.NAME]
        prog = pf.read(path)
        prog.settings.update({"library_name": so.name, "library_bytes": so.stat().st_size,
                              "library_crc32": crc32_file(so)})
        size = pf.write(prog, path)
        files[F.PROGRAM][E.SHA256] = sha256_file(path)
        if isinstance(manifest.get(K.PROGRAM), dict):
            manifest[K.PROGRAM][K.Program.BYTES] = size
    tool[T.STATUS] = ToolchainStatus.FINISHED
    tool[T.LINKED_WITH] = cc
    tmp = out / (MANIFEST + ".part")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    tmp.replace(out / MANIFEST)
    return so


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        try:
            print(f"wrote {finish(argv[0])}")
        except CompileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m edgekv.compiler.backend.finish <artifact dir>", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
