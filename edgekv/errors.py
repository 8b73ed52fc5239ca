"""User-facing errors: each names what the user did and how to fix it. The CLI prints
them without a traceback and exits with status 2."""

from .artifact.snapshot_file import SnapshotError
from .budget import BudgetError
from .memory import MemoryPlanError
from .models.errors import ModelError
from .policies.base import PolicyError
from .units import SizeError


class InputError(ValueError):
    """A prompt, path or option the user gave cannot be used."""


USER_ERRORS = (BudgetError, SizeError, ModelError, PolicyError, InputError, MemoryPlanError, SnapshotError)
