"""What the compiler raises and warns: a leaf module every stage imports (no stage imports another
for its error type)."""

from __future__ import annotations


class CompileError(ValueError):
    """Compilation cannot proceed; the message says why and what to change."""


class ToolchainNeededWarning(UserWarning):
    """The artifact is written, but a toolchain that is not here must link it for the device."""
