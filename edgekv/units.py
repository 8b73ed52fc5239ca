"""Byte sizes as people write them ("512MiB", "1.5GB" → bytes, bytes → "1.5MiB"), and counts rounded up.

Budgets (``budget.py``), memory plans (``memory.py``), ``--mem-limit`` and every report print
and read sizes through these two functions; this module imports nothing of edgekv, so any of
them can use it without importing another."""

from __future__ import annotations

import re

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)\s*$", re.IGNORECASE)
_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class SizeError(ValueError):
    """A size the user gave cannot be read; the message shows how to write one."""


def is_size(text: str) -> bool:
    """True when ``text`` is written as bytes (``512MiB``, ``1.5GB``, ``100B``)."""
    return _BYTES.match(str(text)) is not None


def parse_size(text: str) -> int:
    """Bytes from "512MiB", "1.5GB", "100B" (used for budgets and memory limits)."""
    m = _BYTES.match(str(text))
    if not m:
        raise SizeError(f"cannot read {text!r} as a size; write e.g. 512MiB, 1.5GB or 1.5GiB")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def human_bytes(n: int) -> str:
    """``1.5MiB``-style text for a byte count (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:,.1f}{unit}"
        n /= 1024
    return f"{n}"


def padded(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (weight rows and quant groups)."""
    return -(-n // multiple) * multiple
