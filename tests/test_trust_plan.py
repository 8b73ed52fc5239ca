"""The cache a run plans is never larger than its longest sequence needs (issue 31, item 6): with a
budget above prompt + output (`--policy full --budget 4k` on a short prompt) the eager engine's plan
equals the full cache of the sequence, for a plain prompt and for a document with its questions
(document + longest question + output); only a cache saved for later questions keeps N + B."""

from __future__ import annotations

import re

import pytest

from trust_common import byte_tokenizer, edgekv

DOC = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from edgekv.models import tiny_random_model

    path = tmp_path_factory.mktemp("plan") / "hf"
    tiny_random_model(0).to_hf().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _kv(stdout_and_err: str) -> tuple[str, str]:
    m = re.search(r"KV cache (\S+) \(N=4,096, B=128\) vs (\S+) for the full cache", stdout_and_err)
    assert m, stdout_and_err
    return m.group(1), m.group(2)


@pytest.mark.parametrize("extra", [[], ["--question", "what?"], ["--question", "what?", "--question", "who is lazy?"]],
                         ids=["prompt", "document-one-question", "document-two-questions"])
def test_a_budget_above_the_sequence_plans_only_the_sequence(hf, extra):
    res = edgekv("run", hf, "--prompt", DOC, *extra, "--policy", "full", "--budget", "4k", "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr
    plan, full = _kv(res.stderr)
    assert plan == full, res.stderr  # N + B = 4224 entries would be ~60 times the sequence's cache


def test_a_saved_cache_keeps_room_for_later_questions_and_says_so(hf, tmp_path):
    res = edgekv("run", hf, "--prompt", DOC, "--question", "what?", "--save-cache", tmp_path / "doc.ekv",
                 "--policy", "full", "--budget", "4k", "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr
    plan, full = _kv(res.stderr)
    assert plan != full and "room for later questions" in res.stderr, res.stderr
