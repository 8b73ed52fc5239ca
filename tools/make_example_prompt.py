"""Regenerate examples/long_document.txt: a ~4.5K-token prompt of natural English text.

The text is the Python language reference's topic help that ships with every CPython
(`pydoc_data.topics`), so it is available offline; a question about the opening section
closes the prompt, so that an answer needs something from far before the recent window."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydoc_data.topics import topics


def build(target_tokens: int = 4500) -> str:
    keys = ["assert", "pass", "del", "return", "yield", "raise", "break", "continue", "import", "global",
            "nonlocal", "if", "while", "for", "try", "with", "function", "class", "numbers", "strings",
            "lambda", "comparisons", "booleans", "assignment", "augassign", "exprlists"]
    parts, words = [], 0
    for key in keys:
        if key not in topics:
            continue
        text = topics[key].strip()
        parts.append(text)
        words += len(text.split())
        if words * 1.35 > target_tokens:  # ~1.35 tokens per word for this text
            break
    body = "\n\n".join(parts)
    return ("Read the following excerpt of the Python language reference.\n\n" + body +
            "\n\nQuestion: according to the first section of the excerpt, what does the assert statement do? "
            "Answer in one or two sentences.\nAnswer:")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4500)
    ap.add_argument("-o", "--output", default=str(Path(__file__).resolve().parent.parent / "examples" / "long_document.txt"))
    args = ap.parse_args()
    Path(args.output).write_text(build(args.tokens))
    print(f"wrote {args.output}")
