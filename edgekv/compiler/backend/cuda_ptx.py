"""The CUDA C that TVM generates for a ``cuda-host`` build, compiled to PTX here, at compile time,
with NVRTC (NVIDIA's runtime compiler: a shared library, no GPU and no nvcc needed).

The native runtime loads the PTX with the CUDA driver (``cuModuleLoadDataEx``), which JITs it for
the GPU it finds: PTX for ``compute_80`` runs on every GPU from sm_80 (Ampere) on. The driver
must be at least as new as the NVRTC that wrote the PTX (its ``.version`` line): pin an older
``nvidia-cuda-nvrtc-cu12`` for an older driver (a Jetson's JetPack).

NVRTC comes from PyPI (``pip install 'edgekv[cuda]'``: ``nvidia-cuda-nvrtc-cu12``), from a
CUDA toolkit, or from ``EDGEKV_NVRTC`` (a path to ``libnvrtc.so``). It is called through ctypes,
so no CUDA Python binding is needed. TVM's CUDA C includes three headers NVRTC does not have
built in (libcu++'s ``cuda/std/cstdint`` and ``cuda/std/type_traits``, the toolkit's
``math_constants.h``); the few names the generated code takes from them are handed to NVRTC as
in-memory headers (``HEADERS``), so no toolkit include directory is needed either."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from pathlib import Path

from ..errors import CompileError

INSTALL_HINT = ("pip install 'edgekv[cuda]' (NVRTC from PyPI: nvidia-cuda-nvrtc-cu12), or set EDGEKV_NVRTC to a "
                "libnvrtc.so from a CUDA toolkit")
DEFAULT_ARCH = "sm_80"

_CSTDINT = """#pragma once
namespace cuda { namespace std {
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
} }
"""
# the traits the generated prologue re-exports into std (it uses none of them in a kernel)
_TYPE_TRAITS = """#pragma once
namespace cuda { namespace std {
template <class T, T v> struct integral_constant { static constexpr T value = v; };
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> constexpr bool is_same_v = is_same<A, B>::value;
template <class T> struct is_floating_point : integral_constant<bool, is_same<T, float>::value ||
    is_same<T, double>::value> {};
template <class T> struct is_integral : integral_constant<bool, is_same<T, bool>::value || is_same<T, char>::value ||
    is_same<T, signed char>::value || is_same<T, unsigned char>::value || is_same<T, short>::value ||
    is_same<T, unsigned short>::value || is_same<T, int>::value || is_same<T, unsigned int>::value ||
    is_same<T, long>::value || is_same<T, unsigned long>::value || is_same<T, long long>::value ||
    is_same<T, unsigned long long>::value> {};
template <class T> struct is_signed : integral_constant<bool, (T(-1) < T(0))> {};
template <class T> struct is_unsigned : integral_constant<bool, is_integral<T>::value && !(T(-1) < T(0))> {};
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <bool B, class T, class F> struct conditional { typedef T type; };
template <class T, class F> struct conditional<false, T, F> { typedef F type; };
} }
"""
# IEEE-754 bit patterns of the constants TVM's CUDA codegen names
_MATH_CONSTANTS = {
    "CUDART_INF_F": "__int_as_float(0x7f800000)",
    "CUDART_NAN_F": "__int_as_float(0x7fffffff)",
    "CUDART_MIN_DENORM_F": "__int_as_float(0x00000001)",
    "CUDART_MAX_NORMAL_F": "__int_as_float(0x7f7fffff)",
    "CUDART_NEG_ZERO_F": "__int_as_float(0x80000000)",
    "CUDART_ZERO_F": "0.0f",
    "CUDART_ONE_F": "1.0f",
    "CUDART_INF": "__longlong_as_double(0x7ff0000000000000ULL)",
    "CUDART_NAN": "__longlong_as_double(0xfff8000000000000ULL)",
}
HEADERS = {
    "cuda/std/cstdint": _CSTDINT,
    "cuda/std/type_traits": _TYPE_TRAITS,
    "math_constants.h": "#pragma once\n" + "".join(f"#define {k} {v}\n" for k, v in _MATH_CONSTANTS.items()),
}


def _candidates() -> list[str]:
    env = os.environ.get("EDGEKV_NVRTC")
    if env:
        return [env]
    found: list[str] = []
    try:  # the PyPI wheels put it under the `nvidia` namespace package (cuda_nvrtc/lib, cu13/lib)
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            for p in sorted(Path(root).glob("*/lib/libnvrtc.so*")):
                if "builtins" not in p.name and ".alt." not in p.name:
                    found.append(str(p))
    except ImportError:
        pass
    system = ctypes.util.find_library("nvrtc")
    if system:
        found.append(system)
    found += [str(p) for p in sorted(Path("/usr/local/cuda/lib64").glob("libnvrtc.so*")) if "builtins" not in p.name]
    return found


def load_nvrtc() -> ctypes.CDLL:
    """The NVRTC library, or a CompileError saying how to install it."""
    tried = _candidates()
    for path in tried:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    where = f" (tried {', '.join(tried)})" if tried else ""
    raise CompileError(f"a cuda-host build compiles its kernels to PTX with NVRTC, which is not installed{where}: "
                       f"{INSTALL_HINT}")


def nvrtc_version(lib: ctypes.CDLL | None = None) -> str:
    lib = lib or load_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _log(lib, prog) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def compile_ptx(source: str, arch: str = DEFAULT_ARCH, name: str = "kernels.cu") -> bytes:
    """PTX for ``compute_<arch digits>`` from TVM's CUDA C (NUL-terminated, as cuModuleLoadData
    takes it). No --use_fast_math: the kernels' exp/div stay IEEE, so the ids match the CPU's."""
    lib = load_nvrtc()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    digits = re.sub(r"^(sm_|compute_)", "", arch)
    if not digits.isdigit():
        raise CompileError(f"CUDA arch {arch!r} is not of the form sm_80")
    names = list(HEADERS)
    headers = (ctypes.c_char_p * len(names))(*[HEADERS[n].encode() for n in names])
    includes = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(names), headers, includes)
    if rc != 0:
        raise CompileError(f"NVRTC could not take the CUDA source: {lib.nvrtcGetErrorString(rc).decode()}")
    try:
        opts = [f"--gpu-architecture=compute_{digits}", "--std=c++17", "-default-device"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            raise CompileError(f"NVRTC {nvrtc_version(lib)} rejected the generated CUDA source "
                               f"({lib.nvrtcGetErrorString(rc).decode()}):\n{_log(lib, prog)[-3000:]}")
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetPTX(prog, buf) != 0:
            raise CompileError("NVRTC compiled the CUDA source but returned no PTX")
        return buf.raw[: size.value]  # includes the terminating NUL
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def ptx_entries(ptx: str) -> list[str]:
    """The kernel names a PTX module defines (its ``.entry`` directives)."""
    return re.findall(r"\.entry\s+(\w+)\s*\(", ptx)
