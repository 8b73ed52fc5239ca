"""Issue 34's evaluation side: the varied haystack and many questions of one saved document.

Quick tier: a tiny random model with a byte-level tokenizer and a ChatML template. What is checked:
the varied haystack is natural prose from both sources, deterministic per seed and free of digits;
a document's needles sit where the builder says (their value tokens decode to the value); asking
from the saved cache gives exactly the answers of reading the document and the question in one go;
the question-aware ceiling reads once per question and the others once; a compression mode the
session lacks is reported unavailable; the results tool's summary counts and bounds what it should.
The real-model grid is `tools/results/results_many_questions.py` (docs/results/question_sweep.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from edgekv.engine import BlockEngine
from edgekv.errors import InputError
from edgekv.evaluation import questions as qs
from edgekv.evaluation.tasks import HAYSTACKS, NEEDLE_PHRASINGS, build_passkey
from edgekv.models import tiny_random_model
from edgekv.policies import make_policy

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


pytestmark = pytest.mark.usefixtures("one_thread")  # every read here: one torch thread (conftest)


@pytest.fixture(scope="module")
def tiny_chat(one_thread):
    from tests.conftest import byte_tokenizer

    model = tiny_random_model(0)
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    model.tokenizer = tok
    return model


# ---- the varied haystack -------------------------------------------------------------------------
def test_varied_haystack_is_deterministic_prose_from_both_sources():
    corpus = pytest.importorskip("edgekv.corpus")
    try:
        opticks = corpus.source_paragraphs("opticks")
    except corpus.CorpusError as exc:
        pytest.skip(str(exc))  # says what to install
    pydoc = corpus.source_paragraphs("pydoc")
    assert len(opticks) > 300 and len(pydoc) > 50
    a, b = corpus.varied_paragraphs(3, 4000), corpus.varied_paragraphs(3, 4000)
    assert a == b and a != corpus.varied_paragraphs(4, 4000)
    assert any(p in opticks for p in a) and any(p in pydoc for p in a)
    assert not any(re.search(r"\d", p) for p in a)  # no number competes with the needles'
    assert sum(len(p.split()) for p in a) >= 4000
    assert HAYSTACKS[0] == "varied"


def test_passkey_default_is_varied_with_varied_phrasings(tiny_chat):
    tok = tiny_chat.tokenizer
    prompts = [build_passkey(tok, 900, 0.5, seed) for seed in range(8)]
    assert all(p.haystack == "varied" and p.id.endswith("-varied") for p in prompts)
    texts = [tok.decode(p.ids) for p in prompts]
    used = {i for t, p in zip(texts, prompts) for i, f in enumerate(NEEDLE_PHRASINGS)
            if f.format(kind="pass key", value=p.answer) in t}
    assert len(used) >= 2  # more than one phrasing over the seeds
    again = build_passkey(tok, 900, 0.5, 3)
    assert again.ids.equal(prompts[3].ids)
    repeat = build_passkey(tok, 900, 0.5, 3, haystack="repeat")  # the labelled classic variant
    assert "The grass is green." in tok.decode(repeat.ids) and "IMPORTANT: The pass key" in tok.decode(repeat.ids)


# ---- documents -----------------------------------------------------------------------------------
@pytest.mark.parametrize("task", qs.DOC_TASKS)
def test_document_needles_are_where_the_builder_says(tiny_chat, task):
    tok = tiny_chat.tokenizer
    doc = qs.build_document(tok, task, 1200, 2, keys=3)
    assert doc.id == qs.build_document(tok, task, 1200, 2, keys=3).id
    assert abs(doc.tokens + max(len(q.ids) for q in doc.questions) - 1200) < 40
    assert len(doc.needles) == len(doc.questions) == (1 if task == "passkey" else 3)
    assert sorted(q.needle for q in doc.questions) == list(range(len(doc.needles)))
    for n in doc.needles:
        assert tok.decode([doc.ids[i] for i in n.value_positions]).strip() == n.value
        assert n.position < n.value_positions[0]
    positions = [n.position for n in doc.needles]
    assert positions == sorted(positions, key=lambda p: p)  # laid out in depth order
    for q in doc.questions:
        kind = doc.needles[q.needle].kind
        assert tok.decode(q.ids).startswith("\n\n") and tok.decode(q.ids).endswith(f"The {kind} is")
        assert q.answer == doc.needles[q.needle].value
    with pytest.raises(InputError, match="unknown document task"):
        qs.build_document(tok, "passkeys", 1200, 0)


def test_method_parsing():
    assert qs.parse_method("dapq:q") == qs.Method("dapq", True, None)
    m = qs.parse_method("compress:reconstruct")
    assert m.compress == "reconstruct" and not m.question_known and m.label == "compress:reconstruct"
    assert qs.parse_method("snapkv++:q").label == "snapkv++:q"
    assert [m.label for m in qs.parse_methods(qs.DEFAULT_METHODS)][0] == "full"
    with pytest.raises(InputError, match="does not read the question"):
        qs.parse_method("keydiff:q")
    with pytest.raises(InputError, match="POLICY:q"):
        qs.parse_method("dapq:q:reconstruct")
    with pytest.raises(InputError, match="compress:MODE"):
        qs.parse_method("compress:")
    with pytest.raises(Exception, match="unknown policy"):
        qs.parse_method("nope")


def test_compression_mode_missing_from_the_tree_is_reported(monkeypatch):
    monkeypatch.setattr(qs, "compression_modes", lambda: {})
    assert "not in this tree" in qs.compress_unavailable("reconstruct")
    monkeypatch.setattr(qs, "compression_modes", lambda: {"reconstruct": "reconstruct"})
    assert qs.compress_unavailable("reconstruct") is None
    assert "not in this tree" in qs.compress_unavailable("zip")
    assert qs.compress_unavailable(None) is None


def _one_go(model, doc, q, policy, budget, block, tokens):
    """The document and the question read in one go on a fresh engine, then greedy decoding."""
    from edgekv.session import decode_tokens

    engine = BlockEngine(model, make_policy(policy), budget, block)
    engine.prefill(torch.tensor(doc.ids))
    logits = engine.prefill(torch.tensor(q.ids))
    return decode_tokens(engine, logits, lambda x: int(torch.argmax(x)), tokens)


@pytest.mark.parametrize("policy", ["full", "keydiff"])
def test_asking_from_the_saved_cache_equals_one_uninterrupted_run(tiny_chat, policy, tmp_path):
    doc = qs.build_document(tiny_chat.tokenizer, "multikey", 700, 1, keys=3)
    method = qs.parse_method(policy)
    rows = qs.ask_document(tiny_chat, doc, method, 128, 32, max_new_tokens=4, workdir=str(tmp_path))
    assert [r["from_saved_cache"] for r in rows] == [False, True, True]
    assert {r["document_reads"] for r in rows} == {1}
    full_budget = doc.tokens + 200
    for r, q in zip(rows, doc.questions):
        ids = _one_go(tiny_chat, doc, q, policy, full_budget if policy == "full" else 128, 32, 4)
        assert r["output_text"] == tiny_chat.tokenizer.decode(ids), q.text
        assert 0.0 <= r["needle_retention"] <= 1.0
    if policy == "full":
        assert all(r["needle_retention"] == 1.0 for r in rows)
    assert list(tmp_path.iterdir()) == []  # the snapshot is gone


def test_question_aware_ceiling_reads_once_per_question_and_turns_once(tiny_chat):
    doc = qs.build_document(tiny_chat.tokenizer, "multifact", 700, 0, keys=2)
    rows = qs.ask_document(tiny_chat, doc, qs.parse_method("snapkv:q"), 128, 32, max_new_tokens=3)
    assert [r["document_reads"] for r in rows] == [2, 2] and not any(r["from_saved_cache"] for r in rows)
    turns = qs.ask_document(tiny_chat, doc, qs.parse_method("keydiff"), 128, 32, ask="turns", max_new_tokens=3)
    assert len(turns) == 2 and {r["document_reads"] for r in turns} == {1}
    assert turns[0]["output_text"] == qs.ask_document(tiny_chat, doc, qs.parse_method("keydiff"), 128, 32,
                                                      max_new_tokens=3)[0]["output_text"]


def test_unavailable_compression_gives_rows_that_say_so(tiny_chat, monkeypatch):
    doc = qs.build_document(tiny_chat.tokenizer, "passkey", 600, 0)
    monkeypatch.setattr(qs, "compression_modes", lambda: {})
    rows = qs.ask_document(tiny_chat, doc, qs.parse_method("compress:zip"), 128, 32)
    assert rows and all("compress='zip' is not in this tree" in r["unavailable"] for r in rows)


def test_scoring_numbers_words_and_other_needles(tiny_chat):
    doc = qs.build_document(tiny_chat.tokenizer, "multikey", 700, 4, keys=2)
    q = doc.questions[0]
    other = next(n.value for i, n in enumerate(doc.needles) if i != q.needle)
    assert qs.score(f" {q.answer}.", doc, q)["correct"]
    assert qs.score(f" {other}.", doc, q) == {"predicted": other, "correct": False, "answered_other": True}
    facts = qs.build_document(tiny_chat.tokenizer, "multifact", 700, 4, keys=2)
    fq = facts.questions[0]
    assert qs.score(f" {fq.answer.upper()}, of course", facts, fq)["correct"]


# ---- the results tool ----------------------------------------------------------------------------
def test_results_tool_summary_counts_and_bounds():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.results import results_many_questions as tool

    def row(doc, method, correct, budget=1024, q="Q1", known=False, reads=1):
        return {"document": doc, "task": "multikey", "length_target": 7168, "budget": budget, "ask": "snapshot",
                "method": method, "haystack": "varied", "question": q, "answer": "12345", "correct": correct,
                "question_known": known, "needle_retention": 1.0 if correct else 0.0, "document_reads": reads,
                "document_seconds": 1.0, "answered_other": False}

    rows = [row(d, "full", True, budget=None, q=q) for d in ("multikey-L7168-i0", "multikey-L7168-i1") for q in ("Q1", "Q2")]
    rows += [row("multikey-L7168-i0", "keydiff", True), row("multikey-L7168-i0", "keydiff", False, q="Q2"),
             row("multikey-L7168-i1", "keydiff", False), row("multikey-L7168-i1", "keydiff", False, q="Q2")]
    rows += [dict(row("multikey-L7168-i0", "compress:reconstruct", False), unavailable="not here")]
    data = tool.summarize(rows)
    cell = next(c for c in data["cells"] if c["method"] == "keydiff")
    assert (cell["correct"], cell["questions"], cell["documents"], cell["full_cache_correct"]) == (1, 4, 2, 4)
    lo, hi = cell["interval95"]
    assert 0 < lo < 0.25 < hi < 1 and cell["of_full_cache"] == 0.25
    assert next(c for c in data["cells"] if c["method"] == "compress:reconstruct")["unavailable"] == "not here"
    md = tool.markdown({"provenance": {"command": "x", "commit": "0" * 40, "started": "now"}, "runs": [], **data},
                       "question_sweep", "")
    assert "1/4 = 25%" in md and "unavailable" in md


# ---- the real model (slow) -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_full_cache_answers_a_varied_multikey_document_from_its_saved_cache(smol, one_thread):
    """The varied haystack is a task the full cache can do: of a 2K multi-key document's four codes, each
    asked of the one saved cache, the full cache answers at least three (SmolLM2-135M answered one with
    another code's value when checked: 3 of 4); a starved query-agnostic cache loses the needles."""
    doc = qs.build_document(smol.tokenizer, "multikey", 2048, 0, keys=4)
    full = qs.ask_document(smol, doc, qs.parse_method("full"), 0, 128)
    assert sum(r["correct"] for r in full) >= 3, [(r["answer"], r["output_text"]) for r in full]
    assert [r["from_saved_cache"] for r in full] == [False, True, True, True]
    assert all(r["needle_retention"] == 1.0 for r in full)
    starved = qs.ask_document(smol, doc, qs.parse_method("keydiff"), 192, 128)
    assert all(r["needle_retention"] < 1 for r in starved)
