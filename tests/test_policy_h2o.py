"""H2O: chunked column sums vs the full matrix, hand-checked accumulation over two steps, the recent
window, the observe/select contract, a partial kvpress cross-check, hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekv.policies.attention_rows import attention_column_sums
from policy_contexts import make_ctx as shared_make_ctx

from edgekv.policies.base import EvictionContext, PolicyError
from edgekv.policies.h2o import STATE, H2OPolicy


def make_ctx(**kwargs) -> EvictionContext:
    kwargs.setdefault("state_names", (STATE,))
    return shared_make_ctx(**kwargs)


def full_attention(ctx):
    """Dense [Hq, b, n] reference: repeated K, causal-by-position mask, torch.softmax."""
    G = ctx.queries.shape[0] // ctx.num_kv_heads
    k = ctx.keys.float().repeat_interleave(G, 0)
    pos = ctx.positions.repeat_interleave(G, 0)
    scale = ctx.scale if ctx.scale is not None else 1 / math.sqrt(ctx.head_dim)
    logits = torch.einsum("hrd,hnd->hrn", ctx.queries.float(), k) * scale
    return torch.softmax(logits.masked_fill(pos[:, None, :] > ctx.query_positions[None, :, None], -math.inf), -1)


@pytest.mark.parametrize("chunk", [1, 3, 32, 1000])
def test_column_sums_match_full_matrix(chunk):
    ctx = make_ctx(H=2, G=3, n_cache=20, b=37, seed=chunk)
    sums = attention_column_sums(ctx.keys, ctx.positions, ctx.queries, ctx.query_positions, row_chunk=chunk)
    assert torch.allclose(sums, full_attention(ctx).sum(1), atol=1e-5)
    assert torch.allclose(sums.sum(-1), torch.full((6,), 37.0), atol=1e-4)  # every row sums to 1


def log_weight_ctx(weights, positions, n_cache, budget, state):
    a = torch.tensor(weights, dtype=torch.float32)
    n = len(weights)
    keys = torch.log(a).view(1, n, 1)
    return EvictionContext(layer=0, num_layers=1, budget=budget, keys=keys, values=keys.clone(),
                           positions=torch.tensor(positions).view(1, n), n_cache=n_cache,
                           queries=torch.ones(1, n - n_cache, 1), query_positions=torch.tensor(positions[n_cache:]),
                           scale=1.0, state={STATE: state})


def test_h2o_hand_checked_two_steps():
    # step 1: block = positions 0..3, a = [1, 2, 1, 4]; rows: [1], [1,2]/3, [1,2,1]/4, [1,2,1,4]/8
    ctx = log_weight_ctx([1, 2, 1, 4], [0, 1, 2, 3], 0, budget=2, state=torch.zeros(1, 4))
    pol = H2OPolicy()  # recent = ⌊2 · 0.5⌋ = 1
    pol.observe(ctx)
    assert torch.allclose(ctx.state[STATE], torch.tensor([[41, 34, 9, 12]]) / 24)
    kept = pol.select(ctx).kept
    assert kept.tolist() == [[0, 3]]  # position 3 is the recent one, 0 the heaviest of the rest
    assert H2OPolicy(recent_ratio=0.0).select(ctx).kept.tolist() == [[0, 1]]
    assert H2OPolicy(recent_ratio=1.0).select(ctx).kept.tolist() == [[2, 3]]
    # the engine gathers the state with the kept indices and appends zeros for the new block
    carried = ctx.state[STATE][:, kept[0]]
    # step 2: cache {0 (a=1), 3 (a=4)} ⊕ block positions 4, 5 (a = 1, 1)
    ctx2 = log_weight_ctx([1, 4, 1, 1], [0, 3, 4, 5], 2, budget=2, state=torch.cat([carried, torch.zeros(1, 2)], 1))
    pol.observe(ctx2)
    # rows: q4 -> [1,4,1]/6, q5 -> [1,4,1,1]/7
    expect = torch.tensor([[41 / 24 + 13 / 42, 12 / 24 + 52 / 42, 13 / 42, 6 / 42]])
    assert torch.allclose(ctx2.state[STATE], expect)
    # position 0 (2.02) still outweighs position 3 (1.74) and 4 (0.31); 5 is the recent one
    assert pol.select(ctx2).kept.tolist() == [[0, 3]]
    # without the recent slot: 0 and 3, the block's own tokens lose (low sums: H2O favours old tokens)
    assert H2OPolicy(recent_ratio=0.0).select(ctx2).kept.tolist() == [[0, 1]]


def test_h2o_state_accumulates_across_steps():
    pol = H2OPolicy(recent_ratio=0.25)
    ctx = make_ctx(H=2, G=2, n_cache=0, b=24, budget=16, seed=1)
    pol.observe(ctx)
    first = ctx.state[STATE].clone()
    assert torch.allclose(first, full_attention(ctx).sum(1).view(2, 2, -1).mean(1), atol=1e-5)
    kept = pol.select(ctx).kept
    # next step: the kept entries (with their sums) ⊕ a new block of 8
    gen = torch.Generator().manual_seed(2)
    carried_keys = torch.gather(ctx.keys, 1, kept[..., None].expand(-1, -1, 8))
    carried_pos = torch.gather(ctx.positions, 1, kept)
    carried_acc = torch.gather(ctx.state[STATE], 1, kept)
    keys = torch.cat([carried_keys, torch.randn(2, 8, 8, generator=gen)], 1)
    pos = torch.cat([carried_pos, torch.arange(24, 32).expand(2, 8)], 1)
    ctx2 = EvictionContext(layer=0, num_layers=1, budget=16, keys=keys, values=keys.clone(), positions=pos,
                           n_cache=16, queries=torch.randn(4, 8, 8, generator=gen), query_positions=torch.arange(24, 32),
                           state={STATE: torch.cat([carried_acc, torch.zeros(2, 8)], 1)})
    pol.observe(ctx2)
    step2 = full_attention(ctx2).sum(1).view(2, 2, -1).mean(1)
    assert torch.allclose(ctx2.state[STATE][:, :16], carried_acc + step2[:, :16], atol=1e-5)
    assert torch.allclose(ctx2.state[STATE][:, 16:], step2[:, 16:], atol=1e-5)
    # observing the same step again adds the same increment again (pure accumulation, in place)
    state = ctx2.state[STATE]
    pol.observe(ctx2)
    assert ctx2.state[STATE] is state
    assert torch.allclose(state, torch.cat([carried_acc, torch.zeros(2, 8)], 1) + 2 * step2, atol=1e-5)


def test_h2o_recent_window_is_kept():
    ctx = make_ctx(H=2, G=2, n_cache=40, b=16, budget=24, seed=5)
    pol = H2OPolicy()
    pol.observe(ctx)
    kept = pol.select(ctx).kept
    for h in range(2):
        newest = torch.sort(ctx.positions[h], descending=True).values[:12]
        assert set(newest.tolist()) <= set(ctx.positions[h, kept[h]].tolist())
    # recent window larger than the block reaches back into the cache (highest positions per head)
    pol = H2OPolicy(recent_ratio=1.0)
    kept = pol.select(ctx).kept
    for h in range(2):
        assert sorted(ctx.positions[h, kept[h]].tolist()) == sorted(ctx.positions[h].tolist())[-24:]


def test_h2o_contract_errors():
    ctx = make_ctx(budget=4)
    del ctx.state[STATE]
    with pytest.raises(PolicyError, match="observe"):
        H2OPolicy().select(ctx)
    ctx.state[STATE] = torch.zeros(2, 3)
    with pytest.raises(PolicyError, match="shape"):
        H2OPolicy().observe(ctx)
    with pytest.raises(PolicyError):
        H2OPolicy(recent_ratio=1.5).check_budget(64, 128)
    H2OPolicy().check_budget(1, 128)


def test_h2o_without_state_starts_from_zero():
    ctx = make_ctx(budget=6)
    ctx.state = {}
    H2OPolicy().observe(ctx)
    assert ctx.state[STATE].shape == (2, ctx.n)
    assert H2OPolicy().select(ctx).kept.shape == (2, 6)


def test_h2o_matches_kvpress_observed_attention_column_sums():
    """Partial cross-check with kvpress 0.5.5 ObservedAttentionPress (one-shot prefill, attentions from
    transformers' eager attention): it divides each column sum by the number of queries that saw the
    token (n − j) and group-averages. So ours[:, j] / (n − j) must equal its score; H2O itself keeps the
    un-normalised sums, so the kept sets differ by design."""
    kvpress = pytest.importorskip("kvpress")
    from transformers.models.llama.modeling_llama import eager_attention_forward

    ctx = make_ctx(H=2, G=3, n_cache=0, b=40, seed=8)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    module.eval()
    n = ctx.n
    mask = torch.full((n, n), -math.inf).triu(1)[None, None]
    _, attn = eager_attention_forward(module, ctx.queries[None], ctx.keys[None], ctx.values[None], mask, 1 / math.sqrt(8))
    theirs = kvpress.ObservedAttentionPress().score(module, None, ctx.keys[None], ctx.values[None], attn, {})[0]
    pol = H2OPolicy()
    pol.observe(ctx)
    assert torch.allclose(ctx.state[STATE] / torch.arange(n, 0, -1), theirs, atol=1e-6)


@st.composite
def contexts(draw):
    return make_ctx(H=draw(st.integers(1, 2)), G=draw(st.integers(1, 3)), d=draw(st.sampled_from([1, 4, 8])),
                    n_cache=draw(st.integers(0, 40)), b=draw(st.integers(1, 20)), budget=draw(st.integers(1, 60)),
                    seed=draw(st.integers(0, 10_000)), keys=draw(st.sampled_from(["randn", "zero", "const"])),
                    queries=draw(st.sampled_from(["randn", "zero", "const"])),
                    dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts(), ratio=st.sampled_from([0.0, 0.25, 0.5, 1.0]), steps=st.integers(1, 2))
def test_h2o_properties(ctx, ratio, steps):
    pol = H2OPolicy(recent_ratio=ratio)
    for _ in range(steps):
        pol.observe(ctx)
    acc = ctx.state[STATE]
    assert torch.isfinite(acc).all() and (acc >= 0).all()
    assert abs(float(acc.sum()) - steps * ctx.queries.shape[1] * ctx.num_kv_heads) < 1e-3 * ctx.n + 1e-3
    kept = pol.select(ctx).kept
    assert kept.shape == (ctx.num_kv_heads, min(ctx.n, ctx.budget))
    assert int(kept.min()) >= 0 and int(kept.max()) < ctx.n
    for h, row in enumerate(kept):
        assert len(set(row.tolist())) == row.numel()
        if ctx.must_evict:
            recent = pol.recent_size(ctx.budget)
            newest = torch.sort(ctx.positions[h], descending=True).values[:recent]
            assert set(newest.tolist()) <= set(ctx.positions[h, row].tolist())
