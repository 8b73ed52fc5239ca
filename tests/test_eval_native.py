"""`edgekv eval MODEL --artifacts DIR,...`: compiled artifacts as runs of the sweep, through the
native runtime, scored against the eager full-cache reference. A tiny random model (an HF folder
with a byte-level tokenizer and a chat template) keeps it quick; the real-model grid is
`edgekv eval qwen2.5-coder-1.5b --policy full --artifacts ...` (docs/results)."""

from __future__ import annotations

import json

import pytest

from edgekv.errors import InputError
from edgekv.evaluation import EvalSpec
from edgekv.evaluation.command import build_spec, run_eval
from edgekv.policies import make_policy
from edgekv.runtime import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native runtime: pip install -e . builds it")

CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def chat_tiny_dir(tmp_path_factory):
    """The tiny random model as an HF folder whose tokenizer has a chat template (eval needs one)."""
    from conftest import byte_tokenizer

    from edgekv.models import tiny_random_model

    d = tmp_path_factory.mktemp("tiny_chat")
    tiny_random_model(0).to_hf().save_pretrained(d)
    tok = byte_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def artifacts(chat_tiny_dir, tmp_path_factory):
    """Two compiles of that model: KeyDiff at N = 64 (evicts) and a full cache at N = 2048 (never does)."""
    from edgekv.compiler import compile_model
    from edgekv.models import load_model

    model = load_model(str(chat_tiny_dir))
    root = tmp_path_factory.mktemp("eval-native")
    compile_model(model, make_policy("keydiff"), 64, 32, "host", root / "kd64")
    compile_model(model, make_policy("full"), 2048, 32, "host", root / "full")
    return root / "kd64", root / "full"


def _spec(artifacts: str) -> EvalSpec:
    return build_spec("passkey", "full,keydiff", "64", "32", False, "1k", "0.5", "0", 2, "repeat", 4, "2k", 512, 4,
                      None, artifacts=artifacts)


def test_artifacts_run_beside_the_policies(chat_tiny_dir, artifacts, tmp_path):
    kd, full = artifacts
    spec = _spec(f"{kd},{full}")
    assert spec.policies == ["full", "keydiff", "keydiff (fp32, native)", "full (fp32, native)"]
    data = run_eval(spec, tmp_path, model_name=str(chat_tiny_dir), argv=["edgekv", "eval", "(test)"],
                    progress=False, threads=1)
    rows = {r["policy"]: r for r in data["results"]}
    native_kd, native_full = rows["keydiff (fp32, native)"], rows["full (fp32, native)"]
    # each artifact's row carries its own N and B and its manifest's policy, never the reference's
    assert (native_kd["budget"], native_kd["block"]) == (64, 32)
    assert native_kd["policy_params"]["artifact"] == "kd64" and not native_kd["reused_reference"]
    assert (native_full["budget"], native_full["block"]) == (2048, 32) and native_full["error"] is None
    # the full-cache artifact answers as the eager full cache, and the compiled KeyDiff as the eager one
    # (the compiled eviction equals the eager policy: tests/test_compiled_*)
    assert native_full["agrees_with_full"] and native_full["output_ids"] == rows["full"]["output_ids"]
    assert native_kd["output_ids"] == rows["keydiff"]["output_ids"]
    summary = [s for s in data["summary"] if s["policy"] == "full (fp32, native)"]
    assert summary and summary[0]["accuracy_interval95"][1] > summary[0]["accuracy_interval95"][0]
    assert "| keydiff (fp32, native) |" in (tmp_path / "results.md").read_text()


def test_the_native_engine_reads_kept_positions_from_the_runtime(artifacts):
    """needle_retention reads each layer's kept positions through NativeEngine: the N = 64 cache
    holds 64 distinct positions of a 200-token prompt, the full one all 200."""
    import torch

    from edgekv.evaluation.native_runs import NativeEngine, describe_artifacts

    ids = torch.randint(0, 200, (200,), generator=torch.Generator().manual_seed(0))
    for path, held in zip(artifacts, (64, 200)):
        run = next(iter(describe_artifacts([str(path)]).values()))
        engine = NativeEngine(run, threads=1)
        try:
            logits = engine.prefill(ids)
            assert logits.ndim == 1 and torch.isfinite(logits).all()
            pos = engine.kept_positions(0)
            assert pos.shape[1] == held and all(len(set(h.tolist())) == held for h in pos)
            assert len(engine.caches) == engine.rt.num_layers
        finally:
            engine.close()


def test_resume_reuses_the_artifact_rows(chat_tiny_dir, artifacts, tmp_path, monkeypatch):
    kd, _ = artifacts
    spec = _spec(str(kd))
    first = run_eval(spec, tmp_path, model_name=str(chat_tiny_dir), argv=["edgekv"], progress=False, threads=1)
    from edgekv.evaluation import runner

    def no_runs(*args, **kwargs):
        raise AssertionError("a finished prompt ran again under --resume")

    monkeypatch.setattr(runner, "run_one", no_runs)
    again = run_eval(spec, tmp_path, model_name=str(chat_tiny_dir), argv=["edgekv"], progress=False, threads=1,
                     resume=True)
    assert json.dumps(again["results"], sort_keys=True) == json.dumps(first["results"], sort_keys=True)


def test_policy_none_runs_only_the_artifacts(artifacts):
    kd, _ = artifacts
    spec = build_spec("passkey", "none", "64", "32", False, "1k", "0.5", "0", 2, "repeat", 4, "2k", 512, 4, None,
                      artifacts=str(kd))
    assert spec.policies == ["keydiff (fp32, native)"]
    with pytest.raises(InputError, match="--policy none runs no policy"):
        build_spec("passkey", "none", "64", "32", False, "1k", "0.5", "0", 2, "repeat", 4, "2k", 512, 4, None)


def test_a_folder_that_is_no_artifact_is_refused_before_loading(tmp_path):
    with pytest.raises(InputError, match="--artifacts .*not a readable edgekv artifact"):
        _spec(str(tmp_path))


def test_an_artifact_of_another_model_is_refused_before_the_first_prompt(chat_tiny_dir, artifacts, tmp_path):
    import shutil

    kd, _ = artifacts
    other = shutil.copytree(chat_tiny_dir, tmp_path / "another-model")  # the same weights under another name
    spec = _spec(str(kd))
    with pytest.raises(InputError, match="was compiled from .*not the eval's model"):
        run_eval(spec, tmp_path / "out", model_name=str(other), argv=["edgekv"], progress=False, threads=1)
    assert not (tmp_path / "out").exists()
