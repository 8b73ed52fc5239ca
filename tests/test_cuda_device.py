"""The native runtime's CUDA device (issue 35, ``--target cuda-host``), checked with no GPU and no
CUDA installed: the runtime builds with the CUDA device (it needs no CUDA headers: the driver API
is declared in device_cuda.c, libcuda.so.1 is loaded with dlopen) and refuses a CUDA artifact with
a clear error and exit status 2 when there is no driver; a cuda-host compile writes PTX whose
kernels the program lists, with argument kinds that match the CUDA source's kernel signatures.

Compiling a cuda-host artifact needs NVRTC (``pip install 'edgekv[cuda]'``); those tests skip,
saying so, without it. Running one on a GPU: docs/NATIVE.md, "The CUDA device"."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

tvm = pytest.importorskip("tvm")

from edgekv.artifact import program_file as pf  # noqa: E402
from edgekv.compiler import CompileError, compile_model  # noqa: E402
from edgekv.compiler.backend import cuda_ptx  # noqa: E402
from edgekv.compiler.backend.device_kernels import ARG_KINDS  # noqa: E402
from edgekv.compiler.backend.target import CompileTarget  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
B, N = 8, 24


def nvrtc_missing() -> str | None:
    try:
        cuda_ptx.load_nvrtc()
    except CompileError as exc:
        return f"NVRTC is needed to compile a cuda-host artifact: {exc}"
    return None


@pytest.fixture(scope="module")
def runtime_build(tmp_path_factory) -> Path:
    """The runtime built from runtime/ as it is here: with the CUDA device, without CUDA."""
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        pytest.skip("cmake and a C compiler are needed to build the runtime (apt-get install cmake gcc)")
    build = tmp_path_factory.mktemp("cuda-rt")
    ffi = subprocess.run(["python", "-c", "import tvm_ffi.libinfo as l; print(l.find_include_path())"],
                         capture_output=True, text=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run(["cmake", "-S", str(RUNTIME_DIR), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                          f"-DEDGEKV_TVM_FFI_INCLUDE={ffi.stdout.strip()}"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stderr
    assert "with the CUDA device" in cfg.stdout
    made = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return build


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory) -> Path:
    why = nvrtc_missing()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("cuda-host") / "keydiff"
    compile_model(tiny_random_model(seed=1, layers=2), make_policy("keydiff", {}), N, B, target="cuda-host", out_dir=out)
    return out


def test_runtime_builds_with_the_cuda_device_and_no_cuda(runtime_build):
    lib = runtime_build / "libedgekv_runtime.so"
    rt = ctypes.CDLL(str(lib))
    rt.ekv_runtime_devices.restype = ctypes.c_char_p
    assert "cuda" in rt.ekv_runtime_devices().decode().split(",")
    # CUDA is loaded at run time: the library does not link it, and the source includes no CUDA header
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "libcuda" not in needed and "libcudart" not in needed
    source = (RUNTIME_DIR / "src" / "device_cuda.c").read_text()
    assert not re.search(r"#include\s*[<\"]cuda", source)
    # the build without the device (Android's default) compiles too
    ffi = subprocess.run(["python", "-c", "import tvm_ffi.libinfo as l; print(l.find_include_path())"],
                         capture_output=True, text=True).stdout.strip()
    none = subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{RUNTIME_DIR}/include",
                           f"-I{RUNTIME_DIR}/src", f"-I{ffi}", str(RUNTIME_DIR / "src" / "device_cuda_none.c")],
                          capture_output=True, text=True)
    assert none.returncode == 0, none.stderr


def test_targets_resolve():
    host, plain = CompileTarget.resolve("cuda-host"), CompileTarget.resolve("cuda")
    assert host.kind == plain.kind == "cuda"
    assert host.native_runtime and host.ptx and host.host == {"kind": "llvm"}
    # the `cuda` profile stays a TVM-runtime build (HostRuntime with tvm.cuda()): no program, no PTX
    assert not plain.native_runtime and not plain.ptx


def test_compile_without_nvrtc_is_refused_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEKV_NVRTC", str(tmp_path / "no-libnvrtc.so"))
    with pytest.raises(CompileError, match=r"pip install 'edgekv\[cuda\]'"):
        compile_model(tiny_random_model(seed=1, layers=2), make_policy("keydiff", {}), N, B, target="cuda-host",
                      out_dir=tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_program_records_the_ptx_kernels(cuda_artifact):
    m = json.loads((cuda_artifact / "manifest.json").read_text())
    assert m["files"]["library"]["name"] == "model.so"  # host code for this machine: edgekv-run loads it
    dev = m["device"]
    assert dev["native_runtime"]["device"] == "cuda"
    assert dev["ptx"]["arch"] == "sm_80" and re.fullmatch(r"\d+\.\d+", dev["ptx"]["nvrtc"])
    assert set(dev["files"]) == {"device/kernels.cu", "device/kernels.ptx"}
    prog = pf.read(cuda_artifact / "program.ekv")
    s = prog.settings
    assert (s["device"], s["device_source_name"], s["device_arch"]) == ("cuda", "device/kernels.ptx", "sm_80")
    assert s["arena_align"] % 16 == 0
    ptx = (cuda_artifact / "device" / "kernels.ptx").read_text(errors="replace")
    assert ".target sm_80" in ptx
    assert {k.name for k in prog.device_kernels} == set(cuda_ptx.ptx_entries(ptx))
    assert dev["native_runtime"]["kernels"] == len(prog.device_kernels)
    # every kernel launches with a grid and a block (blockIdx.x = 0, threadIdx.x = 3 at least)
    for k in prog.device_kernels:
        assert 0 in k.tags and 3 in k.tags, (k.name, k.tags)
    flagged = [k.name for k in prog.device_kernels if k.flags & pf.DKERNEL_EVICTION]
    assert flagged and len(flagged) < len(prog.device_kernels)
    assert any("select" in n for n in flagged)


# a CUDA C parameter type → the argument kind the host code passes (device_kernels.ARG_KINDS)
CUDA_PARAM_KINDS = {"int": "int32", "int32_t": "int32", "int64_t": "int64", "float": "float32", "double": "float64",
                    "uint": "uint32", "unsigned int": "uint32", "uint32_t": "uint32"}


def cuda_signatures(source: str) -> dict[str, list[int]]:
    """Each __global__ kernel of TVM's CUDA C → the argument kinds its parameter list declares."""
    out: dict[str, list[int]] = {}
    for m in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)', source):
        kinds = []
        for param in filter(None, (p.strip() for p in m.group(2).split(","))):
            if "*" in param:
                kinds.append(ARG_KINDS["buffer"])
                continue
            ty = re.sub(r"\s+\w+$", "", param).replace("const ", "").strip()
            assert ty in CUDA_PARAM_KINDS, f"{m.group(1)}: parameter type {ty!r}"
            kinds.append(ARG_KINDS[CUDA_PARAM_KINDS[ty]])
        out.setdefault(m.group(1), kinds)
        assert out[m.group(1)] == kinds, f"{m.group(1)} declared twice, differently"
    return out


def test_arg_kinds_match_the_cuda_kernel_signatures(cuda_artifact):
    prog = pf.read(cuda_artifact / "program.ekv")
    declared = cuda_signatures((cuda_artifact / "device" / "kernels.cu").read_text())
    assert set(declared) == {k.name for k in prog.device_kernels}
    for k in prog.device_kernels:
        assert k.args == declared[k.name], k.name
    # and the PTX takes as many parameters as the launch passes (one 8-byte address per buffer)
    ptx = (cuda_artifact / "device" / "kernels.ptx").read_text(errors="replace")
    for k in prog.device_kernels:
        params = re.search(rf"\.entry\s+{k.name}\s*\(([^)]*)\)", ptx).group(1)
        types = re.findall(r"\.param\s+\.(\w+)", params)
        assert len(types) == len(k.args), k.name
        assert all(t in ("u64", "b64") for t, a in zip(types, k.args) if a == ARG_KINDS["buffer"]), k.name


def test_cuda_artifact_without_a_driver_is_a_clear_error(runtime_build, cuda_artifact):
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has a CUDA driver: the no-driver error cannot be shown here")
    run = subprocess.run([str(runtime_build / "edgekv-run"), str(cuda_artifact), "--prompt-ids", "1,2,3",
                          "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "needs an NVIDIA GPU with the CUDA driver (libcuda.so.1 not found)" in run.stderr
    assert "--target host" in run.stderr
    assert "Segmentation" not in run.stderr
