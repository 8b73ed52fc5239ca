"""passes/combine_projections.py (GPU builds): sibling matmuls reading one activation (q, k, v; gate,
up) become one matmul over their weights concatenated along the output dimension, and each result
a slice of its output — for quantised row-blocked weights (q4, q8) and fp32 Wᵀ — with the stored
arrays concatenated to match; the values stay those of the original function (run on the host)."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from edgekv.compiler.kernels.quant_dense import build_gpu_quant_matmul, gpu_row_shapes  # noqa: E402
from edgekv.compiler.passes.combine_projections import CombineProjections, combine_params  # noqa: E402
from edgekv.compiler.quant_formats import Q4_1, Q8_0  # noqa: E402

K = 64
NS = {"q": 64, "k": 32, "v": 32}


def weight_inputs(fmt, name, n):
    if fmt is None:
        return [relax.Var(f"{name}.weight.T", relax.TensorType((K, n), "float32"))]
    return [relax.Var(f"{name}.weight.{fmt.name}r.{part}", relax.TensorType(s, dt))
            for part, (s, dt) in zip("qdm", gpu_row_shapes(fmt, K, n))]


def qkv_module(fmt, *, extra_use: bool = False) -> tvm.IRModule:
    """``q, k, v = x·Wq, x·Wk, x·Wv`` (each matmul reads its own reshape of x, as torch.export
    writes it), returned as ``q + k·v`` sums so every output is used; ``extra_use``: Wk is also
    read elsewhere (then nothing may be combined)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    ws = {name: weight_inputs(fmt, name, n) for name, n in NS.items()}
    with bb.function("decode", [x, *[w for v in ws.values() for w in v]], attrs={"num_input": 1}):
        with bb.dataflow():
            outs = {}
            for name, n in NS.items():
                x2 = bb.emit(relax.op.reshape(x, (1, K)))
                if fmt is None:
                    y = bb.emit(relax.op.matmul(x2, ws[name][0]))
                else:
                    f = bb.add_func(build_gpu_quant_matmul((1, K), fmt, K, n), f"matmul_{fmt.name}_gemv_m1_k{K}_n{n}_gpu")
                    y = bb.emit(relax.call_tir(f, [x2, *ws[name]], relax.TensorType((1, n), "float32")))
                outs[name] = y
            kv = bb.emit(relax.op.multiply(outs["k"], outs["v"]))
            res = [outs["q"], kv]
            if extra_use:
                res.append(bb.emit(relax.op.sum(ws["k"][0])))
            out = bb.emit_output(relax.Tuple(res))
        bb.emit_func_output(out)
    return bb.get()


def random_params(mod, rng):
    params = []
    for p in mod["decode"].params[1:]:
        s, dt = tuple(int(v) for v in p.ty.shape), str(p.ty.dtype)
        if dt == "float32":
            a = (rng.standard_normal(s) * 0.1).astype("float32")
        else:
            a = rng.integers(-128 if dt == "int8" else 0, 128 if dt == "int8" else 256, s).astype(dt)
        params.append((p.name, a))
    return params


def run_on_host(mod, x, params):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["decode"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(a) for _, a in params])
    return [out[i].numpy() for i in range(len(out))]


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0, None], ids=["q4", "q8", "fp32"])
def test_siblings_become_one_matmul_with_the_same_values(fmt):
    mod = qkv_module(fmt)
    combiner = CombineProjections(["decode"])
    new = combiner(mod)
    assert combiner.combined == 3
    parts = 1 if fmt is None else len(gpu_row_shapes(fmt, K, 1))
    assert len(combiner.groups) == 1 and len(combiner.groups[0][1]) == parts
    assert combiner.groups[0][1][0].startswith("q_k_v.weight")
    text = new["decode"].script()
    assert text.count("R.strided_slice") == 3
    if fmt is None:
        assert text.count("R.matmul") == 1
    else:
        prims = [gv.name_hint for gv, f in new.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
        assert prims == [f"matmul_{fmt.name}_gemv_m1_k{K}_n128_gpu"], prims

    rng = np.random.default_rng(0)
    params = random_params(mod, rng)
    stored = combine_params(params, combiner.groups)
    assert [n for n, _ in stored] == [p.name for p in new["decode"].params[1:]]
    for (n, a), p in zip(stored, new["decode"].params[1:]):
        assert a.shape == tuple(int(v) for v in p.ty.shape), n
    x = rng.standard_normal((1, 1, K)).astype("float32")
    for got, want in zip(run_on_host(new, x, stored), run_on_host(mod, x, params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_weight_with_another_use_is_not_combined():
    combiner = CombineProjections(["decode"])
    new = combiner(qkv_module(Q4_1, extra_use=True))
    assert combiner.combined == 0 and combiner.groups == []
    assert "R.strided_slice" not in new["decode"].script()


def test_decode_gate_up_and_silu_become_one_kernel():
    """After the combine, the decode MLP's combined gate / up GEMV, its two slices and
    SiLU(gate) · up become one scheduled kernel (``passes/gate_up_silu.py``; its values are checked
    on PoCL by tests/test_quantized.py::test_opencl_q4_artifact_agrees_with_cpu_q4)."""
    from edgekv.compiler.passes.gate_up_silu import FuseGateUpSiLU

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    ws = {name: weight_inputs(Q4_1, name, 128) for name in ("gate", "up")}
    with bb.function("decode", [x, *ws["gate"], *ws["up"]], attrs={"num_input": 1}):
        with bb.dataflow():
            ys = {}
            for name in ("gate", "up"):
                x2 = bb.emit(relax.op.reshape(x, (1, K)))
                f = bb.add_func(build_gpu_quant_matmul((1, K), Q4_1, K, 128), f"matmul_q4_gemv_m1_k{K}_n128_gpu")
                y = bb.emit(relax.call_tir(f, [x2, *ws[name]], relax.TensorType((1, 128), "float32")))
                ys[name] = bb.emit(relax.op.reshape(y, (1, 1, 128)))
            silu = bb.emit(relax.op.multiply(ys["gate"], relax.op.sigmoid(ys["gate"])))
            out = bb.emit_output(relax.op.multiply(silu, ys["up"]))
        bb.emit_func_output(out)
    combined = CombineProjections(["decode"])(bb.get())
    fuse = FuseGateUpSiLU(["decode"])
    new = fuse(combined)
    assert fuse.fused == 1
    text = new["decode"].script()
    assert "R.sigmoid" not in text and "R.strided_slice" not in text and text.count("R.call_tir") == 1
    kernel = next(f for gv, f in new.functions.items() if gv.name_hint.startswith("gate_up_silu"))
    assert 'threadIdx.x' in kernel.script() and 'blockIdx.x' in kernel.script()
