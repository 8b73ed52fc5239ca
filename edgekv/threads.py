"""How many CPU threads a run uses: one choice for every runtime (torch, TVM's VM, the native runtime).

    from edgekv.threads import prepare_process, choose_threads, apply_threads
    prepare_process()                 # before torch or TVM is imported (the CLI does it first)
    choice = choose_threads(None)     # None: the default; an int: what the user asked for
    apply_threads(choice.count)       # torch + TVM; a native runtime takes choice.count itself

The rule (the native runtime's ``runtime/src/threads.c`` is the same rule in C; docs/NATIVE.md,
"Threads"): **usable cores** = the CPUs this process may run on (affinity), one per physical core,
the big cores of a big.LITTLE chip, at most a cgroup CPU quota; **the default** = usable cores less
the other runnable processes, at least 1; **a request above the usable cores is clamped** to them,
with a warning (``ThreadChoice.asked``): threads beyond the cores only wait for each other — on a
2-core machine 64 threads ran one token 10x slower than 4, and 999 did not finish.

Why this default (measured by ``tools/bench/measure_threads.py``, results in docs/results/threads.md):

- **As many threads as there are free cores**, not all cores. A thread that shares its core with
  another busy process is descheduled for whole time slices, and every parallel region waits
  for its slowest thread: on a 2-core box with one busy process beside it, two torch threads
  ran the main job several times slower than one. ``default_threads`` counts the cores this
  process may use (CPU affinity, a cgroup CPU quota, physical cores rather than SMT siblings, the
  big cores of a big.LITTLE phone) and subtracts the other processes that are runnable right
  now (``procs_running`` of ``/proc/stat``, sampled a few times).
- **torch's waiting threads sleep instead of spinning** (``OMP_WAIT_POLICY=PASSIVE``), so load
  that starts after the choice costs a share of the machine, not a collapse; torch keeps most of
  its parallel speed-up that way. **TVM's pool keeps its own spin** (``TVM_THREAD_POOL_SPIN_COUNT``
  unset): without it two TVM threads ran no faster than one on an idle machine (its kernels are
  short and a worker woken from sleep arrives late), so a spin count of 0 would undo the reason
  for more threads; the price is that load arriving *after* a multi-thread choice slows a compiled
  run badly — set ``TVM_THREAD_POOL_SPIN_COUNT=0`` (or ``--threads 1``) where that is expected.
  TVM workers are not pinned to cores (``TVM_BIND_THREADS=0``): a pinned worker cannot move away
  from a core another process is using. These are environment settings read when the libraries
  load, so ``prepare_process`` must run before torch or TVM is imported; a value the user set wins.
- **TVM sizes its thread pool once**, from ``TVM_NUM_THREADS`` (else ``OMP_NUM_THREADS``, else
  half the logical CPUs on x86) when the pool is first used; ``runtime.config_threadpool`` can
  later lower the count but never raise it above that size. ``apply_threads`` sets both.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# environment defaults applied by prepare_process (the user's own values win)
PROCESS_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",  # torch's OpenMP threads sleep at barriers instead of spinning
    "TVM_BIND_THREADS": "0",  # do not pin TVM workers to cores another process may be using
}


@dataclass(frozen=True)
class ThreadChoice:
    count: int  # threads every runtime uses
    source: str  # "--threads" or "default"
    cores: int  # cores this process may use (physical, big cores on big.LITTLE)
    busy: int  # other runnable processes seen when choosing (0 when not measured)
    reason: str  # one line for the console
    asked: int | None = None  # a --threads above the usable cores, clamped to them

    @property
    def clamped(self) -> bool:
        return self.asked is not None

    def to_dict(self) -> dict:
        return asdict(self)


def prepare_process() -> None:
    """Set the thread-pool environment defaults (``PROCESS_ENV``) unless the user set them.
    Call before torch or TVM is imported; later calls change nothing for libraries already loaded."""
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _quota_cores() -> int | None:
    """A cgroup v2 CPU quota (``cpu.max``: quota period) as whole cores, None without one."""
    text = _read("/sys/fs/cgroup/cpu.max")
    if not text:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        return max(1, math.ceil(int(parts[0]) / int(parts[1])))
    except (ValueError, ZeroDivisionError):
        return None


def _physical(cpus: list[int]) -> list[int]:
    """One logical CPU per physical core (SMT siblings share a core's arithmetic units)."""
    seen, out = set(), []
    for c in cpus:
        sib = _read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        key = sib.strip() if sib else str(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _big_cores(cpus: list[int]) -> list[int]:
    """On big.LITTLE (phones): the cores whose top frequency is within 25 % of the fastest.
    A thread on a little core holds back every parallel region it is part of."""
    freq = {}
    for c in cpus:
        text = _read(f"/sys/devices/system/cpu/cpu{c}/cpufreq/cpuinfo_max_freq")
        if text and text.strip().isdigit():
            freq[c] = int(text.strip())
    if len(freq) != len(cpus) or not freq:
        return cpus
    top = max(freq.values())
    return [c for c in cpus if freq[c] >= 0.75 * top]


def usable_cores() -> int:
    """Cores this process may use: affinity, cgroup quota, physical cores, big cores."""
    cpus = _allowed_cpus()
    cores = len(_big_cores(_physical(cpus)))
    quota = _quota_cores()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def other_runnable(samples: int = 7, interval_s: float = 0.01) -> int:
    """Other processes' runnable threads right now, on the CPUs this process may use: the median
    of ``procs_running`` (/proc/stat, machine-wide, this process's own thread included) over a
    few samples, minus this process, scaled to the share of CPUs it may run on. 0 where
    /proc/stat cannot be read (Android apps, macOS)."""
    values = []
    for i in range(samples):
        text = _read("/proc/stat")
        if text is None:
            return 0
        for line in text.splitlines():
            if line.startswith("procs_running"):
                values.append(int(line.split()[1]))
                break
        if i + 1 < samples:
            time.sleep(interval_s)
    if not values:
        return 0
    values.sort()
    others = max(0, values[len(values) // 2] - 1)
    total = os.cpu_count() or 1
    allowed = len(_allowed_cpus())
    if allowed < total:  # the count is machine-wide; only a share of it runs on our CPUs
        others = round(others * allowed / total)
    return others


def default_threads() -> int:
    """The thread count a run uses when the user gives none (see the module docstring)."""
    return _default_choice().count


def _default_choice() -> ThreadChoice:
    cores = usable_cores()
    busy = other_runnable()
    count = max(1, cores - busy)
    why = (f"{cores} core{'s' if cores != 1 else ''}"
           + (f", {busy} busy with other work" if busy else ", none busy"))
    return ThreadChoice(count=count, source="default", cores=cores, busy=busy, reason=why)


def choose_threads(requested: int | None) -> ThreadChoice:
    """The user's ``--threads`` when given (≥ 1; above the usable cores: clamped to them), else the
    default."""
    if requested is not None:
        if requested < 1:
            from .errors import InputError

            raise InputError(f"--threads {requested}: give a thread count of 1 or more, or leave it out "
                             f"for the default (the free cores)")
        cores = usable_cores()
        if requested > cores:
            return ThreadChoice(count=cores, source="--threads", cores=cores, busy=0, asked=int(requested),
                                reason=f"--threads {requested} clamped to the {cores} usable core"
                                       f"{'s' if cores != 1 else ''}")
        return ThreadChoice(count=int(requested), source="--threads", cores=cores, busy=0, reason="--threads")
    return _default_choice()


def apply_threads(n: int) -> dict:
    """Use ``n`` threads in torch and in TVM's runtime (this process), and in the processes it
    starts (``OMP_NUM_THREADS``, ``TVM_NUM_THREADS``). Returns what each runtime now uses."""
    n = max(1, int(n))
    os.environ["TVM_NUM_THREADS"] = str(n)  # read when TVM's pool is created
    os.environ["OMP_NUM_THREADS"] = str(n)  # child processes (bench workers, simulate children)
    used = {}
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)
        used["torch"] = torch.get_num_threads()
    if "tvm" in sys.modules:
        used["tvm"] = _configure_tvm(n)
    return used


def _configure_tvm(n: int) -> int | None:
    """Set TVM's pool to n workers (created now, from TVM_NUM_THREADS, if it was not yet);
    returns the count TVM reports (lower than n when the pool was made smaller earlier)."""
    try:
        import tvm

        config = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
        num = tvm.get_global_func("runtime.NumThreads", allow_missing=True)
        if config is not None:
            config(1, n)  # 1 = the big cores (all cores on a uniform CPU), n workers
        return int(num()) if num is not None else None
    except Exception:  # noqa: BLE001 - a TVM without these functions keeps its own default
        return None


def threads_in_use() -> dict:
    """What the loaded runtimes use now (for reports)."""
    used = {}
    if "torch" in sys.modules:
        import torch

        used["torch"] = torch.get_num_threads()
    if "tvm" in sys.modules:
        try:
            import tvm

            used["tvm"] = int(tvm.get_global_func("runtime.NumThreads")())
        except Exception:  # noqa: BLE001
            pass
    return used
