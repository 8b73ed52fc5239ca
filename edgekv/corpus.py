"""Long natural English text that ships offline, so nothing is fetched at run time.

Two sources, both read from installed packages:

* ``pydoc``: the Python language reference's topic help bundled with every CPython
  (``pydoc_data.topics``, ~1 MB; PSF License). Used for example prompts, fidelity evaluation and
  benchmarks (``natural_text``); its plain-prose paragraphs (no quoted code) are the varied
  haystack's second register.
* ``opticks``: Isaac Newton's *Opticks* (4th edition, 1730; public domain), the Project Gutenberg /
  Distributed Proofreaders transcription that libbacktrace carries as test data and that the
  ``apache-tvm-ffi`` wheel installs (``tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt``;
  apache-tvm-ffi is edgekv's build requirement and apache-tvm's dependency). Narrative prose on
  experiments, nothing like the Python reference.

``varied_paragraphs`` draws the retrieval tasks' default haystack from both: runs of one to three
consecutive paragraphs, each run from a seed-chosen source and place, so the topic, register and
vocabulary change every few hundred tokens (a document collection, not one repeated sentence).
Sentences holding a digit are dropped (a haystack number would compete with the needles' numbers
in exact-match scoring), as are headings and code blocks."""

from __future__ import annotations

import random
import re
from functools import lru_cache
from pathlib import Path

import torch

OPTICKS_RELATIVE = "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
SOURCES = ("opticks", "pydoc")


class CorpusError(RuntimeError):
    """A text source is not installed."""


@lru_cache(maxsize=1)
def natural_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def natural_token_ids(tokenizer, length: int, offset_chars: int = 0) -> torch.Tensor:
    """The first ``length`` tokens of the corpus (from ``offset_chars``), repeating it if needed."""
    text = natural_text()
    ids: list[int] = []
    start = offset_chars % len(text)
    while len(ids) < length:
        ids.extend(tokenizer(text[start:], add_special_tokens=False)["input_ids"])
        start = 0
    return torch.tensor(ids[:length], dtype=torch.long)


def opticks_path() -> Path:
    """Where the installed apache-tvm-ffi wheel keeps Newton's Opticks."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("tvm_ffi")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("the varied haystack reads Newton's Opticks from the apache-tvm-ffi wheel, which is not "
                          "installed: pip install apache-tvm-ffi==0.1.15.post2 (or use haystack 'repeat' / 'text')")
    path = Path(list(spec.submodule_search_locations)[0]) / OPTICKS_RELATIVE
    if not path.is_file():
        raise CorpusError(f"{path} is missing from the installed apache-tvm-ffi; reinstall it "
                          "(pip install --force-reinstall apache-tvm-ffi==0.1.15.post2)")
    return path


def _prose(block: str) -> str:
    """One paragraph as prose: joined lines, no italics marks, without sentences holding digits or
    single capital letters (figure labels such as "the line PT")."""
    text = " ".join(line.strip() for line in block.splitlines()).replace("_", "").strip()
    keep = [s for s in re.split(r"(?<=[.!?])\s+", text)
            if len(s.split()) >= 4 and not re.search(r"\d", s) and not re.search(r"\b[A-HJ-Z]{1,2}\b", s)]
    return " ".join(keep)


@lru_cache(maxsize=None)
def source_paragraphs(source: str) -> tuple[str, ...]:
    """A source's prose paragraphs (at least 12 words each), in reading order."""
    if source == "opticks":
        blocks = re.split(r"\n\s*\n", opticks_path().read_text(encoding="utf-8"))
    elif source == "pydoc":
        from pydoc_data.topics import topics

        blocks = [b for key in sorted(topics) for b in re.split(r"\n\s*\n", topics[key])
                  if b.strip() and not b.splitlines()[0].startswith((" ", "\t", ">>>"))]
    else:
        raise ValueError(f"unknown text source {source!r}; choose from {', '.join(SOURCES)}")
    out = []
    for block in blocks:
        text = _prose(block)
        if len(text.split()) < 12 or text.upper() == text:
            continue
        # the reference's paragraphs that quote code ("str", x[i], f(), a = b) lure SmolLM2-135M into
        # answering with the quoted text (a 4K passkey with the full cache answered ' "str" in the text'):
        # plain sentences only
        if source == "pydoc" and re.search(r"[\"'()\[\]{}*=<>:`]", text):
            continue
        out.append(text)
    return tuple(out)


def varied_paragraphs(seed: int, min_words: int, sources: tuple[str, ...] = SOURCES) -> list[str]:
    """At least ``min_words`` words of prose: runs of 1–3 consecutive paragraphs, each from a
    seed-chosen source and offset, alternating sources so that no two runs in a row share one."""
    rng = random.Random(104729 * seed + 31)
    out: list[str] = []
    words = 0
    source = rng.choice(sources)
    while words < min_words:
        paras = source_paragraphs(source)
        start = rng.randrange(len(paras))
        for i in range(rng.randint(1, 3)):
            p = paras[(start + i) % len(paras)]
            out.append(p)
            words += len(p.split())
        source = sources[(sources.index(source) + 1) % len(sources)]
    return out
