"""``program.ekv``: an artifact's entry functions as flat kernel-call lists with their static
memory plan — the file the native runtime (``runtime/src/program.c``) reads without a general
parser. This module writes it (``edgekv compile``) and reads it back (tests, ``targets.finish``).

Layout, little-endian, version 1.2::

    header (64 bytes)
      0   8s   magic  b"EKVPROG\\0"
      8   u16  major version (a reader refuses another major)
      10  u16  minor version (added sections/settings; a reader ignores what it does not know)
      12  u32  header_bytes = 64 + 32 × n_sections
      16  u32  n_sections
      20  44 bytes reserved (zero)
    section table at 64: n_sections × 32 bytes
      u32 id, u32 record_size, u64 offset, u64 size, u32 crc32 (zlib's CRC-32 of the section's
      bytes), u32 count  — size == count × record_size; offset 64-byte aligned, inside the file
    sections (SECTION ids below; each an array of fixed-size records)
      STRINGS     record 1:  UTF-8 bytes; strings are (u32 offset, u32 length) into it
      SETTINGS    record 24: u32 key_off, u32 key_len, u32 type (1 int64, 2 string, 3 float64),
                             u32 0, then 8 bytes: the int64 / the f64 / (u32 off, u32 len)
      KERNELS     record 8:  u32 name_off, u32 name_len — the library exports __tvm_ffi_<name>
      BUFFERS     record 96: u8 kind, u8 dtype code (DLPack: 0 int, 1 uint, 2 float), u8 bits,
                             u8 ndim (≤ 8), u32 name_off, u32 name_len, u32 crc32, i64 shape[8],
                             u64 a, u64 b — by kind:
                               INPUT    (1) filled by the caller before a call: a = b = 0
                               CACHE    (2) a = layer, b = cache field index
                               WEIGHT   (3) a = byte offset in the params file, b = bytes
                               CONSTANT (4) a = byte offset in CONSTANTS, b = bytes
                               ARENA    (5) a = byte offset in the arena, b = bytes
                               VIEW     (6) a = id of an earlier buffer it reshapes, b = 0
                             crc32 (1.2): a WEIGHT's zlib CRC-32 of its b bytes in the params
                             file, which a runtime checks before it trusts the weight (the
                             setting ``weight_crc32s`` = 1 says they are there); 0 otherwise
      CONSTANTS   record 1:  tensor constants, each 64-byte aligned
      FUNCTIONS   record 32: u32 name_off, u32 name_len, u32 call_begin, u32 call_count,
                             u32 in_begin, u32 in_count, u32 out_begin, u32 out_count
                             (in/out: ranges of FUNC_BUFFERS; out[0] is the logits)
      CALLS       record 16: u32 kernel, u32 arg_begin, u32 arg_count, u32 0
      ARGS        record 16: u32 kind (0 buffer id, 1 int64, 2 float64), u32 0, 8 bytes value
      FUNC_BUFFERS record 4: u32 buffer id
      CACHE_FIELDS record 24: u32 name_off, u32 name_len, u32 role (0 state, 1 k, 2 v,
                             3 positions, 4 fill), u32 init (0 zeros, 1 constant), u64 init
                             constant offset in CONSTANTS (one layer's bytes; 0 when zeros)
    (1.1, GPU programs only; a CPU program has neither)
      DEVICE_KERNELS record 32: u32 name_off, u32 name_len, u32 arg_begin, u32 arg_count,
                             u32 tag_count, u8 tags[8], u32 flags (bit 0: one of edgekv's
                             eviction kernels — score, select, observe, prepare) — a kernel the host code calls
                             through __TVMFFIFunctionCall: its arguments (kinds in DEVICE_ARGS),
                             then one launch extent per tag (0-2 blockIdx.x/y/z, 3-5 threadIdx.x/y/z,
                             6 dynamic shared memory bytes)
      DEVICE_ARGS record 1:  u8 argument kind (0 buffer, 1 int32, 2 int64, 3 float32, 4 float64,
                             5 uint32)

Every intermediate tensor of a function lives in the arena at the offset the exporter gave
its TVM storage (``StaticPlanBlockMemory``'s plan; functions run one at a time, so they share
one arena). A reshape is a VIEW of its base. The settings hold the model geometry, the run
settings (budget, block, pseudo rows, ...), the memory plan and the files with their sizes
and CRC-32s. A GPU program's settings add ``device`` ("opencl"), the device source file
(``device_source_name`` / ``_bytes`` / ``_crc32``) and ``arena_align``: the alignment of its
arena regions, which a device needs for sub-buffers.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"EKVPROG\0"
MAJOR, MINOR = 1, 2
WEIGHT_CRCS = "weight_crc32s"  # setting: 1 when every WEIGHT buffer carries its CRC-32 (1.2)
HEADER_BYTES = 64
SECTION_ENTRY = 32
ALIGN = 64
MAX_DIMS = 8

# section ids
STRINGS, SETTINGS, KERNELS, BUFFERS, CONSTANTS, FUNCTIONS, CALLS, ARGS, FUNC_BUFFERS, CACHE_FIELDS = range(1, 11)
DEVICE_KERNELS, DEVICE_ARGS = 11, 12
RECORD_SIZE = {STRINGS: 1, SETTINGS: 24, KERNELS: 8, BUFFERS: 96, CONSTANTS: 1, FUNCTIONS: 32, CALLS: 16, ARGS: 16,
               FUNC_BUFFERS: 4, CACHE_FIELDS: 24}
OPTIONAL_RECORD_SIZE = {DEVICE_KERNELS: 32, DEVICE_ARGS: 1}
MAX_TAGS = 8

# buffer kinds
INPUT, CACHE, WEIGHT, CONSTANT, ARENA, VIEW = range(1, 7)
# argument kinds
ARG_BUFFER, ARG_INT, ARG_FLOAT = 0, 1, 2
# setting types
SET_INT, SET_STR, SET_FLOAT = 1, 2, 3
# cache field roles
ROLE_STATE, ROLE_K, ROLE_V, ROLE_POSITIONS, ROLE_FILL = range(5)
FIELD_ROLES = {"k": ROLE_K, "v": ROLE_V, "pos": ROLE_POSITIONS, "fill": ROLE_FILL}

DTYPES = {"int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8), "uint16": (1, 16),
          "uint32": (1, 32), "uint64": (1, 64), "bool": (1, 8), "float16": (2, 16), "float32": (2, 32),
          "float64": (2, 64)}
DTYPE_NAMES = {v: k for k, v in DTYPES.items() if k != "bool"}


class ProgramFormatError(ValueError):
    """A program file that cannot be read (truncated, corrupt, or another major version)."""


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def nbytes(shape, dtype: str) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * DTYPES[dtype][1] // 8


@dataclass
class Buffer:
    kind: int
    dtype: str
    shape: tuple[int, ...]
    name: str = ""
    a: int = 0
    b: int = 0
    crc32: int = 0  # a WEIGHT's CRC-32 of its bytes in the params file (``fill_weight_crcs``)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclass
class Call:
    kernel: int
    args: list[tuple[int, int | float]]  # (ARG_BUFFER, buffer id) | (ARG_INT, v) | (ARG_FLOAT, v)


@dataclass
class Function:
    name: str
    calls: list[Call] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)


@dataclass
class CacheField:
    name: str
    role: int
    init_offset: int | None = None  # one layer's initial contents in CONSTANTS (add_constant); None = zeros


@dataclass
class DeviceKernel:
    name: str
    args: list[int]  # argument kinds (DEVICE_ARGS)
    tags: list[int]  # launch tags, one extent each after the arguments
    flags: int = 0   # DKERNEL_EVICTION: one of edgekv's eviction kernels (runtimes may build it apart)


DKERNEL_EVICTION = 1


@dataclass
class Program:
    settings: dict[str, int | float | str] = field(default_factory=dict)
    kernels: list[str] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    constants: bytearray = field(default_factory=bytearray)
    functions: list[Function] = field(default_factory=list)
    cache_fields: list[CacheField] = field(default_factory=list)
    device_kernels: list[DeviceKernel] = field(default_factory=list)

    def add_constant(self, data: bytes) -> int:
        off = align(len(self.constants))
        self.constants.extend(b"\0" * (off - len(self.constants)))
        self.constants.extend(data)
        return off

    def kernel_index(self, name: str) -> int:
        try:
            return self.kernels.index(name)
        except ValueError:
            self.kernels.append(name)
            return len(self.kernels) - 1

    def function(self, name: str) -> Function:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(name)


class _Strings:
    def __init__(self):
        self.data = bytearray()
        self.index: dict[str, tuple[int, int]] = {}

    def ref(self, s: str) -> tuple[int, int]:
        if s not in self.index:
            b = s.encode()
            self.index[s] = (len(self.data), len(b))
            self.data.extend(b)
        return self.index[s]


def to_bytes(prog: Program) -> bytes:
    strings = _Strings()
    sections: dict[int, tuple[bytes, int]] = {}

    recs = []
    for key, value in prog.settings.items():
        ko, kl = strings.ref(key)
        if isinstance(value, bool) or isinstance(value, int):
            recs.append(struct.pack("<IIII q", ko, kl, SET_INT, 0, int(value)))
        elif isinstance(value, float):
            recs.append(struct.pack("<IIII d", ko, kl, SET_FLOAT, 0, value))
        elif isinstance(value, str):
            recs.append(struct.pack("<IIII II", ko, kl, SET_STR, 0, *strings.ref(value)))
        else:
            raise TypeError(f"setting {key}: {type(value).__name__} is not int, float or str")
    sections[SETTINGS] = (b"".join(recs), len(recs))
    sections[KERNELS] = (b"".join(struct.pack("<II", *strings.ref(k)) for k in prog.kernels), len(prog.kernels))
    recs = []
    for buf in prog.buffers:
        code, bits = DTYPES[buf.dtype]
        if len(buf.shape) > MAX_DIMS:
            raise ValueError(f"buffer {buf.name}: {len(buf.shape)} dimensions, at most {MAX_DIMS}")
        shape = list(buf.shape) + [0] * (MAX_DIMS - len(buf.shape))
        recs.append(struct.pack("<BBBB II I 8q QQ", buf.kind, code, bits, len(buf.shape), *strings.ref(buf.name),
                                buf.crc32 if buf.kind == WEIGHT else 0, *shape, buf.a, buf.b))
    sections[BUFFERS] = (b"".join(recs), len(recs))
    calls, args, fbufs, frecs = [], [], [], []
    for fn in prog.functions:
        call_begin = len(calls)
        for c in fn.calls:
            calls.append(struct.pack("<IIII", c.kernel, len(args), len(c.args), 0))
            for kind, v in c.args:
                args.append(struct.pack("<II d" if kind == ARG_FLOAT else "<II q", kind, 0, v))
        in_begin = len(fbufs)
        fbufs.extend(fn.inputs)
        out_begin = len(fbufs)
        fbufs.extend(fn.outputs)
        frecs.append(struct.pack("<8I", *strings.ref(fn.name), call_begin, len(fn.calls), in_begin, len(fn.inputs),
                                 out_begin, len(fn.outputs)))
    sections[FUNCTIONS] = (b"".join(frecs), len(frecs))
    sections[CALLS] = (b"".join(calls), len(calls))
    sections[ARGS] = (b"".join(args), len(args))
    sections[FUNC_BUFFERS] = (struct.pack(f"<{len(fbufs)}I", *fbufs), len(fbufs))
    recs = [struct.pack("<IIII Q", *strings.ref(cf.name), cf.role, cf.init_offset is not None, cf.init_offset or 0)
            for cf in prog.cache_fields]
    sections[CACHE_FIELDS] = (b"".join(recs), len(recs))
    sections[CONSTANTS] = (bytes(prog.constants), len(prog.constants))
    if prog.device_kernels:
        recs, dargs = [], bytearray()
        for k in prog.device_kernels:
            if len(k.tags) > MAX_TAGS:
                raise ValueError(f"device kernel {k.name}: {len(k.tags)} launch tags, at most {MAX_TAGS}")
            tags = bytes(k.tags) + b"\0" * (MAX_TAGS - len(k.tags))
            recs.append(struct.pack("<IIIII8sI", *strings.ref(k.name), len(dargs), len(k.args), len(k.tags), tags,
                                    k.flags))
            dargs.extend(bytes(k.args))
        sections[DEVICE_KERNELS] = (b"".join(recs), len(recs))
        sections[DEVICE_ARGS] = (bytes(dargs), len(dargs))
    sections[STRINGS] = (bytes(strings.data), len(strings.data))

    order = sorted(sections)
    header_bytes = HEADER_BYTES + SECTION_ENTRY * len(order)
    offset = align(header_bytes)
    table, body = [], bytearray()
    for sid in order:
        data, count = sections[sid]
        rsize = RECORD_SIZE.get(sid) or OPTIONAL_RECORD_SIZE[sid]
        table.append(struct.pack("<IIQQII", sid, rsize, offset, len(data), zlib.crc32(data), count))
        pad = align(offset) - offset
        body.extend(data)
        offset += len(data)
        pad = align(offset) - offset
        body.extend(b"\0" * pad)
        offset += pad
    header = MAGIC + struct.pack("<HHII", MAJOR, MINOR, header_bytes, len(order)) + b"\0" * 44
    head = header + b"".join(table)
    return head + b"\0" * (align(header_bytes) - len(head)) + bytes(body)


def fill_weight_crcs(prog: Program, params_path: str | Path) -> None:
    """Record each WEIGHT buffer's CRC-32 from the params file it points into, and the setting
    that says they are there: what lets a runtime refuse a corrupt weight by its name."""
    import numpy as np

    mm = np.memmap(params_path, dtype=np.uint8, mode="r")
    for buf in prog.buffers:
        if buf.kind == WEIGHT:
            if buf.a + buf.b > mm.size:
                raise ValueError(f"weight {buf.name} ({buf.b} bytes at {buf.a}) lies outside {params_path}")
            buf.crc32 = zlib.crc32(memoryview(mm[buf.a: buf.a + buf.b]))
    prog.settings[WEIGHT_CRCS] = 1


def write(prog: Program, path: str | Path) -> int:
    """Write atomically (a temporary file renamed into place); returns the size. A program whose
    settings name its params file (``params_name``, beside ``path``) gets each weight's CRC-32
    first (``fill_weight_crcs``): the exporter always has the weights written by then."""
    path = Path(path)
    params = path.parent / str(prog.settings.get("params_name", ""))
    if prog.settings.get("params_name") and params.is_file() and not prog.settings.get(WEIGHT_CRCS):
        fill_weight_crcs(prog, params)
    data = to_bytes(prog)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ProgramFormatError(msg)


def from_bytes(data: bytes) -> Program:
    """The inverse of ``to_bytes``, with the same checks the C reader makes."""
    _need(len(data) >= HEADER_BYTES, f"program file is truncated ({len(data)} bytes, the header alone is 64)")
    _need(data[:8] == MAGIC, "not an edgekv program file (bad magic)")
    major, minor, header_bytes, n = struct.unpack_from("<HHII", data, 8)
    _need(major == MAJOR, f"program format {major}.{minor} is not supported (this edgekv reads {MAJOR}.x); recompile")
    _need(header_bytes == HEADER_BYTES + SECTION_ENTRY * n and header_bytes <= len(data),
          "program header is corrupt or truncated")
    raw: dict[int, tuple[bytes, int, int]] = {}
    for i in range(n):
        sid, rsize, off, size, crc, count = struct.unpack_from("<IIQQII", data, HEADER_BYTES + SECTION_ENTRY * i)
        _need(off + size <= len(data), f"section {sid} runs past the end of the file")
        _need(rsize and size == rsize * count, f"section {sid} has an inconsistent size")
        sec = data[off: off + size]
        _need(zlib.crc32(sec) == crc, f"section {sid} fails its checksum (the file is corrupt)")
        raw[sid] = (sec, rsize, count)
    for sid in RECORD_SIZE:
        _need(sid in raw, f"section {sid} is missing")
        _need(raw[sid][1] == RECORD_SIZE[sid], f"section {sid} has record size {raw[sid][1]}")
    for sid, rsize in OPTIONAL_RECORD_SIZE.items():
        _need(sid not in raw or raw[sid][1] == rsize, f"section {sid} has record size {raw.get(sid, (0, 0))[1]}")
    strings = raw[STRINGS][0]

    def s(off: int, length: int) -> str:
        _need(off + length <= len(strings), "a string reference runs past the string table")
        return strings[off: off + length].decode()

    def records(sid: int):
        sec, rsize, count = raw[sid]
        return [sec[i * rsize: (i + 1) * rsize] for i in range(count)]

    prog = Program()
    for r in records(SETTINGS):
        ko, kl, typ, _ = struct.unpack_from("<IIII", r)
        if typ == SET_INT:
            prog.settings[s(ko, kl)] = struct.unpack_from("<q", r, 16)[0]
        elif typ == SET_FLOAT:
            prog.settings[s(ko, kl)] = struct.unpack_from("<d", r, 16)[0]
        elif typ == SET_STR:
            prog.settings[s(ko, kl)] = s(*struct.unpack_from("<II", r, 16))
    prog.kernels = [s(*struct.unpack("<II", r)) for r in records(KERNELS)]
    for r in records(BUFFERS):
        kind, code, bits, ndim, no, nl, crc = struct.unpack_from("<BBBBIII", r)
        shape = struct.unpack_from("<8q", r, 16)[:ndim]
        a, b = struct.unpack_from("<QQ", r, 80)
        _need((code, bits) in DTYPE_NAMES, f"buffer with unknown dtype ({code}, {bits})")
        prog.buffers.append(Buffer(kind, DTYPE_NAMES[(code, bits)], tuple(shape), s(no, nl), a, b, crc))
    prog.constants = bytearray(raw[CONSTANTS][0])
    calls = [struct.unpack("<IIII", r)[:3] for r in records(CALLS)]
    args = []
    for r in records(ARGS):
        kind = struct.unpack_from("<I", r)[0]
        args.append((kind, struct.unpack_from("<d" if kind == ARG_FLOAT else "<q", r, 8)[0]))
    fbufs = [struct.unpack("<I", r)[0] for r in records(FUNC_BUFFERS)]
    for r in records(FUNCTIONS):
        no, nl, cb, cc, ib, ic, ob, oc = struct.unpack("<8I", r)
        fn = Function(s(no, nl), inputs=fbufs[ib: ib + ic], outputs=fbufs[ob: ob + oc])
        for k, ab, ac in calls[cb: cb + cc]:
            fn.calls.append(Call(k, args[ab: ab + ac]))
        prog.functions.append(fn)
    for r in records(CACHE_FIELDS):
        no, nl, role, init, off = struct.unpack("<IIIIQ", r)
        prog.cache_fields.append(CacheField(s(no, nl), role, off if init else None))
    if DEVICE_KERNELS in raw:
        _need(DEVICE_ARGS in raw, "a program with device kernels lacks their argument kinds")
        dargs = raw[DEVICE_ARGS][0]
        for r in records(DEVICE_KERNELS):
            no, nl, ab, ac, tc, tags, flags = struct.unpack("<IIIII8sI", r)
            _need(ab + ac <= len(dargs) and tc <= MAX_TAGS, "a device kernel record is corrupt")
            prog.device_kernels.append(DeviceKernel(s(no, nl), list(dargs[ab: ab + ac]), list(tags[:tc]), flags))
    return prog


def read(path: str | Path) -> Program:
    return from_bytes(Path(path).read_bytes())
