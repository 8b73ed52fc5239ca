"""Budgets: "8k", "8192", "0.5k" tokens, or "512MiB", "1.5GB" bytes of KV cache.

A token budget N is the number of KV entries kept per layer per KV head (the KeyDiff
paper's convention). A byte budget is the whole KV cache at its peak — N + B entries per
layer and head (K, V and the entry's position; under `--kv-dtype int8` K and V are int8 codes plus
their float16 scales, `memory.kv_bytes_per_token`) — so N = bytes / bytes_per_token − B.

A family with sliding-window layers (Gemma 3) splits a byte budget over both kinds of cache: the local
layers' rings of window + B entries come first (their size is fixed), the rest buys the global layers'
N + B. Their window is the floor of N: a budget below it is refused (a global layer keeping less than
a local layer's window would forget what its neighbours still see)."""

from __future__ import annotations

import re

from .memory import DEFAULT_KV_DTYPE, kv_bytes_per_token, local_kv_bytes
from .models.config import ModelConfig
from .units import human_bytes, is_size, parse_size

# the defaults every command shares (`edgekv run`, `compile`, `simulate`, `bench`)
DEFAULT_BUDGET = "1k"
DEFAULT_BLOCK = 128
DEFAULT_POLICY = "keydiff"  # edgekv.policies re-exports it (this module loads no torch)

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


class BudgetError(ValueError):
    """The --budget the user gave cannot be used; the message says how to fix it."""


def parse_budget(text: str, config: ModelConfig | None = None, block: int = 128,
                 kv_dtype: str | None = None) -> int:
    """Tokens N per layer and KV head. Byte forms need the model geometry (``config``) and count
    the cache in ``kv_dtype`` (``memory.KV_DTYPES``: int8 entries with their scales, so the same
    bytes buy more entries than fp32; None: fp32)."""
    raw = str(text).strip()
    m = _TOKENS.match(raw)
    if m:
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
        value = float(m.group(1)) * scale
        if value != int(value):
            raise BudgetError(f"budget {raw!r} is not a whole number of tokens ({value:g}); use e.g. 512 or 0.5k")
        tokens = int(value)
        if tokens <= 0:
            raise BudgetError(f"budget {raw!r} keeps no tokens; give at least one block, e.g. --budget {block}")
    elif is_size(raw):
        if config is None:
            raise BudgetError("a byte budget needs the model geometry; give tokens (e.g. 2k) instead")
        per_token = kv_bytes_per_token(config, kv_dtype or DEFAULT_KV_DTYPE)
        rings = local_kv_bytes(config, block, kv_dtype or DEFAULT_KV_DTYPE)
        total_tokens = max(0, parse_size(raw) - rings) // per_token
        tokens = total_tokens - block
        if rings and tokens < config.sliding_window:
            need = rings + (config.sliding_window + block) * per_token
            raise BudgetError(
                f"budget {raw} leaves {human_bytes(max(0, parse_size(raw) - rings))} for the global layers after the "
                f"{len(config.local_layers)} sliding-window layers' rings ({human_bytes(rings)}: window "
                f"{config.sliding_window} + block {block} entries each), room for N = {max(0, tokens)} tokens; the window "
                f"is the floor of N: give at least {human_bytes(need)}"
            )
        if tokens < block:
            need = 2 * block * per_token
            cache = " with an int8 KV cache" if kv_dtype == "int8" else ""
            raise BudgetError(
                f"budget {raw} holds only {total_tokens} tokens of KV cache ({per_token} bytes per token for "
                f"this model{cache}), not enough for the cache plus one block of {block}; give at least "
                f"{human_bytes(need)} or a smaller --block"
            )
    else:
        raise BudgetError(
            f"cannot read budget {raw!r}; write tokens (8k, 8192, 0.5k) or bytes of KV cache (512MiB, 1.5GB)"
        )
    if tokens < block:
        raise BudgetError(
            f"budget {tokens} tokens is smaller than one block ({block}); use --budget {block} or more, "
            f"or a smaller --block"
        )
    if config is not None:
        check_window_floor(config, tokens)
    return tokens


def check_window_floor(config: ModelConfig, tokens: int) -> None:
    """Refuse N below the sliding window of a family with local layers (they keep exactly it)."""
    if config.local_layers and tokens < config.sliding_window:
        raise BudgetError(
            f"budget {tokens} tokens is smaller than the sliding window of this model's local layers "
            f"({config.sliding_window} tokens, {len(config.local_layers)} of {config.num_layers} layers): they keep "
            f"exactly their window, so the window is the floor; use --budget {config.sliding_window} or more"
        )
