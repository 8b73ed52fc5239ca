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


# ---- the graph rewrite (passes/norm_gemv.py) and the profile choice, on the tiny model's decode ----

@functools.lru_cache(maxsize=None)
def _lowered_decode():
    """The tiny model's q4 GPU decode function as the GPU branch of the pipeline gets it
    (combined projections, FuseGateUpSiLU, FuseForGPU), before FuseNormIntoGEMV."""
    from edgekv.compiler import pipeline as P
    from edgekv.compiler.backend.target import CompileTarget
    from edgekv.compiler.passes.gate_up_silu import FuseGateUpSiLU
    from edgekv.compiler.passes.gpu_fusion import FuseForGPU
    from edgekv.models import tiny_random_model
    from edgekv.policies import make_policy

    model, tgt = tiny_random_model(0), CompileTarget.resolve("opencl-host")
    spec = P.block_cache_spec(make_policy("keydiff"), 64, cores=tgt.cores)
    low = P.lower(model, spec, 32)
    P.lay_out_weights(low, model, "q4", tgt.cores, tgt.weight_layout)
    P.combine_projections(low)
    return FuseForGPU(["decode"])(FuseGateUpSiLU(["decode"])(low.mod)), model.config.num_layers


def test_pass_fuses_every_layers_norms_and_rope():
    from edgekv.compiler.passes.norm_gemv import FuseNormIntoGEMV

    mod, layers = _lowered_decode()
    fuse = FuseNormIntoGEMV(["decode"])
    new = fuse(mod)
    assert fuse.fused == {"norm_qkv_rope": layers, "norm_gate_up_silu": layers}
    text = new["decode"].script()
    # RoPE's chain (its negative half), the v copy's slices and every layer norm but the final one are gone
    assert "R.negative" not in text and "R.strided_slice" not in text
    assert text.count("R.nn.rms_norm") == 1
    kernels = [gv.name_hint for gv in new.get_global_vars()]
    assert any(k.startswith("norm_qkv_rope_q4_") for k in kernels)
    assert not any(k.startswith("gate_up_silu_") for k in kernels)  # replaced, and dropped as unused


def test_pass_leaves_a_norm_with_another_use():
    """A norm output read by anything besides the GEMV stays (folding it would compute it twice)."""
    from tvm import relax

    from edgekv.compiler.passes.norm_gemv import FuseNormIntoGEMV

    mod, _ = _lowered_decode()
    func = mod["decode"]
    norms = [b.var for blk in func.body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.nn.rms_norm"]
    # return the first layer's input norm too: it gains a use outside the GEMV
    out = relax.Tuple([func.body.body, norms[0]]) if not isinstance(func.body.body, relax.Tuple) else \
        relax.Tuple([*func.body.body.fields, norms[0]])
    body = relax.BlockBuilder().normalize(relax.SeqExpr(func.body.blocks, out))
    changed = tvm.IRModule({**{gv: f for gv, f in mod.functions.items() if gv.name_hint != "decode"},
                            mod.get_global_var("decode"): relax.Function(func.params, body, None, func.is_pure,
                                                                           func.attrs)})
    fuse = FuseNormIntoGEMV(["decode"])
    fuse(changed)
    layers = _lowered_decode()[1]
    assert fuse.fused["norm_qkv_rope"] == layers - 1


def test_fusions_are_a_profile_choice():
    from edgekv.compiler.backend.gpu_schedule import fusions_of
    from edgekv.compiler.backend.gpu_schedule import GPUKernelError

    assert fusions_of({}) == {"gate_up_silu": True, "norm_gemv": True}
    assert fusions_of({"gpu_schedule": {"gate_up_silu": False}}) == {"gate_up_silu": False, "norm_gemv": True}
    with pytest.raises(GPUKernelError, match="gpu_schedule.norm_gemv must be true or false"):
        fusions_of({"name": "x", "gpu_schedule": {"norm_gemv": "yes"}})
