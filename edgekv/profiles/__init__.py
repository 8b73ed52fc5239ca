"""Profiles shipped with edgekv as package data (read through ``importlib.resources``, so a
non-editable install has them too):

    targets/<name>.json   compile targets (``edgekv compile --target NAME``; docs/TARGETS.md),
                          read by ``compiler/backend/target.py``
    devices/<name>.json   device classes for ``edgekv simulate --device NAME``
                          (devices/README.md), read by ``simulate/profiles.py``
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def profile_dir(kind: str) -> Path:
    """The folder of the shipped ``targets`` or ``devices`` profiles. edgekv is installed as
    files (a wheel or a checkout, never a zip), so the package resource is a real folder."""
    if kind not in ("targets", "devices"):
        raise ValueError(f"no '{kind}' profiles; there are 'targets' and 'devices'")
    return Path(str(resources.files(__name__).joinpath(kind)))
