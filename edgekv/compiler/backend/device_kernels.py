"""What a runtime needs to launch a GPU build's device kernels, recorded while TVM builds them.

A GPU build's host code (``model.so``) calls each device kernel through the runtime's
``__TVMFFIFunctionCall`` with the kernel's arguments — one pointer per buffer, then its scalar
arguments — followed by the launch extents, one per launch tag (``blockIdx.x``,
``threadIdx.x``, ...). TVM keeps those tags and the argument types in its serialized device
module, in a binary format of its own. Instead of parsing that in C, the exporter takes them
from the device PrimFuncs as TVM hands them to its code generator (``target.build.opencl``):
``record_device_kernels`` wraps that function for the length of one build, and
``program.write_program`` writes the result into ``program.ekv`` (``DEVICE_KERNELS``)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

# launch tags, in the codes program.ekv uses (runtime/src/program.h: EKV_TAG_*)
LAUNCH_TAGS = {"blockIdx.x": 0, "blockIdx.y": 1, "blockIdx.z": 2, "threadIdx.x": 3, "threadIdx.y": 4,
               "threadIdx.z": 5, "tirx.use_dyn_shared_memory": 6}
# argument kinds (EKV_DARG_*): a global buffer, or a scalar of this type
ARG_KINDS = {"buffer": 0, "int32": 1, "int64": 2, "float32": 3, "float64": 4, "uint32": 5}


class DeviceKernelError(RuntimeError):
    """A device kernel whose launch the runtime could not reproduce (an unknown tag or argument type)."""


@dataclass
class DeviceKernel:
    name: str
    args: list[int]   # ARG_KINDS, in the order the host code passes them
    tags: list[int]   # LAUNCH_TAGS, in the order of the extents after the arguments


def _arg_kind(kernel: str, param) -> int:
    import tvm

    ty = param.ty if hasattr(param, "ty") else None
    if isinstance(ty, tvm.ir.PointerType):
        return ARG_KINDS["buffer"]
    dtype = str(param.dtype) if hasattr(param, "dtype") else str(ty)
    if dtype not in ARG_KINDS:
        raise DeviceKernelError(f"device kernel {kernel}: argument {param.name} of type {dtype} has no launch form")
    return ARG_KINDS[dtype]


def describe(func, name: str) -> DeviceKernel:
    tags = [str(t) for t in (func.attrs or {}).get("tirx.kernel_launch_params", [])]
    unknown = [t for t in tags if t not in LAUNCH_TAGS]
    if unknown:
        raise DeviceKernelError(f"device kernel {name}: launch parameter(s) {', '.join(unknown)} are not supported")
    return DeviceKernel(name, [_arg_kind(name, p) for p in func.params], [LAUNCH_TAGS[t] for t in tags])


@contextmanager
def record_device_kernels(kind: str) -> Iterator[dict[str, DeviceKernel]]:
    """While active, every module TVM builds for ``kind`` ("opencl") adds its kernels to the
    yielded dict (name → DeviceKernel). The original code generator is restored afterwards."""
    import tvm_ffi

    name = f"target.build.{kind}"
    original = tvm_ffi.get_global_func(name)
    seen: dict[str, DeviceKernel] = {}

    def recording(mod, target):
        for gv, func in mod.functions.items():
            seen[gv.name_hint] = describe(func, gv.name_hint)
        return original(mod, target)

    tvm_ffi.register_global_func(name, recording, override=True)
    try:
        yield seen
    finally:
        tvm_ffi.register_global_func(name, original, override=True)
