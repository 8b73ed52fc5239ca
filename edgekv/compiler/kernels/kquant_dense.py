"""CPU kernels over the GGUF formats kept as they are (``kquant_formats.py``: Q4_K, Q6_K, Q5_0
column panels), the dequantisation fused in:

* **GEMM** (prefill): per NR-wide panel (one parallel task each), the panel dequantised into an
  fp32 buffer (``weight`` below: gguf's operations in gguf's order, so each weight equals
  ``gguf.quants.dequantize`` bit for bit) laid out as NR / NS sub-panels of K × NS, then the
  target's MR × NS register tile over K blocks (``register_tile.py``: 6 × 16 on AVX2, 12 ymm
  accumulators, no spills). The sum over k runs in order, as the fp32 GEMM's.
* **GEMV** (decode): per 32-group and 16 columns at a time, lanes accumulate Σ x·(q − offset)
  for each half (16 weights), then acc += S·that (− M·Σx for Q4_K): S = d·sc per sub-block
  (exact in fp32: an fp16 times a byte), one FMA and one conversion per weight (compute-bound:
  docs/COMPILER.md, "K-quant kernel schedule").

``build_kquant_dequant_kernel`` writes the GEMM's dequantised panels out: the bit-exactness test
runs it against gguf.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..kquant_formats import KFormat, kpanel_shapes
from ..quant_formats import padded
from .common import panel_store
from .dense import VEC
from .quant_dense import _check_rows
from .register_tile import panel_gemm, subpanel_cols, tile_rows


def _geometry(fmt: KFormat, K: int, N: int, NR: int):
    if NR % VEC:
        raise ValueError(f"panel width {NR} is not a multiple of {VEC}")
    if K % fmt.k_multiple:
        raise ValueError(f"{fmt.ggml} needs K a multiple of {fmt.k_multiple}, got {K}")
    # HB: bytes of high bits per 32-group (16 for a format without them: one i2 step)
    return padded(N, NR) // NR, K // 32, (4 * fmt.hbits if fmt.hbits else 16)


def _f32(v):
    return tirx.Cast("float32", v)


def _quant(fmt: KFormat, QL, QH, jo, g, h, i2, i1, j, HB):
    """q − offset (float32) of quant h·16 + i2·HB + i1 of 32-group g, lane j."""
    b = QL[jo, g * 16 + i2 * HB + i1, j]
    lo = tirx.bitwise_and(tirx.shift_right(b, tirx.Cast("uint8", h * 4)), tirx.const(15, "uint8"))
    if fmt.hbits:
        shift = tirx.Cast("uint8", (h * (16 // HB) + i2) * fmt.hbits)
        hi = tirx.bitwise_and(tirx.shift_right(QH[jo, g * HB + i1, j], shift), tirx.const((1 << fmt.hbits) - 1, "uint8"))
        lo = tirx.bitwise_or(lo, tirx.shift_left(hi, tirx.const(4, "uint8")))
    if fmt.offset:
        return _f32(tirx.Cast("int32", lo) - fmt.offset)
    return _f32(lo)


def _scale(fmt: KFormat, SC, D, jo, sb, k0, j):
    """S of sub-block sb (k0: a column inside it): d·sc, or the block's own d."""
    if fmt.superblock:
        return _f32(D[jo, k0 // fmt.superblock, j]) * _f32(SC[jo, sb, j])
    return _f32(D[jo, sb, j])


def _min(fmt: KFormat, MN, DM, jo, sb, k0, j):
    return _f32(DM[jo, k0 // fmt.superblock, j]) * _f32(MN[jo, sb, j])


def weight(fmt: KFormat, QL, QH, SC, MN, D, DM, jo, g, h, i2, i1, j, HB):
    """The weight, as gguf computes it: (d·sc)·(q − offset) [− dmin·m]."""
    k0 = g * 32 + h * 16
    sb = k0 // fmt.sub
    w = _scale(fmt, SC, D, jo, sb, k0, j) * _quant(fmt, QL, QH, jo, g, h, i2, i1, j, HB)
    if fmt.has_min:
        w = w - _min(fmt, MN, DM, jo, sb, k0, j)
    return w


def _signature(fmt: KFormat, body, a_shape, c_shape, a_len: int, c_len: int, shapes):
    """The kernel ``(A, *parts, C)`` around ``body(A, QL, QH, SC, MN, D, DM, C)`` (absent parts None)."""
    S = dict(zip(fmt.parts, shapes))

    def flat(buf, n):
        return T.decl_buffer((n,), "float32", data=buf.data)

    if fmt.parts == ("ql", "sc", "m", "d", "dm"):
        @T.prim_func(private=True, s_tir=True)
        def kquant_dense(a: T.handle, ql: T.handle, sc: T.handle, mn: T.handle, d: T.handle, dm: T.handle, c: T.handle):
            T.func_attr({"tirx.noalias": True})
            A0 = T.match_buffer(a, a_shape, "float32")
            QL = T.match_buffer(ql, S["ql"][0], S["ql"][1])
            SC = T.match_buffer(sc, S["sc"][0], S["sc"][1])
            MN = T.match_buffer(mn, S["m"][0], S["m"][1])
            D = T.match_buffer(d, S["d"][0], S["d"][1])
            DM = T.match_buffer(dm, S["dm"][0], S["dm"][1])
            C0 = T.match_buffer(c, c_shape, "float32")
            body(T.decl_buffer((a_len,), "float32", data=A0.data), QL, None, SC, MN, D, DM,
                 T.decl_buffer((c_len,), "float32", data=C0.data))
    elif fmt.parts == ("ql", "qh", "sc", "d"):
        @T.prim_func(private=True, s_tir=True)
        def kquant_dense(a: T.handle, ql: T.handle, qh: T.handle, sc: T.handle, d: T.handle, c: T.handle):
            T.func_attr({"tirx.noalias": True})
            A0 = T.match_buffer(a, a_shape, "float32")
            QL = T.match_buffer(ql, S["ql"][0], S["ql"][1])
            QH = T.match_buffer(qh, S["qh"][0], S["qh"][1])
            SC = T.match_buffer(sc, S["sc"][0], S["sc"][1])
            D = T.match_buffer(d, S["d"][0], S["d"][1])
            C0 = T.match_buffer(c, c_shape, "float32")
            body(T.decl_buffer((a_len,), "float32", data=A0.data), QL, QH, SC, None, D, None,
                 T.decl_buffer((c_len,), "float32", data=C0.data))
    elif fmt.parts == ("ql", "qh", "d"):
        @T.prim_func(private=True, s_tir=True)
        def kquant_dense(a: T.handle, ql: T.handle, qh: T.handle, d: T.handle, c: T.handle):
            T.func_attr({"tirx.noalias": True})
            A0 = T.match_buffer(a, a_shape, "float32")
            QL = T.match_buffer(ql, S["ql"][0], S["ql"][1])
            QH = T.match_buffer(qh, S["qh"][0], S["qh"][1])
            D = T.match_buffer(d, S["d"][0], S["d"][1])
            C0 = T.match_buffer(c, c_shape, "float32")
            body(T.decl_buffer((a_len,), "float32", data=A0.data), QL, QH, None, None, D, None,
                 T.decl_buffer((c_len,), "float32", data=C0.data))
    else:
        raise ValueError(f"no kernel signature for the parts {fmt.parts}")
    return kquant_dense


def _dequantize_panel(fmt: KFormat, K: int, HB: int, NS: int = 0):
    """Macro ``dequant(QL, QH, SC, MN, D, DM, W, w_base, jo, NR)``: panel jo as fp32 at W[w_base:],
    in sub-panels of NS columns, each K × NS and contiguous (NS = 0: one K × NR panel)."""

    @T.macro
    def dequant(QL, QH, SC, MN, D, DM, W, w_base, jo, NR):
        for g in T.serial(K // 32):
            for h in T.unroll(2):
                for i2 in T.unroll(16 // HB):
                    for i1 in T.serial(HB):
                        for s in T.unroll(NR // (NS or NR)):
                            for jj in T.vectorized(NS or NR):
                                W[w_base + s * K * (NS or NR) + (g * 32 + h * 16 + i2 * HB + i1) * (NS or NR) + jj] = weight(
                                    fmt, QL, QH, SC, MN, D, DM, jo, g, h, i2, i1, s * (NS or NR) + jj, HB)

    return dequant


def build_kquant_gemm_kernel(a_shape, c_shape, fmt: KFormat, K: int, N: int, NR: int):
    """``C[(1,) M, N] = A[(1,) M, K] · dequant(W)`` with W as ``kquant_formats.kpanel_arrays``."""
    M, K2 = _check_rows(a_shape, c_shape, N)
    if K2 != K:
        raise ValueError(f"A has K = {K2}, the weight {K}")
    NJ, _, HB = _geometry(fmt, K, N, NR)
    NS = subpanel_cols(NR)
    MR = tile_rows(M, NS)
    tile = panel_gemm(M, K, N, NR, NS, MR)
    dequant = _dequantize_panel(fmt, K, HB, NS)

    @T.macro
    def body(A, QL, QH, SC, MN, D, DM, C):
        for jo in T.parallel(NJ):
            with T.sblock("gemm_kq"):
                W = T.sblock_alloc_buffer((K * NR,), "float32")  # the dequantised panel
                acc = T.sblock_alloc_buffer((MR, NS), "float32", scope="local")
                dequant(QL, QH, SC, MN, D, DM, W, 0, jo, NR)
                tile(A, W, C, acc, jo, 0, K * NS, NS)

    return _signature(fmt, body, tuple(a_shape), tuple(c_shape), M * K, M * N, kpanel_shapes(fmt, K, N, NR))


def build_kquant_dequant_kernel(fmt: KFormat, K: int, N: int, NR: int):
    """``W[N/NR · NR/NS · K · NS] = the GEMM's dequantised panels`` (A unused, [1]), in the GEMM's
    own layout (``subpanel_cols``): for the bit-exactness test."""
    NJ, _, HB = _geometry(fmt, K, N, NR)
    dequant = _dequantize_panel(fmt, K, HB, subpanel_cols(NR))

    @T.macro
    def body(A, QL, QH, SC, MN, D, DM, C):
        for jo in T.serial(NJ):
            dequant(QL, QH, SC, MN, D, DM, C, jo * K * NR, jo, NR)

    return _signature(fmt, body, (1,), (NJ * K * NR,), 1, NJ * K * NR, kpanel_shapes(fmt, K, N, NR))


def build_kquant_gemv_kernel(a_shape, c_shape, fmt: KFormat, K: int, N: int, NR: int):
    """``C[(1,) 1, N] = x · dequant(W)`` over the same panel arrays as the GEMM (decode)."""
    M, K2 = _check_rows(a_shape, c_shape, N)
    if M != 1 or K2 != K:
        raise ValueError(f"not a GEMV: {a_shape} with K = {K}")
    NJ, G, HB = _geometry(fmt, K, N, NR)
    store = panel_store(NR, N)
    SUB16 = fmt.sub == 16
    NS = subpanel_cols(NR)

    @T.macro
    def body(A, QL, QH, SC, MN, D, DM, C):
        XS = T.alloc_buffer((G,), "float32")  # Σ x per 32-group (Q4_K's minimum term)
        if fmt.has_min:
            for g in T.serial(G):
                XS[g] = T.float32(0)
                for i in T.serial(32):
                    XS[g] = XS[g] + A[g * 32 + i]
        for jo in T.parallel(NJ):
            with T.sblock("gemv_kq"):
                acc = T.sblock_alloc_buffer((NR,), "float32", scope="local")
                blk = T.sblock_alloc_buffer((2, NS), "float32", scope="local")
                for j in T.vectorized(NR):
                    acc[j] = T.float32(0)
                for g in T.serial(G):
                    for s in T.unroll(NR // NS):  # NS columns at a time: blk stays in registers
                        for h in T.unroll(2):
                            for jj in T.vectorized(NS):
                                blk[h, jj] = T.float32(0)
                        for i2 in T.unroll(16 // HB):
                            for i1 in T.serial(HB):
                                for h in T.unroll(2):
                                    for jj in T.vectorized(NS):
                                        blk[h, jj] = blk[h, jj] + A[g * 32 + h * 16 + i2 * HB + i1] * _quant(
                                            fmt, QL, QH, jo, g, h, i2, i1, s * NS + jj, HB)
                        for jj in T.vectorized(NS):
                            if SUB16:
                                acc[s * NS + jj] = (
                                    acc[s * NS + jj] + _scale(fmt, SC, D, jo, g * 2, g * 32, s * NS + jj) * blk[0, jj]
                                    + _scale(fmt, SC, D, jo, g * 2 + 1, g * 32 + 16, s * NS + jj) * blk[1, jj])
                            elif fmt.has_min:
                                acc[s * NS + jj] = (
                                    acc[s * NS + jj] + _scale(fmt, SC, D, jo, g, g * 32, s * NS + jj) * (blk[0, jj] + blk[1, jj])
                                    - _min(fmt, MN, DM, jo, g, g * 32, s * NS + jj) * XS[g])
                            else:
                                acc[s * NS + jj] = (
                                    acc[s * NS + jj] + _scale(fmt, SC, D, jo, g, g * 32, s * NS + jj) * (blk[0, jj] + blk[1, jj]))
                store(C, acc, jo)

    return _signature(fmt, body, tuple(a_shape), tuple(c_shape), K, N, kpanel_shapes(fmt, K, N, NR))
