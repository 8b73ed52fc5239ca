"""Compiling Gemma 3 is refused, clearly and before any work, until the compiled path has per-layer
cache kinds (the eager engine has them): never a half-working artifact."""

from __future__ import annotations

import pytest

from edgekv.compiler.errors import CompileError
from edgekv.models import tiny_gemma3_model
from edgekv.policies import make_policy


def test_compile_refuses_sliding_window_layers(tmp_path):
    from edgekv.compiler import compile_model

    model = tiny_gemma3_model(0)
    out = tmp_path / "art"
    with pytest.raises(CompileError, match="compiling Gemma 3's sliding-window layers is not supported yet") as info:
        compile_model(model, make_policy("keydiff", {}), 32, 8, "host", out)
    assert "edgekv run" in str(info.value) and "ring of window + B" in str(info.value)
    assert not out.exists() or not any(out.iterdir())


def test_plain_forward_refuses_too():
    from edgekv.compiler.frontend.export import plain_module

    with pytest.raises(CompileError, match="sliding-window layers"):
        plain_module(tiny_gemma3_model(0))
