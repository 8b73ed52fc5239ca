"""One file that carries an artifact to a phone: ``edgekv pack ARTIFACT -o model.ekvpkg``.

The Android app imports it through the system file picker (android/src/.../PackageImporter.java
reads the same layout), so a person needs no adb: copy the file to the phone any way, tap
"Import model". Every part has its SHA-256 in the header, and the header has its own, so a
corrupt or truncated copy is refused naming the part, before the model is usable.

Layout, version 1 (all integers little-endian)::

    0   8   magic  b"EKVPKG\\r\\n"
    8   4   u32 format version (1)
    12  4   u32 part count P
    16  8   u64 header size H (from 0 to the end of the header digest)
    24      P part entries:
              u32 flags (1: EXTERNAL, no bytes here: the app supplies the part, e.g. the model
                         library bundled in the APK as lib/arm64-v8a/libedgekv_model.so)
              u32 name length L
              u64 offset (from the start of the file; 0 for an external part)
              u64 size
              32  SHA-256 of the part's bytes
              L   name (UTF-8, a relative path with "/": no "..", no empty or "." component)
              pad to a multiple of 8
    H-32 32 SHA-256 of bytes [0, H-32)
    then the parts' bytes, each at an offset aligned to 4096, in entry order, nothing after.

The parts are manifest.json, the runtime's files the manifest names (program.ekv, the params
file, tokenizer.ekt, the library model.so) and, for an OpenCL artifact, the kernel sources under
device/. ``bundled_library=True`` leaves model.so out and records it as EXTERNAL with its hash,
so that the app refuses a package made for another build of the library.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

MAGIC = b"EKVPKG\r\n"
VERSION = 1
EXTERNAL = 1
ALIGN = 4096
_FIXED = struct.Struct("<8sIIQ")
_ENTRY = struct.Struct("<IIQQ32s")
_CHUNK = 1 << 20
LIBRARY_NAME = "model.so"  # the manifest's files.library.name for a linked artifact
MAX_PARTS = 4096
MAX_NAME = 255


class PackageError(ValueError):
    """A package that cannot be written or read: names the file, the part and the fix."""


@dataclass(frozen=True)
class Part:
    name: str
    size: int
    sha256: str
    offset: int = 0
    external: bool = False


def check_name(name: str) -> str:
    """A part's name is a plain relative path: what the importer may create under its model folder."""
    raw = name.encode("utf-8")
    parts = name.split("/")
    if not raw or len(raw) > MAX_NAME or name.startswith("/") or "\\" in name or "\0" in name \
            or any(p in ("", ".", "..") for p in parts):
        raise PackageError(f"part name {name!r} is not a plain relative path (no '..', '.', empty parts or '/' at "
                           f"the start, at most {MAX_NAME} bytes)")
    return name


def artifact_parts(artifact: Path, bundled_library: bool = False) -> list[tuple[str, Path | None]]:
    """(name, file) for each part of ARTIFACT's package; file None for an external part."""
    artifact = Path(artifact)
    manifest_path = artifact / "manifest.json"
    if not manifest_path.is_file():
        raise PackageError(f"{artifact} holds no manifest.json: pack a directory that `edgekv compile` wrote")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PackageError(f"{manifest_path} cannot be read: {exc}") from exc
    files = manifest.get("files") or {}
    if "program" not in files:
        raise PackageError(f"{artifact} has no program.ekv in its manifest: it was compiled for another runtime; "
                           "compile with --target android-cpu or --target opencl")
    library = (files.get("library") or {}).get("name")
    if library != LIBRARY_NAME:
        raise PackageError(f"{artifact}'s library is {library!r}, not model.so: link it first "
                           f"(android/finish.sh {artifact})")
    names = ["manifest.json"]
    for key in ("program", "params", "tokenizer_file"):
        entry = files.get(key)
        if entry and entry.get("name"):
            names.append(entry["name"])
    device = artifact / "device"
    if device.is_dir():
        names += sorted(str(p.relative_to(artifact)).replace(os.sep, "/") for p in device.rglob("*") if p.is_file())
    out: list[tuple[str, Path | None]] = []
    for n in names:
        check_name(n)
        if not (artifact / n).is_file():
            raise PackageError(f"{artifact}/{n} is missing: the manifest names it; compile the artifact again")
        out.append((n, artifact / n))
    if not (artifact / LIBRARY_NAME).is_file():
        raise PackageError(f"{artifact}/model.so is missing: run android/finish.sh {artifact}")
    out.append((LIBRARY_NAME, None if bundled_library else artifact / LIBRARY_NAME))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _header(parts: list[Part]) -> bytes:
    entries = b""
    for p in parts:
        name = p.name.encode("utf-8")
        e = _ENTRY.pack(EXTERNAL if p.external else 0, len(name), p.offset, p.size, bytes.fromhex(p.sha256)) + name
        entries += e + b"\0" * (-len(e) % 8)
    size = _FIXED.size + len(entries) + 32
    body = _FIXED.pack(MAGIC, VERSION, len(parts), size) + entries
    return body + hashlib.sha256(body).digest()


def pack(artifact: Path, output: Path, bundled_library: bool = False,
         progress: Callable[[int, int], None] | None = None) -> list[Part]:
    """Writes ARTIFACT's package to OUTPUT (through OUTPUT.part, renamed when complete)."""
    sources = artifact_parts(artifact, bundled_library)
    # hash first (the header goes before the data), then lay the parts out
    hashed = [(n, f, f.stat().st_size if f else (Path(artifact) / n).stat().st_size,
               _sha256(f if f else Path(artifact) / n)) for n, f in sources]
    placeholder = [Part(n, s, h, 0, f is None) for n, f, s, h in hashed]
    offset = -(-len(_header(placeholder)) // ALIGN) * ALIGN
    parts = []
    for n, f, s, h in hashed:
        if f is None:
            parts.append(Part(n, s, h, 0, True))
        else:
            parts.append(Part(n, s, h, offset))
            offset = -(-(offset + s) // ALIGN) * ALIGN
    header = _header(parts)
    total = sum(p.size for p in parts if not p.external)
    output = Path(output)
    tmp = output.with_name(output.name + ".part")
    done = 0
    try:
        with open(tmp, "wb") as out:
            out.write(header)
            for p, (_, f, _, _) in zip(parts, hashed):
                if p.external:
                    continue
                out.write(b"\0" * (p.offset - out.tell()))
                h = hashlib.sha256()
                with open(f, "rb") as src:
                    for chunk in iter(lambda: src.read(_CHUNK), b""):
                        h.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total)
                if h.hexdigest() != p.sha256:
                    raise PackageError(f"{f} changed while it was packed: pack again")
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return parts


def read_header(path: Path) -> list[Part]:
    """The part table of a package, its own digest checked; PackageError naming what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size or fixed[:8] != MAGIC:
                raise PackageError(f"{path} is not an edgekv package (no {MAGIC!r} at its start): make one with "
                                   "`edgekv pack ARTIFACT -o FILE.ekvpkg`")
            _, version, count, header_size = _FIXED.unpack(fixed)
            if version != VERSION:
                raise PackageError(f"{path} is package format {version}; this edgekv reads format {VERSION}")
            if count == 0 or count > MAX_PARTS or header_size > size or header_size < _FIXED.size + 32:
                raise PackageError(f"{path}: the header is damaged or the file is truncated ({count} parts, header "
                                   f"{header_size} bytes, file {size} bytes): copy it again")
            body = fixed + f.read(header_size - _FIXED.size - 32)
            digest = f.read(32)
    except OSError as exc:
        raise PackageError(f"{path} cannot be read: {exc}") from exc
    if hashlib.sha256(body).digest() != digest:
        raise PackageError(f"{path}: the header's SHA-256 does not match: the file is damaged; copy it again")
    parts, pos = [], _FIXED.size
    for _ in range(count):
        flags, name_len, offset, psize, digest_bytes = _ENTRY.unpack_from(body, pos)
        pos += _ENTRY.size
        name = check_name(body[pos:pos + name_len].decode("utf-8", errors="replace"))
        pos += name_len + (-(_ENTRY.size + name_len) % 8)
        external = bool(flags & EXTERNAL)
        if not external and (offset < header_size or offset + psize > size):
            raise PackageError(f"{path}: part {name} lies past the end of the file ({offset + psize} > {size} "
                               "bytes): the file is truncated; copy it again")
        parts.append(Part(name, psize, digest_bytes.hex(), offset, external))
    if len({p.name for p in parts}) != len(parts):
        raise PackageError(f"{path}: a part name appears twice")
    return parts


def check(path: Path, progress: Callable[[int, int], None] | None = None) -> list[Part]:
    """Reads every part and checks its SHA-256; PackageError naming the first bad part."""
    parts = read_header(path)
    total = sum(p.size for p in parts if not p.external)
    done = 0
    with open(path, "rb") as f:
        for p in parts:
            if p.external:
                continue
            f.seek(p.offset)
            h, left = hashlib.sha256(), p.size
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise PackageError(f"{path}: part {p.name} is truncated: copy the file again")
                h.update(chunk)
                left -= len(chunk)
                done += len(chunk)
                if progress:
                    progress(done, total)
            if h.hexdigest() != p.sha256:
                raise PackageError(f"{path}: part {p.name} does not match its SHA-256 (the file is damaged): copy "
                                   "it again, or pack the artifact again")
    return parts


def unpack(path: Path, dest: Path, library: Path | None = None) -> Path:
    """Checks PATH and writes its parts into the new directory DEST; an external part is taken from
    LIBRARY (checked against the package's hash) or refused."""
    parts = check(path)
    dest = Path(dest)
    if dest.exists():
        raise PackageError(f"{dest} exists: unpack into a new directory")
    for p in parts:
        if p.external and library is None:
            raise PackageError(f"{path} leaves {p.name} out (it is bundled in the app): pass --library FILE")
        if p.external and _sha256(library) != p.sha256:
            raise PackageError(f"{library} is not the {p.name} this package was made for (SHA-256 differs)")
    tmp = dest.with_name(dest.name + ".part")
    with open(path, "rb") as f:
        for p in parts:
            target = tmp / p.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if p.external:
                target.write_bytes(Path(library).read_bytes())
                continue
            f.seek(p.offset)
            with open(target, "wb") as out:
                left = p.size
                while left:
                    chunk = f.read(min(_CHUNK, left))
                    out.write(chunk)
                    left -= len(chunk)
    os.replace(tmp, dest)
    return dest


def describe(parts: Iterable[Part]) -> list[dict]:
    return [{"name": p.name, "bytes": p.size, "sha256": p.sha256, "in_package": not p.external} for p in parts]
