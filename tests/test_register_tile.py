"""The CPU GEMMs' register tile (``kernels/register_tile.py``): sized from the target's vector
registers, and the results the same bits whichever tile a target gets (the sum over k runs in order)."""

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from edgekv.compiler.kernels.register_tile import (AVX2, AVX512, NEON, SSE, subpanel_cols, tile_rows,  # noqa: E402
                                                   vector_registers)

TARGETS = {"avx2": {"kind": "llvm", "mcpu": "znver3"}, "avx512": {"kind": "llvm", "mcpu": "skylake-avx512"},
           "android-cpu": {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon"]},
           "generic-x86": {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}}


def test_each_cpu_gets_its_register_file_and_a_tile_that_fits_it():
    expected = {"avx2": AVX2, "avx512": AVX512, "android-cpu": NEON, "generic-x86": SSE}
    for name, spec in TARGETS.items():
        target = tvm.target.Target(spec)
        regs = vector_registers(target)
        assert regs == expected[name], name
        with target:  # the pipeline enters the target around the weight layout
            assert vector_registers() == regs
        for M, NR in ((128, 64), (126, 64), (13, 16), (1, 32)):
            ns = subpanel_cols(NR, regs)
            mr = tile_rows(M, ns, regs)
            assert NR % ns == 0 and M % mr == 0
            assert mr * max(1, ns // regs.lanes) <= regs.accumulators, (name, M, NR, mr, ns)
    # AVX2: 6 × 16 (12 of the 16 ymm), where M allows; AVX-512 8 × 32
    assert (tile_rows(126, subpanel_cols(64, AVX2), AVX2), subpanel_cols(64, AVX2)) == (6, 16)
    assert (tile_rows(128, subpanel_cols(64, AVX512), AVX512), subpanel_cols(64, AVX512)) == (8, 32)


@pytest.mark.parametrize("fmt_name", ["fp32", "Q4_1"])
def test_gemm_results_do_not_depend_on_the_tile(fmt_name):
    """The fp32 and Q4_1 GEMMs built for AVX2's, AVX-512's, NEON's and SSE's tiles (run here) give the same
    bits: only the blocking changes, never the order of the sum over k."""
    from edgekv.compiler import quant_formats as qf
    from edgekv.compiler.kernels import dense, quant_dense

    # K not a multiple of the K block; Q4_1 with a tail panel (fp32 panels are whole); tiles 5 × 16, 8 × 32, 2 × 16
    M, K, N, NR = 40, 96, (96 if fmt_name == "fp32" else 80), 32
    rng = np.random.default_rng(3)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    if fmt_name == "fp32":
        args, w_used = [dense.pack_weight(w, NR)], w
    else:
        blocks = qf.quantize(w.T.copy(), qf.Q4_1)
        args, w_used = qf.panel_arrays(blocks, NR), blocks.dequantize().T
    host = tvm.target.Target({"kind": "llvm"})
    outs = {}
    for name in ("avx2", "avx512", "android-cpu", "generic-x86"):
        with tvm.target.Target(TARGETS[name]):
            f = (dense.build_dense_kernel((M, K), (K, N), (M, N), 1, packed_nr=NR) if fmt_name == "fp32"
                 else quant_dense.build_quant_gemm_kernel((M, K), (M, N), qf.Q4_1, K, N, NR))
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=host)
        out = tvm.runtime.tensor(np.full((M, N), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(a) for a in args], out)
        outs[name] = out.numpy()
    ref = x.astype(np.float64) @ w_used.astype(np.float64)
    np.testing.assert_allclose(outs["avx2"], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    for name in ("avx512", "android-cpu", "generic-x86"):
        assert np.array_equal(outs[name].view(np.uint32), outs["avx2"].view(np.uint32)), name
