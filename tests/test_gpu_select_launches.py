"""No kernel of a GPU build launches a single work-item (issue 35): a 1 × 1 × 1 launch leaves a
GPU idle but for one lane, and costs a launch. Every policy that compiles for OpenCL is built for
``opencl-host`` on the tiny model while the device PrimFuncs TVM hands to its OpenCL code generator
are read: each launch's ``blockIdx`` / ``threadIdx`` extents (a symbolic extent is never 1). D2O
runs in the default suite (its own score / eviction kernels and the per-prompt prepare kernels,
beside the shared attention and dlight's kernels); the other policies with `-m slow`."""

from __future__ import annotations

import re
from contextlib import contextmanager

import pytest

tvm = pytest.importorskip("tvm")

from edgekv.compiler.policy_kernels import gpu_policy_names  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402

B, N = 8, 24
SETUP = {"full": ({}, 128), "lagkv": ({"sinks": 2, "lag": 4}, N), "dapq": ({"window": 4}, N)}
FAST = ("d2o",)
_EXTENT = re.compile(r'T\.launch_thread\("(blockIdx|threadIdx)\.([xyz])", (?:T\.int\d+\()?([^()\s,]+)\)')


def launch_extents(func) -> dict[str, str]:
    """``{"blockIdx.x": "3", "threadIdx.x": "256", ...}`` of a device PrimFunc (after TVM split
    host and device code): the extents its launch is given, as text (a constant or an expression)."""
    return {f"{kind}.{axis}": ext for kind, axis, ext in _EXTENT.findall(func.script())}


def single_work_item(extents: dict[str, str]) -> bool:
    """Every extent a constant 1 (no binding at all counts too: TVM launches that as 1 × 1 × 1)."""
    return all(e == "1" for e in extents.values())


@contextmanager
def recorded_launches():
    """While active, every module built for OpenCL adds ``{kernel: extents}`` to the yielded dict."""
    import tvm_ffi

    name = "target.build.opencl"
    original = tvm_ffi.get_global_func(name)
    seen: dict[str, dict[str, str]] = {}

    def recording(mod, target):
        for gv, func in mod.functions.items():
            seen[gv.name_hint] = launch_extents(func)
        return original(mod, target)

    tvm_ffi.register_global_func(name, recording, override=True)
    try:
        yield seen
    finally:
        tvm_ffi.register_global_func(name, original, override=True)


def test_the_check_sees_a_single_work_item_launch():
    """The check itself: a kernel bound to one block of one thread is reported, a wider one is not."""
    from tvm.script import tirx as T

    def kernel(threads):
        @T.prim_func(private=True, s_tir=True)
        def f(a: T.Buffer((4,), "int32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            for _b in T.thread_binding(1, thread="blockIdx.x"):
                for t in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("w"):
                        T.reads()
                        T.writes()
                        if t == 0:
                            a[0] = 1

        return f.with_attr("global_symbol", f"k{threads}")

    with recorded_launches() as seen:
        tvm.compile(tvm.IRModule({"k1": kernel(1), "k32": kernel(32)}), target=tvm.target.Target("opencl", host="llvm"))
    assert single_work_item(seen["k1_kernel"]) and not single_work_item(seen["k32_kernel"]), seen


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in gpu_policy_names()])
def test_no_kernel_launches_a_single_work_item(name, tmp_path):
    from edgekv.compiler import compile_model

    args, budget = SETUP.get(name, ({}, N))
    with recorded_launches() as seen:
        compile_model(tiny_random_model(seed=1, layers=2), make_policy(name, args), budget, B,
                      target="opencl-host", out_dir=tmp_path / "opencl")
    assert seen, "no OpenCL kernels were built"
    single = sorted(k for k, ext in seen.items() if single_work_item(ext))
    assert not single, f"{name}: kernels launched as one work-item: {single}"
