"""Reconstruct's compiled face (``edgekv/policies/reconstruct.py``, `--compress reconstruct`): its observe
and score kernels, CPU. The compiled prefill step carries the reconstruction rows as its last P rows
(P = ``prompt_rows`` + B, ``compiler/passes/pseudo_rows.py``): a runtime fills them with the repeat prompt
(``kernel_params`` ``first`` / ``later`` + the previous block's last ``tail`` tokens, ``suffix``) and the
block's own tokens at the positions after the block, then padding at position −1; on a step of a
continuation (a question, or no document longer than N) all P rows are padding, and decode has none.

observe (every step), per KV head: cache rows carry their score; if the step has reconstruction rows
(any of the P at a position ≥ 0), block row j < n_valid scores the max, over those rows and the query
heads of the group, of the row's softmax over the cache's sink rows (position < ``sinks``), the block's
rows [0, n_valid) and the reconstruction rows up to its own — else ``CONTINUATION``; a block row at a
position < ``sinks`` scores 1. One row of logits at a time ([N + T] floats), never a [rows, n] matrix.
With ``aligned`` (``score=aligned``) every cache row enters the softmax and block row j takes only the
reconstruction row that reproduces it. score: the candidates' state, −inf past fill + n_valid. Sums run in another order than torch's, so the
scores agree to rounding and kept sets can differ only on near ties."""

from __future__ import annotations

import math

from .face import PolicyKernels

CONTINUATION = 2.0  # edgekv.policies.reconstruct.CONTINUATION (the compiler may import policies; kept literal
# so that the kernel's constant is visibly the one the runtimes' tests compare against)


def reconstruct_kernel_params(policy, budget: int) -> dict:
    """The settings the kernels take and the runtimes fill the rows with (the manifest's
    ``policy.kernel_params``): sinks, the step's extra rows, the tail and the repeat prompt's ids."""
    prompt = policy.repeat
    return {"sinks": int(policy.sinks), "extra": int(policy.max_extra_tokens), "tail": int(policy.tail),
            "first": tuple(prompt.first), "later": tuple(prompt.later), "suffix": tuple(prompt.suffix),
            "aligned": int(getattr(policy, "score", "kvzip") == "aligned")}


def _shape(num_kv_heads, block, extra, num_q_heads, head_dim, sm_scale):
    """(Hq, G, P reconstruction rows of this step, BR real rows, scale): a prefill step has T = BR + P
    rows, decode T = 1 and no reconstruction rows."""
    if num_q_heads is None or num_q_heads % num_kv_heads:
        raise ValueError(f"reconstruct kernel: num_q_heads ({num_q_heads}) must be a multiple of {num_kv_heads}")
    P = int(extra) if block > int(extra) else 0
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    return int(num_q_heads), int(num_q_heads) // num_kv_heads, P, block - P, scale


def build_reconstruct_observe_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                                     *, sinks: int, extra: int, num_q_heads: int, sm_scale: float, aligned: int = 0,
                                     **_rows):
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import NEG_BIG, check_dtype
    from ..kernels.signature import StepShapes, observe_kernel

    check_dtype(dtype)
    H, N, TR, D = num_kv_heads, budget, block, head_dim
    Hq, G, P, BR, scale = _shape(num_kv_heads, block, extra, num_q_heads, head_dim, sm_scale)
    NB = N + TR
    KW = N + TR  # one row of logits: cache rows, then the real rows, then the reconstruction rows
    SINKS = int(sinks)
    PR = max(P, 1)
    # score=aligned: every cache row is visible (not only the sinks), and block row j takes only the
    # reconstruction row that reproduces it (row prompt − 1 + j, prompt = rows − n_valid; row 0 when
    # there is no prompt)
    ALIGNED = bool(aligned)
    VISIBLE_BELOW = 2 ** 31 - 1 if ALIGNED else SINKS  # cache rows the softmax takes: positions below this

    @T.macro
    def observe(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, state, cand_state):
        for h in T.parallel(H):
            with T.sblock("reconstruct"):
                T.reads(k_cache[h, 0:N, 0:D], pos_cache[h, 0:N], fill[0:1], k_blk[0, h, 0:TR, 0:D], pos_blk[0:TR],
                        n_valid[0:1], q[0, h * G:h * G + G, 0:TR, 0:D], state[0:1, h, 0:N])
                T.writes(cand_state[0:1, h, 0:NB])
                best = T.sblock_alloc_buffer((TR,), "float32")
                srow = T.sblock_alloc_buffer((KW,), "float32")
                red = T.sblock_alloc_buffer((3,), "float32")
                rows = T.sblock_alloc_buffer((1,), "int32")
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                rows[0] = 0
                for r in T.serial(PR):
                    if r < P:
                        if pos_blk[BR + r] >= 0:
                            rows[0] = rows[0] + 1
                for j in T.serial(TR):
                    best[j] = T.float32(0)
                for g, r in T.grid(G, PR):
                    if r < rows[0]:
                        red[0] = T.float32(NEG_BIG)
                        for c in T.serial(N):
                            if c < nf:
                                if pos_cache[h, c] < VISIBLE_BELOW:
                                    red[2] = T.float32(0)
                                    for d in T.serial(D):
                                        red[2] = red[2] + q[0, h * G + g, BR + r, d] * k_cache[h, c, d]
                                    srow[c] = red[2] * T.float32(scale)
                                    red[0] = T.max(red[0], srow[c])
                        for j in T.serial(TR):
                            if j < nv or (j >= BR and j <= BR + r):
                                red[2] = T.float32(0)
                                for d in T.serial(D):
                                    red[2] = red[2] + q[0, h * G + g, BR + r, d] * k_blk[0, h, j, d]
                                srow[N + j] = red[2] * T.float32(scale)
                                red[0] = T.max(red[0], srow[N + j])
                        red[1] = T.float32(0)
                        for c in T.serial(N):
                            if c < nf:
                                if pos_cache[h, c] < VISIBLE_BELOW:
                                    srow[c] = T.exp(srow[c] - red[0])
                                    red[1] = red[1] + srow[c]
                        for j in T.serial(TR):
                            if j < nv or (j >= BR and j <= BR + r):
                                srow[N + j] = T.exp(srow[N + j] - red[0])
                                red[1] = red[1] + srow[N + j]
                        if ALIGNED:
                            for j in T.serial(TR):
                                if j < nv:
                                    if r == T.max(rows[0] - nv - 1 + j, 0):
                                        best[j] = T.max(best[j], srow[N + j] / red[1])
                        else:
                            for j in T.serial(TR):
                                if j < nv:
                                    best[j] = T.max(best[j], srow[N + j] / red[1])
                for j in T.serial(NB):
                    if j < nf:
                        cand_state[0, h, j] = state[0, h, T.min(j, N - 1)]
                    elif j < nf + nv:
                        cand_state[0, h, j] = T.if_then_else(
                            pos_blk[T.min(T.max(j - nf, 0), TR - 1)] < SINKS, T.float32(1),
                            T.if_then_else(rows[0] > 0, best[T.min(T.max(j - nf, 0), TR - 1)],
                                           T.float32(CONTINUATION)))
                    else:
                        cand_state[0, h, j] = T.float32(0)

    return observe_kernel(StepShapes(H, N, TR, D, Hq=Hq, S=1), observe)


def build_reconstruct_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                                   *, num_q_heads: int, sm_scale: float, **_params):
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, state_score_kernel

    check_dtype(dtype)
    H, N, TR, D, Hq = num_kv_heads, budget, block, head_dim, int(num_q_heads)
    NB = N + TR

    @T.macro
    def score_body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, cand_state, score):
        for h in T.parallel(H):
            with T.sblock("score"):
                T.reads(cand_state[0, h, 0:NB], fill[0:1], n_valid[0:1])
                T.writes(score[h, 0:NB])
                n: T.let[T.int32] = fill[0] + n_valid[0]
                for j in T.serial(NB):
                    score[h, j] = T.if_then_else(j < n, cand_state[0, h, j], T.float32("-inf"))

    return state_score_kernel(StepShapes(H, N, TR, D, Hq=Hq, S=1), score_body)


KERNELS = PolicyKernels(
    evict_kernel=build_reconstruct_evict_kernel,
    observe_kernel=build_reconstruct_observe_kernel,
    kernel_inputs=("queries",),
    kernel_params=reconstruct_kernel_params,
)
