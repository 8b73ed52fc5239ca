"""Runtimes for compiled edgekv artifacts: ``HostRuntime`` (TVM's Relax VM, in Python) and
``NativeRuntime`` (the C runtime in ``runtime/`` through ctypes; no TVM in the process)."""

from ..artifact import ArtifactError, Manifest, is_artifact, read_manifest, verify_artifact
from .host import HostRuntime, RuntimeStats

# read_manifest (the manifest as a dict) stays until job.py and cli/run.py read a Manifest
__all__ = ["ArtifactError", "HostRuntime", "Manifest", "RuntimeStats", "is_artifact", "read_manifest",
           "verify_artifact"]
