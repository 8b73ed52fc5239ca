"""TOVA: hand-checked cases, last-row-only scoring, group vs layer head aggregation, kvpress 0.5.5
TOVAPress on the same tensors, hypothesis properties."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy_contexts import make_ctx

from edgekv.policies.base import EvictionContext, PolicyError, topk_keep
from edgekv.policies.tova import TOVAPolicy



def last_row_reference(ctx):
    """Dense reference for the last query row: [Hq, n] (every candidate is visible to it)."""
    G = ctx.queries.shape[0] // ctx.num_kv_heads
    k = ctx.keys.float().repeat_interleave(G, dim=0)
    scale = ctx.scale if ctx.scale is not None else 1 / math.sqrt(ctx.head_dim)
    logits = torch.einsum("hd,hnd->hn", ctx.queries[:, -1].float(), k) * scale
    return torch.softmax(logits, dim=-1)


def test_tova_hand_checked():
    # d = 1, scale 1, key_j = ln(a_j): a query of +1 gives a_j / Σa, a query of −1 gives (1/a_j) / Σ(1/a).
    a = torch.tensor([1.0, 4, 1, 2, 1, 3])
    keys = torch.log(a).view(1, 6, 1)
    ctx = EvictionContext(layer=0, num_layers=1, budget=3, keys=keys, values=keys.clone(),
                          positions=torch.arange(6).view(1, 6), n_cache=2,
                          queries=torch.ones(1, 4, 1), query_positions=torch.arange(2, 6), scale=1.0)
    pol = TOVAPolicy()
    assert torch.allclose(pol.score(ctx), (a / 12).view(1, 6))
    assert pol.select(ctx).kept.tolist() == [[1, 3, 5]]
    # GQA: a second query head with −1; group mean = (a/12 + (12/49)/a) / 2
    ctx.queries = torch.tensor([1.0, -1.0]).view(2, 1, 1).expand(2, 4, 1).contiguous()
    expect = (a / 12 + (1 / a) / (1 / a).sum()) / 2
    assert torch.allclose(pol.score(ctx)[0], expect)
    # ranking: 1 (0.197), 5 (0.166), then 0, 2, 4 tie at 0.164 -> the oldest (0) wins
    assert pol.select(ctx).kept.tolist() == [[0, 1, 5]]


def test_tova_uses_only_the_last_query_row():
    ctx = make_ctx(H=2, G=3, n_cache=30, b=16, budget=20, seed=1)
    pol = TOVAPolicy()
    score, kept = pol.score(ctx), pol.select(ctx).kept
    ctx.queries[:, :-1] = torch.randn_like(ctx.queries[:, :-1]) * 10
    ctx.query_positions = ctx.query_positions.clone()
    assert torch.equal(pol.score(ctx), score)
    assert torch.equal(pol.select(ctx).kept, kept)
    ctx.queries[:, -1] = torch.randn_like(ctx.queries[:, -1]) * 3
    assert not torch.allclose(pol.score(ctx), score)


def test_tova_matches_dense_last_row_group_and_layer():
    ctx = make_ctx(H=2, G=3, n_cache=25, b=9, budget=15, seed=2, scale=0.2)
    ref = last_row_reference(ctx)
    assert torch.allclose(TOVAPolicy().score(ctx), ref.view(2, 3, -1).mean(1), atol=1e-6)
    layer = TOVAPolicy(heads="layer").score(ctx)
    assert torch.allclose(layer, ref.mean(0).expand(2, -1), atol=1e-6)
    kept = TOVAPolicy(heads="layer").select(ctx).kept
    assert torch.equal(kept[0], kept[1])


def test_tova_decode_step_and_no_eviction():
    ctx = make_ctx(H=2, G=2, n_cache=20, b=1, budget=20, seed=3)
    kept = TOVAPolicy().select(ctx).kept
    assert kept.shape == (2, 20)
    ctx.budget = 21
    assert TOVAPolicy().select(ctx).kept.tolist() == [list(range(21))] * 2


def test_tova_check_budget():
    TOVAPolicy().check_budget(1, 128)
    with pytest.raises(PolicyError):
        TOVAPolicy(heads="token").check_budget(64, 128)
    with pytest.raises(PolicyError):
        TOVAPolicy().check_budget(0, 128)


# --------------------------------------------------------------------------- kvpress TOVAPress


def _rope(x, pos, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin, cos, sin


@pytest.mark.parametrize("H,G,n_cache,b,budget", [(2, 3, 0, 50, 20), (1, 4, 0, 30, 12), (3, 2, 40, 16, 30),
                                                  (2, 2, 25, 1, 20)])
def test_tova_matches_kvpress(H, G, n_cache, b, budget):
    """kvpress 0.5.5 TOVAPress.score on the same tensors (its window-attention path, q_proj = identity,
    our queries rotated with the same cos/sin).

    Matches ``heads="layer"``: last-row softmax over all candidates, mean over *all* query heads, one
    set for every KV head. Differs: kvpress replaces the newest token's score by max + 1 (pinning it);
    we score it like any other. So scores agree on all but the last column, and kept sets agree once
    our newest token is pinned the same way. With one KV head, ``group`` and ``layer`` coincide.
    """
    kvpress = pytest.importorskip("kvpress")
    d = 16
    ctx = make_ctx(H=H, G=G, d=d, n_cache=n_cache, b=b, budget=budget, seed=budget + b)
    pre_q = ctx.queries.clone()
    ctx.queries, cos, sin = _rope(pre_q, ctx.query_positions, d)
    module = SimpleNamespace(config=SimpleNamespace(num_attention_heads=H * G, num_key_value_heads=H),
                             head_dim=d, q_proj=lambda x: x)
    hidden = pre_q.transpose(0, 1).reshape(1, b, H * G * d)
    theirs = kvpress.TOVAPress().score(module, hidden, ctx.keys[None], ctx.values[None], None,
                                       {"position_embeddings": (cos[None], sin[None])})[0]
    pol = TOVAPolicy(heads="layer")
    ours = pol.score(ctx)
    assert torch.allclose(ours[:, :-1], theirs[:, :-1], rtol=1e-5, atol=1e-7)
    pinned = ours.clone()
    pinned[:, -1] = float("inf")
    top = torch.topk(theirs, budget, dim=-1).indices
    assert [set(r.tolist()) for r in topk_keep(pinned, budget)] == [set(r.tolist()) for r in top]
    if H == 1:
        assert torch.allclose(TOVAPolicy().score(ctx)[:, :-1], theirs[:, :-1], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- properties


@st.composite
def contexts(draw):
    return make_ctx(H=draw(st.integers(1, 2)), G=draw(st.integers(1, 3)), d=draw(st.sampled_from([1, 4, 8])),
                    n_cache=draw(st.integers(0, 40)), b=draw(st.integers(1, 20)), budget=draw(st.integers(1, 60)),
                    seed=draw(st.integers(0, 10_000)), keys=draw(st.sampled_from(["randn", "zero", "const"])),
                    queries=draw(st.sampled_from(["randn", "zero", "const"])),
                    dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts(), heads=st.sampled_from(["group", "layer"]))
def test_tova_properties(ctx, heads):
    pol = TOVAPolicy(heads=heads)
    score = pol.score(ctx)
    assert score.shape == (ctx.num_kv_heads, ctx.n)
    assert torch.isfinite(score).all()
    kept = pol.select(ctx).kept
    assert kept.shape == (ctx.num_kv_heads, min(ctx.n, ctx.budget))
    assert int(kept.min()) >= 0 and int(kept.max()) < ctx.n
    for row in kept:
        assert len(set(row.tolist())) == row.numel()
        assert row.tolist() == sorted(row.tolist())
