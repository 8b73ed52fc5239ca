"""Errors raised while finding or loading a model; each message says how to fix it."""


class ModelError(ValueError):
    """The model the user named cannot be found, read, or is not supported."""
