"""The lean compile (issue 30): a GGUF's weights stay in the file (``models.gguf_weights.GGUFWeights``),
the export traces stride-0 placeholders, and the build reads only the tensors it re-stores — so a
1.5B compile never holds the fp32 model. The artifact is the one a compile of the converted fp32
weights writes, byte for byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from edgekv.models import LoadedModel
from edgekv.models.gguf_weights import GGUFWeights
from edgekv.policies import make_policy

pytest.importorskip("tvm")

from test_kquant_formats import TARGET, tiny_qwen2  # noqa: E402,F401 - the tiny K-quant Qwen2 GGUF fixture


class CountedReads(GGUFWeights):
    def __init__(self, *args):
        super().__init__(*args)
        self.reads: list[str] = []

    def array(self, name):
        self.reads.append(name)
        return super().array(name)


def test_weights_in_the_file_give_the_same_artifact_and_read_only_what_is_restored(tiny_qwen2, tmp_path):  # noqa: F811
    from edgekv.compiler import compile_model

    path = tiny_qwen2.source
    weights = CountedReads(path, gguf.GGUFReader(str(path)), tiny_qwen2.hf_config, "qwen2")
    assert weights.shapes == {n: tuple(t.shape) for n, t in tiny_qwen2.weights.items()}
    for name, t in tiny_qwen2.weights.items():  # exactly gguf's dequantisation, as the converted copy
        np.testing.assert_array_equal(weights.array(name), t.numpy(), err_msg=name)
    weights.reads.clear()
    lazy = LoadedModel(model_id="lazy", config=tiny_qwen2.config, hf_config=tiny_qwen2.hf_config, weights=weights,
                       source=path)
    assert lazy.weights_in_file and lazy.weight_bytes == sum(t.numel() * 4 for t in tiny_qwen2.weights.values())
    pol = make_policy("keydiff")
    a = compile_model(lazy, pol, 24, 8, TARGET, tmp_path / "lazy", weights="q4")
    # every matrix is kept from the file's blocks: only the 1-D F32 tensors (norms, biases) are read
    assert sorted(weights.reads) == sorted(n for n, s in weights.shapes.items() if len(s) == 1)
    b = compile_model(tiny_qwen2, pol, 24, 8, TARGET, tmp_path / "held", weights="q4")
    assert [n for n, _ in a.params] == [n for n, _ in b.params]
    for (n, x), (_, y) in zip(a.params, b.params):
        assert x.dtype == y.dtype and np.array_equal(x, y), n
    assert (tmp_path / "lazy" / "params.safetensors").read_bytes() == (tmp_path / "held" / "params.safetensors").read_bytes()


def test_an_fp32_build_reads_every_weight_from_the_file(tiny_qwen2):  # noqa: F811
    from edgekv.compiler import compile_model

    path = tiny_qwen2.source
    weights = CountedReads(path, gguf.GGUFReader(str(path)), tiny_qwen2.hf_config, "qwen2")
    lazy = LoadedModel(model_id="lazy", config=tiny_qwen2.config, hf_config=tiny_qwen2.hf_config, weights=weights,
                       source=path)
    pol = make_policy("keydiff")
    a = compile_model(lazy, pol, 24, 8, TARGET, weights="fp32")
    b = compile_model(tiny_qwen2, pol, 24, 8, TARGET, weights="fp32")
    assert sorted(weights.reads) == sorted(weights.shapes)  # each once
    for (n, x), (_, y) in zip(a.params, b.params):
        assert np.array_equal(x, y), n
