"""One runtime face: what the eager engine, HostRuntime (TVM's Relax VM) and NativeRuntime (the C
runtime through ctypes) have in common, and the token loop written once over it.

ExecuTorch's ``extension/llm/runner`` is the model: every backend implements one interface
(``irunner.h``) and the token loop (``text_token_generator.h``) is written once over it. Here the
interface is ``Session``; ``generate`` / ``decode_tokens`` are the loop that ``edgekv run`` (plain
and document), the runtimes' own ``generate`` methods and the evaluation use; ``SessionStats`` is
what the one report builder (``edgekv/run_report.py``) reads after a run.

Logits are each session's own array type (torch for the eager engine, numpy for the compiled
runtimes); a sampler takes them as they come and returns the token id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

Sampler = Callable[[Any], int]


@dataclass
class SessionStats:
    """What a run report reads from a session after a run, under the same names for every runtime.
    A field a runtime does not have is None, and the report leaves its key out."""

    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    cache_lengths: list[int]
    memory_plan: dict              # weights, kv_cache, activations, total (bytes)
    planned_kv_bytes: int          # the plan's KV cache, set against the full cache of the same tokens
    peak_rss_bytes: int = 0        # what the runtime sampled itself (the report also takes the process peak)
    eviction_events: int | None = None     # eager: steps that evicted
    kv_cache_allocated: int | None = None  # eager: bytes its caches hold
    device: str | None = None              # compiled: where it ran
    device_bytes_peak: int | None = None   # native: device memory held at peak (0: not measured)
    question_rows: int | None = None       # compiled: the longest question the artifact's blocks score with
    threads: dict = field(default_factory=dict)  # the runtime's own thread count ({"native": n})
    torch_threads: int | None = None       # eager: torch's intra-op threads


class Session(Protocol):
    """A model with a fixed-size KV cache that reads tokens block-wise and decodes one at a time.

    ``snapshot_info`` (the header of the last ``load_cache``: question, made_from, chat, tokens,
    document_seconds) exists once a snapshot was loaded."""

    budget: int          # N: cache entries kept per layer and KV head
    block: int           # B: prompt tokens per prefill step
    question_rows: int   # the longest question whose rows can score the blocks (0: none)

    @property
    def position(self) -> int:
        """The next token's position."""

    def prefill(self, prompt_ids, progress: Callable[[int], None] | None = None, question=None):
        """Block-wise prefill, continuing at ``position``; returns the last token's logits.
        ``progress(n)`` after each block of n tokens; ``question``: the ids that will follow, whose
        rows score every block (not prefilled)."""

    def decode(self, token_id: int):
        """One generated token; returns its logits."""

    def reset(self) -> None:
        """A new sequence: empty caches, position 0."""

    def save_cache(self, path, question: str | None = None, chat: bool = False, made_from: str = "") -> None:
        """The cache state to one snapshot file (``edgekv/artifact/snapshot_file.py``), atomically."""

    def load_cache(self, path) -> str:
        """Continue from a snapshot; returns the question it was made knowing ("")."""

    def cache_lengths(self) -> list[int]:
        """Entries each layer's cache holds now."""

    def describe(self) -> dict:
        """The head of a run report: engine, model, weights, policy, N, B, K/V format and what only
        this kind of session has (the artifact and its runtime; the eager caches' capacity)."""

    def session_stats(self) -> SessionStats:
        """Counters, timings, memory plan and peaks since the last reset or load."""


def decode_tokens(session, logits, sampler: Sampler, max_new_tokens: int, *, eos_ids=(),
                  on_token: Callable[[int], None] | None = None) -> list[int]:
    """The token loop: sample from ``logits`` (a prefill's last), then decode each token until an
    EOS id (included) or ``max_new_tokens``. No decode runs after the last token."""
    out: list[int] = []
    for i in range(max_new_tokens):
        token = int(sampler(logits))
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_ids or i == max_new_tokens - 1:
            break
        logits = session.decode(token)
    return out


def generate(session, prompt_ids, sampler: Sampler, max_new_tokens: int, *, eos_ids=(),
             on_token: Callable[[int], None] | None = None,
             progress: Callable[[int], None] | None = None) -> list[int]:
    """Prefill the prompt, then the token loop; returns the generated ids."""
    logits = session.prefill(prompt_ids, progress=progress)
    return decode_tokens(session, logits, sampler, max_new_tokens, eos_ids=eos_ids, on_token=on_token)
