"""Qwen2 in the default suite: a tiny random Qwen2 (biases on q/k/v, 2 KV heads, RoPE θ 1e6, untied
LM head; ``models/tiny.tiny_qwen2_model``) eager against HF transformers' own Qwen2 forward, compiled
(fp32 and q4, evicting) against the eager engine, and through the native runtime with the same
greedy ids as TVM's VM. The real Qwen2.5-Coder-1.5B runs in ``tests/test_qwen_model.py -m slow``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgekv.engine import BlockEngine, Sampler
from edgekv.models.tiny import tiny_qwen2_model
from edgekv.policies import make_policy

B, PROMPT = 8, 45
TEST_TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2_model(0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(3))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_tiny_qwen2_is_shaped_like_qwen25(qwen):
    cfg = qwen.config
    assert cfg.model_type == "qwen2" and cfg.attention_bias and not cfg.tie_embeddings
    assert (cfg.num_kv_heads, cfg.rope_theta) == (2, 1e6)
    assert "lm_head.weight" in qwen.weights and "model.layers.0.self_attn.q_proj.bias" in qwen.weights
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen.weights  # Qwen2 has none on o


@pytest.mark.parametrize("tie", [False, True])
def test_eager_equals_hf_qwen2(tie, prompt):
    model = tiny_qwen2_model(1, tie_embeddings=tie)
    with torch.no_grad():
        ref = model.to_hf()(prompt[None]).logits[0]
    out = BlockEngine(model, make_policy("full"), budget=64, block=B).prefill(prompt, all_logits=True)
    assert (out - ref).abs().max() < 1e-4


def test_compiled_full_equals_hf_qwen2(qwen, prompt):
    pytest.importorskip("tvm")
    from edgekv.compiler import compile_model
    from edgekv.runtime import HostRuntime

    res = compile_model(qwen, make_policy("full"), PROMPT + 8, B, target=TEST_TARGET)
    rt = HostRuntime.from_executable(res.executable, res.manifest, res.params)
    logits = rt.prefill(prompt.numpy())
    with torch.no_grad():
        hf = qwen.to_hf()(prompt[None]).logits[0, -1].numpy()
    assert _rel(logits, hf) < 1e-5


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_compiled_keydiff_matches_engine_and_native(qwen, prompt, weights, tmp_path):
    """Evicting (N = 16 < the prompt) on this CPU's own layout (packed fp32 panels, or Q4_1 blocks):
    the host VM keeps what the eager engine keeps (fp32), and the native runtime generates the same
    greedy ids as the VM."""
    pytest.importorskip("tvm")
    from edgekv.compiler import compile_model
    from edgekv.runtime import HostRuntime, native

    budget = 16
    out = tmp_path / f"qwen-{weights}"
    compile_model(qwen, make_policy("keydiff"), budget, B, target="host", out_dir=out, weights=weights)
    host = HostRuntime(out)
    engine = BlockEngine(qwen, make_policy("keydiff"), budget=budget, block=B)
    for s in range(0, PROMPT, B):
        got, want = host.step_block(prompt[s: s + B].numpy()), engine.step(prompt[s: s + B])
        if weights == "fp32":  # q4 weights are not the engine's fp32 ones: only the runtimes agree
            assert _rel(got, want.numpy()) < 1e-3
            for layer in range(qwen.config.num_layers):
                np.testing.assert_array_equal(host.kept_positions(layer), engine.kept_positions(layer).numpy())
    assert host.cache_lengths() == [budget] * qwen.config.num_layers
    host.reset()
    ids_host = host.generate(prompt.tolist(), 12)
    if not (native.available() and native.cli_path() is not None):
        pytest.skip("the native runtime is not built: `pip install -e .` builds runtime/ "
                    "(needs cmake and a C compiler)")
    assert native.NativeRuntime(out).generate(prompt.tolist(), 12) == ids_host


def test_engine_greedy_equals_hf_generate_qwen2(qwen, prompt):
    with torch.no_grad():
        ref = qwen.to_hf().generate(prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, PROMPT:]
    assert BlockEngine(qwen, make_policy("full"), budget=64, block=B).generate(prompt, 8, Sampler()) == ref.tolist()


def test_a_compile_that_cannot_fit_is_refused_before_exporting(qwen, monkeypatch):
    pytest.importorskip("tvm")
    import edgekv.compiler.frontend.export as export
    import edgekv.memory as memory
    from edgekv.compiler import compile_model
    from edgekv.compiler.errors import CompileError

    monkeypatch.setattr(memory, "available_bytes", lambda: (1 << 20, "what this test leaves"))
    monkeypatch.setattr(export, "export_plain_forward", lambda *a: pytest.fail("exported before refusing"))
    with pytest.raises(CompileError, match=r"needs about .* more memory \(laid-out params .* TVM build .*\).* "
                                           r"1\.0MiB is left \(what this test leaves\)"):
        compile_model(qwen, make_policy("keydiff"), 16, B, target=TEST_TARGET)


def test_imported_weights_are_the_models_own_tensors(qwen):
    pytest.importorskip("tvm")
    from edgekv.compiler import import_model

    _, params, _ = import_model(qwen, B)
    by_name = {n.removeprefix("p_w_").replace("__", "."): a for n, a in params}
    for name, tensor in qwen.weights.items():
        assert np.shares_memory(by_name[name], tensor.numpy()), name  # views, not copies
