"""`edgekv compile` / `edgekv run ARTIFACT` through the CLI on the tiny model (issue 18): one rule
for options an artifact fixes (equal: accepted; different: refused naming the artifact's
settings), a recompile leaves no file of an earlier target, a device artifact is refused with
where to run it, and an output path that is a file is refused."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

tvm = pytest.importorskip("tvm")

from edgekv.cli import app  # noqa: E402

runner = CliRunner()


HOST_FAST = {"name": "host-test", "target": {"kind": "llvm", "opt-level": 0, "num-cores": 2}}
ANDROID_FAST = {"name": "android-cpu", "description": "test copy at opt-level 0",
                "target": {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon"], "opt-level": 0},
                "library": "tar", "device_source": "obj", "elf_machine": 183,
                "toolchain": {"needed_for": "linking model.tar into model.so", "tool": "Android NDK clang",
                              "env": "TVM_NDK_CC",
                              "finish": "TVM_NDK_CC=... python -m edgekv.compiler.backend.finish <artifact dir>"}}


def cli(*args):
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout + r.stderr


def profile(tmp_path, data, name):
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(data))
    return str(p)


@pytest.fixture(scope="module")
def artifact(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_art")
    out = root / "kd"
    code, text = cli("compile", str(tiny_dir), "--budget", "32", "--block", "8", "--policy", "streaming",
                     "--policy-arg", "sinks=2", "--target", profile(root, HOST_FAST, "host-test"), "-o", str(out))
    assert code == 0, text
    return out


@pytest.mark.parametrize("args", [
    [], ["--budget", "32"], ["--budget", "0.03125k"], ["--block", "8"], ["--policy", "streaming"],
    ["--policy-arg", "sinks=2"], ["--policy-arg", "streaming:sinks=2"],
    ["--budget", "32", "--block", "8", "--policy", "streaming", "--policy-arg", "sinks=2"],
])
def test_options_equal_to_the_artifact_are_accepted(artifact, tmp_path, args):
    report = tmp_path / "r.json"
    code, text = cli("run", str(artifact), "--prompt", "héllo wörld " * 6, "--max-new-tokens", "3", *args,
                     "-o", str(report))
    assert code == 0, text
    data = json.loads(report.read_text())
    assert (data["engine"], data["budget_tokens"], data["block"], data["policy"]) == ("compiled", 32, 8, "streaming")
    assert data["threads"]["tvm"] == data["threads"]["count"]


@pytest.mark.parametrize("args,named", [
    (["--budget", "64"], "--budget 64 differs"),
    (["--budget", "1k"], "--budget 1k (1024 tokens) differs"),
    (["--block", "16"], "--block 16 differs"),
    (["--policy", "keydiff"], "--policy keydiff differs"),
    (["--policy-arg", "sinks=4"], "--policy-arg sinks=4 differs"),
    (["--budget", "64", "--policy", "keydiff"], "--policy keydiff, --budget 64 differ"),
])
def test_options_that_differ_are_refused_naming_the_artifacts_settings(artifact, tmp_path, args, named):
    report = tmp_path / "r.json"
    code, text = cli("run", str(artifact), "--prompt", "hello", *args, "-o", str(report))
    flat = " ".join(text.split())
    assert code == 2 and "Traceback" not in flat, text
    assert "was compiled with --policy streaming --budget 32 --block 8 --policy-arg sinks=2" in flat
    assert named in flat and "recompile" in flat
    assert not report.exists()


def test_recompiling_replaces_the_whole_artifact(tiny_dir, tmp_path):
    out = tmp_path / "art"
    code, text = cli("compile", str(tiny_dir), "--budget", "32", "--block", "8",
                     "--target", profile(tmp_path, HOST_FAST, "host-test"), "-o", str(out))
    assert code == 0, text
    assert "edgekv: exporting and lowering" in text and "edgekv: compiling with TVM" in text  # one line per phase
    host_files = {p.name for p in out.iterdir()}
    assert "model.so" in host_files
    code, text = cli("compile", str(tiny_dir), "--budget", "32", "--block", "8",
                     "--target", profile(tmp_path, ANDROID_FAST, "android-cpu"), "-o", str(out))
    assert code == 0, text
    files = {p.name for p in out.iterdir()}
    assert "model.so" not in files and {"model.tar", "device", "manifest.json"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art.")]  # no staging folders left
    assert str(out) in " ".join(text.split())  # the toolchain note names the artifact, not a staging folder

    # a device artifact on this host: where it runs, not TVM's linker output
    code, text = cli("run", str(out), "--prompt", "hi")
    flat = " ".join(text.split())
    assert code == 2 and "Traceback" not in flat, text
    assert f"{out} was compiled for android-cpu (aarch64-linux-android), not for this machine's CPU" in flat
    assert "--target host" in flat and "finish" in flat
    from edgekv.runtime import ArtifactError, HostRuntime

    with pytest.raises(ArtifactError, match="compiled for android-cpu"):
        HostRuntime(out)

    # a failed recompile leaves the earlier artifact as it was
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, text = cli("compile", str(tiny_dir), "--budget", "32", "--block", "8", "--target", "no-such-target",
                     "-o", str(out))
    assert code == 2 and "unknown target 'no-such-target'" in text
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_compile_output_that_is_a_file_is_refused(tiny_dir, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    code, text = cli("compile", str(tiny_dir), "-o", str(f))
    flat = " ".join(text.split())
    assert code == 2 and "Traceback" not in flat and f"-o {f} is a file" in flat
    assert f.read_text() == "mine"
    d = tmp_path / "stuff"
    d.mkdir()
    (d / "x").write_text("x")
    code, text = cli("compile", str(tiny_dir), "-o", str(d))
    assert code == 2 and "is not an edgekv artifact" in " ".join(text.split())


def test_compile_refuses_a_budget_past_what_kernels_index(tiny_dir, tmp_path):
    code, text = cli("compile", str(tiny_dir), "--budget", "1000m", "--block", "8", "-o", str(tmp_path / "big"))
    flat = " ".join(text.split())
    assert code == 2 and "Traceback" not in flat and "past the 2^31 that compiled kernels index" in flat, text
    assert not (tmp_path / "big").exists()
