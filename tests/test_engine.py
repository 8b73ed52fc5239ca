"""The reference engine against HF transformers and against the block-wise invariants."""

from __future__ import annotations

import pytest
import torch

from edgekv.engine import BlockEngine, Sampler
from edgekv.models import tiny_random_model
from edgekv.policies import make_policy


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids[None]).logits[0]


@pytest.mark.parametrize("variant", [
    dict(seed=0),
    dict(seed=1, model_type="qwen2", tie_embeddings=True),
    dict(seed=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(seed=3, rope_theta=500000.0, heads=6, kv_heads=2),
])
def test_full_budget_equals_hf_forward_tiny(variant):
    model = tiny_random_model(**variant)
    ids = torch.randint(0, model.config.vocab_size, (150,))
    ref = hf_logits(model.to_hf(), ids)
    engine = BlockEngine(model, make_policy("full"), budget=256, block=32)
    out = engine.prefill(ids, all_logits=True)
    assert (out - ref).abs().max() < 1e-4


def test_full_budget_equals_hf_forward_smollm2(smol, smol_hf):
    text = "Edge devices cannot hold the KV cache of a long prompt, so edgekv evicts entries block by block. " * 6
    ids = torch.tensor(smol.tokenizer(text)["input_ids"])
    ref = hf_logits(smol_hf, ids)
    out = BlockEngine(smol, make_policy("full"), budget=512, block=128).prefill(ids, all_logits=True)
    assert (out - ref).abs().max() < 1e-4


def test_greedy_equals_hf_generate_smollm2(smol, smol_hf):
    ids = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor(ids)
    with torch.no_grad():
        ref = smol_hf.generate(ids[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=2)[0, len(ids):]
    engine = BlockEngine(smol, make_policy("full"), budget=256, block=16)
    out = engine.generate(ids, 24, Sampler())
    assert out == ref.tolist()


def test_block_size_changes_nothing_without_eviction(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (130,))
    results = []
    for block in (1, 7, 128, 130):
        engine = BlockEngine(tiny, make_policy("keydiff"), budget=256, block=block)
        logits = engine.prefill(ids, all_logits=True)
        for t in (3, 9):
            logits = torch.cat([logits, engine.decode(t)[None]])
        results.append(logits)
    for other in results[1:]:
        assert torch.allclose(results[0], other, atol=1e-5)


def test_streaming_keeps_sinks_and_recent_window_and_never_exceeds_budget(tiny):
    budget, block, sinks = 48, 16, 4
    engine = BlockEngine(tiny, make_policy("streaming", {"sinks": str(sinks)}), budget, block, record_kept=True)
    ids = torch.randint(0, tiny.config.vocab_size, (150,))
    engine.prefill(ids)
    for t in range(5):
        engine.decode(t)
    assert engine.stats.eviction_events > 0
    for step in engine.stats.steps:
        seen = step.start + step.length
        for kept in step.kept_positions:
            assert kept.shape[1] <= budget
            expected = list(range(sinks)) + list(range(seen - (budget - sinks), seen)) if seen > budget else list(range(seen))
            for head in kept:
                assert head.tolist() == expected


def test_kv_memory_does_not_grow_with_prompt():
    model = tiny_random_model(0, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_position=16384)
    sizes, peaks = [], []
    for length in (1024, 8192):
        engine = BlockEngine(model, make_policy("streaming"), budget=512, block=128)
        engine.prefill(torch.randint(0, 64, (length,)))
        sizes.append(engine.kv_bytes)
        peaks.append(max(engine.cache_lengths()))
    assert sizes[0] == sizes[1]
    assert peaks == [512, 512]
    # The engine's own allocation is exactly the (N + B) plan: K, V fp32 + int32 positions.
    cfg = model.config
    assert sizes[0] == cfg.num_layers * cfg.num_kv_heads * (512 + 128) * (2 * cfg.head_dim * 4 + 4)


def test_decode_keeps_evicting_at_budget(tiny):
    engine = BlockEngine(tiny, make_policy("keydiff"), budget=40, block=16)
    engine.prefill(torch.randint(0, tiny.config.vocab_size, (64,)))
    for t in range(10):
        engine.decode(t)
        assert max(engine.cache_lengths()) == 40
    assert engine.position == 74
    # positions continue at prompt length: the newest kept entries of a streaming-like
    # policy would be 73; for any policy every kept position is < 74 and distinct
    for layer in range(tiny.config.num_layers):
        pos = engine.kept_positions(layer)
        assert int(pos.max()) < 74
        for head in pos:
            assert len(set(head.tolist())) == head.numel()


def test_sampling_is_seeded():
    logits = torch.randn(100)
    s1, s2 = Sampler(temperature=1.0, top_p=0.9, seed=7), Sampler(temperature=1.0, top_p=0.9, seed=7)
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]
    assert Sampler(temperature=1.0, top_p=1e-6, seed=3)(logits) == int(logits.argmax())


def test_full_policy_refuses_with_the_size_it_needs(tiny):
    from edgekv.policies import PolicyError

    engine = BlockEngine(tiny, make_policy("full"), budget=32, block=16)
    with pytest.raises(PolicyError, match="needs 48 cache entries"):
        engine.prefill(torch.randint(0, tiny.config.vocab_size, (48,)))
