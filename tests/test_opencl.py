"""The OpenCL path end to end (issue 19): an artifact compiled for OpenCL with this machine as its
host (``--target opencl-host``) runs in the native runtime's OpenCL device — here on PoCL, OpenCL
on the CPU — and agrees with the CPU artifact of the same model, policy, N and B: the kept
positions of every layer after every block, the last-token logits (1e-4 relative) and 32 greedy
tokens. Then what goes wrong: no OpenCL, a kernel source that does not build, a device with less
memory than the plan, an artifact whose parts disagree — each a clear error.

Needs an OpenCL platform: `apt-get install pocl-opencl-icd` (and `opencl-c-headers` for the
runtime's build); the tests skip, saying so, without one."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
# policies without GPU kernels (rocketkv) are refused for GPU targets (tests/test_compiler_rocketkv.py)
from edgekv.compiler.policy_kernels import gpu_policy_names  # noqa: E402
from edgekv.runtime import native  # noqa: E402

B, N = 8, 24
PROMPT = [int(x) for x in np.random.default_rng(3).integers(1, 250, 70)]
SETUP = {"full": ({}, 128), "lagkv": ({"sinks": 2, "lag": 4}, N), "dapq": ({"window": 4}, N)}
# the default suite runs one policy of each kind of compiled eviction on the device: a score from
# the keys alone (keydiff), a stateful score from the block's attention (h2o, whose attention-score
# kernels SnapKV, SnapKV++ and TOVA share) and a policy with its own kernels and per-prompt
# function (d2o); `-m slow` runs this same test for every other policy (snapkv, dapq's pseudo rows,
# ...). By default SnapKV's and DapQ's OpenCL builds are still checked in
# tests/test_compiler_targets.py (test_query_policies_on_gpu, test_dapq_on_device_targets), and
# DapQ's pseudo-row attention runs on PoCL against its CPU twin in tests/test_gpu_parallel_kernels.py.
FAST = ("keydiff", "h2o", "d2o")


def opencl_skip_reason() -> str | None:
    if not native.available():
        return "the native runtime is not built (pip install -e .)"
    reason = native.opencl_unavailable_reason()
    return reason


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=1, layers=2)


@pytest.fixture(scope="module")
def need_opencl():
    reason = opencl_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def pairs(model, shared_artifact):
    """policy → (CPU artifact, OpenCL artifact) of the tiny model, each built once per session
    (KeyDiff's are also tests/test_opencl_source.py's and tests/test_opencl_teardown.py's)."""

    def get(name):
        args, budget = SETUP.get(name, ({}, N))
        cpu = {"kind": "llvm", "opt-level": 0, "num-cores": 2}
        return tuple(shared_artifact(model, make_policy(name, args), budget, B, target) for target in (cpu, "opencl-host"))

    return get


def run_blocks(art):
    rt = native.NativeRuntime(art)
    kept = []
    logits = rt.prefill(PROMPT, on_block=lambda r: kept.append([r.kept_positions(i) for i in range(r.num_layers)]))
    rt.reset()
    ids = rt.generate(PROMPT, 32)
    info, stats = rt.info, rt.stats
    rt.close()
    return kept, logits, ids, info, stats


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in gpu_policy_names()])
def test_opencl_artifact_agrees_with_the_cpu_artifact(need_opencl, pairs, name):
    cpu, ocl = pairs(name)
    kept_cpu, logits_cpu, ids_cpu, _, _ = run_blocks(cpu)
    kept_ocl, logits_ocl, ids_ocl, info, stats = run_blocks(ocl)
    assert info["device"].startswith("opencl: "), info["device"]
    assert len(kept_ocl) == len(kept_cpu) == -(-len(PROMPT) // B)
    for block, (a, b) in enumerate(zip(kept_cpu, kept_ocl)):
        for layer, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_array_equal(np.sort(x, axis=1), np.sort(y, axis=1), err_msg=f"block {block} layer {layer}")
    rel = float(np.abs(logits_ocl - logits_cpu).max() / np.abs(logits_cpu).max())
    assert rel <= 1e-4, rel
    assert ids_ocl == ids_cpu
    # device memory held against the plan: weights, caches and arena, no more
    assert 0 < stats.device_bytes_peak <= info["plan_bytes"] * 1.05, (stats.device_bytes_peak, info["plan_bytes"])


def test_opencl_snapshot_round_trip(need_opencl, pairs, tmp_path):
    """A document's cache saved from the device and loaded back answers as running on does; a second
    model of the same artifact in the process shares its device and agrees too."""
    _, ocl = pairs("keydiff")
    rt = native.NativeRuntime(ocl)
    rt.prefill(PROMPT[:40])
    rt.save_cache(tmp_path / "doc.ekv")
    want = rt.generate(PROMPT[40:], 12)
    again = native.NativeRuntime(ocl)
    again.load_cache(tmp_path / "doc.ekv")
    assert again.generate(PROMPT[40:], 12) == want


def test_opencl_errors(need_opencl, pairs, tmp_path):
    from edgekv.artifact import ArtifactError
    from edgekv.artifact import program_file as pf

    _, ocl = pairs("keydiff")
    # a kernel source that does not build: the build log in the error
    broken = tmp_path / "broken"
    shutil.copytree(ocl, broken)
    src = broken / "device" / "kernels.cl"
    for cached in src.parent.glob("kernels.cl.*.bin"):
        cached.unlink()
    # every kernel broken: a build log longer than a fixed buffer (read whole, its size asked first)
    text = src.read_text().replace("__kernel void", "__kernel void @")
    src.write_text(text)
    prog = pf.read(broken / "program.ekv")
    from edgekv.artifact import crc32_file

    prog.settings["device_source_bytes"] = src.stat().st_size
    prog.settings["device_source_crc32"] = crc32_file(src)
    pf.write(prog, broken / "program.ekv")
    with pytest.raises(ArtifactError, match="does not build on opencl") as refused:
        native.NativeRuntime(broken)
    assert "error" in str(refused.value).split("does not build on", 1)[1], refused.value  # the driver's log
    # a device with less memory than the plan (PoCL's memory, pretended small by the plan)
    big = tmp_path / "big"
    shutil.copytree(ocl, big)
    prog = pf.read(big / "program.ekv")
    prog.settings["params_bytes"] = 1 << 50
    pf.write(prog, big / "program.ekv")
    with pytest.raises((ArtifactError, MemoryError), match="device memory"):
        native.NativeRuntime(big)
    # the device source from another compile
    other = tmp_path / "other"
    shutil.copytree(ocl, other)
    (other / "device" / "kernels.cl").write_text("__kernel void x(__global float *a) { a[0] = 1.0f; }\n")
    with pytest.raises(ArtifactError, match="kernels.cl"):
        native.NativeRuntime(other)
    # TVM's Python runtime refuses an OpenCL artifact, naming the native one
    from edgekv.runtime import HostRuntime

    with pytest.raises(ArtifactError, match="native runtime"):
        HostRuntime(ocl)


def test_opencl_artifact_without_opencl(pairs, tmp_path):
    """No OpenCL platform at all (an ICD loader that finds no driver), through `edgekv-run` in its
    own process: one error line saying what to install, exit status 2."""
    import subprocess

    if native.cli_path() is None or opencl_skip_reason() == "this runtime was built without OpenCL":
        pytest.skip("edgekv-run with the OpenCL device is not built (apt-get install opencl-c-headers, pip install -e .)")
    _, ocl = pairs("keydiff")
    vendors = tmp_path / "no-vendors"
    vendors.mkdir()
    res = subprocess.run([str(native.cli_path()), str(ocl), "--prompt-ids", "1,2,3"], capture_output=True, text=True,
                         env={"OCL_ICD_VENDORS": str(vendors), "PATH": "/usr/bin:/bin"})  # the driver list: empty
    assert res.returncode == 2, res.stderr
    assert "error: " in res.stderr and "OpenCL" in res.stderr and "pocl-opencl-icd" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_opencl_answers_the_readme_demo_like_the_cpu_artifact(need_opencl, tmp_path):
    """SmolLM2, the README's main job (KeyDiff N = 512): `edgekv-run` on the OpenCL artifact gives
    the CPU artifact's text and token ids, holding no more device memory than the plan; a second
    policy of another kind (D2O: attention-based scores, the per-prompt probe) keeps the same sets."""
    from edgekv.models import load_model
    from tools.experiments import check_opencl

    model = load_model("smollm2-135m")
    d = check_opencl.demo(model, tmp_path)
    assert d["text_equal"] and d["ids_equal"], (d["cpu_text"], d["opencl_text"])
    assert d["device"].startswith("opencl") and 0 < d["device_bytes_peak"] <= d["plan_bytes"]
    from edgekv.corpus import natural_text

    ids = model.tokenizer(natural_text())["input_ids"][:384]
    row = check_opencl.agree(model, "d2o", 128, 128, ids, 8, tmp_path)
    blocks, layers = row["kept_identical"].split("/")
    assert blocks == layers and row["greedy_identical"] and row["logits_rel_diff"] <= 1e-4, row
