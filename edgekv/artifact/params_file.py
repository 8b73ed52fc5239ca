"""``params.safetensors`` with every tensor 64-byte aligned in the file, so that a runtime can
``mmap`` the file and hand the kernels pointers into the map (TVM's CPU kernels need 64-byte
aligned data; the native runtime maps the weights read-only and never copies them).

It is a plain safetensors file (any safetensors reader loads it): the JSON header is padded
with spaces so the data starts at a multiple of 64, and where a tensor's size is not a multiple
of 64 a small ``__pad_<i>`` uint8 tensor fills the gap (safetensors allows no holes). The
absolute offset of each tensor is returned for the program file (``program_file``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

ALIGN = 64
PAD_PREFIX = "__pad_"
_ST_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int8": "I8", "int16": "I16", "int32": "I32",
              "int64": "I64", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def stored_bytes(nbytes: int) -> int:
    """The bytes an array of ``nbytes`` takes in the file, its alignment padding included."""
    return _align(nbytes)


def write_params(params: list[tuple[str, np.ndarray]], path: str | Path,
                 metadata: dict[str, str] | None = None) -> dict[str, tuple[int, int]]:
    """Write the arrays in order; returns {name: (absolute byte offset, bytes)}. Atomic: written
    to ``<path>.part`` and renamed."""
    header: dict = {"__metadata__": dict(metadata or {}, alignment=str(ALIGN))}
    layout, rel, pads = [], 0, 0
    for name, arr in params:
        if name.startswith(PAD_PREFIX):
            raise ValueError(f"parameter name {name!r} is reserved for padding")
        a = np.ascontiguousarray(arr)
        header[name] = {"dtype": _ST_DTYPES[str(a.dtype)], "shape": list(a.shape),
                        "data_offsets": [rel, rel + a.nbytes]}
        layout.append((name, a, rel))
        rel += a.nbytes
        if rel % ALIGN:
            gap = _align(rel) - rel
            header[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [rel, rel + gap]}
            layout.append((None, np.zeros(gap, np.uint8), rel))
            pads += 1
            rel += gap
    text = json.dumps(header, separators=(",", ":")).encode()
    head_len = _align(8 + len(text)) - 8  # data starts 64-byte aligned
    text += b" " * (head_len - len(text))
    data_start = 8 + head_len
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(head_len.to_bytes(8, "little"))
        f.write(text)
        for _, a, _ in layout:
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return {name: (data_start + off, a.nbytes) for name, a, off in layout if name is not None}


def map_params(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays over a memory map of the file (no copy), by name, padding left out. The map is
    copy-on-write (writable arrays, so TVM takes them through DLPack without a copy; a write
    would stay in this process and never reach the file)."""
    path = Path(path)
    with open(path, "rb") as f:
        head_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(head_len))
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    inv = {v: k for k, v in _ST_DTYPES.items()}
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or name.startswith(PAD_PREFIX):
            continue
        begin, end = info["data_offsets"]
        raw = mm[8 + head_len + begin: 8 + head_len + end]
        out[name] = raw.view(inv[info["dtype"]]).reshape(info["shape"])
    return out
