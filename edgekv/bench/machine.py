"""Where a results file was measured: CPU, cores, load, versions and the commit."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine_info() -> dict:
    """What a results file records about where it was measured."""
    import torch

    from ..evaluation.report import git_commit

    full = git_commit(Path(__file__).resolve().parents[1]) or ""  # "<hash>[-dirty]", as eval records it
    commit = full[:7] + ("-dirty" if full.endswith("-dirty") else "")
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "commit": commit}
