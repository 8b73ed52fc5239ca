"""Dense kernels over quantised weights (``quant_formats.py``: GGML Q4_1 / Q8_0 blocks of 32
along K), the dequantisation fused in: scheduled kernels for CPUs (the host, and cross-compiled
aarch64 / Android), and at the end of the file the GPU definitions that dlight schedules.

* **GEMM** (the prefill step): the same register-blocked kernel as the fp32 one (``register_tile``'s
  ``panel_gemm``, one task per NR-wide column panel), with the panel dequantised into a
  K × NR fp32 buffer first, as NR / NS sub-panels of K × NS, the tile's width (L2-resident:
  ≤ 96 KB at NR = 16, 384 KB at NR = 64 for SmolLM2's K = 1536); all M rows then use it, so dequantising costs 1/M of the FMAs and the weight is
  read from memory as 4- or 8-bit quants once per call. Summation over k is sequential:
  results equal the fp32 kernel's over the dequantised weight up to FMA contraction.
* **GEMV** (decode, memory-bound: reads every weight byte once per token): per panel and block,
  NR lanes accumulate Σ x·q over the block's 32 weights, then acc += d · that (+ m · Σ x, the
  block's x sum computed once per call) — one FMA and one conversion per weight, no fp32
  weight materialised. Summed per block, so the order differs from the dequantise-then-matmul
  reference (≈1e-6 relative).
* **Embedding lookup** and **tied LM head** (Q8_0 rows of the [V, K] table): a row gather that
  dequantises, and an NT GEMV (each output one row's dot product, 16-lane partial sums per block).

K not a multiple of 32: the weight is padded with zero blocks (x read as zero past K); N not a
multiple of NR: padded panels, the last one's tail not written.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..quant_formats import GROUP, WeightFormat, padded
from .common import panel_store
from .dense import VEC, nt_row_block
from .register_tile import panel_gemm, subpanel_cols, tile_rows


CACHE_LINE = 64
# Software prefetch, tasks ahead: the hardware prefetchers do not keep a decode GEMV's weight stream
# coming (measured on a 2-core EPYC: the tied LM head's 30 MB Q8_0 table at ~4 GB/s per thread, where
# a plain streaming read reaches 15 GB/s; with each task requesting the rows of the task 8 on, 2.1×
# faster). A prefetch is a hint: the results are the same bits. The panel GEMVs gain nothing from it
# (tried: they are bound by unpacking, and the hardware keeps their slower stream coming).
PREFETCH_AHEAD = 8


@T.macro
def prefetch(buf, offset):
    """Read hint for the cache line of ``buf[offset]`` (LLVM's prefetch: read, high locality, data)."""
    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[offset]),
                                  T.int32(0), T.int32(3), T.int32(1)))


def _check_rows(a_shape, c_shape, n: int):
    *lead, M, K = a_shape
    if tuple(c_shape) != (*lead, M, n) or any(d != 1 for d in lead) or len(lead) > 1:
        raise ValueError(f"not a dense shape: {a_shape} -> {c_shape} (N = {n})")
    return M, K


def _weight_geometry(fmt: WeightFormat, K: int, N: int, NR: int):
    if NR % VEC:
        raise ValueError(f"panel width {NR} is not a multiple of {VEC}")
    KP, NP = padded(K, GROUP), padded(N, NR)
    return KP, NP // NR, KP // GROUP, (KP // 2 if fmt.bits == 4 else KP)


def _signature(body, a_shape, c_shape, a_len: int, c_len: int, q_shape, q_dtype: str, scale_shape, has_min: bool):
    """The kernel ``(A, quants, scales[, minima], C)`` around ``body(A, Q, D, MN, C)`` (A and C
    as flat [a_len] / [c_len] views; MN None for a format without minima, Q8_0)."""
    if has_min:  # Q4_1: quants, scales, minima
        @T.prim_func(private=True, s_tir=True)
        def quant_dense(a: T.handle, q: T.handle, d: T.handle, mn: T.handle, c: T.handle):
            T.func_attr({"tirx.noalias": True})
            A0 = T.match_buffer(a, a_shape, "float32")
            Q = T.match_buffer(q, q_shape, q_dtype)
            D = T.match_buffer(d, scale_shape, "float16")
            MN = T.match_buffer(mn, scale_shape, "float16")
            C0 = T.match_buffer(c, c_shape, "float32")
            body(T.decl_buffer((a_len,), "float32", data=A0.data), Q, D, MN,
                 T.decl_buffer((c_len,), "float32", data=C0.data))
    else:  # Q8_0: quants, scales
        @T.prim_func(private=True, s_tir=True)
        def quant_dense(a: T.handle, q: T.handle, d: T.handle, c: T.handle):
            T.func_attr({"tirx.noalias": True})
            A0 = T.match_buffer(a, a_shape, "float32")
            Q = T.match_buffer(q, q_shape, q_dtype)
            D = T.match_buffer(d, scale_shape, "float16")
            C0 = T.match_buffer(c, c_shape, "float32")
            body(T.decl_buffer((a_len,), "float32", data=A0.data), Q, D, None,
                 T.decl_buffer((c_len,), "float32", data=C0.data))
    return quant_dense


def build_quant_gemm_kernel(a_shape, c_shape, fmt: WeightFormat, K: int, N: int, NR: int):
    """``C[(1,) M, N] = A[(1,) M, K] · dequant(W)`` with W as ``quant_formats.panel_arrays``."""
    M, K2 = _check_rows(a_shape, c_shape, N)
    if K2 != K:
        raise ValueError(f"A has K = {K2}, the weight {K}")
    KP, NJ, KB, QK = _weight_geometry(fmt, K, N, NR)
    NS = subpanel_cols(NR)
    MR = tile_rows(M, NS)
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)
    Q4, HAS_MIN, QDT = fmt.bits == 4, fmt.has_min, fmt.quant_dtype
    tile = panel_gemm(M, K, N, NR, NS, MR)

    @T.macro
    def body(A, Q, D, MN, C):
        for jo in T.parallel(NJ):
            with T.sblock("gemm_q"):
                W = T.sblock_alloc_buffer((KP * NR,), "float32")  # the dequantised panel: NR / NS sub-panels of KP × NS
                acc = T.sblock_alloc_buffer((MR, NS), "float32", scope="local")
                for kb in T.serial(KB):
                    for i in T.serial(GROUP // 2 if Q4 else GROUP):
                        for s in T.unroll(NR // NS):
                            for jj in T.vectorized(NS):
                                if Q4:  # byte i of the block: quant i (low nibble), quant i + 16 (high)
                                    W[(s * KP + kb * GROUP + i) * NS + jj] = (
                                        T.Cast("float32", T.bitwise_and(Q[jo, kb * 16 + i, s * NS + jj], T.uint8(15)))
                                        * T.Cast("float32", D[jo, kb, s * NS + jj]) + T.Cast("float32", MN[jo, kb, s * NS + jj]))
                                    W[(s * KP + kb * GROUP + i + 16) * NS + jj] = (
                                        T.Cast("float32", T.shift_right(Q[jo, kb * 16 + i, s * NS + jj], T.uint8(4)))
                                        * T.Cast("float32", D[jo, kb, s * NS + jj]) + T.Cast("float32", MN[jo, kb, s * NS + jj]))
                                else:
                                    W[(s * KP + kb * GROUP + i) * NS + jj] = (
                                        T.Cast("float32", Q[jo, kb * GROUP + i, s * NS + jj])
                                        * T.Cast("float32", D[jo, kb, s * NS + jj]))
                tile(A, W, C, acc, jo, 0, KP * NS, NS)

    return _signature(body, A_SHAPE, C_SHAPE, M * K, M * N, (NJ, QK, NR), QDT, (NJ, KB, NR), HAS_MIN)


def build_quant_gemv_kernel(a_shape, c_shape, fmt: WeightFormat, K: int, N: int, NR: int):
    """``C[(1,) 1, N] = x · dequant(W)`` over the same panel arrays as the GEMM (decode)."""
    M, K2 = _check_rows(a_shape, c_shape, N)
    if M != 1 or K2 != K:
        raise ValueError(f"not a GEMV: {a_shape} with K = {K}")
    KP, NJ, KB, QK = _weight_geometry(fmt, K, N, NR)
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)
    Q4, HAS_MIN, QDT = fmt.bits == 4, fmt.has_min, fmt.quant_dtype
    store = panel_store(NR, N)

    @T.macro
    def body(A, Q, D, MN, C):
        X = T.alloc_buffer((KP,), "float32")  # x padded with zeros to whole blocks
        XS = T.alloc_buffer((KB,), "float32")  # Σ x per block (the minimum's term)
        for k in T.serial(KP):
            X[k] = T.if_then_else(k < K, A[T.min(k, K - 1)], T.float32(0))
        for kb in T.serial(KB):
            XS[kb] = T.float32(0)
            for i in T.serial(GROUP):
                XS[kb] = XS[kb] + X[kb * GROUP + i]
        for jo in T.parallel(NJ):
            with T.sblock("gemv_q"):
                acc = T.sblock_alloc_buffer((NR,), "float32", scope="local")
                blk = T.sblock_alloc_buffer((NR,), "float32", scope="local")
                for j in T.vectorized(NR):
                    acc[j] = T.float32(0)
                for kb in T.serial(KB):
                    for j in T.vectorized(NR):
                        blk[j] = T.float32(0)
                    for i in T.serial(GROUP // 2 if Q4 else GROUP):
                        for j in T.vectorized(NR):
                            if Q4:
                                blk[j] = (blk[j] + X[kb * GROUP + i]
                                          * T.Cast("float32", T.bitwise_and(Q[jo, kb * 16 + i, j], T.uint8(15)))
                                          + X[kb * GROUP + i + 16]
                                          * T.Cast("float32", T.shift_right(Q[jo, kb * 16 + i, j], T.uint8(4))))
                            else:
                                blk[j] = blk[j] + X[kb * GROUP + i] * T.Cast("float32", Q[jo, kb * GROUP + i, j])
                    for j in T.vectorized(NR):
                        if HAS_MIN:
                            acc[j] = (acc[j] + T.Cast("float32", D[jo, kb, j]) * blk[j]
                                      + T.Cast("float32", MN[jo, kb, j]) * XS[kb])
                        else:
                            acc[j] = acc[j] + T.Cast("float32", D[jo, kb, j]) * blk[j]
                store(C, acc, jo)

    return _signature(body, A_SHAPE, C_SHAPE, K, N, (NJ, QK, NR), QDT, (NJ, KB, NR), HAS_MIN)


def build_q8_take_kernel(ids_len: int, ids_dtype: str, V: int, K: int):
    """``out[t, :] = dequant(table[ids[t], :])``: the embedding lookup over a Q8_0 [V, K] table
    (quants [V, K] int8, scales [V, K/32] float16; K a whole number of blocks). Ids are not
    checked, as with ``take(mode="fast")`` that it replaces: the runtimes check prompt ids."""
    if K % GROUP:
        raise ValueError(f"K = {K} is not a whole number of {GROUP}-wide blocks")
    KB = K // GROUP

    @T.prim_func(private=True, s_tir=True)
    def take_q8(q: T.handle, d: T.handle, ids: T.handle, o: T.handle):
        T.func_attr({"tirx.noalias": True})
        Q = T.match_buffer(q, (V, K), "int8")
        D = T.match_buffer(d, (V, KB), "float16")
        I = T.match_buffer(ids, (ids_len,), ids_dtype)
        O = T.match_buffer(o, (ids_len, K), "float32")
        for t in T.serial(ids_len):
            for kb in T.serial(KB):
                for i in T.vectorized(GROUP):
                    O[t, kb * GROUP + i] = T.Cast("float32", Q[I[t], kb * GROUP + i]) * T.Cast("float32", D[I[t], kb])

    return take_q8


def build_q8_gemv_nt_kernel(a_shape, c_shape, V: int, K: int):
    """``C[(1,) M, V] = A[(1,) M, K] · dequant(table)ᵀ``: the tied LM head over the Q8_0 table
    (M = 1 after the last-token gather). Memory-bound: the table streams once per call. Parallel
    over blocks of JB = 4 rows; per row, 16-lane partial sums of d · (x · q) (summed at the end:
    a fixed order, ≈1e-6 relative from the dequantise-then-matmul reference). Each task prefetches
    the rows of the task PREFETCH_AHEAD on."""
    M, K2 = _check_rows(a_shape, c_shape, V)
    if K2 != K or K % GROUP or V % 4:
        raise ValueError(f"an NT GEMV needs K a whole number of blocks and V a multiple of 4: K = {K}, V = {V}")
    JB, KB = 4, K // GROUP
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)
    AHEAD, LINES = PREFETCH_AHEAD, -(-JB * K // CACHE_LINE)

    @T.macro
    def accumulate(A, Q, D, part, i, jo):
        for kb in T.serial(KB):
            for h in T.unroll(GROUP // VEC):
                for r in T.unroll(JB):
                    for l in T.vectorized(VEC):
                        part[r, l] = part[r, l] + T.Cast("float32", D[jo * JB + r, kb]) * (
                            A[i * K + kb * GROUP + h * VEC + l]
                            * T.Cast("float32", Q[jo * JB + r, kb * GROUP + h * VEC + l]))

    rows = nt_row_block(M, V, JB, accumulate)

    @T.prim_func(private=True, s_tir=True)
    def gemv_nt_q8(a: T.handle, q: T.handle, d: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        Q = T.match_buffer(q, (V, K), "int8")
        D = T.match_buffer(d, (V, KB), "float16")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((M * K,), "float32", data=A0.data)
        C = T.decl_buffer((M * V,), "float32", data=C0.data)
        QF = T.decl_buffer((V * K,), "int8", data=Q.data)
        for jo in T.parallel(V // JB):
            with T.sblock("gemv_nt_q8"):
                part = T.sblock_alloc_buffer((JB, VEC), "float32", scope="local")
                if jo + AHEAD < V // JB:  # the rows AHEAD tasks on, requested now (see PREFETCH_AHEAD)
                    for line in T.serial(LINES):
                        prefetch(QF, (jo + AHEAD) * JB * K + line * CACHE_LINE)
                rows(A, Q, D, C, part, jo)

    return gemv_nt_q8


# ---- GPU targets: unscheduled definitions that dlight schedules (backend/gpu_schedule.py) -------------
# On a GPU the weights keep GGML's row layout — quants [N, Kp/2] uint8 (Q4_1; quants 2j and 2j + 1
# in byte j: dlight's GEMV rule does not follow GGML's i / i + 16 pairing) or [N, Kp] int8 (Q8_0),
# scales (and minima) [N, Kp/32] float32 (the float16 values widened, exactly: not every OpenCL
# device has cl_khr_fp16) — and the kernels are
# plain compute definitions, a dequantise stage feeding a matmul, which TVM's dlight GEMV /
# Matmul rules schedule with the dequantisation inlined (MLC-LLM's q4f32_1 scheme).

def gpu_row_shapes(fmt: WeightFormat, K: int, N: int) -> list[tuple[tuple[int, ...], str]]:
    KP = padded(K, GROUP)
    shapes = [((N, KP // 2 if fmt.bits == 4 else KP), fmt.quant_dtype), ((N, KP // GROUP), "float32")]
    if fmt.has_min:
        shapes.append(((N, KP // GROUP), "float32"))
    return shapes


def _dequantized(fmt: WeightFormat, K: int, N: int):
    """(placeholders, ``value(n, k)``: the dequantised weight at row n, column k)."""
    from tvm import te, tirx

    shapes = gpu_row_shapes(fmt, K, N)
    q = te.placeholder(shapes[0][0], shapes[0][1], name="q")
    d = te.placeholder(shapes[1][0], "float32", name="d")
    m = te.placeholder(shapes[2][0], "float32", name="m") if fmt.has_min else None

    def value(n, k):
        if fmt.bits == 4:
            nib = tirx.bitwise_and(tirx.shift_right(q[n, k // 2], tirx.Cast("uint8", k % 2 * 4)),
                                   tirx.const(15, "uint8"))
            return tirx.Cast("float32", nib) * d[n, k // GROUP] + m[n, k // GROUP]
        return tirx.Cast("float32", q[n, k]) * d[n, k // GROUP]

    return [t for t in (q, d, m) if t is not None], value


def build_gpu_quant_matmul(a_shape, fmt: WeightFormat, K: int, N: int):
    """``C[..., N] = A[..., K] · dequant(W)ᵀ`` over row-layout blocks (GEMV when A has one row)."""
    from tvm import te

    a = te.placeholder(tuple(a_shape), "float32", name="a")
    weights, value = _dequantized(fmt, K, N)
    w = te.compute((N, K), value, name="dequantize")  # inlined into the matmul by dlight
    r = te.reduce_axis((0, K), name="k")
    c = te.compute(tuple(a_shape[:-1]) + (N,), lambda *i: te.sum(a[i[:-1] + (r,)] * w[i[-1], r], axis=r),
                   name="matmul")
    return te.create_prim_func([a, *weights, c]).without_attr("global_symbol")


def build_gpu_quant_take(ids_len: int, ids_dtype: str, fmt: WeightFormat, V: int, K: int):
    """``out[t, :] = dequant(table[ids[t], :])`` over row-layout blocks (the embedding lookup)."""
    from tvm import te, tirx

    weights, value = _dequantized(fmt, K, V)
    ids = te.placeholder((ids_len,), ids_dtype, name="ids")
    out = te.compute((ids_len, K), lambda t, k: value(tirx.Cast("int32", ids[t]), k), name="take")
    return te.create_prim_func([*weights, ids, out]).without_attr("global_symbol")
