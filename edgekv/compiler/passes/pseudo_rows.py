"""Pseudo rows in the compiled block step (DapQ).

A policy with ``max_extra_tokens`` = w > 0 (DapQ: its window) has w pseudo tokens appended to
every prefill step. The compiled prefill function is exported at T = B + w rows:

    tokens[B + w], positions[B + w], n_valid[1]   rows [0, n_valid) real, [n_valid, B) padding,
                                                  [B, B + w) the pseudo tokens at their own positions

Nothing else in the graph changes: projections, RoPE and MLP are row-wise, so the pseudo rows
run through every layer like real ones. Three kernels know about them:

* block attention (``kernels/attention.py``, ``extra_rows`` = w): real rows never see the pseudo
  rows (causal: they come last); pseudo rows see the valid cache, the real rows [0, n_valid) —
  never the padding — and the pseudo rows up to their own;
* the policy's score kernel reads the step's post-RoPE queries ``q`` — the generic
  ``kernel_inputs = ("queries",)`` of its compiled face — and uses only the pseudo rows'
  (``compiler/policy_kernels/dapq.py``);
* select + compaction reads block rows < n_valid only, so pseudo K/V never enter the cache.

Question rows (``edgekv compile --question-rows Q``, issue 16): the same rows carry a document's
question, so that query-aware policies score each block with the question's queries at their true
future positions (the eager engine's ``prefill(question=)``). The step then has max(w, Q) extra
rows; a runtime fills the first ones with the question (or DapQ's pseudo tokens when there is no
question) and the rest with padding at position −1. Padding comes last, so no other row sees it,
and the score kernels skip rows at a negative position: with no question at all every extra row is
padding and the kernels score with the block's own rows, as without question rows.

The logits are those of row n_valid − 1, the last real row. Decode (T = 1) has no pseudo rows.
The host runtime fills the pseudo rows from the policy's ``extra_tokens()`` (built once per
prompt by ``prepare``), for every prefill step: on a step that does not evict, their scores are
not read, so the results equal the engine's, which appends them only to evicting blocks.
"""

from __future__ import annotations

from typing import Any

from ..errors import CompileError
from .attention_sites import AttentionMatchError


def extra_rows(policy: Any) -> int:
    """Pseudo rows the policy appends to every evicting block (the engine's ``max_extra_tokens``)."""
    return int(getattr(policy, "max_extra_tokens", 0) or 0)


def check_question_rows(policy: Any, question_rows: int) -> None:
    """Refuse question rows for a policy that cannot use them, before any work."""
    if question_rows < 0:
        raise CompileError("--question-rows must be ≥ 0 (the longest question in tokens; 0: none)")
    if not question_rows:
        return
    from ..policy_kernels import KERNELS, question_policy_names

    takes = ", ".join(question_policy_names())
    if not getattr(policy, "uses_question", False):
        raise CompileError(
            f"policy '{policy.name}' does not score blocks with a question (only {takes} do), so question rows "
            "would change nothing; compile it without --question-rows")
    if policy.name not in KERNELS or not KERNELS[policy.name].question_kernels:
        raise CompileError(
            f"policy '{policy.name}' scores with the question in the eager engine (`edgekv run MODEL --question`), "
            f"but its compiled kernels do not take question rows yet; compile it without --question-rows, or use "
            f"{takes}")


def step_extra_rows(spec: Any, rows: int, fixed_n_valid: int | None) -> int:
    """The pseudo rows of one rewritten function: ``spec.extra_rows`` for the prefill step (which
    must have more rows than that), none for decode (``fixed_n_valid`` set)."""
    w = int(getattr(spec, "extra_rows", 0) or 0)
    if fixed_n_valid is not None or w == 0:
        return 0
    if rows <= w:
        raise AttentionMatchError(f"the prefill graph has {rows} rows, not more than the {w} pseudo rows of "
                                  f"policy '{spec.policy}'; export it at T = block + {w}")
    return w


def attention_kernel_key(num_q_heads: int, num_kv_heads: int, head_dim: int, extra: int) -> str:
    """Name suffix of the block-attention kernel (``gpu_schedule`` parses it back)."""
    return f"attention_h{num_q_heads}_{num_kv_heads}_d{head_dim}" + (f"_x{extra}" if extra else "")

