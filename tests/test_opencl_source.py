"""Every OpenCL target's device source is valid OpenCL C (issue 35): the tiny model compiled for
``opencl`` (the phone form: aarch64 Android host, dlight's Adreno/Mali schedules) and
``opencl-host`` (x86 host), fp32 and q4 weights (and q8 for the phone form), each ``device/kernels.cl`` passes clang's
OpenCL front end (``clang -x cl -cl-std=CL1.2 -fsyntax-only``) and builds on PoCL. Also the
arena layout of a GPU program: every region at a multiple of the alignment that NVIDIA's
sub-buffers need (512 bytes), which also covers PoCL, Intel, Adreno, Mali (128) and AMD (256).

Needs clang for the front-end check (apt-get install clang) and an OpenCL platform for the
build (apt-get install pocl-opencl-icd); each part skips, saying so, without them."""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import subprocess
import warnings

import pytest

tvm = pytest.importorskip("tvm")

from edgekv.artifact import PROGRAM_FILE  # noqa: E402
from edgekv.artifact import program_file as pf  # noqa: E402
from edgekv.compiler.backend.program import DEVICE_ARENA_ALIGN  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402

# q8 on the phone form too: its int8 quants are read contiguously, and stay vectorised there
FORMS = [(t, w) for t in ("opencl", "opencl-host") for w in ("fp32", "q4")] + [("opencl", "q8")]
CL_STD = "-cl-std=CL1.2"


@pytest.fixture(scope="module")
def built(shared_artifact):
    """(target, weights) → the artifact directory, each compiled once per session (the fp32
    opencl-host one is also tests/test_opencl.py's KeyDiff artifact)."""
    model = tiny_random_model(seed=1, layers=2)

    def get(target, weights):
        with warnings.catch_warnings():  # the phone form: "finish with the NDK" (not needed here)
            warnings.simplefilter("ignore")
            return shared_artifact(model, make_policy("keydiff"), 24, 8, target, weights=weights)

    return get


@pytest.mark.parametrize("target,weights", FORMS, ids=[f"{t}-{w}" for t, w in FORMS])
def test_device_source_passes_clangs_opencl_front_end(built, target, weights):
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("clang is needed to check the OpenCL C source (apt-get install clang)")
    source = built(target, weights) / "device" / "kernels.cl"
    res = subprocess.run([clang, "-x", "cl", CL_STD, "-fsyntax-only", str(source)], capture_output=True, text=True)
    errors = [line[:300] for line in res.stderr.splitlines() if "error:" in line]
    assert res.returncode == 0 and not errors, f"{source}: {len(errors)} errors\n" + "\n".join(errors[:10])


def _opencl():
    """libOpenCL through ctypes, or None: the check builds the source exactly as a runtime would."""
    name = ctypes.util.find_library("OpenCL") or "libOpenCL.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _build_on_first_device(cl, source: bytes) -> tuple[str, int, str]:
    """(device name, clBuildProgram's status, build log) for ``source`` on the first OpenCL device."""
    c_void_pp = ctypes.POINTER(ctypes.c_void_p)
    platforms = (ctypes.c_void_p * 8)()
    n = ctypes.c_uint(0)
    if cl.clGetPlatformIDs(8, platforms, ctypes.byref(n)) != 0 or n.value == 0:
        return "", -1, "no platform"
    device = ctypes.c_void_p()
    for p in platforms[: n.value]:
        nd = ctypes.c_uint(0)
        if cl.clGetDeviceIDs(ctypes.c_void_p(p), ctypes.c_uint64(0xFFFFFFFF), 1, ctypes.byref(device), ctypes.byref(nd)) == 0 and nd.value:
            break
    else:
        return "", -1, "no device"
    name = ctypes.create_string_buffer(256)
    cl.clGetDeviceInfo(device, 0x102B, 255, name, None)  # CL_DEVICE_NAME
    rc = ctypes.c_int(0)
    cl.clCreateContext.restype = ctypes.c_void_p
    ctx = ctypes.c_void_p(cl.clCreateContext(None, 1, ctypes.byref(device), None, None, ctypes.byref(rc)))
    assert rc.value == 0, f"clCreateContext: {rc.value}"
    src = ctypes.c_char_p(source)
    size = ctypes.c_size_t(len(source))
    cl.clCreateProgramWithSource.restype = ctypes.c_void_p
    prog = ctypes.c_void_p(cl.clCreateProgramWithSource(ctx, 1, ctypes.cast(ctypes.byref(src), c_void_pp),
                                                        ctypes.byref(size), ctypes.byref(rc)))
    assert rc.value == 0, f"clCreateProgramWithSource: {rc.value}"
    status = cl.clBuildProgram(prog, 1, ctypes.byref(device), CL_STD.encode(), None, None)
    log_size = ctypes.c_size_t(0)
    cl.clGetProgramBuildInfo(prog, device, 0x1183, 0, None, ctypes.byref(log_size))  # CL_PROGRAM_BUILD_LOG
    log = ctypes.create_string_buffer(log_size.value + 1)
    cl.clGetProgramBuildInfo(prog, device, 0x1183, log_size.value, log, None)
    cl.clReleaseProgram(prog)
    cl.clReleaseContext(ctx)
    return name.value.decode(errors="replace"), status, log.value.decode(errors="replace")


@pytest.mark.parametrize("target,weights", FORMS, ids=[f"{t}-{w}" for t, w in FORMS])
def test_device_source_builds_on_opencl(built, target, weights):
    cl = _opencl()
    if cl is None:
        pytest.skip("no OpenCL library (apt-get install pocl-opencl-icd)")
    source = (built(target, weights) / "device" / "kernels.cl").read_bytes()
    device, status, log = _build_on_first_device(cl, source)
    if status == -1 and device == "":
        pytest.skip(f"no OpenCL device ({log}): apt-get install pocl-opencl-icd")
    assert status == 0, f"{target} {weights}: the source does not build on {device} (error {status}):\n{log[-3000:]}"


@pytest.mark.parametrize("target", ["opencl", "opencl-host"])
def test_gpu_program_arena_regions_meet_every_devices_sub_buffer_alignment(built, target):
    assert DEVICE_ARENA_ALIGN % 512 == 0  # NVIDIA: CL_DEVICE_MEM_BASE_ADDR_ALIGN 4096 bits
    prog = pf.read(built(target, "q4") / PROGRAM_FILE)
    assert prog.settings["arena_align"] == DEVICE_ARENA_ALIGN
    offsets = [b.a for b in prog.buffers if b.kind == pf.ARENA]
    assert offsets, "the program places no tensor in the arena"
    assert all(off % DEVICE_ARENA_ALIGN == 0 for off in offsets), sorted(o % DEVICE_ARENA_ALIGN for o in offsets)
    assert int(prog.settings["arena_bytes"]) % DEVICE_ARENA_ALIGN == 0


def test_cpu_program_keeps_its_64_byte_arena(built, shared_artifact):
    """The CPU's arena is not padded for devices: only GPU programs carry ``arena_align``."""
    art = shared_artifact(tiny_random_model(seed=1, layers=2), make_policy("keydiff"), 24, 8,
                          {"kind": "llvm", "opt-level": 0, "num-cores": 2})
    prog = pf.read(art / PROGRAM_FILE)
    assert "arena_align" not in prog.settings
    assert any(b.a % DEVICE_ARENA_ALIGN for b in prog.buffers if b.kind == pf.ARENA)
