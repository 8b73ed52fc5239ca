"""`edgekv cache`: the converted model copies edgekv keeps, and --clear."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..units import human_bytes
from .common import err, out


def cache_cmd(
    clear: Annotated[bool, typer.Option(help="delete edgekv's cached model copies (they are rebuilt on next use)")] = False,
):
    """Show edgekv's model cache (converted copies of GGUF models), or clear it with --clear."""
    import shutil

    from ..models.loader import cached_conversions
    from ..models.sources import cache_root

    root = cache_root()
    entries = cached_conversions()
    total = sum(e["bytes"] for e in entries)
    out.print(f"edgekv cache: {root} (EDGEKV_CACHE moves it)", soft_wrap=True, highlight=False)
    table = Table(title="converted models")
    table.add_column("converted copy")
    table.add_column("of")
    table.add_column("source sha256", no_wrap=True)
    table.add_column("size", justify="right")
    for e in entries:
        table.add_row(e["path"].name, e["source"], (e["sha256"] or "?")[:12], human_bytes(e["bytes"]))
    out.print(table)
    if not clear:
        err.print(f"{len(entries)} converted cop{'y' if len(entries) == 1 else 'ies'}, {human_bytes(total)}; "
                  "`edgekv cache --clear` deletes them (or delete the folder yourself)", soft_wrap=True)
        return
    for e in entries:
        shutil.rmtree(e["path"], ignore_errors=True)
    err.print(f"deleted {len(entries)} converted cop{'y' if len(entries) == 1 else 'ies'} ({human_bytes(total)}); "
              "the next run converts its model again (~30 s)")
