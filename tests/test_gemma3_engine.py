"""Gemma 3 in the eager engine: the family's description (local / global layers, QK-norm, four norms,
(1 + w) RMSNorm, GeGLU, √hidden embedding scale, local / global RoPE bases, tied embeddings) against
transformers' Gemma3ForCausalLM, and the per-layer cache kinds under one budget: local layers a ring
of window + B entries (exact, no policy), global layers the policy with N + B."""

from __future__ import annotations

import pytest
import torch

from edgekv.budget import BudgetError, parse_budget
from edgekv.engine.block_engine import BlockEngine
from edgekv.engine.cache import RingLayerCache
from edgekv.engine.session import open_eager_session
from edgekv.memory import kv_bytes_per_token, kv_cache_bytes, local_kv_bytes, plan_memory
from edgekv.models import tiny_gemma3_model
from edgekv.policies import make_policy

WINDOW, BLOCK = 16, 8


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3_model(0, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def gemma_hf(gemma):
    return gemma.to_hf()


def prompt(n, seed=1):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_description_from_config(gemma):
    cfg = gemma.config
    assert cfg.layer_kinds == ("local", "local", "global", "local")
    assert cfg.global_layers == [2] and cfg.sliding_window == WINDOW
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset == 1.0 and cfg.mlp_activation == "gelu_tanh"
    assert cfg.embed_scale == pytest.approx(64 ** 0.5) and cfg.tie_embeddings
    assert not torch.allclose(gemma.inv_freq, gemma.local_inv_freq)  # 1e6 vs 1e4


@pytest.mark.parametrize("n", [5, 40, 61])  # inside the window, across it, across the ring's wrap twice
def test_logits_match_transformers(gemma, gemma_hf, n):
    ids = prompt(n)
    with torch.no_grad():
        ref = gemma_hf(ids[None]).logits[0]
    engine = BlockEngine(gemma, make_policy("full", {}), budget=64, block=BLOCK)
    out = engine.prefill(ids, all_logits=True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # local layers held a ring of window + B, never more
    for layer in gemma.config.local_layers:
        assert isinstance(engine.caches[layer], RingLayerCache)
        assert engine.caches[layer].capacity == WINDOW + BLOCK
        assert engine.caches[layer].length == min(n, WINDOW + BLOCK)


def hf_greedy(hf, ids, steps):
    """Greedy ids by transformers' forward over the whole sequence at every step (the definition,
    with no cache of HF's in between)."""
    seq = ids.tolist()
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[ids.numel():]


def test_greedy_ids_match_transformers(gemma, gemma_hf):
    ids = prompt(30, seed=3)
    ref = hf_greedy(gemma_hf, ids, 24)
    engine = BlockEngine(gemma, make_policy("full", {}), budget=64, block=BLOCK)
    assert engine.generate(ids, 24) == ref


def test_softcapping_matches_transformers():
    model = tiny_gemma3_model(2, sliding_window=WINDOW, attn_softcap=5.0, final_softcap=3.0)
    # transformers' Gemma 3 ignores attn_logit_softcapping (QK-norm replaced it): so does edgekv's description
    assert model.config.final_softcap == 3.0
    ids = prompt(40, seed=4)
    with torch.no_grad():
        ref = model.to_hf()(ids[None]).logits[0]
    out = BlockEngine(model, make_policy("full", {}), budget=64, block=BLOCK).prefill(ids, all_logits=True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert out.abs().max() <= 3.0


@pytest.mark.parametrize("policy", ["keydiff", "snapkv", "streaming"])
def test_policy_only_on_global_layers(gemma, policy):
    """With an evicting policy the global layer holds ≤ N + B and evicts; the local layers are rings of the
    last positions, untouched by the policy (their kept positions are exactly the newest)."""
    n_budget, ids = WINDOW, prompt(70, seed=5)
    engine = BlockEngine(gemma, make_policy(policy, {}), budget=n_budget, block=BLOCK, record_kept=True)
    engine.prefill(ids)
    assert engine.stats.eviction_events > 0
    assert engine.cache_lengths()[2] <= n_budget
    for layer in gemma.config.local_layers:
        held = sorted(engine.kept_positions(layer)[0].tolist())
        assert held == list(range(70 - (WINDOW + BLOCK), 70))


def test_local_layers_are_exact_under_eviction(gemma):
    """A policy evicting only on the global layer: a model with every layer local would not change at all;
    here the global layer's eviction is the only difference from the full cache, so the local layers'
    ring is checked on its own: one local layer's output equals windowed attention over the whole prefix."""
    ids = prompt(50, seed=6)
    full = BlockEngine(gemma, make_policy("full", {}), budget=64, block=BLOCK).prefill(ids, all_logits=True)
    evicting = BlockEngine(gemma, make_policy("keydiff", {}), budget=WINDOW, block=BLOCK).prefill(ids, all_logits=True)
    # identical until the first eviction (the first N + B tokens), different after: the policy acted
    torch.testing.assert_close(evicting[: WINDOW + BLOCK], full[: WINDOW + BLOCK], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(evicting[-1], full[-1], atol=1e-4)


def test_window_is_the_floor(gemma):
    with pytest.raises(BudgetError, match="the window is the floor"):
        parse_budget(str(WINDOW - 8), gemma.config, block=BLOCK)
    with pytest.raises(BudgetError, match="the window is the floor"):
        open_eager_session(gemma, "keydiff", {}, "8", BLOCK, None, None)
    assert parse_budget(str(WINDOW), gemma.config, block=BLOCK) == WINDOW


def test_byte_budget_splits_over_both_kinds(gemma):
    cfg = gemma.config
    rings = local_kv_bytes(cfg, BLOCK)
    per_token = kv_bytes_per_token(cfg)
    assert rings == 3 * (WINDOW + BLOCK) * cfg.num_kv_heads * (2 * cfg.head_dim * 4 + 4)
    assert per_token == 1 * cfg.num_kv_heads * (2 * cfg.head_dim * 4 + 4)  # one global layer
    budget = rings + (40 + BLOCK) * per_token + per_token // 2
    n = parse_budget(f"{budget}B", cfg, block=BLOCK)
    assert n == 40
    assert kv_cache_bytes(cfg, n + BLOCK, block=BLOCK) <= budget < kv_cache_bytes(cfg, n + BLOCK + 1, block=BLOCK)
    with pytest.raises(BudgetError, match="the window is the floor"):
        parse_budget(f"{rings + (WINDOW - 1 + BLOCK) * per_token}B", cfg, block=BLOCK)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_plan_counts_both_kinds(gemma, kv_dtype):
    session = open_eager_session(gemma, "keydiff", {}, "32", BLOCK, None, None, kv_dtype=kv_dtype)
    engine = session.engine
    assert session.plan.kv_cache == engine.kv_bytes
    per_entry = gemma.config.num_kv_heads * (2 * (gemma.config.head_dim * 4 if kv_dtype == "fp32" else
                                                    gemma.config.head_dim + 2) + 4)
    rings = 3 * (WINDOW + BLOCK) * per_entry
    assert engine.kv_bytes == rings + (32 + BLOCK) * (per_entry + 4 * gemma.config.num_kv_heads
                                                      * len(engine.policy.entry_state))
    engine.prefill(prompt(60, seed=7))
    assert engine.cache_lengths()[2] <= 32


def test_plan_memory_with_short_sequence(gemma):
    plan = plan_memory(gemma.config, 0, 20, BLOCK, 0, max_tokens=20)
    engine = BlockEngine(gemma, make_policy("full", {}), budget=32, block=BLOCK, max_tokens=20)
    assert plan.kv_cache == engine.kv_bytes


def test_snapshot_round_trip(gemma, tmp_path):
    ids, more = prompt(45, seed=8), prompt(7, seed=9)
    live = BlockEngine(gemma, make_policy("keydiff", {}), budget=WINDOW, block=BLOCK)
    live.prefill(ids)
    live.save_cache(tmp_path / "doc.ekv")
    expected = live.prefill(more)
    loaded = BlockEngine(gemma, make_policy("keydiff", {}), budget=WINDOW, block=BLOCK)
    loaded.load_cache(tmp_path / "doc.ekv")
    torch.testing.assert_close(loaded.prefill(more), expected)


@pytest.mark.parametrize("policy", ["dapq", "d2o", "rocketkv"])
def test_other_policies_run_on_global_layers(gemma, policy):
    engine = BlockEngine(gemma, make_policy(policy, {}), budget=WINDOW + BLOCK, block=BLOCK)
    logits = engine.prefill(prompt(60, seed=10))
    assert torch.isfinite(logits).all()
    assert engine.cache_lengths()[2] <= WINDOW + BLOCK


# ---- `edgekv run` on a Gemma 3 folder ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from conftest import byte_tokenizer

    d = tmp_path_factory.mktemp("tiny-gemma3")
    tiny_gemma3_model(0, sliding_window=WINDOW).to_hf().save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


def run_cli(*args):
    from typer.testing import CliRunner

    from edgekv.cli import app

    result = CliRunner().invoke(app, ["run", *args])
    return result.exit_code, " ".join((result.output + (result.stderr if result.stderr_bytes is not None else "")).split())


def test_cli_run_keeps_both_kinds(gemma_dir, tmp_path):
    import json

    report = tmp_path / "r.json"
    code, out = run_cli(str(gemma_dir), "--prompt", "hello world, " * 8, "--max-new-tokens", "6", "--budget", "16",
                        "--block", "8", "--policy", "keydiff", "-o", str(report))
    assert code == 0, out
    data = json.loads(report.read_text())
    assert data["memory"]["plan"]["kv_cache"] == data["memory"]["kv_cache_allocated"]
    assert data["generated_tokens"] == 6
    text = report.read_text()
    assert '"ring_capacity": 24' in text and '"local_layers": [' in text


def test_cli_refuses_a_budget_below_the_window(gemma_dir):
    code, out = run_cli(str(gemma_dir), "--prompt", "hello", "--budget", "8", "--block", "8")
    assert code == 2, out
    assert "the window is the floor" in out and "Traceback" not in out
