"""The native runtime on another CPU: ``edgekv-run`` cross-built for aarch64 Linux
(``runtime/cmake/aarch64-linux-gnu.cmake``) runs an ``--target aarch64-linux`` artifact, linked
by ``backend.finish.finish`` with the cross gcc, under qemu-user, and generates the same token ids as
the host ``edgekv-run`` on a host artifact of the same model, policy, budget and block. Each
runtime refuses the other's artifact with a message naming the architectures.

Policies: KeyDiff, SnapKV and D2O (whose per-prompt ``prepare`` function the program calls).
Slow (per policy two compiles; two runtime builds; qemu is several times slower than native).
It skips, saying what to install, when the cross compiler, the aarch64 glibc or qemu-user is
missing: ``apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSROOT = Path("/usr/aarch64-linux-gnu")
CROSS_CC = "aarch64-linux-gnu-gcc"
TOOLCHAIN = REPO / "runtime" / "cmake" / "aarch64-linux-gnu.cmake"
APT = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static"
B, N = 8, 16
PROMPT = [(7 * i + 3) % 251 + 1 for i in range(45)]  # 45 ids < vocab 256: six blocks, eviction from the third
NEW_TOKENS = 10


def _qemu() -> str | None:
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def _why_not() -> str | None:
    if platform.machine() != "x86_64":
        return f"cross-builds from an x86_64 machine (this one is {platform.machine()})"
    missing = [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install -y cmake ninja-build)"
    if shutil.which(CROSS_CC) is None:
        return f"{CROSS_CC} not found: {APT}"
    if not (SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists() or not (SYSROOT / "lib" / "libc.so").exists():
        return f"the aarch64 glibc is not in {SYSROOT}: {APT}"
    if _qemu() is None:
        return f"qemu-aarch64-static (qemu-user) not found: {APT}"
    try:
        import tvm  # noqa: F401
        import tvm_ffi.libinfo  # noqa: F401
    except ImportError as exc:
        return f"TVM / TVM-FFI not importable ({exc})"
    return None


WHY = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=WHY or "")]


def _run(cmd: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def _elf_machine(path: Path) -> int | None:
    from edgekv.compiler.backend.device_code import elf_machine

    return elf_machine(Path(path).read_bytes()[:64])


def _build_runtime(build_dir: Path, *cmake_args: str) -> Path:
    """Configure and build runtime/ (2 jobs: the machine is shared); returns edgekv-run."""
    import tvm_ffi.libinfo

    ffi = tvm_ffi.libinfo.find_include_path()
    cfg = _run(["cmake", "-S", REPO / "runtime", "-B", build_dir, "-G", "Ninja", f"-DEDGEKV_TVM_FFI_INCLUDE={ffi}",
                *cmake_args])
    assert cfg.returncode == 0, f"cmake configure failed:\n{cfg.stdout[-2000:]}\n{cfg.stderr[-3000:]}"
    build = _run(["ninja", "-C", build_dir, "-j", "2"])
    what = " ".join(cmake_args) or "host"
    assert build.returncode == 0, f"the runtime did not build ({what}):\n{build.stdout[-4000:]}"
    exe = build_dir / "edgekv-run"
    assert exe.is_file()
    return exe


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory) -> dict[str, list[str]]:
    """{"host": [edgekv-run], "aarch64": [qemu, -L, sysroot, edgekv-run]}: the command prefixes."""
    base = tmp_path_factory.mktemp("runtimes")
    host = _build_runtime(base / "host")
    a64 = _build_runtime(base / "aarch64", f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}")
    assert _elf_machine(a64) == 183  # EM_AARCH64
    return {"host": [str(host)], "aarch64": [_qemu(), "-L", str(SYSROOT), str(a64)]}


@pytest.fixture(scope="module")
def model():
    from edgekv.models import tiny_random_model

    return tiny_random_model(0)


@pytest.fixture(scope="module")
def imported(model):
    from edgekv.compiler import import_model

    return import_model(model, B)


def _policy(name: str):
    from edgekv.policies.d2o import D2OPolicy
    from edgekv.policies.keydiff import KeyDiffPolicy
    from edgekv.policies.snapkv import SnapKVPolicy

    # keydiff: key-only scores; snapkv: the block's attention rows; d2o: a per-prompt `prepare`
    # function and per-layer state in the cache
    return {"keydiff": KeyDiffPolicy(), "snapkv": SnapKVPolicy(window=4, kernel=3), "d2o": D2OPolicy()}[name]


_ARTIFACTS: dict = {}


def _artifacts(name: str, model, imported, tmp_path_factory) -> dict[str, Path]:
    """The host and the (finished) aarch64 artifact of one policy, compiled once per module."""
    if name not in _ARTIFACTS:
        import warnings

        from edgekv.compiler import compile_model
        from edgekv.compiler.backend.finish import finish
        from edgekv.compiler.errors import ToolchainNeededWarning

        policy, _, weights = name.partition("-")  # "keydiff-q4": 4-bit weights (the quantised CPU kernels)
        weights = weights or "fp32"
        base = tmp_path_factory.mktemp(f"art_{name}")
        compile_model(model, _policy(policy), N, B, "host", base / "host", imported=imported, weights=weights)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ToolchainNeededWarning)
            compile_model(model, _policy(policy), N, B, "aarch64-linux", base / "aarch64", imported=imported,
                          weights=weights)
        m = json.loads((base / "aarch64" / "manifest.json").read_text())
        assert m["files"]["library"]["name"] == "model.tar" and m["files"]["program"]["name"] == "program.ekv"
        env = m["device"]["toolchain"]["env"]
        old = os.environ.get(env)
        os.environ[env] = CROSS_CC
        try:
            so = finish(base / "aarch64")
        finally:
            if old is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = old
        assert _elf_machine(so) == 183
        _ARTIFACTS[name] = {"host": base / "host", "aarch64": base / "aarch64"}
    return _ARTIFACTS[name]


def _generate(cmd: list[str], artifact: Path, tmp_path: Path, tag: str) -> dict:
    report = tmp_path / f"{tag}.json"
    r = _run([*cmd, artifact, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS),
              "--report", report, "--quiet"])
    assert r.returncode == 0, f"{tag}: edgekv-run exited {r.returncode}:\n{r.stderr[-3000:]}"
    return json.loads(report.read_text())


@pytest.mark.parametrize("variant", ["keydiff", "snapkv", "d2o", "keydiff-q4"])
def test_aarch64_under_qemu_matches_host(runtimes, model, imported, tmp_path_factory, tmp_path, variant):
    from edgekv.artifact import program_file

    arts = _artifacts(variant, model, imported, tmp_path_factory)
    policy = variant.partition("-")[0]
    check = _run([*runtimes["aarch64"], arts["aarch64"], "--check", "--verify-weights"])
    assert check.returncode == 0, check.stderr
    host = _generate(runtimes["host"], arts["host"], tmp_path, "host")
    a64 = _generate(runtimes["aarch64"], arts["aarch64"], tmp_path, "aarch64")
    assert a64["target"] == "aarch64-linux" and a64["policy"] == host["policy"] == policy
    assert len(host["generated_ids"]) == NEW_TOKENS
    assert a64["generated_ids"] == host["generated_ids"]
    # eviction ran: the caches end at the same lengths, none above the budget (D2O: per-layer budgets)
    assert a64["cache_lengths"] == host["cache_lengths"]
    assert max(host["cache_lengths"]) <= N < len(PROMPT)
    if policy != "d2o":
        assert host["cache_lengths"] == [N] * model.config.num_layers
    if policy == "d2o":
        prog = program_file.read(arts["aarch64"] / "program.ekv")
        assert "prepare" in [f.name for f in prog.functions]


def test_each_runtime_refuses_the_other_architecture(runtimes, model, imported, tmp_path_factory):
    arts = _artifacts("keydiff", model, imported, tmp_path_factory)
    r = _run([*runtimes["host"], arts["aarch64"], "--prompt-ids", "1,2,3"])
    assert r.returncode == 2, r.stderr
    assert "aarch64" in r.stderr and "x86_64" in r.stderr, r.stderr
    r = _run([*runtimes["aarch64"], arts["host"], "--prompt-ids", "1,2,3"])
    assert r.returncode == 2, r.stderr
    assert "compiled for x86_64" in r.stderr and "aarch64" in r.stderr, r.stderr
