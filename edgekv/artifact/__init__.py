"""The artifact directory: the contract between the exporter (``edgekv compile``) and the
runtimes (the Python HostRuntime, the native ``runtime/``). Nothing here imports TVM or the
compiler, so a runtime can check an artifact without them.

    model.so | model.tar   the TVM-generated kernel library (.tar: objects for another machine)
    params.safetensors     the weights, each 64-byte aligned (``params_file``), mapped at load
    program.ekv            the entry functions as flat kernel-call lists + static memory plan
                           (``program_file``), read by the native runtime
    tokenizer.ekt          the tokenizer as a compact binary file (native runtime)
    tokenizer/             the HF tokenizer files (Python)
    manifest.json          what was built and how to check it, for Python and people
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

ARTIFACT_FORMAT = "edgekv-artifact"
ARTIFACT_VERSION = 2  # 2: aligned params, program.ekv, tokenizer.ekt
MANIFEST = "manifest.json"
PARAMS_FILE = "params.safetensors"
PROGRAM_FILE = "program.ekv"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.ekt"


class ArtifactError(RuntimeError):
    """The artifact is missing, corrupt, or does not match this installation."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def crc32_file(path: str | Path) -> int:
    """zlib's CRC-32, the checksum the native runtime verifies (runtime/src/reader.c)."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def edgekv_version() -> str:
    try:
        from importlib.metadata import version

        return version("edgekv")
    except Exception:  # not installed (running from a checkout)
        import re

        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
        m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
        return m.group(1) if m else "unknown"


def is_artifact(path: str | Path | None) -> bool:
    """True when ``path`` is a directory holding an edgekv manifest (for ``edgekv run PATH``)."""
    return path is not None and (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise ArtifactError(f"{path} is not an artifact directory (run `edgekv compile ... -o {path}` first)")
    if not mf.exists():
        raise ArtifactError(f"{path} has no {MANIFEST}; it is not an edgekv artifact or it is incomplete")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{mf} is corrupt ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise ArtifactError(f"{mf} is not an edgekv artifact manifest (format={fmt!r})")
    if manifest.get("format_version") != ARTIFACT_VERSION:
        raise ArtifactError(f"artifact format version {manifest.get('format_version')} is not supported by this "
                            f"edgekv (expects {ARTIFACT_VERSION}); recompile it")
    return manifest


def verify_artifact(path: str | Path, manifest: dict, *, check_hashes: bool = True,
                    tvm_version: str | None = None) -> None:
    """Files present and (with ``check_hashes``) equal to their sha256; the artifact made by this
    edgekv version; ``tvm_version``: the TVM that will run it (HostRuntime) must be the one that
    built it."""
    path = Path(path)
    files = manifest.get("files") or {}
    for key in ("library", "params", "program", "tokenizer_file"):
        entry = files.get(key)
        if not entry:
            if key in ("library", "params"):
                raise ArtifactError(f"{path / MANIFEST} lists no {key} file; recompile the artifact")
            continue
        f = path / entry["name"]
        if not f.exists():
            raise ArtifactError(f"artifact file missing: {f}")
        if check_hashes and sha256_file(f) != entry["sha256"]:
            raise ArtifactError(f"{f} does not match the sha256 in the manifest (corrupt or replaced); recompile")
    built = manifest.get("versions", {})
    if built.get("edgekv") != edgekv_version():
        raise ArtifactError(f"artifact was built by edgekv {built.get('edgekv')}, this is edgekv {edgekv_version()}; "
                            "recompile it with this installation")
    if tvm_version is not None and built.get("tvm") != tvm_version:
        raise ArtifactError(f"artifact was built with TVM {built.get('tvm')}, this runtime has TVM {tvm_version}; "
                            "recompile it with this installation")
