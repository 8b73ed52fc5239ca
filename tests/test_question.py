"""Question-aware block-wise prefill (issue 16), in the eager engine: with the question known, a
query-aware policy scores every evicting block with the question's queries — the question's
tokens run after the block at their true future positions, as extra rows that never enter the
cache — while query-agnostic policies run unchanged. Through the CLI: `run --question` reads the
document once per question for such a policy, and a saved cache records its question."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgekv.engine import BlockEngine
from edgekv.models import tiny_random_model
from edgekv.policies import REGISTRY, PolicyError, make_policy
from edgekv.policies.attention_rows import attention_column_sums, attention_rows, group_reduce
from edgekv.policies.base import EvictionContext

B, N = 8, 16
DOC = torch.tensor(np.random.default_rng(1).integers(1, 250, 60))
QUESTION = torch.tensor([5, 9, 11, 200, 17, 3])
ARGS = {"dapq": {"window": 4}, "lagkv": {"sinks": 2, "lag": 2}}


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


def kept_after(model, name, question, budget=N):
    e = BlockEngine(model, make_policy(name, ARGS.get(name, {})), budget, B, question_rows=8)
    logits = e.prefill(DOC, question=question)
    return [e.kept_positions(layer).sort(dim=1).values for layer in range(2)], logits


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_question_rows_never_enter_the_cache_and_agnostic_policies_do_not_change(model, name):
    budget = 128 if name == "full" else N
    with_q, logits_q = kept_after(model, name, QUESTION, budget)
    without, logits = kept_after(model, name, None, budget)
    for kept in with_q:
        assert int(kept.max()) < DOC.numel()  # only document positions: the question's rows were never kept
    # the logits are the document's last token's, whatever scored the blocks before it
    if not REGISTRY[name].uses_question:
        assert all(torch.equal(a, b) for a, b in zip(with_q, without))
        torch.testing.assert_close(logits_q, logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in sorted(REGISTRY) if REGISTRY[n].uses_question])
def test_with_room_for_everything_the_question_changes_nothing(model, name):
    """N ≥ the prompt: nothing is evicted, so the logits are the full cache's exactly."""
    e = BlockEngine(model, make_policy(name, ARGS.get(name, {})), 128, B, question_rows=8)
    full = BlockEngine(model, make_policy("full", {}), 128, B)
    torch.testing.assert_close(e.prefill(DOC, question=QUESTION), full.prefill(DOC), rtol=0, atol=0)


def _ctx(model):
    """A hand-built eviction step whose extra rows are a question (3 rows after 12 candidates)."""
    g = torch.Generator().manual_seed(0)
    H, Hq, D, n, w = 2, 4, 16, 12, 3
    return EvictionContext(
        layer=0, num_layers=2, budget=8, keys=torch.randn(H, n, D, generator=g), values=torch.randn(H, n, D, generator=g),
        positions=torch.arange(n).repeat(H, 1), n_cache=n - 4, is_prefill=True, scale=0.25,
        queries=torch.randn(Hq, 4, D, generator=g), query_positions=torch.arange(n - 4, n),
        extra_queries=torch.randn(Hq, w, D, generator=g), extra_query_positions=torch.arange(20, 20 + w),
        extra_is_question=True)


def test_policies_score_with_the_question_rows(model):
    ctx = _ctx(model)
    rows = attention_rows(ctx.keys, ctx.positions, ctx.extra_queries, ctx.extra_query_positions, ctx.scale)
    # TOVA: the question's last row, group-averaged
    tova = make_policy("tova", {}).score(ctx)
    torch.testing.assert_close(tova, group_reduce(rows[:, -1], 2, "mean"))
    # SnapKV: every question row votes (window ≥ 3), nothing among the candidates is pinned
    snap = make_policy("snapkv", {"window": 32, "kernel": 1}).score(ctx)
    torch.testing.assert_close(snap, group_reduce(rows.sum(dim=1), 2, "mean"))
    assert torch.isfinite(snap).all()
    # H2O: the accumulated attention plus the question's column sums
    ctx.state = {"h2o_acc": torch.zeros(2, 12)}
    h2o = make_policy("h2o", {"recent_ratio": 0.0}).score(ctx)
    sums = attention_column_sums(ctx.keys, ctx.positions, ctx.extra_queries, ctx.extra_query_positions, ctx.scale)
    torch.testing.assert_close(h2o, group_reduce(sums, 2, "mean"))


def test_bad_questions_are_refused(model):
    e = BlockEngine(model, make_policy("snapkv", {}), N, B, question_rows=4)
    with pytest.raises(PolicyError, match="the question is empty"):
        e.prefill(DOC, question=torch.tensor([], dtype=torch.long))
    with pytest.raises(PolicyError, match="room for 4 question rows"):
        e.prefill(DOC, question=QUESTION)
    assert e._question is None  # a refused prefill leaves no question behind


# ---- through the CLI ------------------------------------------------------------------------------

def test_cli_question_scoring(tiny_dir, tmp_path):
    from typer.testing import CliRunner

    from edgekv.artifact import snapshot_file as sf
    from edgekv.cli import app

    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. The dog lay by the door. " * 10)
    runner = CliRunner()
    out, snap = tmp_path / "r.json", tmp_path / "doc.ekv"
    res = runner.invoke(app, ["run", str(tiny_dir), "--prompt-file", str(doc), "--question", "Where?", "--question",
                              "Who?", "--policy", "snapkv", "--budget", "32", "--block", "8", "--max-new-tokens", "4",
                              "--save-cache", str(snap), "-o", str(out)])
    assert res.exit_code == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["question_scoring"] is True and report["document"]["document_reads"] == 2
    assert sf.read_header(snap).question == "Where?"  # the saved cache is the first question's
    # each answer equals a run with that question alone
    for i, q in enumerate(("Where?", "Who?")):
        one = tmp_path / f"one{i}.json"
        res = runner.invoke(app, ["run", str(tiny_dir), "--prompt-file", str(doc), "--question", q, "--policy", "snapkv",
                                  "--budget", "32", "--block", "8", "--max-new-tokens", "4", "-o", str(one)])
        assert res.exit_code == 0, res.stdout + res.stderr
        assert json.loads(one.read_text())["document"]["answers"][0]["generated_ids"] == \
            report["document"]["answers"][i]["generated_ids"]
    # asking the saved cache another question warns; its own question does not
    res = runner.invoke(app, ["ask", str(snap), "--question", "Other?", "--max-new-tokens", "2"])
    assert res.exit_code == 0 and "was made knowing the question" in " ".join(res.stderr.split())
    res = runner.invoke(app, ["ask", str(snap), "--question", "Where?", "--max-new-tokens", "2"])
    assert res.exit_code == 0 and "was made knowing" not in res.stderr
    # a query-agnostic policy reads the document once
    res = runner.invoke(app, ["run", str(tiny_dir), "--prompt-file", str(doc), "--question", "Where?", "--question",
                              "Who?", "--policy", "keydiff", "--budget", "32", "--block", "8", "--max-new-tokens", "4",
                              "-o", str(out)])
    assert res.exit_code == 0
    report = json.loads(out.read_text())
    assert report["question_scoring"] is False and report["document"]["document_reads"] == 1


# ---- edgekv eval --question -------------------------------------------------------------------------

def test_passkey_prompts_split_at_their_question(smol):
    from edgekv.evaluation.tasks import QUESTION, build_passkey

    p = build_passkey(smol.tokenizer, 1024, 0.5, 0)
    assert 0 < p.question_start < p.tokens - 8
    tail = smol.tokenizer.decode(p.ids[p.question_start:])
    assert tail.startswith("\n\n" + QUESTION), tail
    assert p.answer not in smol.tokenizer.decode(p.ids[p.question_start:])


def test_eval_question_mode(smol):
    """With room for the whole prompt the question changes nothing (the same answer tokens); with
    a budget that evicts, the question-aware run is the engine's prefill(question=) path."""
    from edgekv.evaluation.runner import EvalSpec, run_one
    from edgekv.evaluation.tasks import build_passkey

    prompt = build_passkey(smol.tokenizer, 640, 0.5, 0)
    plain, asked = EvalSpec(tasks=["passkey"], policies=["snapkv"], budgets=[1024]), \
        EvalSpec(tasks=["passkey"], policies=["snapkv"], budgets=[1024], question=True)
    a = run_one(smol, prompt, "snapkv", {}, 1024, 128, plain)
    b = run_one(smol, prompt, "snapkv", {}, 1024, 128, asked)
    assert a.passkey["output_ids"] == b.passkey["output_ids"]
    # evicting: the same as prefilling the document knowing the question, then the question
    c = run_one(smol, prompt, "snapkv", {}, 256, 128, asked)
    e = BlockEngine(smol, make_policy("snapkv", {}), 256, 128, question_rows=prompt.tokens - prompt.question_start)
    e.prefill(prompt.ids[:prompt.question_start], question=prompt.ids[prompt.question_start:])
    logits = e.prefill(prompt.ids[prompt.question_start:])
    assert c.passkey["output_ids"][0] == int(torch.argmax(logits))
