"""The work-group-parallel GPU kernels (issue 35: decode used one work-group per KV head, or one
for all heads) on PoCL, against their CPU twins: the key-parallel block attention
(``kernels/attention.py``, decode and block steps, DapQ's pseudo rows), the split KeyDiff score
(``policy_kernels/keydiff.py``) and the head-parallel select (``kernels/select.py``); and the launch
shapes (work-groups × threads) that make them parallel.

Needs pyopencl and an OpenCL device (``apt-get install pocl-opencl-icd``; pyopencl is in the dev
extra); skips, saying so, without them."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
cl = pytest.importorskip("pyopencl")

from edgekv.compiler.kernels import attention  # noqa: E402
from edgekv.compiler.kernels.attention import build_block_attention_kernel_gpu  # noqa: E402
from edgekv.compiler.policy_kernels.keydiff import (build_keydiff_evict_kernel,  # noqa: E402
                                                    build_keydiff_evict_kernel_gpu)


def _context():
    try:
        for plat in cl.get_platforms():
            if plat.get_devices():
                return cl.Context([plat.get_devices()[0]])
    except Exception:  # noqa: BLE001 - no ICD loader / platform
        return None
    return None


CTX = _context()
pytestmark = pytest.mark.skipif(CTX is None, reason="needs an OpenCL device (apt-get install pocl-opencl-icd)")
# PoCL's optimiser miscompiles some barrier loops (device_tests/test_gpu_kernels_opencl.py): both forms
OPTIONS = ["", "-cl-opt-disable"]


def launch_shapes(func) -> list[tuple[int, int]]:
    """(work-groups, threads per work-group) of each launch of a thread-bound kernel."""
    out: list[list[int]] = []
    for ext, tag in re.findall(r'T\.thread_binding\((\d+), thread="(\w+\.\w)"\)', func.script()):
        if tag == "blockIdx.x":
            out.append([int(ext), 1])
        else:
            out[-1][1] *= int(ext)
    return [tuple(x) for x in out]


@functools.lru_cache(maxsize=None)
def _compiled(func, options):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"}))
    src = lib.mod.imports[0].inspect_source()
    defs = [(name, [re.search(r"(\w+)_ptr$", p.strip()).group(1) for p in params.split(",")])
            for name, params in re.findall(r"__kernel void (\w+)\(([^)]*)\)\s*\{", src)]
    return cl.Program(CTX, src).build(options=options), defs


def run_opencl(func, arrays, options=""):
    prog, defs = _compiled(func, options)
    shapes = launch_shapes(func)
    assert len(defs) == len(shapes)
    queue = cl.CommandQueue(CTX)
    mf = cl.mem_flags
    bufs = {k: cl.Buffer(CTX, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(v))
            for k, v in arrays.items()}
    for (name, args), (groups, threads) in zip(defs, shapes):
        getattr(prog, name)(queue, (groups * threads,), (threads,), *[bufs[a] for a in args])
    out = {k: np.empty_like(v) for k, v in arrays.items()}
    for k, v in out.items():
        cl.enqueue_copy(queue, v, bufs[k])
    queue.finish()
    return out


def run_cpu(func, arrays, names):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    ts = [tvm.runtime.tensor(np.ascontiguousarray(arrays[n])) for n in names]
    lib["main"](*ts)
    return {n: t.numpy() for n, t in zip(names, ts)}


def _cache(H, N, B, D, nf, nv, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((H, N, D)).astype("float32")
    v = rng.standard_normal((H, N, D)).astype("float32")
    k[:, nf:] = 0  # the runtime zero-initialises the cache: rows past fill are finite
    v[:, nf:] = 0
    return {"k_cache": k, "v_cache": v, "pos_cache": np.tile(np.arange(N, dtype="int32"), (H, 1)),
            "fill": np.array([nf], "int32"),
            "k_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
            "v_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
            "pos_blk": np.arange(N + 100, N + 100 + B, dtype="int32"), "n_valid": np.array([nv], "int32")}


ATTN_NAMES = ["q", "k_blk", "v_blk", "k_cache", "v_cache", "fill", "n_valid", "out"]

# (Hq, H, N, B, D, W, fill, n_valid): decode (B = 1) over empty / partial / full caches and more
# keys than a chunk of 256 (N = 600); block steps with padding rows; DapQ's pseudo rows; D = 16
ATTN_CASES = [
    (9, 3, 40, 1, 64, 0, 0, 1), (9, 3, 40, 1, 64, 0, 17, 1), (9, 3, 600, 1, 64, 0, 600, 1),
    (4, 2, 300, 1, 16, 0, 299, 1), (6, 2, 40, 8, 64, 0, 23, 5), (9, 3, 300, 16, 64, 0, 300, 16),
    (4, 2, 40, 8, 16, 3, 12, 3), (2, 1, 37, 12, 64, 4, 37, 8),
]


@pytest.mark.parametrize("case", ATTN_CASES, ids=[f"Hq{c[0]}H{c[1]}N{c[2]}B{c[3]}D{c[4]}W{c[5]}f{c[6]}v{c[7]}"
                                                  for c in ATTN_CASES])
@pytest.mark.parametrize("options", OPTIONS, ids=["opt", "noopt"])
def test_key_parallel_attention_matches_the_cpu_kernel(case, options):
    Hq, H, N, B, D, W, nf, nv = case
    st = _cache(H, N, B, D, nf, nv, 1)
    rng = np.random.default_rng(2)
    arr = {"q": rng.standard_normal((1, Hq, B, D)).astype("float32"), "k_blk": st["k_blk"], "v_blk": st["v_blk"],
           "k_cache": st["k_cache"], "v_cache": st["v_cache"], "fill": st["fill"], "n_valid": st["n_valid"],
           "out": np.full((1, Hq, B, D), 7.0, "float32")}
    want = run_cpu(attention.build_block_attention_kernel(Hq, H, N, B, D, D ** -0.5, extra_rows=W), arr,
                   ATTN_NAMES)["out"]
    func = build_block_attention_kernel_gpu(Hq, H, N, B, D, D ** -0.5, extra_rows=W, key_parallel=True)
    got = run_opencl(func, arr, options)["out"]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_decode_attention_spreads_over_work_groups():
    """SmolLM2's decode step (Hq 9, H 3, N 512, B 1, d 64): one work-group per query row (9) of 256
    threads, against 3 work-groups of 3 × 32 threads each streaming all 513 keys before."""
    dec = build_block_attention_kernel_gpu(9, 3, 512, 1, 64, 0.125)
    assert launch_shapes(dec) == [(9, 256)]
    old = build_block_attention_kernel_gpu(9, 3, 512, 1, 64, 0.125, key_parallel=False)
    assert launch_shapes(old) == [(3, 96)]


SCORE_NAMES = ["k_cache", "v_cache", "pos_cache", "fill", "k_blk", "v_blk", "pos_blk", "n_valid", "score"]
# (H, N, B, D, fill, n_valid, recent): decode over more candidates than a work-group's 256 (N + B not
# a multiple of it), block steps, the recent window, D = 16
# head dim 8 is not a multiple of the 16 lanes: the thread-per-row fallback
SCORE_CASES = [(3, 512, 1, 64, 512, 1, 0), (3, 300, 8, 64, 300, 5, 0), (2, 40, 8, 16, 37, 8, 3),
               (3, 512, 1, 64, 512, 1, 4), (1, 600, 128, 64, 600, 100, 0), (2, 40, 8, 8, 37, 8, 0)]


@pytest.mark.parametrize("case", SCORE_CASES, ids=[f"H{c[0]}N{c[1]}B{c[2]}D{c[3]}f{c[4]}v{c[5]}r{c[6]}"
                                                   for c in SCORE_CASES])
@pytest.mark.parametrize("options", OPTIONS, ids=["opt", "noopt"])
def test_split_keydiff_score_matches_the_cpu_kernel(case, options):
    H, N, B, D, nf, nv, recent = case
    st = _cache(H, N, B, D, nf, nv, 3)
    st["score"] = np.full((H, N + B), 5.0, "float32")
    want = run_cpu(build_keydiff_evict_kernel(H, N, B, D, "float32", recent=recent), st, SCORE_NAMES)["score"]
    got = run_opencl(build_keydiff_evict_kernel_gpu(H, N, B, D, "float32", recent=recent), st, options)["score"]
    n = nf + nv
    np.testing.assert_allclose(got[:, :n], want[:, :n], rtol=1e-5, atol=1e-6)
    assert np.all(got[:, n:] == -np.inf)


def test_keydiff_score_spreads_over_work_groups():
    """SmolLM2's decode step (H 3, N 512, B 1, d 64): 3 × 3 work-groups of 256 threads (3 × 128
    threads before)."""
    assert launch_shapes(build_keydiff_evict_kernel_gpu(3, 512, 1, 64)) == [(9, 256)]
