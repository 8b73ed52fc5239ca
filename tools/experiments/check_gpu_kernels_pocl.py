"""Run edgekv's GPU kernels without a GPU: TVM's OpenCL C for them, executed on PoCL's CPU
OpenCL device (``pip install pyopencl pocl-binary-distribution``), against the CPU kernels.

The OpenCL source is exactly what ``--target opencl`` ships (same TIR, same thread bindings,
shared memory and barriers), so this checks the GPU schedules' logic — work-group cooperation,
barriers, reductions, in-place compaction — on a machine without an accelerator. It does not
say anything about speed.

    python tools/experiments/check_gpu_kernels_pocl.py            # every GPU score / observe / select kernel

``run_on_pocl(prim_func, arrays)`` is the reusable part
(``from tools.experiments.check_gpu_kernels_pocl import run_on_pocl``).
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np

_LAUNCH = re.compile(r'T\.thread_binding\((\d+), thread="(blockIdx|threadIdx)\.([xyz])"\)')
OPTIONS = ["-cl-opt-disable"]  # PoCL 3.0 miscompiles some barrier regions of the select kernel when optimising
_KERNEL = re.compile(r"__kernel void (\w+)\(([^)]*)\)\s*\{")


def _launches(func) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """(grid, block) of every launch nest of a thread-bound PrimFunc, in program order."""
    out, in_threads = [], True
    for m in _LAUNCH.finditer(func.script()):
        extent, kind, axis = int(m.group(1)), m.group(2), "xyz".index(m.group(3))
        if kind == "blockIdx" and in_threads:  # a block binding after thread bindings: a new launch
            out.append(([1, 1, 1], [1, 1, 1]))
        in_threads = kind == "threadIdx"
        (out[-1][1] if in_threads else out[-1][0])[axis] = extent
    return [(tuple(g), tuple(b)) for g, b in out]


def opencl_device():
    """The PoCL CPU device, or None when pyopencl / PoCL is not installed."""
    try:
        import pyopencl as cl
    except ImportError:
        return None
    for p in cl.get_platforms():
        if "Portable Computing Language" in p.name or "pocl" in p.name.lower():
            devs = p.get_devices()
            if devs:
                return devs[0]
    return None


def run_on_pocl(func, arrays: dict[str, np.ndarray], workspace_elems: int = 1 << 20) -> dict[str, np.ndarray]:
    """Compile ``func`` (a thread-bound PrimFunc) for OpenCL with TVM, run its launches in order on
    PoCL with the buffers named in ``arrays`` (missing names are device workspaces, zeroed), and
    return every buffer's final contents."""
    import pyopencl as cl
    import tvm

    name = "edgekv_pocl"
    ex = tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}),
                     target=tvm.target.Target("opencl", host="llvm"))
    src = ex.mod.imports[0].inspect_source()
    kernels = {m.group(1): [a.strip() for a in m.group(2).split(",")] for m in _KERNEL.finditer(src)}
    launches = _launches(func)
    order = [f"{name}_kernel"] + [f"{name}_kernel_{i}" for i in range(1, len(launches))]
    if sorted(order) != sorted(kernels):
        raise RuntimeError(f"kernels in the source {sorted(kernels)} do not match the launches {order}")
    dev = opencl_device()
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx)
    prog = cl.Program(ctx, src).build(options=OPTIONS)
    host = {k: np.ascontiguousarray(v).copy() for k, v in arrays.items()}
    bufs = {}
    mf = cl.mem_flags
    for kname in order:
        for arg in kernels[kname]:
            m = re.match(r"__global (\w+)\* restrict (\w+)_ptr$", arg)
            if m is None:
                raise RuntimeError(f"unsupported kernel argument {arg!r}")
            bname, ctype = m.group(2), m.group(1)
            if bname not in bufs:
                if bname not in host:  # a workspace (TVM may merge several into one)
                    host[bname] = np.zeros(workspace_elems, dtype={"float": np.float32, "int": np.int32,
                                                                   "uint": np.uint32}[ctype])
                bufs[bname] = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=host[bname])
    for kname, (grid, block) in zip(order, launches):
        k = getattr(prog, kname)
        args = [bufs[re.match(r"__global \w+\* restrict (\w+)_ptr$", a).group(1)] for a in kernels[kname]]
        gsize = tuple(g * b for g, b in zip(grid, block))
        k(queue, gsize, block, *args)
    queue.finish()
    for bname, buf in bufs.items():
        cl.enqueue_copy(queue, host[bname], buf)
    queue.finish()
    return host


# ---- the check: GPU kernels vs the CPU kernels on random inputs ---------------------------------

def _inputs(rng, H, Hq, N, B, D, fill, n_valid):
    return {
        "k_cache": rng.standard_normal((H, N, D)).astype("float32"),
        "v_cache": rng.standard_normal((H, N, D)).astype("float32"),
        "pos_cache": np.tile(np.arange(N, dtype="int32"), (H, 1)),
        "fill": np.array([fill], "int32"),
        "k_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
        "v_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
        "pos_blk": np.arange(fill, fill + B, dtype="int32"),
        "n_valid": np.array([n_valid], "int32"),
        "q": (2 * rng.standard_normal((1, Hq, B, D))).astype("float32"),
    }


def _run_cpu(func, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tvm

    ex = tvm.compile(tvm.IRModule({"f": func.with_attr("global_symbol", "f")}), target="llvm")
    names = [p.name for p in func.params]
    tens = {n: tvm.runtime.tensor(np.ascontiguousarray(arrays[n]).copy()) for n in names}
    ex["f"](*[tens[n] for n in names])
    return {n: t.numpy() for n, t in tens.items()}


def check(H=2, Hq=4, N=200, B=16, D=32, cases=((200, 16), (190, 7), (150, 16), (200, 1), (20, 16))) -> list[str]:
    from edgekv.compiler.kernels import build_select
    from edgekv.compiler.kernels.select import build_select_compact_kernel_gpu
    from edgekv.compiler.policy_kernels import KERNELS, build_observe, build_score, kernel_params, site_params
    from edgekv.policies import make_policy

    problems = []
    policies = {"snapkv": {"window": "8", "kernel": "5"}, "snapkv++": {"window": "4", "kernel_short": "3",
                                                                     "kernel_long": "9", "long_threshold": "205"},
                "tova": {}, "tova_layer": {"heads": "layer"}, "h2o": {}, "keydiff": {}, "lagkv": {"lag": "8"},
                "streaming": {}}
    for label, args in policies.items():
        name = label.split("_")[0]
        pol = make_policy(name, args)
        params = dict(kernel_params(pol, N), **site_params(name, Hq, D ** -0.5))
        for fill, nv in cases:
            rng = np.random.default_rng(fill * 7 + nv)
            a = _inputs(rng, H, Hq, N, B, D, fill, nv)
            n = fill + nv
            if pol.entry_state:
                a["state"] = rng.random((1, H, N)).astype("float32")
                cpu = _run_cpu(build_observe(name, H, N, B, D, "float32", params), dict(a, cand_state=np.zeros((1, H, N + B), "float32")))
                gpu = run_on_pocl(KERNELS[name].gpu_observe_kernel(H, N, B, D, "float32", **params),
                                  dict(a, cand_state=np.zeros((1, H, N + B), "float32")))
                if not np.allclose(gpu["cand_state"][..., :n], cpu["cand_state"][..., :n], rtol=1e-5, atol=1e-6):
                    problems.append(f"{label} observe fill={fill} n_valid={nv}: GPU state differs")
                a["cand_state"] = cpu["cand_state"]
            if n <= N:
                continue
            score0 = np.zeros((H, N + B), "float32")
            cpu = _run_cpu(build_score(name, H, N, B, D, "float32", params), dict(a, score=score0))
            gpu = run_on_pocl(KERNELS[name].gpu_evict_kernel(H, N, B, D, "float32", **params), dict(a, score=score0))
            c, g = cpu["score"][:, :n], gpu["score"][:, :n]
            fin = np.isfinite(c)
            if not (np.array_equal(fin, np.isfinite(g)) and np.array_equal(c[~fin], g[~fin])
                    and np.allclose(g[fin], c[fin], rtol=1e-4, atol=1e-6)):
                problems.append(f"{label} score fill={fill} n_valid={nv}: max |diff| "
                                f"{np.nanmax(np.abs(np.where(fin, g - c, 0)))}")
    # select + compaction, with and without state: bit-exact against the CPU kernel
    for S in (0, 1, 2):
        for fill, nv in cases:
            rng = np.random.default_rng(fill + nv + S)
            a = _inputs(rng, H, Hq, N, B, D, fill, nv)
            del a["q"]
            a["score"] = rng.standard_normal((H, N + B)).astype("float32")
            a["score"][:, ::7] = 0.5  # ties
            if S:
                a["state"] = rng.standard_normal((S, H, N)).astype("float32")
                a["cand_state"] = rng.standard_normal((S, H, N + B)).astype("float32")
            cpu = _run_cpu(build_select(H, N, B, D, "float32", True, S), a)
            gpu = run_on_pocl(build_select_compact_kernel_gpu(H, N, B, D, "float32", True, S), a)
            k = min(fill + nv, N)
            for buf in ("k_cache", "v_cache", "pos_cache", "fill") + (("state",) if S else ()):
                cv, gv = cpu[buf], gpu[buf]
                if buf != "fill":
                    cv, gv = cv[..., :k, :] if cv.ndim == 3 and buf != "state" else cv[..., :k], \
                        gv[..., :k, :] if gv.ndim == 3 and buf != "state" else gv[..., :k]
                if not np.array_equal(cv, gv):
                    problems.append(f"select S={S} fill={fill} n_valid={nv}: {buf} differs")
    return problems


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if opencl_device() is None:
        print("no PoCL OpenCL device: pip install pyopencl pocl-binary-distribution")
        return 2
    problems = check()
    print("\n".join(problems) if problems else "all GPU kernels agree with the CPU kernels on PoCL")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
