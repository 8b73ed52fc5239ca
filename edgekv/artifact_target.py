"""Where a compiled artifact runs: this machine's CPU, or a device it was compiled for.

Used before an artifact is loaded (``edgekv run``, ``edgekv simulate``, ``HostRuntime``) so that a
device artifact gets a message saying where and how to run it instead of TVM's linker output."""

from __future__ import annotations


def artifact_runs_here(manifest: dict) -> bool:
    """A host-built artifact (LLVM without a cross triple, no device) runs on this machine's CPU; an
    OpenCL one whose host code is this machine's (``--target opencl-host``) runs here through the
    native runtime's OpenCL device (``needs_native_device``)."""
    tgt = (manifest.get("target") or {}).get("tvm") or {}
    return (tgt.get("kind") == "llvm" and "mtriple" not in tgt and not (manifest.get("target") or {}).get("host")) \
        or needs_native_device(manifest)


def needs_native_device(manifest: dict) -> bool:
    """An artifact the native runtime runs on a device here (OpenCL kernels, this machine as the host):
    TVM's Python runtime (HostRuntime) has no OpenCL, so only the native runtime runs it."""
    target = manifest.get("target") or {}
    host = target.get("host") or {}
    return (target.get("tvm") or {}).get("kind") == "opencl" and host.get("kind") == "llvm" and "mtriple" not in host


def device_artifact_message(path, manifest: dict) -> str:
    """Why a device artifact does not run here, and how to run it where it belongs."""
    target = manifest.get("target") or {}
    tvm_target = target.get("tvm") or {}
    name = target.get("profile") or tvm_target.get("kind", "another target")
    where = tvm_target.get("mtriple") or tvm_target.get("kind")
    tool = ((manifest.get("device") or {}).get("toolchain") or {})
    steps = []
    if tool.get("status") == "needs-toolchain" and tool.get("finish"):
        steps.append("link it on a machine with " + str(tool.get("tool", "the device toolchain")) + ": "
                     + str(tool["finish"]).replace("<artifact dir>", str(path)))
    if tvm_target.get("kind") == "cuda":
        steps.append("run it on a machine with an NVIDIA GPU from Python: "
                     f"edgekv.runtime.HostRuntime('{path}', device=tvm.cuda())")
    else:
        steps.append("copy the artifact directory to the device and run it there with the device runtime "
                     "(docs/TARGETS.md)")
    return (f"{path} was compiled for {name} ({where}), not for this machine's CPU; "
            + "; then ".join(steps)
            + ". To run on this machine, compile for the host: edgekv compile ... --target host -o DIR")
