"""Properties every registered policy obeys inside the engine (DESIGN: invariants)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekv.engine import BlockEngine
from edgekv.models import tiny_random_model
from edgekv.policies import EvictionContext, make_policy, policy_names

MODEL = tiny_random_model(5, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=97)
EVICTING = [p for p in policy_names() if p != "full"]


def small_budget_args(name: str, budget: int) -> dict:
    """Arguments that let each policy run at the small budgets of these tests."""
    return {"lagkv": {"sinks": "2", "lag": "4"}, "snapkv": {"window": "4"}, "snapkv++": {"window": "4"},
            "rocketkv": {"window": "4"}, "dapq": {"window": "4"}}.get(name, {})


def lossless_args(name: str, budget: int) -> dict:
    """``small_budget_args``; rocketkv's stage 2 is sparse decode attention by design (approximate
    even when nothing is evicted), so it is exactly full attention only when its top-k covers every
    row a decode step attends over (N + the new token); its sparse decoding is tested in
    tests/test_rocketkv.py."""
    extra = {"topk": str(budget + 1)} if name == "rocketkv" else {}
    return {**small_budget_args(name, budget), **extra}


@pytest.mark.parametrize("name", policy_names())
def test_lossless_when_budget_covers_everything(name):
    ids = torch.randint(0, 97, (40,))
    ref = BlockEngine(MODEL, make_policy("full"), budget=64, block=8)
    eng = BlockEngine(MODEL, make_policy(name, lossless_args(name, 64)), budget=64, block=8)
    a = torch.cat([ref.prefill(ids, all_logits=True), ref.decode(3)[None], ref.decode(4)[None]])
    b = torch.cat([eng.prefill(ids, all_logits=True), eng.decode(3)[None], eng.decode(4)[None]])
    assert torch.allclose(a, b, atol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(EVICTING), budget=st.integers(24, 40), block=st.sampled_from([8, 11, 16]),
       length=st.integers(41, 90), decode=st.integers(0, 3))
def test_budget_and_valid_distinct_indices(name, budget, block, length, decode):
    engine = BlockEngine(MODEL, make_policy(name, small_budget_args(name, budget)), budget, block, record_kept=True)
    engine.prefill(torch.randint(0, 97, (length,)))
    for t in range(decode):
        engine.decode(t)
    seen = 0
    for step in engine.stats.steps:
        seen = step.start + step.length
        for layer, kept in enumerate(step.kept_positions):
            assert kept.shape[1] <= engine.layer_budgets[layer] <= budget
            for head in kept:
                values = head.tolist()
                assert len(set(values)) == len(values)
                assert all(0 <= p < seen for p in values)
    assert engine.stats.eviction_events > 0


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_no_nan_on_constant_or_zero_keys(name, fill):
    policy = make_policy(name, small_budget_args(name, 8))
    h, hq, n, d, b = 2, 4, 20, 8, 6
    keys = torch.full((h, n, d), fill)
    ctx = EvictionContext(
        layer=0, num_layers=2, budget=8, keys=keys, values=keys.clone(),
        positions=torch.arange(n, dtype=torch.int32).expand(h, n).contiguous(), n_cache=n - b,
        queries=torch.full((hq, b, d), fill), query_positions=torch.arange(n - b, n),
        extra_queries=torch.full((hq, 4, d), fill), extra_query_positions=torch.arange(n, n + 4),
        state={s: torch.zeros(h, n) for s in policy.entry_state}, scale=d ** -0.5,
    )
    if policy.observes_every_step:
        policy.observe(ctx)
    sel = policy.select(ctx)
    assert sel.kept.shape == (h, 8)
    for head in sel.kept:
        assert len(set(head.tolist())) == 8
    for t in (sel.keys, sel.values):
        assert t is None or torch.isfinite(t).all()
