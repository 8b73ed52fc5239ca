"""The int8 KV cache format (`--kv-dtype int8`, eager engine): per token, per group of 32 channels.

Format. Each K or V row of one KV head (d channels; K after RoPE) is cut into groups of
``INT8_GROUP`` = 32 consecutive channels (one group when d ≤ 32, a shorter last group when d is not
a multiple of 32). A group stores its int8 codes and one float16 scale, symmetric as GGML's Q8_0:

    s = max|x| / 127 over the group, in float16 — rounded up, not to nearest, where rounding to
        nearest would give s·127 < max|x|, so that no code is ever clipped,
    q = round(x / s) ∈ [−127, 127]   (q = 0 in an all-zero group, s = 0),
    x̂ = s · q                         (exact in float32: an 11-bit by 8-bit product).

So |x − x̂| ≤ s/2 for every element, and a row of d = 64 costs 64 + 2·2 = 68 bytes against 256
in fp32 (``memory.kv_row_bytes``). A scale past float16's range (a group with max|x| > 8.3e6)
saturates at 65504 and its codes clip at ±127; no LLM's K or V comes near that.

Why per token, and why groups of 32 channels (measured on SmolLM2-135M-Instruct: K and V of all
30 layers over the first 1,536 tokens of `edgekv eval`'s fidelity text, `tools/experiments/check_kv_int8.py`,
docs/results/kv_int8.md; relative error = ‖x − x̂‖ / ‖x‖ over all rows and layers):
- Groups of 32 instead of one scale per whole row, because K has outlier channels (a few channels
  of much larger magnitude, the observation behind KIVI): with one scale per row the largest
  channel sets the step for all d channels. K: 0.83 % per 32 channels against 1.08 % per whole
  row (worst layer 0.96 % against 1.30 %); V: 0.59 % against 0.68 %. It costs 2 bytes per row
  (68 against 66 at d = 64).
- Per token, because the cache is streaming and evicting. A row is quantised once, when it is
  written, from its own values; its codes and scales never change after that, whichever rows are
  evicted around it, and compaction moves them with the row. KIVI's per-channel K (one scale per
  channel over a group of tokens) is more accurate for K — 0.37 % over groups of 32 tokens, same
  bytes — but it needs the group's tokens before it can quantise any of them (KIVI keeps the
  newest tokens in full precision until a group is complete), and under eviction a group's tokens
  leave one by one, at different positions per KV head: its scales would then cover rows no
  longer there (too coarse) or the survivors would be requantised, changing kept rows at every
  eviction, and compaction would have to regroup rows of different groups. None of that fits a
  fixed N + B buffer compacted after every block, nor a compiled kernel.

The rule for who reads what: quantise on write, everything reads dequantised. ``LayerCache.write``
quantises a block's K and V as they enter the cache, and every reader sees only x̂: the block's
attention over cache ⊕ block — the block's own rows included —, every policy's scoring (the
``EvictionContext``'s keys and values, the question's or pseudo rows' keys, RocketKV's page
summaries and sparse attention) and snapshots. The block's own rows are read quantised too, so a
token's K and V have one value from the step that wrote them to the last step that reads them (the
scores that decide a row's eviction see the same values its attention saw), and a compiled kernel
can follow one rule: dequantise whatever it reads from the cache. The price, measured (full cache,
nothing evicted, 2 × 512 teacher-forced positions): mean KL to fp32 KV 2.6e-4 nats and top-1
99.3 % against 5e-5 and 99.5 % with the block's own rows read in fp32 — two orders of magnitude
below what eviction itself costs at N = 256–512 (2e-2 to 3e-1). A merge-on-evict policy (D2O) writes new rows: those
are quantised on write as well; rows it returns unchanged keep their codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..memory import INT8_GROUP

CODE_LIMIT = 127  # symmetric: −128 is never used, so negating a row negates its codes exactly
SCALE_DTYPE = torch.float16
_FLOAT16_MAX = 65504.0


def _grouped(x: torch.Tensor, groups: int, group: int) -> torch.Tensor:
    """[..., d] → [..., groups, group], zero-padded past d (zeros never raise a group's max)."""
    d = x.shape[-1]
    if groups * group != d:
        x = F.pad(x, (0, groups * group - d))
    return x.reshape(*x.shape[:-1], groups, group)


def quantize_rows(x: torch.Tensor, group: int = INT8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [..., d] → (codes [..., d] int8, scales [..., ⌈d/group⌉] float16): the module's format
    with its groups of 32 (another ``group`` only for measuring alternatives: tools/experiments/check_kv_int8.py)."""
    d = x.shape[-1]
    groups = -(-d // group)
    grouped = _grouped(x.float(), groups, group)
    peak = grouped.abs().amax(dim=-1)
    scales = (peak / CODE_LIMIT).clamp(max=_FLOAT16_MAX).to(SCALE_DTYPE)
    # rounding to nearest can leave s·127 a hair under max|x| (then the largest element would clip);
    # the next float16 up is then taken: scales are ≥ 0, so that is the bit pattern plus one
    short = scales.float() * CODE_LIMIT < peak
    if bool(short.any()):
        up = (scales.view(torch.int16) + 1).view(SCALE_DTYPE)
        scales = torch.where(short & (scales < _FLOAT16_MAX), up, scales)
    step = scales.float()
    safe = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero group: codes 0 whatever the divisor
    codes = torch.round(grouped / safe[..., None]).clamp(-CODE_LIMIT, CODE_LIMIT).to(torch.int8)
    return codes.reshape(*x.shape[:-1], groups * group)[..., :d].contiguous(), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, group: int = INT8_GROUP) -> torch.Tensor:
    """(codes [..., d] int8, scales [..., G] float16) → x̂ [..., d] float32 (x̂ = s · q, exact)."""
    d = codes.shape[-1]
    groups = scales.shape[-1]
    if groups * group == d:
        grouped = codes.reshape(*codes.shape[:-1], groups, group).float() * scales.float()[..., None]
        return grouped.reshape(codes.shape)
    step = scales.float().repeat_interleave(group, dim=-1)[..., :d]
    return codes.float() * step


def round_trip(x: torch.Tensor, group: int = INT8_GROUP) -> torch.Tensor:
    """What an int8 cache gives back for rows ``x``: dequantize(quantize(x)), float32."""
    return dequantize_rows(*quantize_rows(x, group), group)


def quantization_bound(x: torch.Tensor, group: int = INT8_GROUP) -> torch.Tensor:
    """Per element of ``x`` [..., d], the largest |x − x̂| the format allows: half its group's scale."""
    _, scales = quantize_rows(x, group)
    step = scales.float().repeat_interleave(group, dim=-1)[..., : x.shape[-1]]
    return step / 2
