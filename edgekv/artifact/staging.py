"""An artifact folder written as a whole: the build writes a fresh staging folder beside the
destination, which replaces the destination only when the build succeeded (so a recompile
leaves no file of an earlier target, and a failed one leaves the earlier artifact as it was).

`edgekv compile` wraps ``compile_model`` in it. It belongs beside the artifact writer; it waits
here, in a module that imports nothing of edgekv, while the compiler is being reorganised
(issue 29)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def staging_dir(output: Path) -> Path:
    """A fresh folder beside ``output`` for the build to write (hidden: its name starts with a dot)."""
    return Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".building", dir=output.parent))


def replace_dir(new: Path, output: Path) -> None:
    """Put the finished folder ``new`` in the place of ``output`` (an earlier one is moved aside,
    then deleted)."""
    if output.exists():
        old = output.with_name(f".{output.name}.old-{new.name.split('.')[-2]}")
        output.rename(old)
        new.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(output)
