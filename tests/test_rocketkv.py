"""RocketKV (issue 17), eager engine: stage 1 is SnapKV++ unchanged, stage 2 replaces each decode
step's attention by exact attention over the top-k rows of an approximate score read from page-wise
min / max key summaries (digest shared/research/seed-rocketkv.md §3, checklist §9.1 items 8–13).

Checked here: k ≥ the cache length is dense attention exactly (logits bit-equal to snapkv++ at the same
budget, every decode step); the summaries equal a recomputation from the cache after every step
(prefill blocks, evicting and non-evicting decode, partial last pages) and a decode step changes only
the page its token lands in; the selected rows are valid, distinct, min(k, fill) of them, and are
what a naive per-head re-implementation of the paper's pseudocode selects; the Quest bound, the
p = 1 / r = d degenerate case, group sharing; the traffic split; bad arguments
and `edgekv run --policy rocketkv`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from edgekv.engine import BlockEngine
from edgekv.engine.cache import LayerCache
from edgekv.models import tiny_random_model
from edgekv.policies import PolicyError, make_policy
from edgekv.policies.rocketkv import (PageSummaries, RocketKVPolicy, approximate_page_scores, page_minmax,
                                      select_channels, stage2_plan, token_weights)

N, B = 16, 8
MODEL = tiny_random_model(3, layers=2)  # 4 query heads over 2 KV heads (G = 2), head dim 16
PROMPT = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(7))


def decode_run(engine, steps, tokens=None):
    """Prefill PROMPT, then ``steps`` decode steps fed ``tokens`` (default: greedy); yields
    (logits, engine) after the prefill and after every decode step."""
    logits = engine.prefill(PROMPT)
    yield logits, engine
    for t in range(steps):
        token = tokens[t] if tokens is not None else int(logits.argmax())
        logits = engine.decode(token)
        yield logits, engine


def greedy_tokens(name, args, steps, budget=N, model=MODEL):
    out, logits = [], None
    for logits, _ in decode_run(BlockEngine(model, make_policy(name, args), budget, B), steps - 1):
        out.append(int(logits.argmax()))
    return out


# ---- stage 2 with k ≥ the cache length is dense attention exactly ------------------------------------

@pytest.mark.parametrize("budget", [N, 64])  # evicting at every decode step / never evicting
def test_topk_covering_the_cache_equals_snapkvpp_exactly(budget):
    steps = 8
    tokens = greedy_tokens("snapkv++", {"window": "4"}, steps, budget)
    ref = decode_run(BlockEngine(MODEL, make_policy("snapkv++", {"window": "4"}), budget, B), steps, tokens)
    rk = BlockEngine(MODEL, make_policy("rocketkv", {"window": "4", "topk": str(budget + 1)}), budget, B)
    for (want, eng_ref), (got, eng) in zip(ref, decode_run(rk, steps, tokens)):  # in lockstep
        assert torch.equal(got, want)
        assert eng.cache_lengths() == eng_ref.cache_lengths()
        for layer in range(MODEL.config.num_layers):
            assert torch.equal(eng.kept_positions(layer), eng_ref.kept_positions(layer))
    policy = rk.policy
    for layer in range(MODEL.config.num_layers):  # every row was selected
        n = policy.last_fill[layer]
        assert torch.equal(policy.last_selected[layer], torch.arange(n).expand(MODEL.config.num_kv_heads, n))


def test_sparse_decoding_changes_only_decode():
    """With the default (sparse) plan the prompt still attends densely — prefill logits and kept sets
    equal snapkv++'s — and decoding differs: stage 2 is on."""
    tokens = greedy_tokens("snapkv++", {"window": "4"}, 6)
    ref = list(decode_run(BlockEngine(MODEL, make_policy("snapkv++", {"window": "4"}), N, B), 6, tokens))
    got = list(decode_run(BlockEngine(MODEL, make_policy("rocketkv", {"window": "4"}), N, B), 6, tokens))
    assert torch.equal(got[0][0], ref[0][0])
    assert all(torch.isfinite(lg).all() for lg, _ in got)
    assert any(not torch.allclose(a, b, atol=1e-4) for (a, _), (b, _) in zip(got[1:], ref[1:]))
    plan = got[-1][1].policy.plan(N, MODEL.config.head_dim)
    assert plan.topk < N  # the default plan really is sparse at this budget


# ---- the summaries -------------------------------------------------------------------------------

def assert_summaries_current(engine):
    policy = engine.policy
    for layer, cache in enumerate(engine.caches):
        s = policy.summaries(layer)
        n = cache.length
        assert s is not None and s.rows == n
        lo, hi = page_minmax(cache.keys[:, :n], s.page)
        pages = lo.shape[-1]
        assert torch.equal(s.kmin[:, :, :pages], lo) and torch.equal(s.kmax[:, :, :pages], hi)
        assert torch.isposinf(s.kmin[:, :, pages:]).all() and torch.isneginf(s.kmax[:, :, pages:]).all()


@pytest.mark.parametrize("budget,page", [(N, 3), (N, 5), (64, 3), (64, 4)])
def test_summaries_equal_a_recomputation_after_every_step(budget, page):
    """Pages of 3 / 5 rows leave a partial last page at most fills (the fill boundary); N = 16 evicts
    in the prefill and at every decode step (rebuilds), N = 64 never (only appends)."""
    engine = BlockEngine(MODEL, make_policy("rocketkv", {"window": "4", "page": str(page)}), budget, B)
    logits = engine.prefill(PROMPT[:8])  # one block, no eviction yet
    assert_summaries_current(engine)
    for start in range(8, PROMPT.numel(), B):
        logits = engine.step(PROMPT[start: start + B])
        assert_summaries_current(engine)
    fills = set()
    for _ in range(10):
        logits = engine.decode(int(logits.argmax()))
        assert_summaries_current(engine)
        fills.add(engine.caches[0].length % page)
    assert len(fills) > 1 or budget == N  # the growing cache crossed page boundaries


def test_a_decode_step_changes_only_the_page_of_its_token():
    engine = BlockEngine(MODEL, make_policy("rocketkv", {"window": "4", "page": "3"}), 64, B)
    logits = engine.prefill(PROMPT[:20])
    for _ in range(6):
        before = [(s.kmin.clone(), s.kmax.clone()) for s in (engine.policy.summaries(i) for i in range(2))]
        logits = engine.decode(int(logits.argmax()))
        for layer, (lo, hi) in enumerate(before):
            s = engine.policy.summaries(layer)
            changed = ((s.kmin != lo) | (s.kmax != hi)).any(dim=(0, 1)).nonzero().flatten().tolist()
            assert set(changed) <= {(engine.caches[layer].length - 1) // 3}
        assert_summaries_current(engine)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_decode_with_room_folds_and_never_rebuilds(kv_dtype, monkeypatch):
    """With room in the cache a decode step folds its one row in; an int8 cache (which dequantises
    on every read) must not turn that into a rebuild per step."""
    from edgekv.policies.rocketkv import PageSummaries

    engine = BlockEngine(MODEL, make_policy("rocketkv", {"window": "4", "page": "3"}), 64, B, kv_dtype=kv_dtype)
    logits = engine.prefill(PROMPT[:20])
    rebuilds = []
    original = PageSummaries.rebuild
    monkeypatch.setattr(PageSummaries, "rebuild", lambda self, keys, n: (rebuilds.append(n), original(self, keys, n)))
    for _ in range(6):
        logits = engine.decode(int(logits.argmax()))
        assert_summaries_current(engine)
    assert rebuilds == []


def test_fidelity_teacher_forces_a_sparse_decoder_through_decode():
    """The fidelity trace of rocketkv scores its window as decode would run it (stage 2 included),
    one token at a time; snapkv++'s keeps the chunked path."""
    from edgekv.evaluation.fidelity import run_trace

    args = {"window": "4", "page": "3", "topk": "4"}
    trace = run_trace(BlockEngine(MODEL, make_policy("rocketkv", args), N, B), PROMPT, 30, 0)
    engine = BlockEngine(MODEL, make_policy("rocketkv", args), N, B)
    want = [engine.prefill(PROMPT[:30])] + [engine.decode(int(t)) for t in PROMPT[30:-1]]
    assert torch.equal(trace.logits, torch.stack(want))
    assert make_policy("rocketkv").replaces_decode_attention()
    assert not make_policy("snapkv++").replaces_decode_attention()


def test_summaries_follow_a_new_cache_buffer():
    """A reset engine or a loaded snapshot brings new key buffers: the summaries rebuild from them."""
    engine = BlockEngine(MODEL, make_policy("rocketkv", {"window": "4"}), N, B)
    engine.prefill(PROMPT)
    engine.reset()
    logits = engine.prefill(PROMPT[:20])
    engine.decode(int(logits.argmax()))
    assert_summaries_current(engine)


@settings(max_examples=40, deadline=None)
@given(page=st.integers(1, 6), chunks=st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_incremental_summaries_equal_recomputation(page, chunks, seed):
    """Appends of any size, and compactions (a random subset of rows moved to the front, as the
    engine's eviction does), keep PageSummaries equal to page_minmax of the live rows."""
    g = torch.Generator().manual_seed(seed)
    cache = LayerCache(2, 48, 4)
    s = PageSummaries(cache.keys, page)
    for size, compact in chunks:
        n = cache.length
        if n + size > cache.capacity:
            break
        cache.write(n, torch.randn(2, size, 4, generator=g), torch.zeros(2, size, 4), torch.arange(n, n + size))
        cache.length = n + size
        s.append(cache.keys, cache.length)
        if compact:
            keep = torch.sort(torch.randperm(cache.length, generator=g)[: max(1, cache.length // 2)]).values
            cache.keys[:, : keep.numel()] = cache.keys[:, keep].clone()
            cache.length = keep.numel()
            s.rebuild(cache.keys, cache.length)
        lo, hi = page_minmax(cache.keys[:, : cache.length], page)
        assert torch.equal(s.kmin[:, :, : lo.shape[-1]], lo) and torch.equal(s.kmax[:, :, : hi.shape[-1]], hi)


# ---- the selection -------------------------------------------------------------------------------

def naive_selection(q, keys, page, channels, topk):
    """The paper's pseudocode (digest §3.2) one KV head, one query head, one page at a time."""
    heads, n, d = keys.shape
    groups = q.shape[0] // heads
    out = []
    for j in range(heads):
        qs = q[j * groups:(j + 1) * groups]
        magnitude, signed = qs.abs().sum(0), qs.sum(0)
        chosen = sorted(range(d), key=lambda i: (-float(magnitude[i]), i))[:channels]
        weights = torch.zeros(n, dtype=q.dtype)
        for g in range(groups):
            page_scores = []
            for start in range(0, n, page):
                rows = keys[j, start: start + page]
                page_scores.append(sum(float(qs[g, i]) * float(rows[:, i].max() if signed[i] > 0 else rows[:, i].min())
                                       for i in chosen))
            tau = math.sqrt(d * float(qs[g, chosen].abs().sum()) / float(qs[g].abs().sum()))
            per_token = torch.tensor([page_scores[t // page] for t in range(n)], dtype=q.dtype)
            weights += torch.softmax(per_token / tau, dim=0)
        order = sorted(range(n), key=lambda t: (-float(weights[t]), t))[:topk]
        out.append(sorted(order))
    return torch.tensor(out)


def randn64(generator, *shape):
    """float64 tensors: the naive and vectorised sums then agree far below any page-score gap."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def vector_selection(q, keys, page, channels, topk):
    from edgekv.policies.base import topk_keep

    heads, n, d = keys.shape
    group_queries = q.reshape(heads, -1, d)
    lo, hi = page_minmax(keys, page)
    chosen, positive = select_channels(group_queries, channels)
    scores = approximate_page_scores(group_queries, lo, hi, chosen, positive)
    return topk_keep(token_weights(group_queries, scores, chosen, page, n), topk)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.sampled_from([(2, 2), (4, 2), (6, 3), (4, 1)]), n=st.integers(1, 30), page=st.integers(1, 5),
       d=st.sampled_from([4, 8]), data=st.data())
def test_selection_matches_a_naive_reading_of_the_paper(heads, n, page, d, data):
    hq, h = heads
    channels = data.draw(st.integers(1, d))
    topk = data.draw(st.integers(1, n))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, keys = randn64(g, hq, d), randn64(g, h, n, d)
    got = vector_selection(q, keys, page, channels, topk)
    assert torch.equal(got, naive_selection(q, keys, page, channels, topk))
    assert got.shape == (h, min(topk, n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), page=st.integers(1, 6), d=st.sampled_from([4, 8, 16]), data=st.data())
def test_page_score_bounds_every_token_of_its_page(n, page, d, data):
    """The Quest bound for one query head (G = 1, digest §9.1 item 9): the page score is ≥ every
    token's partial dot product on the chosen channels."""
    channels = data.draw(st.integers(1, d))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, keys = randn64(g, 1, 1, d), randn64(g, 1, n, d)
    lo, hi = page_minmax(keys, page)
    chosen, positive = select_channels(q, channels)
    scores = approximate_page_scores(q, lo, hi, chosen, positive)[0, 0]
    partial = (keys[0][:, chosen[0]] * q[0, 0, chosen[0]]).sum(-1)  # [n]
    for t in range(n):
        assert scores[t // page] >= partial[t] - 1e-12


def test_one_row_pages_and_every_channel_are_exact_attention():
    """p = 1 and r = d (digest §9.1 item 10): the page scores are the exact q·k, τ = sqrt(d), so π is
    the group sum of the exact attention softmax (at the usual 1/sqrt(d) scale)."""
    g = torch.Generator().manual_seed(1)
    q, keys = randn64(g, 4, 16), randn64(g, 2, 11, 16)
    group_queries = q.reshape(2, 2, 16)
    lo, hi = page_minmax(keys, 1)
    chosen, positive = select_channels(group_queries, 16)
    scores = approximate_page_scores(group_queries, lo, hi, chosen, positive)
    exact = torch.einsum("hgd,hnd->hgn", group_queries, keys)
    torch.testing.assert_close(scores, exact)
    want = torch.softmax(exact / math.sqrt(16), dim=-1).sum(1)
    torch.testing.assert_close(token_weights(group_queries, scores, chosen, 1, 11), want)


def test_query_heads_of_a_group_share_one_selection_in_any_order():
    """One index set per KV head (digest §9.1 item 13), invariant to the order of its group's query heads."""
    g = torch.Generator().manual_seed(2)
    q, keys = torch.randn(6, 8, generator=g), torch.randn(2, 25, 8, generator=g)
    base = vector_selection(q, keys, 3, 4, 7)
    swapped = q[[2, 0, 1, 4, 5, 3]]
    assert torch.equal(vector_selection(swapped, keys, 3, 4, 7), base)
    moved = q[[3, 1, 2, 0, 4, 5]]  # a head moved to the other group: the selection may change, and its
    assert vector_selection(moved, keys, 3, 4, 7).shape == base.shape  # size does not


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(12, 40), page=st.integers(0, 5), channels=st.integers(0, 16), topk=st.integers(0, 13),
       block=st.sampled_from([4, 8, 11]), length=st.integers(10, 60))
def test_selected_rows_are_valid_and_min_k_fill_of_them(budget, page, channels, topk, block, length):
    args = {"window": "4", "page": str(page), "channels": str(channels), "topk": str(topk)}
    engine = BlockEngine(MODEL, make_policy("rocketkv", args), budget, block)
    logits = engine.prefill(torch.randint(0, 256, (length,)))
    k = engine.policy.plan(budget, MODEL.config.head_dim).topk
    for _ in range(4):
        logits = engine.decode(int(logits.argmax()))
        for layer, cache in enumerate(engine.caches):
            fill = engine.policy.last_fill[layer]
            assert fill == min(length + _ + 1, budget + 1)  # the step attended over cache ⊕ new token
            selected = engine.policy.last_selected[layer]
            assert selected.shape == (MODEL.config.num_kv_heads, min(k, fill))
            for head in selected.tolist():
                assert head == sorted(set(head)) and all(0 <= i < fill for i in head)


def test_decode_attention_is_exact_attention_over_the_selected_rows():
    g = torch.Generator().manual_seed(4)
    cache = LayerCache(2, 40, 16)
    cache.write(0, torch.randn(2, 30, 16, generator=g), torch.randn(2, 30, 16, generator=g), torch.arange(30))
    policy = RocketKVPolicy(topk=6, page=2, channels=5)
    q = torch.randn(4, 1, 16, generator=g)
    out = policy.decode_attention(0, q, cache, 30, budget=32, scale=0.25)
    selected = policy.last_selected[0]
    assert torch.equal(selected, vector_selection(q[:, 0], cache.keys[:, :30], 2, 5, 6))
    for h in range(4):
        rows = selected[h // 2]
        probs = torch.softmax(cache.keys[h // 2, rows] @ q[h, 0] * 0.25, dim=0)
        torch.testing.assert_close(out[h, 0], probs @ cache.values[h // 2, rows])


# ---- budget split and traffic ----------------------------------------------------------------------

def test_default_plan_follows_the_papers_split():
    plan = stage2_plan(2048, 64)  # B = N/4: c₂ = 4 → p = 2, r = d·p/c₂ = 32, k = B/2
    assert (plan.traffic, plan.page, plan.channels, plan.topk) == (512, 2, 32, 256)
    assert stage2_plan(2048, 64, traffic=256).page == 3  # c₂ = 8: p = ⌈√8⌉
    assert stage2_plan(2048, 64, page=4).channels == 64  # r derived from the given p, at most d
    assert stage2_plan(100, 64, traffic=400).page == 1  # B ≥ N: no page reduction


@pytest.mark.parametrize("budget", [256, 512, 1000, 2048, 4096])
@pytest.mark.parametrize("ratio", [2, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_traffic_per_step_is_the_budget(budget, ratio, head_dim):
    """Summary reads + top-k rows ≈ B KV pairs at a full cache (digest §9.1 item 12), within the
    rounding of p and r."""
    plan = stage2_plan(budget, head_dim, traffic=budget // ratio)
    assert plan.traffic_pairs(budget, head_dim) == pytest.approx(plan.traffic, rel=0.2)


def test_bytes_read_per_decode_step_against_snapkvpp():
    rk, snap = make_policy("rocketkv"), make_policy("snapkv++")
    d, fill = 64, 2049
    dense = snap.decode_bytes_per_step(fill, d, 2048, num_kv_heads=3, num_layers=30)
    assert dense == 30 * 3 * fill * 2 * d * 4
    sparse = rk.decode_bytes_per_step(fill, d, 2048, num_kv_heads=3, num_layers=30)
    plan = rk.plan(2048, d)
    assert sparse == 30 * 3 * (math.ceil(fill / plan.page) * plan.channels + plan.topk * 2 * d) * 4
    assert sparse < dense / 3.5  # ≈ 1/c₂ = 1/4 of the bytes
    assert rk.decode_bytes_per_step(100, d, 2048) == snap.decode_bytes_per_step(100, d, 2048)  # k ≥ fill: dense


# ---- arguments, compile, CLI -------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    ({"page": "-1"}, "page=-1 is negative"),
    ({"page": "17"}, "page=17 is larger than the budget N=16"),
    ({"topk": "18"}, "topk=18 is more than the 17 rows"),
    ({"topk": "-2"}, "topk=-2 is negative"),
    ({"channels": "17"}, "channels=17 is more than this model's head dim 16"),
    ({"channels": "-1"}, "channels=-1 is negative"),
    ({"traffic": "-4"}, "traffic=-4 is negative"),
    ({"page": "two"}, "page='two' is not a valid int"),
])
def test_bad_arguments_are_refused_with_the_fix(args, message):
    with pytest.raises(PolicyError, match=message) as err:
        BlockEngine(MODEL, make_policy("rocketkv", {"window": "4", **args}), N, B)
    assert "use" in str(err.value) or "valid" in str(err.value)


def test_edgekv_run_with_rocketkv(tiny_dir, tmp_path):
    from edgekv.cli import app

    report = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["run", str(tiny_dir), "--prompt", "a long enough prompt " * 4,
                                      "--policy", "rocketkv", "--budget", "24", "--block", "8",
                                      "--policy-arg", "window=4", "--policy-arg", "page=3",
                                      "--max-new-tokens", "6", "-o", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["generated_tokens"] == 6 and max(data["cache_lengths"]) <= 24
    assert data["policy_params"]["page"] == 3
    bad = CliRunner().invoke(app, ["run", str(tiny_dir), "--prompt", "hi", "--policy", "rocketkv",
                                   "--policy-arg", "channels=99"])
    assert bad.exit_code == 2 and "channels=99 is more than" in " ".join(bad.output.split())
