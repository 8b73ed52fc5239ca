"""The streamed GGUF conversion (``loader.convert_gguf_streamed``: one tensor at a time, a layer per
shard, progress over the bytes) gives exactly transformers' conversion, q/k row permutation
included (SmolLM2 is a Llama GGUF); and refuses a disk too small before writing."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from edgekv.models.errors import ModelError
from edgekv.models.loader import check_gguf, convert_gguf_streamed, load_hf_dir
from edgekv.models.sources import KNOWN_MODELS, fetch_known_gguf


@pytest.fixture(scope="module")
def smol_gguf():
    return fetch_known_gguf(KNOWN_MODELS["smollm2-135m"])


def test_streamed_conversion_equals_transformers(smol, smol_gguf, tmp_path):
    dest = tmp_path / "converted"
    text = io.StringIO()
    convert_gguf_streamed(smol_gguf, dest, Console(file=text), check_gguf(smol_gguf), "llama")
    assert "fp32 safetensors copy" in text.getvalue()
    assert len(list(dest.glob("model-layer*.safetensors"))) == smol.config.num_layers
    mine = load_hf_dir(dest, "smollm2-135m")
    assert mine.config == smol.config
    assert sorted(mine.weights) == sorted(smol.weights)
    for name, w in smol.weights.items():
        assert torch.equal(mine.weights[name], w), name
    prompt = "Hello, world — über 猫 😀\n\tdef f(x): return x"
    assert mine.tokenizer(prompt)["input_ids"] == smol.tokenizer(prompt)["input_ids"]


def test_too_little_disk_is_refused_before_writing(smol_gguf, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 5000, 5000))
    with pytest.raises(ModelError, match=r"not enough disk for the fp32 copy .* needs [\d,]+ bytes, 5,000 are free"):
        convert_gguf_streamed(smol_gguf, tmp_path / "c", Console(file=io.StringIO()), check_gguf(smol_gguf), "llama")
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob("c.*"))
