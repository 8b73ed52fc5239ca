"""The one runtime face (edgekv/session.py): the token loop written once, and every runtime
(the eager engine, HostRuntime, NativeRuntime) has the Session protocol's members."""

from __future__ import annotations

import pytest

from edgekv.session import Session, decode_tokens, generate


class Counting:
    """A session whose logits are the next token id: the loop's decisions are visible."""

    def __init__(self, start: int = 10):
        self.next, self.decoded, self.prefilled = start, [], []

    def prefill(self, prompt_ids, progress=None, question=None):
        self.prefilled.append(list(prompt_ids))
        if progress is not None:
            progress(len(prompt_ids))
        return self.next

    def decode(self, token_id):
        self.decoded.append(token_id)
        self.next = token_id + 1
        return self.next


def test_generate_stops_at_max_new_tokens_without_a_decode_after_the_last():
    s = Counting()
    seen, done = [], []
    assert generate(s, [1, 2, 3], int, 4, on_token=seen.append, progress=done.append) == [10, 11, 12, 13]
    assert seen == [10, 11, 12, 13] and s.decoded == [10, 11, 12] and done == [3] and s.prefilled == [[1, 2, 3]]


def test_eos_ends_the_loop_and_is_included():
    s = Counting()
    assert decode_tokens(s, 10, int, 8, eos_ids=(12,)) == [10, 11, 12]
    assert s.decoded == [10, 11]


def test_no_tokens_asked_is_a_prefill_only():
    s = Counting()
    assert generate(s, [1], int, 0) == [] and s.decoded == []


def _members() -> set[str]:
    return {name for name in vars(Session) if not name.startswith("_")} | set(Session.__annotations__)


@pytest.mark.parametrize("where", ["edgekv.engine.session:EagerSession", "edgekv.runtime.host:HostRuntime",
                                   "edgekv.runtime.native:NativeRuntime"])
def test_every_runtime_has_the_session_members(where):
    import importlib

    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    attributes = {"budget", "block", "question_rows", "position"}  # set per instance in some runtimes
    missing = [m for m in _members() - attributes if not hasattr(cls, m)]
    assert not missing, f"{name} lacks {missing}"
