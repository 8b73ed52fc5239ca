"""What a device build generated, read back from its executable: the device code the artifact
keeps in ``device/``, kernels left on the host by mistake, the ELF machine of cross-compiled
objects, and an nvcc check of generated CUDA C."""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from ..errors import CompileError

DEVICE_DIR = "device"
SOURCE_SUFFIX = {"cuda": "cu", "opencl": "cl", "metal": "metal"}


def device_code(ex, tgt: dict) -> dict[str, bytes]:
    """The generated device code of an executable: ``{file name: bytes}`` — the GPU source for
    GPU targets, the object files (what ``export_library`` puts in the .tar) for LLVM ones."""
    host = ex.mod.imports[0] if ex.mod.imports else ex.mod
    out: dict[str, bytes] = {}
    for i, m in enumerate(host.imports):
        if m.kind in SOURCE_SUFFIX:
            out[f"kernels{'' if i == 0 else i}.{SOURCE_SUFFIX[m.kind]}"] = m.inspect_source().encode()
    if tgt.get("kind") == "llvm":
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "lib.tar"
            ex.export_library(str(path))
            with tarfile.open(path) as tf:
                for member in tf.getmembers():
                    if member.isfile() and member.name.endswith(".o"):
                        out[member.name] = tf.extractfile(member).read()
    return out


def host_functions_on_host(ex) -> list[str]:
    """Kernels the host code runs itself (CPU loops in a GPU build): parallel lambdas and host
    functions with float arithmetic. Empty for a correct GPU build."""
    host = ex.mod.imports[0] if ex.mod.imports else ex.mod
    ll = host.inspect_source("ll")
    bad = []
    if "__tvm_parallel_lambda" in ll:
        bad.append("__tvm_parallel_lambda")
    for m in re.finditer(r"define [^@]*@([\w.]+_compute_)\(.*?\n}\n", ll, re.S):
        body = m.group(0)
        if re.search(r"\b(fadd|fmul|fdiv|fcmp)\b", body):
            bad.append(m.group(1))
    return bad


def elf_machine(obj: bytes) -> int | None:
    if obj[:4] != b"\x7fELF":
        return None
    little = obj[5] == 1
    return int.from_bytes(obj[18:20], "little" if little else "big")


def check_cuda_source(source: str, arch: str = "sm_80", nvcc: str = "nvcc") -> dict:
    """Compile generated CUDA C with nvcc (no GPU needed) to prove it is valid for ``arch``;
    returns {cubin_bytes, seconds}. Raises CompileError with nvcc's message on failure."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cu"
        src.write_text(source)
        t0 = time.perf_counter()
        r = subprocess.run([nvcc, "-w", f"-arch={arch}", "-cubin", "-o", str(Path(d) / "k.cubin"), str(src)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError(f"nvcc rejected the generated CUDA source:\n{r.stderr[-3000:]}")
        return {"cubin_bytes": (Path(d) / "k.cubin").stat().st_size, "seconds": time.perf_counter() - t0}
