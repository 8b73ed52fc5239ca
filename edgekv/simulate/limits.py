"""The enforced memory cap of the child process, and what each mechanism measures.

Preference order for ``auto``:

1. ``cgroup2`` — a child cgroup with ``memory.max`` (and ``memory.swap.max = 0``) under this
   process's own cgroup v2, when the memory controller is delegated and the folder writable.
   Charges what a phone charges: resident anonymous memory plus page cache touched.
   Exceeding it gets the child OOM-killed by the kernel; ``memory.peak`` is the measured peak.
2. ``rlimit-data`` — ``RLIMIT_DATA`` set in the child before anything else is imported.
   Since Linux 4.7 it bounds the private writable virtual memory (``VmData``: heap, anonymous
   mmaps, private writable file mappings such as the mmapped weights, thread stacks),
   reserved or touched; code and read-only mappings are not counted. An allocation past it
   fails (torch: "can't allocate memory"), so VmData never exceeds the cap. It is stricter
   than resident memory for reservations and looser for shared-library code (~0.1 GB here).
3. ``rlimit-as`` — ``RLIMIT_AS`` bounds the whole virtual address space (``VmPeak``), libraries
   and untouched reservations included. Measured here: a tiny model's child peaks at VmPeak
   0.97 GiB against VmData 0.45 GiB and RSS 0.40 GiB; SmolLM2-135M (plan 0.56 GB) at VmPeak
   1.95 GB against VmData 1.07 GB and RSS 1.02 GB. It works, but it caps address space that
   a phone never charges, so it is offered and never chosen by ``auto``.

cgroup v1's ``memory.limit_in_bytes`` is deliberately not used: where it exists (as on the
development box, whose cgroup v2 mount has only the hugetlb controller) its hierarchy
belongs to the sandbox or the init system, not to edgekv.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

MECHANISMS = ("auto", "cgroup2", "rlimit-data", "rlimit-as")

MEASURES = {
    "cgroup2": "cgroup v2 memory.max: resident anonymous memory + page cache of the child (memory.peak)",
    "rlimit-data": "RLIMIT_DATA: the child's private writable virtual memory (VmData: heap, anonymous and "
                   "private writable mappings incl. mmapped weights, reserved or touched; not library code)",
    "rlimit-as": "RLIMIT_AS: the child's whole virtual address space (VmPeak: libraries and untouched "
                 "reservations included; with torch ~0.5-0.9 GB above VmData)",
}
PEAK_FIELD = {"cgroup2": "memory.peak", "rlimit-data": "VmData", "rlimit-as": "VmPeak"}


class LimitError(RuntimeError):
    """The requested mechanism cannot be used on this host; the message says why."""


@dataclass(frozen=True)
class Mechanism:
    name: str
    reason: str  # why this one (and why not the better ones)
    cgroup_parent: str | None = None

    @property
    def measures(self) -> str:
        return MEASURES[self.name]


def _own_cgroup2_dir() -> tuple[Path | None, str]:
    """This process's cgroup v2 folder, or None with the reason."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as exc:
        return None, f"cannot read /proc/self/cgroup ({exc})"
    rel = next((ln.split("::", 1)[1] for ln in lines if ln.startswith("0::")), None)
    if rel is None:
        return None, "no cgroup v2 hierarchy for this process"
    mounts = []
    try:
        for ln in Path("/proc/self/mounts").read_text().splitlines():
            parts = ln.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                mounts.append(Path(parts[1]))
    except OSError:
        pass
    if not mounts:
        return None, "no cgroup2 file system is mounted"
    for m in mounts:
        d = m / rel.lstrip("/")
        if d.is_dir():
            return d, f"cgroup2 at {d}"
    return None, f"this process's cgroup {rel} is not visible under {', '.join(map(str, mounts))}"


def cgroup2_status() -> tuple[Path | None, str]:
    """(folder to create child cgroups in, reason). None when cgroup v2 memory limits are unusable."""
    d, why = _own_cgroup2_dir()
    if d is None:
        return None, why
    controllers = (d / "cgroup.controllers").read_text().split() if (d / "cgroup.controllers").is_file() else []
    if "memory" not in controllers:
        return None, (f"cgroup v2 at {d} has no memory controller (controllers: {' '.join(controllers) or 'none'}); "
                      "the host keeps memory in cgroup v1 or does not delegate it")
    subtree = (d / "cgroup.subtree_control").read_text().split()
    if "memory" not in subtree:
        return None, f"the memory controller is not enabled for child cgroups of {d} (cgroup.subtree_control)"
    if not os.access(d, os.W_OK):
        return None, f"{d} is not writable by this user"
    return d, f"cgroup v2 memory controller delegated at {d}"


def choose(requested: str = "auto") -> Mechanism:
    if requested not in MECHANISMS:
        raise LimitError(f"unknown --mechanism {requested!r}; use one of {', '.join(MECHANISMS)}")
    parent, why = cgroup2_status()
    if requested in ("auto", "cgroup2"):
        if parent is not None:
            return Mechanism("cgroup2", why, str(parent))
        if requested == "cgroup2":
            raise LimitError(f"cgroup v2 memory.max is not usable here: {why}; use --mechanism rlimit-data")
        return Mechanism("rlimit-data", f"cgroup v2 memory.max unavailable ({why}); RLIMIT_DATA instead")
    return Mechanism(requested, "requested with --mechanism")


# ---- in the child ------------------------------------------------------------------------

def apply_in_child(mechanism: str, cap: int, cgroup_dir: str | None = None) -> None:
    """Put the calling (child) process under ``cap`` bytes. Call before importing torch."""
    if mechanism == "rlimit-data":
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    elif mechanism == "rlimit-as":
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    elif mechanism == "cgroup2":
        if cgroup_dir is None:
            raise LimitError("cgroup2 needs the child cgroup folder")
        Path(cgroup_dir, "cgroup.procs").write_text(str(os.getpid()))
    else:
        raise LimitError(f"unknown mechanism {mechanism!r}")


def make_cgroup(parent: str, cap: int) -> Path:
    d = Path(parent) / f"edgekv-sim-{os.getpid()}-{os.urandom(3).hex()}"
    d.mkdir()
    try:
        (d / "memory.max").write_text(str(cap))
        if (d / "memory.swap.max").exists():
            (d / "memory.swap.max").write_text("0")
    except OSError:
        remove_cgroup(d)
        raise
    return d


def cgroup_peak_and_oom(d: Path) -> tuple[int | None, int]:
    peak = None
    if (d / "memory.peak").is_file():
        peak = int((d / "memory.peak").read_text().strip())
    ooms = 0
    if (d / "memory.events").is_file():
        for ln in (d / "memory.events").read_text().splitlines():
            k, _, v = ln.partition(" ")
            if k == "oom_kill":
                ooms = int(v)
    return peak, ooms


def remove_cgroup(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmPeak, VmData, VmRSS, VmHWM, RssAnon, RssFile of a process in bytes ({} when gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for ln in fh:
                k, _, v = ln.partition(":")
                if k in ("VmPeak", "VmSize", "VmData", "VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out
