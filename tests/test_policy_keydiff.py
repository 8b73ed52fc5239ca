"""KeyDiff reference scorer: the digest's hand-checked cases (research/seed-keydiff.md §10.2),
invariances, numerical safety, the recent-window variant, a differential test against NVIDIA
kvpress 0.5.5 ``KeyDiffPress``, and hypothesis properties of the selection."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgekv.policies.base import EvictionContext, PolicyError, topk_keep
from edgekv.policies.keydiff import KeyDiffPolicy, keydiff_scores, recent_count

TOY = [[1, 0], [2, 0.2], [0, 1], [1, 1], [-1, 0.5]]


def make_ctx(keys: torch.Tensor, budget: int, values: torch.Tensor | None = None, positions=None) -> EvictionContext:
    H, n, _ = keys.shape
    if positions is None:
        positions = torch.arange(n).expand(H, n).contiguous()
    return EvictionContext(
        layer=0, num_layers=1, budget=budget, keys=keys,
        values=keys.clone() if values is None else values,
        positions=positions, n_cache=max(0, min(budget, n)),
    )


def kept_sets(policy: KeyDiffPolicy, keys: torch.Tensor, budget: int, **kw) -> list[set[int]]:
    return [set(row.tolist()) for row in policy.select(make_ctx(keys, budget, **kw)).kept]


def boundary_gap(score: torch.Tensor, k: int) -> float:
    """Smallest gap, over heads, between the k-th and (k+1)-th highest scores."""
    s = torch.sort(score, dim=-1, descending=True).values
    return float((s[:, k - 1] - s[:, k]).min())


# ---------------------------------------------------------------- digest hand-checked cases

def test_toy_example_scores_and_kept_set():
    keys = torch.tensor([TOY])
    score = keydiff_scores(keys)[0]
    expected = torch.tensor([-0.6257, -0.7002, -0.7801, -0.9940, 0.2108])
    assert torch.allclose(score, expected, atol=1e-4)
    assert kept_sets(KeyDiffPolicy(), keys, 3) == [{0, 1, 4}]


def test_toy_example_pairwise_ratio():
    """−S·1 = n‖μ‖·score; the digest gives the ratio 2.8892 = 5 × 0.57784."""
    k = torch.tensor(TOY, dtype=torch.float64)
    k_hat = k / k.norm(dim=-1, keepdim=True)
    pairwise = -(k_hat @ k_hat.T).sum(-1)
    mu = k_hat.mean(0)
    assert float(mu.norm()) == pytest.approx(0.57784, abs=1e-5)
    ratio = pairwise / keydiff_scores(k[None])[0].double()
    assert torch.allclose(ratio, torch.full_like(ratio, 5 * 0.57784), atol=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_mean_anchor_ranking_equals_pairwise_cosine(seed):
    g = torch.Generator().manual_seed(seed)
    H, n, d, N = 4, 64, 16, 24
    keys = torch.randn(H, n, d, generator=g) + 0.5 * torch.randn(H, 1, d, generator=g)  # anisotropic, like real keys
    k_hat = keys.double() / keys.double().norm(dim=-1, keepdim=True)
    pairwise = -(k_hat @ k_hat.transpose(1, 2)).sum(-1)  # Eq. 7
    score = keydiff_scores(keys).double()  # Eq. 8
    mu_norm = k_hat.mean(1).norm(dim=-1, keepdim=True)
    assert torch.allclose(pairwise, n * mu_norm * score, atol=1e-5)
    assert boundary_gap(pairwise, N) > 1e-4
    assert torch.equal(topk_keep(pairwise, N), topk_keep(score, N))
    assert [set(r.tolist()) for r in topk_keep(pairwise, N)] == kept_sets(KeyDiffPolicy(), keys, N)


def test_relaxed_optimality_brute_force():
    """§10.2(c): KeyDiff's set minimises Σ_{i∈S} k̂_i·μ(K̂) over all |S| = N (small n)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(30):
        n, N = 9, 4
        k = torch.randn(n, 3, generator=g, dtype=torch.float64) + torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
        k_hat = k / k.norm(dim=-1, keepdim=True)
        proj = k_hat @ k_hat.mean(0)
        best = min(itertools.combinations(range(n), N), key=lambda s: float(proj[list(s)].sum()))
        assert kept_sets(KeyDiffPolicy(), k[None].float(), N) == [set(best)]


# ---------------------------------------------------------------- invariances (§10.2 d)

def random_keys(seed: int, H: int = 3, n: int = 48, d: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, n, d, generator=g) + torch.randn(H, 1, d, generator=g)


@pytest.mark.parametrize("seed", range(4))
def test_positive_scaling_per_key_exact(seed):
    """Scaling keys by powers of two is exact in floating point, so the sets must be identical."""
    keys = random_keys(seed)
    g = torch.Generator().manual_seed(100 + seed)
    scales = 2.0 ** torch.randint(-20, 21, keys.shape[:2] + (1,), generator=g).float()
    N = 20
    assert kept_sets(KeyDiffPolicy(), keys * scales, N) == kept_sets(KeyDiffPolicy(), keys, N)
    assert torch.equal(keydiff_scores(keys * scales), keydiff_scores(keys))


@pytest.mark.parametrize("seed", range(4))
def test_positive_scaling_per_key_arbitrary(seed):
    keys = random_keys(seed)
    g = torch.Generator().manual_seed(200 + seed)
    scales = torch.exp(4 * torch.randn(keys.shape[:2] + (1,), generator=g))
    N = 20
    assert boundary_gap(keydiff_scores(keys), N) > 1e-5
    assert torch.allclose(keydiff_scores(keys * scales), keydiff_scores(keys), atol=1e-6)
    assert kept_sets(KeyDiffPolicy(), keys * scales, N) == kept_sets(KeyDiffPolicy(), keys, N)


@pytest.mark.parametrize("seed", range(4))
def test_permutation_equivariance(seed):
    keys = random_keys(seed)
    H, n, _ = keys.shape
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(300 + seed))
    N = 17
    assert boundary_gap(keydiff_scores(keys), N) > 1e-5
    base = kept_sets(KeyDiffPolicy(), keys, N)
    permuted = kept_sets(KeyDiffPolicy(), keys[:, perm], N)
    assert [{int(perm[i]) for i in s} for s in permuted] == base


@pytest.mark.parametrize("seed", range(4))
def test_negating_all_keys(seed):
    keys = random_keys(seed)
    assert torch.equal(keydiff_scores(-keys), keydiff_scores(keys))
    assert kept_sets(KeyDiffPolicy(), -keys, 11) == kept_sets(KeyDiffPolicy(), keys, 11)


def test_values_never_matter():
    keys = random_keys(1)
    a = kept_sets(KeyDiffPolicy(), keys, 13, values=torch.zeros_like(keys))
    b = kept_sets(KeyDiffPolicy(), keys, 13, values=1e6 * torch.randn(keys.shape))
    assert a == b


def test_heads_select_independently():
    """Head 0 and head 1 hold the same keys in a different order: per-head sets differ accordingly."""
    k0 = random_keys(5, H=1)[0]
    perm = torch.randperm(k0.shape[0], generator=torch.Generator().manual_seed(5))
    keys = torch.stack([k0, k0[perm]])
    s0, s1 = kept_sets(KeyDiffPolicy(), keys, 10)
    assert s0 != s1
    assert {int(perm[i]) for i in s1} == s0
    # head 1 alone gives the same answer as inside the stack
    assert kept_sets(KeyDiffPolicy(), keys[1:], 10) == [s1]


# ---------------------------------------------------------------- bookkeeping and numerics

def test_no_eviction_when_within_budget():
    keys = random_keys(2, n=10)
    kept = KeyDiffPolicy().select(make_ctx(keys, 10)).kept
    assert torch.equal(kept, torch.arange(10).expand(3, 10))


def test_zero_keys_and_zero_anchor_no_nan():
    keys = random_keys(3, H=2, n=12, d=4)
    keys[0, [2, 5, 7]] = 0.0  # zero keys
    keys[1] = torch.cat([keys[1, :6], -keys[1, :6]])  # normalised keys cancel: anchor = 0
    score = keydiff_scores(keys)
    assert torch.isfinite(score).all()
    assert torch.all(score[0, [2, 5, 7]] == 0)
    # the anchor cancels up to rounding (‖μ‖ ≪ eps): the eps clamp damps the scores towards 0
    assert score[1].abs().max() < 0.05
    exact = torch.tensor([[[3.0, -1.0, 2.0], [-3.0, 1.0, -2.0]]])  # k̂₀ + k̂₁ = 0 exactly
    assert torch.equal(keydiff_scores(exact), torch.zeros(1, 2))
    kept = KeyDiffPolicy().select(make_ctx(keys, 5)).kept
    assert kept.shape == (2, 5)
    all_zero = torch.zeros(1, 9, 4)
    assert torch.equal(KeyDiffPolicy().select(make_ctx(all_zero, 4)).kept, torch.tensor([[0, 1, 2, 3]]))


def test_low_precision_input_scored_in_fp32():
    keys = random_keys(4)
    s16 = keydiff_scores(keys.to(torch.bfloat16))
    assert s16.dtype == torch.float32
    assert torch.allclose(s16, keydiff_scores(keys.to(torch.bfloat16).float()))


# ---------------------------------------------------------------- recent-window variant (§2.7)

def test_recent_count_rules():
    assert recent_count(0, 2048) == 0
    assert recent_count(0.1, 2048) == 204
    assert recent_count(0.2, 100) == 20
    assert recent_count(256, 2048) == 256
    assert recent_count(1, 2048) == 1


def test_recent_window_reserves_newest_and_fills_rest_by_keydiff():
    keys = random_keys(6, H=2, n=40)
    N, w = 16, 4
    ctx = make_ctx(keys, N)
    plain = keydiff_scores(keys)
    for frac_or_count in (0.25, 4):
        kept = KeyDiffPolicy(recent_window=frac_or_count).select(ctx).kept
        for h in range(2):
            got = set(kept[h].tolist())
            assert set(range(40 - w, 40)) <= got
            rest = plain[h, : 40 - w]
            expected = set(topk_keep(rest[None], N - w)[0].tolist()) | set(range(40 - w, 40))
            assert got == expected


def test_recent_window_uses_positions_per_head():
    keys = random_keys(8, H=2, n=20)
    positions = torch.stack([torch.arange(20), torch.arange(20) * 3])  # head 1 has gaps
    kept = KeyDiffPolicy(recent_window=6).select(make_ctx(keys, 8, positions=positions)).kept
    assert set(range(14, 20)) <= set(kept[0].tolist())
    assert {18, 19} <= set(kept[1].tolist())  # positions 54, 57 lie within 6 of the newest


def test_check_budget():
    KeyDiffPolicy().check_budget(128, 128)
    KeyDiffPolicy(recent_window=0.2).check_budget(128, 128)
    for bad in (-0.1, 1.5, 300):
        with pytest.raises(PolicyError):
            KeyDiffPolicy(recent_window=bad).check_budget(256, 128)
    assert KeyDiffPolicy().params() == {"recent_window": 0.0}


# ---------------------------------------------------------------- differential test vs kvpress

@pytest.fixture(scope="module")
def kvpress_keydiff():
    mod = pytest.importorskip("kvpress.presses.keydiff_press")
    return mod.KeyDiffPress()


@pytest.mark.parametrize("seed,n,budget", [(0, 1152, 1024), (1, 300, 128), (2, 257, 200), (3, 64, 8)])
def test_matches_kvpress_keydiff(kvpress_keydiff, seed, n, budget):
    """kvpress scores one (batch, kv_heads, seq, dim) tensor exactly as the paper: anchor = mean of
    F.normalize(keys), score = −cosine_similarity(keys, anchor). Same definition here, so the
    scores agree to float rounding and the kept sets (top-N, ties → lower index) are equal."""
    g = torch.Generator().manual_seed(seed)
    H, d = 3, 64
    keys = torch.randn(H, n, d, generator=g) + 0.7 * torch.randn(H, 1, d, generator=g)
    values = torch.randn(H, n, d, generator=g)
    theirs = kvpress_keydiff.score(None, None, keys[None], values[None], None, {})[0]
    ours = KeyDiffPolicy().score(make_ctx(keys, budget, values=values))
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=1e-6)
    assert boundary_gap(ours, budget) > 1e-5
    assert torch.equal(topk_keep(theirs, budget), KeyDiffPolicy().select(make_ctx(keys, budget, values=values)).kept)


# ---------------------------------------------------------------- hypothesis properties

@st.composite
def keydiff_cases(draw):
    H = draw(st.integers(1, 3))
    n = draw(st.integers(1, 40))
    d = draw(st.integers(1, 8))
    keys = draw(hnp.arrays(np.float32, (H, n, d), elements=st.floats(-1e3, 1e3, width=32)))
    mode = draw(st.sampled_from(["random", "zero_rows", "all_zero", "constant", "tiny"]))
    if mode == "zero_rows":
        keys[:, draw(st.integers(0, n - 1))] = 0
    elif mode == "all_zero":
        keys[:] = 0
    elif mode == "constant":
        keys[:] = keys[:, :1]
    elif mode == "tiny":
        keys *= 1e-30
    budget = draw(st.integers(1, 48))
    window = draw(st.sampled_from([0, 0.1, 0.5, 1, 3]))
    return torch.from_numpy(keys), budget, window


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keydiff_cases())
def test_property_selection_valid(case):
    keys, budget, window = case
    H, n, _ = keys.shape
    policy = KeyDiffPolicy(recent_window=window)
    if recent_count(window, budget) > budget:
        return
    ctx = make_ctx(keys, budget)
    score = policy.score(ctx)
    assert not torch.isnan(score).any()
    kept = policy.select(ctx).kept
    assert kept.shape == (H, min(n, budget))
    assert kept.dtype == torch.int64
    assert ((kept >= 0) & (kept < n)).all()
    for row in kept:
        assert len(set(row.tolist())) == row.numel()
        assert torch.equal(row, torch.sort(row).values)
    if window and n > budget:  # the reserved newest entries are always kept
        w = recent_count(window, budget)
        assert set(range(n - w, n)) <= set(kept[0].tolist())
