"""Register-blocked dense kernel ``C[M, N] = A[M, K] · W[K, N]`` (fp32) for the host CPU.

The model's linear layers reach TVM as ``matmul(x, Wᵀ)`` with the weight stored pre-transposed
as [K, N] (``passes/pretranspose_weights.py``). This kernel replaces TVM's legalized loop nest for them (the
``DenseRule`` of ``backend/cpu_schedule.py``):

* parallel over column panels of NR columns (``jo``); per panel, the row blocks ``io`` run in
  sequence, so the K × NR weight panel (≤ 150 KB for SmolLM2) stays in L2 while all M rows use
  it — the weight streams from memory once per call (decode: M = 1, a GEMV that reads W once);
* the panel in MR × NS register tiles sized from the target's vector registers, over K blocks
  that stay in L1 (``register_tile.py``, shared with the quantised GEMMs): per k one broadcast
  of A[i, k] per row and NS / lanes vector loads of W[k, :].

Summation over k is sequential, as in TVM's unscheduled matmul, so results are identical to it
up to FMA contraction.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .register_tile import PANEL_LANES, panel_gemm, subpanel_cols, tile_rows

VEC = PANEL_LANES  # the vector unit of panel widths and of the NT / GEMV kernels' partial sums


def dense_tiles(M: int, K: int, N: int, cores: int = 1) -> tuple[int, int] | None:
    """(MR, NR) for this shape on ``cores`` threads (MR: the register tile's rows, ``register_tile``),
    or None when no tile fits (then the generic
    rule applies). The parallel loop runs over the N / NR column panels, so NR is the widest of
    64 / 32 / 16 whose panel count splits evenly over the cores or is at least 4 per core: 3
    panels of 64 on 2 cores (SmolLM2's k/v projections) leave one core idle for a third of the
    call, so they run as 6 panels of 32; otherwise the wider panel (fewer W loads per FMA)."""
    widths = (256, 128, 64) if M == 1 else (64, 32, 16)
    fits = [c for c in widths if N % c == 0 and N // c >= 2]
    nr = next((c for c in fits if (N // c) % cores == 0 or N // c >= 4 * cores), fits[0] if fits else None)
    if nr is None:
        nr = next((c for c in (64, 32, 16) if N % c == 0), None)
    if nr is None:
        return None
    return tile_rows(M, subpanel_cols(nr)), nr


def packed_shape(K: int, N: int, NR: int) -> tuple[int, int, int]:
    """The packed layout of a [K, N] weight: N / NR column panels, each K × NR and contiguous."""
    return (N // NR, K, NR)


def pack_weight(w, NR: int):
    """numpy [K, N] → [N / NR, K, NR] (``packed_shape``), as the artifact stores it."""
    import numpy as np

    K, N = w.shape
    return np.ascontiguousarray(w.reshape(K, N // NR, NR).transpose(1, 0, 2))


def unpack_weight(p):
    """The inverse of ``pack_weight``: [N / NR, K, NR] → [K, N]."""
    import numpy as np

    nj, K, nr = p.shape
    return np.ascontiguousarray(p.transpose(1, 0, 2).reshape(K, nj * nr))


def build_dense_kernel(a_shape: tuple[int, ...], w_shape: tuple[int, int], c_shape: tuple[int, ...],
                       cores: int = 1, packed_nr: int | None = None):
    """PrimFunc with exactly these buffer shapes (A and C may carry one leading 1-dim: the kernel
    reads and writes them through flat [M·K] / [M·N] views, so one body serves both ranks).

    ``packed_nr``: W arrives packed as [N / NR, K, NR] panels (``pack_weights.py``), so each task
    streams one contiguous block; unpacked, a panel is K rows of NR floats N·4 bytes apart, which
    the hardware prefetchers do not follow across pages (``tools/bench/bench_compiled.py`` times both
    layouts with the weights streamed from memory, as in the model)."""
    *lead, M, K = a_shape
    K2, N = w_shape
    if K2 != K or tuple(c_shape) != (*lead, M, N) or any(d != 1 for d in lead) or len(lead) > 1:
        raise ValueError(f"not a dense shape: {a_shape} x {w_shape} -> {c_shape}")
    if packed_nr:
        if N % packed_nr or packed_nr % VEC:
            raise ValueError(f"N = {N} is not a whole number of {packed_nr}-wide panels")
        tiles = (tile_rows(M, subpanel_cols(packed_nr)), packed_nr)
    else:
        tiles = dense_tiles(M, K, N, cores)
    if tiles is None:
        raise ValueError(f"no register tile fits N = {N}")
    MR, NR = tiles
    NJ = N // NR
    PACKED = bool(packed_nr)
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)
    W_SHAPE = packed_shape(K, N, NR) if PACKED else (K, N)

    NS = subpanel_cols(NR)
    tile = panel_gemm(M, K, N, NR, NS, MR)

    @T.prim_func(private=True, s_tir=True)
    def dense(a: T.handle, w: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        W0 = T.match_buffer(w, W_SHAPE, "float32")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((M * K,), "float32", data=A0.data)
        W = T.decl_buffer((K * N,), "float32", data=W0.data)
        C = T.decl_buffer((M * N,), "float32", data=C0.data)
        for jo in T.parallel(NJ):
            with T.sblock("dense"):
                T.reads(A[0:M * K], W[0:K * N])
                T.writes(C[0:M * N])
                acc = T.sblock_alloc_buffer((MR, NS), "float32", scope="local")
                if PACKED:  # panel jo: K rows of NR, contiguous ([N / NR, K, NR])
                    tile(A, W, C, acc, jo, jo * K * NR, NS, NR)
                else:  # row k, columns of panel jo: [K, N]
                    tile(A, W, C, acc, jo, jo * NR, NS, N)

    return dense


def build_packed_gemv_kernel(a_shape: tuple[int, ...], w_shape: tuple[int, int], c_shape: tuple[int, ...],
                             packed_nr: int):
    """``C[(1,) 1, N] = x · W`` with W packed as [N / NR, K, NR] (decode, memory-bound, the same
    weight parameter as the prefill GEMM): parallel over panels, each streamed once as one
    contiguous block into NR / 16 vector accumulators. Summation over k is sequential, as in the
    unscheduled matmul."""
    *lead, M, K = a_shape
    K2, N = w_shape
    NR = int(packed_nr)
    if M != 1 or K2 != K or tuple(c_shape) != (*lead, M, N) or any(d != 1 for d in lead) or N % NR or NR % VEC:
        raise ValueError(f"not a packed GEMV shape: {a_shape} x {w_shape} ({NR}-wide panels) -> {c_shape}")
    NJ = N // NR
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)

    @T.prim_func(private=True, s_tir=True)
    def gemv_packed(a: T.handle, w: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        W = T.match_buffer(w, (NJ, K, NR), "float32")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((K,), "float32", data=A0.data)
        C = T.decl_buffer((N,), "float32", data=C0.data)
        for jo in T.parallel(NJ):
            with T.sblock("gemv_panel"):
                T.reads(A[0:K], W[jo, 0:K, 0:NR])
                T.writes(C[jo * NR:jo * NR + NR])
                acc = T.sblock_alloc_buffer((NR,), "float32", scope="local")
                for j in T.vectorized(NR):
                    acc[j] = T.float32(0)
                for k in T.serial(K):
                    for j in T.vectorized(NR):
                        acc[j] = acc[j] + A[k] * W[jo, k, j]
                for j in T.vectorized(NR):
                    C[jo * NR + j] = acc[j]

    return gemv_packed


def nt_row_block(M: int, N: int, JB: int, accumulate):
    """The body of an NT GEMV task (the tied LM head: fp32 table here, Q8_0 in ``quant_dense``):
    for each of the M rows of A, JB output columns as JB × VEC partial sums — zeroed, filled by
    ``accumulate(A, W, scales, part, i, jo)`` (the table format's dot products over K), then
    folded lane by lane into ``C[i, jo·JB : jo·JB + JB]``. A macro ``rows(A, W, scales, C, part, jo)``."""

    @T.macro
    def rows(A, W, scales, C, part, jo):
        for i in T.serial(M):
            for r in T.unroll(JB):
                for l in T.vectorized(VEC):
                    part[r, l] = T.float32(0)
            accumulate(A, W, scales, part, i, jo)
            for r in T.unroll(JB):
                C[i * N + jo * JB + r] = T.float32(0)
                for l in T.serial(VEC):
                    C[i * N + jo * JB + r] = C[i * N + jo * JB + r] + part[r, l]

    return rows


def build_dense_nt_kernel(a_shape: tuple[int, ...], w_shape: tuple[int, int], c_shape: tuple[int, ...]):
    """``C[(1,) M, N] = A[(1,) M, K] · W[N, K]ᵀ`` — the tied LM head (the embedding table read
    row-wise after FuseTransposeMatmul; M = 1 since only the last token's logits are needed).
    Memory-bound: the table streams once. Parallel over blocks of JB = 4 output columns; each
    dot product runs as 16-lane partial sums over K (vectorised; summed at the end — a fixed,
    different summation order from the sequential loop, ~1e-6 relative)."""
    *lead, M, K = a_shape
    N, K2 = w_shape
    if K2 != K or tuple(c_shape) != (*lead, M, N) or any(d != 1 for d in lead) or len(lead) > 1:
        raise ValueError(f"not an NT dense shape: {a_shape} x {w_shape}ᵀ -> {c_shape}")
    if K % VEC or N % 4:
        raise ValueError("K must be a multiple of 16 and N of 4")
    JB, KC = 4, K // VEC
    NJ = N // JB
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)

    @T.macro
    def accumulate(A, W, _scales, part, i, jo):
        for k0 in T.serial(KC):
            for r in T.unroll(JB):
                for l in T.vectorized(VEC):
                    part[r, l] = part[r, l] + A[i * K + k0 * VEC + l] * W[jo * JB + r, k0 * VEC + l]

    rows = nt_row_block(M, N, JB, accumulate)

    @T.prim_func(private=True, s_tir=True)
    def dense_nt(a: T.handle, w: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        W = T.match_buffer(w, (N, K), "float32")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((M * K,), "float32", data=A0.data)
        C = T.decl_buffer((M * N,), "float32", data=C0.data)
        for jo in T.parallel(NJ):
            with T.sblock("dense_nt"):
                T.reads(A[0:M * K], W[jo * JB:jo * JB + JB, 0:K])
                T.writes(C[0:M * N])
                part = T.sblock_alloc_buffer((JB, VEC), "float32", scope="local")
                rows(A, W, None, C, part, jo)

    return dense_nt


def gemv_parts(K: int) -> int:
    return next((p for p in (4, 2) if K % p == 0 and K // p >= 16), 1)


def build_gemv_kernel(a_shape: tuple[int, ...], w_shape: tuple[int, int], c_shape: tuple[int, ...]):
    """``C[(1,) 1, N] = x[(1,) 1, K] · W[K, N]`` (decode, memory-bound): split-K, so every task
    streams P contiguous row ranges of W (whole rows: one sequential stream, which the hardware
    prefetcher follows at full bandwidth, unlike column panels); partial rows [P, N] are summed
    at the end (a different but fixed summation order: ~1e-7 relative)."""
    *lead, M, K = a_shape
    K2, N = w_shape
    if M != 1 or K2 != K or tuple(c_shape) != (*lead, M, N) or any(d != 1 for d in lead) or N % VEC:
        raise ValueError(f"not a GEMV shape: {a_shape} x {w_shape} -> {c_shape}")
    P = gemv_parts(K)
    KP, NC = K // P, N // VEC
    A_SHAPE, C_SHAPE = tuple(a_shape), tuple(c_shape)

    @T.prim_func(private=True, s_tir=True)
    def gemv(a: T.handle, w: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        A0 = T.match_buffer(a, A_SHAPE, "float32")
        W = T.match_buffer(w, (K, N), "float32")
        C0 = T.match_buffer(c, C_SHAPE, "float32")
        A = T.decl_buffer((K,), "float32", data=A0.data)
        C = T.decl_buffer((N,), "float32", data=C0.data)
        part = T.alloc_buffer((P, N), "float32")
        for p in T.parallel(P):
            with T.sblock("gemv_part"):
                T.reads(A[p * KP:p * KP + KP], W[p * KP:p * KP + KP, 0:N])
                T.writes(part[p, 0:N])
                for j0 in T.serial(NC):
                    for l in T.vectorized(VEC):
                        part[p, j0 * VEC + l] = T.float32(0)
                for k in T.serial(KP):
                    for j0 in T.serial(NC):
                        for l in T.vectorized(VEC):
                            part[p, j0 * VEC + l] = part[p, j0 * VEC + l] + A[p * KP + k] * W[p * KP + k, j0 * VEC + l]
        for j0 in T.serial(NC):
            with T.sblock("gemv_sum"):
                T.reads(part[0:P, j0 * VEC:j0 * VEC + VEC])
                T.writes(C[j0 * VEC:j0 * VEC + VEC])
                for l in T.vectorized(VEC):
                    C[j0 * VEC + l] = part[0, j0 * VEC + l]
                for p in T.serial(P - 1):
                    for l in T.vectorized(VEC):
                        C[j0 * VEC + l] = C[j0 * VEC + l] + part[p + 1, j0 * VEC + l]

    return gemv
