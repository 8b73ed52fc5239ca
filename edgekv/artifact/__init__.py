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
import zlib
from pathlib import Path

from .errors import ArtifactError
from .manifest import ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, Keys, Manifest
from .weights_check import verify_weights

__all__ = ["ARTIFACT_FORMAT", "ARTIFACT_VERSION", "MANIFEST", "PARAMS_FILE", "PROGRAM_FILE", "TOKENIZER_DIR",
           "TOKENIZER_FILE", "ArtifactError", "Keys", "Manifest", "check_runs_here", "crc32_file", "edgekv_version",
           "is_artifact", "sha256_file", "verify_artifact", "verify_weights"]

PARAMS_FILE = "params.safetensors"
PROGRAM_FILE = "program.ekv"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.ekt"


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


def verify_artifact(path: str | Path, manifest: Manifest, *, check_hashes: bool = True,
                    tvm_version: str | None = None, verify: str = "default"):
    """Files present and (with ``check_hashes``) equal to their sha256; the weights checked tensor by
    tensor against the program's CRC-32s (``weights_check``; ``verify``: ``default``, ``always`` or
    ``off`` = ``--no-verify``); the artifact made by this edgekv version; ``tvm_version``: the TVM
    that will run it (HostRuntime) must be the one that built it. Returns the ``WeightsCheck``."""
    from .weights_check import WeightsCheck, verify_weights

    path = Path(path)
    m = manifest
    files = m.files
    program = files.get(Keys.Files.PROGRAM)
    has_program = bool(program) and (path / program.name).is_file()
    tok = files.get(Keys.Files.TOKENIZER)
    if tok and isinstance(tok.sha256, dict):  # the HF tokenizer directory, file by file
        for name, digest in tok.sha256.items():
            f = path / tok.name / name
            if not f.is_file():
                raise ArtifactError(f"artifact file missing: {f}")
            if check_hashes and sha256_file(f) != digest:
                raise ArtifactError(f"{f} does not match the sha256 in the manifest (corrupt or replaced); recompile")
    for key in (Keys.Files.LIBRARY, Keys.Files.PARAMS, Keys.Files.PROGRAM, Keys.Files.TOKENIZER_FILE):
        entry = files.get(key)
        if not entry:
            if key in (Keys.Files.LIBRARY, Keys.Files.PARAMS):
                raise ArtifactError(f"{path / MANIFEST} lists no {key} file; recompile the artifact")
            continue
        f = path / entry.name
        if not f.exists():
            raise ArtifactError(f"artifact file missing: {f}")
        if key == Keys.Files.PARAMS and (has_program or verify == "off"):
            continue  # the weights: checked below by their CRC-32s, with a stamp (or not at all: --no-verify)
        if check_hashes and sha256_file(f) != entry.sha256:
            raise ArtifactError(f"{f} does not match the sha256 in the manifest (corrupt or replaced); recompile")
    weights = WeightsCheck("unchecked")
    if has_program:
        weights = verify_weights(path, files[Keys.Files.PARAMS].name, program.name, mode=verify)
    built_edgekv, built_tvm = m.versions.get(Keys.Versions.EDGEKV), m.versions.get(Keys.Versions.TVM)
    if built_edgekv != edgekv_version():
        raise ArtifactError(f"artifact was built by edgekv {built_edgekv}, this is edgekv {edgekv_version()}; "
                            "recompile it with this installation")
    if tvm_version is not None and built_tvm != tvm_version:
        raise ArtifactError(f"artifact was built with TVM {built_tvm}, this runtime has TVM {tvm_version}; "
                            "recompile it with this installation")
    check_runs_here(path, m)
    return weights


# LLVM's feature names → the flags Linux lists in /proc/cpuinfo, where they differ
_CPUINFO_NAMES = {"sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
                  "avx512fp16": "avx512_fp16", "avx512vbmi2": "avx512_vbmi2", "avx512bitalg": "avx512_bitalg",
                  "avx512vpopcntdq": "avx512_vpopcntdq", "avxvnni": "avx_vnni", "amx-tile": "amx_tile",
                  "amx-int8": "amx_int8", "amx-bf16": "amx_bf16", "vpclmulqdq": "vpclmulqdq", "bmi": "bmi1",
                  "fma": "fma", "f16c": "f16c"}


def check_runs_here(path: Path, manifest: Manifest) -> None:
    """Refuse an artifact whose code this machine cannot run: another architecture, or CPU
    features this CPU lacks (a library built for AVX-512 would die on an illegal instruction).
    Reads the program's settings; an artifact without a program (a GPU build) is not checked."""
    import platform

    entry = manifest.files.get(Keys.Files.PROGRAM)
    if not entry or not (path / entry.name).is_file():
        return
    from . import program_file

    try:
        settings = program_file.read(path / entry.name).settings
    except program_file.ProgramFormatError as exc:
        raise ArtifactError(f"{path / entry.name}: {exc}") from None
    arch, here = str(settings.get("target_arch", "")), platform.machine()
    here = {"amd64": "x86_64", "arm64": "aarch64"}.get(here.lower(), here)
    if arch and arch != here:
        raise ArtifactError(f"the artifact was compiled for {arch} and this machine is {here}: compile it here with "
                            f"--target host, or run it on a {arch} device")
    wanted = [f for f in str(settings.get("cpu_features", "")).split(",") if f]
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return  # no /proc/cpuinfo: nothing to compare with
    missing = [f for f in wanted if _CPUINFO_NAMES.get(f, f) not in flags]
    if missing:
        raise ArtifactError(f"the artifact's kernels use CPU features this machine lacks: {', '.join(missing)}; "
                            "recompile it here (edgekv compile --target host), which builds for this CPU")
