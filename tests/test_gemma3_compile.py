"""Compiled Gemma 3 against the eager engine (the oracle) on the tiny random config: per-layer cache
kinds (a local layer keeps exactly its window, no policy; a global layer runs the policy with N), the
manifest naming each layer's kind and size, and the refusals of what is still unmapped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("tvm")

from edgekv.compiler.errors import CompileError  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_gemma3_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402

from tests.compiled_checks import relative_error  # noqa: E402

B = 8
N = 24  # the global layer's budget; the local layers' window is 16 (tiny_gemma3_model)
PROMPT = 45  # 5 full blocks + a 5-token tail: the local rings wrap twice, the global layer evicts
DECODE = 12
# unoptimised LLVM code: these tests check correctness, and opt-level 0 compiles ~3x faster
TEST_TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3_model(0, final_softcap=30.0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))


def _artifact(shared_artifact, model, name):
    return shared_artifact(model, make_policy(name, {}), N, B, TEST_TARGET)


def test_plain_forward_equals_transformers_within_the_window(model):
    """The one plain forward, with Gemma's properties read from the description, is HF's Gemma 3
    (the export is causal: exact while T ≤ window, which the block and decode steps are)."""
    from transformers import AutoModelForCausalLM

    from edgekv.compiler.frontend.export import plain_module

    hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=torch.float32)
    weights = dict(model.weights, **{"lm_head.weight": model.weights["model.embed_tokens.weight"]})
    hf.load_state_dict(weights)
    tokens = torch.randint(0, 256, (1, model.config.sliding_window))
    with torch.no_grad():
        got = plain_module(model)(tokens, torch.arange(tokens.shape[1])[None])
        want = hf.eval()(tokens).logits
    assert relative_error(got.numpy(), want.numpy()) < 1e-5


@pytest.mark.parametrize("name", ["keydiff", "snapkv"])
def test_compiled_equals_eager_greedy_ids_and_logits(shared_artifact, model, prompt, name):
    from edgekv.runtime import HostRuntime

    rt = HostRuntime(_artifact(shared_artifact, model, name))
    eng = BlockEngine(model, make_policy(name, {}), N, B)
    cfg = model.config
    for s in range(0, PROMPT, B):
        got, want = rt.step_block(prompt[s:s + B].numpy()), eng.step(prompt[s:s + B]).numpy()
        assert relative_error(got, want) < 1e-4, f"block at {s}"
        for layer in cfg.global_layers:  # the policy's choice, made by the compiled kernels
            np.testing.assert_array_equal(np.sort(rt.kept_positions(layer), 1),
                                          np.sort(eng.kept_positions(layer).numpy(), 1), err_msg=f"{s}, {layer}")
        end = s + len(prompt[s:s + B])
        for layer in cfg.local_layers:  # a local layer keeps exactly the newest `window` positions
            newest = np.arange(max(0, end - cfg.sliding_window), end)
            np.testing.assert_array_equal(np.sort(rt.kept_positions(layer), 1),  # a ring: slot order is not
                                          np.tile(newest, (cfg.num_kv_heads, 1)))  # position order
    ids_rt, ids_eng = [], []
    tok_rt = tok_eng = int(np.argmax(got))
    for _ in range(DECODE):
        got, want = rt.decode(tok_rt), eng.decode(tok_eng).numpy()
        assert relative_error(got, want) < 1e-4
        tok_rt, tok_eng = int(np.argmax(got)), int(np.argmax(want))
        ids_rt.append(tok_rt)
        ids_eng.append(tok_eng)
    assert ids_rt == ids_eng
    assert rt.cache_lengths() == [cfg.sliding_window if k == "local" else N for k in cfg.layer_kinds]


def test_manifest_names_each_layers_cache_kind_and_size(shared_artifact, model):
    from edgekv.artifact import Manifest

    art = _artifact(shared_artifact, model, "keydiff")
    m = Manifest.read(art)
    cfg = model.config
    window, H, D = cfg.sliding_window, cfg.num_kv_heads, cfg.head_dim
    assert m.cache_kinds == [("local", window) if k == "local" else ("global", N) for k in cfg.layer_kinds]
    raw = json.loads((art / "manifest.json").read_text())
    for kind, cache in zip(cfg.layer_kinds, raw["cache"]):
        rows = window if kind == "local" else N
        assert cache["k"] == [H, rows, D] and cache["v"] == [H, rows, D] and cache["pos"] == [H, rows]
    # the memory plan counts both kinds: K and V fp32, positions int32 and the fill, per layer
    per_row = H * (2 * D * 4 + 4)
    want = sum(per_row * (window if k == "local" else N) + 4 for k in cfg.layer_kinds)
    assert m.memory_plan.cache_bytes == want


def test_a_budget_below_the_window_is_refused_the_window_is_the_floor(model, tmp_path):
    from edgekv.compiler import compile_model

    out = tmp_path / "art"
    with pytest.raises(CompileError, match="the window is the floor") as info:
        compile_model(model, make_policy("keydiff", {}), 12, B, TEST_TARGET, out)
    assert "--budget 16" in str(info.value)
    assert not out.exists()


@pytest.mark.parametrize("what, kwargs, match", [
    ("d2o", {}, "D2O's layer budgets are allocated over all layers"),
    ("keydiff", {"kv_dtype": "int8"}, "--kv-dtype int8 is not compiled for this model's 3 sliding-window layers"),
    ("keydiff", {"target": "cuda"}, "have no GPU kernels yet"),
    ("dapq", {}, "pseudo rows are not compiled"),
])
def test_what_is_still_unmapped_is_refused_before_any_work(model, tmp_path, monkeypatch, what, kwargs, match):
    from edgekv.compiler import compile_model
    from edgekv.compiler import pipeline

    monkeypatch.setattr(pipeline, "import_model", lambda *a, **k: pytest.fail("exported before refusing"))
    target = kwargs.pop("target", TEST_TARGET)
    with pytest.raises(CompileError, match=match):
        compile_model(model, make_policy(what, {}), 32, B, target, tmp_path / "art", **kwargs)


def test_a_description_the_forward_cannot_map_is_refused_naming_the_piece(model):
    import dataclasses

    from edgekv.compiler.frontend.export import check_exportable

    with pytest.raises(CompileError, match="no MLP activation 'relu'"):
        check_exportable(dataclasses.replace(model.config, mlp_activation="relu"))
    with pytest.raises(CompileError, match=r"layer kinds \['chunked'\] have no compiled cache"):
        check_exportable(dataclasses.replace(model.config, layer_kinds=("chunked",) * model.config.num_layers))


def test_native_runtime_greedy_ids_equal_eager_and_snapshots_keep_both_kinds(shared_artifact, model, prompt,
                                                                           tmp_path):
    """edgekv's C runtime runs the artifact's per-layer caches as program.ekv sizes them (each cache
    buffer with its layer's shape): greedy ids equal the eager engine's, local layers keep their window,
    and a saved cache continues as the live one does."""
    from edgekv.runtime import native

    if not native.available():
        pytest.skip("the native runtime is not built: `pip install -e .` builds runtime/ (needs cmake and a C compiler)")
    art = _artifact(shared_artifact, model, "keydiff")
    cfg = model.config
    want = BlockEngine(model, make_policy("keydiff", {}), N, B).generate(prompt, DECODE)
    nat = native.NativeRuntime(art, threads=1)
    assert nat.generate(prompt.tolist(), DECODE) == want
    assert nat.cache_lengths() == [cfg.sliding_window if k == "local" else N for k in cfg.layer_kinds]
    end = PROMPT + DECODE - 1  # the last generated token is never fed back
    for layer in cfg.local_layers:
        np.testing.assert_array_equal(np.sort(nat.kept_positions(layer)[0]), np.arange(end - cfg.sliding_window, end))
    nat.reset()
    nat.prefill(prompt.tolist())
    nat.save_cache(tmp_path / "doc.ekvc")
    live = [int(np.argmax(nat.decode(t))) for t in want[:4]]
    again = native.NativeRuntime(art, threads=1)
    again.load_cache(tmp_path / "doc.ekvc")
    assert [int(np.argmax(again.decode(t))) for t in want[:4]] == live
