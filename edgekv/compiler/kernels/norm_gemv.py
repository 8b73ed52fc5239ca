"""GPU decode: RMSNorm folded into the quantised GEMV that reads it, with the GEMV's consumers in
its epilogue — one launch where TVM's fusion makes several (``passes/norm_gemv.py`` rewrites the
graph to call these).

Both kernels share one skeleton: a work-group of ``THREADS`` work-items per *pair* of output rows.
Every work-group first computes its row's sum of squares itself (the activation is one row of K,
read by every work-group; K is small, and this saves the norm's launch and its round trip), then
the two dequantising dot products of its rows over ``x · rsqrt(Σx²/K + eps) · w`` (the order
TVM's ``rms_norm`` computes), each reduced across the work-items through shared memory, then
work-item 0 applies the epilogue to the pair:

* ``build_norm_qkv_rope_gpu``: the combined q / k / v projection (``combine_projections.py``).
  Pair = rows (i, i + d/2) of one head, so RoPE — HF's ``x · cos + rotate_half(x) · sin`` — is
  applied in the epilogue, and q, k (rotated) and v are written straight in the ``[1, heads, 1,
  d]`` layout the attention and the score read: the norm, the GEMV, RoPE on q, RoPE on k and the
  v copy were five launches.
* ``build_norm_gate_up_silu_gpu``: the combined gate / up projection; pair = rows (j, I + j), the
  epilogue ``g · sigmoid(g) · u`` (as ``gate_up_silu.py``): the norm and that kernel were two.

Sums run in a different order than the unfused kernels' (per work-item strided partial sums, then
a tree), so values differ from them by float rounding only."""

from __future__ import annotations

from tvm.script import tirx as T

from ..quant_formats import WeightFormat
from .quant_dense import gpu_row_shapes
from .signature import kernel_attrs

THREADS = 64  # work-items per pair of rows (a power of two: the tree reduction halves it)


def _norm_pair_macro(fmt: WeightFormat, K: int, eps: float):
    """``norm_pair(a, nw, q, d, m, n0, n1, tx, red, acc)``: run by all THREADS work-items alike; on
    return work-item 0's ``acc[1]`` and ``acc[2]`` hold rows n0's and n1's dot products with
    ``a · rsqrt(Σa²/K + eps) · nw`` (partials summed from shared memory, not by an in-place tree:
    TVM's barrier planner cannot prove a tree's halves disjoint)."""
    NT = THREADS
    STEPS = (K + NT - 1) // NT
    q4 = fmt.bits == 4

    @T.macro
    def norm_pair(a, nw, q, d, m, n0, n1, tx, red, acc):
        acc[0] = T.float32(0)
        for s in T.serial(STEPS):
            if s * NT + tx < K:
                acc[0] = acc[0] + a[0, 0, s * NT + tx] * a[0, 0, s * NT + tx]
        red[tx] = acc[0]
        T.tvm_storage_sync("shared")
        acc[0] = T.float32(0)
        for t in T.serial(NT):  # every work-item sums the partials itself: no in-place tree, one barrier
            acc[0] = acc[0] + red[t]
        acc[0] = T.rsqrt(acc[0] / T.float32(K) + T.float32(eps))
        acc[1] = T.float32(0)
        acc[2] = T.float32(0)
        for s in T.serial(STEPS):
            if s * NT + tx < K:
                acc[3] = a[0, 0, s * NT + tx] * acc[0] * nw[s * NT + tx]
                if q4:
                    acc[1] = acc[1] + acc[3] * (T.Cast("float32", T.bitwise_and(
                        T.shift_right(q[n0, (s * NT + tx) // 2], T.Cast("uint8", (s * NT + tx) % 2 * 4)), T.uint8(15)))
                        * d[n0, (s * NT + tx) // 32] + m[n0, (s * NT + tx) // 32])
                    acc[2] = acc[2] + acc[3] * (T.Cast("float32", T.bitwise_and(
                        T.shift_right(q[n1, (s * NT + tx) // 2], T.Cast("uint8", (s * NT + tx) % 2 * 4)), T.uint8(15)))
                        * d[n1, (s * NT + tx) // 32] + m[n1, (s * NT + tx) // 32])
                else:
                    acc[1] = acc[1] + acc[3] * (T.Cast("float32", q[n0, s * NT + tx]) * d[n0, (s * NT + tx) // 32])
                    acc[2] = acc[2] + acc[3] * (T.Cast("float32", q[n1, s * NT + tx]) * d[n1, (s * NT + tx) // 32])
        red[NT + tx] = acc[1]
        red[2 * NT + tx] = acc[2]
        T.tvm_storage_sync("shared")
        if tx == 0:
            acc[1] = T.float32(0)
            acc[2] = T.float32(0)
            for t in T.serial(NT):
                acc[1] = acc[1] + red[NT + t]
                acc[2] = acc[2] + red[2 * NT + t]

    return norm_pair


def _signature(fmt: WeightFormat, K: int, N: int, body, outs: list[tuple[str, tuple[int, ...]]], extra: bool):
    """The PrimFunc ``(a [1,1,K], nw [K], q, d[, m][, cos, sin], *outs)``: ``body`` gets the
    buffers in that order (None for an absent one)."""
    (qs, qdt), (ds, _), *_ = gpu_row_shapes(fmt, K, N)
    attrs = kernel_attrs(True)
    (n1, s1), (n2, s2), (n3, s3) = (outs + [("", ())] * 3)[:3]
    if extra:  # q / k / v with RoPE: cos, sin and three outputs
        if fmt.has_min:
            @T.prim_func(private=True, s_tir=True)
            def fused(a: T.Buffer((1, 1, K), "float32"), nw: T.Buffer((K,), "float32"), q: T.Buffer(qs, qdt),
                      d: T.Buffer(ds, "float32"), m: T.Buffer(ds, "float32"), cos: T.Buffer((1, 1, 1, s1[-1]), "float32"),
                      sin: T.Buffer((1, 1, 1, s1[-1]), "float32"), o1: T.Buffer(s1, "float32"),
                      o2: T.Buffer(s2, "float32"), o3: T.Buffer(s3, "float32")):
                T.func_attr(attrs)
                body(a, nw, q, d, m, cos, sin, o1, o2, o3)

            return fused

        @T.prim_func(private=True, s_tir=True)
        def fused_nomin(a: T.Buffer((1, 1, K), "float32"), nw: T.Buffer((K,), "float32"), q: T.Buffer(qs, qdt),
                        d: T.Buffer(ds, "float32"), cos: T.Buffer((1, 1, 1, s1[-1]), "float32"),
                        sin: T.Buffer((1, 1, 1, s1[-1]), "float32"), o1: T.Buffer(s1, "float32"),
                        o2: T.Buffer(s2, "float32"), o3: T.Buffer(s3, "float32")):
            T.func_attr(attrs)
            body(a, nw, q, d, None, cos, sin, o1, o2, o3)

        return fused_nomin
    if fmt.has_min:
        @T.prim_func(private=True, s_tir=True)
        def fused_one(a: T.Buffer((1, 1, K), "float32"), nw: T.Buffer((K,), "float32"), q: T.Buffer(qs, qdt),
                      d: T.Buffer(ds, "float32"), m: T.Buffer(ds, "float32"), o1: T.Buffer(s1, "float32")):
            T.func_attr(attrs)
            body(a, nw, q, d, m, None, None, o1, None, None)

        return fused_one

    @T.prim_func(private=True, s_tir=True)
    def fused_one_nomin(a: T.Buffer((1, 1, K), "float32"), nw: T.Buffer((K,), "float32"), q: T.Buffer(qs, qdt),
                        d: T.Buffer(ds, "float32"), o1: T.Buffer(s1, "float32")):
        T.func_attr(attrs)
        body(a, nw, q, d, None, None, None, o1, None, None)

    return fused_one_nomin


def build_norm_qkv_rope_gpu(fmt: WeightFormat, K: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            eps: float):
    """``(q, k, v) = rope(rms_norm(a, nw) · Wqkvᵀ)`` in the attention's layout ``[1, heads, 1, d]``
    (q and k rotated with ``cos`` / ``sin`` ``[1, 1, 1, d]``; rows 0..Hq·d of the combined weight
    are q, then H·d of k, then H·d of v). A work-group per pair of rows (i, i + d/2) of a head."""
    Hq, H, D = num_q_heads, num_kv_heads, head_dim
    if D % 2:
        raise ValueError(f"norm + q/k/v + RoPE: head_dim {D} is odd")
    HALF = D // 2
    NT = THREADS
    PQ, PK = Hq * HALF, H * HALF
    norm_pair = _norm_pair_macro(fmt, K, eps)

    @T.macro
    def body(a, nw, q, d, m, cos, sin, q_out, k_out, v_out):
        for p in T.thread_binding(PQ + 2 * PK, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("norm_qkv_rope"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((3 * NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    # pair p: segment (q, k, v), head within it, row i < d/2; rows n0 = i and n0 + d/2
                    seg: T.let[T.int32] = T.Select(p < PQ, 0, T.Select(p < PQ + PK, 1, 2))
                    rel: T.let[T.int32] = p - T.Select(seg == 0, 0, T.Select(seg == 1, PQ, PQ + PK))
                    head: T.let[T.int32] = rel // HALF
                    i: T.let[T.int32] = rel % HALF
                    n0: T.let[T.int32] = T.Select(seg == 0, 0, T.Select(seg == 1, Hq * D, (Hq + H) * D)) + head * D + i
                    norm_pair(a, nw, q, d, m, n0, n0 + HALF, tx, red, acc)
                    if tx == 0:
                        if seg == 0:  # x·cos + rotate_half(x)·sin, rotate_half = (−x[d/2:], x[:d/2])
                            q_out[0, head, 0, i] = acc[1] * cos[0, 0, 0, i] + (-acc[2]) * sin[0, 0, 0, i]
                            q_out[0, head, 0, i + HALF] = (acc[2] * cos[0, 0, 0, i + HALF]
                                                           + acc[1] * sin[0, 0, 0, i + HALF])
                        elif seg == 1:
                            k_out[0, head, 0, i] = acc[1] * cos[0, 0, 0, i] + (-acc[2]) * sin[0, 0, 0, i]
                            k_out[0, head, 0, i + HALF] = (acc[2] * cos[0, 0, 0, i + HALF]
                                                           + acc[1] * sin[0, 0, 0, i + HALF])
                        else:
                            v_out[0, head, 0, i] = acc[1]
                            v_out[0, head, 0, i + HALF] = acc[2]

    return _signature(fmt, K, (Hq + 2 * H) * D, body,
                      [("q", (1, Hq, 1, D)), ("k", (1, H, 1, D)), ("v", (1, H, 1, D))], extra=True)


def build_norm_gate_up_silu_gpu(fmt: WeightFormat, K: int, inter: int, eps: float):
    """``out[0, 0, j] = silu(g_j) · u_j`` with (g, u) = rms_norm(a, nw) · [Wg; Wu]ᵀ (rows j and
    I + j of the combined weight): a work-group per j."""
    I, NT = inter, THREADS
    norm_pair = _norm_pair_macro(fmt, K, eps)

    @T.macro
    def body(a, nw, q, d, m, cos, sin, out, o2, o3):
        for j in T.thread_binding(I, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("norm_gate_up_silu"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((3 * NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    norm_pair(a, nw, q, d, m, j, I + j, tx, red, acc)
                    if tx == 0:
                        out[0, 0, j] = acc[1] * T.sigmoid(acc[1]) * acc[2]

    return _signature(fmt, K, 2 * I, body, [("out", (1, 1, I))], extra=False)
