"""`dapq` — DapQ, decoding-aligned pseudo queries (Tian, Su, Li, Zhang 2026, arXiv 2603.11564).

Definition. ``w`` pseudo tokens are appended after the prompt at the positions the first ``w``
generated tokens will take, ``n … n+w−1`` (n = prompt length); their content is the first ``a`` and
the last ``w − a`` prompt tokens ("where matters more than what"). In every layer the pseudo rows'
post-RoPE queries attend (softmax per row, causal by position) over the prompt keys ⊕ the pseudo keys;
a candidate's score is the sum over the w pseudo rows of the probability it gets, averaged over the G
query heads of its KV group; the top N candidates are kept per KV head. Pseudo K/V are never stored
and the first output token comes from the last real prompt row (decoding starts at position n).

Defaults (paper §5.1, digest §2.9): ``window`` w = 32, ``prefix`` a = 4 (first 4 + last 28),
``softmax_over="prompt+pseudo"``, no protected recent window (``keep_recent=0``), final-aligned
positions. Pooling, which the paper does not name, is ours, chosen by measurement (issue 16,
``tools/experiments/check_snapkv_pooling.py --study dapq``, docs/policies.md): max pooling over κ = 63
candidates (SnapKV++'s), because without it DapQ keeps the needle's attended tokens but too few
of their neighbours — long passkeys 1 of 12 without pooling, 12 of 12 with it, at N = 512 on
2K/4K prompts, one block and block-wise; fidelity to the full cache stays SnapKV++'s (mean KL
0.042 vs 0.025 unpooled at N = 256..1K). ``kernel=1`` is the unpooled variant.

Block-wise adaptation (digest §7.3): the pseudo tokens are built once in ``prepare`` from the whole
prompt (known up front) and appended, at positions n … n+w−1, to every block that triggers an
eviction; they see the evicted cache ⊕ the whole block; the candidates cache ⊕ block are re-scored
from scratch at every eviction (stateless). ``positions="block"`` is the digest's block-aligned
variant (e … e+w−1, e = end of the current block). One block covering the prompt is the paper's
single-shot DapQ exactly.

Deviations: the paper evicts only once, after prefill; the engine keeps the cache at N while decoding,
and there (no pseudo rows: a step with B = 1) the observers are the block's own last min(w, b) real
queries — while decoding, that is the true decoding query the pseudo queries stand in for. The
softmax domain, pooling and GQA reduction are not stated by the paper (digest §2.9); they are switches.

Engine contract: ``max_extra_tokens`` (= window) sizes the cache tail; the pseudo rows' queries and keys
arrive as ``ctx.extra_queries`` / ``ctx.extra_keys`` (without the keys, e.g. a hand-built ctx, the
softmax runs over the candidates alone). Cost: w extra tokens through every layer per evicting block
(+25 % linear-layer work at w = 32, B = 128) and a [Hq, w, N + B + w] attention tile per layer.

Compiled: ``build_dapq_evict_kernel`` (CPU) and ``build_dapq_evict_kernel_gpu`` (GPU) score from the
step's post-RoPE queries (``kernel_inputs``), one pseudo row's attention at a time; the compiled
prefill step carries the pseudo rows as its last w rows (``edgekv/compiler/pseudo_rows.py``,
docs/COMPILER.md "Pseudo rows"), on every prefill block.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .attention_rows import attention_rows, group_reduce, require_queries
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, protect_recent, topk_keep
from .snapkv import pool_scores


def pseudo_token_ids(prompt_ids: torch.Tensor, window: int, prefix: int) -> torch.Tensor:
    """The pseudo tokens' content: the first ``prefix`` and the last ``window − prefix`` prompt tokens
    (fewer when the prompt is shorter than either part)."""
    x = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    n = x.numel()
    head = x[: min(prefix, n)]
    tail_len = min(window - prefix, n)
    tail = x[n - tail_len :] if tail_len > 0 else x[:0]
    return torch.cat([head, tail])


def dapq_scores(
    keys: torch.Tensor,
    positions: torch.Tensor,
    pseudo_queries: torch.Tensor,
    pseudo_positions: torch.Tensor,
    pseudo_keys: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """DapQ's score, [Hq, n] fp32: Σ over the pseudo rows of their attention over the n candidates.

    keys [H, n, d], positions [H, n]; pseudo_queries [Hq, w, d], pseudo_positions [w].
    With ``pseudo_keys`` [H, w, d] the softmax runs over candidates ⊕ pseudo rows (causal among the
    pseudo rows) and only the candidates' columns are summed; without, over the candidates alone.
    Only the w pseudo rows of the attention matrix are computed.
    """
    n = keys.shape[1]
    if pseudo_keys is not None:
        pk_pos = pseudo_positions.to(positions.dtype)[None, :].expand(keys.shape[0], -1)
        keys = torch.cat([keys, pseudo_keys.to(keys.dtype)], dim=1)
        positions = torch.cat([positions, pk_pos], dim=1)
    probs = attention_rows(keys, positions, pseudo_queries, pseudo_positions, scale)  # [Hq, w, n(+w)]
    return probs[:, :, :n].sum(dim=1)


def pseudo_rows_in_step(rows: int, window: int) -> int:
    """How many of a compiled step's ``rows`` are pseudo rows: the compiled prefill step runs
    B + window rows (the last window are the pseudo tokens), decode runs 1 ≤ window real row."""
    return window if rows > window else 0


def _kernel_constants(num_kv_heads, budget, block, head_dim, window, softmax_pseudo, kernel, pooling, keep_recent,
                      num_q_heads, sm_scale, question_rows=0):
    """The compile-time constants both DapQ kernels share: (Hq, G, N + T, pseudo rows P, real rows,
    observer rows R, pseudo keys in the softmax, pooling half-width, avg?, κ, recent window, scale)."""
    if num_q_heads is None or num_q_heads % num_kv_heads:
        raise ValueError(f"dapq kernel: num_q_heads ({num_q_heads}) must be a multiple of the {num_kv_heads} KV heads")
    if pooling not in ("avg", "max"):
        raise ValueError(f"dapq kernel: pooling must be avg or max (got {pooling!r})")
    # with question rows (`--question-rows`) the step's extra rows are max(window, Q): the pseudo
    # tokens or the question, then padding at position −1 that observes nothing
    P = int(question_rows) if question_rows else pseudo_rows_in_step(block, int(window))
    return (int(num_q_heads), int(num_q_heads) // num_kv_heads, budget + block, P, block - P,
            P if P else min(int(window), block), bool(softmax_pseudo) and P > 0, int(kernel) // 2, pooling == "avg",
            float(kernel), int(keep_recent), float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim))


def build_dapq_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                            window: int = 32, softmax_pseudo: bool = True, kernel: int = 1, pooling: str = "avg",
                            keep_recent: int = 0, num_q_heads: int | None = None, sm_scale: float | None = None,
                            question_rows: int = 0):
    """TIR score kernel: the same definition as ``DapQPolicy.score``, computing only the observer
    rows of the attention matrix.

    ``question_rows``: the step's extra rows when the artifact takes a question (``--question-rows``):
    the question or the pseudo tokens first, then padding rows at position −1, which observe nothing
    (and, coming last, are seen by no other row).

    ``block`` is the step's row count T. A prefill step carries the pseudo rows as its last
    ``window`` rows (T = B + window, ``pseudo_rows_in_step``): they observe the candidates cache ⊕
    real rows [0, n_valid), with their own causal keys in the softmax when ``softmax_pseudo``. A
    decode step (T = 1) has no pseudo rows: its last min(window, n_valid) real rows observe (the
    reference's fallback), causally. Inputs: the eight common buffers (``kernels/common.py``, with
    B = T), then the step's post-RoPE queries ``q [1, Hq, T, d]``.

    One parallel task per KV head; per (query head of the group, observer row): that row's logits
    over the cache and block keys (an [N + T] buffer: never more than one row), max, exp, sum,
    and its probabilities added to the candidates' scores; then the group mean, the optional
    pooling (``kernel`` odd, ``pooling`` avg/max as ``pool_scores``) and the protected recent
    window. Dot products as partial sums over LANES lanes (vectorised); the summation order
    differs from torch's, so scores agree to rounding and kept sets can differ only on near ties.
    """
    from tvm import tirx
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, TR, D = num_kv_heads, budget, block, head_dim
    Hq, G, NB, P, BR, R, SP, K2, AVG, KAPPA, REC, scale = _kernel_constants(
        num_kv_heads, budget, block, head_dim, window, softmax_pseudo, kernel, pooling, keep_recent, num_q_heads, sm_scale,
        question_rows)
    LANES = 16 if D % 16 == 0 else (8 if D % 8 == 0 else 1)
    CH = D // LANES

    def candidate_seen(j, row, nv):
        """Block row j is a candidate the observer row sees."""
        return j < nv if P else tirx.all(j < nv, j <= row)

    def key_seen(j, row, nv):
        """Block row j is in the observer row's softmax (a seen candidate or an earlier pseudo row)."""
        if not SP:
            return candidate_seen(j, row, nv)
        return tirx.any(candidate_seen(j, row, nv), tirx.all(j >= BR, j <= row))

    @T.macro
    def dot(qv, kv, part, red):
        for l in T.vectorized(LANES):
            part[l] = T.float32(0)
        for c0 in T.serial(CH):
            for l in T.vectorized(LANES):
                part[l] = part[l] + qv[c0 * LANES + l] * kv[c0 * LANES + l]
        red[0] = T.float32(0)
        for l in T.serial(LANES):
            red[0] = red[0] + part[l]
        red[0] = red[0] * T.float32(scale)

    @T.macro
    def dapq_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score):
        for h in T.parallel(H):
            with T.sblock("dapq"):
                # explicit regions: automatic inference would reference the block's own let vars
                T.reads(k_cache[h, 0:N, 0:D], pos_cache[h, 0:N], fill[0:1], k_blk[0, h, 0:TR, 0:D], pos_blk[0:TR],
                        n_valid[0:1], q[0, h * G:h * G + G, 0:TR, 0:D])
                T.writes(score[h, 0:NB])
                qv = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                s = T.sblock_alloc_buffer((NB,), "float32")  # one observer row: cache key i at i, block key j at N + j
                raw = T.sblock_alloc_buffer((NB,), "float32")  # per candidate (cache rows, then block rows)
                part = T.sblock_alloc_buffer((LANES,), "float32")
                red = T.sblock_alloc_buffer((3,), "float32")  # dot, row max, row sum
                newest = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                nobs: T.let[T.int32] = T.if_then_else(P > 0, R, T.min(R, n_valid[0]))
                if n > N:
                    for i in T.serial(NB):
                        raw[i] = T.float32(0)
                    for g in T.serial(G):
                        for r in T.serial(nobs):
                            row: T.let[T.int32] = T.if_then_else(P > 0, BR + r, nv - nobs + r)
                            if pos_blk[row] >= 0:  # a padding row (position −1) observes nothing
                                for c in T.vectorized(D):
                                    qv[c] = q[0, h * G + g, row, c]
                                red[1] = T.float32("-inf")
                                for i in T.serial(nf):
                                    for c in T.vectorized(D):
                                        kv[c] = k_cache[h, i, c]
                                    dot(qv, kv, part, red)
                                    s[i] = red[0]
                                    red[1] = T.max(red[1], red[0])
                                for j in T.serial(TR):
                                    if key_seen(j, row, nv):
                                        for c in T.vectorized(D):
                                            kv[c] = k_blk[0, h, j, c]
                                        dot(qv, kv, part, red)
                                        s[N + j] = red[0]
                                        red[1] = T.max(red[1], red[0])
                                red[2] = T.float32(0)
                                for i in T.serial(nf):
                                    s[i] = T.exp(s[i] - red[1])
                                    red[2] = red[2] + s[i]
                                for j in T.serial(TR):
                                    if key_seen(j, row, nv):
                                        s[N + j] = T.exp(s[N + j] - red[1])
                                        red[2] = red[2] + s[N + j]
                                for i in T.serial(nf):
                                    raw[i] = raw[i] + s[i] / red[2]
                                for j in T.serial(TR):
                                    if candidate_seen(j, row, nv):
                                        raw[nf + j] = raw[nf + j] + s[N + j] / red[2]
                    # group mean, then pooling over the candidate order (kernel 1: the identity)
                    for i in T.serial(NB):
                        raw[i] = raw[i] / T.float32(G)
                    newest[0] = -2147483647
                    for i in T.serial(nf):
                        newest[0] = T.max(newest[0], pos_cache[h, i])
                    for j in T.serial(nv):
                        newest[0] = T.max(newest[0], pos_blk[j])
                    for i in T.serial(NB):
                        if i < n:
                            red[0] = T.if_then_else(AVG, T.float32(0), T.float32("-inf"))
                            for o in T.serial(2 * K2 + 1):
                                if i + o - K2 >= 0 and i + o - K2 < n:
                                    red[0] = T.if_then_else(AVG, red[0] + raw[i + o - K2], T.max(red[0], raw[i + o - K2]))
                            score[h, i] = T.if_then_else(
                                T.if_then_else(i < nf, pos_cache[h, T.min(i, N - 1)], pos_blk[T.max(i - nf, 0)])
                                > newest[0] - REC,
                                T.float32("inf"), T.if_then_else(AVG, red[0] / T.float32(KAPPA), red[0]))
                        else:
                            score[h, i] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, TR, D, Hq=Hq), dapq_score, queries=True)


def build_dapq_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                                window: int = 32, softmax_pseudo: bool = True, kernel: int = 1, pooling: str = "avg",
                                keep_recent: int = 0, num_q_heads: int | None = None, sm_scale: float | None = None):
    """GPU version of ``build_dapq_evict_kernel`` (same signature and definition), the flash-style
    two-pass form: one thread block per KV head, one thread per key column of a tile of NT
    columns (cache rows [0, N), then the step's rows). The G·R observer rows are taken RC at a
    time, their queries staged in shared memory. Pass 1: each thread keeps an online (max, sum)
    per row over the columns it owns; the NT partials are merged in shared memory into each
    row's softmax normaliser. Pass 2: each thread adds exp(s − max) / sum of every row to its
    own candidates. No logits are stored (scratch: RC·d + 2·RC·NT floats of shared memory, the
    thread's key and its candidates' sums in registers). Group mean, pooling and the protected
    recent window follow, the pooling neighbours exchanged through a shared-memory tile with a
    halo (never through global memory, which a work-group barrier does not order on OpenCL/Metal)."""
    from tvm import tirx
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, TR, D = num_kv_heads, budget, block, head_dim
    Hq, G, NB, P, BR, R, SP, K2, AVG, KAPPA, REC, scale = _kernel_constants(
        num_kv_heads, budget, block, head_dim, window, softmax_pseudo, kernel, pooling, keep_recent, num_q_heads, sm_scale)
    RWS = G * R  # observer rows of one KV head
    NT = 128
    RC = 8  # observer rows per chunk
    NCH = (RWS + RC - 1) // RC
    CT = (NB + NT - 1) // NT  # column tiles
    QL = (RC * D + NT - 1) // NT
    NEG = -3.0e38
    if K2 > NT:
        raise ValueError(f"dapq GPU kernel: a pooling kernel of at most {2 * NT + 1} (got {kernel})")

    def seen(col, row, nv, nf, candidate_only):
        """Column col (candidate order: cache rows [0, nf), step rows [nf, nf + nv), then the pseudo
        rows) is in the observer row's softmax (``candidate_only``: and is a candidate)."""
        blk = tirx.all(col >= nf, col < nf + nv) if P else tirx.all(col >= nf, col < nf + nv, col - nf <= row)
        out = tirx.any(col < nf, blk)
        if SP and not candidate_only:
            out = tirx.any(out, tirx.all(col >= nf + nv, BR + col - nf - nv <= row))
        return out

    def observer_row(rr, nv, nobs):
        """Step row of observer rr (of the G·R, group-major): a pseudo row, or (decode) a last real row."""
        return tirx.if_then_else(P > 0, BR + rr % R, nv - nobs + rr % R)

    @T.macro
    def load_key(kreg, k_cache, k_blk, h, col, nf, nv):
        for c in T.serial(D):
            kreg[c] = T.if_then_else(
                col < nf, k_cache[h, T.min(col, N - 1), c],
                k_blk[0, h, T.min(T.max(T.if_then_else(col < nf + nv, col - nf, BR + col - nf - nv), 0), TR - 1), c])

    @T.macro
    def row_logit(st, q_sh, kreg, k):
        st[0] = T.float32(0)
        for c in T.serial(D):
            st[0] = st[0] + q_sh[k, c] * kreg[c]
        st[0] = st[0] * T.float32(scale)

    @T.macro
    def dapq_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("dapq"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((RC, D), "float32", scope="shared")
                    m_part = T.sblock_alloc_buffer((RC, NT), "float32", scope="shared")
                    l_part = T.sblock_alloc_buffer((RC, NT), "float32", scope="shared")
                    m_row = T.sblock_alloc_buffer((RC,), "float32", scope="shared")
                    l_row = T.sblock_alloc_buffer((RC,), "float32", scope="shared")
                    newest_sh = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                    halo = T.sblock_alloc_buffer((NT + 2 * K2,), "float32", scope="shared")
                    kreg = T.sblock_alloc_buffer((D,), "float32", scope="local")
                    mt = T.sblock_alloc_buffer((RC,), "float32", scope="local")
                    lt = T.sblock_alloc_buffer((RC,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((CT,), "float32", scope="local")
                    pooled = T.sblock_alloc_buffer((CT,), "float32", scope="local")
                    st = T.sblock_alloc_buffer((3,), "float32", scope="local")  # dot, new max, merged sum
                    newest = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    nobs: T.let[T.int32] = T.if_then_else(P > 0, R, T.min(R, n_valid[0]))
                    if n > N:
                        for u in T.serial(CT):
                            acc[u] = T.float32(0)
                        for ch in T.serial(NCH):
                            T.tvm_storage_sync("shared")
                            # stage the chunk's queries (coalesced over d)
                            for e in T.serial(QL):
                                if e * NT + tx < RC * D:
                                    q_sh[(e * NT + tx) // D, (e * NT + tx) % D] = q[
                                        0, h * G + T.min(ch * RC + (e * NT + tx) // D, RWS - 1) // R,
                                        T.min(T.max(observer_row(T.min(ch * RC + (e * NT + tx) // D, RWS - 1), nv, nobs),
                                                    0), TR - 1),
                                        (e * NT + tx) % D]
                            T.tvm_storage_sync("shared")
                            # pass 1: per-thread online max / sum of each row over its columns
                            for k in T.serial(RC):
                                mt[k] = T.float32(NEG)
                                lt[k] = T.float32(0)
                            for u in T.serial(CT):
                                load_key(kreg, k_cache, k_blk, h, u * NT + tx, nf, nv)
                                for k in T.serial(RC):
                                    if ch * RC + k < RWS and (ch * RC + k) % R < nobs:
                                        if seen(u * NT + tx, observer_row(ch * RC + k, nv, nobs), nv, nf, False):
                                            row_logit(st, q_sh, kreg, k)
                                            st[1] = T.max(mt[k], st[0])
                                            lt[k] = lt[k] * T.exp(mt[k] - st[1]) + T.exp(st[0] - st[1])
                                            mt[k] = st[1]
                            for k in T.serial(RC):
                                m_part[k, tx] = mt[k]
                                l_part[k, tx] = lt[k]
                            T.tvm_storage_sync("shared")
                            if tx < RC:
                                st[1] = T.float32(NEG)
                                for t in T.serial(NT):
                                    st[1] = T.max(st[1], m_part[tx, t])
                                st[2] = T.float32(0)
                                for t in T.serial(NT):
                                    st[2] = st[2] + l_part[tx, t] * T.exp(m_part[tx, t] - st[1])
                                m_row[tx] = st[1]
                                l_row[tx] = T.max(st[2], T.float32(1e-30))
                            T.tvm_storage_sync("shared")
                            # pass 2: each row's probabilities of this thread's candidates
                            for u in T.serial(CT):
                                load_key(kreg, k_cache, k_blk, h, u * NT + tx, nf, nv)
                                for k in T.serial(RC):
                                    if ch * RC + k < RWS and (ch * RC + k) % R < nobs:
                                        if seen(u * NT + tx, observer_row(ch * RC + k, nv, nobs), nv, nf, True):
                                            row_logit(st, q_sh, kreg, k)
                                            acc[u] = acc[u] + T.exp(st[0] - m_row[k]) / l_row[k]
                        # newest candidate position (protected recent window)
                        newest[0] = -2147483647
                        for u in T.serial(CT):
                            if u * NT + tx < n:
                                newest[0] = T.max(newest[0], T.if_then_else(
                                    u * NT + tx < nf, pos_cache[h, T.min(u * NT + tx, N - 1)],
                                    pos_blk[T.min(T.max(u * NT + tx - nf, 0), TR - 1)]))
                        newest_sh[tx] = newest[0]
                        T.tvm_storage_sync("shared")
                        newest[0] = -2147483647
                        for t in T.serial(NT):
                            newest[0] = T.max(newest[0], newest_sh[t])
                        # group mean and pooling over the candidate order (kernel 1: the identity); a tile's
                        # neighbours come through shared memory with a halo of K2 on each side
                        for u in T.serial(CT):
                            T.tvm_storage_sync("shared")
                            halo[K2 + tx] = acc[u] / T.float32(G)
                            if tx >= NT - K2:
                                halo[tx - (NT - K2)] = T.if_then_else(u > 0, acc[T.max(u - 1, 0)] / T.float32(G),
                                                                      T.float32(0))
                            if tx < K2:
                                halo[NT + K2 + tx] = T.if_then_else(u + 1 < CT, acc[T.min(u + 1, CT - 1)] / T.float32(G),
                                                                    T.float32(0))
                            T.tvm_storage_sync("shared")
                            pooled[u] = T.if_then_else(AVG, T.float32(0), T.float32("-inf"))
                            for o in T.serial(2 * K2 + 1):
                                if u * NT + tx + o - K2 >= 0 and u * NT + tx + o - K2 < n:
                                    pooled[u] = T.if_then_else(AVG, pooled[u] + halo[tx + o],
                                                               T.max(pooled[u], halo[tx + o]))
                        for u in T.serial(CT):
                            if u * NT + tx < NB:
                                if u * NT + tx < n:
                                    score[h, u * NT + tx] = T.if_then_else(
                                        T.if_then_else(u * NT + tx < nf, pos_cache[h, T.min(u * NT + tx, N - 1)],
                                                       pos_blk[T.min(T.max(u * NT + tx - nf, 0), TR - 1)])
                                        > newest[0] - REC,
                                        T.float32("inf"), T.if_then_else(AVG, pooled[u] / T.float32(KAPPA), pooled[u]))
                                else:
                                    score[h, u * NT + tx] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, TR, D, Hq=Hq), dapq_score_gpu, gpu=True, queries=True)


@dataclass
class DapQPolicy(Policy):
    name = "dapq"
    summary = "DapQ: scores entries with pseudo queries at the positions the answer will take"
    needs_queries = True  # only used when a step has no pseudo rows (decoding)
    uses_question = True  # the question replaces the pseudo rows (`--question`)
    question_kernels = True
    evict_kernel = staticmethod(build_dapq_evict_kernel)
    gpu_evict_kernel = staticmethod(build_dapq_evict_kernel_gpu)
    # the compiled kernels also take the step's post-RoPE queries (the pseudo rows' among them)
    kernel_inputs = ("queries",)
    window: int = 32
    prefix: int = 4
    positions: str = "final"
    softmax_over: str = "prompt+pseudo"
    kernel: int = 63  # max pooling over 63 candidates: ours, measured (the paper names no pooling)
    pooling: str = "max"
    keep_recent: int = 0

    def __post_init__(self) -> None:
        # Per-prompt state (not parameters): set by prepare().
        self._pseudo: tuple[torch.Tensor, torch.Tensor] | None = None
        self._engine = None
        self._prompt_len = 0

    # The engine sizes each cache's tail for the pseudo rows from this (read on the instance).
    @property
    def max_extra_tokens(self) -> int:
        return self.window

    def kernel_params(self, budget: int) -> dict[str, Any]:
        return {"window": int(self.window), "softmax_pseudo": self.softmax_over == "prompt+pseudo",
                "kernel": int(self.kernel), "pooling": str(self.pooling), "keep_recent": int(self.keep_recent)}

    def check_budget(self, budget: int, block: int) -> None:
        if self.window < 1:
            raise PolicyError("dapq: window must be ≥ 1 pseudo token (e.g. --policy-arg window=32)")
        if not 0 <= self.prefix <= self.window:
            raise PolicyError(f"dapq: prefix must be within [0, window={self.window}] (got {self.prefix})")
        if self.positions not in ("final", "block"):
            raise PolicyError(f"dapq: positions must be final or block (got {self.positions!r})")
        if self.softmax_over not in ("prompt+pseudo", "prompt"):
            raise PolicyError(f"dapq: softmax_over must be prompt+pseudo or prompt (got {self.softmax_over!r})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise PolicyError(f"dapq: the pooling kernel must be odd and ≥ 1 (got {self.kernel})")
        if self.pooling not in ("avg", "max"):
            raise PolicyError(f"dapq: pooling must be avg or max (got {self.pooling!r})")
        if not 0 <= self.keep_recent < budget:
            raise PolicyError(f"dapq: keep_recent must be within [0, budget={budget}) (got {self.keep_recent})")

    # ---- pseudo tokens ---------------------------------------------------------------------
    def prepare(self, prompt_ids: torch.Tensor, model: Any) -> None:
        """Build the pseudo tokens once from the whole prompt; ``model`` is the engine."""
        ids = pseudo_token_ids(prompt_ids, self.window, self.prefix)
        n = int(torch.as_tensor(prompt_ids).numel())
        self._prompt_len = n
        self._pseudo = (ids, torch.arange(n, n + ids.numel(), dtype=torch.long))
        try:
            self._engine = weakref.ref(model) if model is not None else None
        except TypeError:
            self._engine = None

    def prepare_continuation(self, ids: torch.Tensor, start: int, model: Any) -> None:
        """A continuation (position ``start`` on): pseudo tokens from its own tokens, after its end."""
        self.prepare(ids, model)
        end = start + self._prompt_len
        self._prompt_len = end
        self._pseudo = (self._pseudo[0], torch.arange(end, end + self._pseudo[0].numel(), dtype=torch.long))

    def extra_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._pseudo is None:
            return None
        ids, pos = self._pseudo
        if self.positions == "block":  # e … e+w−1, e = end of the block about to run
            engine = self._engine() if self._engine is not None else None
            if engine is None:
                raise PolicyError("dapq: positions=block needs the engine passed to prepare()")
            end = min(engine.position + engine.block, self._prompt_len)
            pos = torch.arange(end, end + ids.numel(), dtype=torch.long)
        return ids, pos

    # ---- scoring ---------------------------------------------------------------------------
    def observers(self, ctx: EvictionContext):
        """(queries, positions, keys or None) of the observation rows for this eviction."""
        if ctx.extra_queries is not None and ctx.extra_queries.shape[1] > 0:
            # Without the pseudo keys (a caller other than the engine) the softmax runs over the
            # candidates alone.
            keys = ctx.extra_keys if self.softmax_over == "prompt+pseudo" else None
            return ctx.extra_queries, ctx.extra_query_positions, keys
        # No pseudo rows (decoding, or a step run without them): the block's own last w queries,
        # whose keys are candidates already.
        queries, query_positions = require_queries(ctx, self.name)
        w = min(self.window, queries.shape[1])
        return queries[:, -w:], query_positions[-w:], None

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] fp32: group-mean summed pseudo-query attention, optionally pooled."""
        queries, query_positions, pseudo_keys = self.observers(ctx)
        per_q_head = dapq_scores(ctx.keys, ctx.positions, queries, query_positions, pseudo_keys, ctx.scale)
        score = group_reduce(per_q_head, ctx.num_kv_heads, "mean")
        score = pool_scores(score, self.kernel, self.pooling)
        return protect_recent(score, ctx.positions, self.keep_recent)

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
