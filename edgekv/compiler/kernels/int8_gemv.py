"""Decode GEMVs over 8-bit activations (``--decode-activations int8``): x is quantised once per
call to int8 per block of 32 (scale dx = max|x| / 127, q = round(x / dx), llama.cpp's Q8_0 rule),
and each weight block's dot product is an exact integer sum Σ q_x·q_w, scaled once per block:

    Q4_1   Σ x·(d·q + m)          ≈ d·(dx·Σ q_x·q) + m·(dx·Σ q_x)
    Q4_K   Σ x·((d·sc)·q − dmin·m) ≈ (d·sc)·(dx·Σ q_x·q) − (dmin·m)·(dx·Σ q_x)
    Q6_K   Σ x·((d·sc)·(q − 32))   ≈ (d·sc)·(dx·Σ q_x·(q − 32))   (per sub-block of 16)
    Q8_0   Σ x·(d·q)               ≈ d·(dx·Σ q_x·q)                 (the tied LM head's rows)

The minimum term uses the quantised x's sum dx·Σq_x (llama.cpp's Q8_1 ``s``), not x's exact sum, so
the result is exactly x̂·w for x̂ = dx·q_x: its error Σ(x̂ − x)·w has coefficients w = d·q + m
centred near zero, where the exact sum's would be d·q ∈ [0, 15d] (about 4× the error variance on
Q4_1; the two measured on SmolLM2 in docs/COMPILER.md). Only x's
rounding changes the result (≤ dx/2 per element), as in llama.cpp's Q8_0 / Q8_1 / Q8_K activations; the fp32-activation
kernels (``quant_dense.py``, ``kquant_dense.py``) stay the default and the reference.

Why: the fp32 GEMV is compute-bound (a nibble extract, a widening, a conversion and an FMA per
weight: docs/COMPILER.md). Two integer paths, the same integer sums (so the same bits):

* ``avx2`` (x86 with AVX2): ``vpmaddubsw`` multiplies 32 unsigned weight bytes by 32 signed x bytes
  and adds adjacent pairs into 16 int16 lanes. The weight panels hold one column per byte lane, two
  k per byte (Q4's low / high nibble: quants i and i + 16), so rows i and i + 1 of a panel are
  interleaved byte by byte (a ``Shuffle``: ``vpunpck[lh]bw``) to put a column's two consecutive-k
  quants side by side, against the pair (x_i, x_i+1) broadcast to every lane. Signed weights (Q6_K's
  q − 32, Q8_0) take llama.cpp's sign trick: |x| as the unsigned side, the weight with x's sign
  (``vpsignb``). int16 partial sums are widened to int32 before they can overflow (each pair is at
  most 2·15·127 for 4-bit, 2·32·127 for Q6_K's signed 6-bit, 2·127·127 for Q8_0).
* ``generic`` (every other target, aarch64 included): the same sums as plain TIR integer
  arithmetic (int16 products, int32 widening), which LLVM vectorises for the target.

``int8_isa(target)`` picks the path from the TVM target; the kernels are built per call site by
``passes/quantize_weights.py`` when the build asks for int8 decode activations.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kquant_formats import KFormat, kpanel_shapes
from ..quant_formats import GROUP, WeightFormat, padded
from .common import panel_store
from .quant_dense import CACHE_LINE, PREFETCH_AHEAD, _check_rows, _weight_geometry, prefetch

ISAS = ("avx2", "generic")
QMAX = 127  # |q_x| ≤ 127: symmetric, so −q_x is an int8 too (the sign trick)


def int8_isa(target) -> str:
    """``avx2`` for an llvm target whose CPU has AVX2, else ``generic`` (TVM target or dict)."""
    import tvm
    from tvm.target import codegen

    tgt = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    if str(tgt.kind.name) != "llvm":
        return "generic"
    triple = str(tgt.attrs.get("mtriple", "") or "")
    if triple and not triple.startswith(("x86_64", "i686", "i386")):
        return "generic"
    try:
        return "avx2" if codegen.target_has_features("avx2", tgt) else "generic"
    except Exception:  # an LLVM that cannot answer for this target: the portable path
        return "generic"


def check_isa(isa: str) -> str:
    if isa not in ISAS:
        raise ValueError(f"int8 GEMV path {isa!r}: one of {', '.join(ISAS)}")
    return isa


# ---- x → int8 blocks ---------------------------------------------------------------------------

def quantize_x(K: int, KP: int):
    """Macro ``quantize(A, XQ, XP, XA, DX, XS, AM)``: per 32-block kb of x (zeros past K), DX[kb] =
    max|x| / 127, XQ = round(x · 127 / max|x|) (int8; 0 for an all-zero block), XS[kb] = DX[kb]·Σ XQ
    (the quantised block's sum), XP[p] = the int16 whose bytes are XQ[2p], XQ[2p + 1] (a pair to broadcast), XA[p] the same of |XQ|."""
    KB = KP // GROUP

    @T.macro
    def quantize(A, XQ, XP, XA, DX, XS, AM):
        for kb in T.serial(KB):
            AM[0] = T.float32(0)
            XS[kb] = T.float32(0)
            for i in T.serial(GROUP):
                AM[0] = T.max(AM[0], T.fabs(T.if_then_else(kb * GROUP + i < K, A[T.min(kb * GROUP + i, K - 1)], T.float32(0))))
            DX[kb] = AM[0] / T.float32(QMAX)
            AM[1] = T.if_then_else(AM[0] > T.float32(0), T.float32(QMAX) / T.max(AM[0], T.float32(1e-30)), T.float32(0))
            for i in T.serial(GROUP):
                XQ[kb * GROUP + i] = T.Cast("int8", T.round(
                    T.if_then_else(kb * GROUP + i < K, A[T.min(kb * GROUP + i, K - 1)], T.float32(0)) * AM[1]))
                XS[kb] = XS[kb] + T.Cast("float32", XQ[kb * GROUP + i])
            XS[kb] = DX[kb] * XS[kb]  # dx·Σq: the quantised x's own sum (see the module docstring)
        for p in T.serial(KP // 2):
            XP[p] = T.Cast("int16", T.bitwise_or(T.bitwise_and(T.Cast("int32", XQ[2 * p]), 255),
                                                 T.shift_left(T.Cast("int32", XQ[2 * p + 1]), 8)))
        for p in T.serial(KP // 2):
            XA[p] = T.Cast("int16", T.bitwise_or(T.abs(T.Cast("int32", XQ[2 * p])),
                                                 T.shift_left(T.abs(T.Cast("int32", XQ[2 * p + 1])), 8)))

    return quantize


# ---- byte-lane helpers (the avx2 path) ----------------------------------------------------------

def _interleave(n: int, half: str):
    """Shuffle indices interleaving two n-byte vectors a, b byte by byte: n = 16 → all 32 bytes
    (a0 b0 a1 b1 … a15 b15); n = 32 → AVX2's in-lane unpack, ``half`` "lo" (bytes 0–7 and 16–23 of
    each) or "hi" (8–15 and 24–31)."""
    if n == 16:
        return [v for t in range(16) for v in (t, 16 + t)]
    base = 0 if half == "lo" else 8
    return [v for lane in (0, 16) for t in range(8) for v in (lane + base + t, 32 + lane + base + t)]


def _octets(n: int) -> list[int]:
    """Column octet of each 8-lane slice of the int16 sums: the in-lane unpack puts columns
    0–7, 16–23 in the first 16 lanes and 8–15, 24–31 in the second."""
    return [0, 2, 1, 3] if n == 32 else [0, 1]


def _pmaddubsw(u, s):
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u, s)


def _psignb(a, b):
    return T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", a, b)


def _pair(XP, p):
    """x's int8 pair p broadcast to 32 bytes (the signed side of ``vpmaddubsw``)."""
    return T.reinterpret("int8x32", T.broadcast(XP[p], 16))


def _nibbles(QL, jo, row, c0, n: int, h):
    """Nibble h (0: low, 1: high) of n bytes of panel row ``row`` from column c0, as uint8 lanes."""
    return T.bitwise_and(T.shift_right(QL[jo, row, T.ramp(c0, 1, n)], T.broadcast(T.Cast("uint8", 4 * h), n)),
                         T.broadcast(T.uint8(15), n))


def _chunk(NR: int) -> int:
    return 32 if NR % 32 == 0 else 16


# ---- Q4 panels: Q4_1 (quant_formats) and Q4_K (kquant_formats) ----------------------------------

def _q4_panel_sums(NR: int, isa: str):
    """Macro ``sums(QL, XQ, XP, a16, isum, jo, kb, s)``: isum[0, c] = Σ_k q_x[k]·q[k, c] over 32-block
    kb for the NS columns of chunk s of panel jo (unsigned nibbles, quants i and i + 16 of the block
    in byte i): two int16 sums (low / high nibble, 8 row pairs each, ≤ 8·2·15·127 < 2¹⁵), widened."""
    NS = _chunk(NR)
    NV = NS // 16  # int16 vectors per nibble
    AVX2 = check_isa(isa) == "avx2"
    LO, HI = _interleave(NS, "lo"), _interleave(NS, "hi")

    @T.macro
    def sums(QL, XQ, XP, a16, isum, jo, kb, s):
        for h in T.unroll(2):
            for l in T.vectorized(NS):
                a16[h, l] = T.int16(0)
        for ip in T.serial(8):
            for h in T.unroll(2):
                if AVX2:
                    if NV == 2:
                        a16[h, T.ramp(0, 1, 16)] = a16[h, T.ramp(0, 1, 16)] + _pmaddubsw(
                            T.Shuffle([_nibbles(QL, jo, kb * 16 + 2 * ip, s * NS, NS, h), _nibbles(QL, jo, kb * 16 + 2 * ip + 1, s * NS, NS, h)], LO),
                            _pair(XP, kb * 16 + h * 8 + ip))
                        a16[h, T.ramp(16, 1, 16)] = a16[h, T.ramp(16, 1, 16)] + _pmaddubsw(
                            T.Shuffle([_nibbles(QL, jo, kb * 16 + 2 * ip, s * NS, NS, h), _nibbles(QL, jo, kb * 16 + 2 * ip + 1, s * NS, NS, h)], HI),
                            _pair(XP, kb * 16 + h * 8 + ip))
                    else:
                        a16[h, T.ramp(0, 1, 16)] = a16[h, T.ramp(0, 1, 16)] + _pmaddubsw(
                            T.Shuffle([_nibbles(QL, jo, kb * 16 + 2 * ip, s * NS, NS, h), _nibbles(QL, jo, kb * 16 + 2 * ip + 1, s * NS, NS, h)], LO),
                            _pair(XP, kb * 16 + h * 8 + ip))
                else:
                    for l in T.vectorized(NS):
                        a16[h, l] = (a16[h, l]
                                     + T.Cast("int16", T.bitwise_and(T.shift_right(QL[jo, kb * 16 + 2 * ip, s * NS + l], T.uint8(4 * h)), T.uint8(15)))
                                     * T.Cast("int16", XQ[kb * GROUP + h * 16 + 2 * ip])
                                     + T.Cast("int16", T.bitwise_and(T.shift_right(QL[jo, kb * 16 + 2 * ip + 1, s * NS + l], T.uint8(4 * h)), T.uint8(15)))
                                     * T.Cast("int16", XQ[kb * GROUP + h * 16 + 2 * ip + 1]))
        if AVX2:
            for o in T.unroll(NS // 8):
                isum[0, T.ramp(((o % 2) * 2 + o // 2 if NS == 32 else o) * 8, 1, 8)] = (T.Cast("int32x8", a16[0, T.ramp(o * 8, 1, 8)])
                                                  + T.Cast("int32x8", a16[1, T.ramp(o * 8, 1, 8)]))
        else:
            for l in T.vectorized(NS):
                isum[0, l] = T.Cast("int32", a16[0, l]) + T.Cast("int32", a16[1, l])

    return sums


def build_q4_int8_gemv_kernel(a_shape, c_shape, fmt: WeightFormat, K: int, N: int, NR: int, isa: str):
    """``C[(1,) 1, N] ≈ x · dequant(W)`` over Q4_1 panels (``quant_formats.panel_arrays``) with x as
    int8 blocks: the same arguments as ``quant_dense.build_quant_gemv_kernel``."""
    M, K2 = _check_rows(a_shape, c_shape, N)
    if M != 1 or K2 != K:
        raise ValueError(f"not a GEMV: {a_shape} with K = {K}")
    if fmt.bits != 4 or not fmt.has_min:
        raise ValueError(f"int8 activations: Q4_1 panels only, not {fmt.name}")
    KP, NJ, KB, QK = _weight_geometry(fmt, K, N, NR)
    NS = _chunk(NR)
    store = panel_store(NR, N)
    sums = _q4_panel_sums(NR, isa)
    quantize = quantize_x(K, KP)
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)

    @T.prim_func(private=True, s_tir=True)
    def gemv_q4_x8(a: T.handle, q: T.handle, d: T.handle, mn: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        Q = T.match_buffer(q, (NJ, QK, NR), "uint8")
        D = T.match_buffer(d, (NJ, KB, NR), "float16")
        MN = T.match_buffer(mn, (NJ, KB, NR), "float16")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((K,), "float32", data=A0.data)
        C = T.decl_buffer((N,), "float32", data=C0.data)
        XQ = T.alloc_buffer((KP,), "int8")
        XP = T.alloc_buffer((KP // 2,), "int16")
        XA = T.alloc_buffer((KP // 2,), "int16")
        DX = T.alloc_buffer((KB,), "float32")
        XS = T.alloc_buffer((KB,), "float32")
        AM = T.alloc_buffer((2,), "float32")
        quantize(A, XQ, XP, XA, DX, XS, AM)
        for jo in T.parallel(NJ):
            with T.sblock("gemv_q4_x8"):
                acc = T.sblock_alloc_buffer((NR,), "float32", scope="local")
                a16 = T.sblock_alloc_buffer((2, NS), "int16", scope="local")
                isum = T.sblock_alloc_buffer((2, NS), "int32", scope="local")
                for j in T.vectorized(NR):
                    acc[j] = T.float32(0)
                for kb in T.serial(KB):
                    for s in T.unroll(NR // NS):
                        sums(Q, XQ, XP, a16, isum, jo, kb, s)
                        for l in T.vectorized(NS):
                            acc[s * NS + l] = (acc[s * NS + l]
                                               + T.Cast("float32", D[jo, kb, s * NS + l]) * (DX[kb] * T.Cast("float32", isum[0, l]))
                                               + T.Cast("float32", MN[jo, kb, s * NS + l]) * XS[kb])
                store(C, acc, jo)

    return gemv_q4_x8


# ---- K-quant panels (kquant_formats): Q4_K and Q6_K --------------------------------------------

def _q6(QL, QH, jo, g, h, i2, i1, c0, n: int):
    """Q6_K's signed quant q − 32 (int8 lanes) of quant h·16 + i2·8 + i1 of 32-group g, n columns
    from c0: the low nibble from ``ql`` and 2 high bits from ``qh`` (``kquant_formats`` layout)."""
    lo = _nibbles(QL, jo, g * 16 + i2 * 8 + i1, c0, n, h)
    hi = T.bitwise_and(T.shift_right(QH[jo, g * 8 + i1, T.ramp(c0, 1, n)], T.broadcast(T.Cast("uint8", (h * 2 + i2) * 2), n)),
                       T.broadcast(T.uint8(3), n))
    u = T.bitwise_or(lo, T.shift_left(hi, T.broadcast(T.uint8(4), n)))
    return T.reinterpret(f"int8x{n}", u) - T.broadcast(T.int8(32), n)


def _q6_scalar(QL, QH, jo, g, h, i2, i1, c):
    lo = T.bitwise_and(T.shift_right(QL[jo, g * 16 + i2 * 8 + i1, c], T.Cast("uint8", 4 * h)), T.uint8(15))
    hi = T.bitwise_and(T.shift_right(QH[jo, g * 8 + i1, c], T.Cast("uint8", (h * 2 + i2) * 2)), T.uint8(3))
    return T.Cast("int16", T.bitwise_or(lo, T.shift_left(hi, T.uint8(4)))) - T.int16(32)


def _q6_panel_sums(NR: int, isa: str):
    """Macro ``sums(QL, QH, XQ, XP, XA, a16, isum, jo, g, s)``: isum[h, c] = Σ q_x·(q − 32) over
    sub-block 2g + h (16 quants) of chunk s of panel jo. Signed weights: |x| against the weight
    with x's sign (``vpsignb``); int16 sums over 4 row pairs (≤ 4·2·32·127 < 2¹⁵), widened per i2."""
    NS = _chunk(NR)
    NV = NS // 16
    AVX2 = check_isa(isa) == "avx2"
    LO, HI = _interleave(NS, "lo"), _interleave(NS, "hi")

    @T.macro
    def sums(QL, QH, XQ, XP, XA, a16, isum, jo, g, s):
        for h in T.unroll(2):
            for l in T.vectorized(NS):
                isum[h, l] = 0
        for h in T.unroll(2):
            for i2 in T.unroll(2):
                for l in T.vectorized(NS):
                    a16[h, l] = T.int16(0)
                for ip in T.serial(4):
                    if AVX2:
                        a16[h, T.ramp(0, 1, 16)] = a16[h, T.ramp(0, 1, 16)] + _pmaddubsw(
                            T.reinterpret("int8x32", T.broadcast(XA[g * 16 + h * 8 + i2 * 4 + ip], 16)),
                            _psignb(T.Shuffle([_q6(QL, QH, jo, g, h, i2, 2 * ip, s * NS, NS), _q6(QL, QH, jo, g, h, i2, 2 * ip + 1, s * NS, NS)], LO),
                                    _pair(XP, g * 16 + h * 8 + i2 * 4 + ip)))
                        if NV == 2:
                            a16[h, T.ramp(16, 1, 16)] = a16[h, T.ramp(16, 1, 16)] + _pmaddubsw(
                                T.reinterpret("int8x32", T.broadcast(XA[g * 16 + h * 8 + i2 * 4 + ip], 16)),
                                _psignb(T.Shuffle([_q6(QL, QH, jo, g, h, i2, 2 * ip, s * NS, NS), _q6(QL, QH, jo, g, h, i2, 2 * ip + 1, s * NS, NS)], HI),
                                        _pair(XP, g * 16 + h * 8 + i2 * 4 + ip)))
                    else:
                        for l in T.vectorized(NS):
                            a16[h, l] = (a16[h, l]
                                         + _q6_scalar(QL, QH, jo, g, h, i2, 2 * ip, s * NS + l) * T.Cast("int16", XQ[g * 32 + h * 16 + i2 * 8 + 2 * ip])
                                         + _q6_scalar(QL, QH, jo, g, h, i2, 2 * ip + 1, s * NS + l) * T.Cast("int16", XQ[g * 32 + h * 16 + i2 * 8 + 2 * ip + 1]))
                if AVX2:
                    for o in T.unroll(NS // 8):
                        isum[h, T.ramp(((o % 2) * 2 + o // 2 if NS == 32 else o) * 8, 1, 8)] = (
                            isum[h, T.ramp(((o % 2) * 2 + o // 2 if NS == 32 else o) * 8, 1, 8)] + T.Cast("int32x8", a16[h, T.ramp(o * 8, 1, 8)]))
                else:
                    for l in T.vectorized(NS):
                        isum[h, l] = isum[h, l] + T.Cast("int32", a16[h, l])

    return sums


def build_kquant_int8_gemv_kernel(a_shape, c_shape, fmt: KFormat, K: int, N: int, NR: int, isa: str):
    """``C[(1,) 1, N] ≈ x · dequant(W)`` over Q4_K or Q6_K panels (``kquant_formats.kpanel_arrays``)
    with x as int8 blocks: the arguments of ``kquant_dense.build_kquant_gemv_kernel``."""
    from .kquant_dense import _geometry, _signature

    M, K2 = _check_rows(a_shape, c_shape, N)
    if M != 1 or K2 != K:
        raise ValueError(f"not a GEMV: {a_shape} with K = {K}")
    if fmt.ggml not in INT8_KFORMATS:
        raise ValueError(f"int8 activations: {', '.join(INT8_KFORMATS)} panels only, not {fmt.ggml}")
    NJ, G, _ = _geometry(fmt, K, N, NR)
    NS = _chunk(NR)
    store = panel_store(NR, N)
    Q6 = fmt.ggml == "Q6_K"
    SB = fmt.superblock // 32  # 32-groups per super-block
    sums4 = _q4_panel_sums(NR, isa)
    sums6 = _q6_panel_sums(NR, isa)
    quantize = quantize_x(K, K)

    @T.macro
    def body(A, QL, QH, SC, MN, D, DM, C):
        XQ = T.alloc_buffer((K,), "int8")
        XP = T.alloc_buffer((K // 2,), "int16")
        XA = T.alloc_buffer((K // 2,), "int16")
        DX = T.alloc_buffer((G,), "float32")
        XS = T.alloc_buffer((G,), "float32")
        AM = T.alloc_buffer((2,), "float32")
        quantize(A, XQ, XP, XA, DX, XS, AM)
        for jo in T.parallel(NJ):
            with T.sblock("gemv_kq_x8"):
                acc = T.sblock_alloc_buffer((NR,), "float32", scope="local")
                a16 = T.sblock_alloc_buffer((2, NS), "int16", scope="local")
                isum = T.sblock_alloc_buffer((2, NS), "int32", scope="local")
                for j in T.vectorized(NR):
                    acc[j] = T.float32(0)
                for g in T.serial(G):
                    for s in T.unroll(NR // NS):
                        if Q6:
                            sums6(QL, QH, XQ, XP, XA, a16, isum, jo, g, s)
                            for l in T.vectorized(NS):
                                acc[s * NS + l] = (
                                    acc[s * NS + l]
                                    + T.Cast("float32", D[jo, g // SB, s * NS + l]) * T.Cast("float32", SC[jo, 2 * g, s * NS + l])
                                    * (DX[g] * T.Cast("float32", isum[0, l]))
                                    + T.Cast("float32", D[jo, g // SB, s * NS + l]) * T.Cast("float32", SC[jo, 2 * g + 1, s * NS + l])
                                    * (DX[g] * T.Cast("float32", isum[1, l])))
                        else:
                            sums4(QL, XQ, XP, a16, isum, jo, g, s)
                            for l in T.vectorized(NS):
                                acc[s * NS + l] = (
                                    acc[s * NS + l]
                                    + T.Cast("float32", D[jo, g // SB, s * NS + l]) * T.Cast("float32", SC[jo, g, s * NS + l])
                                    * (DX[g] * T.Cast("float32", isum[0, l]))
                                    - T.Cast("float32", DM[jo, g // SB, s * NS + l]) * T.Cast("float32", MN[jo, g, s * NS + l]) * XS[g])
                store(C, acc, jo)

    return _signature(fmt, body, tuple(a_shape), tuple(c_shape), K, N, kpanel_shapes(fmt, K, N, NR))


INT8_KFORMATS = ("Q4_K", "Q6_K")


# ---- the tied LM head: Q8_0 rows [V, K] (quant_dense.build_q8_gemv_nt_kernel's arrays) ----------

def _pmaddwd(a, b):
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a, b)


def build_q8_int8_gemv_nt_kernel(a_shape, c_shape, V: int, K: int, isa: str):
    """``C[(1,) 1, V] ≈ x · dequant(table)ᵀ`` over the Q8_0 rows with x as int8 blocks. Per row and
    32-block, 8 int32 lanes each hold Σ q_x·q over 4 consecutive k (``vpmaddubsw`` with the sign
    trick, then ``vpmaddwd`` by ones; the generic path the same sums as plain TIR), added as
    (d·dx)·lane into 8 fp32 partial sums, folded in order at the end (generic: 16 lanes of k and
k + 16). Parallel over blocks of 4
    rows, each task prefetching the rows of the task ``PREFETCH_AHEAD`` on (as the fp32 head)."""
    M, K2 = _check_rows(a_shape, c_shape, V)
    if M != 1 or K2 != K or K % GROUP or V % 4:
        raise ValueError(f"an NT GEMV needs M = 1, K a whole number of blocks and V a multiple of 4: {a_shape}, V = {V}")
    JB, KB = 4, K // GROUP
    AVX2 = check_isa(isa) == "avx2"
    L = 8 if AVX2 else 16  # fp32 partial sums per row
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)
    AHEAD, LINES = PREFETCH_AHEAD, -(-JB * K // CACHE_LINE)
    quantize = quantize_x(K, K)

    @T.prim_func(private=True, s_tir=True)
    def gemv_nt_q8_x8(a: T.handle, q: T.handle, d: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        Q = T.match_buffer(q, (V, K), "int8")
        D = T.match_buffer(d, (V, KB), "float16")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((K,), "float32", data=A0.data)
        C = T.decl_buffer((V,), "float32", data=C0.data)
        QF = T.decl_buffer((V * K,), "int8", data=Q.data)
        XQ = T.alloc_buffer((K,), "int8")
        XP = T.alloc_buffer((K // 2,), "int16")
        XA = T.alloc_buffer((K // 2,), "int16")
        DX = T.alloc_buffer((KB,), "float32")
        XS = T.alloc_buffer((KB,), "float32")
        AM = T.alloc_buffer((2,), "float32")
        quantize(A, XQ, XP, XA, DX, XS, AM)
        for jo in T.parallel(V // JB):
            with T.sblock("gemv_nt_q8_x8"):
                part = T.sblock_alloc_buffer((JB, L), "float32", scope="local")
                if jo + AHEAD < V // JB:  # the rows AHEAD tasks on, requested now (quant_dense.PREFETCH_AHEAD)
                    for line in T.serial(LINES):
                        prefetch(QF, (jo + AHEAD) * JB * K + line * CACHE_LINE)
                for r in T.unroll(JB):
                    for l in T.vectorized(L):
                        part[r, l] = T.float32(0)
                for kb in T.serial(KB):
                    for r in T.unroll(JB):
                        if AVX2:
                            part[r, T.ramp(0, 1, L)] = part[r, T.ramp(0, 1, L)] + T.broadcast(
                                T.Cast("float32", D[jo * JB + r, kb]) * DX[kb], L) * T.Cast("float32x8", _pmaddwd(
                                    _pmaddubsw(T.reinterpret("int8x32", XA[T.ramp(kb * 16, 1, 16)]),
                                               _psignb(Q[jo * JB + r, T.ramp(kb * GROUP, 1, GROUP)],
                                                       T.reinterpret("int8x32", XP[T.ramp(kb * 16, 1, 16)]))),
                                    T.broadcast(T.int16(1), 16)))
                        else:  # 16 lanes of 2 products each (k and k + 16), contiguous loads
                            for l in T.vectorized(16):
                                part[r, l] = part[r, l] + T.Cast("float32", D[jo * JB + r, kb]) * DX[kb] * T.Cast("float32", (
                                    T.Cast("int32", T.Cast("int16", Q[jo * JB + r, kb * GROUP + l]) * T.Cast("int16", XQ[kb * GROUP + l]))
                                    + T.Cast("int32", T.Cast("int16", Q[jo * JB + r, kb * GROUP + 16 + l]) * T.Cast("int16", XQ[kb * GROUP + 16 + l]))))
                for r in T.unroll(JB):
                    C[jo * JB + r] = T.float32(0)
                    for l in T.serial(L):
                        C[jo * JB + r] = C[jo * JB + r] + part[r, l]

    return gemv_nt_q8_x8
