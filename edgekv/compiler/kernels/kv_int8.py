"""The int8 KV cache's kernels (``--kv-dtype int8``, compiled): the format of ``engine/kv_quant.py``
— per token, per 32 channels, symmetric int8 codes with a float16 scale rounded up — as TIR.

The rule is the eager engine's: quantise on write, every reader sees dequantised rows. At every
attention site the block-cache pass (``passes/rewrite_block_cache.py``, ``passes/int8_cache.py``) places

  * ``dequantize`` ×2: the layer's codes and scales → fp32 K/V [H, N, d], a transient of one layer
    that every existing kernel (attention, score, observe, select, D2O's merge, RocketKV's stage 2)
    reads as it reads an fp32 cache;
  * ``round_trip`` ×2: the block's K/V → dequantize(quantize(·)), what the cache will hold, so the
    block's own rows are read quantised too;
  * ``copy_positions``: the positions before select + compaction rewrites them in place;
  * ``store`` ×2, after select + compaction: the compacted fp32 K/V → the layer's codes and scales,
    in place — a row the step kept moves its codes, a new or rewritten row is quantised.

Quantising a dequantised row gives back its codes and scales bit for bit: its scale s was rounded
up so that its largest code is ±127, so the group's peak is 127·s (exact in float32), 127·s / 127
= s, and q·s / s = q. So moving a kept row's codes and quantising its dequantised values agree:
``store``'s search for the row's old codes is a shortcut that cannot change a bit, rows kept
across a step keep their codes (as the eager cache's compaction moves them), block rows get the
codes the eager ``LayerCache.write`` gives them, and a row a policy rewrote (D2O's merge) is
quantised on write. The price is one dequantising pass over the layer's K/V per step and one
pass that compares and moves; kernels that read the codes themselves would save both (not done:
every policy's kernels would need an int8 twin).

A kernel takes [H, R, ·] tensors — the cache's (R = N), or the block's viewed as [H, B, ·] — and
runs over the H·R rows in parallel, one group of a row at a time (a group's scale needs only its
own channels): its max as a balanced tree, its scale in scalar code, its codes as one vector
(x / s, rounding, clamping). A shorter last group (d not a multiple of 32) is its own call.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...memory import INT8_GROUP, int8_scale_groups

CODE_LIMIT = 127
FLOAT16_MAX = 65504.0
GS = INT8_GROUP


def _tree_max(values: list):
    """max of ``values`` (PrimExprs) as a balanced tree: log2(n) dependent steps, not n."""
    while len(values) > 1:
        values = [T.max(values[k], values[k + 1]) if k + 1 < len(values) else values[k]
                  for k in range(0, len(values), 2)]
    return values[0]


def _group_macro(write_codes: bool):
    """``group(x, h, n, g, width, out, scales)`` for group ``g`` (``width`` ≤ 32 channels, a Python
    int) of row (h, n) of ``x`` [H, R, D]: its float16 scale s (``kv_quant.quantize_rows``: max|x| /
    127 to nearest, then one float16 step up when that leaves s·127 under max|x|) and codes
    q = round(x / s) ∈ [−127, 127]; ``write_codes``: the codes to ``out`` (int8) and s to ``scales``
    [H, R, G], else x̂ = s·q to ``out`` (float32; ``scales`` unused). No scratch buffers: scratch
    inside the parallel loop would be a workspace allocation per row."""

    @T.macro
    def group(x, h, n, g, width, out, scales):
        peak: T.let[T.float32] = _tree_max([T.fabs(x[h, n, g * GS + c]) for c in range(width)])
        nearest: T.let[T.float16] = T.Cast("float16", T.min(peak / T.float32(CODE_LIMIT), T.float32(FLOAT16_MAX)))
        step: T.let[T.float16] = T.if_then_else(
            T.Cast("float32", nearest) * T.float32(CODE_LIMIT) < peak and nearest < T.float16(FLOAT16_MAX),
            T.reinterpret("float16", T.reinterpret("int16", nearest) + T.int16(1)), nearest)
        s: T.let[T.float32] = T.Cast("float32", step)
        safe: T.let[T.float32] = T.if_then_else(s > T.float32(0), s, T.float32(1))  # an all-zero group: codes 0
        if write_codes:
            scales[h, n, g] = step
        for c in T.vectorized(width):
            if write_codes:
                out[h, n, g * GS + c] = T.Cast("int8", T.max(T.min(T.nearbyint(x[h, n, g * GS + c] / safe),
                                                                   T.float32(CODE_LIMIT)), T.float32(-CODE_LIMIT)))
            else:
                out[h, n, g * GS + c] = T.max(T.min(T.nearbyint(x[h, n, g * GS + c] / safe), T.float32(CODE_LIMIT)),
                                              T.float32(-CODE_LIMIT)) * s

    return group


def build_dequantize_kernel(num_kv_heads: int, rows: int, head_dim: int):
    """``dequantize(codes [H, R, d] int8, scales [H, R, G] float16, out [H, R, d] float32)``:
    out = s·q, exact."""
    H, R, D, G = num_kv_heads, rows, head_dim, int8_scale_groups(head_dim)

    @T.prim_func(private=True, s_tir=True)
    def dequantize_kv(codes: T.Buffer((H, R, D), "int8"), scales: T.Buffer((H, R, G), "float16"),
                      out: T.Buffer((H, R, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(H * R):
            with T.sblock("dequantize"):
                T.reads(codes[t // R, t % R, 0:D], scales[t // R, t % R, 0:G])
                T.writes(out[t // R, t % R, 0:D])
                for c in T.vectorized(D):
                    out[t // R, t % R, c] = (T.Cast("float32", codes[t // R, t % R, c])
                                             * T.Cast("float32", scales[t // R, t % R, c // GS]))

    return dequantize_kv


def build_round_trip_kernel(num_kv_heads: int, rows: int, head_dim: int):
    """``round_trip(x [H, R, d] float32, out [H, R, d] float32)``: dequantize(quantize(x)) — what
    an int8 cache gives back for rows ``x`` (``kv_quant.round_trip``)."""
    H, R, D, G = num_kv_heads, rows, head_dim, int8_scale_groups(head_dim)
    FULL, TAIL = D // GS, D % GS  # whole groups, then a shorter last one
    group = _group_macro(write_codes=False)

    @T.prim_func(private=True, s_tir=True)
    def round_trip_kv(x: T.Buffer((H, R, D), "float32"), out: T.Buffer((H, R, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(H * R):
            with T.sblock("round_trip"):
                T.reads(x[t // R, t % R, 0:D])
                T.writes(out[t // R, t % R, 0:D])
                for g in T.serial(FULL):
                    group(x, t // R, t % R, g, GS, out, None)
                if TAIL > 0:
                    group(x, t // R, t % R, FULL, TAIL, out, None)

    return round_trip_kv


def build_copy_positions_kernel(num_kv_heads: int, rows: int):
    """``copy_positions(pos [H, R] int32, out [H, R] int32)``: the cache's positions before a step
    compacts them in place (``build_store_kernel`` finds each kept row's old codes by them)."""
    H, R = num_kv_heads, rows

    @T.prim_func(private=True, s_tir=True)
    def copy_positions(pos: T.Buffer((H, R), "int32"), out: T.Buffer((H, R), "int32")):
        T.func_attr({"tirx.noalias": True})
        for h in T.parallel(H):
            with T.sblock("copy"):
                for n in T.vectorized(R):
                    out[h, n] = pos[h, n]

    return copy_positions


def build_store_kernel(num_kv_heads: int, rows: int, head_dim: int):
    """``store(x [H, N, d] float32, pos [H, N] int32, fill [1] int32, pos_before [H, N] int32,
    codes [H, N, d] int8, scales [H, N, G] float16)``, in place on codes and scales: rows [0, fill)
    of the compacted fp32 view ``x`` into the cache's int8 rows.

    A row that was in the cache before the step (its position found in ``pos_before`` at an index
    i ≥ its new index, whose stored row dequantises to exactly x's) has its codes and scales moved
    from row i; any other row — a block row, or one a merging policy rewrote — is quantised. Moving
    gives the bits quantising would (re-quantising a dequantised row is exact, module docstring): the
    match is only a shortcut, so a row it misses is still right. Compaction only moves rows down and
    keeps their order, so one pass per head with a pointer into the old positions finds them, and
    reading row i ≥ j before row j is written keeps it in place."""
    H, N, D, G = num_kv_heads, rows, head_dim, int8_scale_groups(head_dim)
    FULL, TAIL = D // GS, D % GS
    group = _group_macro(write_codes=True)

    @T.prim_func(private=True, s_tir=True)
    def store_kv(x: T.Buffer((H, N, D), "float32"), pos: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
                 pos_before: T.Buffer((H, N), "int32"), codes: T.Buffer((H, N, D), "int8"),
                 scales: T.Buffer((H, N, G), "float16")):
        T.func_attr({"tirx.noalias": True})
        for h in T.parallel(H):
            with T.sblock("store"):
                T.reads(x[h, 0:N, 0:D], pos[h, 0:N], fill[0:1], pos_before[h, 0:N])
                T.writes(codes[h, 0:N, 0:D], scales[h, 0:N, 0:G])
                src = T.sblock_alloc_buffer((1,), "int32")
                differ = T.sblock_alloc_buffer((1,), "int32")
                src[0] = 0
                for j in T.serial(N):
                    if j < fill[0]:
                        while src[0] < N - 1 and pos_before[h, src[0]] < pos[h, j]:
                            src[0] = src[0] + 1
                        differ[0] = T.Cast("int32", src[0] < j or pos_before[h, src[0]] != pos[h, j])
                        if differ[0] == 0:
                            for c in T.serial(D):
                                differ[0] = differ[0] + T.Cast("int32", x[h, j, c] != T.Cast(
                                    "float32", codes[h, src[0], c]) * T.Cast("float32", scales[h, src[0], c // GS]))
                        if differ[0] == 0:
                            if src[0] != j:
                                for c in T.vectorized(D):
                                    codes[h, j, c] = codes[h, src[0], c]
                                for g in T.serial(G):
                                    scales[h, j, g] = scales[h, src[0], g]
                        else:
                            for g in T.serial(FULL):
                                group(x, h, j, g, GS, codes, scales)
                            if TAIL > 0:
                                group(x, h, j, FULL, TAIL, codes, scales)

    return store_kv
