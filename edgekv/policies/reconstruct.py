"""`reconstruct` — compress once, answer anything: KVzip's context-reconstruction score, block-wise
(Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416). `edgekv run --save-cache F --compress reconstruct` / `edgekv compile --compress
reconstruct` select it; `--policy reconstruct` is the same thing.

Definition (KVzip). A KV entry matters as much as the attention it receives while the model, given
the cache, repeats the context: after the context come "Repeat the previous context exactly." (in the
model's chat form) and the context itself, teacher-forced. KVzip runs that in chunks (2,048 tokens in
kvpress): chunk c's rows are the repeat prompt (for c > 0: "Repeat the part of the previous context
exactly, starting with" + the last 8 tokens of chunk c − 1), the chat suffix, then chunk c's tokens.
Each row's attention is taken over the sinks, chunk c's own entries and the rows (causally) — not
over the whole cache — and entry j of chunk c scores the max over the rows and over the query heads
of its KV group. The first ``sinks`` tokens score 1. The cache keeps the highest scores.

Block-wise form (what this file computes). The chunk is the block: when block t (B tokens at
s … s + b − 1) is read, its reconstruction rows — repeat prompt (+ the previous block's last
``tail`` tokens) + chat suffix + block t — run after it, at positions s + b …, as extra rows of the
same step (they attend to what the cache holds, the block and themselves, causally, and never enter
the cache). ``observe`` scores block t's entries with KVzip's rule and keeps the score beside the
entry (``entry_state``); ``select`` keeps the top N scores per KV head. Every block of a document
longer than N carries rows (``rows_every_block``), so every document entry is scored by its own
block's reconstruction, as in KVzip, and the eviction at each block already ranks by the final
score: no second pass and no base policy are needed.

Where this departs from KVzip, and why:
* the rows' forward sees what the budget holds (≤ N + B entries), not the whole context: the whole
  KV never exists here. The score itself is KVzip's (sinks + own chunk + rows), so it is unchanged
  by that only through the rows' hidden states in later layers;
* a block's rows see the document up to that block, not all of it (they run while reading), and sit
  right after the block, not after the whole document;
* the chunk is B (128 by default), not 2,048, so the extra rows fit the memory plan of one step;
* N per KV head is fixed (the caches have static shapes), where KVzip ranks heads and layers jointly;
* ``score=aligned`` (not the default) departs from KVzip's rule itself: each entry is scored by the one
  row that reproduces it, under a softmax over the whole cache (``aligned_scores``; why there);
* entries added after the document (a question, generated tokens) are not reconstructed: they score
  ``CONTINUATION`` (above any attention), so they push out the lowest-scored document entries.
A document no longer than N is kept whole and carries no rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .attention_rows import kv_groups, softmax_scale
from .base import EvictionContext, Policy, PolicyError, Selection, keep_all, topk_keep

STATE = "reconstruction"
# the score of an entry that was not reconstructed (after the document): above any probability
CONTINUATION = 2.0
FIRST_PROMPT = "Repeat the previous context exactly."
LATER_PROMPT = "Repeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids around each block's reconstruction: ``first`` before block 0, ``later`` then
    the previous block's tail before the others, ``suffix`` (the chat template's end of the user
    turn and start of the answer) before the block's own tokens."""

    first: tuple[int, ...] = ()
    later: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def rows(self, tail: int, block: int) -> int:
        """The most extra rows one step carries: the longer prompt, the suffix and a block."""
        return max(len(self.first), len(self.later) + tail) + len(self.suffix) + block


def repeat_prompt(tokenizer: Any, chat: bool = True) -> RepeatPrompt:
    """The repeat prompt in the model's chat form when its tokenizer has one (KVzip: the prompt
    continues the user turn that holds the context, then the template's suffix), else after "\\n\\n"
    then "\\n"; no tokenizer (the tiny test models): no words, the rows are the tail and the block."""
    if tokenizer is None:
        return RepeatPrompt()
    from ..models.chat import QUESTION_SEPARATOR, chat_pieces

    suffix = chat_pieces(tokenizer)["suffix"] if chat else None
    suffix = suffix if suffix is not None else "\n"

    def ids(text: str) -> tuple[int, ...]:
        return tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])

    return RepeatPrompt(first=ids(QUESTION_SEPARATOR + FIRST_PROMPT), later=ids(QUESTION_SEPARATOR + LATER_PROMPT),
                        suffix=ids(suffix))


def block_rows(prompt: RepeatPrompt, document: torch.Tensor, start: int, b: int, tail: int,
               offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, positions) of the reconstruction rows of the block ``document[start : start + b]``:
    the repeat prompt (with the previous block's last ``tail`` tokens after block 0), the suffix and
    the block, at positions ``offset + start + b`` on (right after the block)."""
    head = list(prompt.first) if start == 0 else list(prompt.later) + document[max(0, start - tail):start].tolist()
    ids = torch.tensor(head + list(prompt.suffix) + document[start:start + b].tolist(), dtype=torch.long)
    first = offset + start + b
    return ids, torch.arange(first, first + ids.numel(), dtype=torch.long)


# reconstruction rows scored at once: the scorer's largest tensor is [H, G, SCORE_ROWS, n + e] fp32,
# a fraction of the attention-score matrix that the memory plan counts for one step
# (``block_activation_bytes``: Hq × (B + extra rows) × capacity), so the score fits the plan
SCORE_ROWS = 32


def reconstruction_scores(keys: torch.Tensor, positions: torch.Tensor, n_cache: int, row_queries: torch.Tensor,
                          row_keys: torch.Tensor, row_positions: torch.Tensor, sinks: int,
                          scale: float | None = None, chunk_rows: int = SCORE_ROWS) -> torch.Tensor:
    """KVzip's score of the block's entries, [H, b] fp32: for each reconstruction row and query head,
    the softmax over the visible keys — the cache's sink entries (position < ``sinks``), the block's
    entries (index ≥ ``n_cache``) and the rows' own keys up to the row's position — then the max
    over the rows and over the query heads of each KV group.

    keys [H, n, d] / positions [H, n]: cache ⊕ block; row_queries [Hq, e, d], row_keys [H, e, d],
    row_positions [e] (post-RoPE). The rows are scored ``chunk_rows`` at a time (a running max), and
    each chunk's softmax is taken in place, so one [H, G, chunk_rows, n + e] matrix (and its mask) is
    the largest thing alive: the memory plan's attention scores cover it."""
    num_kv, n, d = keys.shape
    num_q, e, _ = row_queries.shape
    groups = kv_groups(num_q, num_kv)
    scale = softmax_scale(scale, d)
    q = row_queries.to(torch.float32).reshape(num_kv, groups, e, d)
    k = torch.cat([keys.to(torch.float32), row_keys.to(torch.float32)], dim=1)  # [H, n + e, d]
    kt = k.transpose(1, 2)
    index = torch.arange(n, device=keys.device)
    hidden = ~((index[None, :] >= n_cache) | (positions < sinks))  # [H, n]: cache entries the rows do not see
    score = torch.zeros(num_kv, n - n_cache, dtype=torch.float32, device=keys.device)
    for r0 in range(0, e, max(1, int(chunk_rows))):
        r1 = min(e, r0 + max(1, int(chunk_rows)))
        c = r1 - r0
        logits = torch.matmul(q[:, :, r0:r1].reshape(num_kv, groups * c, d), kt).view(num_kv, groups, c, n + e)
        logits.mul_(scale)
        logits[..., :n].masked_fill_(hidden[:, None, None, :], float("-inf"))
        # causal among the rows: row i sees row j's key when j's position ≤ i's
        later = row_positions[None, :] > row_positions[r0:r1, None]  # [c, e]
        logits[..., n:].masked_fill_(later[None, None], float("-inf"))
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        logits.div_(logits.sum(dim=-1, keepdim=True))
        torch.maximum(score, logits[..., n_cache:n].amax(dim=(1, 2)), out=score)
        del logits
    return score


def aligned_scores(keys: torch.Tensor, n_cache: int, row_queries: torch.Tensor, row_keys: torch.Tensor,
                   row_positions: torch.Tensor, scale: float | None = None,
                   chunk_rows: int = SCORE_ROWS) -> torch.Tensor:
    """The ``aligned`` score of the block's entries, [H, b] fp32: entry j scores the attention it gets
    from the one reconstruction row that must reproduce it — the row holding the token before j's copy
    (the last prompt row for j = 0; with no prompt rows, row 0) — under that row's softmax over
    everything it sees (the whole cache, the block, the rows up to its own), max over the query heads
    of the KV group.

    Why not KVzip's max over every row: on SmolLM2, with B-token chunks, the max over rows does not
    single out the entries the copy needs; the needles' value tokens score about the median of their
    head (``tools/results/results_reconstruct_diagnosis.py``); the aligned row asks only "is j read
    when j is repeated". The softmax takes the whole cache, so an entry the model can
    repeat from elsewhere (an earlier mention, the language prior via the sinks) scores low.

    Same inputs as ``reconstruction_scores``; the block's copy is the last b rows. Scored
    ``chunk_rows`` entries at a time: one [H, G, chunk_rows, n + e] matrix is the largest thing alive."""
    num_kv, n, d = keys.shape
    num_q, e, _ = row_queries.shape
    b = n - n_cache
    groups = kv_groups(num_q, num_kv)
    scale = softmax_scale(scale, d)
    prompt = e - b
    row_of = (torch.arange(b, device=keys.device) + prompt - 1).clamp(min=0)  # [b] the row that reproduces j
    q = row_queries.to(torch.float32).reshape(num_kv, groups, e, d)
    k = torch.cat([keys.to(torch.float32), row_keys.to(torch.float32)], dim=1)  # [H, n + e, d]
    kt = k.transpose(1, 2)
    score = torch.zeros(num_kv, b, dtype=torch.float32, device=keys.device)
    for j0 in range(0, b, max(1, int(chunk_rows))):
        j1 = min(b, j0 + max(1, int(chunk_rows)))
        rows = row_of[j0:j1]
        c = j1 - j0
        logits = torch.matmul(q[:, :, rows].reshape(num_kv, groups * c, d), kt).view(num_kv, groups, c, n + e)
        logits.mul_(scale)
        later = row_positions[None, :] > row_positions[rows, None]  # [c, e]: causal among the rows
        logits[..., n:].masked_fill_(later[None, None], float("-inf"))
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        logits.div_(logits.sum(dim=-1, keepdim=True))
        own = n_cache + torch.arange(j0, j1, device=keys.device)  # entry j's column in its row
        score[:, j0:j1] = logits[:, :, torch.arange(c, device=keys.device), own].amax(dim=1)
        del logits
    return score


# the scorings ``--policy-arg score=...`` selects
SCORES = {
    "kvzip": "KVzip's: max over every reconstruction row of its softmax over the sinks, the block and the rows",
    "aligned": "the row that reproduces the entry, its softmax over everything it sees (the whole cache too)",
}


@dataclass
class ReconstructPolicy(Policy):
    name = "reconstruct"
    summary = ("KVzip, block-wise: each block's entries scored by the attention they get while the model "
               "repeats the block (query-agnostic; about 2x the prefill)")
    observes_every_step = True
    entry_state = (STATE,)
    # what a compiled artifact's extra rows hold (its manifest's pseudo_rows.positions): each block's
    # reconstruction rows, after the block
    positions: ClassVar[str] = "reconstruct"
    # the first tokens, always kept (KVzip's n_sink)
    sinks: int = 4
    # tokens of the previous block quoted in the "starting with" prompt (KVzip's prev_postfix_size)
    tail: int = 8
    # the repeat prompt in the model's chat form (KVzip), when the tokenizer has one
    chat: bool = True
    # rows reserved for the repeat prompt, the tail and the suffix: a step carries this + B extra rows
    prompt_rows: int = 32
    # how the rows score the block's entries (``SCORES``)
    score: str = "kvzip"

    def __post_init__(self):
        if self.score not in SCORES:
            raise PolicyError(f"reconstruct: score={self.score!r} is not a scoring; give --policy-arg score= one of "
                              f"{', '.join(SCORES)}")
        self._block = 0
        self._prompt = RepeatPrompt()
        self._document: torch.Tensor | None = None
        self._engine = None
        self._prompt_set = False

    @property
    def rows_every_block(self) -> bool:
        """The engine appends ``extra_tokens()`` to every block, evicting or not (``extra_rows_for``)."""
        return True

    @property
    def max_extra_tokens(self) -> int:
        """Extra rows of one step: ``prompt_rows`` (the repeat prompt, the tail, the suffix) + B,
        known once ``check_budget`` has seen B; what the memory plan and the caches count."""
        return self.prompt_rows + self._block if self._block else 0

    def check_budget(self, budget: int, block: int) -> None:
        if self.sinks < 0 or self.tail < 0:
            raise PolicyError("reconstruct: sinks and tail must be ≥ 0")
        if self.sinks >= budget:
            raise PolicyError(f"reconstruct: sinks ({self.sinks}) must be below the budget ({budget})")
        self._block = int(block)

    def set_repeat_prompt(self, prompt: RepeatPrompt) -> None:
        """The ids of the repeat prompt (``repeat_prompt(tokenizer)``), refused when they do not fit
        ``prompt_rows``."""
        need = prompt.rows(self.tail, 0)
        if need > self.prompt_rows:
            raise PolicyError(f"reconstruct: the repeat prompt takes {need} rows with tail={self.tail}, more than "
                              f"prompt_rows={self.prompt_rows}; give --policy-arg prompt_rows={need} or more")
        self._prompt = prompt
        self._prompt_set = True

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The repeat prompt from the model's tokenizer (``repeat_prompt``), unless it was set
        (``set_repeat_prompt``): the engine's ``prepare`` and the compiler call it."""
        if not self._prompt_set:
            self.set_repeat_prompt(repeat_prompt(tokenizer, self.chat))

    @property
    def repeat(self) -> RepeatPrompt:
        return self._prompt

    def prepare(self, prompt_ids: torch.Tensor, model: Any) -> None:
        """A new document: rows on every block when it runs past N (``model`` is the engine)."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        self._engine = weakref.ref(model) if model is not None else None
        self.use_tokenizer(getattr(getattr(model, "model", None), "tokenizer", None))
        budget = int(getattr(model, "budget", 0) or 0)
        self._document = ids if ids.numel() > budget else None

    def prepare_continuation(self, ids: torch.Tensor, start: int, model: Any) -> None:
        """A question or a saved cache's continuation: nothing is reconstructed."""
        self._document = None

    def extra_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        engine = self._engine() if self._engine is not None else None
        if self._document is None or engine is None:
            return None
        start = int(engine.position)
        if start >= self._document.numel():  # decoding after the document
            self._document = None
            return None
        b = min(engine.block, self._document.numel() - start)
        return block_rows(self._prompt, self._document, start, b, self.tail)

    def observe(self, ctx: EvictionContext) -> None:
        state = ctx.state.get(STATE)
        if state is None:
            raise PolicyError(f"reconstruct: ctx.state has no {STATE!r}; the engine keeps it beside the cache")
        block = slice(ctx.n_cache, ctx.n)
        rows = ctx.extra_queries is not None and ctx.extra_keys is not None and not ctx.extra_is_question
        if rows and ctx.extra_queries.shape[1] > 0 and self.score == "aligned":
            state[:, block] = aligned_scores(ctx.keys, ctx.n_cache, ctx.extra_queries, ctx.extra_keys,
                                             ctx.extra_query_positions, ctx.scale).to(state.dtype)
        elif rows and ctx.extra_queries.shape[1] > 0:
            state[:, block] = reconstruction_scores(ctx.keys, ctx.positions, ctx.n_cache, ctx.extra_queries,
                                                    ctx.extra_keys, ctx.extra_query_positions, self.sinks,
                                                    ctx.scale).to(state.dtype)
        else:
            state[:, block] = CONTINUATION
        sink = ctx.positions[:, block] < self.sinks
        state[:, block] = torch.where(sink, torch.ones_like(state[:, block]), state[:, block])

    def select(self, ctx: EvictionContext) -> Selection:
        if not ctx.must_evict:
            return keep_all(ctx)
        return Selection(kept=topk_keep(ctx.state[STATE].to(torch.float32), ctx.budget))
