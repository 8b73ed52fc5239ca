"""passes/gpu_fusion.py (GPU builds): HF's RMSNorm chain becomes one ``nn.rms_norm``, and a quantised
GPU matmul between two reshapes takes the activation's own shape, so that FuseOps puts the residual
add into its epilogue — on a small hand-built Relax function shaped like one decoder step, and the
values stay those of the original function (run on the host)."""

from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from edgekv.compiler.kernels.quant_dense import build_gpu_quant_matmul, gpu_row_shapes  # noqa: E402
from edgekv.compiler.passes.gpu_fusion import FuseForGPU  # noqa: E402
from edgekv.compiler.quant_formats import Q4_1  # noqa: E402

K, N = 64, 64


def step_module() -> tvm.IRModule:
    """``out = x + W · rms_norm(x)`` written as torch.export writes it (reshapes around the matmul)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    w = relax.Var("norm_w", relax.TensorType((K,), "float32"))
    q, d, m = (relax.Var(n, relax.TensorType(s, dt)) for n, (s, dt) in zip("qdm", gpu_row_shapes(Q4_1, K, N)))
    gemv = bb.add_func(build_gpu_quant_matmul((1, K), Q4_1, K, N), "matmul_q4_gemv_m1_k64_n64_gpu")
    with bb.function("decode", [x, w, q, d, m], attrs={"num_input": 1}):
        with bb.dataflow():
            sq = bb.emit(relax.op.power(x, relax.const(2.0, "float32")))
            mean = bb.emit(relax.op.mean(sq, axis=[-1], keepdims=True))
            r = bb.emit(relax.op.rsqrt(relax.op.add(mean, relax.const(1e-5, "float32"))))
            normed = bb.emit(relax.op.multiply(w, relax.op.multiply(x, r)))
            x2 = bb.emit(relax.op.reshape(normed, (1, K)))
            y2 = bb.emit(relax.call_tir(gemv, [x2, q, d, m], relax.TensorType((1, N), "float32")))
            y3 = bb.emit(relax.op.reshape(y2, (1, 1, N)))
            out = bb.emit_output(relax.op.add(x, y3))
        bb.emit_func_output(out)
    return bb.get()


def run_on_host(mod, args):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["decode"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_fusion_rewrites_and_keeps_the_values():
    mod = step_module()
    fusion = FuseForGPU(["decode"])
    new = fusion(mod)
    assert fusion.folded == {"matmul_reshapes": 1, "rms_norms": 1}
    text = new["decode"].script()
    assert "R.nn.rms_norm" in text and "R.power" not in text and "R.reshape" not in text
    # the old 2-D kernel is gone, the 3-D one stays
    prims = [gv.name_hint for gv, f in new.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(prims) == 1, prims

    rng = np.random.default_rng(0)
    shapes = gpu_row_shapes(Q4_1, K, N)
    args = [rng.standard_normal((1, 1, K)).astype("float32"), rng.standard_normal(K).astype("float32"),
            rng.integers(0, 256, shapes[0][0]).astype("uint8"),
            (rng.random(shapes[1][0]) * 0.1).astype("float32"), (rng.random(shapes[2][0]) * -0.05).astype("float32")]
    np.testing.assert_allclose(run_on_host(new, args), run_on_host(mod, args), rtol=1e-5, atol=1e-5)


def test_fusion_leaves_a_matmul_whose_output_has_other_uses():
    """A matmul whose 2-D output is used beyond the reshape keeps its shape (nothing to gain)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    q, d, m = (relax.Var(n, relax.TensorType(s, dt)) for n, (s, dt) in zip("qdm", gpu_row_shapes(Q4_1, K, N)))
    gemv = bb.add_func(build_gpu_quant_matmul((1, K), Q4_1, K, N), "matmul_q4_gemv_m1_k64_n64_gpu")
    with bb.function("decode", [x, q, d, m], attrs={"num_input": 1}):
        with bb.dataflow():
            x2 = bb.emit(relax.op.reshape(x, (1, K)))
            y2 = bb.emit(relax.call_tir(gemv, [x2, q, d, m], relax.TensorType((1, N), "float32")))
            y3 = bb.emit(relax.op.reshape(y2, (1, 1, N)))
            out = bb.emit_output(relax.Tuple([y2, y3]))
        bb.emit_func_output(out)
    fusion = FuseForGPU(["decode"])
    fusion(bb.get())
    assert fusion.folded == {"matmul_reshapes": 0, "rms_norms": 0}


def test_block_attention_is_the_profiles_choice():
    """``gpu_schedule.block_attention`` picks a block step's attention kernel (key-parallel by default:
    256 threads a work-group splitting the keys; or row-tiled); decode is key-parallel either way;
    an unknown choice is refused naming the known ones."""
    from edgekv.compiler.backend.gpu_schedule import BLOCK_ATTENTION, GPUKernelError, block_attention_of, gpu_kernel_for
    from edgekv.compiler.kernels.attention import build_block_attention_kernel

    assert block_attention_of({"name": "p"}) == "key-parallel"
    assert block_attention_of({"gpu_schedule": {"block_attention": "row-tiled"}}) == "row-tiled"
    with pytest.raises(GPUKernelError, match="key-parallel, row-tiled"):
        block_attention_of({"name": "p", "gpu_schedule": {"block_attention": "fastest"}})

    def threads(B, choice):
        cpu = build_block_attention_kernel(4, 2, 24, B, 16, 0.25)
        gpu = gpu_kernel_for("step_attention_h4_2_d16", cpu, "keydiff", {}, {(4, 2, 16): 0.25}, choice)
        return re.findall(r'T\.thread_binding\((\d+), thread="threadIdx\.x"\)', gpu.script())

    assert set(BLOCK_ATTENTION) == {"row-tiled", "key-parallel"}
    assert threads(8, "key-parallel") == ["256"] and threads(8, "row-tiled") != ["256"]
    assert threads(1, "row-tiled") == threads(1, "key-parallel") == ["256"]


def test_gemv_schedule_is_the_profiles_choice():
    """``gpu_schedule.gemv`` in a target profile picks the GEMV rule; each choice binds the q4 GEMV to
    GPU threads; an unknown choice is refused naming the known ones."""
    from edgekv.compiler.backend.gpu_schedule import (GEMV_SCHEDULES, GPUKernelError, default_schedule,
                                                      gemv_schedule_of, unbound_functions)
    from edgekv.compiler.backend.target import resolve_target

    assert gemv_schedule_of(resolve_target("opencl-host")[0]) in GEMV_SCHEDULES
    assert gemv_schedule_of({"name": "p"}) == "dlight-gemv"
    with pytest.raises(GPUKernelError, match="rows-64"):
        gemv_schedule_of({"name": "p", "gpu_schedule": {"gemv": "fastest"}})
    target = tvm.target.Target({"kind": "opencl", "max_num_threads": 256, "thread_warp_size": 1})
    for choice in GEMV_SCHEDULES:
        mod = tvm.IRModule({"gemv": build_gpu_quant_matmul((1, 1, K), Q4_1, K, N).with_attr("global_symbol", "gemv")})
        with target:
            scheduled = default_schedule(choice)(mod)
        assert unbound_functions(scheduled) == [], choice
