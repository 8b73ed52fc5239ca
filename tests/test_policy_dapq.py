"""DapQ (edgekv/policies/dapq.py): pseudo tokens, causality, single-shot reduction, block-wise runs."""

from __future__ import annotations

import pytest
import torch

from edgekv.engine import BlockEngine
from edgekv.models import tiny_random_model
from edgekv.policies.base import Policy, PolicyError, Selection
from edgekv.policies.dapq import DapQPolicy, dapq_scores, pseudo_token_ids


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model(0, layers=2, heads=4, kv_heads=2, head_dim=16)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


class Recording(DapQPolicy):
    """DapQ that records what each eviction saw and answered."""

    def __post_init__(self):
        super().__post_init__()
        self.calls = []

    def select(self, ctx):
        sel = super().select(ctx)
        self.calls.append(dict(
            layer=ctx.layer, n=ctx.n, kept=sel.kept.clone(), positions=ctx.positions.clone(),
            extra_pos=None if ctx.extra_query_positions is None else ctx.extra_query_positions.clone(),
            score=self.score(ctx) if ctx.must_evict else None,
        ))
        return sel


class Replay(Policy):
    """Answers with previously recorded selections, in order; never asks for pseudo rows."""

    name = "replay"

    def __init__(self, selections):
        self.selections = list(selections)

    def select(self, ctx):
        return Selection(kept=self.selections.pop(0))


# ---- pseudo tokens ---------------------------------------------------------------------------
def test_pseudo_tokens_are_prefix_suffix_at_decoding_positions():
    x = prompt(100)
    p = DapQPolicy()
    p.prepare(x, None)
    ids, pos = p.extra_tokens()
    assert torch.equal(ids, torch.cat([x[:4], x[100 - 28 :]]))
    assert torch.equal(pos, torch.arange(100, 132))
    assert p.max_extra_tokens == 32
    short = prompt(10)
    assert torch.equal(pseudo_token_ids(short, 32, 4), torch.cat([short[:4], short]))
    assert torch.equal(pseudo_token_ids(x, 8, 0), x[-8:])
    assert DapQPolicy().extra_tokens() is None  # before prepare(): no pseudo rows


def test_arguments_are_checked():
    for bad in (dict(window=0), dict(prefix=40), dict(positions="x"), dict(softmax_over="x"), dict(kernel=2),
                dict(keep_recent=64)):
        with pytest.raises(PolicyError):
            DapQPolicy(**bad).check_budget(64, 16)


# ---- causality: pseudo rows change nothing but the selection -------------------------------------
def test_pseudo_rows_leave_prompt_kv_and_first_logits_unchanged(tiny):
    x = prompt(40)
    policy = DapQPolicy(window=8, prefix=2)
    policy.prepare(x, None)
    with_extra = BlockEngine(tiny, policy, budget=200, block=64)
    plain = BlockEngine(tiny, DapQPolicy(window=8, prefix=2), budget=200, block=64)
    logits_a = with_extra.step(x, extra=policy.extra_tokens())  # nothing evicted: pseudo rows dropped
    logits_b = plain.step(x)
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-5, atol=1e-5)
    for ca, cb in zip(with_extra.caches, plain.caches):
        assert ca.length == cb.length == 40
        torch.testing.assert_close(ca.keys[:, :40], cb.keys[:, :40], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ca.values[:, :40], cb.values[:, :40], rtol=1e-5, atol=1e-5)
        assert torch.equal(ca.positions[:, :40], cb.positions[:, :40])
    hf = tiny.to_hf()
    with torch.no_grad():
        ref = hf(x[None]).logits[0, -1]
    torch.testing.assert_close(logits_a, ref, rtol=1e-4, atol=1e-4)


def test_pseudo_rows_only_change_the_selection(tiny):
    """Replaying DapQ's kept sets without pseudo rows gives the same caches and logits: the pseudo
    rows never leak into real tokens, and the first token comes from the last real row."""
    x = prompt(150, seed=1)
    dapq = Recording(window=8, prefix=2)
    a = BlockEngine(tiny, dapq, budget=32, block=16)
    logits_a = a.prefill(x)
    assert a.stats.eviction_events > 0
    b = BlockEngine(tiny, Replay([c["kept"] for c in dapq.calls]), budget=32, block=16)
    logits_b = b.prefill(x)
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)
    for ca, cb in zip(a.caches, b.caches):
        assert ca.length == cb.length
        assert torch.equal(ca.positions[:, : ca.length], cb.positions[:, : cb.length])
        torch.testing.assert_close(ca.keys[:, : ca.length], cb.keys[:, : cb.length], rtol=1e-4, atol=1e-4)


def test_no_pseudo_kv_stays_in_the_cache(tiny):
    n, budget, block, w = 150, 32, 16, 8
    x = prompt(n, seed=2)
    policy = Recording(window=w, prefix=2)
    engine = BlockEngine(tiny, policy, budget=budget, block=block, record_kept=True)
    logits = engine.prefill(x)
    assert engine.capacity == budget + block + w
    for step in engine.stats.steps:
        for kept in step.kept_positions:
            assert kept.shape[1] <= budget
            assert int(kept.max()) < step.start + step.length <= n  # no position ≥ n, no pseudo row
            for head in kept:
                assert head.unique().numel() == head.numel()
    evicting = [c for c in policy.calls if c["extra_pos"] is not None]
    assert evicting and all(torch.equal(c["extra_pos"], torch.arange(n, n + w)) for c in evicting)
    # Decoding continues at position n and keeps the cache at N (observer = the real decoding query).
    token = int(logits.argmax())
    for t in range(3):
        token = int(engine.decode(token).argmax())
        for layer in range(tiny.config.num_layers):
            kept = engine.kept_positions(layer)
            assert kept.shape[1] == budget and int(kept.max()) <= n + t
    assert policy.calls[-1]["extra_pos"] is None


def test_block_aligned_positions_follow_the_block(tiny):
    n, block, w = 90, 16, 4
    policy = Recording(window=w, prefix=1, positions="block")
    BlockEngine(tiny, policy, budget=24, block=block).prefill(prompt(n, seed=3))
    seen = {int(c["extra_pos"][0]) for c in policy.calls if c["extra_pos"] is not None}
    assert seen == {min(s + block, n) for s in range(16, n, block)}


def test_score_sanity_and_softmax_domain(tiny):
    torch.manual_seed(0)
    keys, pk = torch.randn(2, 20, 16), torch.randn(2, 5, 16)
    pos = torch.arange(20)[None].expand(2, -1)
    q, qpos = torch.randn(4, 5, 16), torch.arange(20, 25)
    prompt_only = dapq_scores(keys, pos, q, qpos)
    with_pseudo = dapq_scores(keys, pos, q, qpos, pk)
    torch.testing.assert_close(prompt_only.sum(-1), torch.full((4,), 5.0))  # Σ_j S_j = w
    assert bool((with_pseudo.sum(-1) < 5.0).all()) and bool((with_pseudo >= 0).all())
    assert bool((with_pseudo <= prompt_only + 1e-6).all())


# ---- one block over the whole prompt = the paper's single-shot DapQ ---------------------------
@pytest.mark.parametrize("softmax_over", ["prompt+pseudo", "prompt"])
def test_single_block_equals_single_shot_dapq(tiny, softmax_over):
    n, budget, w, a = 60, 20, 8, 2
    x = prompt(n, seed=4)
    policy = Recording(window=w, prefix=a, softmax_over=softmax_over, kernel=1)  # the paper: no pooling
    engine = BlockEngine(tiny, policy, budget=budget, block=128, record_kept=True)
    logits = engine.prefill(x)
    # Direct single-shot computation with HF's own forward over [prompt, pseudo] at positions 0..n+w-1.
    pseudo = torch.cat([x[:a], x[n - (w - a) :]])
    hf = tiny.to_hf()
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        out = hf(torch.cat([x, pseudo])[None], position_ids=torch.arange(n + w)[None], output_attentions=True)
        plain = hf(x[None]).logits[0, -1]
    groups = tiny.config.num_heads // tiny.config.num_kv_heads
    for layer, att in enumerate(out.attentions):
        rows = att[0, :, n:, :]  # [Hq, w, n + w]: only the pseudo rows
        if softmax_over == "prompt":  # renormalise over the prompt columns
            rows = rows[:, :, :n] / rows[:, :, :n].sum(-1, keepdim=True)
        score = rows[:, :, :n].sum(1).view(tiny.config.num_kv_heads, groups, n).mean(1)
        expect = torch.sort(torch.topk(score, budget, dim=-1).indices, dim=-1).values
        call = policy.calls[layer]
        torch.testing.assert_close(call["score"], score, rtol=1e-4, atol=1e-5)
        assert torch.equal(engine.kept_positions(layer).long(), expect)
    # The first output token comes from the last real row: the full-cache logits.
    torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)


def test_pooling_and_recent_switches(tiny):
    x = prompt(100, seed=5)
    engine = BlockEngine(tiny, DapQPolicy(window=8, kernel=5, pooling="max", keep_recent=6), budget=24, block=32)
    engine.prefill(x)
    for layer in range(tiny.config.num_layers):
        kept = engine.kept_positions(layer)
        assert kept.shape[1] == 24
        assert bool((kept[:, -6:] == torch.arange(94, 100, dtype=kept.dtype)).all())


# ---- the real model ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.realmodel
def test_dapq_smollm2_2k_blockwise(smol):
    import pydoc_data.topics as topics

    model = smol
    text = " ".join(list(topics.topics.values())[:40])
    ids = torch.tensor(model.tokenizer.encode(text)[:2048])
    assert ids.numel() == 2048
    policy = DapQPolicy()
    engine = BlockEngine(model, policy, budget=256, block=128)
    logits = engine.prefill(ids)
    assert torch.isfinite(logits).all()
    assert engine.stats.eviction_events == 2048 // 128 - 2
    assert engine.cache_lengths() == [256] * model.config.num_layers
    for layer in range(model.config.num_layers):
        assert int(engine.kept_positions(layer).max()) < 2048
    token = int(logits.argmax())
    for _ in range(4):
        logits = engine.decode(token)
        assert torch.isfinite(logits).all()
        token = int(logits.argmax())
    assert max(engine.cache_lengths()) == 256
