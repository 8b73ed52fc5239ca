"""Output files of a command (a report, a saved cache): refused before any work when they cannot be
written, and written atomically at the end."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import InputError


def check_writable(path: str | os.PathLike | None, what: str = "--output") -> None:
    """Refuse an output file that cannot be written, before any work starts. The test is the
    write itself: a temporary file is created (and removed) in the target's folder, as
    ``write_json_atomic`` will do at the end — permission bits alone do not tell (root, read-only
    file systems, /proc)."""
    if path is None:
        return
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise InputError(f"{what} {p} is a directory; give a file path such as {p / 'report.json'}")
    if parent.exists() and not parent.is_dir():
        raise InputError(f"{what} {p}: {parent} is a file, not a folder; choose another path")
    if not parent.is_dir():
        raise InputError(f"{what} {p}: the folder {parent} does not exist; create it or choose another path")
    if p.exists() and not p.is_file():  # a device such as /dev/null: written in place
        try:
            with open(p, "a"):
                pass
        except OSError as exc:
            raise InputError(f"{what} {p} is not writable ({exc.strerror}); choose a path you can write to") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".check", dir=parent)
        os.close(fd)
        os.unlink(tmp)
        if p.exists():
            with open(p, "a"):
                pass
    except OSError as exc:
        raise InputError(f"{what} {p} is not writable: cannot create a file in {parent} ({exc.strerror or exc}); "
                         "choose a path you can write to") from None


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write via a temporary file and rename, so a failed run never leaves half a file
    (a path that exists and is not a regular file, such as /dev/stdout, is written in place)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_file():
        with open(p, "w") as fh:
            json.dump(data, fh, indent=2)
        return
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is an ordinary file
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
