"""User-facing errors: each names what the user did and how to fix it. The CLI prints
them without a traceback and exits with status 2.

This module loads nothing heavy (no torch, numpy or TVM): `edgekv --help` and every refusal made
before a model loads import it. ``PolicyError`` and ``SnapshotError`` are declared here for that
reason (``edgekv.policies`` and ``edgekv.artifact.snapshot_file``, which load torch and numpy,
re-export them)."""

from .budget import BudgetError
from .memory import MemoryPlanError
from .models.errors import ModelError
from .units import SizeError


class InputError(ValueError):
    """A prompt, path or option the user gave cannot be used."""


class PolicyError(ValueError):
    """A policy cannot run with the given budget / arguments; the message says how to fix it."""


class SnapshotError(ValueError):
    """A snapshot that cannot be used here: corrupt, truncated, another format, or made for
    other weights / another artifact / other settings. The message says which and what to do."""


USER_ERRORS = (BudgetError, SizeError, ModelError, PolicyError, InputError, MemoryPlanError, SnapshotError)
