"""Long natural English text that ships offline: the Python language reference's topic
help bundled with every CPython (`pydoc_data.topics`, ~1 MB). Used for example prompts,
fidelity evaluation and benchmarks, so nothing is fetched at run time."""

from __future__ import annotations

from functools import lru_cache

import torch


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
