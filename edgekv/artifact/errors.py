"""The one error of an artifact directory, apart from the manifest and the readers that raise it."""


class ArtifactError(RuntimeError):
    """The artifact is missing, corrupt, or does not match this installation."""
