"""Read a document once, ask many questions (``--question``, ``--save-cache``, ``edgekv ask``).

The document is prefilled block-wise once; its compressed cache is saved to a snapshot
(``edgekv/artifact/snapshot_file.py``: ``--save-cache``, or a temporary file when several
questions need it) and mapped back before every question but the first, so no answer leaks
into the next question's cache. Each question is the question part of the chat split
(``edgekv.models.chat``), prefilled as a continuation of the document, then decoded.

One loop serves every runtime: the eager engine, HostRuntime and the native runtime are each a
``Session`` (``edgekv/session.py``: ``prefill`` / ``decode`` / ``save_cache`` / ``load_cache`` over
the same snapshot format), and each answer is the session's token loop (``decode_tokens``). Times
are taken here, around the calls, so they mean the same thing in each."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import InputError
from .session import Session, decode_tokens


@dataclass
class Answer:
    question: str
    question_tokens: int
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""
    load_seconds: float = 0.0          # mapping the snapshot back before this question (0: continued live)
    prefill_seconds: float = 0.0       # the question's own prefill
    first_token_seconds: float = 0.0   # from the start of this question (load included) to its first token
    decode_seconds: float = 0.0

    def to_dict(self) -> dict:
        decoded = max(0, len(self.generated_ids) - 1)  # the first token comes from the prefill's logits
        return {"question": self.question, "question_tokens": self.question_tokens, "text": self.text,
                "generated_ids": self.generated_ids, "generated_tokens": len(self.generated_ids),
                "load_seconds": self.load_seconds, "question_prefill_seconds": self.prefill_seconds,
                "time_to_first_token_seconds": self.first_token_seconds,
                "decode_tok_s": decoded / self.decode_seconds if self.decode_seconds else None}


@dataclass
class DocumentRun:
    """What the document part of a run did, for the report."""

    document_tokens: int
    prefill_seconds: float = 0.0           # this run's document prefill (0 when it came from a snapshot)
    saved_cache: str | None = None
    snapshot_bytes: int | None = None
    loaded_cache: str | None = None
    prefill_seconds_when_saved: float = 0.0  # the loaded snapshot's document prefill, measured when it was made
    made_for_question: str = ""
    document_reads: int = 0  # 0 from a saved cache, 1, or one per question (question-aware scoring)
    answers: list[Answer] = field(default_factory=list)

    def to_dict(self) -> dict:
        answers = [a.to_dict() for a in self.answers]
        fresh_document = self.prefill_seconds or self.prefill_seconds_when_saved
        # each answer's first token from the saved state, against reading the document again first
        ttft = [{"question": a.question, "from_snapshot_seconds": a.first_token_seconds,
                 "with_document_prefill_seconds": fresh_document + a.first_token_seconds - a.load_seconds}
                for a in self.answers if a.load_seconds > 0]
        return {"document_tokens": self.document_tokens, "document_prefill_seconds": self.prefill_seconds,
                "saved_cache": self.saved_cache, "snapshot_bytes": self.snapshot_bytes,
                "loaded_cache": self.loaded_cache,
                "document_prefill_seconds_when_saved": self.prefill_seconds_when_saved or None,
                "made_for_question": self.made_for_question or None, "document_reads": self.document_reads,
                "answers": answers, "time_to_first_token": ttft}


def snapshot_settings(path: str | os.PathLike) -> dict:
    """The header of a snapshot, for choosing what opens it (``edgekv ask``): engine, made_from,
    policy, its parameters, N, B, chat. Refuses what is not a snapshot, naming the file."""
    import json

    from .artifact import snapshot_file as sf

    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"the saved cache {p} does not exist; make one with "
                         "`edgekv run ... --prompt-file DOC --save-cache FILE`")
    snap = sf.read_header(p)
    return {"engine": "eager" if snap.engine == sf.ENGINE_EAGER else "compiled", "made_from": snap.made_from,
            "policy": snap.policy, "policy_params": json.loads(snap.policy_params or "{}"), "budget": snap.budget,
            "block": snap.block, "chat": snap.chat, "tokens": snap.tokens, "position": snap.position}


def check_snapshot_destination(path: str | os.PathLike | None) -> None:
    """``--save-cache`` is checked by writing before any work, as every output is."""
    if path is not None:
        from .output_files import check_writable

        check_writable(path, "--save-cache")


def run_document(session: Session, *, document_ids, questions: list[tuple[str, list[int]]],
                 new_sampler: Callable[[], Callable[[object], int]],
                 max_new_tokens: int, eos_ids=(), chat: bool = False, save_cache=None, load_cache=None,
                 made_from: str = "", progress=None, on_token: Callable[[int, int], None] | None = None,
                 on_question: Callable[[int, str], None] | None = None, question_scoring: bool = False,
                 on_warning: Callable[[str], None] | None = None) -> DocumentRun:
    """Prefill ``document_ids`` (or map ``load_cache`` back), save the state when asked or when
    several questions need it, then answer each question from that state.

    ``question_scoring`` (a query-aware policy on a session that takes the question's rows: the
    eager engine, an artifact compiled with ``--question-rows``): the cache depends on the question, so the document is read once per question,
    knowing it (``prefill(..., question=)``); ``save_cache`` keeps the first question's cache and
    records that question. A loaded cache made knowing another question warns (``on_warning``).

    ``questions``: (text, question-part ids). ``new_sampler()`` gives each question its own sampler
    (``sampler(logits) -> token``), so a seeded answer does not depend on the questions before it.
    ``on_token(i, token)`` streams question i's tokens; ``on_question(i, text)`` is called before
    question i starts."""
    run = DocumentRun(document_tokens=len(document_ids) if document_ids is not None else 0)
    per_question = question_scoring and load_cache is None and bool(questions)
    snapshot = load_cache or save_cache
    tmp = None
    if snapshot is None and len(questions) > 1 and not per_question:
        fd, tmp = tempfile.mkstemp(prefix="edgekv-doc-", suffix=".ekv")
        os.close(fd)
        snapshot = tmp

    def save(path, question: str = "") -> None:
        try:
            session.save_cache(path, question=question, chat=chat, made_from=made_from)
        except OSError as exc:  # a full disk, a folder gone: the writer left nothing behind
            raise InputError(f"cannot write --save-cache {path}: {exc.strerror or exc}; nothing was written — "
                             "free space or choose another path") from None
        if path == save_cache:
            run.saved_cache, run.snapshot_bytes = str(save_cache), Path(save_cache).stat().st_size

    def read_document(question_ids=None) -> float:
        t0 = time.perf_counter()
        if question_ids is None:
            session.prefill(document_ids, progress=progress)
        else:
            session.prefill(document_ids, progress=progress, question=question_ids)
        return time.perf_counter() - t0

    def answer(i: int, text: str, ids, start: float, load_seconds: float) -> None:
        """Question i from the state the runtime holds now; ``start``: when this question began."""
        a = Answer(question=text, question_tokens=len(ids), load_seconds=load_seconds)
        sample = new_sampler()
        t0 = time.perf_counter()
        logits = session.prefill(ids)
        a.prefill_seconds = time.perf_counter() - t0
        first_token_at = []

        def token_cb(token: int) -> None:
            if not first_token_at:
                first_token_at.append(time.perf_counter())
                a.first_token_seconds = first_token_at[0] - start
            if on_token is not None:
                on_token(i, token)

        a.generated_ids = decode_tokens(session, logits, sample, max_new_tokens, eos_ids=eos_ids, on_token=token_cb)
        # decoding is timed from the first token on: that one came from the question's prefill
        a.decode_seconds = time.perf_counter() - first_token_at[0] if len(a.generated_ids) > 1 else 0.0
        run.answers.append(a)

    try:
        if per_question:  # each question's own reading of the document
            for i, (text, ids) in enumerate(questions):
                if on_question is not None:
                    on_question(i, text)
                if i > 0:
                    session.reset()
                seconds = read_document(ids)
                run.prefill_seconds += seconds
                run.document_reads += 1
                if i == 0 and save_cache is not None:
                    save(save_cache, question=text)
                answer(i, text, ids, time.perf_counter(), 0.0)
            return run
        if load_cache is not None:
            start = time.perf_counter()
            run.made_for_question = session.load_cache(load_cache)
            first_load = time.perf_counter() - start
            info = session.snapshot_info
            if bool(info["chat"]) != bool(chat):
                raise InputError(f"{load_cache} holds a document read {'with' if info['chat'] else 'without'} "
                                 f"the chat template: ask {'with --chat' if info['chat'] else 'without --chat'}")
            run.loaded_cache, run.document_tokens = str(load_cache), int(info["tokens"])
            run.prefill_seconds_when_saved = float(info["document_seconds"])
            for text, _ in questions:
                if run.made_for_question and text != run.made_for_question and on_warning is not None:
                    on_warning(f"{load_cache} was made knowing the question \"{run.made_for_question}\" (a "
                               "query-aware policy's cache); answers to other questions may miss what it evicted")
        else:
            first_load, start = 0.0, 0.0
            run.prefill_seconds = read_document()
            run.document_reads = 1
            if snapshot is not None:
                save(snapshot)
        for i, (text, ids) in enumerate(questions):
            if on_question is not None:
                on_question(i, text)
            if i > 0:
                start = time.perf_counter()
                session.load_cache(snapshot)
                answer(i, text, ids, start, time.perf_counter() - start)
            else:  # the first question: from the document just read, or from the cache loaded above
                answer(i, text, ids, start if load_cache is not None else time.perf_counter(), first_load)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return run
