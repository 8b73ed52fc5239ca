"""D2O (edgekv/policies/d2o.py): layer budgets, merge-on-evict, EMA threshold, block-wise runs."""

from __future__ import annotations

import math

import pytest
import torch

from edgekv.engine import BlockEngine
from edgekv.models import tiny_random_model
from edgekv.policies.base import EvictionContext, PolicyError
from edgekv.policies.d2o import STATE, D2OPolicy, allocate_budgets, layer_statistic, merge_into


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model(0, layers=3, heads=4, kv_heads=2, head_dim=16)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def hand_ctx(keys, values, acc, budget, layer=0):
    """One KV head, positions 0..n-1, accumulated scores given."""
    n = len(keys)
    return EvictionContext(
        layer=layer, num_layers=1, budget=budget, keys=torch.tensor(keys, dtype=torch.float32)[None],
        values=torch.tensor(values, dtype=torch.float32)[None], positions=torch.arange(n)[None], n_cache=n,
        state={STATE: torch.tensor(acc, dtype=torch.float32)[None]},
    )


# ---- layer budgets ---------------------------------------------------------------------------
def test_allocation_is_capped_conserved_and_monotone():
    shares = torch.softmax(-torch.tensor([0.0, 0.05, 0.3, 0.9, 1.0]), 0)
    out = allocate_budgets(shares, cap=100, total=400, floor=6)
    assert max(out) <= 100 and sum(out) == 400
    assert out == sorted(out, reverse=True)  # lower variance, larger budget
    assert out[0] == out[1] == 100  # clamped at the cap, the excess went to the others
    assert allocate_budgets(torch.full((4,), 0.25), cap=64, total=160, floor=6) == [40] * 4
    assert allocate_budgets(torch.tensor([0.97, 0.01, 0.01, 0.01]), cap=64, total=100, floor=6) == [64, 12, 12, 12]
    assert allocate_budgets(torch.tensor([0.97, 0.01, 0.01, 0.01]), cap=64, total=40, floor=6) == [22, 6, 6, 6]


def test_layer_statistic_orders_dense_before_sparse():
    n = 32
    dense = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]  # uniform causal rows
    sparse = torch.zeros(n, n)
    sparse[:, 0] = 1.0  # everything on token 0
    head_var = torch.stack([dense.sum(0).var().expand(4), sparse.sum(0).var().expand(4)])  # [L=2, Hq=4]
    sigma = layer_statistic(head_var, "minmax")
    assert sigma.tolist() == pytest.approx([0.0, 1.0])
    policy = D2OPolicy()
    budgets = policy.allocate(head_var, 64)
    assert budgets[0] > budgets[1] and max(budgets) <= 64 and sum(budgets) == int(0.75 * 64 * 2)
    assert policy.allocate(torch.ones(3, 4), 64) == [48] * 3  # equal variances: uniform
    assert layer_statistic(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), "head_minmax").tolist()[1] == 0.0


def test_budgets_hold_in_the_engine(tiny):
    n, budget, block = 150, 32, 16
    policy = D2OPolicy()
    engine = BlockEngine(tiny, policy, budget=budget, block=block, record_kept=True)
    logits = engine.prefill(prompt(n))
    budgets = engine.layer_budgets
    assert budgets == policy.budgets and max(budgets) <= budget
    assert sum(budgets) == int(0.75 * budget * tiny.config.num_layers) and len(set(budgets)) > 1
    for step in engine.stats.steps:
        for layer, kept in enumerate(step.kept_positions):
            assert kept.shape[1] <= budgets[layer]
            for head in kept:
                assert head.unique().numel() == head.numel() and int(head.max()) < step.start + step.length
                if kept.shape[1] == budgets[layer]:  # sinks and the recent window are always kept
                    recent = budgets[layer] // 4
                    top = step.start + step.length
                    assert set(range(4)) | set(range(top - recent, top)) <= set(head.tolist())
    assert engine.cache_lengths() == budgets
    token = int(logits.argmax())
    for _ in range(3):
        token = int(engine.decode(token).argmax())
        assert engine.cache_lengths() == budgets
    assert torch.isfinite(engine.caches[0].keys).all()


def test_prompt_that_fits_is_full_attention(tiny):
    ids = prompt(40, seed=3)
    engine = BlockEngine(tiny, D2OPolicy(), budget=64, block=8)
    logits = torch.cat([engine.prefill(ids, all_logits=True), engine.decode(3)[None], engine.decode(4)[None]])
    assert engine.layer_budgets == [64] * 3 and engine.stats.eviction_events == 0
    hf = tiny.to_hf()
    with torch.no_grad():
        ref = hf(torch.cat([ids, torch.tensor([3, 4])])[None]).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_budget_arguments(tiny):
    with pytest.raises(PolicyError):
        D2OPolicy(avg_ratio=1.5).check_budget(64, 16)
    with pytest.raises(PolicyError):
        D2OPolicy(merge="max").check_budget(64, 16)
    with pytest.raises(PolicyError):
        D2OPolicy(sinks=8).check_budget(8, 16)
    engine = BlockEngine(tiny, D2OPolicy(layers="uniform", avg_ratio=0.5), budget=32, block=16)
    engine.prefill(prompt(80))
    assert engine.layer_budgets == [16] * 3 == engine.cache_lengths()


# ---- token level: merge-on-evict -----------------------------------------------------------------
K = [[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [-1.0, 0.0]]
V = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
ACC = [5.0, 4.0, 1.0, 0.0]  # keep entries 0 and 1; evict 2 (cos 0.8 with 0) and 3 (cos 0 with 1)


@pytest.mark.parametrize("mode", ["weighted", "code", "average"])
def test_merge_on_a_hand_built_case(mode):
    policy = D2OPolicy(sinks=0, recent_ratio=0.0, merge=mode)
    sel = policy.select(hand_ctx(K, V, ACC, budget=2))
    assert sel.kept.tolist() == [[0, 1]]
    assert policy.tau[0] == pytest.approx(0.4)  # first eviction: τ = mean(0.8, 0.0)
    k0, k2, v0, v2 = torch.tensor(K[0]), torch.tensor(K[2]), torch.tensor(V[0]), torch.tensor(V[2])
    if mode == "weighted":  # Eq. 12: (e·x_j + e^u·x_i) / (e + e^u)
        wj, wi = math.e, math.exp(0.8)
        want_k, want_v = (wj * k0 + wi * k2) / (wj + wi), (wj * v0 + wi * v2) / (wj + wi)
    elif mode == "code":  # (x_j + u·x_i) / 2
        want_k, want_v = (k0 + 0.8 * k2) / 2, (v0 + 0.8 * v2) / 2
    else:
        want_k, want_v = (k0 + k2) / 2, (v0 + v2) / 2
    torch.testing.assert_close(sel.keys[0, 0], want_k)
    torch.testing.assert_close(sel.values[0, 0], want_v)
    # Entry 3 (best similarity 0 < τ) is discarded: entry 1 is unchanged.
    torch.testing.assert_close(sel.keys[0, 1], torch.tensor(K[1]))
    torch.testing.assert_close(sel.values[0, 1], torch.tensor(V[1]))


def test_identical_key_merges_to_the_mean_value():
    keys = [[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]  # entry 2 ∥ entry 0: u = 1, weights e / (2e) each
    sel = D2OPolicy(sinks=0, recent_ratio=0.0).select(hand_ctx(keys, V[:3], [3.0, 2.0, 1.0], budget=2))
    torch.testing.assert_close(sel.keys[0, 0], torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(sel.values[0, 0], torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(merge_into(torch.ones(1, 2, 2), torch.ones(1, 1, 2), torch.zeros(1, 1, dtype=torch.long),
                                          torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.bool)), torch.ones(1, 2, 2))


def test_ema_threshold_recursion_and_single_eviction_identity():
    beta = 0.7
    policy = D2OPolicy(sinks=0, recent_ratio=0.0, beta=beta)
    policy.select(hand_ctx(K, V, ACC, budget=2))
    tau = [0.4]
    # Then one eviction at a time (decoding): merge ⇔ m ≥ τ_prev, τ ← β·m + (1 − β)·τ_prev.
    for m in (0.3, 0.5, 0.45, 0.9, -0.2):
        evict = [m, -math.sqrt(1 - m * m)]  # cos m with entry 0, negative with entry 1
        sel = policy.select(hand_ctx([[1.0, 0.0], [0.0, 1.0], evict], V[:3], [5.0, 4.0, 0.0], budget=2))
        merged = sel.keys is not None
        assert merged == (m >= tau[-1])
        tau.append(beta * m + (1 - beta) * tau[-1])
        assert policy.tau[0] == pytest.approx(tau[-1])
        if merged:
            w = math.exp(m)
            torch.testing.assert_close(sel.values[0, 0], (math.e * torch.tensor(V[0]) + w * torch.tensor(V[2])) / (math.e + w))
    assert policy.tau[0] == pytest.approx(tau[-1])
    policy.prepare(prompt(10), None)  # a new prompt resets τ
    assert policy.tau == {}


def test_threshold_and_merge_switches():
    everything = D2OPolicy(sinks=0, recent_ratio=0.0, threshold="none").select(hand_ctx(K, V, ACC, budget=2))
    assert not torch.equal(everything.values[0, 1], torch.tensor(V[1]))  # entry 3 merged into 1 as well
    plain = D2OPolicy(sinks=0, recent_ratio=0.0, merge="none").select(hand_ctx(K, V, ACC, budget=2))
    assert plain.keys is None and plain.values is None and plain.kept.tolist() == [[0, 1]]


def test_sinks_and_recent_are_kept():
    keys = torch.randn(12, 2).tolist()
    acc = [0.0] * 4 + [float(i) for i in range(8)]  # sinks have the lowest scores, recent too
    acc[-1] = acc[-2] = -1.0
    sel = D2OPolicy(sinks=4, recent_ratio=0.25).select(hand_ctx(keys, keys, acc, budget=8))
    assert sel.kept.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11]]


# ---- one block over the whole prompt = the paper's after-prefill D2O ----------------------------
def test_single_block_equals_single_shot_d2o(tiny):
    n, budget, sinks = 48, 20, 4
    x = prompt(n, seed=7)
    policy = D2OPolicy()
    engine = BlockEngine(tiny, policy, budget=budget, block=64)
    engine.prefill(x)
    hf = tiny.to_hf()
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        out = hf(x[None], output_attentions=True, use_cache=True)
    L, H = tiny.config.num_layers, tiny.config.num_kv_heads
    G = tiny.config.num_heads // H
    col = [att[0].sum(1) for att in out.attentions]  # [Hq, n]: whole-prompt column sums
    head_var = torch.stack([c.double().var(-1) for c in col])
    raw = head_var.mean(1)
    shares = torch.softmax(-(raw - raw.min()) / (raw.max() - raw.min()), 0)
    budgets = allocate_budgets(shares, budget, int(0.75 * budget * L), sinks + 2)
    assert engine.layer_budgets == budgets
    for layer in range(L):
        nl, recent = budgets[layer], budgets[layer] // 4
        acc = col[layer].view(H, G, n).mean(1)
        keys, values = out.past_key_values.layers[layer].keys[0], out.past_key_values.layers[layer].values[0]
        plans, all_best = [], []
        for h in range(H):
            pinned = set(range(sinks)) | set(range(n - recent, n))
            rest = sorted((j for j in range(n) if j not in pinned), key=lambda j: (-float(acc[h, j]), j))
            kept = sorted(pinned | set(rest[: nl - len(pinned)]))
            unit = torch.nn.functional.normalize(keys[h], dim=-1)
            matches = []
            for i in (j for j in range(n) if j not in kept):
                sims = [float(unit[i] @ unit[j]) for j in kept]
                best = max(sims)
                matches.append((i, sims.index(best), best))
                all_best.append(best)
            plans.append((kept, matches))
        tau = sum(all_best) / len(all_best)
        assert policy.tau[layer] == pytest.approx(tau, abs=1e-5)
        cache = engine.caches[layer]
        assert cache.length == nl
        for h, (kept, matches) in enumerate(plans):
            assert cache.positions[h, :nl].tolist() == kept
            for slot, j in enumerate(kept):
                group = [(i, u) for i, t, u in matches if t == slot and u >= tau]
                z = math.e + sum(math.exp(u) for _, u in group)
                want_k = (math.e * keys[h, j] + sum(math.exp(u) * keys[h, i] for i, u in group)) / z
                want_v = (math.e * values[h, j] + sum(math.exp(u) * values[h, i] for i, u in group)) / z
                torch.testing.assert_close(cache.keys[h, slot], want_k, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(cache.values[h, slot], want_v, rtol=1e-4, atol=1e-4)


# ---- the real model ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.realmodel
def test_d2o_smollm2_2k_blockwise(smol):
    import pydoc_data.topics as topics

    model = smol
    text = " ".join(list(topics.topics.values())[:40])
    ids = torch.tensor(model.tokenizer.encode(text)[:2048])
    assert ids.numel() == 2048
    policy = D2OPolicy()
    engine = BlockEngine(model, policy, budget=256, block=128)
    logits = engine.prefill(ids)
    assert torch.isfinite(logits).all()
    budgets = engine.layer_budgets
    assert max(budgets) <= 256 and sum(budgets) == int(0.75 * 256 * model.config.num_layers)
    assert engine.cache_lengths() == budgets
    assert len(policy.tau) == model.config.num_layers
    token = int(logits.argmax())
    for _ in range(4):
        logits = engine.decode(token)
        assert torch.isfinite(logits).all()
        token = int(logits.argmax())
    assert engine.cache_lengths() == budgets
    for cache in engine.caches:
        assert torch.isfinite(cache.keys[:, : cache.length]).all() and torch.isfinite(cache.values[:, : cache.length]).all()
