"""Many questions of one saved document: read it once without the question, save the compressed
cache, and ask every question of that one cache (issue 34's evaluation of "read once, ask many").

A **document** holds one or more needles on the varied haystack (``tasks.lay_out``): ``passkey``
(one pass key), ``multikey`` (``keys`` numbered codes of different kinds — pass key, door code,
room number, ... — at spread depths, each asked separately) and ``multifact`` (``keys`` word-valued
facts — the secret city, the ship's name, ... — each asked separately). The document and each
question are encoded as the two chat parts the runtimes use (``edgekv.models.chat``): the document
part is what ``--save-cache`` saves, a question part is what ``edgekv ask`` appends; the answer's
start ("The door code is") ends the question part so the value comes first.

A **method** is (policy, question_known, compress), written ``POLICY``, ``POLICY:q`` or ``compress:MODE``:

* ``keydiff``, ``lagkv``, ``dapq``: read the document once without any question, save the cache
  (``Session.save_cache``), map it back before every question (``Session.load_cache``) — the
  ``run --save-cache`` / ``edgekv ask`` path;
* ``full``: the same with a budget that holds everything (the ceiling of any cache);
* ``snapkv:q``, ``snapkv++:q``, ``dapq:q``: the question-aware ceiling. Each question's cache is
  built knowing it (``prefill(document, question=...)``), so the document is read once per question
  and nothing is reused — that is what the ceiling costs;
* ``compress:reconstruct`` (any ``compress:MODE``): the document is read once with a query-agnostic
  compression mode (issue 34's ``--compress reconstruct``: the mode's own policy,
  ``edgekv.policies.COMPRESS_MODES`` / ``compress_policy``, as ``run --save-cache --compress``
  reads), then asked like the others. A tree without the mode reports the method unavailable
  (every row says so) instead of failing.

Two ways of asking (``ask``): ``snapshot`` (each question from the saved cache, nothing of one
answer in the next) and ``turns`` (SCBench's shared-context multi-turn: the questions follow one
another in one conversation after the document, each answer staying in the cache; a question-aware
method reads the document knowing only the first question, as a real conversation would).

Scoring: exact match of the value (numbers: the first run of digits; words: the first word,
case-insensitive); ``answered_other``: the answer was another needle's value. Retention: per needle,
the share of (layer, KV head) caches that hold every token of its value after the document's read.
"""

from __future__ import annotations

import inspect
import os
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import InputError
from .tasks import (DEFAULT_HAYSTACK, DISTRACTOR_KINDS, HAYSTACKS, INTRO, _rng, extract_key, lay_out, needle_text,
                    phrasings_for)

DOC_TASKS = ("passkey", "multikey", "multifact")
ASK_MODES = ("snapshot", "turns")
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # document i of a passkey cell: depth i mod 5, seed i
MULTI_INTRO = ("Some facts are hidden inside a lot of irrelevant text. Find them and memorize them. "
               "I will quiz you about them.\n\n")
NUMBER_KINDS = ("pass key",) + DISTRACTOR_KINDS
# word-valued facts: each kind with values of one sort, one word each
FACT_VALUES = {
    "secret city": ("Lisbon", "Nairobi", "Oslo", "Lima", "Kyoto", "Dublin", "Cairo", "Quito", "Hanoi", "Zurich"),
    "ship's name": ("Albatross", "Meridian", "Valkyrie", "Seahorse", "Endeavour", "Kestrel", "Nautilus", "Osprey"),
    "magic word": ("butterscotch", "quasar", "lantern", "marmalade", "thimble", "zephyr", "pumpkin", "juniper"),
    "hidden animal": ("otter", "lynx", "walrus", "pelican", "gecko", "badger", "llama", "heron", "jaguar"),
    "guest's name": ("Beatrice", "Ignatius", "Rosalind", "Thaddeus", "Winifred", "Cornelius", "Philippa"),
    "secret fruit": ("papaya", "apricot", "quince", "mango", "lychee", "tangerine", "gooseberry", "plum"),
}
DEFAULT_METHODS = "full,keydiff,lagkv,dapq,compress:reconstruct,snapkv:q,snapkv++:q,dapq:q"


# ---- documents ---------------------------------------------------------------------------------
@dataclass
class DocQuestion:
    text: str
    ids: list[int] = field(repr=False)  # the question part + the answer's start
    needle: int = 0
    answer: str = ""
    turn_ids: list[int] = field(default_factory=list, repr=False)  # as a later turn: no separator before it


@dataclass
class Needle:
    kind: str
    value: str
    depth: float
    phrasing: int
    position: int = 0  # first token of the needle paragraph in the document part
    value_positions: list[int] = field(default_factory=list)  # the tokens of its value's first mention


@dataclass
class Document:
    id: str
    task: str
    length_target: int
    seed: int
    haystack: str
    ids: list[int] = field(repr=False)  # the document part (chat prefix + intro + haystack)
    needles: list[Needle] = field(default_factory=list)
    questions: list[DocQuestion] = field(default_factory=list)
    between_turns: list[int] = field(default_factory=list, repr=False)  # end of an answer → next user turn

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def meta(self) -> dict:
        d = asdict(self)
        d.pop("ids")
        d.pop("between_turns")
        for q in d["questions"]:
            q["tokens"] = len(q.pop("ids"))
            q.pop("turn_ids")
        d["tokens"] = self.tokens
        return d


def question_of(kind: str) -> tuple[str, str]:
    return f"What is the {kind} mentioned in the text above?", f"The {kind} is"


def turn_pieces(tokenizer) -> tuple[str, str, str]:
    """(chat prefix before the first user turn, suffix after a user turn, text between an assistant's
    answer and the next user turn) from the chat template, which must insert contents verbatim."""
    from ..models.chat import chat_pieces

    pieces = chat_pieces(tokenizer)
    if pieces["prefix"] is None:
        raise InputError(f"the model's chat template cannot split documents from questions: {pieces['reason']}")
    a, b, c = "EKVANSWERSENTINEL", "EKVNEXTSENTINEL", "EKVUSERSENTINEL"
    text = tokenizer.apply_chat_template([{"role": "user", "content": c}, {"role": "assistant", "content": a},
                                          {"role": "user", "content": b}], tokenize=False, add_generation_prompt=True)
    between = text[text.index(a) + len(a): text.index(b)]
    return pieces["prefix"], pieces["suffix"], between


def build_document(tokenizer, task: str, length: int, index: int, *, haystack: str = DEFAULT_HAYSTACK,
                   keys: int = 4, digits: int = 5) -> Document:
    """Document ``index`` of a (task, length) cell, about ``length`` tokens with its longest question.
    Seeded by (index, length, keys): the same arguments give the same tokens."""
    if task not in DOC_TASKS:
        raise InputError(f"unknown document task {task!r}; choose from {', '.join(DOC_TASKS)}")
    if haystack not in HAYSTACKS:
        raise InputError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    if task != "passkey" and not 2 <= keys <= len(FACT_VALUES):
        raise InputError(f"--keys {keys}: a multi-key or multi-fact document holds 2 to {len(FACT_VALUES)} needles")
    rng = _rng(index, length, keys, DOC_TASKS.index(task))
    if task == "passkey":
        kinds, depths = ["pass key"], [PASSKEY_DEPTHS[index % len(PASSKEY_DEPTHS)]]
        intro = INTRO
    else:  # spread over the haystack, each jittered a little so depths differ between documents
        kinds = rng.sample(NUMBER_KINDS if task == "multikey" else tuple(FACT_VALUES), keys)
        depths = [min(0.97, max(0.03, (i + 0.5) / keys + rng.uniform(-0.4, 0.4) / keys)) for i in range(keys)]
        intro = MULTI_INTRO
    values: list[str] = []
    for kind in kinds:
        while True:
            v = (str(rng.randrange(10 ** (digits - 1), 10 ** digits)) if task != "multifact"
                 else rng.choice(FACT_VALUES[kind]))
            if v not in values:
                values.append(v)
                break
    phrasing = phrasings_for(rng, haystack, len(kinds))
    texts = [needle_text(v, k, f) for v, k, f in zip(values, kinds, phrasing)]
    prefix, suffix, between = turn_pieces(tokenizer)
    q_parts = []
    for k in kinds:
        q, start = question_of(k)
        q_parts.append((q, tokenizer("\n\n" + q + suffix + start, add_special_tokens=False)["input_ids"],
                        tokenizer(q + suffix + start, add_special_tokens=False)["input_ids"]))
    fixed = len(tokenizer(prefix + intro, add_special_tokens=False)["input_ids"]) + max(len(ids) for _, ids, _ in q_parts)
    needle_tokens = sum(len(tokenizer(" \n\n" + t + "\n\n", add_special_tokens=False)["input_ids"]) for t in texts)
    room = max(length - fixed - needle_tokens, 16)
    body, starts = lay_out(tokenizer, room, haystack, 7919 * index + length, texts, depths)
    text = prefix + intro + body
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    base = len(prefix) + len(intro)
    needles = []
    for k, v, d, f, s, t in zip(kinds, values, depths, phrasing, starts, texts):
        at = base + s + t.index(v)
        span = [i for i, (s0, e0) in enumerate(offsets) if e0 > at and s0 < at + len(v)]
        needles.append(Needle(k, v, d, f, position=next(i for i, (s0, e0) in enumerate(offsets) if e0 > base + s),
                              value_positions=span))
    questions = [DocQuestion(q, ids, i, values[i], turn) for i, (q, ids, turn) in enumerate(q_parts)]
    order = list(range(len(questions)))
    random.Random(index).shuffle(order)  # ask in an order unrelated to the needles' depths
    questions = [questions[i] for i in order]
    doc_id = f"{task}-L{length}-i{index}" + (f"-k{keys}" if task != "passkey" else "") + f"-{haystack}"
    return Document(doc_id, task, length, index, haystack, enc["input_ids"], needles, questions,
                    between_turns=tokenizer(between, add_special_tokens=False)["input_ids"])


# ---- methods -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """How a document's cache is made: a policy, whether the question is known when it is read, and a
    query-agnostic compression mode (``compress``: None for the policy alone; a mode reads with its own
    policy, ``edgekv.policies.compress_policy``, as ``run --save-cache --compress MODE`` does)."""

    policy: str
    question_known: bool = False
    compress: str | None = None

    @property
    def label(self) -> str:
        if self.compress:
            return f"compress:{self.compress}"
        return self.policy + (":q" if self.question_known else "")

    @property
    def reuses_one_cache(self) -> bool:
        return not self.question_known


def compression_modes() -> dict[str, str]:
    """The tree's compression modes ({mode: the policy that reads with it}); empty before issue 34's
    ``--compress`` lands."""
    try:
        from ..policy_labels import COMPRESS_MODES
    except ImportError:
        return {}
    return dict(COMPRESS_MODES)


def parse_method(text: str) -> Method:
    """``POLICY`` (read without the question), ``POLICY:q`` (knowing it) or ``compress:MODE`` (read with
    a compression mode, e.g. ``compress:reconstruct``); a policy must exist, a mode need not (a tree
    without it reports the method unavailable when it runs)."""
    from ..policies import make_policy

    parts = [t.strip() for t in text.strip().split(":")]
    if parts[0] == "compress":
        if len(parts) != 2 or not parts[1]:
            raise InputError(f"method {text!r}: write compress:MODE, e.g. compress:reconstruct")
        return Method(compression_modes().get(parts[1], parts[1]), False, parts[1])
    if not parts[0] or len(parts) > 2 or (len(parts) == 2 and parts[1] != "q"):
        raise InputError(f"method {text!r}: write POLICY, POLICY:q (the question known) or compress:MODE "
                         "(e.g. compress:reconstruct)")
    policy = make_policy(parts[0])
    m = Method(parts[0], len(parts) == 2)
    if m.question_known and not getattr(policy, "uses_question", False):
        raise InputError(f"method {text!r}: {parts[0]} does not read the question; drop ':q'")
    return m


def parse_methods(text: str) -> list[Method]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise InputError("--methods is empty; give e.g. full,keydiff,dapq,dapq:q,compress:reconstruct")
    return list(dict.fromkeys(parse_method(t) for t in items))


def compress_unavailable(compress: str | None) -> str | None:
    """Why a document cannot be read with ``compress`` in this tree (None: it can, or no mode asked)."""
    if compress is None:
        return None
    modes = compression_modes()
    if compress not in modes:
        return (f"compress={compress!r} is not in this tree (edgekv.policies.COMPRESS_MODES: "
                f"{', '.join(modes) or 'none'}; issue 34's --compress)")
    return None


# ---- asking ------------------------------------------------------------------------------------
def score(answer: str, doc: Document, q: DocQuestion) -> dict:
    if doc.task == "multifact":
        m = re.search(r"[A-Za-z]+", answer)
        predicted = m.group(0).lower() if m else None
        values = [n.value.lower() for n in doc.needles]
        want = q.answer.lower()
    else:
        predicted, values, want = extract_key(answer), [n.value for n in doc.needles], q.answer
    return {"predicted": predicted, "correct": predicted == want,
            "answered_other": predicted is not None and predicted != want and predicted in values}


def retention(session, needle: Needle) -> float | None:
    """Share of (layer, KV head) caches holding every token of the needle's value."""
    if not needle.value_positions or not hasattr(session, "kept_positions"):
        return None
    want = torch.tensor(needle.value_positions)
    held = [float(torch.isin(want, pos).all()) for layer in range(len(session.caches))
            for pos in session.kept_positions(layer)]
    return sum(held) / len(held)


def ask_document(model, doc: Document, method: Method, budget: int, block: int, *, ask: str = "snapshot",
                 max_new_tokens: int = 10, progress: Callable[[int], None] | None = None,
                 workdir: str | None = None, policy_args: dict[str, str] | None = None) -> list[dict]:
    """Every question of ``doc`` answered with ``method`` at budget N and block B on the eager engine
    (a Session): one row per question. ``policy_args``: the policy's ``--policy-arg`` values (a variant
    label such as ``dapq#k15`` carries its own)."""
    from ..engine import BlockEngine
    from ..policies import make_policy
    from ..session import decode_tokens

    if ask not in ASK_MODES:
        raise InputError(f"ask mode {ask!r}: choose from {', '.join(ASK_MODES)}")
    tok = model.tokenizer
    eos = tuple(i for i in [getattr(tok, "eos_token_id", None)] if i is not None)
    longest = max(len(q.ids) for q in doc.questions)
    if method.policy == "full":  # room for the document, every turn and answer: nothing is evicted
        budget = doc.tokens + sum(len(q.ids) + len(doc.between_turns) + max_new_tokens + 1 for q in doc.questions)
    base = {"document": doc.id, "task": doc.task, "length_target": doc.length_target, "document_tokens": doc.tokens,
            "method": method.label, "policy": method.policy, "question_known": method.question_known,
            "compress": method.compress, "budget": None if method.policy == "full" else budget, "block": block,
            "ask": ask, "haystack": doc.haystack}
    why = compress_unavailable(method.compress)
    if why is not None:
        return [dict(base, question=q.text, needle=q.needle, answer=q.answer, unavailable=why) for q in doc.questions]
    # a compression mode reads with its own policy, as `run --save-cache --compress MODE` does
    policy = make_policy(method.policy, policy_args or {})
    base["policy_params"] = policy.params()
    engine = BlockEngine(model, policy, budget, block,
                         question_rows=longest if method.question_known else 0)
    greedy = lambda logits: int(torch.argmax(logits))  # noqa: E731
    rows: list[dict] = []
    reads = 0

    def read(question_ids=None) -> tuple[float, list]:
        nonlocal reads
        kwargs = {}
        if question_ids is not None:
            kwargs["question"] = torch.tensor(question_ids)
        t0 = time.perf_counter()
        engine.prefill(torch.tensor(doc.ids), progress=progress, **kwargs)
        reads += 1
        return time.perf_counter() - t0, [retention(engine, n) for n in doc.needles]

    def answer(q: DocQuestion, ids: list[int], seconds: float, kept: list, loaded: bool) -> list[int]:
        logits = engine.prefill(torch.tensor(ids))
        out = decode_tokens(engine, logits, greedy, max_new_tokens, eos_ids=eos)
        text = tok.decode([t for t in out if t not in eos], skip_special_tokens=True)
        rows.append(dict(base, question=q.text, needle=q.needle, answer=q.answer, output_text=text,
                         needle_depth=doc.needles[q.needle].depth, needle_retention=kept[q.needle],
                         document_seconds=seconds, from_saved_cache=loaded, **score(text, doc, q)))
        return out

    fd, snap = tempfile.mkstemp(prefix="edgekv-questions-", suffix=".ekv", dir=workdir)
    os.close(fd)
    try:
        if ask == "turns":  # one conversation: a question-aware read knows only the first question
            seconds, kept = read(doc.questions[0].ids if method.question_known else None)
            ids = doc.questions[0].ids
            for i, q in enumerate(doc.questions):
                if i:
                    ids = ([] if out[-1] in eos else [out[-1]]) + doc.between_turns + q.turn_ids
                out = answer(q, ids, seconds, kept, False)
        elif method.question_known:  # the ceiling: the document read again, knowing each question
            for i, q in enumerate(doc.questions):
                if i:
                    engine.reset()
                seconds, kept = read(q.ids)
                answer(q, q.ids, seconds, kept, False)
        else:  # read once, save; every question but the first from the saved cache
            seconds, kept = read()
            engine.save_cache(snap)
            for i, q in enumerate(doc.questions):
                if i:
                    engine.load_cache(snap)
                answer(q, q.ids, seconds, kept, bool(i))
    finally:
        os.unlink(snap)
    for r in rows:
        r["document_reads"] = reads
    return rows
