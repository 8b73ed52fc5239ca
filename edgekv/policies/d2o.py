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

Compiled: ``edgekv/compiler/policy_kernels/d2o.py`` (its kernels, GPU versions in ``d2o_gpu.py``, the
per-prompt budget probe in ``d2o_prepare.py``; docs/COMPILER.md).
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


@dataclass
class D2OPolicy(Policy):
    name = "d2o"
    summary = "D2O: per-layer budgets from attention variance; H2O-style keeping, evicted entries merged into similar kept ones"
    needs_queries = True
    observes_every_step = True
    entry_state = (STATE,)
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

    def state_dict(self) -> dict:
        """τ per layer and the prompt's layer budgets: what a saved cache continues with."""
        return {"tau": {str(k): float(v) for k, v in self.tau.items()}, "budgets": self.budgets}

    def load_state_dict(self, state: dict) -> None:
        self.tau = {int(k): float(v) for k, v in state.get("tau", {}).items()}
        self.budgets = state.get("budgets")

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

        # only the layers that evict get a budget (a family's sliding-window layers keep their window)
        layers = list(getattr(engine, "global_layers", range(engine.cfg.num_layers)))

        def first_block_variances() -> torch.Tensor:
            probe = _VarianceProbe()
            type(engine)(engine.model, probe, budget=first.numel(), block=first.numel()).step(first)
            return torch.stack([probe.variances[i] for i in layers])

        budgets = self.prompt_budgets(prompt_ids.numel(), engine.budget, len(layers), first_block_variances)
        self.budgets = [engine.budget] * engine.cfg.num_layers
        for layer, layer_budget in zip(layers, budgets):
            self.budgets[layer] = layer_budget

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
