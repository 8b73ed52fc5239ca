"""Run edgekv's GPU kernels (``*_gpu`` builders beside each CPU kernel) on a real OpenCL device and
hold them against the CPU kernels they replace (``edgekv/compiler/kernels``) on random inputs.

Any OpenCL device will do — a phone GPU, a desktop GPU, or pocl on a CPU
(``pip install pyopencl pocl-binary-distribution``), which exercises the same barriers,
local memory and work-group semantics. Each kernel PrimFunc is compiled with TVM for
``opencl``; its kernels are launched here with pyopencl in the order and with the grid TVM
gives them (read from the thread bindings). Skips when pyopencl or a device is absent.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
cl = pytest.importorskip("pyopencl")

from edgekv.compiler.kernels import attention, select  # noqa: E402
from edgekv.compiler.kernels.attention import build_block_attention_kernel_gpu  # noqa: E402
from edgekv.compiler.kernels.select import build_select_compact_kernel_gpu  # noqa: E402
from edgekv.compiler.policy_kernels.keydiff import build_keydiff_evict_kernel, build_keydiff_evict_kernel_gpu  # noqa: E402
from edgekv.compiler.policy_kernels.lagkv import build_lagkv_evict_kernel, build_lagkv_evict_kernel_gpu  # noqa: E402
from edgekv.compiler.policy_kernels.streaming import (build_streaming_evict_kernel,  # noqa: E402
                                                      build_streaming_evict_kernel_gpu)


def _context():
    for plat in cl.get_platforms():
        devs = plat.get_devices()
        if devs:
            return cl.Context([devs[0]])
    return None


try:
    CTX = _context()
except Exception as e:  # noqa: BLE001 - no ICD loader / platform
    CTX = None
    _WHY = str(e)
else:
    _WHY = "no OpenCL platform with a device"
pytestmark = pytest.mark.skipif(CTX is None, reason=f"needs an OpenCL device: {_WHY}")

# pocl 3.0 (pocl-binary-distribution) miscompiles the select kernel's barrier loop at its
# default optimisation level (the selection finds nothing); with optimisation off it agrees
# with the CPU kernel exactly, as it does with printf instrumentation. Other drivers: defaults.
_POCL = CTX is not None and "Portable Computing Language" in CTX.devices[0].platform.name
BUILD_OPTIONS = os.environ.get("EDGEKV_OPENCL_OPTIONS", "-cl-opt-disable" if _POCL else "")


def _launches(func) -> list[dict]:
    """Per kernel launch in body order: {'blockIdx.x': n, 'threadIdx.x': n, 'threadIdx.y': n}."""
    out: list[dict] = []
    for ext, tag in re.findall(r'T\.thread_binding\((\d+), thread="(\w+\.\w)"\)', func.script()):
        if tag == "blockIdx.x":
            out.append({})
        out[-1][tag] = int(ext)
    return out


def run_opencl(func, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"}))
    src = lib.mod.imports[0].inspect_source()
    defs = re.findall(r"__kernel void (\w+)\(([^)]*)\)\s*\{", src)
    launches = _launches(func)
    assert len(defs) == len(launches), (len(defs), launches)
    order = sorted(defs, key=lambda d: int(d[0].rsplit("_", 1)[1]) if d[0][-1].isdigit() and "_kernel_" in d[0] else 0)
    queue = cl.CommandQueue(CTX)
    mf = cl.mem_flags
    bufs = {k: cl.Buffer(CTX, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(v)) for k, v in arrays.items()}
    prog = cl.Program(CTX, src).build(options=BUILD_OPTIONS)
    for (name, params), launch in zip(order, launches):
        names = [re.search(r"(\w+)_ptr$", p.strip()).group(1) for p in params.split(",")]
        tx, ty = launch.get("threadIdx.x", 1), launch.get("threadIdx.y", 1)
        kern = getattr(prog, name)
        kern(queue, (launch["blockIdx.x"] * tx, ty), (tx, ty), *[bufs[n] for n in names])
    out = {}
    for k, v in arrays.items():
        res = np.empty_like(v)
        cl.enqueue_copy(queue, res, bufs[k])
        out[k] = res
    queue.finish()
    return out


def run_cpu(func, arrays: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    ts = [tvm.runtime.tensor(np.ascontiguousarray(arrays[n])) for n in names]
    lib["main"](*ts)
    return {n: t.numpy() for n, t in zip(names, ts)}


EVICT_ARGS = ["k_cache", "v_cache", "pos_cache", "fill", "k_blk", "v_blk", "pos_blk", "n_valid"]
SHAPES = [(2, 16, 8, 16), (3, 40, 8, 64)]
FILLS = [(0, 8), (5, 3), (16, 8), (12, 5), (9, 8)]


def _state(H, N, B, D, nf, nv, seed):
    rng = np.random.default_rng(seed)
    nf = min(nf, N)
    k = rng.standard_normal((H, N, D)).astype("float32")
    v = rng.standard_normal((H, N, D)).astype("float32")
    pos = np.tile(np.arange(N, dtype="int32"), (H, 1))
    k[:, nf:] = 0
    v[:, nf:] = 0
    return {"k_cache": k, "v_cache": v, "pos_cache": pos, "fill": np.array([nf], "int32"),
            "k_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
            "v_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
            "pos_blk": np.arange(100, 100 + B, dtype="int32"), "n_valid": np.array([nv], "int32")}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nf,nv", FILLS)
@pytest.mark.parametrize("G", [1, 3])
def test_attention(shape, nf, nv, G):
    H, N, B, D = shape
    st = _state(H, N, B, D, nf, nv, 1)
    rng = np.random.default_rng(2)
    arr = {"q": rng.standard_normal((1, H * G, B, D)).astype("float32"), "k_blk": st["k_blk"], "v_blk": st["v_blk"],
           "k_cache": st["k_cache"], "v_cache": st["v_cache"], "fill": st["fill"], "n_valid": st["n_valid"],
           "out": np.full((1, H * G, B, D), 7.0, "float32")}
    names = ["q", "k_blk", "v_blk", "k_cache", "v_cache", "fill", "n_valid", "out"]
    want = run_cpu(attention.build_block_attention_kernel(H * G, H, N, B, D, D ** -0.5), arr, names)["out"]
    got = run_opencl(build_block_attention_kernel_gpu(H * G, H, N, B, D, D ** -0.5), arr)["out"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


SCORES = [
    ("streaming", build_streaming_evict_kernel, build_streaming_evict_kernel_gpu, {"sinks": 2}),
    ("keydiff", build_keydiff_evict_kernel, build_keydiff_evict_kernel_gpu, {"recent": 0}),
    ("keydiff-recent", build_keydiff_evict_kernel, build_keydiff_evict_kernel_gpu, {"recent": 3}),
    ("lagkv", build_lagkv_evict_kernel, build_lagkv_evict_kernel_gpu, {"sinks": 2, "lag": 4}),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nf,nv", FILLS)
@pytest.mark.parametrize("name,cpu,gpu,params", SCORES, ids=[s[0] for s in SCORES])
def test_score(shape, nf, nv, name, cpu, gpu, params):
    H, N, B, D = shape
    st = _state(H, N, B, D, nf, nv, 3)
    st["score"] = np.full((H, N + B), 5.0, "float32")
    want = run_cpu(cpu(H, N, B, D, "float32", **params), st, EVICT_ARGS + ["score"])["score"]
    got = run_opencl(gpu(H, N, B, D, "float32", **params), st)["score"]
    n = min(nf, N) + nv
    if n > N:  # scores are only defined (and read) when something is evicted
        np.testing.assert_allclose(got[:, :n], want[:, :n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nf,nv", FILLS)
@pytest.mark.parametrize("ties", [False, True])
def test_select(shape, nf, nv, ties):
    H, N, B, D = shape
    st = _state(H, N, B, D, nf, nv, 4)
    rng = np.random.default_rng(5)
    score = rng.standard_normal((H, N + B)).astype("float32")
    if ties:
        score = np.round(score * 2) / 2  # many exact ties
        score[:, 1] = np.inf
    st["score"] = score
    names = EVICT_ARGS + ["score"]
    want = run_cpu(select.build_select_compact_kernel(H, N, B, D, "float32", True), st, names)
    got = run_opencl(build_select_compact_kernel_gpu(H, N, B, D, "float32", True), st)
    n = min(int(want["fill"][0]), N)
    assert got["fill"][0] == want["fill"][0]
    for key in ("k_cache", "v_cache", "pos_cache"):
        np.testing.assert_array_equal(got[key][:, :n], want[key][:, :n], err_msg=key)


@pytest.mark.parametrize("nf,nv", [(0, 8), (5, 3), (12, 8)])
def test_append(nf, nv):
    H, N, B, D = 2, 16, 8, 16
    st = _state(H, N, B, D, nf, nv, 6)
    want = run_cpu(select.build_select_compact_kernel(H, N, B, D, "float32", False), st, EVICT_ARGS)
    got = run_opencl(build_select_compact_kernel_gpu(H, N, B, D, "float32", False), st)
    for key in ("k_cache", "v_cache", "pos_cache", "fill"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# ---- DapQ: block attention with trailing pseudo rows, and the pseudo rows' score kernel ----

@pytest.mark.parametrize("nf,nv", [(0, 8), (5, 3), (16, 8), (12, 5)])
@pytest.mark.parametrize("G", [1, 3])
def test_attention_with_pseudo_rows(nf, nv, G):
    H, N, B, D, W = 2, 16, 8, 16, 4
    st = _state(H, N, B + W, D, nf, nv, 7)
    rng = np.random.default_rng(8)
    arr = {"q": rng.standard_normal((1, H * G, B + W, D)).astype("float32"), "k_blk": st["k_blk"],
           "v_blk": st["v_blk"], "k_cache": st["k_cache"], "v_cache": st["v_cache"], "fill": st["fill"],
           "n_valid": st["n_valid"], "out": np.full((1, H * G, B + W, D), 7.0, "float32")}
    names = ["q", "k_blk", "v_blk", "k_cache", "v_cache", "fill", "n_valid", "out"]
    want = run_cpu(attention.build_block_attention_kernel(H * G, H, N, B + W, D, D ** -0.5, extra_rows=W),
                   arr, names)["out"]
    got = run_opencl(build_block_attention_kernel_gpu(H * G, H, N, B + W, D, D ** -0.5, extra_rows=W), arr)["out"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


DAPQ = [{"window": 4}, {"window": 4, "softmax_pseudo": False}, {"window": 4, "kernel": 3, "keep_recent": 2},
        {"window": 4, "kernel": 5, "pooling": "max"}]
# (H, N, B, d), fill, n_valid: evicting steps; N = 150 spreads the candidates over two column tiles
# of the GPU kernel (128 columns), so pooling reads neighbours across a tile edge
DAPQ_CASES = [((2, 16, 8, 16), 16, 8), ((2, 16, 8, 16), 12, 5), ((2, 16, 8, 16), 9, 8), ((3, 40, 8, 64), 40, 5),
              ((2, 150, 8, 16), 150, 6), ((2, 150, 8, 16), 147, 8)]


@pytest.mark.parametrize("shape,nf,nv", DAPQ_CASES, ids=[str(c) for c in DAPQ_CASES])
@pytest.mark.parametrize("rows", ["prefill", "decode"])
@pytest.mark.parametrize("params", DAPQ, ids=[str(p) for p in DAPQ])
def test_dapq_score(shape, nf, nv, rows, params):
    from edgekv.compiler.policy_kernels.dapq import build_dapq_evict_kernel, build_dapq_evict_kernel_gpu

    H, N, B, D = shape
    T_ = B + params["window"] if rows == "prefill" else 1
    nf, nv = (nf, nv) if rows == "prefill" else (N, 1)
    st = _state(H, N, T_, D, nf, nv, 9)
    G = 2
    st["q"] = np.random.default_rng(10).standard_normal((1, H * G, T_, D)).astype("float32")
    st["score"] = np.full((H, N + T_), 5.0, "float32")
    site = {"num_q_heads": H * G, "sm_scale": D ** -0.5}
    want = run_cpu(build_dapq_evict_kernel(H, N, T_, D, "float32", **params, **site), st,
                   EVICT_ARGS + ["q", "score"])["score"]
    got = run_opencl(build_dapq_evict_kernel_gpu(H, N, T_, D, "float32", **params, **site), st)["score"]
    n = min(nf, N) + nv
    assert n > N  # the scores are read
    np.testing.assert_allclose(got[:, :n], want[:, :n], rtol=1e-5, atol=1e-6)
    assert np.all(got[:, n:] == -np.inf)
