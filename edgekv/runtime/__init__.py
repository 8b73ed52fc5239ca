"""Host runtime for compiled edgekv artifacts (TVM Relax VM)."""

from .host import ArtifactError, HostRuntime, RuntimeStats, is_artifact, read_manifest, verify_artifact

__all__ = ["ArtifactError", "HostRuntime", "RuntimeStats", "is_artifact", "read_manifest", "verify_artifact"]
