"""Compiled question rows (issue 16, `edgekv compile --question-rows Q`): the document's question
scores every block inside the compiled model, as the eager engine's ``prefill(question=)`` does.

On a tiny random model: the compiled artifact (TVM's VM and the native runtime) keeps the eager
engine's sets after the document read with the question, then after the question itself and a
few decode steps; without a question the same artifact equals the engine without one (the
padding rows are inert); bad input is refused with the fix (no question rows, a question longer
than the artifact's rows, an empty question, a policy that cannot use a question, a GPU target)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.compiler import CompileError, compile_model  # noqa: E402
from edgekv.compiler.driver import check_policy_builds_for  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.policies.base import PolicyError  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402
from tests.compiled_checks import assert_same_kept_sets as assert_same_sets, relative_error as _rel  # noqa: E402
from edgekv.runtime import native  # noqa: E402

TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}
B, N, Q = 8, 16, 8
DOC = np.random.default_rng(1).integers(1, 250, 60)
QUESTION = np.array([5, 9, 11, 200, 17, 3])
ARGS = {"dapq": {"window": 4, "prefix": 1, "kernel": 3}, "snapkv": {"window": 4}, "snapkv++": {"window": 4, "kernel": 3}}
_BUILT: dict = {}


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


def built(model, name, tmp_path_factory, question_rows=Q):
    key = (name, question_rows)
    if key not in _BUILT:
        out = tmp_path_factory.mktemp(f"question-{name}") / "art"
        compile_model(model, make_policy(name, ARGS.get(name, {})), N, B, target=TARGET, out_dir=out,
                      question_rows=question_rows)
        _BUILT[key] = out
    return _BUILT[key]


def engine(model, name):
    return BlockEngine(model, make_policy(name, ARGS.get(name, {})), N, B, question_rows=Q)




def check_against_engine(model, rt, name, question):
    """Document (with ``question`` scoring its blocks), then the question, then 3 greedy steps."""
    eng = engine(model, name)
    got = rt.prefill(DOC, question=question) if question is not None else rt.prefill(DOC)
    want = eng.prefill(torch.as_tensor(DOC), question=None if question is None else torch.as_tensor(question))
    assert _rel(got, want.numpy()) < 1e-3
    assert_same_sets(rt, eng, "after the document")
    for layer in range(2):  # the question's rows never enter the cache
        assert rt.kept_positions(layer).max() < DOC.size
    got, want = rt.prefill(QUESTION), eng.prefill(torch.as_tensor(QUESTION)).numpy()
    assert _rel(got, want) < 1e-3
    assert_same_sets(rt, eng, "after the question")
    for _ in range(3):
        tok = int(np.argmax(got))
        got, want = rt.decode(tok), eng.decode(tok).numpy()
        assert _rel(got, want) < 1e-3
    assert_same_sets(rt, eng, "after decoding")
    return eng


@pytest.mark.parametrize("name", ["snapkv++", "dapq", pytest.param("snapkv", marks=pytest.mark.slow),
                                  pytest.param("tova", marks=pytest.mark.slow), pytest.param("h2o", marks=pytest.mark.slow)])
def test_compiled_question_rows_keep_the_engines_sets(model, name, tmp_path_factory):
    art = built(model, name, tmp_path_factory)
    rt = HostRuntime(art)
    assert rt.manifest.question_rows == Q and rt.manifest.extra_rows == max(Q, ARGS.get(name, {}).get("window", 0)
                                                                              if name == "dapq" else 0)
    with_q = check_against_engine(model, rt, name, QUESTION)
    rt.reset()
    without = check_against_engine(model, rt, name, None)  # padding rows only: the engine without a question
    # the question changed what was kept (else this setup would not test anything)
    assert any(not torch.equal(with_q.kept_positions(layer).sort(1).values, without.kept_positions(layer).sort(1).values)
               for layer in range(2)) or name in ("tova", "h2o")


@pytest.mark.skipif(not native.available(), reason="the native runtime is not built: `pip install -e .` builds "
                                                    "runtime/ (needs cmake and a C compiler)")
@pytest.mark.parametrize("name", ["snapkv++", "dapq"])
def test_native_runtime_takes_the_question(model, name, tmp_path_factory):
    art = built(model, name, tmp_path_factory)
    nat, host = native.NativeRuntime(art), HostRuntime(art)
    assert nat.question_rows == Q
    for question in (QUESTION, None):
        got = nat.prefill(DOC, question=question)
        want = host.prefill(DOC, question=question)
        assert _rel(got, want) < 1e-4
        for layer in range(2):
            np.testing.assert_array_equal(nat.kept_positions(layer), host.kept_positions(layer))
        got, want = nat.prefill(QUESTION), host.prefill(QUESTION)
        assert _rel(got, want) < 1e-4
        nat.reset()
        host.reset()
    with pytest.raises(PolicyError, match="--question-rows 9 or more"):
        nat.prefill(DOC, question=np.arange(1, 10))
    with pytest.raises(PolicyError, match="empty"):
        nat.prefill(DOC, question=np.array([], dtype=np.int64))
    assert nat.position == 0  # nothing was read


def test_question_errors(model, tmp_path_factory):
    rt = HostRuntime(built(model, "snapkv++", tmp_path_factory))
    with pytest.raises(PolicyError, match="--question-rows 9 or more"):
        rt.prefill(DOC, question=np.arange(1, 10))
    with pytest.raises(PolicyError, match="empty"):
        rt.prefill(DOC, question=[])
    assert rt.position == 0
    for name, why in (("keydiff", "does not score blocks with a question"), ("d2o", "does not score blocks")):
        with pytest.raises(CompileError, match=why):
            compile_model(model, make_policy(name), N, B, target=TARGET, question_rows=Q)
    with pytest.raises(CompileError, match="no GPU kernels"):
        check_policy_builds_for(make_policy("snapkv++"), {"kind": "opencl"}, question_rows=Q)
    with pytest.raises(CompileError, match="≥ 0"):
        compile_model(model, make_policy("snapkv++"), N, B, target=TARGET, question_rows=-1)


@pytest.mark.skipif(not native.available(), reason="the native runtime is not built: `pip install -e .`")
def test_artifact_without_question_rows_refuses_a_question(model, tmp_path_factory):
    art = built(model, "snapkv++", tmp_path_factory, question_rows=0)
    for rt in (HostRuntime(art), native.NativeRuntime(art)):
        with pytest.raises(PolicyError, match="compiled without question rows"):
            rt.prefill(DOC, question=QUESTION)
