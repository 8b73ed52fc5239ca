"""What the kernel microbenchmarks (bench_gemm_tiles, bench_kquant_kernels, bench_int8_gemv) share:
the start of a run, their clock, warm and cold timing of a compiled kernel, and another commit's
kernel files imported beside the current ones."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def add_timing_args(ap, threads: int) -> None:
    """The options every kernel microbenchmark takes: --threads, --reps, --cpu-time, -o."""
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (with --threads 1: robust to a shared machine)")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")


def start_provenance(args) -> dict:
    """The run's provenance (taken before anything runs) and TVM's thread pool size (set before TVM
    loads); ``clock(args)`` is the timer to pass on."""
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    return prov


def clock(args):
    return time.process_time if args.cpu_time else time.perf_counter


def time_warm(f, args, clock, reps: int = 5) -> float:
    """The best of ``reps`` calls after one warm-up (weights in cache)."""
    f(*args)
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        f(*args)
        best = min(best, clock() - t0)
    return best


def time_cold(f, copies: list[list], x, out, clock) -> float:
    """Seconds per call, cycling through the weight copies (each cold when its turn comes)."""
    for args in copies[:2]:
        f(x, *args, out)
    t0 = clock()
    for args in copies:
        f(x, *args, out)
    return (clock() - t0) / len(copies)


def kernels_at(ref: str, stems: tuple[str, ...]) -> dict:
    """``edgekv/compiler/kernels/<stem>.py`` as they are at git ``ref``, imported beside the current
    ones as ``_<stem>_baseline`` (their imports of each other pointed at the baseline copies)."""
    tmp = Path(tempfile.mkdtemp(prefix="kernels_baseline_"))
    mods = {}
    for stem in stems:
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:edgekv/compiler/kernels/{stem}.py"],
                             check=True, capture_output=True, text=True).stdout
        for other in stems:
            src = src.replace(f"from .{other} import", f"from ._{other}_baseline import")
        path = tmp / f"_{stem}_baseline.py"
        path.write_text(src)  # TVMScript reads a macro's source from its file
        name = f"edgekv.compiler.kernels._{stem}_baseline"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "edgekv.compiler.kernels"
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[stem] = mod
    return mods
