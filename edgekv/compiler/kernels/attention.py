"""Block attention over cache ⊕ block, as one tiled online-softmax TIR kernel.

Query row i of the block (i < n_valid) attends to every valid cache row (they are all older
than the block) and to block rows j ≤ i (causal inside the block). Rows i ≥ n_valid are padding:
their output is zero. GQA: query head h reads KV head h // (Hq / H).

Pseudo rows (DapQ, ``extra_rows`` = w): the step has B + w rows, the last w are pseudo tokens.
They see the valid cache rows, the real rows [0, n_valid) (never the padding between n_valid and
B) and the pseudo rows up to their own; the real rows never see them (causal: they come last).

Schedule (written into the kernel; the CPU analogue of a flash-attention tile loop):

* the G = Hq / H query heads that share a KV head are one row space of G·B rows; it is cut
  into tiles of QT rows, and the loop over (KV head, row tile) is the parallel outer loop;
* per tile the keys are visited in tiles of KT keys — one loop: cache tiles up to ``fill``,
  then block tiles up to the tile's last causal row; a key is visible iff its index in the tile
  is ≤ a per-(tile, row) limit (fill, or causality). A key tile is transposed once into a local
  [d, KT] buffer (and its V rows copied to [KT, d]), so S = Q·Kᵀ runs vectorised over keys
  with RB query rows register-blocked; the softmax is online (running max m, sum l, rescaled
  accumulator O) with its row max / sum reduced across the 16 lanes as a halving tree (a chain
  of 16 dependent scalar ops per row and tile cost ~30 % of the kernel); P·V runs vectorised
  over d with RB rows sharing each V row load;
* memory per task: QT·d (queries, pre-scaled) + d·KT + QT·KT + QT·d floats — never a full
  score matrix (the old kernel kept N + B scores per row).

Summation order differs from a plain softmax (tile-wise max and rescaling); results agree to
~1e-6 relative (``tests/test_compiler_kernels.py`` holds it against a numpy oracle). Key rows
past ``fill`` inside the last cache tile are read but masked (−inf score, weight exactly 0);
their *values* are multiplied by that 0, so V rows past ``fill`` must be finite (the runtime
zero-initialises the cache and compaction leaves finite stale rows).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import NEG_BIG, check_dtype
from .signature import StepShapes, attention_kernel, window_attention_kernel



def vexp(x):
    """exp(x) for fp32 as plain arithmetic, so LLVM vectorises it (``T.exp`` becomes one libm
    call per lane): x = n·ln2 + r with |r| ≤ ln2/2 (two-constant reduction), a degree-7
    polynomial for e^r, 2^n built in the exponent bits. Max rel. error ~2e-7; x ≤ −88.38
    (including −inf) gives exactly 0. ``x`` may be a vector (``float32xL``, as an intrinsic
    lowering sees it after vectorisation): the constants take its lanes."""
    from tvm import tirx

    dt = str(getattr(x, "ty", "float32"))
    lanes = dt[len("float32"):]  # "" or "x16"
    f32 = lambda v: tirx.const(v, dt)  # noqa: E731
    i32 = lambda v: tirx.const(v, "int32" + lanes)  # noqa: E731
    xc = tirx.max(tirx.min(x, f32(88.3762626647949)), f32(-88.3762626647949))
    n = tirx.floor(xc * f32(1.44269504088896341) + f32(0.5))
    r = xc - n * f32(0.693359375) + n * f32(2.12194440e-4)
    p = f32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f32(c)
    p = p * r * r + r + f32(1.0)
    bits = tirx.shift_left(tirx.Cast("int32" + lanes, n) + i32(127), i32(23))
    return p * tirx.reinterpret(dt, bits)


def _largest_divisor(n: int, candidates) -> int:
    for c in candidates:
        if c <= n and n % c == 0:
            return c
    return 1


MAX_QT = 192  # rows per task: its qs / s / o tiles (≤ 150 KB at d = 64) stay in L2


def attention_tiles(num_q_heads: int, num_kv_heads: int, block: int, head_dim: int, cores: int = 1) -> dict[str, int]:
    """Tile sizes of the kernel for these shapes (QT rows per task, KT keys per tile, RB rows
    per register block, VL vector lanes) on ``cores`` threads.

    Every key tile is transposed once per task and then serves QT rows, so larger row tiles
    amortise it (SmolLM2, one thread: QT = 64 → 53 GFLOP/s, 128 → 78, 192 → 82). QT is the
    largest divisor of the G·B rows up to ``MAX_QT`` whose task count H·G·B / QT splits evenly
    over the cores (SmolLM2 on 2 cores: 192 rows, 6 tasks); a tile may span two query heads,
    which only costs visiting the block's key tiles that causality would have skipped."""
    G = num_q_heads // num_kv_heads
    rows = G * block
    if block > 1:
        divisors = [d for d in range(min(rows, MAX_QT), 0, -1) if rows % d == 0]
        QT = next((d for d in divisors if (num_kv_heads * rows // d) % max(1, cores) == 0), divisors[0])
    else:
        QT = rows
    RB = _largest_divisor(QT, (4, 3, 2))
    return {"QT": QT, "KT": 64, "RB": RB, "VL": 16 if head_dim % 16 == 0 else (8 if head_dim % 8 == 0 else 1)}


def block_key_visible(key, row, n_valid, real_rows: int, extra_rows: int):
    """Whether block row ``row`` sees block key ``key`` (tirx expressions): causal (key ≤ row), and
    with ``extra_rows`` pseudo rows after ``real_rows`` real ones, the padding keys
    [n_valid, real_rows) are hidden from the pseudo rows (real rows never reach them: key ≤ row <
    n_valid). Without extra rows it is exactly ``key <= row``."""
    from tvm import tirx

    if not extra_rows:
        return key <= row
    return tirx.all(key <= row, tirx.any(key < n_valid, key >= real_rows))


def build_block_attention_kernel(num_q_heads: int, num_kv_heads: int, budget: int, block: int,
                                 head_dim: int, sm_scale: float, dtype: str = "float32", extra_rows: int = 0,
                                 cores: int = 1, window: int = 0):
    """``block`` rows in all; with ``extra_rows`` = w > 0 the last w of them are pseudo rows (DapQ):
    they see every valid cache row, the real rows [0, n_valid) and the pseudo rows up to their own
    (causal), and their output is kept; real rows never see them (they come last).

    ``window`` > 0: a sliding-window ("local") layer (``window_attention_kernel``'s signature: the
    cache's and the block's positions too). Its cache is a ring (``kernels/window.py``: token p in
    slot p mod window), so slot order is not position order and the window is a bound on positions:
    block row i sees a cache slot iff its position > pos_blk[i] − window, and block row j ≤ i iff
    j ≥ i − window + 1 (the block's positions are contiguous) — its query sees the last ``window``
    positions, itself included, exactly the eager engine's ring mask."""
    from tvm import tirx

    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    W = int(extra_rows)
    if not 0 <= W < B:
        raise ValueError(f"{W} pseudo rows do not fit a step of {B} rows")
    BR = B - W  # real rows
    WIN = int(window)
    RING = WIN > 0  # a Python bool: TVMScript takes it as a static branch
    if WIN and W:
        raise ValueError("a sliding-window layer's attention takes no pseudo rows")

    def tile_key_visible(j, lim, t, ncache, row, nv, nf, kh=None, pos_cache=None, pos_blk=None):
        # j ≤ lim: the cache's fill or causality; with pseudo rows, a block key in the padding
        # [n_valid, BR) is hidden from them too (the cache tiles t < ncache have no padding)
        if WIN:  # and the key no older than the window: a cache slot by its position (a ring),
            # a block key by its index (the block's positions are contiguous)
            in_window = T.if_then_else(t < ncache,
                                       pos_cache[kh, T.min(t * KT + j, N - 1)] > pos_blk[row] - WIN,
                                       j >= row - WIN + 1 - (t - ncache) * KT)
            return tirx.all(j <= lim, in_window)
        if not W:
            return j <= lim
        key = (t - ncache) * KT + j
        return tirx.all(j <= lim, tirx.any(t < ncache, block_key_visible(key, row, nv, BR, W)))
    G = Hq // H
    scale = float(sm_scale)
    t = attention_tiles(Hq, H, B, D, cores)
    QT, KT, RB = t["QT"], t["KT"], t["RB"]
    KL = 16  # lanes of the softmax partials (KT is a multiple)
    LOG_KL = 4
    ROWS = G * B
    NQT = ROWS // QT  # QT divides ROWS (attention_tiles)
    NRB = QT // RB
    # a tile inside one query head covers block rows [i0, i0 + QT): block keys beyond its last
    # row are fully masked and skipped; a tile spanning heads (decode: B = 1) needs all B keys
    IN_HEAD = B % QT == 0

    @T.macro
    def block_attention(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out, pos_cache, pos_blk):
        for task in T.parallel(H * NQT):
            with T.sblock("attn"):
                # explicit regions: automatic inference would reference the block's own let vars
                if RING:
                    T.reads(q[0, 0:Hq, 0:B, 0:D], k_blk[0, 0:H, 0:B, 0:D], v_blk[0, 0:H, 0:B, 0:D],
                            k_cache[0:H, 0:N, 0:D], v_cache[0:H, 0:N, 0:D], fill[0:1], n_valid[0:1],
                            pos_cache[0:H, 0:N], pos_blk[0:B])
                else:
                    T.reads(q[0, 0:Hq, 0:B, 0:D], k_blk[0, 0:H, 0:B, 0:D], v_blk[0, 0:H, 0:B, 0:D],
                            k_cache[0:H, 0:N, 0:D], v_cache[0:H, 0:N, 0:D], fill[0:1], n_valid[0:1])
                T.writes(out[0, 0:Hq, 0:B, 0:D])
                qs = T.sblock_alloc_buffer((QT, D), "float32")
                kt = T.sblock_alloc_buffer((D, KT), "float32")
                vt = T.sblock_alloc_buffer((KT, D), "float32")
                s = T.sblock_alloc_buffer((QT, KT), "float32")
                o = T.sblock_alloc_buffer((QT, D), "float32")
                m = T.sblock_alloc_buffer((QT,), "float32")
                lsum = T.sblock_alloc_buffer((QT,), "float32")
                alpha = T.sblock_alloc_buffer((QT,), "float32")
                part = T.sblock_alloc_buffer((KL,), "float32")
                accs = T.sblock_alloc_buffer((RB, KT), "float32", scope="local")
                acco = T.sblock_alloc_buffer((RB, D), "float32", scope="local")
                kh: T.let[T.int32] = task // NQT
                r0: T.let[T.int32] = (task % NQT) * QT
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                ncache: T.let[T.int32] = (nf + KT - 1) // KT  # key tiles over the cache
                # last block key any row of this tile can see
                jmax: T.let[T.int32] = T.if_then_else(IN_HEAD, (r0 % B) + QT - 1, B - 1)
                for r, c in T.grid(QT, D):
                    qs[r, c] = q[0, kh * G + (r0 + r) // B, (r0 + r) % B, c] * T.float32(scale)
                    o[r, c] = T.float32(0)
                for r in T.serial(QT):
                    m[r] = T.float32(NEG_BIG)
                    lsum[r] = T.float32(0)
                # key tiles: cache rows [0, fill) (no mask), then block rows [0, jmax] (causal)
                for t in T.serial(ncache + (jmax + KT) // KT):
                    # K tile transposed to [d, KT] (keys on the vector lanes), V tile copied, both
                    # from the cache or the block; rows past the end are clamped (read, masked)
                    for j, c in T.grid(KT, D):
                        kt[c, j] = T.if_then_else(t < ncache, k_cache[kh, T.min(t * KT + j, N - 1), c],
                                                  k_blk[0, kh, T.min((t - ncache) * KT + j, B - 1), c])
                    for j in T.serial(KT):
                        for c in T.vectorized(D):
                            vt[j, c] = T.if_then_else(t < ncache, v_cache[kh, T.min(t * KT + j, N - 1), c],
                                                      v_blk[0, kh, T.min((t - ncache) * KT + j, B - 1), c])
                    for rb in T.serial(NRB):
                        # S = Q·Kᵀ: RB x KT accumulators in registers (a local buffer LLVM promotes)
                        for r in T.unroll(RB):
                            for j in T.vectorized(KT):
                                accs[r, j] = T.float32(0)
                        for c in T.serial(D):
                            for r in T.unroll(RB):
                                for j in T.vectorized(KT):
                                    accs[r, j] = accs[r, j] + qs[rb * RB + r, c] * kt[c, j]
                        for r in T.unroll(RB):
                            for j in T.vectorized(KT):
                                s[rb * RB + r, j] = accs[r, j]
                    for r in T.serial(QT):
                        # key j of the tile is visible iff j <= lim: the cache's fill, or causality
                        lim: T.let[T.int32] = T.if_then_else(t < ncache, nf - 1 - t * KT,
                                                             (r0 + r) % B - (t - ncache) * KT)
                        # masked row max, exp and sum as KL-lane partials, then a halving tree
                        # across the lanes (vector ops, not a chain of KL dependent scalar ones)
                        for l in T.vectorized(KL):
                            part[l] = T.float32(NEG_BIG)
                        for j0 in T.serial(KT // KL):
                            for l in T.vectorized(KL):
                                s[r, j0 * KL + l] = T.if_then_else(tile_key_visible(j0 * KL + l, lim, t, ncache, (r0 + r) % B, nv, nf, kh, pos_cache, pos_blk), s[r, j0 * KL + l], T.float32(NEG_BIG) * T.float32(2))
                                part[l] = T.max(part[l], s[r, j0 * KL + l])
                        # step w folds lanes [h, 2h) onto [0, h), h = KL >> (w + 1); the lanes it
                        # also writes past h are never read again for the result (part[0])
                        for w in T.unroll(LOG_KL):
                            for l in T.vectorized(KL // 2):
                                part[l] = T.max(part[l], part[l + (KL >> (w + 1))])
                        alpha[r] = vexp(m[r] - T.max(m[r], part[0]))
                        m[r] = T.max(m[r], part[0])
                        for l in T.vectorized(KL):
                            part[l] = T.float32(0)
                        for j0 in T.serial(KT // KL):
                            for l in T.vectorized(KL):
                                s[r, j0 * KL + l] = vexp(s[r, j0 * KL + l] - m[r])
                                part[l] = part[l] + s[r, j0 * KL + l]
                        for w in T.unroll(LOG_KL):
                            for l in T.vectorized(KL // 2):
                                part[l] = part[l] + part[l + (KL >> (w + 1))]
                        lsum[r] = lsum[r] * alpha[r] + part[0]
                        for c in T.vectorized(D):
                            o[r, c] = o[r, c] * alpha[r]
                    for rb in T.serial(NRB):
                        # O += P·V: RB x D accumulators, each V row loaded once for RB rows
                        for r in T.unroll(RB):
                            for c in T.vectorized(D):
                                acco[r, c] = T.float32(0)
                        for j in T.serial(KT):
                            for r in T.unroll(RB):
                                for c in T.vectorized(D):
                                    acco[r, c] = acco[r, c] + s[rb * RB + r, j] * vt[j, c]
                        for r in T.unroll(RB):
                            for c in T.vectorized(D):
                                o[rb * RB + r, c] = o[rb * RB + r, c] + acco[r, c]
                for r, c in T.grid(QT, D):
                    out[0, kh * G + (r0 + r) // B, (r0 + r) % B, c] = T.if_then_else(
                        T.Or((r0 + r) % B < nv, (r0 + r) % B >= BR), o[r, c] / lsum[r], T.float32(0))

    if WIN:
        return window_attention_kernel(StepShapes(H, N, B, D, Hq=Hq), block_attention)

    @T.macro
    def plain_attention(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out):
        block_attention(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out, None, None)

    return attention_kernel(StepShapes(H, N, B, D, Hq=Hq), plain_attention)


# ---- GPU version (same signature; swapped in by gpu_schedule.ReplaceKernels) ----------------------

def _gpu_lanes(d: int) -> int:
    for w in (32, 16, 8, 4, 2, 1):
        if d % w == 0 and w <= d:
            return w
    return 1


def build_block_attention_kernel_gpu(num_q_heads: int, num_kv_heads: int, budget: int, block: int,
                                     head_dim: int, sm_scale: float, dtype: str = "float32",
                                     rows_per_block: int = 4, extra_rows: int = 0, key_parallel: bool | None = None):
    """GPU block attention. ``key_parallel`` (default: at decode, B = 1) builds the key-parallel
    kernel (``_build_key_parallel_attention_gpu``: a work-group's threads split the keys, not the
    rows, so decode's G·B = G rows per KV head no longer leave each of H work-groups streaming all
    N keys serially); otherwise the row-tiled kernel below.

    Row-tiled: one thread block = ``RQ`` query rows that share a KV head (threadIdx.y) × ``TX`` lanes
    (threadIdx.x). Keys are streamed in tiles of ``TK`` rows: the K and V tiles are loaded
    into shared memory once (coalesced) and reused by all RQ rows; each row keeps an online
    softmax (running max, sum, and its slice of the output in registers). Cache tiles run
    only up to ``fill``, block tiles only up to ``n_valid`` (causal mask inside the block);
    rows ≥ n_valid are written as zeros. With ``extra_rows`` = w pseudo rows (DapQ) the last w
    of the ``block`` rows see the real rows < n_valid and the pseudo rows up to their own
    (``kernels.attention.block_key_visible``); block tiles then run over all rows."""
    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    W = int(extra_rows)
    BR = B - W  # real rows
    G = Hq // H
    if key_parallel is None:
        key_parallel = B == 1
    if key_parallel and (KEY_PARALLEL_THREADS % D == 0 or D % KEY_PARALLEL_THREADS == 0):
        return _build_key_parallel_attention_gpu(Hq, H, N, B, D, float(sm_scale), W,
                                                 key_parallel_rows(Hq, H, B))
    ROWS = G * B  # query rows per KV head
    RQ = max(1, min(rows_per_block, ROWS))
    RT = (ROWS + RQ - 1) // RQ  # row tiles per KV head
    TX = _gpu_lanes(D)
    TK = max(8, min(32, 2048 // D))
    CPT = (D + TX - 1) // TX  # channels per lane
    NT = RQ * TX
    LOADS = (TK * D + NT - 1) // NT
    SPT = (TK + TX - 1) // TX  # scores per lane per tile
    scale = float(sm_scale)

    @T.macro
    def block_attention_gpu(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out):
        for bx in T.thread_binding(H * RT, thread="blockIdx.x"):
            for ty in T.thread_binding(RQ, thread="threadIdx.y"):
                for tx in T.thread_binding(TX, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        q_sh = T.sblock_alloc_buffer((RQ, D), "float32", scope="shared")
                        k_sh = T.sblock_alloc_buffer((TK, D + 1), "float32", scope="shared")  # +1: no bank conflicts
                        v_sh = T.sblock_alloc_buffer((TK, D), "float32", scope="shared")
                        s_sh = T.sblock_alloc_buffer((RQ, TK), "float32", scope="shared")
                        acc = T.sblock_alloc_buffer((CPT,), "float32", scope="local")
                        st = T.sblock_alloc_buffer((4,), "float32", scope="local")  # m, l, tile max, rescale
                        dot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        kh: T.let[T.int32] = bx // RT
                        rr: T.let[T.int32] = (bx % RT) * RQ + ty  # query row within the KV head
                        g: T.let[T.int32] = T.min(rr, ROWS - 1) // B
                        i: T.let[T.int32] = T.min(rr, ROWS - 1) % B
                        h: T.let[T.int32] = kh * G + g
                        tid: T.let[T.int32] = ty * TX + tx
                        nf: T.let[T.int32] = fill[0]
                        nv: T.let[T.int32] = n_valid[0]
                        ct: T.let[T.int32] = (nf + TK - 1) // TK
                        bt: T.let[T.int32] = T.if_then_else(W > 0, (B + TK - 1) // TK, (nv + TK - 1) // TK)
                        for u in T.serial(CPT):
                            if u * TX + tx < D:
                                q_sh[ty, u * TX + tx] = q[0, h, i, u * TX + tx]
                                acc[u] = T.float32(0)
                        st[0] = T.float32(NEG_BIG)
                        st[1] = T.float32(0)
                        for it in T.serial(ct + bt):
                            T.tvm_storage_sync("shared")
                            # stage the K/V tile (cache rows, then block rows) in shared memory
                            for u in T.serial(LOADS):
                                if u * NT + tid < TK * D:
                                    jj: T.let[T.int32] = (u * NT + tid) // D
                                    cc: T.let[T.int32] = (u * NT + tid) % D
                                    if it < ct:
                                        k_sh[jj, cc] = T.if_then_else(it * TK + jj < nf,
                                                                      k_cache[kh, T.min(it * TK + jj, N - 1), cc],
                                                                      T.float32(0))
                                        v_sh[jj, cc] = T.if_then_else(it * TK + jj < nf,
                                                                      v_cache[kh, T.min(it * TK + jj, N - 1), cc],
                                                                      T.float32(0))
                                    else:
                                        k_sh[jj, cc] = T.if_then_else(T.Or((it - ct) * TK + jj < nv,
                                                                           T.And(W > 0, (it - ct) * TK + jj >= BR)),
                                                                      k_blk[0, kh, T.min((it - ct) * TK + jj, B - 1), cc],
                                                                      T.float32(0))
                                        v_sh[jj, cc] = T.if_then_else(T.Or((it - ct) * TK + jj < nv,
                                                                           T.And(W > 0, (it - ct) * TK + jj >= BR)),
                                                                      v_blk[0, kh, T.min((it - ct) * TK + jj, B - 1), cc],
                                                                      T.float32(0))
                            T.tvm_storage_sync("shared")
                            # scores of this row against the tile
                            for u in T.serial(SPT):
                                if u * TX + tx < TK:
                                    dot[0] = T.float32(0)
                                    for c in T.serial(D):
                                        dot[0] = dot[0] + q_sh[ty, c] * k_sh[u * TX + tx, c]
                                    s_sh[ty, u * TX + tx] = T.if_then_else(
                                        T.if_then_else(it < ct, it * TK + u * TX + tx < nf,
                                                       block_key_visible((it - ct) * TK + u * TX + tx, i, nv, BR, W)),
                                        dot[0] * T.float32(scale), T.float32(NEG_BIG))
                            T.tvm_storage_sync("shared")
                            # online softmax update (every lane of the row does the same scalar work)
                            st[2] = st[0]
                            for j in T.serial(TK):
                                st[2] = T.max(st[2], s_sh[ty, j])
                            st[3] = T.exp(st[0] - st[2])
                            st[1] = st[1] * st[3]
                            for u in T.serial(CPT):
                                acc[u] = acc[u] * st[3]
                            for j in T.serial(TK):
                                dot[0] = T.if_then_else(s_sh[ty, j] > T.float32(NEG_BIG), T.exp(s_sh[ty, j] - st[2]),
                                                        T.float32(0))
                                st[1] = st[1] + dot[0]
                                for u in T.serial(CPT):
                                    if u * TX + tx < D:
                                        acc[u] = acc[u] + dot[0] * v_sh[j, u * TX + tx]
                            st[0] = st[2]
                        if rr < ROWS:
                            for u in T.serial(CPT):
                                if u * TX + tx < D:
                                    out[0, h, i, u * TX + tx] = T.if_then_else(
                                        T.Or(i < nv, i >= BR), acc[u] / T.max(st[1], T.float32(1e-30)), T.float32(0))

    return attention_kernel(StepShapes(H, N, B, D, Hq=Hq), block_attention_gpu, gpu=True)


KEY_PARALLEL_THREADS = 256  # threads of a key-parallel work-group: one key each per chunk


def key_parallel_rows(num_q_heads: int, num_kv_heads: int, block: int) -> int:
    """Query rows per work-group of the key-parallel kernel: one at decode (B = 1: the G rows of a
    KV head go to G work-groups, which read the head's keys from L2 side by side), up to 8 in a
    block step (each key a thread loads then serves 8 rows)."""
    rows = num_q_heads // num_kv_heads * block
    return 1 if block == 1 else min(8, rows)


def _build_key_parallel_attention_gpu(Hq: int, H: int, N: int, B: int, D: int, scale: float, W: int,
                                      RW: int, NT: int = KEY_PARALLEL_THREADS):
    """Flash-decoding inside one work-group: ``RW`` query rows of one KV head × ``NT`` threads.
    The keys (cache rows [0, fill), then block rows) are visited in chunks of NT: thread t scores
    key t of the chunk against the RW rows (its K row read once for all of them), the chunk's row
    max and row sum are two-level reductions in shared memory (16 lanes × NT/16), and P·V runs
    with thread (key slice ks, channel c) summing every KS-th key of the chunk into its RW
    accumulators (V reads coalesced over c); the KS partial outputs are summed at the end. Every
    thread keeps the same running max and sum per row, so the online-softmax rescale needs no
    extra exchange. Barriers per chunk: 5, whatever the rows; work-groups: H · ⌈G·B / RW⌉."""
    from tvm import tirx

    G = Hq // H
    ROWS = G * B
    BR = B - W
    RT = (ROWS + RW - 1) // RW
    if NT % D and D % NT:
        raise ValueError(f"key-parallel attention: head dim {D} and {NT} threads do not tile")
    KS = max(1, NT // D)  # key slices of the P·V pass
    # decode (one query row): Q·K with LQ lanes per key, reading K rows coalesced (a warp reads two
    # whole rows per load, against 32 rows' one channel when a thread walks its own key's row)
    LQ = 16
    COAL = RW == 1 and D % LQ == 0 and NT % LQ == 0
    KR = NT // LQ  # keys per pass of the coalesced Q·K
    PV = min(16, NT // KS)  # keys whose V loads are in flight together in P·V
    CPT = max(1, D // NT)  # channels per thread (D > NT)
    RL = 16  # lanes of the row reductions
    PER = NT // RL  # keys per lane in a reduction
    OUTS = (RW * D + NT - 1) // NT

    def visible(j, i, nf, nv):
        # key j of the candidate order (cache rows, then block rows) seen by block row i
        return tirx.any(j < nf, block_key_visible(j - nf, i, nv, BR, W))

    def key_row(k_cache, k_blk, kh, j, nf, c):
        return T.if_then_else(j < nf, k_cache[kh, T.min(j, N - 1), c],
                              k_blk[0, kh, T.min(T.max(j - nf, 0), B - 1), c])

    @T.macro
    def attention_kp(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out):
        for bx in T.thread_binding(H * RT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((RW, D), "float32", scope="shared")
                    s_sh = T.sblock_alloc_buffer((RW, NT), "float32", scope="shared")
                    mx_sh = T.sblock_alloc_buffer((RW, RL), "float32", scope="shared")
                    sm_sh = T.sblock_alloc_buffer((RW, RL), "float32", scope="shared")
                    o_sh = T.sblock_alloc_buffer((KS, RW, D), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((RW, CPT), "float32", scope="local")
                    dot = T.sblock_alloc_buffer((RW,), "float32", scope="local")
                    m = T.sblock_alloc_buffer((RW,), "float32", scope="local")
                    lsum = T.sblock_alloc_buffer((RW,), "float32", scope="local")
                    alpha = T.sblock_alloc_buffer((RW,), "float32", scope="local")
                    red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    kp_sh = T.sblock_alloc_buffer(((LQ + 1) * NT if COAL else 1,), "float32", scope="shared")
                    kpart = T.sblock_alloc_buffer((NT // KR if COAL else 1,), "float32", scope="local")
                    vbuf = T.sblock_alloc_buffer((PV, CPT), "float32", scope="local")
                    kh: T.let[T.int32] = bx // RT
                    r0: T.let[T.int32] = (bx % RT) * RW  # first query row (within the KV head)
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    nkeys: T.let[T.int32] = nf + T.if_then_else(W > 0, B, nv)
                    ks: T.let[T.int32] = tx // D
                    c0: T.let[T.int32] = tx % D
                    for u in T.serial((RW * D + NT - 1) // NT):
                        if u * NT + tx < RW * D:
                            q_sh[(u * NT + tx) // D, (u * NT + tx) % D] = q[
                                0, kh * G + T.min(r0 + (u * NT + tx) // D, ROWS - 1) // B,
                                T.min(r0 + (u * NT + tx) // D, ROWS - 1) % B, (u * NT + tx) % D] * T.float32(scale)
                    for r in T.unroll(RW):
                        m[r] = T.float32(NEG_BIG)
                        lsum[r] = T.float32(0)
                        for u in T.unroll(CPT):
                            acc[r, u] = T.float32(0)
                    for it in T.serial((nkeys + NT - 1) // NT):
                        # (the previous chunk's P·V has read s_sh; the first chunk waits for q_sh)
                        T.tvm_storage_sync("shared")
                        for r in T.unroll(RW):
                            dot[r] = T.float32(0)
                        if COAL:
                            # thread (key kk, lane l) of each pass kq: channels l, l + LQ, ... of key
                            # kq·KR + kk; the LQ partial dots meet in kp_sh (rows padded to LQ + 1 floats, flat so that
                            # TVM keeps the padding: threads reading their own key's row then hit distinct banks)
                            for kq in T.unroll(NT // KR):
                                kpart[kq] = T.float32(0)
                                if it * NT + kq * KR + tx // LQ < nf:
                                    for cc in T.unroll(D // LQ):
                                        kpart[kq] = kpart[kq] + q_sh[0, cc * LQ + tx % LQ] * k_cache[
                                            kh, T.min(it * NT + kq * KR + tx // LQ, N - 1), cc * LQ + tx % LQ]
                                elif it * NT + kq * KR + tx // LQ < nkeys:
                                    for cc in T.unroll(D // LQ):
                                        kpart[kq] = kpart[kq] + q_sh[0, cc * LQ + tx % LQ] * k_blk[
                                            0, kh, T.min(T.max(it * NT + kq * KR + tx // LQ - nf, 0), B - 1),
                                            cc * LQ + tx % LQ]
                                kp_sh[(kq * KR + tx // LQ) * (LQ + 1) + tx % LQ] = kpart[kq]
                            T.tvm_storage_sync("shared")
                            for l in T.unroll(LQ):
                                dot[0] = dot[0] + kp_sh[tx * (LQ + 1) + l]
                        else:
                            for c in T.serial(D):
                                red[0] = key_row(k_cache, k_blk, kh, it * NT + tx, nf, c)
                                for r in T.unroll(RW):
                                    dot[r] = dot[r] + q_sh[r, c] * red[0]
                        for r in T.unroll(RW):
                            s_sh[r, tx] = T.if_then_else(
                                T.And(it * NT + tx < nkeys,
                                      visible(it * NT + tx, T.min(r0 + r, ROWS - 1) % B, nf, nv)),
                                dot[r], T.float32(NEG_BIG))
                        T.tvm_storage_sync("shared")
                        # the chunk's row max: RL lanes per row, each over PER keys
                        if tx < RW * RL:
                            red[0] = T.float32(NEG_BIG)
                            for k in T.serial(PER):
                                red[0] = T.max(red[0], s_sh[tx // RL, k * RL + tx % RL])
                            mx_sh[tx // RL, tx % RL] = red[0]
                        T.tvm_storage_sync("shared")
                        for r in T.unroll(RW):
                            red[0] = m[r]
                            for l in T.serial(RL):
                                red[0] = T.max(red[0], mx_sh[r, l])
                            alpha[r] = T.exp(m[r] - red[0])
                            m[r] = red[0]
                            s_sh[r, tx] = T.if_then_else(s_sh[r, tx] > T.float32(NEG_BIG),
                                                         T.exp(s_sh[r, tx] - red[0]), T.float32(0))
                        T.tvm_storage_sync("shared")
                        if tx < RW * RL:
                            red[0] = T.float32(0)
                            for k in T.serial(PER):
                                red[0] = red[0] + s_sh[tx // RL, k * RL + tx % RL]
                            sm_sh[tx // RL, tx % RL] = red[0]
                        # P·V over the chunk: thread (ks, c) takes keys ks, ks + KS, ...
                        for r in T.unroll(RW):
                            for u in T.unroll(CPT):
                                acc[r, u] = acc[r, u] * alpha[r]
                        # PV keys' V loads first (unrolled, masked keys read as 0), then their
                        # FMAs: a loop of one load then its use waited out every load's latency
                        for jo in T.serial(NT // KS // PV):
                            for ji in T.unroll(PV):
                                for u in T.unroll(CPT):
                                    vbuf[ji, u] = T.if_then_else(
                                        it * NT + (jo * PV + ji) * KS + ks < nkeys,
                                        T.if_then_else(
                                            it * NT + (jo * PV + ji) * KS + ks < nf,
                                            v_cache[kh, T.min(it * NT + (jo * PV + ji) * KS + ks, N - 1), u * NT + c0],
                                            v_blk[0, kh, T.min(T.max(it * NT + (jo * PV + ji) * KS + ks - nf, 0), B - 1),
                                                  u * NT + c0]),
                                        T.float32(0))
                            for ji in T.unroll(PV):
                                for u in T.unroll(CPT):
                                    for r in T.unroll(RW):
                                        acc[r, u] = acc[r, u] + s_sh[r, (jo * PV + ji) * KS + ks] * vbuf[ji, u]
                        T.tvm_storage_sync("shared")
                        for r in T.unroll(RW):
                            red[0] = T.float32(0)
                            for l in T.serial(RL):
                                red[0] = red[0] + sm_sh[r, l]
                            lsum[r] = lsum[r] * alpha[r] + red[0]
                    # the KS partial outputs, summed per (row, channel)
                    T.tvm_storage_sync("shared")
                    for r in T.unroll(RW):
                        for u in T.unroll(CPT):
                            o_sh[ks, r, u * NT + c0] = acc[r, u]
                    T.tvm_storage_sync("shared")
                    for u in T.serial(OUTS):
                        if u * NT + tx < RW * D:
                            if r0 + (u * NT + tx) // D < ROWS:
                                red[0] = T.float32(0)
                                for s in T.serial(KS):
                                    red[0] = red[0] + o_sh[s, (u * NT + tx) // D, (u * NT + tx) % D]
                                out[0, kh * G + (r0 + (u * NT + tx) // D) // B, (r0 + (u * NT + tx) // D) % B,
                                    (u * NT + tx) % D] = T.if_then_else(
                                    T.Or((r0 + (u * NT + tx) // D) % B < nv, (r0 + (u * NT + tx) // D) % B >= BR),
                                    red[0] / T.max(lsum[(u * NT + tx) // D], T.float32(1e-30)), T.float32(0))

    return attention_kernel(StepShapes(H, N, B, D, Hq=Hq), attention_kp, gpu=True)
