"""The CUDA artifact run on an NVIDIA GPU, held against the host engine (the oracle):
per block and decode step, last-token logits within 1e-3 and identical kept positions.

Skips with its reason when TVM sees no CUDA device or cannot compile CUDA C here (TVM compiles
the artifact's embedded CUDA source on load: NVRTC from ``pip install cuda-python``, or nvcc
on PATH — then this test sets TVM_CUDA_COMPILE_MODE=nvcc)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from device_runtime import DeviceRuntime  # noqa: E402
from edgekv.compiler import compile_model, import_model  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies.keydiff import KeyDiffPolicy  # noqa: E402
from edgekv.policies.lagkv import LagKVPolicy  # noqa: E402
from edgekv.policies.streaming import StreamingPolicy  # noqa: E402


def _why_not() -> str | None:
    try:
        if not tvm.cuda(0).exist:
            return "TVM sees no CUDA device (tvm.cuda(0).exist is False)"
    except Exception as e:  # noqa: BLE001 - runtime built without CUDA
        return f"TVM's CUDA runtime is unavailable: {e}"
    try:
        import cuda.bindings  # noqa: F401 - NVRTC
    except ImportError:
        if shutil.which("nvcc") is None:
            return "neither NVRTC (pip install cuda-python) nor nvcc is available to compile the CUDA kernels"
        os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    return None


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

B = 8
PROMPT = 45


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def imported(model):
    return import_model(model, B)


@pytest.mark.parametrize("policy,budget", [
    (KeyDiffPolicy(), 13), (KeyDiffPolicy(recent_window=4), 16), (StreamingPolicy(sinks=2), 16),
    (LagKVPolicy(sinks=2, lag=4), 16),
])
def test_cuda_matches_engine(model, imported, tmp_path, policy, budget):
    compile_model(model, policy, budget, B, "cuda", tmp_path / "art", imported=imported)
    rt = DeviceRuntime.load(tmp_path / "art", tvm.cuda(0))
    eng = BlockEngine(model, policy, budget, B)
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))
    for s in range(0, PROMPT, B):
        chunk = prompt[s: s + B]
        got = rt.step_block(chunk.numpy())
        want = eng.step(chunk).numpy()
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-3, f"block at {s}"
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy(),
                                          err_msg=f"block at {s}, layer {layer}")
    logits = got
    for _ in range(4):
        tok = int(np.argmax(logits))
        logits = rt.decode(tok)
        want = eng.decode(tok).numpy()
        assert np.abs(logits - want).max() / np.abs(want).max() < 1e-3
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())
