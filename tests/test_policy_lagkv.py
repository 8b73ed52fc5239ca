"""LagKV reference scorer: the digest's checkable properties (research/seed-lagkv.md §8.1),
the fixed-budget mapping (equal quotas per partition, sinks + tail kept, fallback), a
differential test against NVIDIA kvpress 0.5.5 ``LagKVPress``, and hypothesis properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgekv.policies.base import EvictionContext, PolicyError, topk_keep
from edgekv.policies.lagkv import LagKVPolicy, lag_chunk_scores, within_partition_rank


def make_ctx(keys, values, budget) -> EvictionContext:
    H, n, _ = keys.shape
    return EvictionContext(
        layer=0, num_layers=1, budget=budget, keys=keys, values=values,
        positions=torch.arange(n).expand(H, n).contiguous(), n_cache=max(0, min(budget, n)),
    )


def rand_kv(seed, H=2, n=100, d=16, dyadic=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(H, n, d, generator=g) * (1 + torch.rand(1, 1, d, generator=g) * 4)
    v = torch.randn(H, n, d, generator=g)
    if dyadic:  # multiples of 1/64: sums, differences and power-of-two scalings stay exact
        k, v = (k * 64).round() / 64, (v * 64).round() / 64
    return k, v


def kept_sets(policy, keys, values, budget):
    return [set(r.tolist()) for r in policy.select(make_ctx(keys, values, budget)).kept]


def same_order(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Every pair whose scores differ by more than tol in ``a`` is ordered the same way in ``b``."""
    da = a.unsqueeze(-1) - a.unsqueeze(-2)
    db = b.unsqueeze(-1) - b.unsqueeze(-2)
    clear = da.abs() > tol
    return bool(((torch.sign(da) == torch.sign(db)) | ~clear).all())


# ---------------------------------------------------------------- shapes and axes (§8.1.1)

def test_chunk_score_shapes_and_softmax_rows():
    k, v = rand_kv(0, H=3, n=5 * 8, d=16)
    s = lag_chunk_scores(k, 8)
    assert s.shape == (3, 4, 8)
    assert torch.allclose(s.sum(-1), torch.ones(3, 4))
    raw, start, end = LagKVPolicy(sinks=0, lag=8).raw_scores(make_ctx(k, v, 32))
    assert (start, end) == (0, 32) and raw.shape == (3, 4, 8)
    assert torch.allclose(raw.sum(-1), torch.full((3, 4), 2.0))  # s_K + s_V sums to 2
    raw_k, _, _ = LagKVPolicy(sinks=0, lag=8, value_weight=0).raw_scores(make_ctx(k, v, 32))
    assert torch.allclose(raw_k, s)


def test_chunk_score_formula_by_hand():
    """Eq. 7–10 spelled out for one partition and its reference (unbiased std over channels)."""
    z = torch.tensor([[0.0, 1.0, 5.0], [2.0, -1.0, 0.0], [1.0, 0.0, 2.0], [3.0, 2.0, 4.0]])  # L = 2, P = 2
    lo, hi = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([3.0, 2.0, 4.0])
    z_bar = (z[:2] - lo) / (hi - lo)
    expected = torch.softmax(z_bar.std(dim=-1), dim=-1)
    assert torch.allclose(lag_chunk_scores(z[None], 2)[0, 0], expected)
    biased = torch.softmax(z_bar.std(dim=-1, correction=0), dim=-1)
    assert torch.allclose(lag_chunk_scores(z[None], 2, unbiased=False)[0, 0], biased)


# ---------------------------------------------------------------- locality (§8.1.2)

def test_partition_scores_depend_only_on_itself_and_next():
    S, L = 4, 8
    k, v = rand_kv(1, n=S + 5 * L + 3)  # P = 5 partitions (4 scored) + remainder 3
    policy = LagKVPolicy(sinks=S, lag=L)
    base, _, _ = policy.raw_scores(make_ctx(k, v, 20))
    k2, v2 = k.clone(), v.clone()
    k2[:, :S] += 100  # sinks
    v2[:, -3:] = 0  # remainder (part of the tail)
    assert torch.equal(policy.raw_scores(make_ctx(k2, v2, 20))[0], base)
    k2[:, S + 2 * L : S + 3 * L] *= -7  # partition 2: it and its predecessor (1) may change
    moved, _, _ = policy.raw_scores(make_ctx(k2, v2, 20))
    assert torch.equal(moved[:, [0, 3]], base[:, [0, 3]])
    assert not torch.allclose(moved[:, 1], base[:, 1]) and not torch.allclose(moved[:, 2], base[:, 2])
    k3 = k.clone()
    k3[:, S + 4 * L : S + 5 * L] += torch.randn(2, L, 16)  # last full partition: reference of 3 only
    moved, _, _ = policy.raw_scores(make_ctx(k3, v, 20))
    assert torch.equal(moved[:, :3], base[:, :3]) and not torch.allclose(moved[:, 3], base[:, 3])


# ---------------------------------------------------------------- invariances (§8.1.3)

@pytest.mark.parametrize("seed", range(3))
def test_per_channel_affine_invariance_exact(seed):
    """Z[..., c] → a_c·Z[..., c] + b_c, a_c a power of two, b_c an integer, dyadic data:
    every intermediate stays exact, so scores and kept sets are bitwise identical."""
    k, v = rand_kv(seed, n=4 + 6 * 8, dyadic=True)
    g = torch.Generator().manual_seed(50 + seed)
    a = 2.0 ** torch.randint(-3, 4, (16,), generator=g).float()
    b = torch.randint(-5, 6, (16,), generator=g).float()
    policy = LagKVPolicy(sinks=4, lag=8)
    ctx0, ctx1 = make_ctx(k, v, 30), make_ctx(k * a + b, v * a.flip(0) - b, 30)
    assert torch.equal(policy.raw_scores(ctx0)[0], policy.raw_scores(ctx1)[0])
    assert torch.equal(policy.select(ctx0).kept, policy.select(ctx1).kept)


@pytest.mark.parametrize("seed", range(3))
def test_per_channel_affine_invariance_general(seed):
    k, v = rand_kv(seed, n=4 + 6 * 8)
    g = torch.Generator().manual_seed(60 + seed)
    a = torch.exp(torch.randn(16, generator=g))
    b = 3 * torch.randn(16, generator=g)
    policy = LagKVPolicy(sinks=4, lag=8)
    r0 = policy.raw_scores(make_ctx(k, v, 30))[0]
    r1 = policy.raw_scores(make_ctx(k * a + b, v * a - b, 30))[0]
    assert torch.allclose(r0, r1, atol=1e-5)
    assert same_order(r0, r1, 1e-5)


def test_global_sign_flip_invariance():
    k, v = rand_kv(3, n=4 + 6 * 8)
    policy = LagKVPolicy(sinks=4, lag=8)
    r0 = policy.raw_scores(make_ctx(k, v, 30))[0]
    r1 = policy.raw_scores(make_ctx(-k, -v, 30))[0]
    assert torch.allclose(r0, r1, atol=1e-5) and same_order(r0, r1, 1e-5)


def test_channel_permutation_invariance():
    k, v = rand_kv(4, n=4 + 6 * 8)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(4))
    policy = LagKVPolicy(sinks=4, lag=8)
    r0 = policy.raw_scores(make_ctx(k, v, 30))[0]
    r1 = policy.raw_scores(make_ctx(k[..., perm], v[..., perm], 30))[0]
    assert torch.allclose(r0, r1, atol=1e-6) and same_order(r0, r1, 1e-5)


def test_token_permutations_inside_partitions():
    """Permuting the reference chunk changes nothing (min/max are order-free); permuting the
    scored chunk permutes its scores (equivariance)."""
    S, L = 4, 8
    k, v = rand_kv(5, n=S + 3 * L)  # partitions 0, 1 scored; 2 is the last reference
    policy = LagKVPolicy(sinks=S, lag=L)
    r0 = policy.raw_scores(make_ctx(k, v, 20))[0]
    perm = torch.randperm(L, generator=torch.Generator().manual_seed(5))
    ref_idx = torch.arange(S + 2 * L, S + 3 * L)
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[:, ref_idx] = k[:, ref_idx[perm]]
    v_ref[:, ref_idx] = v[:, ref_idx[perm]]
    r_ref = policy.raw_scores(make_ctx(k_ref, v_ref, 20))[0]
    assert torch.equal(r_ref[:, 1], r0[:, 1])  # partition 1 only sees its reference's min/max
    cur_idx = torch.arange(S, S + L)
    k_cur, v_cur = k.clone(), v.clone()
    k_cur[:, cur_idx] = k[:, cur_idx[perm]]
    v_cur[:, cur_idx] = v[:, cur_idx[perm]]
    r_cur = policy.raw_scores(make_ctx(k_cur, v_cur, 20))[0]
    assert torch.allclose(r_cur[:, 0], r0[:, 0][:, perm], atol=1e-7)
    assert torch.equal(r_cur[:, 1], r0[:, 1])


# ---------------------------------------------------------------- outlier retention (§8.1.4)

def test_outlier_is_kept_at_one_token_per_partition():
    S, L, P = 2, 8, 5
    n = S + P * L
    k, v = rand_kv(6, H=1, n=n, d=16)
    typical = S + 1 * L + 3  # partition 1: make one token a copy of a reference row
    k[0, typical] = k[0, S + 2 * L + 5]
    v[0, typical] = v[0, S + 2 * L + 5]
    out = S + 1 * L + 6  # plant a mixed-sign outlier far outside partition 2's range
    k[0, out] = torch.tensor([30.0, -30.0] * 8)
    policy = LagKVPolicy(sinks=S, lag=L)
    raw, start, _ = policy.raw_scores(make_ctx(k, v, S + 2 * L + P - 1))
    assert int(raw[0, 1].argmax()) == out - start - L
    assert int(raw[0, 1].argmax()) != typical - start - L
    # tail = last full partition (L); budget = sinks + tail + one token per scored partition
    budget = S + L + (P - 1)
    kept = policy.select(make_ctx(k, v, budget)).kept[0].tolist()
    assert out in kept and typical not in kept
    chosen = [i for i in kept if S <= i < S + (P - 1) * L]
    assert sorted((i - S) // L for i in chosen) == list(range(P - 1))  # one per partition


# ---------------------------------------------------------------- numerics (§8.1.8)

def test_constant_channels_no_nan():
    k, v = rand_kv(7, n=4 + 5 * 8)
    k[..., 3] = 1.5  # one channel constant everywhere
    v[:, 20:] = 0.25  # values constant from token 20 on (several whole reference chunks)
    policy = LagKVPolicy(sinks=4, lag=8)
    ctx = make_ctx(k, v, 24)
    raw = policy.raw_scores(ctx)[0]
    assert torch.isfinite(raw).all()
    assert not torch.isnan(policy.score(ctx)).any()
    kept = policy.select(ctx).kept
    assert kept.shape == (2, 24) and all(len(set(r.tolist())) == 24 for r in kept)
    all_const = torch.ones(1, 60, 4)
    kept = policy.select(make_ctx(all_const, all_const, 30)).kept
    assert kept.shape == (1, 30) and torch.isfinite(policy.score(make_ctx(all_const, all_const, 30))).any()


def test_head_dim_one_and_low_precision():
    k, v = rand_kv(8, n=4 + 4 * 8, d=1)
    policy = LagKVPolicy(sinks=4, lag=8)
    assert torch.isfinite(policy.raw_scores(make_ctx(k, v, 20))[0]).all()  # unbiased std of 1 channel: guarded
    k, v = rand_kv(8, n=4 + 4 * 8)
    raw16 = policy.raw_scores(make_ctx(k.bfloat16(), v.bfloat16(), 20))[0]
    assert raw16.dtype == torch.float32


# ---------------------------------------------------------------- the fixed-budget mapping

def test_within_partition_rank():
    raw = torch.tensor([[0.1, 0.5, 0.5, 0.2]])
    assert torch.equal(within_partition_rank(raw), torch.tensor([[0.0, 3.0, 2.0, 1.0]]) / 4)  # tie → lower index higher


def test_budget_layout_sinks_tail_and_equal_quotas():
    S, L = 16, 128
    N, B = 1024, 128
    n = N + B  # steady state of block-wise prefill
    k, v = rand_kv(9, H=3, n=n, d=64)
    policy = LagKVPolicy()
    assert policy.resolve_lag(N) == L and policy.sinks == S
    kept = policy.select(make_ctx(k, v, N)).kept
    assert kept.shape == (3, N)
    P = (n - S) // L  # 8 partitions, 7 scored, tail = 128 + 112
    tail_start = S + (P - 1) * L
    for row in kept.tolist():
        assert set(range(S)) <= set(row) and set(range(tail_start, n)) <= set(row)
        per_part = np.bincount([(i - S) // L for i in row if S <= i < tail_start], minlength=P - 1)
        assert per_part.sum() == N - S - (n - tail_start)
        assert per_part.max() - per_part.min() <= 1
        assert list(per_part) == sorted(per_part, reverse=True)  # extra slots go to older partitions


def test_decode_evicts_in_newest_scored_partition():
    S, L, N = 16, 128, 1024
    k, v = rand_kv(10, H=2, n=N + 1, d=32)
    kept = LagKVPolicy().select(make_ctx(k, v, N)).kept
    P = (N + 1 - S) // L
    newest = range(S + (P - 2) * L, S + (P - 1) * L)
    for row in kept.tolist():
        (evicted,) = set(range(N + 1)) - set(row)
        assert evicted in newest


def test_fallback_without_reference_keeps_sinks_and_most_recent():
    k, v = rand_kv(11, n=35)
    policy = LagKVPolicy(sinks=4, lag=16)  # 35 − 4 < 2·16: nothing scorable
    kept = policy.select(make_ctx(k, v, 20)).kept
    assert torch.equal(kept, torch.cat([torch.arange(4), torch.arange(19, 35)]).expand(2, 20))


def test_no_eviction_within_budget():
    k, v = rand_kv(12, n=50)
    assert torch.equal(LagKVPolicy().select(make_ctx(k, v, 50)).kept, torch.arange(50).expand(2, 50))


def test_auto_lag_and_check_budget():
    p = LagKVPolicy()
    assert [p.resolve_lag(N) for N in (128, 256, 1024, 2048, 8192, 16384)] == [16, 32, 128, 256, 1024, 1024]
    for N in (20, 64, 128, 512, 8192, 100_000):
        p.check_budget(N, 128)
        assert N >= p.sinks + 2 * p.resolve_lag(N)
    assert LagKVPolicy(sinks=100).resolve_lag(128) == 14
    with pytest.raises(PolicyError, match="lag="):
        LagKVPolicy(lag=1024).check_budget(2048, 128)
    LagKVPolicy(lag=1016).check_budget(2048, 128)
    for bad in (dict(sinks=-1), dict(lag=-2), dict(value_weight=-1.0)):
        with pytest.raises(PolicyError):
            LagKVPolicy(**bad).check_budget(1024, 128)
    with pytest.raises(PolicyError):
        LagKVPolicy(sinks=16).check_budget(17, 128)
    assert p.params() == {"sinks": 16, "lag": 0, "value_weight": 1.0, "unbiased_std": True}


# ---------------------------------------------------------------- differential test vs kvpress

@pytest.fixture(scope="module")
def kvpress_lagkv():
    return pytest.importorskip("kvpress.presses.lagkv_press").LagKVPress


@pytest.mark.parametrize(
    "seed,S,L,n,N",
    [(0, 16, 128, 1152, 1024), (0, 16, 128, 1152, 1026), (1, 4, 32, 300, 204), (2, 16, 16, 256, 128), (3, 0, 8, 77, 50)],
)
def test_matches_kvpress_lagkv(kvpress_lagkv, seed, S, L, n, N):
    """What matches: kvpress ``LagKVPress(n_sink=S, lag_size=L).score`` on one (batch, kv_heads,
    seq, dim) tensor uses the same layout (start-aligned partitions after the sinks, tail = last
    full partition + remainder), the same per-partition score (Eq. 7–10, unbiased std, softmax
    over the L tokens) and turns it into the within-partition rank / L. So (a) our per-chunk
    K and V scores equal its ``_get_states_score``, (b) our selection score equals its score on
    the scored partitions, and (c) both top-N sets are equal whenever the number of evictions
    is a multiple of the number of scored partitions (no tie at the rank threshold), and
    otherwise differ only among entries whose rank equals the threshold rank.
    What does not match: kvpress gives sinks and tail the same score 1.0 (we: +inf and a
    recency score, so the sinks win and the newest tail entries win if the budget is too small
    for all of them), breaks equal ranks across partitions with torch.topk's unspecified order
    (we: older partition first), divides by max − min without ε (NaN on a constant channel, see
    ``test_kvpress_nan_on_constant_channel``), scores in the cache dtype (we: fp32), averages
    s_K and s_V instead of adding them (same ranking), and compresses to a ratio of the whole
    sequence once (we: to N at every eviction event)."""
    g = torch.Generator().manual_seed(seed)
    H, d = 3, 32
    k = torch.randn(H, n, d, generator=g)
    v = torch.randn(H, n, d, generator=g)
    press = kvpress_lagkv(n_sink=S, lag_size=L)
    policy = LagKVPolicy(sinks=S, lag=L)
    ctx = make_ctx(k, v, N)
    P = (n - S) // L
    view = (1, H, P, L, d)
    assert torch.allclose(press._get_states_score(k[None, :, S : S + P * L].reshape(view))[0], lag_chunk_scores(k[:, S : S + P * L], L), atol=1e-7)
    assert torch.allclose(press._get_states_score(v[None, :, S : S + P * L].reshape(view))[0], lag_chunk_scores(v[:, S : S + P * L], L), atol=1e-7)
    theirs = press.score(None, None, k[None], v[None], None, {})[0]
    ours = policy.score(ctx)
    _, start, end = policy.raw_scores(ctx)
    assert torch.equal(theirs[:, start:end], ours[:, start:end])
    assert torch.all(theirs[:, :start] == 1) and torch.all(theirs[:, end:] == 1)
    kept_theirs, kept_ours = topk_keep(theirs, N), policy.select(ctx).kept
    if (n - N) % (P - 1) == 0:  # equal quotas, no tie at the threshold: identical sets
        assert torch.equal(kept_theirs, kept_ours)
    else:  # identical above and below the threshold rank; at it, as many entries each
        thr = torch.sort(ours, dim=-1, descending=True).values[:, N - 1 : N]
        for h in range(H):
            a, b = set(kept_theirs[h].tolist()), set(kept_ours[h].tolist())
            above = set(torch.nonzero(ours[h] > thr[h]).flatten().tolist())
            assert above <= a and above <= b and len(a - above) == len(b - above)
            assert all(float(ours[h, i]) == float(thr[h]) for i in a ^ b)


def test_matches_kvpress_fallback(kvpress_lagkv):
    """Both keep sinks + most recent when no partition has a reference (n < S + 2L)."""
    k, v = rand_kv(13, n=35)  # 35 < 4 + 2·16
    theirs = kvpress_lagkv(n_sink=4, lag_size=16).score(None, None, k[None], v[None], None, {})[0]
    assert torch.equal(topk_keep(theirs, 20), LagKVPolicy(sinks=4, lag=16).select(make_ctx(k, v, 20)).kept)


def test_kvpress_nan_on_constant_channel(kvpress_lagkv):
    """The documented deviation: without ε, a constant reference channel gives NaN scores."""
    k, v = rand_kv(14, n=4 + 4 * 8)
    k[..., 0] = 1.0
    theirs = kvpress_lagkv(n_sink=4, lag_size=8).score(None, None, k[None], v[None], None, {})
    raw = kvpress_lagkv(n_sink=4, lag_size=8)._get_states_score(k[None, :, 4:].reshape(1, 2, 4, 8, 16))
    assert torch.isnan(raw).all()
    assert theirs.shape == (1, 2, 36)
    assert torch.isfinite(LagKVPolicy(sinks=4, lag=8).raw_scores(make_ctx(k, v, 20))[0]).all()


# ---------------------------------------------------------------- hypothesis properties

@st.composite
def lagkv_cases(draw):
    H = draw(st.integers(1, 3))
    n = draw(st.integers(1, 80))
    d = draw(st.integers(1, 6))
    shape = (H, n, d)
    elems = st.floats(-1e3, 1e3, width=32)
    k = draw(hnp.arrays(np.float32, shape, elements=elems))
    v = draw(hnp.arrays(np.float32, shape, elements=elems))
    mode = draw(st.sampled_from(["random", "zero", "constant", "const_channel", "repeat_rows"]))
    if mode == "zero":
        k[:] = 0
        v[:] = 0
    elif mode == "constant":
        k[:] = k[:, :1]
        v[:] = v[:, :1]
    elif mode == "const_channel":
        k[..., 0] = 2.0
        v[..., -1] = -1.0
    elif mode == "repeat_rows":
        k[:, 1::2] = k[:, ::2][:, : k[:, 1::2].shape[1]]
    budget = draw(st.integers(1, 64))
    sinks = draw(st.integers(0, 20))
    lag = draw(st.integers(0, 24))
    value_weight = draw(st.sampled_from([0.0, 0.5, 1.0]))
    unbiased = draw(st.booleans())
    policy = LagKVPolicy(sinks=sinks, lag=lag, value_weight=value_weight, unbiased_std=unbiased)
    return torch.from_numpy(k), torch.from_numpy(v), budget, policy


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lagkv_cases())
def test_property_selection_valid(case):
    """Holds for every input, even budgets that ``check_budget`` would refuse."""
    k, v, budget, policy = case
    H, n, _ = k.shape
    ctx = make_ctx(k, v, budget)
    score = policy.score(ctx)
    assert score.shape == (H, n) and not torch.isnan(score).any()
    kept = policy.select(ctx).kept
    assert kept.shape == (H, min(n, budget))
    assert ((kept >= 0) & (kept < n)).all()
    for row in kept:
        assert len(set(row.tolist())) == row.numel()
        assert torch.equal(row, torch.sort(row).values)
    if n > budget and min(policy.sinks, n) <= budget:
        assert set(range(min(policy.sinks, n))) <= set(kept[0].tolist())  # sinks survive while they fit
