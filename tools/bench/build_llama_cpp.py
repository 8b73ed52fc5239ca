"""Build llama.cpp's own `llama-bench` and `llama-completion` (the one-shot CLI), once, into edgekv's cache: the peer for
every "× llama.cpp" figure (tools/bench/bench_llama_cpp.py).

    python tools/bench/build_llama_cpp.py [--cache DIR] [--jobs N] [--force]

The sources are the ones `llama-cpp-python`'s sdist vendors (`pip download --no-binary :all:
--no-deps llama-cpp-python`, pinned below), configured with CMake, Release, GGML_NATIVE=ON (the
build machine's own instruction set, as a user building llama.cpp gets). The Python binding is
not used: its per-token `eval` loop costs more than a 135M model's decode step. The binaries land
in `<cache>/llama.cpp/<version>/bin/` and a `build.json` beside them records the version and
flags; a second run finds them and builds nothing. On a shared machine run it under the lock:
`flock /work/wt/heavy.lock python tools/bench/build_llama_cpp.py`."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgekv.bench.llama_cpp import LLAMA_CPP_PYTHON, TARGETS, build_dir as cache_dir

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


class BuildError(RuntimeError):
    pass


def built_binaries(cache: Path | None = None) -> dict[str, Path] | None:
    """The binaries of a finished build, or None when there is none yet."""
    root = cache_dir(cache)
    if not (root / "build.json").exists():
        return None
    bins = {t: root / "bin" / t for t in TARGETS}
    return bins if all(p.exists() for p in bins.values()) else None


def check_toolchain() -> None:
    """cmake and a C/C++ compiler, checked before anything is downloaded."""
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if missing:
        raise BuildError(f"building llama.cpp needs {', '.join(missing)}: install them (Debian/Ubuntu: "
                         "`apt-get install cmake build-essential`, macOS: `xcode-select --install && "
                         "brew install cmake`), then rerun this command")


def _sdist(root: Path, console: Console) -> Path:
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    dest = root / "sdist"
    if (dest / name).exists():
        return dest / name
    dest.mkdir(parents=True, exist_ok=True)
    console.print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (~75 MB; pip prepares its "
                  "metadata, a few minutes) ...")
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                          f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dest)], capture_output=True, text=True)
    if res.returncode != 0 or not (dest / name).exists():
        raise BuildError(f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON} failed: {res.stderr.strip()[-600:]}")
    return dest / name


def _extract_vendor(sdist: Path, root: Path) -> Path:
    src = root / "src"
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(src, members=members, filter="data")
    return src


def _run_build(cmd: list[str], log, progress: Progress, task) -> None:
    """Runs the cmake build, advancing the bar from the '[n/m]' lines Ninja / Make print."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.write(line)
        m = re.match(r"\s*\[\s*(\d+)/(\d+)\]", line) or re.match(r"\s*\[\s*(\d+)%\]", line)
        if m and len(m.groups()) == 2:
            progress.update(task, completed=int(m.group(1)), total=int(m.group(2)))
        elif m:
            progress.update(task, completed=int(m.group(1)), total=100)
    if proc.wait() != 0:
        raise BuildError(f"the llama.cpp build failed (exit {proc.returncode}); its log: {log.name}")


def build(cache: Path | None = None, jobs: int | None = None, force: bool = False,
          console: Console | None = None) -> dict[str, Path]:
    """Builds llama-bench and llama-cli once; returns their paths."""
    console = console or Console(stderr=True)
    if not force and (bins := built_binaries(cache)):
        console.print(f"llama.cpp already built: {bins['llama-bench'].parent}")
        return bins
    check_toolchain()
    root = cache_dir(cache)
    src = _extract_vendor(_sdist(root, console), root)
    build_dir = root / "build"
    jobs = jobs or os.cpu_count() or 2
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log_path = root / "build.log"
    with open(log_path, "w") as log, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                              TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("configure llama.cpp", total=None)
        res = subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS],
                             stdout=log, stderr=subprocess.STDOUT)
        if res.returncode != 0:
            raise BuildError(f"cmake could not configure llama.cpp (exit {res.returncode}); its log: {log_path}")
        progress.update(task, description=f"build {' + '.join(TARGETS)} ({jobs} jobs)")
        _run_build(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], log, progress, task)
    (root / "bin").mkdir(exist_ok=True)
    bins = {}
    for t in TARGETS:
        found = next((p for p in (build_dir / "bin" / t, build_dir / t) if p.exists()), None)
        if found is None:
            raise BuildError(f"the build finished but {t} is missing under {build_dir}; its log: {log_path}")
        shutil.copy2(found, root / "bin" / t)
        bins[t] = root / "bin" / t
    version = subprocess.run([str(bins["llama-bench"]), "--version"], capture_output=True, text=True)
    from edgekv.evaluation.report import provenance

    (root / "build.json").write_text(json.dumps({
        "meta": provenance([sys.executable, *sys.argv]),
        "llama_cpp_python": LLAMA_CPP_PYTHON, "cmake_flags": list(CMAKE_FLAGS),
        "version": (version.stdout + version.stderr).strip(), "binaries": {t: str(p) for t, p in bins.items()},
    }, indent=1))
    console.print(f"built {', '.join(TARGETS)} into {root / 'bin'}")
    return bins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, help="edgekv's cache directory (default: EDGEKV_CACHE or ~/.cache/edgekv)")
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: every core)")
    ap.add_argument("--force", action="store_true", help="rebuild even when a build is there")
    args = ap.parse_args()
    try:
        bins = build(args.cache, args.jobs, args.force)
    except BuildError as e:
        sys.exit(f"error: {e}")
    for t, p in bins.items():
        print(f"{t}: {p}")


if __name__ == "__main__":
    main()
