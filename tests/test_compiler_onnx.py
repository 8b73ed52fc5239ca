"""ONNX input: a tiny random Llama exported with torch.onnx.export (plain and past_key_values forms),
compiled from the ONNX file, against the torch-export artifact, ONNX Runtime and HF."""

from __future__ import annotations

import re

import shutil
import sys

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from edgekv.compiler import AttentionMatchError, CompileError, compile_model, import_model  # noqa: E402
from edgekv.compiler.frontend.onnx_export import export_onnx, onnxruntime_logits  # noqa: E402
from edgekv.compiler.frontend.onnx_model import load_onnx_model  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies.full import FullPolicy  # noqa: E402
from edgekv.policies.keydiff import KeyDiffPolicy  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402

B = 8
PROMPT = 45  # 5 full blocks + a 5-token tail block
TEST_TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}
FORMS = ("plain", "past")


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def onnx_dirs(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    return {form: export_onnx(model, root / form, form) for form in FORMS}


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1)).numpy()


_BUILDS: dict = {}


def _runtime(key, model, policy, budget, imported=None):
    if key not in _BUILDS:
        _BUILDS[key] = compile_model(model, policy, budget, B, target=TEST_TARGET, imported=imported)
    res = _BUILDS[key]
    return HostRuntime.from_executable(res.executable, res.manifest, res.params)


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.mark.parametrize("form", FORMS)
def test_onnxruntime_on_the_export_equals_hf(model, onnx_dirs, prompt, form):
    with torch.no_grad():
        hf = model.to_hf()(torch.from_numpy(prompt)[None]).logits[0].numpy()
    assert _rel(onnxruntime_logits(onnx_dirs[form], prompt), hf) < 1e-4


@pytest.mark.parametrize("form", FORMS)
def test_compiled_from_onnx_equals_compiled_from_torch(model, onnx_dirs, prompt, form):
    policy, budget = KeyDiffPolicy(), 13
    rt_torch = _runtime(("torch", budget), model, policy, budget, imported=import_model(model, B))
    onnx_model = load_onnx_model(onnx_dirs[form])
    assert onnx_model.form == form
    rt_onnx = _runtime((form, budget), onnx_model, policy, budget)
    evictions = 0
    for s in range(0, PROMPT, B):
        chunk = prompt[s: s + B]
        got, want = rt_onnx.step_block(chunk), rt_torch.step_block(chunk)
        assert _rel(got, want) < 1e-4, f"block at {s}"
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt_onnx.kept_positions(layer), rt_torch.kept_positions(layer),
                                          err_msg=f"block at {s}, layer {layer}")
        evictions += int(s + len(chunk) > budget)
    assert evictions >= 3
    for _ in range(3):  # decode (the graph imported at T = 1) keeps evicting the same entries
        tok = int(np.argmax(got))
        got, want = rt_onnx.decode(tok), rt_torch.decode(tok)
        assert _rel(got, want) < 1e-4
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt_onnx.kept_positions(layer), rt_torch.kept_positions(layer))


@pytest.mark.parametrize("form", FORMS)
def test_full_budget_equals_onnxruntime(model, onnx_dirs, prompt, form):
    onnx_model = load_onnx_model(onnx_dirs[form])
    rt = _runtime((form, "full"), onnx_model, FullPolicy(), PROMPT + 8)
    logits = rt.prefill(prompt)
    assert _rel(logits, onnxruntime_logits(onnx_dirs[form], prompt)[-1]) < 1e-4
    seq = prompt.tolist()
    for _ in range(2):
        seq.append(int(np.argmax(logits)))
        logits = rt.decode(seq[-1])
        assert _rel(logits, onnxruntime_logits(onnx_dirs[form], seq)[-1]) < 1e-4
    manifest = rt.manifest.raw
    assert manifest["model"]["source"]["format"] == "onnx" and manifest["model"]["source"]["form"] == form


def test_artifact_weights_come_from_the_onnx_file(model, onnx_dirs):
    """Every weight of the artifact is an initializer of the ONNX file (no separately loaded model)."""
    from onnx import numpy_helper

    from edgekv.compiler.kernels.dense import unpack_weight

    onnx_model = load_onnx_model(onnx_dirs["plain"])
    res = _BUILDS.get(("plain", 13)) or compile_model(onnx_model, KeyDiffPolicy(), 13, B, target=TEST_TARGET)
    inits = [numpy_helper.to_array(i) for i in onnx_model.proto.graph.initializer]
    assert len(res.params) >= len(model.weights)
    for name, arr in res.params:
        if re.search(r"\.P\d+$", name):  # packed into column panels by the host build (pack_weights.py)
            arr = unpack_weight(arr)
        assert any(arr.shape == i.shape and np.array_equal(arr, i) or arr.shape == i.T.shape and np.array_equal(arr, i.T)
                   for i in inits), name
    assert res.manifest["model"]["weight_hash"] == onnx_model.weight_hash


def test_lm_head_runs_on_the_last_row_only(onnx_dirs):
    """HoistLastTokenGather also takes the ONNX frontend's 3-D LM-head matmul."""
    from edgekv.compiler.passes.attention_sites import Graph, op_name, shape_of
    from edgekv.compiler import BlockCacheSpec
    from edgekv.compiler.pipeline import lower_module

    mod, _, _ = load_onnx_model(onnx_dirs["plain"]).import_graph(B)
    mod, _, _ = lower_module(mod, BlockCacheSpec(budget=16, policy="full"))
    graph = Graph(mod["prefill_block"])
    vocab = 256
    head_shapes = [shape_of(v) for v in graph.order
                   if op_name(graph.producer[v]) == "relax.matmul" and (shape_of(v) or (0,))[-1] == vocab]
    assert head_shapes and all(s[-2] == 1 for s in head_shapes), head_shapes


# ---- errors ------------------------------------------------------------------------------------

def test_refuses_a_file_that_is_not_onnx(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"GGUF this is not a protobuf")
    with pytest.raises(CompileError, match="is not a readable ONNX model"):
        load_onnx_model(bad)


def test_refuses_missing_config_naming_the_option(onnx_dirs, tmp_path):
    lone = tmp_path / "model.onnx"
    shutil.copy(onnx_dirs["plain"], lone)
    with pytest.raises(CompileError, match=r"needs the model's HF config.json.*--tokenizer DIR"):
        load_onnx_model(lone)
    assert load_onnx_model(lone, onnx_dirs["plain"].parent).config.num_layers == 2  # --tokenizer finds it


def test_refuses_a_graph_without_attention(tmp_path, onnx_dirs):
    class NotADecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 16)
            self.head = torch.nn.Linear(16, 256)

        def forward(self, tokens, positions):
            return self.head(self.emb(tokens) + positions[..., None].float())

    path = tmp_path / "model.onnx"
    args = (torch.zeros(1, B, dtype=torch.long), torch.arange(B)[None])
    seq = torch.export.Dim("seq", max=64)
    torch.onnx.export(NotADecoder().eval(), args, str(path), input_names=["input_ids", "position_ids"],
                      output_names=["logits"], dynamo=True, verbose=False,
                      dynamic_shapes={"tokens": {1: seq}, "positions": {1: seq}})
    shutil.copy(onnx_dirs["plain"].parent / "config.json", tmp_path / "config.json")
    with pytest.raises(AttentionMatchError, match=r"model.onnx is not a causal decoder.*no attention site found"):
        load_onnx_model(path).import_graph(B)


def test_refuses_a_fixed_sequence_length(onnx_dirs, tmp_path):
    def fixed(proto):
        for vi in proto.graph.input[:2]:
            vi.type.tensor_type.shape.dim[1].dim_value = B

    path = _edited(onnx_dirs["plain"], tmp_path / "s" / "model.onnx", fixed)
    with pytest.raises(CompileError, match=r"'input_ids' has a fixed length 8.*export with a dynamic sequence"):
        load_onnx_model(path).import_graph(B)


def _edited(src, dst, edit):
    proto = onnx.load(str(src))
    edit(proto)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(dst))
    shutil.copy(src.parent / "config.json", dst.parent / "config.json")
    return dst


def test_refuses_an_unsupported_op_naming_it(onnx_dirs, tmp_path):
    def contrib_op(proto):
        node = next(n for n in proto.graph.node if n.op_type == "Sigmoid")
        node.op_type, node.domain = "SkipSimplifiedLayerNormalization", "com.microsoft"
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))

    path = _edited(onnx_dirs["plain"], tmp_path / "x" / "model.onnx", contrib_op)
    with pytest.raises(CompileError, match=r"cannot import.*SkipSimplifiedLayerNormalization"):
        load_onnx_model(path).import_graph(B)


def test_refuses_dynamic_shapes_it_cannot_fix(onnx_dirs, tmp_path):
    def dynamic_heads(proto):
        dim = next(i for i in proto.graph.input if i.name.startswith("past_key_values")).type.tensor_type.shape.dim[1]
        dim.dim_param = "heads"

    path = _edited(onnx_dirs["past"], tmp_path / "y" / "model.onnx", dynamic_heads)
    with pytest.raises(CompileError, match=r"past input 'past_key_values.0.key' has shape \[1, 'heads'"):
        load_onnx_model(path).import_graph(B)


def test_refuses_a_graph_without_position_ids(onnx_dirs, tmp_path):
    def rename(proto):
        proto.graph.input[1].name = "cache_position"
        for n in proto.graph.node:
            n.input[:] = ["cache_position" if x == "position_ids" else x for x in n.input]

    path = _edited(onnx_dirs["plain"], tmp_path / "z" / "model.onnx", rename)
    with pytest.raises(CompileError, match="input 'cache_position'.*supported inputs: input_ids, position_ids"):
        load_onnx_model(path)


def test_without_onnx_installed_names_the_extra(monkeypatch, onnx_dirs):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(CompileError, match=r"pip install -e '\.\[compile\]'"):
        load_onnx_model(onnx_dirs["plain"])


def test_cli_refuses_bad_onnx_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from edgekv.cli import app

    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x00\x01garbage")
    result = CliRunner().invoke(app, ["compile", str(bad), "--budget", "64", "--block", "8", "-o", str(tmp_path / "a")])
    text = " ".join((result.output + (result.stderr if result.stderr_bytes is not None else "")).split())
    assert result.exit_code == 2, text
    assert "is not a readable ONNX model" in text and str(bad) in text
    assert "Traceback" not in text
    assert not (tmp_path / "a").exists()


def test_eager_run_of_an_onnx_file_points_to_compile(onnx_dirs):
    from edgekv.models import ModelError, load_model

    with pytest.raises(ModelError, match=r"is an ONNX graph: only `edgekv compile .*model.onnx` takes it"):
        load_model(onnx_dirs["plain"])
