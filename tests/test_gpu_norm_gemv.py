"""The fused decode kernels of ``kernels/norm_gemv.py`` on PoCL against numpy: RMSNorm + the combined
q / k / v GEMV + RoPE (q and k rotated, v copied, each in the attention's ``[1, heads, 1, d]``
layout) and RMSNorm + the combined gate / up GEMV + SiLU · up, for q4 and q8 rows, with K not a
multiple of the work-group's 64 work-items. Each is one launch of more than one work-item.

Needs pyopencl and an OpenCL device (``apt-get install pocl-opencl-icd``); skips, saying so."""

from __future__ import annotations

import functools

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
cl = pytest.importorskip("pyopencl")

from edgekv.compiler.kernels.norm_gemv import build_norm_gate_up_silu_gpu, build_norm_qkv_rope_gpu  # noqa: E402
from edgekv.compiler.kernels.quant_dense import gpu_row_shapes  # noqa: E402
from edgekv.compiler.quant_formats import Q4_1, Q8_0  # noqa: E402
from tools.bench.bench_gpu_select import opencl_program  # noqa: E402


def _device():
    try:
        for plat in cl.get_platforms():
            if plat.get_devices():
                return plat.get_devices()[0]
    except Exception:  # noqa: BLE001 - no ICD loader / platform
        return None
    return None


DEVICE = _device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs an OpenCL device (apt-get install pocl-opencl-icd)")
EPS = 1e-5


@functools.lru_cache(maxsize=None)
def _context():
    return cl.Context([DEVICE])


def _weights(fmt, K, N, rng):
    shapes = gpu_row_shapes(fmt, K, N)
    q = rng.integers(0, 256, shapes[0][0]).astype(shapes[0][1]) if fmt.bits == 4 else \
        rng.integers(-127, 128, shapes[0][0]).astype("int8")
    arrays = [q, (rng.random(shapes[1][0]) * 0.05).astype("float32")]
    if fmt.has_min:
        arrays.append((rng.random(shapes[2][0]) * -0.02).astype("float32"))
    return arrays


def _dequant(fmt, arrays, K):
    q, d = arrays[0], arrays[1]
    k = np.arange(K)
    if fmt.bits == 4:
        nib = (q[:, k // 2] >> (k % 2 * 4).astype("uint8")) & 15
        return nib.astype("float32") * d[:, k // 32] + arrays[2][:, k // 32]
    return q[:, k].astype("float32") * d[:, k // 32]


def _run(func, inputs: dict, outputs: dict):
    prog, kernels, launches = opencl_program(func, _context(), "")
    assert len(kernels) == len(launches) == 1, (kernels, launches)
    (groups, local), = launches
    assert local > 1 and groups > 1  # never a single work-item
    queue = cl.CommandQueue(_context())
    mf = cl.mem_flags
    bufs = {k: cl.Buffer(_context(), mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(v))
            for k, v in {**inputs, **outputs}.items()}
    name, args = kernels[0]
    kernel = cl.Kernel(prog, name)
    for i, a in enumerate(args):
        kernel.set_arg(i, bufs[a])
    cl.enqueue_nd_range_kernel(queue, kernel, (groups * local,), (local,))
    out = {}
    for k, v in outputs.items():
        out[k] = np.empty_like(v)
        cl.enqueue_copy(queue, out[k], bufs[k])
    queue.finish()
    return out


def _normed(a, nw):
    x = a.reshape(-1).astype("float64")
    return x / np.sqrt((x * x).mean() + EPS) * nw


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=["q4", "q8"])
@pytest.mark.parametrize("K,Hq,H,D", [(96, 4, 2, 16), (64, 3, 1, 8), (200, 2, 2, 32)])
def test_norm_qkv_rope_matches_numpy(fmt, K, Hq, H, D):
    rng = np.random.default_rng(K + Hq)
    N = (Hq + 2 * H) * D
    ws = _weights(fmt, K, N, rng)
    a = rng.standard_normal((1, 1, K)).astype("float32")
    nw = (1 + 0.1 * rng.standard_normal(K)).astype("float32")
    ang = rng.random(D // 2) * 3
    cos = np.cos(np.concatenate([ang, ang])).astype("float32").reshape(1, 1, 1, D)
    sin = np.sin(np.concatenate([ang, ang])).astype("float32").reshape(1, 1, 1, D)
    names = ["q", "d", "m"][:len(ws)]
    func = build_norm_qkv_rope_gpu(fmt, K, Hq, H, D, EPS)
    outs = {n: np.zeros(s, "float32") for n, s in (("o1", (1, Hq, 1, D)), ("o2", (1, H, 1, D)), ("o3", (1, H, 1, D)))}
    got = _run(func, {"a": a, "nw": nw, **dict(zip(names, ws)), "cos": cos, "sin": sin}, outs)

    y = _dequant(fmt, ws, K).astype("float64") @ _normed(a, nw)
    c, s = cos.reshape(D).astype("float64"), sin.reshape(D).astype("float64")

    def rope(x):  # x [heads, D]: HF's x·cos + rotate_half(x)·sin
        return x * c + np.concatenate([-x[:, D // 2:], x[:, :D // 2]], axis=1) * s

    want_q = rope(y[:Hq * D].reshape(Hq, D))
    want_k = rope(y[Hq * D:(Hq + H) * D].reshape(H, D))
    want_v = y[(Hq + H) * D:].reshape(H, D)
    for key, want in (("o1", want_q), ("o2", want_k), ("o3", want_v)):
        np.testing.assert_allclose(got[key].reshape(want.shape), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=["q4", "q8"])
@pytest.mark.parametrize("K,I", [(96, 40), (64, 128)])
def test_norm_gate_up_silu_matches_numpy(fmt, K, I):
    rng = np.random.default_rng(K + I)
    ws = _weights(fmt, K, 2 * I, rng)
    a = rng.standard_normal((1, 1, K)).astype("float32")
    nw = (1 + 0.1 * rng.standard_normal(K)).astype("float32")
    names = ["q", "d", "m"][:len(ws)]
    func = build_norm_gate_up_silu_gpu(fmt, K, I, EPS)
    got = _run(func, {"a": a, "nw": nw, **dict(zip(names, ws))}, {"o1": np.zeros((1, 1, I), "float32")})
    y = _dequant(fmt, ws, K).astype("float64") @ _normed(a, nw)
    g, u = y[:I], y[I:]
    np.testing.assert_allclose(got["o1"].reshape(I), g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-4)
