"""The kernel signatures of one layer's cache step, each written once.

Every edgekv cache-step kernel — block attention, a policy's score or observe kernel, select +
compaction — has one of the fixed signatures below (buffers and conventions: ``common``). A
builder writes only the *body*, as a ``T.macro`` that takes the buffers in signature order, and
gets the PrimFunc from here; its CPU and GPU versions pass the same body shape with
``gpu=False`` / ``gpu=True``. So the buffer declarations live in one place, a GPU kernel has
the signature of its CPU twin by construction (``gpu_schedule.ReplaceKernels`` swaps one for
the other), and a new kernel is one body.

``gpu=True`` marks the function ``tirx.is_scheduled`` (dlight leaves it alone: its thread
bindings are its schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T


@dataclass(frozen=True)
class StepShapes:
    """The static shapes of one layer's cache step: ``H`` KV heads, cache budget ``N``, block
    ``B`` (rows of the block's K/V/positions, pseudo rows included), head dim ``D``; ``Hq``
    query heads (kernels with queries) and ``S`` per-entry state fields (stateful policies)."""

    H: int
    N: int
    B: int
    D: int
    Hq: int = 0
    S: int = 0

    @property
    def NB(self) -> int:
        """Eviction candidates: the cache rows followed by the block rows."""
        return self.N + self.B


def kernel_attrs(gpu: bool) -> dict:
    """The function attributes of an edgekv kernel (for a policy's own signatures, as D2O's)."""
    return {"tirx.noalias": True, "tirx.is_scheduled": True} if gpu else {"tirx.noalias": True}


def score_kernel(s: StepShapes, body, *, gpu: bool = False, queries: bool = False):
    """``score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid[, q], score)``:
    the common eight, the block's queries ``q`` [1, Hq, B, D] when ``queries``, and one score per
    candidate [H, N + B]. ``body`` gets the buffers in that order."""
    H, N, B, D, Hq, NB = s.H, s.N, s.B, s.D, s.Hq, s.NB
    attrs = kernel_attrs(gpu)
    if queries:
        @T.prim_func(private=True, s_tir=True)
        def score_with_queries(
            k_cache: T.Buffer((H, N, D), "float32"),
            v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"),
            fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"),
            v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"),
            n_valid: T.Buffer((1,), "int32"),
            q: T.Buffer((1, Hq, B, D), "float32"),
            score: T.Buffer((H, NB), "float32"),
        ):
            T.func_attr(attrs)
            body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, score)

        return score_with_queries

    @T.prim_func(private=True, s_tir=True)
    def score_kv(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr(attrs)
        body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score)

    return score_kv


def observe_kernel(s: StepShapes, body, *, gpu: bool = False):
    """``observe(common eight, q, state [S, H, N], cand_state [S, H, N + B])``: a stateful policy's
    per-step update — reads the cache's ``state`` and writes every candidate's ``cand_state``,
    which select + compaction then carries along with the kept rows."""
    H, N, B, D, Hq, S, NB = s.H, s.N, s.B, s.D, s.Hq, s.S, s.NB
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def observe(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        q: T.Buffer((1, Hq, B, D), "float32"),
        state: T.Buffer((S, H, N), "float32"),
        cand_state: T.Buffer((S, H, NB), "float32"),
    ):
        T.func_attr(attrs)
        body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, state, cand_state)

    return observe


def state_score_kernel(s: StepShapes, body, *, gpu: bool = False):
    """``score(common eight, q, cand_state, score)``: a stateful policy's score, made from the
    candidates' state that its observe kernel wrote."""
    H, N, B, D, Hq, S, NB = s.H, s.N, s.B, s.D, s.Hq, s.S, s.NB
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def score_from_state(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        q: T.Buffer((1, Hq, B, D), "float32"),
        cand_state: T.Buffer((S, H, NB), "float32"),
        score: T.Buffer((H, NB), "float32"),
    ):
        T.func_attr(attrs)
        body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, q, cand_state, score)

    return score_from_state


def select_kernel(s: StepShapes, body, *, with_score: bool, gpu: bool = False):
    """``select(common eight[, score][, state, cand_state])``, in place on the cache (and state):
    the four signatures (a score or append-only) × (with or without ``s.S`` state fields). ``body``
    always gets eleven arguments, ``None`` for the buffers this signature lacks."""
    H, N, B, D, S, NB = s.H, s.N, s.B, s.D, s.S, s.NB
    attrs = kernel_attrs(gpu)
    if with_score and S:
        @T.prim_func(private=True, s_tir=True)
        def select_compact_state(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            score: T.Buffer((H, NB), "float32"),
            state: T.Buffer((S, H, N), "float32"), cand_state: T.Buffer((S, H, NB), "float32"),
        ):
            T.func_attr(attrs)
            body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, state, cand_state)

        return select_compact_state
    if with_score:
        @T.prim_func(private=True, s_tir=True)
        def select_compact(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            score: T.Buffer((H, NB), "float32"),
        ):
            T.func_attr(attrs)
            body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, None, None)

        return select_compact
    if S:
        @T.prim_func(private=True, s_tir=True)
        def append_only_state(
            k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
            pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
            k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
            pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
            state: T.Buffer((S, H, N), "float32"), cand_state: T.Buffer((S, H, NB), "float32"),
        ):
            T.func_attr(attrs)
            body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, None, state, cand_state)

        return append_only_state

    @T.prim_func(private=True, s_tir=True)
    def append_only(
        k_cache: T.Buffer((H, N, D), "float32"), v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"), fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"), v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"), n_valid: T.Buffer((1,), "int32"),
    ):
        T.func_attr(attrs)
        body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, None, None, None)

    return append_only


def attention_kernel(s: StepShapes, body, *, gpu: bool = False):
    """``attention(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out [1, Hq, B, D])``: the
    block's queries against cache ⊕ block."""
    H, N, B, D, Hq = s.H, s.N, s.B, s.D, s.Hq
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def block_attention(
        q: T.Buffer((1, Hq, B, D), "float32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        fill: T.Buffer((1,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        out: T.Buffer((1, Hq, B, D), "float32"),
    ):
        T.func_attr(attrs)
        body(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out)

    return block_attention


def window_attention_kernel(s: StepShapes, body):
    """``attention(q, k_blk, v_blk, k_cache, v_cache, pos_cache, fill, pos_blk, n_valid, out)``: a
    sliding-window layer's block attention, which reads each cache slot's position (its cache is a
    ring: slot order is not position order) and the block's positions. CPU only."""
    H, N, B, D, Hq = s.H, s.N, s.B, s.D, s.Hq
    attrs = kernel_attrs(False)

    @T.prim_func(private=True, s_tir=True)
    def window_attention(
        q: T.Buffer((1, Hq, B, D), "float32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        out: T.Buffer((1, Hq, B, D), "float32"),
    ):
        T.func_attr(attrs)
        body(q, k_blk, v_blk, k_cache, v_cache, fill, n_valid, out, pos_cache, pos_blk)

    return window_attention
