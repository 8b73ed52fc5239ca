"""Device targets (CUDA, OpenCL, Metal, Hexagon, Android CPU) build complete artifacts here,
with every kernel generated for the device, the eviction kernels present by name, and static
shapes. Nothing runs on a device (see device_tests/ for that)."""

from __future__ import annotations

import json
import re
import tarfile

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.compiler import compile_model, import_model, resolve_target  # noqa: E402
from edgekv.compiler.backend.device_code import elf_machine, host_functions_on_host  # noqa: E402
from edgekv.compiler.backend.gpu_schedule import GPUKernelError, ReplaceKernels, demote_float64, unbound_functions  # noqa: E402
from edgekv.compiler.backend.target import PROFILE_DIR  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies.dapq import DapQPolicy  # noqa: E402
from edgekv.policies.full import FullPolicy  # noqa: E402
from edgekv.policies.h2o import H2OPolicy  # noqa: E402
from edgekv.policies.snapkv import SnapKVPolicy  # noqa: E402
from edgekv.policies.snapkv_pp import SnapKVPlusPlusPolicy  # noqa: E402
from edgekv.policies.tova import TOVAPolicy  # noqa: E402
from edgekv.policies.keydiff import KeyDiffPolicy  # noqa: E402
from edgekv.policies.lagkv import LagKVPolicy  # noqa: E402
from edgekv.policies.streaming import StreamingPolicy  # noqa: E402

B = 8
N = 16
GPU = ("cuda", "opencl", "metal")
SOURCE = {"cuda": "kernels.cu", "opencl": "kernels.cl", "metal": "kernels.metal"}


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(0)


@pytest.fixture(scope="module")
def imported(model):
    return import_model(model, B)


def _fast(name: str) -> dict:
    """The profile with LLVM at opt-level 0 (these tests check placement, not speed: the
    Hexagon/AArch64 backends take ~30-50 s per module otherwise)."""
    profile = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    for key in ("target", "host"):
        if key in profile and profile[key].get("kind") == "llvm":
            profile[key] = {**profile[key], "opt-level": 0}
    return profile


_BUILDS: dict = {}


def _build(model, imported, tmp_path_factory, target, policy=None, budget=N):
    policy = policy or KeyDiffPolicy()
    key = (target, repr(policy), budget)
    if key not in _BUILDS:
        out = tmp_path_factory.mktemp(f"{target}_{policy.name}")
        _BUILDS[key] = (compile_model(model, policy, budget, B, _fast(target), out, imported=imported), out)
    return _BUILDS[key]


@pytest.mark.parametrize("target", ["cuda", "opencl", "metal", "hexagon", "android-cpu", "aarch64-linux"])
def test_profiles_resolve(target):
    profile, tgt = resolve_target(target)
    host = profile.get("host")
    assert profile["name"] == target
    t = tvm.target.Target(tgt, host=host) if host else tvm.target.Target(tgt)
    assert t.kind.name == tgt["kind"]
    assert "toolchain" in profile


@pytest.mark.parametrize("target", GPU)
def test_gpu_artifact_all_on_device(model, imported, tmp_path_factory, target):
    res, out = _build(model, imported, tmp_path_factory, target)
    m = json.loads((out / "manifest.json").read_text())
    assert {p.name for p in out.iterdir()} >= {"manifest.json", "params.safetensors", "model.tar", "device"}
    assert m["files"]["library"]["name"] == "model.tar"
    from edgekv.artifact.manifest import Manifest, undefined_keys

    assert undefined_keys(m) == [] and Manifest.from_json(m).device  # device builds: manifest.py defines every key
    if target == "opencl":  # the native runtime's OpenCL device runs it: a program with its device kernels
        from edgekv.artifact import program_file as pf

        prog = pf.read(out / "program.ekv")
        assert prog.settings["device"] == "opencl" and prog.settings["device_source_name"] == "device/kernels.cl"
        kernels = {k.name for k in prog.device_kernels}
        assert kernels == set(re.findall(r"__kernel\s+void\s+(\w+)\s*\(", (out / "device" / "kernels.cl").read_text()))
        assert any(k.flags & pf.DKERNEL_EVICTION for k in prog.device_kernels)
        assert not all(k.flags & pf.DKERNEL_EVICTION for k in prog.device_kernels)
    else:  # CUDA, Metal: the native runtime has no device for them, so no program
        assert "program" not in m["files"] and not (out / "program.ekv").exists()
    dev = m["device"]
    # every PrimFunc of the built module is a device kernel ...
    funcs = dev["device_functions"]
    assert len(funcs) > 20
    src = (out / "device" / SOURCE[target]).read_text()
    for f in funcs:
        assert re.search(rf"\b{re.escape(f)}_kernel\w*\s*\(", src), f"{f} has no {target} kernel"
    # ... and the host code runs none itself (no CPU loops, no parallel lambdas)
    assert host_functions_on_host(res.executable) == []
    # the edgekv kernels were replaced by the thread-bound versions, for both functions
    kinds = dev["edgekv_kernels"]
    assert sorted(set(kinds.values())) == ["attention", "score", "select"]
    for fn in ("prefill_block", "decode"):
        assert re.search(rf"\b{fn}_score_keydiff_h2_d16_kernel\w*\(", src)
        assert re.search(rf"\b{fn}_select_h2_d16_score_kernel\w*\(", src)
        assert re.search(rf"\b{fn}_attention_h4_2_d16_kernel\w*\(", src)
    # static shapes: no symbolic dims in any kernel
    assert dev["symbolic_shapes"] == {}
    assert dev["code"][SOURCE[target]] == len(src.encode())
    if target != "cuda":
        assert dev["float64_demoted"] and "double" not in src
    tool = dev["toolchain"]
    assert tool["status"] == ("complete" if target == "cuda" else "needs-toolchain")


@pytest.mark.parametrize("target,machine", [("hexagon", 164), ("android-cpu", 183)])
def test_llvm_cross_artifact(model, imported, tmp_path_factory, target, machine):
    res, out = _build(model, imported, tmp_path_factory, target)
    m = json.loads((out / "manifest.json").read_text())
    assert m["device"]["elf_machine"] == [machine]  # 164 = QUALCOMM DSP6, 183 = AArch64
    assert m["device"]["toolchain"]["status"] == "needs-toolchain"
    with tarfile.open(out / "model.tar") as tf:
        objs = {mm.name: tf.extractfile(mm).read() for mm in tf.getmembers() if mm.name.endswith(".o")}
    assert objs and all(elf_machine(o) == machine for o in objs.values())
    # CPU cross builds carry the native runtime's program, for their architecture
    from edgekv.artifact import program_file

    settings = program_file.read(out / "program.ekv").settings
    assert settings["target_arch"] == {164: "hexagon", 183: "aarch64"}[machine]
    assert settings["library_name"] == "model.tar" and settings["cpu_features"] == ""
    blob = b"".join(objs.values())
    for fn in ("prefill_block", "decode"):
        for k in (b"_score_keydiff_h2_d16", b"_select_h2_d16_score", b"_attention_h4_2_d16"):
            assert fn.encode() + k in blob


@pytest.mark.parametrize("policy", [LagKVPolicy(sinks=2, lag=4), FullPolicy(),
                                    pytest.param(StreamingPolicy(sinks=2), marks=pytest.mark.slow)],
                         ids=["lagkv", "full", "streaming"])
def test_other_policies_on_gpu(model, imported, tmp_path_factory, policy):
    budget = 64 if policy.name == "full" else N
    res, out = _build(model, imported, tmp_path_factory, "opencl", policy, budget)
    dev = res.manifest["device"]
    src = (out / "device" / "kernels.cl").read_text()
    for f in dev["device_functions"]:
        assert re.search(rf"\b{re.escape(f)}_kernel\w*\s*\(", src), f
    if policy.name == "full":
        assert "prefill_block_select_h2_d16_append_kernel" in src and "score" not in "".join(dev["edgekv_kernels"])
    else:
        assert f"prefill_block_score_{policy.name}_h2_d16_kernel" in src
    assert dev["symbolic_shapes"] == {}


DAPQ = DapQPolicy(window=4, prefix=1)


@pytest.fixture(scope="module")
def imported_dapq(model):
    """DapQ's prefill step runs B + window rows (the pseudo rows last)."""
    return import_model(model, B, DAPQ.window)


@pytest.mark.parametrize("target", list(GPU) + ["hexagon"])
def test_dapq_on_device_targets(model, imported_dapq, tmp_path_factory, target):
    """DapQ builds completely for the GPUs and the NPU: every function on the device, its attention
    with pseudo rows and its score kernel (which reads the queries) in the generated code, static shapes."""
    res, out = _build(model, imported_dapq, tmp_path_factory, target, DAPQ)
    dev = res.manifest["device"]
    assert res.manifest["extra_rows"] == DAPQ.window
    if target == "hexagon":
        with tarfile.open(out / "model.tar") as tf:
            blob = b"".join(tf.extractfile(m).read() for m in tf.getmembers() if m.name.endswith(".o"))
        for k in (b"prefill_block_score_dapq_h4_2_d16", b"decode_score_dapq_h4_2_d16", b"prefill_block_attention_h4_2_d16_x4",
                  b"prefill_block_select_h2_d16_score"):
            assert k in blob
        assert dev["elf_machine"] == [164]
        return
    src = (out / "device" / SOURCE[target]).read_text()
    for f in dev["device_functions"]:
        assert re.search(rf"\b{re.escape(f)}_kernel\w*\s*\(", src), f"{f} has no {target} kernel"
    assert host_functions_on_host(res.executable) == []
    assert sorted(set(dev["edgekv_kernels"].values())) == ["attention", "score", "select"]
    for name in ("prefill_block_score_dapq_h4_2_d16", "decode_score_dapq_h4_2_d16", "prefill_block_attention_h4_2_d16_x4",
                 "decode_attention_h4_2_d16", "prefill_block_select_h2_d16_score"):
        assert re.search(rf"\b{name}_kernel\w*\(", src), name
    assert dev["symbolic_shapes"] == {}


QUERY_POLICIES = {"snapkv": SnapKVPolicy(window=4, kernel=3), "snapkvpp": SnapKVPlusPlusPolicy(window=4),
                  "tova": TOVAPolicy(), "h2o": H2OPolicy()}


@pytest.mark.parametrize("target", GPU)
@pytest.mark.parametrize("tag", list(QUERY_POLICIES))
def test_query_policies_on_gpu(model, imported, tmp_path_factory, target, tag):
    """SnapKV, SnapKV++, TOVA and H2O: complete GPU artifacts, every function on the device, the
    policy's score (and H2O's observe) kernels and the state-carrying select in the source, static
    shapes; H2O's state cache is in the manifest and the memory plan."""
    if target != "opencl" and tag in ("snapkvpp", "tova"):
        pytest.skip("same kernel builder as snapkv on this target (opencl covers every policy)")
    policy = QUERY_POLICIES[tag]
    res, out = _build(model, imported, tmp_path_factory, target, policy, N)
    m = json.loads((out / "manifest.json").read_text())
    dev = m["device"]
    src = (out / "device" / SOURCE[target]).read_text()
    for f in dev["device_functions"]:
        assert re.search(rf"\b{re.escape(f)}_kernel\w*\s*\(", src), f"{f} has no {target} kernel"
    assert host_functions_on_host(res.executable) == []
    state = tag == "h2o"
    want = ["attention", "score", "select"] + (["observe"] if state else [])
    assert sorted(set(dev["edgekv_kernels"].values())) == sorted(want)
    for fn in ("prefill_block", "decode"):
        assert re.search(rf"\b{fn}_score_{tag}_h4_2_d16_kernel\w*\(", src)
        assert re.search(rf"\b{fn}_select_h2_d16_score{'_s1' if state else ''}_kernel\w*\(", src)
        if state:
            assert re.search(rf"\b{fn}_observe_h2o_h4_2_d16_kernel\w*\(", src)
    assert dev["symbolic_shapes"] == {}
    if state:
        assert m["entry_state"] == ["h2o_acc"] and all(c["state"] == [1, 2, N] for c in m["cache"])
        kv = len(m["cache"]) * (2 * 2 * N * 16 * 4 + 2 * N * 4 + 4)
        assert m["memory_plan"]["cache_bytes"] == kv + len(m["cache"]) * 2 * N * 4


def test_query_policy_on_hexagon(model, imported, tmp_path_factory):
    res, out = _build(model, imported, tmp_path_factory, "hexagon", H2OPolicy(), N)
    with tarfile.open(out / "model.tar") as tf:
        blob = b"".join(tf.extractfile(mm).read() for mm in tf.getmembers() if mm.name.endswith(".o"))
    for fn in ("prefill_block", "decode"):
        for k in (b"_score_h2o_h4_2_d16", b"_observe_h2o_h4_2_d16", b"_select_h2_d16_score_s1"):
            assert fn.encode() + k in blob


def test_unbound_kernels_are_refused(model, imported):
    """Without the replacement the CPU kernels have no thread binding: the check names them."""
    from edgekv.compiler import BlockCacheSpec
    from edgekv.compiler.pipeline import lower_module

    mod, _, _ = lower_module(imported[0], BlockCacheSpec(budget=N, policy="streaming", policy_params={"sinks": 2}))
    bad = unbound_functions(mod)
    assert "prefill_block_attention_h4_2_d16" in bad and "decode_select_h2_d16_score" in bad
    with pytest.raises(GPUKernelError, match="no GPU score kernel"):  # a policy name with no GPU kernel
        ReplaceKernels("nogpu", {}, {}).transform_module(
            tvm.IRModule({"prefill_block_score_nogpu_h2_d16": mod["prefill_block_score_streaming_h2_d16"]}), None)


def test_float64_demotion_keeps_results(model, imported):
    """The fp64 → fp32 rewrite used for Metal/OpenCL, run on the host against the engine:
    same kept positions, logits within 1e-3."""
    from edgekv.engine import BlockEngine
    from edgekv.runtime import HostRuntime

    policy = KeyDiffPolicy()
    # built as a device build for this CPU (a profile with its own host target): its manifest
    # has the device section that records the demotion
    profile = {"name": "host-fp32-rope", "target": {"kind": "llvm", "opt-level": 0}, "host": {"kind": "llvm"},
               "demote_float64": True}
    res = compile_model(model, policy, N, B, profile, imported=imported)
    assert res.manifest["device"]["float64_demoted"]
    rt = HostRuntime.from_executable(res.executable, res.manifest, res.params)
    eng = BlockEngine(model, policy, N, B)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    for s in range(0, 40, B):
        chunk = prompt[s:s + B]
        got = rt.step_block(chunk.numpy())
        want = eng.step(chunk).numpy()
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-3
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["keydiff", "dapq"])
def test_cuda_source_compiles_with_nvcc(model, imported, imported_dapq, tmp_path_factory, policy):
    """The generated CUDA C is valid for sm_80 (nvcc, no GPU needed)."""
    import shutil

    from edgekv.compiler.backend.device_code import check_cuda_source

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    if policy == "dapq":
        res, out = _build(model, imported_dapq, tmp_path_factory, "cuda", DAPQ)
    else:
        res, out = _build(model, imported, tmp_path_factory, "cuda")
    info = check_cuda_source((out / "device" / "kernels.cu").read_text(), "sm_80")
    assert info["cubin_bytes"] > 10_000


def test_finish_links_with_the_named_toolchain(model, imported, tmp_path_factory, tmp_path, monkeypatch):
    """``backend.finish.finish`` hands the tar's objects to the compiler named by the profile's env
    variable (a stand-in that records its arguments) and records model.so in the manifest."""
    import shutil
    import sys

    from edgekv.compiler import CompileError
    from edgekv.compiler.backend.finish import finish

    _, out = _build(model, imported, tmp_path_factory, "android-cpu")
    art = tmp_path / "art"
    shutil.copytree(out, art)
    monkeypatch.delenv("TVM_NDK_CC", raising=False)
    with pytest.raises(CompileError, match="TVM_NDK_CC"):
        finish(art)
    fake = tmp_path / "fakecc.py"
    fake.write_text("import sys, json\nargs = sys.argv[1:]\no = args[args.index('-o') + 1]\n"
                    "open(o, 'w').write(json.dumps(args))\n")
    monkeypatch.setenv("TVM_NDK_CC", f"{sys.executable} {fake}")
    so = finish(art)
    args = json.loads(so.read_text())
    assert "-shared" in args and any(a.endswith("lib0.o") for a in args)
    m = json.loads((art / "manifest.json").read_text())
    assert m["files"]["library"]["name"] == "model.so" and m["device"]["toolchain"]["status"] == "finished"
    # the program (a CPU cross build has one) now names model.so with its size and CRC-32, and
    # the manifest's hashes follow both files; the tar stays and a second finish relinks it
    from edgekv.artifact import crc32_file, program_file, sha256_file

    settings = program_file.read(art / "program.ekv").settings
    assert (settings["library_name"], settings["library_bytes"], settings["library_crc32"]) == \
        ("model.so", so.stat().st_size, crc32_file(so))
    assert m["files"]["program"]["sha256"] == sha256_file(art / "program.ekv")
    assert m["files"]["library"]["sha256"] == sha256_file(so)
    # the command that artifacts compiled before the compiler moved into stages record still finishes
    import subprocess

    legacy = subprocess.run([sys.executable, "-m", "edgekv.compiler.targets", "finish", str(art)],
                            capture_output=True, text=True)
    assert legacy.returncode == 0 and "wrote" in legacy.stdout, legacy.stderr
    assert m["files"]["library_objects"]["name"] == "model.tar"
    assert finish(art) == so


@pytest.mark.parametrize("target", ["opencl", pytest.param("cuda", marks=pytest.mark.slow),
                                    pytest.param("metal", marks=pytest.mark.slow), "hexagon"])
def test_d2o_on_device_targets(model, imported, tmp_path_factory, target):
    """D2O wires its own kernels (score with the queries, merge-on-evict + compaction with its
    state): their GPU versions replace them, everything runs on the device, shapes are static."""
    from edgekv.policies.d2o import D2OPolicy

    res, out = _build(model, imported, tmp_path_factory, target, D2OPolicy())
    dev = res.manifest["device"]
    names = (b"_d2o_score_h4_2_d16_s4", b"_d2o_evict_h2_d16")
    if target == "hexagon":
        with tarfile.open(out / "model.tar") as tf:
            blob = b"".join(tf.extractfile(mm).read() for mm in tf.getmembers() if mm.name.endswith(".o"))
        assert dev["elf_machine"] == [164]
        for fn in ("prefill_block", "decode"):
            assert all(fn.encode() + k in blob for k in names)
        return
    src = (out / "device" / SOURCE[target]).read_text()
    for f in dev["device_functions"]:
        assert re.search(rf"\b{re.escape(f)}_kernel\w*\s*\(", src), f"{f} has no {target} kernel"
    assert host_functions_on_host(res.executable) == []
    # the per-prompt probe's kernels (prepare) are built where a runtime runs them: OpenCL
    assert sorted(set(dev["edgekv_kernels"].values())) == (
        ["attention", "prepare", "score", "select"] if target == "opencl" else ["attention", "score", "select"])
    for fn in ("prefill_block", "decode"):
        for k in names:
            assert re.search(rf"\b{fn}{k.decode()}_kernel\w*\(", src), f"{fn}{k.decode()} missing"
    assert dev["symbolic_shapes"] == {}
    if target != "cuda":
        assert dev["float64_demoted"] and "double" not in src
