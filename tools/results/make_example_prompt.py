"""Build the README's example prompt, examples/long_document.txt: natural English text with a
question whose answer is in the text, far before the end.

The text is the Python language reference's topic help that ships with every CPython
(`pydoc_data.topics`), so it is available offline. A question is either about a section of the
reference or about a fact in the short notes that open the prompt. Which document length and question the
README uses is not chosen here but by measurement: ``tools/results/pick_demo.py`` runs the candidates
below on the real model (full cache, no document, and each policy × budget), writes what it
tried and what answered right to docs/results/demo.json, and writes the chosen prompt with
this module (``python tools/results/make_example_prompt.py --from-choice`` rewrites it from that file).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from pydoc_data.topics import topics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "long_document.txt"
CHOICE = ROOT / "docs" / "results" / "demo.json"

# the reference's sections in the order the document strings them together
SECTION_ORDER = ["assert", "pass", "del", "return", "yield", "raise", "break", "continue", "import", "global",
                 "nonlocal", "if", "while", "for", "try", "with", "function", "class", "numbers", "strings",
                 "lambda", "comparisons", "booleans", "assignment", "augassign", "exprlists"]


@dataclass(frozen=True)
class Question:
    """A question, and what a right answer must say (a regular expression, case-insensitive,
    matched against the generated text). ``note``: a sentence of the notes that open the prompt,
    before the document (the question asks about it); without one the question is about the
    reference ``section`` itself."""

    id: str
    section: str
    text: str
    right: str
    note: str = ""

    def is_right(self, answer: str) -> bool:
        return re.search(self.right, answer, re.IGNORECASE) is not None


QUESTIONS = [
    Question("assert", "assert", "according to the excerpt, what does the assert statement do?",
             r"debug|AssertionError"),
    Question("pass", "pass", "according to the excerpt, what happens when a pass statement is executed?",
             r"nothing happens|null operation|does nothing|no operation"),
    Question("generator-return", "return",
             "according to the excerpt, in a generator function, which exception does the return statement "
             "cause to be raised?", r"StopIteration"),
    Question("bare-raise", "raise",
             "according to the excerpt, which exception does a bare raise statement raise when there is no "
             "active exception?", r"RuntimeError"),
    Question("break-target", "break",
             "according to the excerpt, when a for loop is terminated by break, what value does the loop "
             "control target keep?", r"current value"),
    Question("del-order", "del",
             "according to the excerpt, in which order does deletion of a target list delete each target?",
             r"left to right"),
]
# facts in the notes before the document: SmolLM2-135M answers none of the questions above with
# its full cache (docs/results/demo.md), but it does retrieve a fact stated before a long text
QUESTIONS += [
    Question("code-name", "", "what is the project's code name?", r"blue heron",
             note="The project's code name is Blue Heron."),
    Question("room", "", "in which room does the review meeting take place?", r"\b417\b",
             note="The review meeting takes place in room 417."),
    Question("author", "", "who prepared this excerpt for the course?", r"amelia hart",
             note="This excerpt was prepared for the course by Dr. Amelia Hart."),
    Question("password", "", "what is the Wi-Fi password of the training lab?", r"tangerine",
             note="The Wi-Fi password of the training lab is tangerine."),
]
QUESTIONS_BY_ID = {q.id: q for q in QUESTIONS}


def document(target_tokens: int, first: str = "assert") -> str:
    """~``target_tokens`` tokens of the reference, starting at section ``first``."""
    keys = SECTION_ORDER[SECTION_ORDER.index(first):]
    parts, words = [], 0
    for key in keys:
        if key not in topics:
            continue
        text = topics[key].strip()
        parts.append(text)
        words += len(text.split())
        if words * 1.35 > target_tokens:  # ~1.35 tokens per word for this text
            break
    return "\n\n".join(parts)


def build(target_tokens: int = 2000, question: str = "assert") -> str:
    """The prompt: an instruction, the document, then the question (so the answer is far back)."""
    q = QUESTIONS_BY_ID[question]
    notes = f"Study notes for the Python course. {q.note}\n\n" if q.note else ""
    return (notes + "Read the following excerpt of the Python language reference.\n\n" + document(target_tokens) +
            f"\n\nQuestion: {q.text[0].upper() + q.text[1:]} Answer in one or two sentences.\nAnswer:")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="document length in tokens (approximate)")
    ap.add_argument("--question", default="assert", choices=sorted(QUESTIONS_BY_ID))
    ap.add_argument("--from-choice", action="store_true",
                    help=f"take --tokens and --question from the measured choice in {CHOICE.relative_to(ROOT)}")
    ap.add_argument("-o", "--output", default=str(EXAMPLE))
    args = ap.parse_args()
    if args.from_choice:
        choice = json.loads(CHOICE.read_text())["choice"]
        args.tokens, args.question = choice["document_tokens"], choice["question"]
    Path(args.output).write_text(build(args.tokens, args.question))
    print(f"wrote {args.output} ({args.tokens} tokens requested, question {args.question!r})")


if __name__ == "__main__":
    main()
