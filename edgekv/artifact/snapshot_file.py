"""Cache snapshots: a document's compressed cache saved once and mapped back for each question.

The native runtime (``runtime/src/snapshot.c``) and this module read and write the same file;
HostRuntime and the native runtime share a compiled artifact's cache layout, so a snapshot
made by one loads in the other. The eager engine writes the same container with its own
layout (``engine`` = 1) and loads only its own. Layout, little-endian, version 1.1::

    header (256 bytes)
      0   8s   magic b"EKVSNAP\\0"
      8   u16  major, u16 minor
      12  u32  header_bytes: the header, the tensor table and the strings, 64-byte aligned
      16  u32  n_tensors
      20  u32  strings_bytes
      24  u64  position: the next token's position
      32  u64  tokens: the document tokens prefilled
      40  u32  budget N, u32 block B
      48  u32  engine: 1 the eager engine, 2 a compiled artifact
      52  u32  flags: bit 0 — made knowing a question (a query-aware policy's cache); bit 1 — the
               document was read with the chat template (its questions must be too)
      56  32s  the model weights' sha256
      88  u32  CRC-32 of the artifact's program.ekv (0 for the eager engine)
      92  u32  CRC-32 of the policy's parameters (the string below)
      96  u32  CRC-32 of the question
      100 u32  KV dtype of a compiled artifact's cache: 0 float32, 1 int8 codes with float16 scales
               (the eager engine writes 0 and records its format in its state)
      104 f64  (1.1) the document's prefill seconds when the snapshot was made (0 unknown)
      248 u32  CRC-32 of header_bytes bytes with this field zero
    tensor table at 256: n × 32 bytes: u32 layer, u32 field, u64 offset, u64 bytes, u32 crc32, u32 0
    strings: the policy name, its parameters (JSON), the question, the engine's state as JSON
             (eager; "" compiled), (1.1) what it was made from: the model as given to `edgekv run`
             (eager) or the artifact's absolute path (compiled) — each NUL-terminated
    data: each tensor 64-byte aligned

Written atomically (``<path>.part``, fsync, rename); read by mapping the file copy-on-write
(the arrays are views of the mapping, never copies)."""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"EKVSNAP\0"
MAJOR, MINOR = 1, 1
HEADER, ENTRY, ALIGN = 256, 32, 64
ENGINE_EAGER, ENGINE_COMPILED = 1, 2
KV_DTYPE_CODES = {"float32": 0, "int8": 1}  # header field 100 (the C runtime's names)


from ..errors import SnapshotError  # noqa: E402,F401  (declared in edgekv.errors, which loads no numpy)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Snapshot:
    engine: int
    position: int
    tokens: int
    budget: int
    block: int
    weight_hash: str            # hex sha256
    policy: str
    policy_params: str          # canonical JSON, as the artifact records it
    question: str = ""
    chat: bool = False
    program_crc: int = 0
    extra: str = ""             # eager: the engine's per-prompt state as JSON
    made_from: str = ""         # what to open to continue from it (`edgekv ask` opens it)
    document_seconds: float = 0.0  # the document's prefill time when it was made
    kv_dtype: int = 0           # compiled: KV_DTYPE_CODES of the artifact's cache
    tensors: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (layer, field) → array (bytes)

    def info(self) -> dict:
        """What a runtime reports of a loaded snapshot (``snapshot_info``; the native runtime's
        ``ekv_snapshot_info`` has the same fields)."""
        return {"question": self.question, "made_from": self.made_from, "chat": self.chat, "tokens": self.tokens,
                "document_seconds": self.document_seconds}


def write(snap: Snapshot, path: str | os.PathLike) -> int:
    """Write atomically; returns the size. A failure leaves nothing behind."""
    path = Path(path)
    keys = sorted(snap.tensors)
    parts = (snap.policy, snap.policy_params, snap.question, snap.extra, snap.made_from)
    strings = b"".join(s.encode() + b"\0" for s in parts)
    head = _align(HEADER + ENTRY * len(keys) + len(strings))
    table, offset, blobs = [], head, []
    for k in keys:
        data = np.ascontiguousarray(snap.tensors[k]).view(np.uint8).reshape(-1)
        table.append(struct.pack("<IIQQII", k[0], k[1], offset, data.nbytes, zlib.crc32(data), 0))
        blobs.append((offset, data))
        offset = _align(offset + data.nbytes)
    h = bytearray(head)
    h[0:8] = MAGIC
    struct.pack_into("<HHIII", h, 8, MAJOR, MINOR, head, len(keys), len(strings))
    struct.pack_into("<QQIIII", h, 24, snap.position, snap.tokens, snap.budget, snap.block, snap.engine,
                     int(bool(snap.question)) | (2 if snap.chat else 0))
    h[56:88] = bytes.fromhex(snap.weight_hash) if len(snap.weight_hash) == 64 else bytes(32)
    struct.pack_into("<IIIId", h, 88, snap.program_crc, zlib.crc32(snap.policy_params.encode()),
                     zlib.crc32(snap.question.encode()), snap.kv_dtype, float(snap.document_seconds))
    h[HEADER: HEADER + ENTRY * len(keys)] = b"".join(table)
    h[HEADER + ENTRY * len(keys): HEADER + ENTRY * len(keys) + len(strings)] = strings
    struct.pack_into("<I", h, 248, zlib.crc32(bytes(h)))
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(h)
            at = head
            for off, data in blobs:
                f.write(b"\0" * (off - at))
                f.write(memoryview(data))
                at = off + data.nbytes
            f.write(b"\0" * (_align(at) - at))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _map(path: Path):
    try:
        return np.memmap(path, dtype=np.uint8, mode="c")
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"cannot read the snapshot {path}: {exc}") from None


def _parse_header(mm, path: Path) -> tuple[Snapshot, bytearray, int]:
    """The checked header: the Snapshot without tensors, the header bytes and the tensor count."""
    raw = bytes(mm[:HEADER]) if mm.size >= HEADER else b""
    if len(raw) < HEADER or raw[:8] != MAGIC:
        raise SnapshotError(f"{path} is not an edgekv cache snapshot (bad magic or truncated)")
    major, minor, head, n, n_str = struct.unpack_from("<HHIII", raw, 8)
    if major != MAJOR:
        raise SnapshotError(f"{path}: snapshot format {major}.{minor}; this edgekv reads {MAJOR}.x — make it again")
    if head > mm.size or HEADER + ENTRY * n + n_str > head:
        raise SnapshotError(f"{path}: the header is truncated or corrupt")
    h = bytearray(mm[:head])
    stored = struct.unpack_from("<I", h, 248)[0]
    struct.pack_into("<I", h, 248, 0)
    if zlib.crc32(bytes(h)) != stored:
        raise SnapshotError(f"{path}: the header fails its checksum (the file is corrupt)")
    position, tokens, budget, block, engine, flags = struct.unpack_from("<QQIIII", h, 24)
    strings = bytes(h[HEADER + ENTRY * n: HEADER + ENTRY * n + n_str]).split(b"\0")[:-1]  # each NUL-terminated
    if len(strings) < 3:
        raise SnapshotError(f"{path}: corrupt strings")
    policy, params, question = (s.decode() for s in strings[:3])
    extra = strings[3].decode() if len(strings) > 3 else ""
    made_from = strings[4].decode() if minor >= 1 and len(strings) > 4 else ""
    seconds = struct.unpack_from("<d", h, 104)[0] if minor >= 1 else 0.0
    snap = Snapshot(engine=engine, position=position, tokens=tokens, budget=budget, block=block,
                    weight_hash=bytes(h[56:88]).hex(), policy=policy, policy_params=params, question=question,
                    chat=bool(flags & 2), program_crc=struct.unpack_from("<I", h, 88)[0], extra=extra,
                    made_from=made_from, document_seconds=seconds if 0 <= seconds < 1e9 else 0.0,
                    kv_dtype=struct.unpack_from("<I", h, 100)[0])
    return snap, h, n


def read_header(path: str | os.PathLike) -> Snapshot:
    """The settings a snapshot records, checked against its header checksum (no tensors)."""
    path = Path(path)
    return _parse_header(_map(path), path)[0]


def read(path: str | os.PathLike) -> Snapshot:
    """Map and check a snapshot: every tensor an array over the copy-on-write mapping."""
    path = Path(path)
    mm = _map(path)
    snap, h, n = _parse_header(mm, path)
    for i in range(n):
        layer, fld, off, size, crc, _ = struct.unpack_from("<IIQQII", h, HEADER + ENTRY * i)
        if off + size > mm.size or off % ALIGN:
            raise SnapshotError(f"{path} is truncated (a tensor runs past the end)")
        data = mm[off: off + size]
        if zlib.crc32(data) != crc:
            raise SnapshotError(f"{path}: a cache tensor fails its checksum (the file is corrupt)")
        snap.tensors[(layer, fld)] = data
    return snap


def check_matches(snap: Snapshot, path, *, engine: int, weight_hash: str, policy: str, policy_params: str,
                  budget: int, block: int, program_crc: int = 0, kv_dtype: int = 0) -> None:
    """Refuse a snapshot made for other weights, another engine/artifact, policy, N or B."""
    if snap.engine != engine:
        made = "the eager engine" if snap.engine == ENGINE_EAGER else "a compiled artifact"
        raise SnapshotError(f"{path} was made by {made}; load it the same way, or make it again here")
    if snap.weight_hash != weight_hash:
        raise SnapshotError(f"{path} was made for other model weights ({snap.weight_hash[:12]}…, these are "
                            f"{weight_hash[:12]}…)")
    if (snap.policy, snap.policy_params) != (policy, policy_params):
        raise SnapshotError(f"{path} was made with policy {snap.policy} {snap.policy_params}, this run is {policy} "
                            f"{policy_params}")
    if (snap.budget, snap.block) != (budget, block):
        raise SnapshotError(f"{path} was made at N = {snap.budget}, B = {snap.block}; this run has N = {budget}, "
                            f"B = {block}")
    if engine == ENGINE_COMPILED and snap.kv_dtype != kv_dtype:
        raise SnapshotError(f"{path}: its KV cache is stored as {_kv_name(snap.kv_dtype)}, this artifact stores "
                            f"{_kv_name(kv_dtype)}; make it again with this artifact")
    if engine == ENGINE_COMPILED and snap.program_crc != program_crc:
        raise SnapshotError(f"{path} was made with another artifact (its program differs); make it again")


def artifact_identity(path, manifest) -> dict:
    """What a snapshot made with the artifact in ``path`` records of it, from its manifest and
    program.ekv alone (nothing loaded): ``check_matches``'s arguments for ``ENGINE_COMPILED``."""
    import json

    from . import ArtifactError, crc32_file

    program = Path(path) / "program.ekv"
    if not program.is_file():
        raise ArtifactError("cache snapshots need an artifact directory with program.ekv (recompile it)")
    return {"weight_hash": manifest.weight_hash, "policy": manifest.policy_name,
            "policy_params": json.dumps(manifest.policy_params, sort_keys=True), "budget": int(manifest.budget),
            "block": int(manifest.block), "program_crc": crc32_file(program),
            "kv_dtype": KV_DTYPE_CODES["int8" if manifest.kv_dtype == "int8" else "float32"]}


def _kv_name(code: int) -> str:
    return {v: k for k, v in KV_DTYPE_CODES.items()}.get(code, "an unknown format")
