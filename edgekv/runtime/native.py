"""Finding the native runtime that `pip install` built from ``runtime/`` (scikit-build-core).

``pip install`` puts ``libedgekv_runtime.so`` into the package (``edgekv/_native/``) and the
``edgekv-run`` command on PATH. ``EDGEKV_RUNTIME_LIB`` / ``EDGEKV_RUN`` point at another build
(an AddressSanitizer build in the tests, a cross build).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from functools import lru_cache
from pathlib import Path

LIB_NAME = "libedgekv_runtime.so"
CLI_NAME = "edgekv-run"


class NativeRuntimeMissing(RuntimeError):
    """The native runtime was not built (the package was installed without its CMake build)."""


def _installed(relpath: str) -> Path | None:
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution("edgekv")
    except (ImportError, PackageNotFoundError):
        return None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(relpath):
            p = Path(str(dist.locate_file(f))).resolve()
            if p.is_file():
                return p
    return None


def library_path() -> Path | None:
    """The shared library to load, or None when there is none."""
    env = os.environ.get("EDGEKV_RUNTIME_LIB")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[1] / "_native" / LIB_NAME  # a wheel install
    if here.is_file():
        return here
    return _installed(f"edgekv/_native/{LIB_NAME}")


def cli_path() -> Path | None:
    """The ``edgekv-run`` command, or None when it was not built."""
    env = os.environ.get("EDGEKV_RUN")
    if env:
        return Path(env)
    found = shutil.which(CLI_NAME)
    return Path(found) if found else _installed(CLI_NAME)


def available() -> bool:
    p = library_path()
    return p is not None and p.is_file()


@lru_cache(maxsize=None)
def load_library(path: str | None = None) -> ctypes.CDLL:
    """Load the runtime library (once). RTLD_GLOBAL: the TVM-generated kernel library that the
    runtime dlopens resolves ``TVMFFIErrorSetRaisedFromCStrParts`` from the process."""
    p = Path(path) if path else library_path()
    if p is None or not p.is_file():
        raise NativeRuntimeMissing(
            "the native runtime (libedgekv_runtime.so) is not built; reinstall with "
            "`pip install -e .` (it builds runtime/ with CMake), or set EDGEKV_RUNTIME_LIB")
    return ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
