"""Host runtime for compiled edgekv artifacts (TVM Relax VM)."""

from .host import ArtifactError, HostRuntime, RuntimeStats, read_manifest, verify_artifact

__all__ = ["ArtifactError", "HostRuntime", "RuntimeStats", "read_manifest", "verify_artifact"]
