"""Weight verification at open, the Python twin of ``runtime/src/weights_check.c``: each weight's
CRC-32 (recorded by the exporter in ``program.ekv``, layout 1.2) against its bytes in the params
file, the first mismatch refused by the weight's name; a stamp beside the artifact
(``.params.verified``) remembers a clean check of this very file (its size, device, inode, mtime,
ctime, and the program's CRC), so that later opens — by either runtime, the line is the same —
cost a ``stat``. An unwritable artifact directory only means checking at every open."""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError

STAMP_FILE = ".params.verified"
VERIFY_MODES = ("default", "always", "off")


@dataclass(frozen=True)
class WeightsCheck:
    how: str  # "checked" (this open), "stamped" (an earlier open's stamp), "unchecked" (--no-verify)
    seconds: float = 0.0


def stamp_line(params: Path, program_crc: int) -> str:
    st = os.stat(params)
    return (f"edgekv-weights-verified 1 program={program_crc:08x} size={st.st_size} dev={st.st_dev} ino={st.st_ino} "
            f"mtime={st.st_mtime_ns // 10**9}.{st.st_mtime_ns % 10**9:09d} "
            f"ctime={st.st_ctime_ns // 10**9}.{st.st_ctime_ns % 10**9:09d}\n")


def corrupt_message(what: str, params: Path) -> str:
    return (f"{what} in {params} fails its checksum: the weights are corrupt (a damaged or half-finished copy). "
            "Copy the artifact again, or recompile it; --no-verify runs it unchecked")


def _write_stamp(stamp: Path, line: str) -> None:
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}")
    try:
        tmp.write_text(line)
        tmp.replace(stamp)
    except OSError:  # a read-only artifact: checked at every open instead
        tmp.unlink(missing_ok=True)


def verify_weights(artifact: str | Path, params_name: str, program_name: str, *, mode: str = "default") -> WeightsCheck:
    """Check the params file's weights against the program's CRCs (``mode``: ``default`` trusts a
    matching stamp, ``always`` ignores it, ``off`` checks nothing). Raises ``ArtifactError``
    naming the first corrupt weight."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r}: one of {', '.join(VERIFY_MODES)}")
    if mode == "off":
        return WeightsCheck("unchecked")
    from . import program_file

    art = Path(artifact)
    params, program = art / params_name, art / program_name
    program_bytes = program.read_bytes()
    program_crc = zlib.crc32(program_bytes)
    stamp = art / STAMP_FILE
    line = stamp_line(params, program_crc)
    if mode == "default":
        try:
            if stamp.read_text() == line:
                return WeightsCheck("stamped")
        except (OSError, UnicodeDecodeError):
            pass
    t0 = time.perf_counter()
    try:
        prog = program_file.from_bytes(program_bytes)
    except program_file.ProgramFormatError as exc:
        raise ArtifactError(f"{program}: {exc}") from None
    size = params.stat().st_size
    with open(params, "rb") as f:
        if prog.settings.get(program_file.WEIGHT_CRCS) == 1:
            for buf in prog.buffers:
                if buf.kind != program_file.WEIGHT:
                    continue
                if buf.a + buf.b > size:
                    raise ArtifactError(f"{params} is {size} bytes, too short for weight {buf.name} ({buf.b} bytes at "
                                        f"{buf.a}): the file is truncated; copy the artifact again, or recompile it")
                f.seek(buf.a)
                if zlib.crc32(f.read(buf.b)) != buf.crc32:
                    raise ArtifactError(corrupt_message(f"weight {buf.name} ({buf.b} bytes at offset {buf.a})", params))
        else:  # a program older than 1.2: the whole file's CRC
            crc = 0
            for chunk in iter(lambda: f.read(1 << 22), b""):
                crc = zlib.crc32(chunk, crc)
            if crc != int(prog.settings.get("params_crc32", -1)):
                raise ArtifactError(corrupt_message("the params file", params))
    seconds = time.perf_counter() - t0
    _write_stamp(stamp, line)
    return WeightsCheck("checked", seconds)
