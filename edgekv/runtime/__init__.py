"""Runtimes for compiled edgekv artifacts: ``HostRuntime`` (TVM's Relax VM, in Python) and
``NativeRuntime`` (the C runtime in ``runtime/`` through ctypes; no TVM in the process)."""

from ..artifact import ArtifactError, Manifest, is_artifact, verify_artifact
from .host import HostRuntime, RuntimeStats

__all__ = ["ArtifactError", "HostRuntime", "Manifest", "RuntimeStats", "is_artifact", "verify_artifact"]
