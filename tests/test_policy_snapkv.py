"""SnapKV and SnapKV++ (and the shared attention_rows helper): hand-checked cases, the naive
full-matrix reference, kvpress 0.5.5 SnapKVPress on the same tensors, and hypothesis properties."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekv.policies.attention_rows import attention_rows, group_reduce
from policy_contexts import make_ctx

from edgekv.policies.base import EvictionContext, PolicyError
from edgekv.policies.snapkv import SnapKVPolicy, pool_scores, window_votes
from edgekv.policies.snapkv_pp import SnapKVPlusPlusPolicy



def naive_attention(ctx: EvictionContext) -> torch.Tensor:
    """Full [Hq, b, n] matrix: K repeated per query head, dense logits, causal-by-position mask."""
    Hq = ctx.queries.shape[0]
    G = Hq // ctx.num_kv_heads
    k = ctx.keys.float().repeat_interleave(G, dim=0)
    pos = ctx.positions.repeat_interleave(G, dim=0)
    scale = ctx.scale if ctx.scale is not None else 1 / math.sqrt(ctx.head_dim)
    logits = torch.einsum("hrd,hnd->hrn", ctx.queries.float(), k) * scale
    mask = pos[:, None, :] > ctx.query_positions[None, :, None]
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)


def hf_eager_attention(ctx: EvictionContext) -> torch.Tensor:
    """The same matrix from transformers' own eager attention (repeat_kv + additive mask)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    Hq = ctx.queries.shape[0]
    G = Hq // ctx.num_kv_heads
    module = torch.nn.Module()
    module.num_key_value_groups = G
    module.eval()
    pos = ctx.positions.repeat_interleave(G, dim=0)
    mask = torch.zeros(1, Hq, ctx.queries.shape[1], ctx.n)
    mask = mask.masked_fill(pos[None, :, None, :] > ctx.query_positions[None, None, :, None], float("-inf"))
    scale = ctx.scale if ctx.scale is not None else 1 / math.sqrt(ctx.head_dim)
    _, weights = eager_attention_forward(module, ctx.queries.float()[None], ctx.keys.float()[None],
                                         ctx.values.float()[None], mask, scale)
    return weights[0]


def kept_sets(kept: torch.Tensor) -> list[set[int]]:
    return [set(row.tolist()) for row in kept]


# --------------------------------------------------------------------------- attention_rows


@pytest.mark.parametrize("H,G,n_cache,b", [(1, 1, 0, 9), (2, 3, 10, 7), (3, 2, 25, 16), (2, 1, 5, 1)])
def test_attention_rows_matches_full_softmax(H, G, n_cache, b):
    ctx = make_ctx(H=H, G=G, n_cache=n_cache, b=b, seed=H * 100 + G * 10 + b)
    full = naive_attention(ctx)
    assert torch.allclose(full, hf_eager_attention(ctx), atol=1e-6)
    for rows in (slice(0, b), slice(b - 1, b), slice(max(0, b - 4), b), slice(0, (b + 1) // 2)):
        sub = attention_rows(ctx.keys, ctx.positions, ctx.queries[:, rows], ctx.query_positions[rows], ctx.scale)
        assert sub.dtype == torch.float32
        assert torch.allclose(sub, full[:, rows], atol=1e-6)


def test_attention_rows_causal_inside_block_and_scale():
    ctx = make_ctx(H=2, G=2, n_cache=6, b=5, seed=3, scale=0.3)
    probs = attention_rows(ctx.keys, ctx.positions, ctx.queries, ctx.query_positions, ctx.scale)
    assert torch.allclose(probs, naive_attention(ctx), atol=1e-6)
    for r in range(5):
        # block key i (index n_cache + i) is visible to block query r iff i ≤ r; the cache always is
        assert torch.all(probs[:, r, 6 + r + 1:] == 0)
        assert torch.all(probs[:, r, : 6 + r + 1] > 0)
    assert torch.allclose(probs.sum(-1), torch.ones(4, 5), atol=1e-6)


def test_attention_rows_row_without_visible_key_is_zero_not_nan():
    keys = torch.randn(1, 4, 2)
    positions = torch.tensor([[5, 6, 7, 8]])
    probs = attention_rows(keys, positions, torch.randn(1, 2, 2), torch.tensor([1, 6]))
    assert torch.all(probs[0, 0] == 0)
    assert torch.isfinite(probs).all() and abs(float(probs[0, 1].sum()) - 1) < 1e-6


def test_group_reduce_uses_consecutive_query_heads():
    x = torch.arange(6.0)[:, None]  # query heads 0..5, G = 3 -> groups {0,1,2}, {3,4,5}
    assert group_reduce(x, 2, "mean").flatten().tolist() == [1.0, 4.0]
    assert group_reduce(x, 2, "sum").flatten().tolist() == [3.0, 12.0]


# --------------------------------------------------------------------------- SnapKV, by hand


def log_weight_ctx(weights, n_cache, budget, G=1, head_queries=None):
    """d = 1, scale 1, key_j = ln(a_j), query = 1: softmax over visible keys is a_j / Σ a."""
    a = torch.tensor(weights, dtype=torch.float32)
    n = len(weights)
    b = n - n_cache
    keys = torch.log(a).view(1, n, 1)
    if head_queries is None:
        q = torch.ones(G, b, 1)
    else:
        q = torch.tensor(head_queries, dtype=torch.float32).view(G, 1, 1).expand(G, b, 1)
    return EvictionContext(layer=0, num_layers=1, budget=budget, keys=keys, values=keys.clone(),
                           positions=torch.arange(n).view(1, n), n_cache=n_cache, queries=q.contiguous(),
                           query_positions=torch.arange(n_cache, n), scale=1.0)


@pytest.mark.parametrize("n_cache", [0, 3])
def test_snapkv_hand_checked(n_cache):
    # a = [1,4,1,2 | 1,1]: window = positions 4, 5; row 4 sums to 9, row 5 to 10, so key j < 4
    # collects a_j (1/9 + 1/10) = a_j·19/90.
    ctx = log_weight_ctx([1, 4, 1, 2, 1, 1], n_cache=n_cache, budget=4)
    score = SnapKVPolicy(window=2, kernel=1).score(ctx)
    assert torch.allclose(score[0, :4], torch.tensor([19, 76, 19, 38]) / 90, atol=1e-6)
    assert torch.isinf(score[0, 4:]).all()
    assert SnapKVPolicy(window=2, kernel=1).select(ctx).kept.tolist() == [[1, 3, 4, 5]]
    # κ = 3, zero padding counted: (v_{j-1} + v_j + v_{j+1}) / 3 -> [95, 114, 133, 57] / 270
    score = SnapKVPolicy(window=2, kernel=3).score(ctx)
    assert torch.allclose(score[0, :4], torch.tensor([95, 114, 133, 57]) / 270, atol=1e-6)
    assert SnapKVPolicy(window=2, kernel=3).select(ctx).kept.tolist() == [[1, 2, 4, 5]]


def test_snapkv_gqa_is_the_group_mean_of_per_head_scores():
    ctx = make_ctx(H=1, G=3, n_cache=20, b=12, budget=16, seed=7)
    pol = SnapKVPolicy(window=5, kernel=7)
    per_head = []
    for h in range(3):
        one = make_ctx(H=1, G=1, n_cache=20, b=12, budget=16, seed=7)
        one.keys, one.positions, one.queries = ctx.keys, ctx.positions, ctx.queries[h : h + 1]
        per_head.append(pol.score(one))
    assert torch.allclose(pol.score(ctx), torch.stack(per_head).mean(0), atol=1e-6)


@pytest.mark.parametrize("b,window", [(8, 32), (40, 32), (1, 32), (16, 4)])
def test_snapkv_always_keeps_the_window(b, window):
    ctx = make_ctx(H=2, G=2, n_cache=30, b=b, budget=max(min(b, window) + 3, 20), seed=b)
    kept = SnapKVPolicy(window=window).select(ctx).kept
    w = min(window, b)
    newest = set(ctx.query_positions[-w:].tolist())
    for h in range(2):
        assert newest <= set(ctx.positions[h, kept[h]].tolist())
    assert kept.shape == (2, ctx.budget)


def test_snapkv_no_eviction_keeps_everything():
    ctx = make_ctx(n_cache=4, b=6, budget=64)
    assert SnapKVPolicy().select(ctx).kept.tolist() == [list(range(10))] * 2


def test_snapkv_check_budget():
    SnapKVPolicy().check_budget(33, 128)
    SnapKVPolicy().check_budget(9, 8)  # window clipped to the block
    for pol, budget in ((SnapKVPolicy(), 32), (SnapKVPolicy(kernel=6), 64), (SnapKVPolicy(pooling="min"), 64),
                        (SnapKVPolicy(window=0), 64)):
        with pytest.raises(PolicyError):
            pol.check_budget(budget, 128)


def test_snapkv_needs_queries():
    ctx = make_ctx(budget=4)
    ctx.queries = None
    with pytest.raises(PolicyError, match="needs the block's queries"):
        SnapKVPolicy(window=2).select(ctx)


# --------------------------------------------------------------------------- kvpress SnapKVPress

def _rope(x, pos, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin, cos, sin


def kvpress_inputs(H, G, d, n_cache, b, seed):
    """Pre-RoPE queries as hidden states (q_proj = identity), cos/sin for the block positions; our
    ctx gets the same queries rotated here (post-RoPE)."""
    ctx = make_ctx(H=H, G=G, d=d, n_cache=n_cache, b=b, seed=seed)
    pre_q = ctx.queries.clone()
    post_q, cos, sin = _rope(pre_q, ctx.query_positions, d)
    ctx.queries = post_q
    module = SimpleNamespace(config=SimpleNamespace(num_attention_heads=H * G, num_key_value_heads=H),
                             head_dim=d, q_proj=lambda x: x)
    hidden = pre_q.transpose(0, 1).reshape(1, b, H * G * d)
    kwargs = {"position_embeddings": (cos[None], sin[None])}
    return ctx, module, hidden, kwargs


@pytest.mark.parametrize("H,G,n_cache,b,w,budget", [(2, 3, 0, 96, 32, 48), (1, 1, 0, 40, 8, 20),
                                                    (3, 2, 50, 64, 32, 70), (2, 2, 30, 20, 16, 25)])
def test_snapkv_matches_kvpress(H, G, n_cache, b, w, budget):
    """Same tensors through kvpress 0.5.5 SnapKVPress.score (window attention path).

    Matches: softmax over all candidates with the window's causal mask, the window rows reduced
    (kvpress: mean, ours: sum -> factor w), avg pooling with counted zero padding over the
    non-window part, group mean, window pinned on top. Their keys are cache ⊕ block as here
    (index-causal == position-causal because the block comes last). Not compared: kvpress requires
    b > w (it cannot clip the window), and keeps a compression *ratio* (we take top-N of its scores).
    """
    kvpress = pytest.importorskip("kvpress")
    ctx, module, hidden, kwargs = kvpress_inputs(H, G, 16, n_cache, b, seed=budget)
    ctx.budget = budget
    press = kvpress.SnapKVPress(window_size=w, kernel_size=7)
    theirs = press.score(module, hidden, ctx.keys[None], ctx.values[None], None, kwargs)[0]
    pol = SnapKVPolicy(window=w, kernel=7)
    ours = pol.score(ctx)
    n = ctx.n
    assert torch.allclose(ours[:, : n - w], w * theirs[:, : n - w], rtol=1e-5, atol=1e-6)
    top = torch.topk(theirs, budget, dim=-1).indices
    assert kept_sets(pol.select(ctx).kept) == kept_sets(top)


# --------------------------------------------------------------------------- SnapKV++


def test_snapkvpp_reduces_to_snapkv_with_one_head_per_group_and_no_pooling():
    ctx = make_ctx(H=3, G=1, n_cache=40, b=24, budget=30, seed=11)
    a = SnapKVPlusPlusPolicy(window=8, kernel=1)
    b = SnapKVPolicy(window=8, kernel=1)
    assert torch.allclose(a.score(ctx), b.score(ctx))
    assert torch.equal(a.select(ctx).kept, b.select(ctx).kept)


def test_snapkvpp_score_is_maxpooled_group_sum():
    ctx = make_ctx(H=2, G=3, n_cache=40, b=24, budget=30, seed=12)
    pol = SnapKVPlusPlusPolicy(window=8, kernel=5)
    votes = window_votes(ctx, 8, "t")
    # mass identity: every window row sums to 1 -> each query head's votes sum to w
    assert torch.allclose(votes.sum(-1), torch.full((6,), 8.0), atol=1e-5)
    grouped = votes.view(2, 3, -1).sum(1)
    expect = torch.nn.functional.max_pool1d(grouped[:, None, : ctx.n - 8], 5, 1, 2)[:, 0]
    assert torch.allclose(pol.score(ctx)[:, : ctx.n - 8], expect)


def test_maxpool_one_hot_semantics():
    x = torch.zeros(1, 20)
    x[0, 10] = 1.0
    pooled = pool_scores(x, 7, "max")
    assert pooled[0].nonzero().flatten().tolist() == list(range(7, 14))
    x = torch.zeros(1, 20)
    x[0, 1] = 1.0
    assert pool_scores(x, 7, "max")[0].nonzero().flatten().tolist() == list(range(0, 5))  # clipped
    avg = pool_scores(x, 7, "avg")
    assert torch.allclose(avg[0, :5], torch.full((5,), 1 / 7))


def test_snapkvpp_keeps_the_neighbourhood_of_a_strong_token():
    ctx = make_ctx(H=1, G=2, d=8, n_cache=40, b=16, budget=16 + 4 + 7, seed=5)
    ctx.queries = ctx.queries * 0.01
    t = 20
    ctx.keys[0, t] = 50 * ctx.queries[:, -4:].sum((0, 1)) / ctx.queries[:, -4:].sum((0, 1)).norm()
    kept = SnapKVPlusPlusPolicy(window=4, kernel=7).select(ctx).kept[0].tolist()
    assert set(range(t - 3, t + 4)) <= set(kept)
    assert set(range(ctx.n - 4, ctx.n)) <= set(kept)


def test_snapkvpp_group_shared_selection_invariance():
    ctx = make_ctx(H=2, G=3, n_cache=40, b=20, budget=24, seed=9)
    pol = SnapKVPlusPlusPolicy(window=6, kernel=3)
    base = pol.select(ctx).kept
    perm = torch.tensor([2, 0, 1, 4, 5, 3])  # permute within groups
    ctx.queries = ctx.queries[perm]
    assert torch.equal(pol.select(ctx).kept, base)
    # move a head that stares at one old token into the other group: group 0 loses it
    ctx = make_ctx(H=2, G=2, n_cache=40, b=20, budget=24, seed=9)
    ctx.keys[:, :] = 0
    ctx.keys[:, 35] = 1.0
    ctx.queries[:] = 0
    ctx.queries[0] = 40.0  # query head 0 (group 0) attends to candidate 35 only
    pol = SnapKVPlusPlusPolicy(window=6, kernel=1)
    kept = pol.select(ctx).kept  # the other candidates tie, and ties go to the older ones
    assert 35 in kept[0].tolist() and 35 not in kept[1].tolist()
    ctx.queries = ctx.queries[torch.tensor([2, 1, 0, 3])]
    kept = pol.select(ctx).kept
    assert 35 not in kept[0].tolist() and 35 in kept[1].tolist()


def test_snapkvpp_adaptive_kernel():
    pol = SnapKVPlusPlusPolicy()
    assert pol.kernel_for(1000) == 63 and pol.kernel_for(48 * 1024 - 1) == 63 and pol.kernel_for(48 * 1024) == 511
    assert SnapKVPlusPlusPolicy(kernel=15).kernel_for(10**6) == 15
    short = SnapKVPlusPlusPolicy(long_threshold=10**9)
    long = SnapKVPlusPlusPolicy(long_threshold=1)
    ctx = make_ctx(H=1, G=2, n_cache=600, b=64, budget=300, seed=4)
    votes = window_votes(ctx, 32, "t").view(1, 2, -1).sum(1)[:, : ctx.n - 32]
    for pol, k in ((short, 63), (long, 511)):
        expect = torch.nn.functional.max_pool1d(votes[:, None], k, 1, k // 2)[:, 0]
        assert torch.allclose(pol.score(ctx)[:, : ctx.n - 32], expect)


def test_snapkvpp_check_budget():
    SnapKVPlusPlusPolicy().check_budget(33, 128)
    with pytest.raises(PolicyError):
        SnapKVPlusPlusPolicy(kernel_long=510).check_budget(64, 128)
    with pytest.raises(PolicyError):
        SnapKVPlusPlusPolicy().check_budget(32, 128)
    SnapKVPlusPlusPolicy(kernel=7, kernel_long=510).check_budget(64, 128)  # fixed kernel wins


# --------------------------------------------------------------------------- properties


@st.composite
def contexts(draw):
    H = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 4, 8]))
    n_cache = draw(st.integers(0, 40))
    b = draw(st.integers(1, 20))
    budget = draw(st.integers(1, 60))
    keys = draw(st.sampled_from(["randn", "zero", "const"]))
    queries = draw(st.sampled_from(["randn", "zero", "const"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 10_000))
    return make_ctx(H=H, G=G, d=d, n_cache=n_cache, b=b, budget=budget, seed=seed, keys=keys,
                    queries=queries, dtype=dtype)


def check_selection(ctx, kept):
    H, n = ctx.num_kv_heads, ctx.n
    assert kept.shape == (H, min(n, ctx.budget))
    assert kept.dtype == torch.int64
    assert int(kept.min()) >= 0 and int(kept.max()) < n
    for row in kept:
        assert len(set(row.tolist())) == row.numel()


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts(), window=st.integers(1, 8), kernel=st.sampled_from([1, 3, 7, 63]),
       pp=st.booleans())
def test_window_policies_properties(ctx, window, kernel, pp):
    w = min(window, ctx.queries.shape[1])
    ctx.budget = max(ctx.budget, w + 1)
    pol = SnapKVPlusPlusPolicy(window=window, kernel=kernel) if pp else SnapKVPolicy(window=window, kernel=kernel)
    score = pol.score(ctx)
    assert score.shape == (ctx.num_kv_heads, ctx.n)
    assert not torch.isnan(score).any()
    assert torch.isfinite(score[:, : ctx.n - w]).all() and torch.isinf(score[:, ctx.n - w:]).all()
    kept = pol.select(ctx).kept
    check_selection(ctx, kept)
    assert set(range(ctx.n - w, ctx.n)) <= set(kept[0].tolist())
