"""The Android artifacts (``android-cpu``: arm64 CPU; ``opencl``: Adreno/Mali GPU) run on a
phone over adb + TVM RPC, held against the host engine: per block, last-token logits within
1e-3 and identical kept positions.

What it needs (each missing piece skips the test and says which):
* ``adb`` on PATH and one device in ``adb devices``;
* ``TVM_NDK_CC``: the NDK clang++ that links ``model.tar`` into ``model.so``
  (e.g. ``$NDK/toolchains/llvm/prebuilt/linux-x86_64/bin/aarch64-linux-android28-clang++``);
* ``EDGEKV_TVM_RPC=host:port``: a TVM RPC server running on the phone (TVM's Android RPC app,
  or ``tvm_rpc server`` pushed with adb and reached through ``adb forward tcp:9090 tcp:9090``).
  Its TVM runtime must be the same version as here and built with OpenCL for the opencl case.

The artifact directory is also pushed to ``/data/local/tmp/edgekv/<target>`` so a native runner
can be tried by hand (see README.md)."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from device_runtime import DeviceRuntime  # noqa: E402
from edgekv.compiler import compile_model, import_model  # noqa: E402
from edgekv.compiler.backend.finish import finish  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies.keydiff import KeyDiffPolicy  # noqa: E402


def _why_not() -> str | None:
    if shutil.which("adb") is None:
        return "adb is not on PATH"
    try:
        out = subprocess.run(["adb", "devices"], capture_output=True, text=True, timeout=20).stdout
    except Exception as e:  # noqa: BLE001
        return f"adb devices failed: {e}"
    if not [l for l in out.splitlines()[1:] if l.strip().endswith("device")]:
        return "no Android device in `adb devices`"
    if not os.environ.get("TVM_NDK_CC"):
        return "TVM_NDK_CC (Android NDK clang++) is not set: model.tar cannot be linked into model.so"
    if not os.environ.get("EDGEKV_TVM_RPC"):
        return "EDGEKV_TVM_RPC=host:port of a TVM RPC server on the phone is not set"
    return None


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
B = 8


@pytest.mark.parametrize("target", ["android-cpu", "opencl"])
def test_android_matches_engine(tmp_path, target):
    from tvm import rpc

    model = tiny_random_model(seed=0, layers=2)
    policy, budget = KeyDiffPolicy(), 16
    art = tmp_path / target
    compile_model(model, policy, budget, B, target, art, imported=import_model(model, B))
    so = finish(art)
    subprocess.run(["adb", "shell", "mkdir", "-p", f"/data/local/tmp/edgekv/{target}"], check=True)
    subprocess.run(["adb", "push", str(art) + "/.", f"/data/local/tmp/edgekv/{target}/"], check=True)
    host, port = os.environ["EDGEKV_TVM_RPC"].rsplit(":", 1)
    remote = rpc.connect(host, int(port))
    remote.upload(str(so))
    lib = remote.load_module(so.name)
    dev = remote.cl(0) if target == "opencl" else remote.cpu(0)
    from safetensors.numpy import load_file
    import json

    manifest = json.loads((art / "manifest.json").read_text())
    rt = DeviceRuntime(lib, manifest, list(load_file(str(art / "params.safetensors")).items()), dev)
    eng = BlockEngine(model, policy, budget, B)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    for s in range(0, 40, B):
        chunk = prompt[s: s + B]
        got = rt.step_block(chunk.numpy())
        want = eng.step(chunk).numpy()
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-3
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())
