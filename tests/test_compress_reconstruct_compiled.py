"""`--compress reconstruct` compiled (issue 34): the reconstruction rows ride the compiled prefill step
as its extra rows (``compiler/passes/pseudo_rows.py``) and the policy's observe kernel scores them
(``compiler/policy_kernels/reconstruct.py``); the artifact declares the rows in its manifest
(``pseudo_rows.positions`` = "reconstruct", the repeat prompt's ids in ``policy.kernel_params``).

On a tiny random model: TVM's VM keeps the eager engine's sets after a document longer than N, then
after a question and a few decode steps, and from a saved cache; a document within N carries no rows
in either."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.compiler import compile_model  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.policies.reconstruct import RepeatPrompt  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402
from tests.compiled_checks import assert_same_kept_sets as same_sets, relative_error as _rel  # noqa: E402

TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}
B, N = 8, 16
DOC = np.random.default_rng(1).integers(1, 250, 60)
QUESTION = np.array([5, 9, 11, 200, 17, 3])
PROMPT = RepeatPrompt(first=(7, 8, 9), later=(10, 11), suffix=(12,))


def policy(score="kvzip"):
    p = make_policy("reconstruct", {"score": score})
    p.set_repeat_prompt(PROMPT)
    return p


@pytest.fixture(scope="module", params=["kvzip", "aligned"])
def score(request):
    """Each scoring (``--policy-arg score=``) compiled and held against the engine."""
    return request.param


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def artifact(model, score, tmp_path_factory):
    out = tmp_path_factory.mktemp("reconstruct") / "art"
    compile_model(model, policy(score), N, B, target=TARGET, out_dir=out)
    return out




def test_manifest_declares_the_rows(artifact, score):
    rt = HostRuntime(artifact)
    m = rt.manifest
    assert m.policy_name == "reconstruct" and m.extra_rows == 32 + B
    assert m.pseudo_rows["positions"] == "reconstruct"
    kp = m.raw["policy"]["kernel_params"]
    assert (kp["first"], kp["later"], kp["suffix"], kp["tail"], kp["sinks"]) == ([7, 8, 9], [10, 11], [12], 8, 4)
    assert kp["aligned"] == (score == "aligned")


def test_compiled_keeps_the_engines_sets(model, artifact, score):
    rt, eng = HostRuntime(artifact), BlockEngine(model, policy(score), N, B)
    assert _rel(rt.prefill(DOC), eng.prefill(torch.as_tensor(DOC)).numpy()) < 1e-3
    same_sets(rt, eng, "after the document")
    got, want = rt.prefill(QUESTION), eng.prefill(torch.as_tensor(QUESTION)).numpy()
    assert _rel(got, want) < 1e-3
    same_sets(rt, eng, "after the question")
    for _ in range(3):
        tok = int(np.argmax(got))
        got, want = rt.decode(tok), eng.decode(tok).numpy()
        assert _rel(got, want) < 1e-3
    same_sets(rt, eng, "after decoding")


def test_compiled_saved_cache_answers_as_one_run(artifact, tmp_path):
    one = HostRuntime(artifact)
    one.prefill(DOC)
    a = one.prefill(QUESTION)
    saved = HostRuntime(artifact)
    saved.prefill(DOC)
    saved.save_cache(tmp_path / "doc.ekv")
    later = HostRuntime(artifact)
    later.load_cache(tmp_path / "doc.ekv")
    b = later.prefill(QUESTION)
    np.testing.assert_array_equal(a, b)
    for layer in range(2):
        np.testing.assert_array_equal(one.kept_positions(layer), later.kept_positions(layer))


def test_document_within_the_budget_carries_no_rows(model, artifact, score):
    rt, eng = HostRuntime(artifact), BlockEngine(model, policy(score), N, B)
    short = DOC[:N]
    assert _rel(rt.prefill(short), eng.prefill(torch.as_tensor(short)).numpy()) < 1e-3
    got, want = rt.prefill(QUESTION), eng.prefill(torch.as_tensor(QUESTION)).numpy()
    assert _rel(got, want) < 1e-3
    same_sets(rt, eng, "a short document, then the question")


@pytest.mark.skipif(not __import__("edgekv.runtime.native", fromlist=["available"]).available(),
                    reason="the native runtime is not built: `pip install -e .` builds runtime/ (cmake, a C compiler)")
def test_native_runtime_fills_the_same_rows(artifact, tmp_path):
    """The C runtime builds each block's rows from program.ekv's settings (runtime/src/reconstruct.c):
    the same kept sets and logits as TVM's VM block by block, then a question, and from a saved cache
    through `edgekv-run --save-cache` / `--load-cache`."""
    from edgekv.runtime import native

    nat, host = native.NativeRuntime(artifact), HostRuntime(artifact)
    host.prepare(DOC)
    kept_host = []
    for s in range(0, DOC.size, B):
        host.step_block(DOC[s:s + B])
        kept_host.append([host.kept_positions(layer) for layer in range(2)])
    kept_nat = []
    nat.prefill(DOC, on_block=lambda rt: kept_nat.append([rt.kept_positions(layer) for layer in range(2)]))
    assert len(kept_nat) == len(kept_host)
    for a, b in zip(kept_host, kept_nat):
        for layer in range(2):
            np.testing.assert_array_equal(a[layer], b[layer])
    got, want = nat.prefill(QUESTION), host.prefill(QUESTION)
    assert _rel(got, want) < 1e-5
    nat.reset()
    nat.prefill(DOC)
    nat.save_cache(tmp_path / "nat.ekv")
    again = native.NativeRuntime(artifact)
    again.load_cache(tmp_path / "nat.ekv")
    assert _rel(again.prefill(QUESTION), want) < 1e-5


@pytest.mark.slow  # builds the JNI bridge and runs a JVM (about a minute); the app's own tests cover the bridge
def test_app_bridge_saves_and_answers_a_reconstruct_document(tmp_path_factory, tmp_path):
    """The app's Engine through the JNI bridge on a desktop JVM (tests/test_android_app.py's HostCheck)
    on a reconstruct artifact: the first question reads the document (rows on every block) and saves
    its cache, the later ones load it; the same ids as edgekv-run on the same artifact."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_android_app as app

    bridge = app._build_bridge(tmp_path_factory.mktemp("bridge"), sanitize=False)
    # a byte-level tokenizer spells the repeat prompt one byte a row: room for it
    art = app._host_artifact(tmp_path_factory, "reconstruct", {"prompt_rows": 80})
    got = app._host_check(bridge, art, tmp_path, app.QUESTIONS)
    assert got["info"]["policy"] == "reconstruct" and len(app.DOCUMENT.encode("utf-8")) > got["info"]["budget"]
    want = app._edgekv_run_answers(art, tmp_path, app.QUESTIONS)
    answers = got["answers"]
    assert [a["generated_ids"] for a in answers] == [w["generated_ids"] for w in want]
    assert [a["from_snapshot"] for a in answers] == [False, True, True]
