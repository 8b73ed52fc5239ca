"""`edgekv cache`: the model files edgekv keeps (converted copies, fetched wheels, the GGUFs
extracted or assembled from them), and --clear."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..units import human_bytes
from .common import err, out


def cache_cmd(
    clear: Annotated[bool, typer.Option(help="delete edgekv's cached model copies and fetched model files (they are "
                                             "fetched and rebuilt on next use)")] = False,
):
    """Show edgekv's model cache (converted copies of GGUF models, fetched model wheels and the GGUFs
    taken from them), or clear it with --clear."""
    import shutil

    from ..models.loader import cached_conversions
    from ..models.sources import cache_root, cached_downloads

    root = cache_root()
    entries = cached_conversions()
    downloads = cached_downloads()
    total = sum(e["bytes"] for e in entries)
    fetched = sum(d["bytes"] for d in downloads)
    out.print(f"edgekv cache: {root} (EDGEKV_CACHE moves it)", soft_wrap=True, highlight=False)
    table = Table(title="converted models")
    table.add_column("converted copy")
    table.add_column("of")
    table.add_column("source sha256", no_wrap=True)
    table.add_column("size", justify="right")
    for e in entries:
        table.add_row(e["path"].name, e["source"], (e["sha256"] or "?")[:12], human_bytes(e["bytes"]))
    out.print(table)
    if downloads:
        files = Table(title="fetched model files")
        files.add_column("file")
        files.add_column("kind")
        files.add_column("size", justify="right")
        for d in downloads:
            files.add_row(str(d["path"].relative_to(root)), d["kind"], human_bytes(d["bytes"]))
        out.print(files)
    what = (f"{len(entries)} converted cop{'y' if len(entries) == 1 else 'ies'}, {human_bytes(total)}; "
            f"{len(downloads)} fetched file{'' if len(downloads) == 1 else 's'}, {human_bytes(fetched)}")
    if not clear:
        err.print(f"{what}; `edgekv cache --clear` deletes them (or delete the folder yourself)", soft_wrap=True)
        return
    for e in entries:
        shutil.rmtree(e["path"], ignore_errors=True)
    for d in downloads:
        d["path"].unlink(missing_ok=True)
    err.print(f"deleted {what}; the next run fetches and converts its model again", soft_wrap=True)
