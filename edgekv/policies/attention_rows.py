"""Attention probabilities of a few query rows over cache ⊕ block — the shared reference for the
attention-based baselines (SnapKV, SnapKV++, TOVA, H2O).

What is computed, exactly (fp32 throughout, batch 1):

    logits[h, r, j] = scale · q[h, r] · k[h // G, j]              G = Hq / H query heads per KV head
    visible[h, r, j] = positions[h // G, j] ≤ query_positions[r]   (causal mask by original position)
    probs[h, r, :]  = softmax over the visible j of logits[h, r, :], 0 on the masked j

Query head ``h`` reads KV head ``h // G`` (HF ``repeat_kv`` order: consecutive query heads share a
KV head). ``scale`` defaults to 1/sqrt(d). The mask is by *position*, not by index, so it is right for
any candidate order; in the engine the cache rows come first and the block rows last, which makes it
the usual "causal inside the block, everything visible in the cache" mask.

The policies ask only for the rows they need — SnapKV the last w block rows, TOVA the last one — and
H2O's column sums over all block rows are accumulated ``row_chunk`` rows at a time. The full [b, n]
matrix for every head is never built: the compiled kernels work the same way (a row tile, its
max / exp / sum / divide, then the reduction the policy needs). A row with no visible key (impossible in
the engine, where every query sees its own key) gives all-zero probabilities, never NaN.
"""

from __future__ import annotations

import math

import torch

from .base import PolicyError

# Query rows per chunk for column sums: 32 rows × (N + B) candidates × Hq heads of fp32 at a time.
DEFAULT_ROW_CHUNK = 32


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: the given one, or 1/sqrt(d)."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def kv_groups(num_q_heads: int, num_kv_heads: int) -> int:
    """G, the number of query heads that share one KV head."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    return num_q_heads // num_kv_heads


def attention_rows(
    keys: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention probabilities of the given query rows: [Hq, r, n] fp32.

    keys [H, n, d] (post-RoPE), positions [H, n], queries [Hq, r, d] (post-RoPE), query_positions [r].
    """
    num_kv, n, d = keys.shape
    num_q, rows, _ = queries.shape
    groups = kv_groups(num_q, num_kv)
    scale = softmax_scale(scale, d)

    # [H, G·r, d] @ [H, d, n] -> [H, G, r, n]: each KV head against the query rows of its group,
    # without repeating K per query head.
    q = queries.to(torch.float32).reshape(num_kv, groups * rows, d)
    k = keys.to(torch.float32)
    logits = torch.matmul(q, k.transpose(1, 2)).view(num_kv, groups, rows, n) * scale

    visible = positions[:, None, None, :] <= query_positions.to(positions.device)[None, None, :, None]
    logits = logits.masked_fill(~visible, float("-inf"))

    # Softmax written out (max, exp, sum, divide) as the kernels do it; fully masked rows -> zeros.
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, torch.ones_like(total))
    return probs.reshape(num_q, rows, n)


def attention_column_sums(
    keys: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float | None = None,
    row_chunk: int = DEFAULT_ROW_CHUNK,
) -> torch.Tensor:
    """Σ over all query rows of ``attention_rows``: [Hq, n] fp32, computed ``row_chunk`` rows at a time."""
    if row_chunk <= 0:
        raise ValueError("row_chunk must be positive")
    num_q, rows, _ = queries.shape
    total = torch.zeros(num_q, keys.shape[1], dtype=torch.float32, device=keys.device)
    for start in range(0, rows, row_chunk):
        stop = min(start + row_chunk, rows)
        probs = attention_rows(keys, positions, queries[:, start:stop], query_positions[start:stop], scale)
        total += probs.sum(dim=1)
    return total


def group_reduce(per_query_head: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """[Hq, ...] -> [H, ...]: mean (or sum) over the G query heads of each KV group."""
    groups = kv_groups(per_query_head.shape[0], num_kv_heads)
    grouped = per_query_head.reshape(num_kv_heads, groups, *per_query_head.shape[1:])
    if how == "mean":
        return grouped.mean(dim=1)
    if how == "sum":
        return grouped.sum(dim=1)
    raise ValueError(f"unknown group reduction {how!r} (mean or sum)")


def scoring_rows(ctx, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows a query-aware policy scores a step with: the question's, when the engine
    appends the question after the document (`--question`: its tokens at their true future
    positions, rows that never enter the cache), else the block's own rows."""
    if ctx.extra_is_question and ctx.extra_queries is not None and ctx.extra_queries.shape[1] > 0:
        return ctx.extra_queries, ctx.extra_query_positions
    return require_queries(ctx, policy)


def require_queries(ctx, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's queries and their positions, or a clear error when the engine did not pass them."""
    if ctx.queries is None or ctx.query_positions is None:
        raise PolicyError(
            f"policy '{policy}' scores with attention and needs the block's queries "
            "(ctx.queries [Hq, b, d] and ctx.query_positions [b]); the engine passes them when "
            "the policy sets needs_queries = True"
        )
    if ctx.queries.shape[1] == 0:
        raise PolicyError(f"policy '{policy}' got an empty block (no query rows)")
    return ctx.queries, ctx.query_positions
