"""Where a compiled artifact runs: this machine's CPU, or a device it was compiled for.

Used before an artifact is loaded (``edgekv run``, ``edgekv simulate``, ``HostRuntime``) so that a
device artifact gets a message saying where and how to run it instead of TVM's linker output."""

from __future__ import annotations

from .artifact.manifest import Keys, Manifest, ToolchainStatus

_TVM = Keys.TvmTarget


def artifact_runs_here(manifest: Manifest) -> bool:
    """A host-built artifact (LLVM without a cross triple, no device) runs on this machine's CPU; an
    OpenCL one whose host code is this machine's (``--target opencl-host``) runs here through the
    native runtime's OpenCL device (``needs_native_device``)."""
    target = manifest.target
    return (target.kind == "llvm" and _TVM.MTRIPLE not in target.tvm and not target.host) \
        or needs_native_device(manifest)


def needs_native_device(manifest: Manifest) -> bool:
    """An artifact the native runtime runs on a device here (OpenCL kernels, or CUDA PTX from
    ``--target cuda-host``, with this machine as the host): TVM's Python runtime (HostRuntime) has
    no OpenCL and does not load the PTX, so only the native runtime runs it."""
    target = manifest.target
    host = target.host or {}
    return target.kind in ("opencl", "cuda") and host.get(_TVM.KIND) == "llvm" and _TVM.MTRIPLE not in host


def device_artifact_message(path, manifest: Manifest) -> str:
    """Why a device artifact does not run here, and how to run it where it belongs."""
    m = manifest
    name = m.target.profile or m.target.tvm.get(_TVM.KIND, "another target")
    where = m.target.mtriple or m.target.kind
    tool = m.toolchain
    T = Keys.Toolchain
    steps = []
    if tool.get(T.STATUS) == ToolchainStatus.NEEDS_TOOLCHAIN and tool.get(T.FINISH):
        steps.append("link it on a machine with " + str(tool.get(T.TOOL, "the device toolchain")) + ": "
                     + str(tool[T.FINISH]).replace("<artifact dir>", str(path)))
    if m.target.kind == "cuda":
        steps.append("run it on a machine with an NVIDIA GPU from Python: "
                     f"edgekv.runtime.HostRuntime('{path}', device=tvm.cuda())")
    else:
        steps.append("copy the artifact directory to the device and run it there with the device runtime "
                     "(docs/TARGETS.md)")
    return (f"{path} was compiled for {name} ({where}), not for this machine's CPU; "
            + "; then ".join(steps)
            + ". To run on this machine, compile for the host: edgekv compile ... --target host -o DIR")
