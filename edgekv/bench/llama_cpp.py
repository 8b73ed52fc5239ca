"""llama.cpp as the peer: its own `llama-bench` binary, built once from the sources that
`llama-cpp-python`'s sdist vendors (`python tools/bench/build_llama_cpp.py`), run as a child process
on the same GGUF and thread count. Not the Python binding: one `eval` call per token from Python
costs more than a 135M model's decode step, which made earlier "× llama.cpp" figures overstate.

A run's peak RSS is the child's own, from GNU time (`/usr/bin/time`'s max RSS)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is the peer (pinned: the figures name it)
TARGETS = ("llama-bench", "llama-completion")  # llama-cli now needs the server build; llama-completion is the one-shot CLI


def build_dir(cache: Path | None = None) -> Path:
    """``<edgekv cache>/llama.cpp/<llama-cpp-python version>``: where the build tool puts the binaries."""
    if cache is None:
        from ..models.sources import cache_root
        cache = cache_root()
    return Path(cache) / "llama.cpp" / LLAMA_CPP_PYTHON


def find_binary(name: str = "llama-bench", cache: Path | None = None) -> Path:
    """The built binary (``LLAMA_BENCH`` / ``LLAMA_CLI`` override the cache), or a RuntimeError
    that says how to build it."""
    override = os.environ.get(name.upper().replace("-", "_"))
    path = Path(override) if override else build_dir(cache) / "bin" / name
    if not path.is_file():
        raise RuntimeError(f"{name} is not built ({path} is missing): build llama.cpp once with "
                           "`python tools/bench/build_llama_cpp.py` (needs cmake and a C++ compiler), or point "
                           f"{name.upper().replace('-', '_')} at a {name} binary")
    return path


def run_measured(cmd: list[str], timeout: float | None = None) -> tuple[str, str, int]:
    """(stdout, stderr, peak RSS bytes) of a child process; raises on a non-zero exit.

    The peak is GNU time's ``%M`` (``/usr/bin/time``, a small process that forks the command): the
    ``wait4`` of a child forked straight from this Python process would count the parent's pages the
    child held between fork and exec (a loaded tokenizer, torch), not the command's own."""
    time_bin = shutil.which("time", path="/usr/bin:/bin") or ""
    marker = "EDGEKV_PEAK_KIB"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        wrapped = [time_bin, "-f", f"{marker} %M", *cmd] if time_bin else cmd
        proc = subprocess.Popen(wrapped, stdout=out, stderr=err, text=True)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    peak_kib = usage.ru_maxrss  # without GNU time: this process's child, an upper bound (see above)
    if time_bin:
        lines = [ln for ln in stderr.splitlines() if ln.startswith(marker)]
        stderr = "\n".join(ln for ln in stderr.splitlines() if not ln.startswith(marker))
        if lines:
            peak_kib = int(lines[-1].split()[1])
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}): {stderr.strip()[-600:]}")
    return stdout, stderr, peak_kib * 1024  # Linux: KiB


def llama_bench(gguf: str | Path, threads: int, *, prompt: int = 0, generate: int = 0, depth: int = 0,
                flash_attn: bool = False, repetitions: int = 1, binary: Path | None = None) -> dict:
    """One llama-bench test: ``pp<prompt>`` (prompt > 0) or ``tg<generate>`` after ``depth`` tokens
    of context (``-d``). Returns tok/s (mean over repetitions, llama-bench's own ``avg_ts``), its
    samples, and the process's peak RSS (the context is sized for prompt + depth + generate)."""
    if (prompt > 0) == (generate > 0):
        raise ValueError("one of prompt / generate, not both")
    exe = binary or find_binary("llama-bench")
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(generate), "-d", str(depth),
           "-fa", "1" if flash_attn else "0", "-r", str(repetitions), "-o", "json"]
    stdout, _, peak = run_measured(cmd)
    rows = json.loads(stdout)
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench printed {len(rows)} results for one test: {cmd}")
    row = rows[0]
    return {"tok_s": float(row["avg_ts"]), "samples_tok_s": [float(x) for x in row.get("samples_ts", [])],
            "peak_rss": peak, "flash_attn": flash_attn, "prompt": prompt, "generate": generate, "depth": depth,
            "threads": int(row.get("n_threads", threads)), "build_commit": row.get("build_commit"),
            "cpu_info": row.get("cpu_info"), "type_k": row.get("type_k"), "command": " ".join(cmd)}
