"""The native runtime (runtime/, C) against HostRuntime (TVM's Relax VM) on the same artifact:
every compiled policy, kept positions after every block, logits, greedy tokens; the
``edgekv-run`` command and ``edgekv run ARTIFACT``; bad input through the user entry points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from edgekv.artifact import PARAMS_FILE, PROGRAM_FILE  # noqa: E402
from edgekv.artifact import program_file as pf  # noqa: E402
from edgekv.compiler import compile_model  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.compiler.policy_kernels import compiled_policy_names  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402
from edgekv.runtime import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available() or native.cli_path() is None,
                                reason="the native runtime is not built: `pip install -e .` builds runtime/ "
                                       "(needs cmake and a C compiler)")

B, N = 4, 12
PROMPT_LEN, NEW_TOKENS = 37, 32
# unoptimised LLVM code compiles ~3x faster; these tests check agreement, not speed
TEST_TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}
# per policy: arguments and budget that make it evict within the prompt
POLICY_SETUP = {"full": ({}, 80), "lagkv": ({"sinks": 2, "lag": 2}, N)}
_ARTIFACTS: dict = {}


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, 256, PROMPT_LEN).tolist()


def artifact(model, name, tmp_path_factory):
    if name not in _ARTIFACTS:
        args, budget = POLICY_SETUP.get(name, ({}, N))
        out = tmp_path_factory.mktemp(f"native-{name}") / "art"
        compile_model(model, make_policy(name, args), budget, B, target=TEST_TARGET, out_dir=out)
        _ARTIFACTS[name] = out
    return _ARTIFACTS[name]


def host_kept_per_block(rt: HostRuntime, ids: list[int]):
    """HostRuntime's prefill, block by block, with every layer's kept positions after each block."""
    rt.prepare(ids)
    kept, logits = [], None
    for s in range(0, len(ids), rt.block):
        logits = rt.step_block(ids[s: s + rt.block])
        kept.append([rt.kept_positions(layer) for layer in range(rt.num_layers)])
    return kept, logits


@pytest.mark.parametrize("name", compiled_policy_names())
def test_native_equals_host_runtime(model, prompt, name, tmp_path_factory):
    art = artifact(model, name, tmp_path_factory)
    host, nat = HostRuntime(art), native.NativeRuntime(art)
    kept_host, logits_host = host_kept_per_block(host, prompt)
    kept_nat = []
    logits_nat = nat.prefill(prompt, on_block=lambda rt: kept_nat.append(
        [rt.kept_positions(layer) for layer in range(rt.num_layers)]))
    assert len(kept_nat) == len(kept_host) == -(-PROMPT_LEN // B)
    for block, (a, b) in enumerate(zip(kept_host, kept_nat)):
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(a[layer], b[layer], err_msg=f"{name}: block {block}, layer {layer}")
    assert max(len(k[0][0]) for k in kept_host) > 0
    rel = float(np.abs(logits_nat - logits_host).max() / np.abs(logits_host).max())
    assert rel <= 1e-5, f"{name}: last-token logits differ by {rel:.2e} relative"
    host.reset()
    nat.reset()
    assert nat.generate(prompt, NEW_TOKENS) == host.generate(prompt, NEW_TOKENS)


def test_every_policy_evicts_in_this_setup(model, prompt, tmp_path_factory):
    """The agreement above is about eviction: with these budgets every evicting policy evicts."""
    for name in compiled_policy_names():
        if name == "full":
            continue
        rt = native.NativeRuntime(artifact(model, name, tmp_path_factory))
        rt.prefill(prompt)
        assert max(rt.cache_lengths()) <= POLICY_SETUP.get(name, ({}, N))[1] < PROMPT_LEN, name


def run_cli(*args, timeout=120):
    return subprocess.run([str(native.cli_path()), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_edgekv_run_command(model, prompt, tmp_path_factory, tmp_path):
    art = artifact(model, "keydiff", tmp_path_factory)
    report = tmp_path / "r.json"
    res = run_cli(art, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", NEW_TOKENS, "--report",
                  report, "--threads", 2)
    assert res.returncode == 0, res.stderr
    r = json.loads(report.read_text())
    host = HostRuntime(art)
    assert r["generated_ids"] == host.generate(prompt, NEW_TOKENS)
    assert r["engine"] == "native" and r["threads"] == 2 and r["prompt_tokens"] == PROMPT_LEN
    assert r["cache_lengths"] == host.cache_lengths()
    plan = r["memory"]["plan"]
    inputs = plan["total_bytes"] - plan["weights_bytes"] - plan["cache_bytes"] - plan["arena_bytes"]
    assert 0 < inputs <= 4096  # tokens, positions, n_valid of each function
    assert plan["weights_bytes"] == (art / PARAMS_FILE).stat().st_size
    assert r["memory"]["weights_mapped_bytes"] == plan["weights_bytes"]
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0


def test_edgekv_run_uses_no_python(model, prompt, tmp_path_factory):
    """edgekv-run starts with an empty environment and nothing but itself: no Python anywhere."""
    art = artifact(model, "streaming", tmp_path_factory)
    res = subprocess.run([str(native.cli_path()), str(art), "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-new-tokens", "4", "--quiet"], capture_output=True, text=True, env={}, timeout=60)
    assert res.returncode == 0, res.stderr
    libs = subprocess.run(["ldd", str(native.cli_path())], capture_output=True, text=True).stdout
    assert "python" not in libs.lower() and "tvm" not in libs.lower(), libs


def test_edgekv_run_artifact_uses_native_runtime(model, prompt, tmp_path_factory, tmp_path):
    """`edgekv run ARTIFACT` picks the native runtime when it is built (--runtime tvm forces the VM)."""
    from typer.testing import CliRunner

    from edgekv.cli import app
    from edgekv.job import open_artifact

    art = artifact(model, "keydiff", tmp_path_factory)
    # the tiny model has no tokenizer: the CLI's artifact path is job.open_artifact
    rt, described = open_artifact(art)
    assert isinstance(rt, native.NativeRuntime) and described.model_id == model.model_id
    rt_tvm, _ = open_artifact(art, runtime="tvm")
    assert isinstance(rt_tvm, HostRuntime)
    res = CliRunner().invoke(app, ["run", str(art), "--prompt", "hi", "--runtime", "bogus"])
    assert res.exit_code == 2


# ---- bad input: each a clear error and exit status 2, never a crash ---------------------------
def _copy(art, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(art, dst)
    return dst


def expect_refusal(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert any(line.startswith("error: ") for line in res.stderr.splitlines()), res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def test_bad_artifacts_are_refused(model, prompt, tmp_path_factory, tmp_path):
    art = artifact(model, "keydiff", tmp_path_factory)
    ids = ",".join(map(str, prompt))
    # no program / not an artifact
    expect_refusal(run_cli(tmp_path, "--prompt-ids", ids), "program.ekv")
    # corrupt program
    bad = _copy(art, tmp_path / "a")
    data = bytearray((bad / PROGRAM_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / PROGRAM_FILE).write_bytes(bytes(data))
    expect_refusal(run_cli(bad, "--check"), "corrupt")
    # truncated params
    bad = _copy(art, tmp_path / "b")
    with open(bad / PARAMS_FILE, "r+b") as f:
        f.truncate((bad / PARAMS_FILE).stat().st_size // 2)
    expect_refusal(run_cli(bad, "--prompt-ids", ids), "truncated")
    # a library from another compile (another policy's model.so)
    bad = _copy(art, tmp_path / "c")
    shutil.copy(artifact(model, "streaming", tmp_path_factory) / "model.so", bad / "model.so")
    expect_refusal(run_cli(bad, "--check"), "model.so")
    # a library for another machine: an aarch64 ELF header
    bad = _copy(art, tmp_path / "d")
    lib = bytearray((bad / "model.so").read_bytes())
    lib[18:20] = (183).to_bytes(2, "little")
    (bad / "model.so").write_bytes(bytes(lib))
    prog = pf.read(bad / PROGRAM_FILE)
    import zlib

    prog.settings["library_crc32"] = zlib.crc32(bytes(lib))
    pf.write(prog, bad / PROGRAM_FILE)
    expect_refusal(run_cli(bad, "--check"), "aarch64")
    # an artifact compiled for another architecture
    prog.settings["target_arch"] = "aarch64"
    pf.write(prog, bad / PROGRAM_FILE)
    expect_refusal(run_cli(bad, "--check"), "compiled for aarch64")
    # CPU features this machine lacks
    bad = _copy(art, tmp_path / "e")
    prog = pf.read(bad / PROGRAM_FILE)
    prog.settings["cpu_features"] = "avx2,quantum-tunnelling"
    pf.write(prog, bad / PROGRAM_FILE)
    expect_refusal(run_cli(bad, "--check"), "quantum-tunnelling")
    # a program that calls a kernel the library does not export
    bad = _copy(art, tmp_path / "f")
    prog = pf.read(bad / PROGRAM_FILE)
    prog.kernels[0] = "no_such_kernel"
    pf.write(prog, bad / PROGRAM_FILE)
    expect_refusal(run_cli(bad, "--check"), "no_such_kernel")
    # a program of a future major version
    bad = _copy(art, tmp_path / "g")
    data = bytearray((bad / PROGRAM_FILE).read_bytes())
    data[8:10] = (2).to_bytes(2, "little")
    (bad / PROGRAM_FILE).write_bytes(bytes(data))
    expect_refusal(run_cli(bad, "--check"), "format 2.")


def test_bad_run_inputs_are_refused(model, prompt, tmp_path_factory, tmp_path):
    art = artifact(model, "keydiff", tmp_path_factory)
    ids = ",".join(map(str, prompt))
    expect_refusal(run_cli(art, "--prompt-ids", "1,,2"), "--prompt-ids")
    expect_refusal(run_cli(art, "--prompt-ids", "999999"), "outside the vocabulary")
    expect_refusal(run_cli(art, "--prompt", "hello"), "no tokenizer")
    expect_refusal(run_cli(art, "--prompt", "   \n"), "empty")
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--temperature", "-1"), "--temperature")
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--top-p", "2"), "--top-p")
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--threads", "0"), "--threads")
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--mem-limit", "lots"), "--mem-limit")
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--mem-limit", "1KiB"), "memory plan")
    # the report path is checked before any work; nothing is written
    report = tmp_path / "missing-dir" / "r.json"
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--report", report), "missing-dir")
    assert not report.parent.exists()
    expect_refusal(run_cli(art, "--prompt-ids", ids, "--report", tmp_path), "directory")
    # past the trained context without the opt-in; accepted with it
    long = ",".join(["5"] * 4090)
    expect_refusal(run_cli(art, "--prompt-ids", long, "--max-new-tokens", 16), "past the model's trained context")
    ok = run_cli(art, "--prompt-ids", long, "--max-new-tokens", 16, "--allow-beyond-context", "--quiet")
    assert ok.returncode == 0, ok.stderr


def test_full_policy_refuses_overflow_natively(model, tmp_path_factory):
    rt = native.NativeRuntime(artifact(model, "full", tmp_path_factory))
    from edgekv.policies.base import PolicyError

    with pytest.raises(PolicyError, match="never evicts"):
        rt.prefill(list(range(1, 100)))


def test_memory_limit_refused_before_allocating(model, tmp_path_factory):
    art = artifact(model, "keydiff", tmp_path_factory)
    with pytest.raises(MemoryError, match="memory plan needs"):
        native.NativeRuntime(art, mem_limit=1024)


def test_python_runtimes_refuse_an_artifact_this_machine_cannot_run(model, tmp_path_factory, tmp_path):
    """The Python side checks the same things before loading: the architecture and CPU features."""
    from edgekv.artifact import ArtifactError

    art = _copy(artifact(model, "streaming", tmp_path_factory), tmp_path)
    prog = pf.read(art / PROGRAM_FILE)
    prog.settings["cpu_features"] = "avx2,avx512-quantum"
    pf.write(prog, art / PROGRAM_FILE)
    with pytest.raises(ArtifactError, match="avx512-quantum"):
        HostRuntime(art, check_hashes=False)
    prog.settings["target_arch"] = "riscv64"
    pf.write(prog, art / PROGRAM_FILE)
    with pytest.raises(ArtifactError, match="compiled for riscv64"):
        HostRuntime(art, check_hashes=False)
    with pytest.raises(ArtifactError, match="does not match the sha256"):
        HostRuntime(art)


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.parametrize("name", compiled_policy_names())
def test_native_equals_host_runtime_on_smollm2(smol, name, tmp_path):
    """SmolLM2, every compiled policy, N = 256, B = 128, a 1K-token prompt: kept positions of every
    layer after every block, last-token logits and 32 greedy tokens, native against HostRuntime."""
    from edgekv.corpus import natural_text

    ids = smol.tokenizer(natural_text())["input_ids"][:1000]
    budget = 1200 if name == "full" else 256
    compile_model(smol, make_policy(name, {}), budget, 128, out_dir=tmp_path / "art")
    host, nat = HostRuntime(tmp_path / "art"), native.NativeRuntime(tmp_path / "art")
    kept_host, logits_host = host_kept_per_block(host, ids)
    kept_nat = []
    logits_nat = nat.prefill(ids, on_block=lambda rt: kept_nat.append(
        [rt.kept_positions(layer) for layer in range(rt.num_layers)]))
    for block, (a, b) in enumerate(zip(kept_host, kept_nat)):
        for layer in range(smol.config.num_layers):
            np.testing.assert_array_equal(a[layer], b[layer], err_msg=f"{name}: block {block}, layer {layer}")
    assert float(np.abs(logits_nat - logits_host).max() / np.abs(logits_host).max()) <= 1e-5
    host.reset()
    nat.reset()
    assert nat.generate(ids, 32) == host.generate(ids, 32)


def test_sampling_is_seeded(model, prompt, tmp_path_factory, tmp_path):
    """Temperature sampling: the same seed gives the same tokens, another seed other tokens; a
    nucleus too small to hold more than the best token is greedy."""
    art = artifact(model, "keydiff", tmp_path_factory)
    ids = ",".join(map(str, prompt))

    def tokens(*extra):
        out = tmp_path / "s.json"
        res = run_cli(art, "--prompt-ids", ids, "--max-new-tokens", 24, "--quiet", "--report", out, *extra)
        assert res.returncode == 0, res.stderr
        return json.loads(out.read_text())["generated_ids"]

    greedy = tokens()
    a, b = tokens("--temperature", "1.5", "--seed", "7"), tokens("--temperature", "1.5", "--seed", "7")
    assert a == b
    assert a != greedy and a != tokens("--temperature", "1.5", "--seed", "8")
    assert tokens("--temperature", "1.0", "--top-p", "1e-6", "--seed", "3") == greedy
