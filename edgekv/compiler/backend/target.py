"""Compile targets: a profile (``edgekv/profiles/targets/<name>.json``, a path to one, or a dict)
resolved to the TVM target and the choices the pipeline branches on.

A profile holds ``target`` (a TVM target dict), and optionally ``host`` (the target dict of the
VM's host code: GPU builds), ``demote_float64``, ``device_source`` and ``toolchain`` (``env``:
the variable holding the compiler command ``backend/finish.py`` links with; ``link_flags``:
added after the objects, e.g. ``-lm``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...profiles import profile_dir
from ..errors import CompileError

PROFILE_DIR = profile_dir("targets")
DEVICE_TARGETS = ("cuda", "cuda-host", "opencl", "opencl-host", "metal", "hexagon", "android-cpu", "aarch64-linux")
GPU_KINDS = ("cuda", "opencl", "metal", "vulkan", "rocm", "webgpu")
NATIVE_DEVICES = ("opencl", "cuda")  # GPU kinds the native runtime runs (runtime/src/device_opencl.c, device_cuda.c)
NO_FP64_KINDS = ("metal", "opencl", "vulkan", "webgpu")  # default of a profile's demote_float64


def is_gpu_target(target: Any) -> bool:
    """A TVM target (object or dict) whose kernels run on a GPU."""
    kind = target.kind.name if hasattr(target, "kind") else dict(target).get("kind")
    return kind in GPU_KINDS


def _profile_path(target: str) -> Path | None:
    p = Path(target)
    if p.suffix == ".json" and p.exists():
        return p
    cand = PROFILE_DIR / f"{target}.json"
    return cand if cand.exists() else None


def resolve_target(target: str | dict = "host") -> tuple[dict, dict]:
    """A target profile name (``edgekv/profiles/targets/<name>.json``), a JSON path, a profile dict
    (with ``target``), a TVM target dict, or a TVM target kind such as ``llvm``. Returns (profile,
    resolved TVM target dict); ``"host"`` values for ``mcpu`` / ``num-cores`` become this
    machine's CPU (from LLVM) and core count."""
    if isinstance(target, dict):
        profile = dict(target) if "target" in target else {"name": "custom", "target": dict(target)}
    else:
        path = _profile_path(target)
        if path is not None:
            profile = json.loads(path.read_text())
        elif target == "llvm":
            profile = json.loads((PROFILE_DIR / "host.json").read_text())
        else:
            known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise CompileError(f"unknown target '{target}'; known profiles in edgekv/profiles/targets/: "
                               f"{', '.join(known)} (or a path to a profile .json)")
    tgt = dict(profile["target"])
    if tgt.get("kind") == "llvm":
        if tgt.get("mcpu") == "host":
            from tvm.target import codegen

            tgt["mcpu"] = str(codegen.llvm_get_system_cpu())
        if tgt.get("num-cores") == "host":
            tgt["num-cores"] = int(os.cpu_count() or 1)
    return profile, tgt


def weight_layout(profile: dict, tgt: dict) -> str | None:
    """How a target's build lays out its weights: ``host`` (this CPU: fp32 panels or quantised
    panels), ``cpu`` (a cross-compiled CPU: fp32 as TVM lays it out, quantised panels), ``gpu``
    (quantised rows that dlight schedules), or None where quantised weights have no kernels yet
    (Hexagon: its float16 conversions are untested)."""
    if is_gpu_target(tgt):
        return "gpu"
    if tgt.get("kind") != "llvm" or "hexagon" in str(tgt.get("mtriple", "")):
        return None
    return "cpu" if (profile.get("host") or "mtriple" in tgt) else "host"


@dataclass(frozen=True)
class CompileTarget:
    """A resolved target and what the pipeline branches on."""

    profile: dict
    tvm: dict  # the TVM target dict ("host" values resolved)
    host: dict | None  # the target dict of the VM's host code (GPU builds), or None

    @classmethod
    def resolve(cls, target: str | dict) -> "CompileTarget":
        profile, tgt = resolve_target(target)
        return cls(profile, tgt, dict(profile["host"]) if profile.get("host") else None)

    @property
    def name(self) -> str:
        return str(self.profile.get("name", self.tvm.get("kind")))

    @property
    def kind(self) -> str:
        return str(self.tvm.get("kind"))

    @property
    def is_gpu(self) -> bool:
        return is_gpu_target(self.tvm)

    @property
    def weight_layout(self) -> str | None:
        return weight_layout(self.profile, self.tvm)

    @property
    def is_host(self) -> bool:
        """This machine's CPU: the build the host runtime loads as is (no ``device`` section)."""
        return self.weight_layout == "host"

    @property
    def native_runtime(self) -> bool:
        """The native runtime runs the build (CPU targets, OpenCL, and CUDA where the profile says
        ``native_runtime``: cuda-host): it gets ``program.ekv`` and the per-prompt ``prepare``
        function. The ``cuda`` profile stays a TVM-runtime build (HostRuntime with tvm.cuda())."""
        if not self.is_gpu:
            return True
        return self.kind in NATIVE_DEVICES and bool(self.profile.get("native_runtime", self.kind == "opencl"))

    @property
    def ptx(self) -> bool:
        """The build's CUDA C is compiled to PTX at compile time (``backend/cuda_ptx.py``)."""
        return self.kind == "cuda" and self.profile.get("device_code") == "ptx"

    @property
    def demote_float64(self) -> bool:
        return bool(self.profile.get("demote_float64", self.kind in NO_FP64_KINDS))

    @property
    def cores(self) -> int:
        """Threads of a CPU target (``num-cores``; 1 where the profile does not say)."""
        return int(self.tvm.get("num-cores", 1))

    def tvm_target(self):
        import tvm

        return tvm.target.Target(self.tvm, host=self.host) if self.host else tvm.target.Target(self.tvm)
