"""`edgekv run` on the tiny model through the CLI (issue 18): streamed text that survives
multi-byte characters, caches bounded by prompt + output, memory plans refused before
allocation, bad inputs refused before any work, one line per phase, the thread count reported."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from edgekv.cli import app
from edgekv.job import TextStream
from edgekv.memory import kv_cache_bytes

runner = CliRunner()


def run_cli(*args):
    result = runner.invoke(app, ["run", *args])
    return result.exit_code, result.stdout, result.stderr


def refused(code, stdout, stderr, message, report=None):
    text = " ".join((stdout + stderr).split())
    assert code == 2, text
    assert message in text, text
    assert "Traceback" not in text
    if report is not None:
        assert not report.exists()


# ---- 2. streamed text ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["猫 is a cat 🐱, naïve — 日本語のテキスト", " 🐈‍⬛ family 👨‍👩‍👧 ok", "plain ascii"])
def test_stream_holds_back_incomplete_characters(smol, text):
    tok = smol.tokenizer
    ids = tok(text)["input_ids"]
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces)  # never a half character on the console
    if not text.isascii():
        assert "" in pieces  # some token ended inside a character and was held back


def test_stream_of_bytes_one_token_each(tiny_dir):
    """The tiny model's tokenizer has one token per byte: every non-ASCII character spans tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    ids = list("猫🐱é".encode())
    stream = TextStream(tok)
    assert [stream.push(i) for i in ids] == ["", "", "猫", "", "", "", "🐱", "", "é"]
    invalid = TextStream(tok)  # a byte sequence that never completes is printed at the end, as decoded
    assert invalid.push(0xE7) == "" and invalid.flush() == "\ufffd"


def test_cli_streams_the_whole_answer(tiny_dir, tmp_path):
    """The random tiny model emits arbitrary bytes: what the console shows is the report's text."""
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "héllo 猫", "--max-new-tokens", "40",
                                   "--budget", "128", "--block", "8", "-o", str(report))
    assert code == 0, stdout + stderr
    data = json.loads(report.read_text())
    assert stdout.startswith(data["text"] + "\n")
    assert data["generated_tokens"] == 40


# ---- 4. caches bounded by the sequence; plans refused before allocation ---------------------------

@pytest.mark.parametrize("budget", ["999GiB", "1000m", "4096"])
def test_a_huge_budget_allocates_what_the_sequence_needs(tiny_dir, tmp_path, budget):
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hello world", "--max-new-tokens", "5",
                                   "--budget", budget, "--block", "8", "-o", str(report))
    assert code == 0, stdout + stderr
    data = json.loads(report.read_text())
    seq = data["prompt_tokens"] + 5
    assert data["cache_capacity"] == seq
    from edgekv.models import load_model

    cfg = load_model(str(tiny_dir)).config
    assert data["memory"]["plan"]["kv_cache"] == kv_cache_bytes(cfg, seq)
    assert data["memory"]["kv_cache_allocated"] == kv_cache_bytes(cfg, seq)
    assert data["memory"]["vs_full_cache"]["saved_fraction"] == 0


def test_an_evicting_budget_still_allocates_n_plus_b(tiny_dir, tmp_path):
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "x" * 300, "--max-new-tokens", "4",
                                   "--budget", "64", "--block", "16", "-o", str(report))
    assert code == 0, stdout + stderr
    data = json.loads(report.read_text())
    assert data["cache_capacity"] == 64 + 16 and max(data["cache_lengths"]) <= 64
    assert 0 < data["memory"]["vs_full_cache"]["saved_fraction"] < 1
    assert "% saved" in " ".join(stderr.split())


def test_a_plan_above_the_memory_limit_is_refused_before_allocation(tiny_dir, tmp_path):
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hello", "--mem-limit", "10KiB", "-o", str(report))
    refused(code, stdout, stderr, "above --mem-limit 10.0KiB", report)
    assert "weights" in stderr and "KV cache" in stderr


def test_a_plan_above_the_free_memory_is_refused_with_the_numbers(tiny_dir, tmp_path, monkeypatch):
    import edgekv.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: (1 << 20, "available memory of this machine"))
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hello " * 400, "--budget", "2k", "--block", "512",
                                   "-o", str(report))
    refused(code, stdout, stderr, "only 1.0MiB is free (available memory of this machine)", report)
    assert "KV cache" in stderr


def test_the_compiled_plan_is_checked_before_loading(tmp_path):
    """`edgekv run ARTIFACT --mem-limit` refuses from the manifest, before TVM loads anything."""
    from edgekv.artifact import ARTIFACT_VERSION

    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({
        "format": "edgekv-artifact", "format_version": ARTIFACT_VERSION, "model": {"id": "m", "config": {}},
        "policy": {"name": "keydiff", "params": {}}, "budget": 32, "block": 8, "target": {"tvm": {"kind": "llvm"}},
        "memory_plan": {"weights_bytes": 3 << 30, "cache_bytes": 1 << 20, "activation_bytes": 1 << 20,
                        "total_bytes": (3 << 30) + (2 << 20)}}))
    pytest.importorskip("tvm")
    code, stdout, stderr = run_cli(str(art), "--prompt", "hi", "--mem-limit", "1GiB")
    refused(code, stdout, stderr, "weights alone need 3.0GiB, above --mem-limit 1.0GiB")


# ---- 5. bad inputs: refused before the run, nothing written --------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature -1: give 0 (greedy) or a positive temperature"),
    (["--top-p", "2"], "--top-p 2: give a probability mass in (0, 1]"),
    (["--top-p", "0"], "--top-p 0: give a probability mass in (0, 1]"),
    (["--max-new-tokens", "-3"], "--max-new-tokens -3: give 0 or more"),
    (["--block", "0"], "--block 0: give a positive number"),
    (["--threads", "0"], "--threads 0: give a thread count of 1 or more"),
    (["--mem-limit", "lots"], "cannot read 'lots' as a size"),
])
def test_bad_numbers_are_refused(tiny_dir, tmp_path, args, message):
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hi", *args, "-o", str(report))
    refused(code, stdout, stderr, message, report)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_report_that_cannot_be_created_is_refused_before_the_run(tiny_dir):
    """/proc exists and root's permission bits say writable, but no file can be created there."""
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hi", "--report", "/proc/edgekv-report.json")
    refused(code, stdout, stderr, "/proc/edgekv-report.json is not writable: cannot create a file in /proc")
    assert "prefill" not in stderr  # nothing ran


def test_report_under_a_file_is_refused(tiny_dir, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hi", "-o", str(f / "r.json"))
    refused(code, stdout, stderr, "is a file, not a folder")


def test_report_to_a_device_is_written_in_place(tiny_dir):
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hi", "--max-new-tokens", "2", "-o", "/dev/null")
    assert code == 0, stdout + stderr
    import os

    assert not os.path.isfile("/dev/null")  # still the device, not replaced by a file


# ---- 3 / 8. threads reported; one line per phase when output is redirected -----------------------

def test_threads_and_phases_are_reported(tiny_dir, tmp_path):
    report = tmp_path / "r.json"
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hello", "--max-new-tokens", "3", "--threads", "1",
                                   "-o", str(report))
    assert code == 0, stdout + stderr
    data = json.loads(report.read_text())
    assert data["threads"]["count"] == 1 and data["threads"]["source"] == "--threads"
    assert data["threads"]["torch"] == 1
    for line in ("edgekv: threads: 1 (--threads)", "edgekv: loading", "edgekv: prefill: ", "edgekv: decode: up to 3"):
        assert line in stderr, stderr
    code, stdout, stderr = run_cli(str(tiny_dir), "--prompt", "hello", "--max-new-tokens", "1", "-o", str(report))
    data = json.loads(report.read_text())
    assert data["threads"]["source"] == "default" and data["threads"]["count"] >= 1
    assert f"edgekv: threads: {data['threads']['count']} (default: " in stderr
