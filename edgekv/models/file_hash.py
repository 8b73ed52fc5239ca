"""sha256 of model files, remembered per (path, size, mtime) in the user cache — its own module
because both the loader and a lazily loaded model (``LoadedModel.weight_hash``) need it."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from .sources import cache_root


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def source_sha256(path: Path) -> str:
    """sha256 of a model file, remembered per (path, size, mtime) in the cache so that a file is
    hashed once, not on every load."""
    stat = path.stat()
    memo_key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache_root() / "converted" / "hashes.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if memo_key in known:
        return known[memo_key]
    digest = sha256_of_file(path)
    known[memo_key] = digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="hashes.", dir=memo.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(known, fh, indent=1)
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache still works, it just hashes again next time
    return digest
