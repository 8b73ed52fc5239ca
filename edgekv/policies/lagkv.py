"""`lagkv` — LagKV (Liang et al., China Merchants Bank AI Lab, arXiv 2504.04704).

Definition. Per layer and per KV head, the candidates (cache ⊕ block, in temporal order)
are laid out as in the paper, starting after S sink entries:

    [ sinks 0..S-1 | partition 0 | partition 1 | … | partition P-2 | tail ]
                     └────────── scored, L entries each ───────────┘  └ last full partition
                                                                         + remainder: L … 2L−1

With P = ⌊(n − S)/L⌋ full partitions of lag size L, partition p is scored against the next
one, p+1 (its "lag" reference), separately for Z = K and Z = V:

    lo, hi  = per-channel min / max of Z over the L tokens of partition p+1
    Z̄       = (Z_p − lo) / max(hi − lo, ε)          (ε: documented deviation, see below)
    s_Z     = softmax over the L tokens of p of std_channels(Z̄)   (unbiased std, as the
              official code; the paper names neither estimator nor axis)
    s       = s_K + value_weight · s_V               (official code: score_v_ratio = 1)

High s = the token is not coherent with the next chunk = keep. Sinks and the tail are never
evicted while the budget allows. No queries or attention weights are used.

Mapping the paper's ratio to edgekv's fixed budget N (the RULER / KVPress way, paper Eq. 13:
"the retention ratio of each window adapts to the target size"): at every eviction event
the whole candidate set is compressed once, exactly like KVPress ``LagKVPress`` with
``n_kept = N``. Each scored token's selection score is its normalised rank inside its
partition, (rank ascending)/L ∈ [0, 1); sinks get +inf and the tail a recency score in
(2, 3); then the global top-N is kept. Equal ranks across partitions split the evictions
evenly over the scored partitions (±1, extra slots to the older partitions by the lower-index
tie rule), i.e. every partition keeps ⌊r·L⌋ or ⌈r·L⌉ with r = (N − S − |tail|)/(n − S − |tail|).
If n − S < 2L (no partition has a reference) the policy falls back to sinks + most recent,
as KVPress does.

Defaults. ``sinks = 16`` (paper ablations and official code; KVPress uses 4).
``lag = 0`` means auto: L = min(1024, N // 8), at least 1 and at most (N − S)/2. This gives
the paper's default L = 1024 at N = 8K, KVPress's/RULER's L = 128 at N = 1K, 16 at N = 128;
the protected tail is then 12.5–25 % of N, and N ≥ S + 2L always holds, so the tail never
crowds out the scored entries. An explicit ``lag`` must satisfy N ≥ sinks + 2·lag.
``value_weight = 1.0``, ``unbiased_std = True`` (official code).

Block-wise adaptation / deviations. (1) Re-scoring: the paper never re-scores its
compressed region, whose size then grows with the sequence; a fixed N forces re-eviction,
so earlier survivors are re-partitioned (L consecutive survivors per partition) and
re-scored at every event. In decode (n = N + 1) the evicted entry is the lowest-ranked one
of the newest scored partition (the one just leaving the tail), like the paper's recursion.
(2) ε = 1e-6 clamps the per-channel range: the paper divides by max − min, which gives
inf/NaN for a constant reference channel. (3) Scores are computed in fp32. (4) Ties go to the
lower candidate index (older entry). (5) The tail is over budget only when N < S + 2L
(refused by ``check_budget``); ``select`` then keeps its newest entries first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, topk_keep

PAPER_LAG = 1024  # official code default (``lag_size=1024``); cap of the auto lag


def lag_chunk_scores(z: torch.Tensor, lag: int, unbiased: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Paper Eq. 7–10 for one of K or V: z [..., P·L, d] with P ≥ 2 → [..., P−1, L] (fp32).

    Partition p (of P−1 scored ones) is min-max normalised per channel by partition p+1,
    reduced to the std over channels per token, and softmaxed over its L tokens.
    """
    d = z.shape[-1]
    zp = z.float().unflatten(-2, (-1, lag))  # [..., P, L, d]
    cur, ref = zp[..., :-1, :, :], zp[..., 1:, :, :]
    lo = ref.amin(dim=-2, keepdim=True)
    hi = ref.amax(dim=-2, keepdim=True)
    z_bar = (cur - lo) / (hi - lo).clamp_min(eps)
    std = z_bar.std(dim=-1, correction=1 if (unbiased and d > 1) else 0)
    return std.softmax(dim=-1)


def within_partition_rank(raw: torch.Tensor) -> torch.Tensor:
    """[..., L] scores → normalised ascending rank / L ∈ [0, 1); equal scores rank the lower
    index higher (the tie rule of ``topk_keep``)."""
    L = raw.shape[-1]
    order = torch.sort(raw, dim=-1, descending=True, stable=True).indices  # best first
    pos = torch.empty_like(order)
    pos.scatter_(-1, order, torch.arange(L, device=raw.device).expand_as(order))
    return (L - 1 - pos).float() / L


@dataclass
class LagKVPolicy(Policy):
    name = "lagkv"
    summary = "LagKV: scores each partition of tokens against the next one's min/max statistics; no attention scores"
    EPS = 1e-6  # guard on the per-channel range max − min (not a paper parameter)

    # First entries that are never evicted (attention sinks). Paper / official code: 16.
    sinks: int = 16
    # Lag size L (tokens per partition). 0 = auto: min(1024, N // 8), at most (N − sinks) / 2.
    lag: int = 0
    # Weight of the value score: s = s_K + value_weight · s_V. Official code: 1.0.
    value_weight: float = 1.0
    # Unbiased std over channels (divide by d − 1), as torch's default in the official code.
    unbiased_std: bool = True

    def resolve_lag(self, budget: int) -> int:
        if self.lag > 0:
            return int(self.lag)
        return max(1, min(PAPER_LAG, budget // 8, (budget - self.sinks) // 2))

    def check_budget(self, budget: int, block: int) -> None:
        if self.sinks < 0:
            raise PolicyError("lagkv: sinks must be ≥ 0 (e.g. --policy-arg sinks=16)")
        if self.lag < 0:
            raise PolicyError("lagkv: lag must be ≥ 0 (0 = automatic: min(1024, budget // 8))")
        if not self.value_weight >= 0:
            raise PolicyError("lagkv: value_weight must be ≥ 0 (1.0 = paper, 0 = keys only)")
        L = self.resolve_lag(budget)
        if budget < self.sinks + 2 * L:
            hint = (
                f"use --policy-arg lag={max(1, (budget - self.sinks) // 2)} or less, or lag=0 (automatic)"
                if self.lag > 0 and budget >= self.sinks + 2
                else f"use a budget of at least {self.sinks + 2 * L} or fewer sinks"
            )
            raise PolicyError(
                f"lagkv: budget {budget} cannot hold {self.sinks} sinks plus a tail of up to "
                f"2·lag − 1 = {2 * L - 1} entries and still choose any token; {hint}"
            )

    def raw_scores(self, ctx: EvictionContext) -> tuple[torch.Tensor, int, int]:
        """Paper score s = s_K + w·s_V of the scored partitions, [H, P−1, L] (fp32), plus the
        scored region [start, end). Empty [H, 0, L] when no partition has a reference."""
        n = ctx.n
        L = self.resolve_lag(ctx.budget)
        start = min(self.sinks, n)
        P = (n - start) // L
        if P < 2:
            return ctx.keys.new_zeros((ctx.num_kv_heads, 0, L), dtype=torch.float32), start, start
        stop = start + P * L
        s = lag_chunk_scores(ctx.keys[:, start:stop], L, self.unbiased_std, self.EPS)
        if self.value_weight != 0:
            s = s + self.value_weight * lag_chunk_scores(ctx.values[:, start:stop], L, self.unbiased_std, self.EPS)
        return s, start, start + (P - 1) * L

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """[H, n] selection score: sinks +inf, tail (and everything when nothing is scorable)
        2 + i/n (newer higher), scored entries their within-partition rank / L ∈ [0, 1)."""
        H, n = ctx.num_kv_heads, ctx.n
        idx = torch.arange(n, device=ctx.keys.device, dtype=torch.float32)
        score = (2.0 + idx / n).expand(H, n).clone()
        raw, start, end = self.raw_scores(ctx)
        score[:, :start] = float("inf")
        if end > start:
            score[:, start:end] = within_partition_rank(raw).reshape(H, end - start)
        return score

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(self.score(ctx), ctx.budget))
