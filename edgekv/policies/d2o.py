"""`d2o` — D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025, arXiv 2406.13035).

Definition. Two levels. *Layers*: the variance over tokens of the attention column sums (the total
attention each token receives) measures how sparse a layer is; layer budgets are an "inverse variance
softmax", β_l = softmax_l(−σ̃²_l), dense (low-variance) layers getting more. *Tokens*: inside its budget
N_l a layer keeps 4 attention sinks + the top heavy hitters by accumulated attention (H2O) + the M_l
most recent entries (N:M = 3:1, sinks counted in the heavy part). Every evicted entry is matched to its
most key-cosine-similar kept entry; if that similarity m reaches the layer's EMA threshold
τ ← β·mean(m) + (1 − β)·τ (τ = mean(m) at the layer's first eviction), its K and V are merged into the
match with the paper's convex weights (Eq. 12): k_j ← (e·k_j + Σ_i e^{u_ij} k_i) / (e + Σ_i e^{u_ij}),
same weights for v. Merged slots keep their own score and position.

Defaults (paper §5.1 / A.3): N:M = 3:1 (``recent_ratio=0.25``), ``sinks=4``, ``beta=0.7``,
``merge="weighted"`` (Eq. 12), EMA threshold on. Layer allocation: ``variance_norm="minmax"``.

Layer budgets. The engine sizes every layer's buffers for the global N, so a layer can never get more
than N. The paper fixes the *total* (Σ_l N_l = α·S·L); here the total is ``avg_ratio``·N·L (default
0.75: average layer budget 0.75·N) and the softmax shares are water-filled under the cap N (a layer
over N is set to N and its excess goes to the others in proportion to their shares; a floor of
sinks + 2) then rounded down, so every N_l ≤ N and Σ N_l = ⌊avg_ratio·N·L⌋. ``avg_ratio=1`` is uniform
N (D2O "without the layer operation"), ``layers="uniform"`` is uniform ⌊avg_ratio·N⌋ (for ablations at
equal memory). To match a uniform policy's total memory N·L, run D2O with budget N / avg_ratio.
A prompt that fits the buffers (n ≤ N) has nothing to compress: every layer gets N (so with
N ≥ prompt + output D2O is exactly full attention, as every edgekv policy must be).

Block-wise adaptation (digest §8.5, option A). The layer statistic comes from the exact attention of
the *first block* (nothing is evicted yet): ``prepare`` runs that block once more through a throw-away
engine that records each layer's per-head column sums (cost: one extra block forward per prompt), and
the budgets are frozen for the prompt. Scores accumulate over every step (each block's column sums
over cache ⊕ block, computed a few query rows at a time; one row per decode step). Every eviction event
(each evicting block, then every decode step) evicts down to N_l, merges, and updates τ once. With one
block covering the whole prompt this is the paper's after-prefill D2O exactly (budgets from the whole
prompt's attention, scores = its column sums, τ = the mean best similarity).

Paper/code discrepancies followed (digest §3, §9): the paper's Eq. 12 merge (the code's cosine-weighted
scatter-mean is ``merge="code"``, plain average ``merge="average"``); compression right after prefill (the
code compresses at the first decode step — impossible here, the cache must be ≤ N after every step);
no uncompressed layers (the code never compresses layers 0, 1, L−1); τ per layer, reset per prompt (the
code never resets it); sinks counted inside the heavy part (as the code). Deviations: the raw variance
is normalised across layers by min-max before the softmax (the paper's raw softmax is degenerate, the
code's per-head min-max makes it uniform; ``variance_norm`` = raw / head_minmax / mean to switch);
selection and scores are per KV head (query-head column sums averaged over the group; the code
expands K/V to the query heads); the merge decision is per (head, evicted entry), since every KV head
evicts its own entries (the code averages m over heads).

Compiled (``build_d2o_score_kernel``, ``build_d2o_evict_kernel`` and their ``_gpu`` versions, wired per
attention site by ``emit_d2o_site``): each layer carries the accumulated sums as the generic per-entry
``state`` tensor (compacted with the cache) and ``COMPILED_STATE`` — (N_l, M_l) and τ. The budgets are state, set per prompt by
the host runtime with ``prompt_budgets`` from the compiled first block's column sums (docs/COMPILER.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .attention_rows import attention_column_sums, group_reduce, require_queries
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, protect_sinks, topk_keep
from .h2o import pin_most_recent

STATE = "d2o_acc"
# Evicted rows per chunk of the cosine-similarity matrix [H, chunk, N_l].
SIM_CHUNK = 256


# ---- layer level -----------------------------------------------------------------------------
def column_sum_variance(col_sums: torch.Tensor) -> torch.Tensor:
    """[Hq, n] attention column sums -> [Hq] variance over tokens (unbiased, as the code's ``var``)."""
    if col_sums.shape[-1] < 2:
        return torch.zeros(col_sums.shape[0], dtype=torch.float64)
    return col_sums.double().var(dim=-1)


def layer_statistic(head_variances: torch.Tensor, norm: str = "minmax") -> torch.Tensor:
    """[L, Hq] per-head column-sum variances -> [L] the σ̃² that enters the softmax.

    ``raw``: mean over heads (paper-literal). ``minmax``: raw, min-max normalised across layers.
    ``mean``: raw divided by its mean over layers. ``head_minmax``: the official code — min-max across
    the heads of each layer, then the mean over heads.
    """
    v = head_variances.double()
    if norm == "head_minmax":
        lo, hi = v.min(dim=1, keepdim=True).values, v.max(dim=1, keepdim=True).values
        return ((v - lo) / (hi - lo + 1e-6)).mean(dim=1)
    raw = v.mean(dim=1)
    if norm == "raw":
        return raw
    if norm == "minmax":
        return (raw - raw.min()) / (raw.max() - raw.min() + 1e-12)
    if norm == "mean":
        return raw / raw.mean().clamp_min(1e-12)
    raise PolicyError(f"d2o: unknown variance_norm {norm!r}; use minmax, mean, raw or head_minmax")


def allocate_budgets(shares: torch.Tensor, cap: int, total: int, floor: int) -> list[int]:
    """Split ``total`` slots over layers in proportion to ``shares`` (Σ = 1), each within
    [floor, cap]: water-filling (a layer clamped at a bound is fixed there and the rest is
    re-split among the others in proportion), then rounding down with the remainder given to the
    largest fractional parts. Σ result = min(total, L·cap) when total ≥ L·floor."""
    shares = shares.double()
    n_layers = shares.numel()
    floor = min(floor, cap)
    total = max(min(total, n_layers * cap), n_layers * floor)
    alloc = torch.zeros(n_layers, dtype=torch.float64)
    free = torch.ones(n_layers, dtype=torch.bool)
    remaining = float(total)
    while free.any():
        weight = shares[free].sum()
        share = torch.zeros_like(shares)
        share[free] = (shares[free] / weight * remaining) if weight > 0 else remaining / int(free.sum())
        over = free & (share > cap)
        under = free & (share < floor)
        if over.any():
            alloc[over], free[over] = float(cap), False
            remaining -= cap * int(over.sum())
        elif under.any():
            alloc[under], free[under] = float(floor), False
            remaining -= floor * int(under.sum())
        else:
            alloc[free], free[:] = share[free], False
    out = alloc.floor()
    rest = int(round(total - float(out.sum())))
    frac = alloc - out
    for i in torch.sort(frac, descending=True, stable=True).indices.tolist():
        if rest <= 0:
            break
        if out[i] < cap:
            out[i] += 1
            rest -= 1
    return [int(x) for x in out.tolist()]


@dataclass
class _VarianceProbe(Policy):
    """Records each layer's per-query-head column-sum variance of one step (never evicts)."""

    name = "d2o-probe"
    needs_queries = True
    observes_every_step = True

    def __post_init__(self) -> None:
        self.variances: dict[int, torch.Tensor] = {}

    def observe(self, ctx: EvictionContext) -> None:
        queries, query_positions = require_queries(ctx, self.name)
        sums = attention_column_sums(ctx.keys, ctx.positions, queries, query_positions, ctx.scale)
        self.variances[ctx.layer] = column_sum_variance(sums)

    def select(self, ctx: EvictionContext) -> Selection:
        return keep_all(ctx)


# ---- token level -----------------------------------------------------------------------------
def best_matches(evicted_keys: torch.Tensor, kept_keys: torch.Tensor, chunk: int = SIM_CHUNK):
    """Per head and evicted entry, the most key-cosine-similar kept entry: (m [H, E], j* [H, E]).

    The [H, E, C] similarity matrix is built ``chunk`` evicted rows at a time."""
    kept_unit = torch.nn.functional.normalize(kept_keys.float(), dim=-1)
    best, where = [], []
    for start in range(0, evicted_keys.shape[1], chunk):
        ev_unit = torch.nn.functional.normalize(evicted_keys[:, start : start + chunk].float(), dim=-1)
        sim = torch.matmul(ev_unit, kept_unit.transpose(1, 2))  # [H, e, C]
        m, j = sim.max(dim=-1)
        best.append(m)
        where.append(j)
    if not best:
        empty = evicted_keys.new_zeros(evicted_keys.shape[0], 0)
        return empty.float(), empty.long()
    return torch.cat(best, dim=1), torch.cat(where, dim=1)


def merge_into(kept: torch.Tensor, evicted: torch.Tensor, target: torch.Tensor, sim: torch.Tensor,
               merge: torch.Tensor, mode: str = "weighted") -> torch.Tensor:
    """Fold the evicted rows selected by ``merge`` [H, E] into their targets [H, E] among ``kept``.

    kept [H, C, d], evicted [H, E, d], sim [H, E] = u_{i j*(i)}.
    ``weighted`` (paper Eq. 12): x_j ← (e·x_j + Σ_i e^{u_i} x_i) / (e + Σ_i e^{u_i}).
    ``code`` (official code): x_j ← (x_j + Σ_i u_i x_i) / (1 + |E_j|).
    ``average`` (Table 8's "average merge"): x_j ← (x_j + Σ_i x_i) / (1 + |E_j|).
    Rows with no merged entry are unchanged."""
    w_on = merge.to(torch.float32)
    if mode == "weighted":
        self_w, w, count_w = math.e, torch.exp(sim.float()) * w_on, None
    elif mode == "code":
        self_w, w, count_w = 1.0, sim.float() * w_on, w_on
    elif mode == "average":
        self_w, w, count_w = 1.0, w_on, w_on
    else:
        raise PolicyError(f"d2o: unknown merge {mode!r}; use weighted, code, average or none")
    heads, _, d = kept.shape
    idx = target.long()
    num = kept.float() * self_w
    num = num.scatter_add(1, idx[..., None].expand(heads, idx.shape[1], d), w[..., None] * evicted.float())
    den = torch.zeros(heads, kept.shape[1], dtype=torch.float32)
    den = den.scatter_add(1, idx, w if count_w is None else count_w) + self_w
    return (num / den[..., None]).to(kept.dtype)


# ---- compiled kernels --------------------------------------------------------------------------
MERGE_MODES = ("weighted", "code", "average")
# What the compiled model carries per layer beside k, v, pos, fill (one tensor each, in this order):
#   state       [1, H, N] float32  the generic per-entry state of ``entry_state`` (Policy, "Compiled
#                                  kernels beyond K/V"): the accumulated column sums of the cached
#                                  entries, compacted with them
# and D2O's own per-layer tensors (``compiled_state``):
#   d2o_budget  [2] int32       N_l and M_l = ⌊N_l·recent_ratio⌋, set by the host per prompt
#   d2o_tau     [2] float32     τ, and 1.0 once the layer's first eviction has set it
COMPILED_STATE = (("d2o_budget", 2, "int32"), ("d2o_tau", 2, "float32"))


def _merge_weight_fn(merge: str):
    """sim (a PrimExpr) -> the weight of an evicted row in ``merge_into``'s numerator."""
    from tvm import tirx

    if merge == "weighted":
        return tirx.exp
    if merge == "code":
        return lambda sim: sim
    return lambda sim: tirx.const(1.0, "float32")


def _update_tau_macro(H: int, NB: int, beta: float, ema: bool):
    """``update_tau(gone, best, evicted, d2o_tau, thr, total)``: ``update_threshold`` over the
    evicted entries of all H heads (``evicted`` per head) — τ = mean(m) at the first eviction,
    then β·mean(m) + (1 − β)·τ — and the merge threshold ``thr`` (−inf with threshold="none")."""
    from tvm.script import tirx as T

    @T.macro
    def update_tau(gone, best, evicted, d2o_tau, thr, total):
        total[0] = T.float32(0)
        for h in T.serial(H):
            for i in T.serial(NB):
                if gone[h, i] == 1:
                    total[0] = total[0] + best[h, i]
        total[0] = total[0] / T.Cast("float32", H * evicted)
        if d2o_tau[1] == T.float32(0):
            d2o_tau[0] = total[0]
            d2o_tau[1] = T.float32(1)
        else:
            d2o_tau[0] = T.float32(beta) * total[0] + T.float32(1.0 - beta) * d2o_tau[0]
        thr[0] = T.if_then_else(ema, d2o_tau[0], T.float32("-inf"))

    return update_tau


def _score_signature(s, body, *, gpu: bool):
    """D2O's score kernel signature (CPU and GPU: one declaration, ``kernels/signature.py``'s way):
    ``(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand,
    col_sums)``."""
    from tvm.script import tirx as T

    from ..compiler.kernels.signature import kernel_attrs

    H, N, B, D, Hq, NB = s.H, s.N, s.B, s.D, s.Hq, s.NB
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def d2o_score(
        q: T.Buffer((1, Hq, B, D), "float32"),
        k_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        acc: T.Buffer((1, H, N), "float32"),
        d2o_budget: T.Buffer((2,), "int32"),
        score: T.Buffer((H, NB), "float32"),
        acc_cand: T.Buffer((H, NB), "float32"),
        col_sums: T.Buffer((Hq, NB), "float32"),
    ):
        T.func_attr(attrs)
        body(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand, col_sums)

    return d2o_score


def _evict_signature(s, body, *, gpu: bool):
    """D2O's evict (select + merge + compaction) signature: the common eight, then ``score,
    acc_cand, d2o_budget, acc, d2o_tau``."""
    from tvm.script import tirx as T

    from ..compiler.kernels.signature import kernel_attrs

    H, N, B, D, NB = s.H, s.N, s.B, s.D, s.NB
    attrs = kernel_attrs(gpu)

    @T.prim_func(private=True, s_tir=True)
    def d2o_evict(
        k_cache: T.Buffer((H, N, D), "float32"),
        v_cache: T.Buffer((H, N, D), "float32"),
        pos_cache: T.Buffer((H, N), "int32"),
        fill: T.Buffer((1,), "int32"),
        k_blk: T.Buffer((1, H, B, D), "float32"),
        v_blk: T.Buffer((1, H, B, D), "float32"),
        pos_blk: T.Buffer((B,), "int32"),
        n_valid: T.Buffer((1,), "int32"),
        score: T.Buffer((H, NB), "float32"),
        acc_cand: T.Buffer((H, NB), "float32"),
        d2o_budget: T.Buffer((2,), "int32"),
        acc: T.Buffer((1, H, N), "float32"),
        d2o_tau: T.Buffer((2,), "float32"),
    ):
        T.func_attr(attrs)
        body(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, d2o_budget, acc,
             d2o_tau)

    return d2o_evict


def build_d2o_score_kernel(num_q_heads: int, num_kv_heads: int, budget: int, block: int, head_dim: int,
                           sm_scale: float, dtype: str = "float32", sinks: int = 4):
    """TIR kernel: ``D2OPolicy.observe`` + ``D2OPolicy.score`` of one layer, on every step.

    ``(q[1, Hq, B, d], k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc[1, H, N], d2o_budget[2])
    -> (score[H, N+B], acc_cand[H, N+B], col_sums[Hq, N+B])``

    col_sums: per query head, Σ over the block's valid query rows of their attention probabilities
    over cache ⊕ block (softmax per row over the candidates with position ≤ the row's, as
    ``attention_column_sums``; one row at a time). acc_cand: the candidates' accumulated sums after
    this step (cache rows: ``acc`` + the group mean of col_sums; block rows: the group mean).
    score: acc_cand with the sinks (position < ``sinks``) and the M_l = ``d2o_budget[1]`` newest
    candidates (the last M_l indices: the cache is in temporal order) at +inf. The host reads
    col_sums of the probe block (``d2o_layer_budgets``); the eviction kernel compacts acc_cand."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes

    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    G = Hq // H
    NB = N + B
    S = int(sinks)
    scale = float(sm_scale)

    @T.macro
    def d2o_score(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand, col_sums):
        for hq in T.parallel(Hq):
            with T.sblock("d2o_col_sums"):
                T.reads(q[0, hq, 0:B, 0:D], k_cache[hq // G, 0:N, 0:D], pos_cache[hq // G, 0:N], fill[0:1],
                        k_blk[0, hq // G, 0:B, 0:D], pos_blk[0:B], n_valid[0:1])
                T.writes(col_sums[hq, 0:NB])
                logit = T.sblock_alloc_buffer((NB,), "float32")
                red = T.sblock_alloc_buffer((3,), "float32")  # dot product, row max, row sum
                nf: T.let[T.int32] = fill[0]
                nv: T.let[T.int32] = n_valid[0]
                for j in T.serial(NB):
                    col_sums[hq, j] = T.float32(0)
                for r in T.serial(B):
                    if r < nv:
                        red[1] = T.float32("-inf")
                        for j in T.serial(NB):
                            logit[j] = T.float32("-inf")
                            if j < nf + nv:
                                if T.if_then_else(j < nf, pos_cache[hq // G, T.min(j, N - 1)],
                                                  pos_blk[T.max(j - nf, 0)]) <= pos_blk[r]:
                                    red[0] = T.float32(0)
                                    for c in T.serial(D):
                                        red[0] = red[0] + q[0, hq, r, c] * T.if_then_else(
                                            j < nf, k_cache[hq // G, T.min(j, N - 1), c], k_blk[0, hq // G, T.max(j - nf, 0), c])
                                    logit[j] = red[0] * T.float32(scale)
                                    red[1] = T.max(red[1], logit[j])
                        red[2] = T.float32(0)
                        for j in T.serial(NB):
                            logit[j] = T.if_then_else(logit[j] == T.float32("-inf"), T.float32(0),
                                                      T.exp(logit[j] - red[1]))
                            red[2] = red[2] + logit[j]
                        for j in T.serial(NB):
                            col_sums[hq, j] = col_sums[hq, j] + logit[j] / red[2]
        for h in T.parallel(H):
            with T.sblock("d2o_acc_score"):
                T.reads(col_sums[h * G:h * G + G, 0:NB], acc[0, h, 0:N], pos_cache[h, 0:N], pos_blk[0:B], fill[0:1],
                        n_valid[0:1], d2o_budget[0:2])
                T.writes(acc_cand[h, 0:NB], score[h, 0:NB])
                inc = T.sblock_alloc_buffer((1,), "float32")
                nf2: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                for j in T.serial(NB):
                    inc[0] = T.float32(0)
                    for g in T.serial(G):
                        inc[0] = inc[0] + col_sums[h * G + g, j]
                    acc_cand[h, j] = T.if_then_else(j < nf2, acc[0, h, T.min(j, N - 1)], T.float32(0)) + inc[0] / T.float32(G)
                    score[h, j] = T.float32("-inf")
                    if j < n:
                        score[h, j] = acc_cand[h, j]
                        if j >= n - d2o_budget[1]:
                            score[h, j] = T.float32("inf")
                        if T.if_then_else(j < nf2, pos_cache[h, T.min(j, N - 1)], pos_blk[T.max(j - nf2, 0)]) < S:
                            score[h, j] = T.float32("inf")

    return _score_signature(StepShapes(H, N, B, D, Hq=Hq), d2o_score, gpu=False)


def build_d2o_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                           merge: str = "weighted", threshold: str = "ema", beta: float = 0.7, eps: float = 1e-12):
    """TIR eviction kernel of one layer: ``D2OPolicy.select`` (top-N_l, ``best_matches``,
    ``update_threshold``, ``merge_into``) and the engine's compaction, in place.

    ``(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score[H, N+B],
    acc_cand[H, N+B], d2o_budget[2], acc[1, H, N], d2o_tau[2])``; in place (``call_tir_inplace``):
    k_cache, v_cache, pos_cache, fill, acc, d2o_tau (indices 0, 1, 2, 3, 11, 12).

    When fill + n_valid ≤ N_l = ``d2o_budget[0]`` the block is appended (acc ← acc_cand). Otherwise
    four loop nests: (1) per KV head (parallel): the evicted set (the shared ``evicted_mask_macro``,
    ties → the higher index evicted, as ``topk_keep``), unit keys (``F.normalize``'s ``eps``) and
    for each evicted entry its most cosine-similar kept entry m, j* (ties → the lower index, as
    ``torch.max``); (2) once: τ ← β·mean(m) + (1 − β)·τ over all heads and evicted entries (τ =
    mean(m) at the layer's first eviction; ``d2o_tau[1]`` marks it set); (3) per KV head: every
    evicted entry with m ≥ τ (all with ``threshold="none"``) folded into its j* with the weights of
    ``merge`` — into the cache row itself, or into a copy of the block row; (4) per KV head: the
    kept candidates (merged) compacted to the front in ascending order with their positions and
    acc_cand. τ is float32 (the reference carries a Python float): a merge decision can differ
    only when m is within an ulp of τ."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes
    from ..compiler.kernels.select import evicted_mask_macro

    check_dtype(dtype)
    if merge not in MERGE_MODES + ("none",):
        raise PolicyError(f"d2o: the compiled eviction has no merge mode {merge!r}; use weighted, code, average or none")
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    MERGE = merge != "none"  # merge=none: plain top-N_l, τ never updated (as ``select``)
    SELF_W = math.e if merge == "weighted" else 1.0
    weight = _merge_weight_fn(merge)
    COUNT_DEN = merge != "weighted"  # code/average: den = 1 + |E_j|; weighted: e + Σ e^u
    EPS = float(eps)
    mark_evicted = evicted_mask_macro(NB)
    update_tau = _update_tau_macro(H, NB, float(beta), threshold == "ema")

    @T.macro
    def d2o_evict(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, d2o_budget, acc, d2o_tau):
        gone = T.alloc_buffer((H, NB), "int32")
        best = T.alloc_buffer((H, NB), "float32")
        target = T.alloc_buffer((H, NB), "int32")
        unit = T.alloc_buffer((H, NB, D), "float32")
        k_new = T.alloc_buffer((H, B, D), "float32")  # the block rows, merges applied
        v_new = T.alloc_buffer((H, B, D), "float32")
        thr = T.alloc_buffer((1,), "float32")
        for h in T.parallel(H):
            with T.sblock("d2o_match"):
                T.reads(k_cache[h, 0:N, 0:D], k_blk[0, h, 0:B, 0:D], v_blk[0, h, 0:B, 0:D], score[h, 0:NB],
                        fill[0:1], n_valid[0:1], d2o_budget[0:2])
                T.writes(k_new[h, 0:B, 0:D], v_new[h, 0:B, 0:D], gone[h, 0:NB], best[h, 0:NB],
                         target[h, 0:NB], unit[h, 0:NB, 0:D])
                key = T.sblock_alloc_buffer((NB,), "int32")
                row = T.sblock_alloc_buffer((NB,), "int32")
                lo = T.sblock_alloc_buffer((1,), "int64")
                hi = T.sblock_alloc_buffer((1,), "int64")
                cnt = T.sblock_alloc_buffer((1,), "int32")
                red = T.sblock_alloc_buffer((1,), "float32")
                nf: T.let[T.int32] = fill[0]
                n: T.let[T.int32] = fill[0] + n_valid[0]
                keep: T.let[T.int32] = d2o_budget[0]
                for i in T.serial(B):
                    for c in T.serial(D):
                        k_new[h, i, c] = k_blk[0, h, i, c]
                        v_new[h, i, c] = v_blk[0, h, i, c]
                for i in T.serial(NB):
                    gone[h, i] = 0
                if n > keep:
                    mark_evicted(score, h, n, keep, key, row, lo, hi, cnt)
                    for i in T.serial(NB):
                        gone[h, i] = row[i]
                        best[h, i] = T.float32("-inf")
                        target[h, i] = 0
                    if MERGE:
                        for i in T.serial(NB):
                            if i < n:
                                red[0] = T.float32(0)
                                for c in T.serial(D):
                                    unit[h, i, c] = T.if_then_else(i < nf, k_cache[h, T.min(i, N - 1), c],
                                                                   k_blk[0, h, T.max(i - nf, 0), c])
                                    red[0] = red[0] + unit[h, i, c] * unit[h, i, c]
                                red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                for c in T.serial(D):
                                    unit[h, i, c] = unit[h, i, c] / red[0]
                        for i in T.serial(NB):
                            if i < n:
                                if row[i] == 1:
                                    for j in T.serial(NB):
                                        if j < n:
                                            if row[j] == 0:
                                                red[0] = T.float32(0)
                                                for c in T.serial(D):
                                                    red[0] = red[0] + unit[h, i, c] * unit[h, j, c]
                                                if red[0] > best[h, i]:
                                                    best[h, i] = red[0]
                                                    target[h, i] = j
        with T.sblock("d2o_tau"):
            T.reads(gone[0:H, 0:NB], best[0:H, 0:NB], fill[0:1], n_valid[0:1], d2o_budget[0:2], d2o_tau[0:2])
            T.writes(d2o_tau[0:2], thr[0:1])
            total = T.sblock_alloc_buffer((1,), "float32")
            n2: T.let[T.int32] = fill[0] + n_valid[0]
            if MERGE and n2 > d2o_budget[0]:
                update_tau(gone, best, n2 - d2o_budget[0], d2o_tau, thr, total)
        for h in T.parallel(H):
            with T.sblock("d2o_fold"):
                T.reads(gone[h, 0:NB], best[h, 0:NB], target[h, 0:NB], thr[0:1], k_blk[0, h, 0:B, 0:D],
                        v_blk[0, h, 0:B, 0:D], fill[0:1], n_valid[0:1], d2o_budget[0:2])
                T.writes(k_cache[h, 0:N, 0:D], v_cache[h, 0:N, 0:D], k_new[h, 0:B, 0:D], v_new[h, 0:B, 0:D])
                den = T.sblock_alloc_buffer((NB,), "float32")
                hit = T.sblock_alloc_buffer((NB,), "int32")
                w = T.sblock_alloc_buffer((1,), "float32")
                nf3: T.let[T.int32] = fill[0]
                if MERGE and fill[0] + n_valid[0] > d2o_budget[0]:
                    for j in T.serial(NB):
                        den[j] = T.float32(0)
                        hit[j] = 0
                    # numerators accumulate in the kept rows themselves: evicted rows are never targets
                    for i in T.serial(NB):
                        if gone[h, i] == 1:
                            if best[h, i] >= thr[0]:
                                w[0] = weight(best[h, i])
                                if hit[target[h, i]] == 0:
                                    hit[target[h, i]] = 1
                                    for c in T.serial(D):
                                        if target[h, i] < nf3:
                                            k_cache[h, target[h, i], c] = k_cache[h, target[h, i], c] * T.float32(SELF_W)
                                            v_cache[h, target[h, i], c] = v_cache[h, target[h, i], c] * T.float32(SELF_W)
                                        else:
                                            k_new[h, target[h, i] - nf3, c] = k_new[h, target[h, i] - nf3, c] * T.float32(SELF_W)
                                            v_new[h, target[h, i] - nf3, c] = v_new[h, target[h, i] - nf3, c] * T.float32(SELF_W)
                                den[target[h, i]] = den[target[h, i]] + T.if_then_else(COUNT_DEN, T.float32(1), w[0])
                                for c in T.serial(D):
                                    if target[h, i] < nf3:
                                        k_cache[h, target[h, i], c] = k_cache[h, target[h, i], c] + w[0] * T.if_then_else(
                                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.max(i - nf3, 0), c])
                                        v_cache[h, target[h, i], c] = v_cache[h, target[h, i], c] + w[0] * T.if_then_else(
                                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.max(i - nf3, 0), c])
                                    else:
                                        k_new[h, target[h, i] - nf3, c] = k_new[h, target[h, i] - nf3, c] + w[0] * T.if_then_else(
                                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.max(i - nf3, 0), c])
                                        v_new[h, target[h, i] - nf3, c] = v_new[h, target[h, i] - nf3, c] + w[0] * T.if_then_else(
                                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.max(i - nf3, 0), c])
                    for j in T.serial(NB):
                        if hit[j] == 1:
                            for c in T.serial(D):
                                if j < nf3:
                                    k_cache[h, j, c] = k_cache[h, j, c] / (den[j] + T.float32(SELF_W))
                                    v_cache[h, j, c] = v_cache[h, j, c] / (den[j] + T.float32(SELF_W))
                                else:
                                    k_new[h, j - nf3, c] = k_new[h, j - nf3, c] / (den[j] + T.float32(SELF_W))
                                    v_new[h, j - nf3, c] = v_new[h, j - nf3, c] / (den[j] + T.float32(SELF_W))
        for h in T.parallel(H):
            with T.sblock("d2o_compact"):
                T.reads(gone[h, 0:NB], k_new[h, 0:B, 0:D], v_new[h, 0:B, 0:D], acc_cand[h, 0:NB], pos_blk[0:B],
                        fill[0:1], n_valid[0:1], d2o_budget[0:2])
                T.writes(k_cache[h, 0:N, 0:D], v_cache[h, 0:N, 0:D], pos_cache[h, 0:N], acc[0, h, 0:N])
                cnt4 = T.sblock_alloc_buffer((1,), "int32")
                nf4: T.let[T.int32] = fill[0]
                # kept[j] ≥ j: writing row j from candidate kept[j] in ascending j never overwrites a
                # row still to be read (as in the select kernel); with nothing evicted this appends
                cnt4[0] = 0
                for i in T.serial(NB):
                    if i < fill[0] + n_valid[0]:
                        if gone[h, i] == 0:
                            if cnt4[0] < N:
                                if i < nf4:
                                    if cnt4[0] != i:
                                        for c in T.serial(D):
                                            k_cache[h, cnt4[0], c] = k_cache[h, i, c]
                                            v_cache[h, cnt4[0], c] = v_cache[h, i, c]
                                        pos_cache[h, cnt4[0]] = pos_cache[h, i]
                                else:
                                    for c in T.serial(D):
                                        k_cache[h, cnt4[0], c] = k_new[h, i - nf4, c]
                                        v_cache[h, cnt4[0], c] = v_new[h, i - nf4, c]
                                    pos_cache[h, cnt4[0]] = pos_blk[i - nf4]
                                acc[0, h, cnt4[0]] = acc_cand[h, i]
                                cnt4[0] = cnt4[0] + 1
        with T.sblock("d2o_fill"):
            fill[0] = T.min(fill[0] + n_valid[0], d2o_budget[0])

    return _evict_signature(StepShapes(H, N, B, D), d2o_evict, gpu=False)


# ---- GPU versions (same signatures; swapped in by gpu_schedule.ReplaceKernels) -------------------
GPU_THREADS = 128


def build_d2o_score_kernel_gpu(num_q_heads: int, num_kv_heads: int, budget: int, block: int, head_dim: int,
                               sm_scale: float, dtype: str = "float32", sinks: int = 4):
    """``build_d2o_score_kernel`` thread-bound. Column sums: one thread block per query head, each
    of the 128 threads owning the candidates j ≡ tx (mod 128) (their logits and running column
    sums in registers); per query row the row's q sits in shared memory and the row max and sum
    are reduced through shared memory. Accumulation and pins: one thread block per KV head, one
    thread per candidate."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes

    check_dtype(dtype)
    Hq, H, N, B, D = num_q_heads, num_kv_heads, budget, block, head_dim
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    G = Hq // H
    NB = N + B
    S = int(sinks)
    scale = float(sm_scale)
    NT = GPU_THREADS
    KPT = (NB + NT - 1) // NT  # candidates per thread
    QL = (D + NT - 1) // NT

    @T.macro
    def d2o_score_gpu(q, k_cache, pos_cache, fill, k_blk, pos_blk, n_valid, acc, d2o_budget, score, acc_cand, col_sums):
        for hq in T.thread_binding(Hq, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_col_sums"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    logit = T.sblock_alloc_buffer((KPT,), "float32", scope="local")
                    colacc = T.sblock_alloc_buffer((KPT,), "float32", scope="local")
                    red = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    nv: T.let[T.int32] = n_valid[0]
                    for u in T.serial(KPT):
                        colacc[u] = T.float32(0)
                    for r in T.serial(B):
                        if r < nv:
                            T.tvm_storage_sync("shared")
                            for u in T.serial(QL):
                                if u * NT + tx < D:
                                    q_sh[T.min(u * NT + tx, D - 1)] = q[0, hq, r, T.min(u * NT + tx, D - 1)]
                            T.tvm_storage_sync("shared")
                            red[1] = T.float32("-inf")
                            for u in T.serial(KPT):
                                logit[u] = T.float32("-inf")
                                if u * NT + tx < nf + nv:
                                    if T.if_then_else(u * NT + tx < nf, pos_cache[hq // G, T.min(u * NT + tx, N - 1)],
                                                      pos_blk[T.min(T.max(u * NT + tx - nf, 0), B - 1)]) <= pos_blk[r]:
                                        red[0] = T.float32(0)
                                        for c in T.serial(D):
                                            red[0] = red[0] + q_sh[c] * T.if_then_else(
                                                u * NT + tx < nf, k_cache[hq // G, T.min(u * NT + tx, N - 1), c],
                                                k_blk[0, hq // G, T.min(T.max(u * NT + tx - nf, 0), B - 1), c])
                                        logit[u] = red[0] * T.float32(scale)
                                        red[1] = T.max(red[1], logit[u])
                            red_sh[tx] = red[1]
                            T.tvm_storage_sync("shared")
                            red[1] = T.float32("-inf")
                            for t in T.serial(NT):
                                red[1] = T.max(red[1], red_sh[t])
                            T.tvm_storage_sync("shared")
                            red[2] = T.float32(0)
                            for u in T.serial(KPT):
                                logit[u] = T.if_then_else(logit[u] == T.float32("-inf"), T.float32(0),
                                                          T.exp(logit[u] - red[1]))
                                red[2] = red[2] + logit[u]
                            red_sh[tx] = red[2]
                            T.tvm_storage_sync("shared")
                            red[2] = T.float32(0)
                            for t in T.serial(NT):
                                red[2] = red[2] + red_sh[t]
                            for u in T.serial(KPT):
                                colacc[u] = colacc[u] + logit[u] / red[2]
                    for u in T.serial(KPT):
                        if u * NT + tx < NB:
                            col_sums[hq, T.min(u * NT + tx, NB - 1)] = colacc[u]
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_acc_score"):
                    T.reads()
                    T.writes()
                    inc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    nf2: T.let[T.int32] = fill[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    for u in T.serial(KPT):
                        if u * NT + tx < NB:
                            inc[0] = T.float32(0)
                            for g in T.serial(G):
                                inc[0] = inc[0] + col_sums[h * G + g, T.min(u * NT + tx, NB - 1)]
                            acc_cand[h, T.min(u * NT + tx, NB - 1)] = T.if_then_else(
                                u * NT + tx < nf2, acc[0, h, T.min(u * NT + tx, N - 1)], T.float32(0)) + inc[0] / T.float32(G)
                            score[h, T.min(u * NT + tx, NB - 1)] = T.float32("-inf")
                            if u * NT + tx < n:
                                score[h, T.min(u * NT + tx, NB - 1)] = acc_cand[h, T.min(u * NT + tx, NB - 1)]
                                if u * NT + tx >= n - d2o_budget[1]:
                                    score[h, T.min(u * NT + tx, NB - 1)] = T.float32("inf")
                                if T.if_then_else(u * NT + tx < nf2, pos_cache[h, T.min(u * NT + tx, N - 1)],
                                                  pos_blk[T.min(T.max(u * NT + tx - nf2, 0), B - 1)]) < S:
                                    score[h, T.min(u * NT + tx, NB - 1)] = T.float32("inf")

    return _score_signature(StepShapes(H, N, B, D, Hq=Hq), d2o_score_gpu, gpu=True)


def build_d2o_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                               merge: str = "weighted", threshold: str = "ema", beta: float = 0.7, eps: float = 1e-12):
    """``build_d2o_evict_kernel`` thread-bound, the same four steps as separate launches.
    (1) one thread block per KV head: thread 0 finds the evicted set (``evicted_mask_macro`` over
    shared memory: 33 counting passes, negligible next to the matching), then the 128 threads
    normalise candidates and match evicted entries (one evicted entry per thread, a loop over the
    kept ones). (2) τ: one thread. (3) merge: one thread block per KV head, one thread per channel
    (targets shared by several evicted entries need no atomics; thread 0 first tallies which rows
    are hit and their denominators). (4) compaction: one thread per channel, the row order walked
    by every thread (kept[j] ≥ j keeps it in place), thread 0 moving positions and state."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..compiler.kernels.common import check_dtype
    from ..compiler.kernels.signature import StepShapes
    from ..compiler.kernels.select import evicted_mask_macro

    check_dtype(dtype)
    if merge not in MERGE_MODES + ("none",):
        raise PolicyError(f"d2o: the compiled eviction has no merge mode {merge!r}; use weighted, code, average or none")
    H, N, B, D = num_kv_heads, budget, block, head_dim
    if D > 1024:
        raise ValueError(f"d2o GPU eviction runs one thread per channel: head_dim {D} > 1024")
    NB = N + B
    MERGE = merge != "none"
    SELF_W = math.e if merge == "weighted" else 1.0
    weight = _merge_weight_fn(merge)
    COUNT_DEN = merge != "weighted"
    EPS = float(eps)
    NT = GPU_THREADS
    KPT = (NB + NT - 1) // NT
    CP = (B * D + NT - 1) // NT
    mark_evicted = evicted_mask_macro(NB, lanes=1)  # run by one GPU thread: no vector lanes
    update_tau = _update_tau_macro(H, NB, float(beta), threshold == "ema")

    @T.macro
    def d2o_evict_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, d2o_budget, acc, d2o_tau):
        gone = T.alloc_buffer((H, NB), "int32")
        best = T.alloc_buffer((H, NB), "float32")
        target = T.alloc_buffer((H, NB), "int32")
        unit = T.alloc_buffer((H, NB, D), "float32")
        k_new = T.alloc_buffer((H, B, D), "float32")
        v_new = T.alloc_buffer((H, B, D), "float32")
        thr = T.alloc_buffer((1,), "float32")
        den_all = T.alloc_buffer((H, NB), "float32")  # per row: Σ weights (or counts) merged into it
        hit_all = T.alloc_buffer((H, NB), "int32")  # per row: 1 when something merges into it
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("d2o_match"):
                    T.reads()
                    T.writes()
                    # thread 0's selection scratch is thread-private: the sync pass allows no shared
                    # loads in branch conditions, and the bisection branches on them
                    key = T.sblock_alloc_buffer((NB,), "int32", scope="local")
                    row = T.sblock_alloc_buffer((NB,), "int32", scope="local")
                    lo = T.sblock_alloc_buffer((1,), "int64", scope="local")
                    hi = T.sblock_alloc_buffer((1,), "int64", scope="local")
                    cnt = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    nf: T.let[T.int32] = fill[0]
                    n: T.let[T.int32] = fill[0] + n_valid[0]
                    keep: T.let[T.int32] = d2o_budget[0]
                    for u in T.serial(CP):
                        if u * NT + tx < B * D:
                            k_new[h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D] = \
                                k_blk[0, h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D]
                            v_new[h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D] = \
                                v_blk[0, h, T.min((u * NT + tx) // D, B - 1), (u * NT + tx) % D]
                    for u in T.serial(KPT):
                        if u * NT + tx < NB:
                            gone[h, T.min(u * NT + tx, NB - 1)] = 0
                            best[h, T.min(u * NT + tx, NB - 1)] = T.float32("-inf")
                            target[h, T.min(u * NT + tx, NB - 1)] = 0
                    T.tvm_storage_sync("shared")
                    if n > keep:
                        if tx == 0:
                            mark_evicted(score, h, n, keep, key, row, lo, hi, cnt)
                            for i in T.serial(NB):
                                gone[h, i] = row[i]
                    T.tvm_storage_sync("shared")
                    if MERGE and n > keep:
                        for u in T.serial(KPT):
                            if u * NT + tx < n:
                                red[0] = T.float32(0)
                                for c in T.serial(D):
                                    unit[h, T.min(u * NT + tx, NB - 1), c] = T.if_then_else(
                                        u * NT + tx < nf, k_cache[h, T.min(u * NT + tx, N - 1), c],
                                        k_blk[0, h, T.min(T.max(u * NT + tx - nf, 0), B - 1), c])
                                    red[0] = red[0] + unit[h, T.min(u * NT + tx, NB - 1), c] * unit[h, T.min(u * NT + tx, NB - 1), c]
                                red[0] = T.max(T.sqrt(red[0]), T.float32(EPS))
                                for c in T.serial(D):
                                    unit[h, T.min(u * NT + tx, NB - 1), c] = unit[h, T.min(u * NT + tx, NB - 1), c] / red[0]
                        T.tvm_storage_sync("shared")
                        for u in T.serial(KPT):
                            if u * NT + tx < n:
                                if gone[h, T.min(u * NT + tx, NB - 1)] == 1:
                                    for j in T.serial(NB):
                                        if j < n:
                                            if gone[h, j] == 0:
                                                red[0] = T.float32(0)
                                                for c in T.serial(D):
                                                    red[0] = red[0] + unit[h, T.min(u * NT + tx, NB - 1), c] * unit[h, j, c]
                                                if red[0] > best[h, T.min(u * NT + tx, NB - 1)]:
                                                    best[h, T.min(u * NT + tx, NB - 1)] = red[0]
                                                    target[h, T.min(u * NT + tx, NB - 1)] = j
        for _b in T.thread_binding(1, thread="blockIdx.x"):
            for _t in T.thread_binding(1, thread="threadIdx.x"):
                with T.sblock("d2o_tau"):
                    T.reads()
                    T.writes()
                    total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    n2: T.let[T.int32] = fill[0] + n_valid[0]
                    if MERGE and n2 > d2o_budget[0]:
                        update_tau(gone, best, n2 - d2o_budget[0], d2o_tau, thr, total)
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for c in T.thread_binding(D, thread="threadIdx.x"):
                with T.sblock("d2o_fold"):
                    T.reads()
                    T.writes()
                    w = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    nf3: T.let[T.int32] = fill[0]
                    if MERGE and fill[0] + n_valid[0] > d2o_budget[0]:
                        if c == 0:
                            for j in T.serial(NB):
                                den_all[h, j] = T.float32(0)
                                hit_all[h, j] = 0
                            for i in T.serial(NB):
                                if gone[h, i] == 1:
                                    if best[h, i] >= thr[0]:
                                        hit_all[h, target[h, i]] = 1
                                        den_all[h, target[h, i]] = den_all[h, target[h, i]] + T.if_then_else(
                                            COUNT_DEN, T.float32(1), weight(best[h, i]))
                        T.tvm_storage_sync("shared")
                        for j in T.serial(NB):
                            if hit_all[h, j] == 1:
                                if j < nf3:
                                    k_cache[h, T.min(j, N - 1), c] = k_cache[h, T.min(j, N - 1), c] * T.float32(SELF_W)
                                    v_cache[h, T.min(j, N - 1), c] = v_cache[h, T.min(j, N - 1), c] * T.float32(SELF_W)
                                else:
                                    k_new[h, T.min(j - nf3, B - 1), c] = k_new[h, T.min(j - nf3, B - 1), c] * T.float32(SELF_W)
                                    v_new[h, T.min(j - nf3, B - 1), c] = v_new[h, T.min(j - nf3, B - 1), c] * T.float32(SELF_W)
                        for i in T.serial(NB):
                            if gone[h, i] == 1:
                                if best[h, i] >= thr[0]:
                                    w[0] = weight(best[h, i])
                                    if target[h, i] < nf3:
                                        k_cache[h, T.min(target[h, i], N - 1), c] = k_cache[h, T.min(target[h, i], N - 1), c] + w[0] * T.if_then_else(
                                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                                        v_cache[h, T.min(target[h, i], N - 1), c] = v_cache[h, T.min(target[h, i], N - 1), c] + w[0] * T.if_then_else(
                                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                                    else:
                                        k_new[h, T.min(target[h, i] - nf3, B - 1), c] = k_new[h, T.min(target[h, i] - nf3, B - 1), c] + w[0] * T.if_then_else(
                                            i < nf3, k_cache[h, T.min(i, N - 1), c], k_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                                        v_new[h, T.min(target[h, i] - nf3, B - 1), c] = v_new[h, T.min(target[h, i] - nf3, B - 1), c] + w[0] * T.if_then_else(
                                            i < nf3, v_cache[h, T.min(i, N - 1), c], v_blk[0, h, T.min(T.max(i - nf3, 0), B - 1), c])
                        for j in T.serial(NB):
                            if hit_all[h, j] == 1:
                                if j < nf3:
                                    k_cache[h, T.min(j, N - 1), c] = k_cache[h, T.min(j, N - 1), c] / (den_all[h, j] + T.float32(SELF_W))
                                    v_cache[h, T.min(j, N - 1), c] = v_cache[h, T.min(j, N - 1), c] / (den_all[h, j] + T.float32(SELF_W))
                                else:
                                    k_new[h, T.min(j - nf3, B - 1), c] = k_new[h, T.min(j - nf3, B - 1), c] / (den_all[h, j] + T.float32(SELF_W))
                                    v_new[h, T.min(j - nf3, B - 1), c] = v_new[h, T.min(j - nf3, B - 1), c] / (den_all[h, j] + T.float32(SELF_W))
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for c in T.thread_binding(D, thread="threadIdx.x"):
                with T.sblock("d2o_compact"):
                    T.reads()
                    T.writes()
                    cnt4 = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    nf4: T.let[T.int32] = fill[0]
                    cnt4[0] = 0
                    for i in T.serial(NB):
                        if i < fill[0] + n_valid[0]:
                            if gone[h, i] == 0:
                                if cnt4[0] < N:
                                    if i < nf4:
                                        if cnt4[0] != i:
                                            k_cache[h, cnt4[0], c] = k_cache[h, T.min(i, N - 1), c]
                                            v_cache[h, cnt4[0], c] = v_cache[h, T.min(i, N - 1), c]
                                            if c == 0:
                                                pos_cache[h, cnt4[0]] = pos_cache[h, T.min(i, N - 1)]
                                    else:
                                        k_cache[h, cnt4[0], c] = k_new[h, T.min(i - nf4, B - 1), c]
                                        v_cache[h, cnt4[0], c] = v_new[h, T.min(i - nf4, B - 1), c]
                                        if c == 0:
                                            pos_cache[h, cnt4[0]] = pos_blk[T.min(i - nf4, B - 1)]
                                    if c == 0:
                                        acc[0, h, cnt4[0]] = acc_cand[h, i]
                                    cnt4[0] = cnt4[0] + 1
        for _b in T.thread_binding(1, thread="blockIdx.x"):
            for _t in T.thread_binding(1, thread="threadIdx.x"):
                with T.sblock("d2o_fill"):
                    T.reads()
                    T.writes()
                    fill[0] = T.min(fill[0] + n_valid[0], d2o_budget[0])

    return _evict_signature(StepShapes(H, N, B, D), d2o_evict_gpu, gpu=True)


def d2o_gpu_kernel(name: str, func, policy_params: dict, sm_scales: dict):
    """``gpu_schedule.ReplaceKernels``'s hook (``D2OPolicy.gpu_kernel``): (kind, GPU PrimFunc) for
    the D2O kernel ``name`` (the names ``emit_d2o_site`` gives), None for any other function."""
    import re

    params = dict(policy_params)
    sinks = int(params.pop("sinks"))
    shape = lambda i: tuple(int(x) for x in func.params[i].ty.shape)  # noqa: E731
    m = re.search(r"_d2o_score_h(\d+)_(\d+)_d(\d+)_s(\d+)$", name)
    if m:
        _, Hq, B, D = shape(0)
        H, N, _ = shape(1)
        scale = sm_scales.get((Hq, H, D))
        if scale is None:
            raise PolicyError(f"{name}: no attention site with {Hq} query heads, {H} KV heads, head dim {D}")
        return "score", build_d2o_score_kernel_gpu(Hq, H, N, B, D, scale, "float32", sinks)
    if re.search(r"_d2o_evict_h(\d+)_d(\d+)$", name):
        H, N, D = shape(0)
        B = shape(4)[2]
        return "select", build_d2o_evict_kernel_gpu(H, N, B, D, "float32", **params)
    if re.search(r"d2o_layer_budgets_l(\d+)_h(\d+)$", name):  # the per-prompt probe's kernels
        import json

        settings = json.loads(str(func.attrs[BUDGET_SETTINGS]))
        return "prepare", build_d2o_budget_kernel(**settings, device=True)
    if re.search(r"d2o_set_layer_l(\d+)$", name):
        return "prepare", build_d2o_set_layer_kernel(shape(0)[0], device=True)
    return None


def emit_d2o_site(bb, kernel, site, spec, block, caches, inputs, k_blk, v_blk, pos_blk, n_valid):
    """The block-cache pass's hook (``D2OPolicy.emit_site_eviction``): at one attention site emit
    the score kernel and the in-place eviction kernel over the site's caches
    (k, v, pos, fill, state = the accumulated sums [1, H, N], d2o_budget, d2o_tau); ``inputs`` are
    the policy's ``kernel_inputs`` tensors (the block's queries). Returns (the site's new caches, [col_sums]):
    the per-query-head column sums of the step leave the function as an extra output, for the
    host's layer-budget probe (``d2o_layer_budgets``)."""
    from tvm import relax  # lazy: tvm is the optional `compile` extra

    H, Hq, D, N, T_ = site.num_kv_heads, site.num_q_heads, site.head_dim, spec.budget, block
    params = dict(spec.policy_params)
    sinks = int(params.pop("sinks"))
    kc, vc, pc, fc, acc, layer_budget, tau = caches
    (q,) = inputs
    score_gv = kernel(f"d2o_score_h{Hq}_{H}_d{D}_s{sinks}",
                      lambda: build_d2o_score_kernel(Hq, H, N, T_, D, site.sm_scale, spec.dtype, sinks))
    evict_gv = kernel(f"d2o_evict_h{H}_d{D}",
                      lambda: build_d2o_evict_kernel(H, N, T_, D, spec.dtype, **params))
    cand = relax.TensorType((H, N + T_), "float32")
    scored = bb.emit(relax.call_tir(score_gv, [q, kc, pc, fc, k_blk, pos_blk, n_valid, acc, layer_budget],
                                    [cand, cand, relax.TensorType((Hq, N + T_), "float32")]), f"d2o_score_{site.index}")
    score, acc_cand, col_sums = (bb.emit(relax.TupleGetItem(scored, i)) for i in range(3))
    args = [kc, vc, pc, fc, k_blk, v_blk, pos_blk, n_valid, score, acc_cand, layer_budget, acc, tau]
    upd = bb.emit(relax.call_tir_inplace(evict_gv, args, [0, 1, 2, 3, 11, 12],
                                         [args[i].ty for i in (0, 1, 2, 3, 11, 12)]), f"evict_{site.index}")
    new = [bb.emit(relax.TupleGetItem(upd, i)) for i in range(6)]
    return new[:5] + [layer_budget, new[5]], [col_sums]


BUDGET_SETTINGS = "edgekv.d2o_budget_settings"  # PrimFunc attribute: build_d2o_budget_kernel's arguments


def build_d2o_budget_kernel(num_layers: int, num_q_heads: int, candidates: int, budget: int, *, avg_ratio: float,
                            min_budget: int, recent_ratio: float, variance_norm: str, device: bool = False):
    """TIR kernel: the first block's column sums → every layer's (N_l, M_l): ``prompt_budgets``
    compiled (float64, serial; 30 layers × a few heads is microseconds). Steps as in
    ``column_sum_variance`` → ``layer_statistic`` → softmax(−σ̃²) → ``allocate_budgets``:

        (col_sums[L, Hq, N + B] f32, n_valid[1] i32, prompt_len[1] i64) -> budgets[L, 2] i32

    A prompt that fits (prompt_len ≤ N) gets N everywhere, as the reference skips the probe then.

    ``device``: the GPU form — the same serial steps as one work-item (a 1 × 1 launch; microseconds
    next to a prefill step), scratch in private memory, and float32 arithmetic: phone GPUs have no
    fp64 (the profiles demote float64), so a layer's share can round differently from the CPU's
    float64 in a near-tie of the water-filling (one entry of budget, at most)."""
    from tvm.script import tirx as T

    if variance_norm not in ("minmax", "mean", "raw", "head_minmax"):
        raise ValueError(f"d2o budget kernel: unknown variance_norm {variance_norm!r}")
    L, Hq, NB, cap = num_layers, num_q_heads, candidates, budget
    floor_ = min(min_budget, cap)
    total = max(min(int(avg_ratio * budget * L), L * cap), L * floor_)  # as allocate_budgets clamps it
    norm = ("minmax", "mean", "raw", "head_minmax").index(variance_norm)
    F = "float32" if device else "float64"  # the accumulation type
    scope = "local" if device else "global"

    @T.macro
    def allocate(col_sums, n_valid, prompt_len, budgets):
        with T.sblock("d2o_layer_budgets"):
            T.reads(col_sums[0:L, 0:Hq, 0:NB], n_valid[0:1], prompt_len[0:1])
            T.writes(budgets[0:L, 0:2])
            hv = T.sblock_alloc_buffer((L, Hq), F, scope=scope)    # per-head column-sum variance
            sig = T.sblock_alloc_buffer((L,), F, scope=scope)      # σ̃², then the shares
            alloc = T.sblock_alloc_buffer((L,), F, scope=scope)
            share = T.sblock_alloc_buffer((L,), F, scope=scope)
            free = T.sblock_alloc_buffer((L,), "int32", scope=scope)
            out = T.sblock_alloc_buffer((L,), "int32", scope=scope)
            acc = T.sblock_alloc_buffer((4,), F, scope=scope)      # sums, min, max, remaining
            cnt = T.sblock_alloc_buffer((4,), "int32", scope=scope)        # free layers, over, under, rest
            n: T.let[T.int32] = n_valid[0]
            for l, h in T.grid(L, Hq):  # unbiased variance over the n valid columns
                acc[0] = T.Cast(F, 0)
                for j in T.serial(NB):
                    if j < n:
                        acc[0] = acc[0] + T.Cast(F, col_sums[l, h, j])
                acc[1] = acc[0] / T.Cast(F, T.max(n, 1))
                acc[2] = T.Cast(F, 0)
                for j in T.serial(NB):
                    if j < n:
                        acc[2] = acc[2] + (T.Cast(F, col_sums[l, h, j]) - acc[1]) * (
                            T.Cast(F, col_sums[l, h, j]) - acc[1])
                hv[l, h] = T.if_then_else(n < 2, T.Cast(F, 0), acc[2] / T.Cast(F, T.max(n - 1, 1)))
            for l in T.serial(L):  # layer_statistic
                acc[0] = T.Cast(F, 0)
                if norm == 3:  # head_minmax
                    acc[1] = hv[l, 0]
                    acc[2] = hv[l, 0]
                    for h in T.serial(Hq):
                        acc[1] = T.min(acc[1], hv[l, h])
                        acc[2] = T.max(acc[2], hv[l, h])
                    for h in T.serial(Hq):
                        acc[0] = acc[0] + (hv[l, h] - acc[1]) / (acc[2] - acc[1] + T.Cast(F, 1e-6))
                else:
                    for h in T.serial(Hq):
                        acc[0] = acc[0] + hv[l, h]
                sig[l] = acc[0] / T.Cast(F, Hq)
            if norm == 0 or norm == 1:
                acc[0] = T.Cast(F, 0)
                acc[1] = sig[0]
                acc[2] = sig[0]
                for l in T.serial(L):
                    acc[0] = acc[0] + sig[l]
                    acc[1] = T.min(acc[1], sig[l])
                    acc[2] = T.max(acc[2], sig[l])
                for l in T.serial(L):
                    if norm == 0:
                        sig[l] = (sig[l] - acc[1]) / (acc[2] - acc[1] + T.Cast(F, 1e-12))
                    else:
                        sig[l] = sig[l] / T.max(acc[0] / T.Cast(F, L), T.Cast(F, 1e-12))
            acc[1] = -sig[0]  # softmax(−σ̃²)
            for l in T.serial(L):
                acc[1] = T.max(acc[1], -sig[l])
            acc[0] = T.Cast(F, 0)
            for l in T.serial(L):
                sig[l] = T.exp(-sig[l] - acc[1])
                acc[0] = acc[0] + sig[l]
            for l in T.serial(L):
                sig[l] = sig[l] / acc[0]
                alloc[l] = T.Cast(F, 0)
                free[l] = 1
            acc[3] = T.Cast(F, total)  # water-filling: clamp at [floor, cap], re-split the rest
            for _it in T.serial(L + 1):
                cnt[0] = 0
                acc[0] = T.Cast(F, 0)
                for l in T.serial(L):
                    if free[l] == 1:
                        cnt[0] = cnt[0] + 1
                        acc[0] = acc[0] + sig[l]
                if cnt[0] > 0:
                    cnt[1] = 0
                    cnt[2] = 0
                    for l in T.serial(L):
                        if free[l] == 1:
                            share[l] = T.if_then_else(acc[0] > T.Cast(F, 0), sig[l] / acc[0] * acc[3],
                                                      acc[3] / T.Cast(F, cnt[0]))
                            if share[l] > T.Cast(F, cap):
                                cnt[1] = cnt[1] + 1
                            if share[l] < T.Cast(F, floor_):
                                cnt[2] = cnt[2] + 1
                    for l in T.serial(L):
                        if free[l] == 1:
                            if cnt[1] > 0:
                                if share[l] > T.Cast(F, cap):
                                    alloc[l] = T.Cast(F, cap)
                                    free[l] = 0
                                    acc[3] = acc[3] - T.Cast(F, cap)
                            elif cnt[2] > 0:
                                if share[l] < T.Cast(F, floor_):
                                    alloc[l] = T.Cast(F, floor_)
                                    free[l] = 0
                                    acc[3] = acc[3] - T.Cast(F, floor_)
                            else:
                                alloc[l] = share[l]
                                free[l] = 0
            cnt[3] = total  # round down, the remainder to the largest fractional parts (stable)
            for l in T.serial(L):
                out[l] = T.Cast("int32", T.floor(alloc[l]))
                cnt[3] = cnt[3] - out[l]
                free[l] = 1  # now: not yet visited
            for _k in T.serial(L):
                cnt[0] = -1
                for l in T.serial(L):
                    if free[l] == 1:
                        if cnt[0] < 0:
                            cnt[0] = l
                        elif alloc[l] - T.floor(alloc[l]) > alloc[cnt[0]] - T.floor(alloc[cnt[0]]):
                            cnt[0] = l
                free[cnt[0]] = 0
                if cnt[3] > 0 and out[cnt[0]] < cap:
                    out[cnt[0]] = out[cnt[0]] + 1
                    cnt[3] = cnt[3] - 1
            for l in T.serial(L):
                out[l] = T.if_then_else(prompt_len[0] <= T.int64(cap), cap, T.min(out[l], cap))
                budgets[l, 0] = out[l]
                budgets[l, 1] = T.Cast("int32", T.floor(T.Cast(F, out[l]) * T.Cast(F, recent_ratio)))

    @T.prim_func(private=True, s_tir=True)
    def d2o_layer_budgets(col_sums: T.Buffer((L, Hq, NB), "float32"), n_valid: T.Buffer((1,), "int32"),
                          prompt_len: T.Buffer((1,), "int64"), budgets: T.Buffer((L, 2), "int32")):
        T.func_attr({"tirx.noalias": True})
        if device:  # one work-item: the allocation is a few hundred scalar steps
            for _b in T.thread_binding(1, thread="blockIdx.x"):
                for _t in T.thread_binding(1, thread="threadIdx.x"):
                    allocate(col_sums, n_valid, prompt_len, budgets)
        else:
            allocate(col_sums, n_valid, prompt_len, budgets)

    return d2o_layer_budgets


def build_d2o_set_layer_kernel(num_layers: int, device: bool = False):
    """TIR kernel, in place: one layer's d2o_budget ← budgets[layer], τ cleared, the cache emptied
    (the probe block leaves it): ``(budgets[L, 2], layer[1], d2o_budget[2], d2o_tau[2], fill[1])``.
    ``device``: the GPU form (one work-item)."""
    from tvm.script import tirx as T

    @T.macro
    def set_layer(budgets, layer, d2o_budget, d2o_tau, fill):
        with T.sblock("d2o_set_layer"):
            T.reads(budgets[0:num_layers, 0:2], layer[0:1])
            T.writes(d2o_budget[0:2], d2o_tau[0:2], fill[0:1])
            for i in T.serial(2):
                d2o_budget[i] = budgets[layer[0], i]
                d2o_tau[i] = T.float32(0)
            fill[0] = 0

    @T.prim_func(private=True, s_tir=True)
    def d2o_set_layer(budgets: T.Buffer((num_layers, 2), "int32"), layer: T.Buffer((1,), "int32"),
                      d2o_budget: T.Buffer((2,), "int32"), d2o_tau: T.Buffer((2,), "float32"),
                      fill: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        if device:
            for _b in T.thread_binding(1, thread="blockIdx.x"):
                for _t in T.thread_binding(1, thread="threadIdx.x"):
                    set_layer(budgets, layer, d2o_budget, d2o_tau, fill)
        else:
            set_layer(budgets, layer, d2o_budget, d2o_tau, fill)

    return d2o_set_layer


def emit_d2o_prepare(bb, kernel, policy, probe, caches, n_valid, prompt_len, budget):
    """``D2OPolicy.emit_prepare``: after the probe (``prefill_block`` over the empty cache on the
    prompt's first block; ``probe`` its outputs: logits, caches, then each layer's col_sums), the
    budget kernel turns the column sums into every layer's (N_l, M_l), and one small in-place kernel
    per layer writes them into ``d2o_budget``, clears τ and empties the cache. Returns the caches."""
    import json

    import numpy as np
    from tvm import relax

    L = len(caches)
    col_sums = probe[-L:]
    Hq, NB = (int(d) for d in col_sums[0].ty.shape.values)
    stacked = bb.emit(relax.op.stack(col_sums, axis=0), "d2o_probe_col_sums")
    settings = {"num_layers": L, "num_q_heads": Hq, "candidates": NB, "budget": int(budget),
                "avg_ratio": float(policy.avg_ratio), "min_budget": int(policy.min_layer_budget(budget)),
                "recent_ratio": float(policy.recent_ratio), "variance_norm": policy.variance_norm}
    # the settings ride on the kernel, so that a GPU build can rebuild its device form (d2o_gpu_kernel)
    budget_gv = kernel(f"d2o_layer_budgets_l{L}_h{Hq}", lambda: build_d2o_budget_kernel(**settings).with_attr(
        BUDGET_SETTINGS, json.dumps(settings)))
    budgets = bb.emit(relax.call_tir(budget_gv, [stacked, n_valid, prompt_len], relax.TensorType((L, 2), "int32")),
                      "d2o_budgets")
    set_gv = kernel(f"d2o_set_layer_l{L}", lambda: build_d2o_set_layer_kernel(L))
    out = []
    # ``stored``: what the layout has after D2O's own tensors (an int8 cache's scales), passed through
    for layer, (kc, vc, pc, fc, acc, layer_budget, tau, *stored) in enumerate(caches):
        args = [budgets, relax.const(np.array([layer], dtype="int32")), layer_budget, tau, fc]
        upd = bb.emit(relax.call_tir_inplace(set_gv, args, [2, 3, 4], [a.ty for a in args[2:]]), f"d2o_set_{layer}")
        lb, ta, fi = (bb.emit(relax.TupleGetItem(upd, i)) for i in range(3))
        out.append([kc, vc, pc, fi, acc, lb, ta, *stored])
    return out


@dataclass
class D2OPolicy(Policy):
    name = "d2o"
    summary = "D2O: per-layer budgets from attention variance; H2O-style keeping, evicted entries merged into similar kept ones"
    needs_queries = True
    observes_every_step = True
    entry_state = (STATE,)
    kernel_inputs = ("queries",)
    # compiled: the eviction kernel (the score kernel needs the queries, so the pass asks
    # ``emit_site_eviction`` to wire both), and the per-layer state the compiled model carries
    evict_kernel = staticmethod(build_d2o_evict_kernel)
    emit_site_eviction = staticmethod(emit_d2o_site)
    gpu_kernel = staticmethod(d2o_gpu_kernel)
    compiled_state = COMPILED_STATE
    emit_prepare = staticmethod(emit_d2o_prepare)
    recent_ratio: float = 0.25
    sinks: int = 4
    beta: float = 0.7
    merge: str = "weighted"
    threshold: str = "ema"
    avg_ratio: float = 0.75
    layers: str = "variance"
    variance_norm: str = "minmax"

    def __post_init__(self) -> None:
        # Per-prompt state (not parameters): reset by prepare().
        self.tau: dict[int, float] = {}
        self.budgets: list[int] | None = None
        self.layer_sigma: torch.Tensor | None = None

    def check_budget(self, budget: int, block: int) -> None:
        if not 0.0 <= self.recent_ratio < 1.0:
            raise PolicyError(f"d2o: recent_ratio must be within [0, 1) (got {self.recent_ratio})")
        if self.sinks < 0:
            raise PolicyError("d2o: sinks must be ≥ 0 (e.g. --policy-arg sinks=4)")
        if not 0.0 <= self.beta <= 1.0:
            raise PolicyError(f"d2o: beta must be within [0, 1] (got {self.beta})")
        if self.merge not in ("weighted", "code", "average", "none"):
            raise PolicyError(f"d2o: merge must be weighted, code, average or none (got {self.merge!r})")
        if self.threshold not in ("ema", "none"):
            raise PolicyError(f"d2o: threshold must be ema or none (merge every evicted entry) (got {self.threshold!r})")
        if not 0.0 < self.avg_ratio <= 1.0:
            raise PolicyError(f"d2o: avg_ratio (average layer budget / N) must be within (0, 1] (got {self.avg_ratio})")
        if self.layers not in ("variance", "uniform"):
            raise PolicyError(f"d2o: layers must be variance or uniform (got {self.layers!r})")
        if self.variance_norm not in ("minmax", "mean", "raw", "head_minmax"):
            raise PolicyError(f"d2o: variance_norm must be minmax, mean, raw or head_minmax (got {self.variance_norm!r})")
        if budget < self.sinks + 2:
            raise PolicyError(f"d2o: budget {budget} cannot hold {self.sinks} sinks and a recent entry; use "
                              f"a budget of at least {self.sinks + 2} or fewer sinks")

    def kernel_params(self, budget: int) -> dict:
        return {"merge": self.merge, "threshold": self.threshold, "beta": float(self.beta), "sinks": int(self.sinks)}

    def compiled_state_init(self, budget: int) -> dict:
        """Every layer's (N_l, M_l) before a prompt: uniform, or N until the probe sets it."""
        import numpy as np

        n_l = self.uniform_budget(budget) if self.layers == "uniform" else budget
        return {"d2o_budget": np.array([n_l, self.recent_size(n_l)], dtype=np.int32)}

    def state_dict(self) -> dict:
        """τ per layer and the prompt's layer budgets: what a saved cache continues with."""
        return {"tau": {str(k): float(v) for k, v in self.tau.items()}, "budgets": self.budgets}

    def load_state_dict(self, state: dict) -> None:
        self.tau = {int(k): float(v) for k, v in state.get("tau", {}).items()}
        self.budgets = state.get("budgets")

    def prepare_min_prompt(self, budget: int) -> int | None:
        """The first-block probe runs for prompts longer than N (shorter ones keep N everywhere)."""
        return None if self.layers == "uniform" else budget

    # ---- layer level -------------------------------------------------------------------------
    def min_layer_budget(self, budget: int) -> int:
        return min(budget, self.sinks + 2)

    def uniform_budget(self, budget: int) -> int:
        return max(self.min_layer_budget(budget), int(self.avg_ratio * budget))

    def allocate(self, head_variances: torch.Tensor, budget: int) -> list[int]:
        """[L, Hq] first-block column-sum variances -> per-layer budgets (each ≤ ``budget``)."""
        n_layers = head_variances.shape[0]
        if self.layers == "uniform":
            return [self.uniform_budget(budget)] * n_layers
        sigma = layer_statistic(head_variances, self.variance_norm)
        self.layer_sigma = sigma
        shares = torch.softmax(-sigma, dim=0)
        return allocate_budgets(shares, budget, int(self.avg_ratio * budget * n_layers), self.min_layer_budget(budget))

    def prepare(self, prompt_ids: torch.Tensor, model: Any) -> None:
        """Reset τ; measure the first block's attention (all layers, exact) and fix the budgets.
        ``model`` is the engine: a throw-away engine of the same class runs that block once."""
        self.tau, self.budgets, self.layer_sigma = {}, None, None
        engine = model
        if engine is None or self.layers == "uniform":
            return
        prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        first = prompt_ids[: engine.block]

        def first_block_variances() -> torch.Tensor:
            probe = _VarianceProbe()
            type(engine)(engine.model, probe, budget=first.numel(), block=first.numel()).step(first)
            return torch.stack([probe.variances[i] for i in range(engine.cfg.num_layers)])

        self.budgets = self.prompt_budgets(prompt_ids.numel(), engine.budget, engine.cfg.num_layers,
                                           first_block_variances)

    def prompt_budgets(self, prompt_len: int, budget: int, num_layers: int,
                       first_block_variances: Callable[[], torch.Tensor]) -> list[int]:
        """Every layer's N_l for a prompt of ``prompt_len`` tokens — what ``prepare`` fixes; the
        compiled runtime calls it too, with its own probe. ``first_block_variances()`` returns the
        first block's [L, Hq] column-sum variances and is called only when the budgets depend on it."""
        if self.layers == "uniform":
            return [self.uniform_budget(budget)] * num_layers
        if prompt_len <= budget:  # the prompt fits: nothing to compress, uniform N
            return [budget] * num_layers
        return [min(budget, b) for b in self.allocate(first_block_variances(), budget)]

    def layer_budget(self, layer: int, budget: int) -> int:
        if self.budgets is None:  # before prepare(): no statistic yet, uniform average budget
            return self.uniform_budget(budget)
        return min(budget, self.budgets[layer])

    # ---- token level -------------------------------------------------------------------------
    def observe(self, ctx: EvictionContext) -> None:
        """Accumulated attention (Eq. 6): add this step's group-mean column sums."""
        queries, query_positions = require_queries(ctx, self.name)
        inc = group_reduce(attention_column_sums(ctx.keys, ctx.positions, queries, query_positions, ctx.scale),
                           ctx.num_kv_heads, "mean")
        acc = ctx.state.get(STATE)
        if acc is None:
            ctx.state[STATE] = inc
        else:
            acc.add_(inc.to(acc.dtype))

    def recent_size(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n]: accumulated attention; the sinks and the M_l most recent entries +inf."""
        acc = ctx.state.get(STATE)
        if acc is None:
            raise PolicyError(f"d2o: ctx.state has no {STATE!r}; the engine must call observe() before select()")
        score = pin_most_recent(acc.to(torch.float32), ctx.positions, self.recent_size(ctx.budget))
        return protect_sinks(score, ctx.positions, self.sinks)

    def update_threshold(self, layer: int, best: torch.Tensor) -> float:
        """τ ← β·mean(m) + (1 − β)·τ (τ = mean(m) at the layer's first eviction); returns the new τ."""
        current = float(best.mean()) if best.numel() else self.tau.get(layer, float("inf"))
        tau = current if layer not in self.tau else self.beta * current + (1.0 - self.beta) * self.tau[layer]
        self.tau[layer] = tau
        return tau

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        kept = topk_keep(self.score(ctx), ctx.budget)  # [H, N_l] ascending
        if self.merge == "none":
            return Selection(kept=kept)
        heads, n, d = ctx.keys.shape
        evicted_mask = torch.ones(heads, n, dtype=torch.bool)
        evicted_mask.scatter_(1, kept.long(), False)
        evicted = evicted_mask.nonzero()[:, 1].view(heads, n - kept.shape[1])  # [H, E] ascending
        gather = lambda x, idx: torch.gather(x, 1, idx[..., None].expand(heads, idx.shape[1], d))  # noqa: E731
        k_kept, v_kept = gather(ctx.keys, kept), gather(ctx.values, kept)
        k_ev, v_ev = gather(ctx.keys, evicted), gather(ctx.values, evicted)
        best, target = best_matches(k_ev, k_kept)
        tau = self.update_threshold(ctx.layer, best)
        do_merge = best >= tau if self.threshold == "ema" else torch.ones_like(best, dtype=torch.bool)
        if not bool(do_merge.any()):
            return Selection(kept=kept)
        return Selection(
            kept=kept,
            keys=merge_into(k_kept, k_ev, target, best, do_merge, self.merge),
            values=merge_into(v_kept, v_ev, target, best, do_merge, self.merge),
        )
