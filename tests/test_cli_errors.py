"""Each bad input gets a clear error naming what the user did, exit status 2, no traceback,
and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgekv.cli import app

runner = CliRunner()


def run_cli(*args):
    result = runner.invoke(app, ["run", *args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes is not None else "")


@pytest.fixture()
def report(tmp_path):
    return tmp_path / "report.json"


def assert_refused(code, output, message, report=None):
    assert code == 2, output
    assert message in " ".join(output.split()), output
    assert "Traceback" not in output
    if report is not None:
        assert not Path(report).exists()


@pytest.mark.parametrize("budget,message", [
    ("lots", "cannot read budget 'lots'"),
    ("0", "keeps no tokens"),
    ("64", "smaller than one block (128)"),
    ("1KiB", "not enough for the cache plus one block"),
])
def test_bad_budget(smol, budget, message, report):
    code, out = run_cli("--prompt", "hello", "--budget", budget, "--report", str(report))
    assert_refused(code, out, message, report)


def test_unknown_model(report):
    code, out = run_cli("no-such-model", "--prompt", "hi", "--report", str(report))
    assert_refused(code, out, "unknown model 'no-such-model'", report)


def test_path_that_is_not_a_model(tmp_path, report):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a model")
    code, out = run_cli(str(junk), "--prompt", "hi")
    assert_refused(code, out, "is not a GGUF file")
    code, out = run_cli(str(tmp_path), "--prompt", "hi", "--report", str(report))
    assert_refused(code, out, "is not an HF model directory", report)


def test_unsupported_architecture(tmp_path):
    from safetensors.torch import save_file
    import torch

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}))
    save_file({"wte.weight": torch.zeros(4, 8)}, str(tmp_path / "model.safetensors"))
    code, out = run_cli(str(tmp_path), "--prompt", "hi")
    assert_refused(code, out, "unsupported architecture 'gpt2'")
    assert "llama" in out


def test_prompt_past_context_needs_opt_in(smol, tmp_path, report):
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 8300)
    code, out = run_cli("--prompt-file", str(prompt), "--budget", "512", "--report", str(report))
    assert_refused(code, out, "past smollm2-135m's trained context of 8192", report)
    assert "--allow-beyond-context" in out


def test_empty_prompt(smol, report):
    code, out = run_cli("--prompt", "   ", "--report", str(report))
    assert_refused(code, out, "the prompt is empty", report)


def test_unknown_policy(report):
    code, out = run_cli("--prompt", "hi", "--policy", "magic", "--report", str(report))
    assert_refused(code, out, "unknown policy 'magic'", report)
    assert "keydiff" in out and "streaming" in out


def test_bad_policy_argument():
    code, out = run_cli("--prompt", "hi", "--policy", "streaming", "--policy-arg", "sinks=many")
    assert_refused(code, out, "sinks='many' is not a valid int")
    code, out = run_cli("--prompt", "hi", "--policy", "streaming", "--policy-arg", "colour=red")
    assert_refused(code, out, "has no argument 'colour'")


def test_unwritable_report_is_refused_before_the_run(tmp_path):
    code, out = run_cli("--prompt", "hi", "--report", str(tmp_path / "missing" / "r.json"))
    assert_refused(code, out, "does not exist")
    code, out = run_cli("--prompt", "hi", "--report", str(tmp_path))
    assert_refused(code, out, "is a directory")


def test_a_run_writes_its_report(smol, report):
    code, out = run_cli("--prompt", "The capital of France is", "--budget", "128", "--block", "16",
                        "--policy", "streaming", "--max-new-tokens", "4", "--report", str(report))
    assert code == 0, out
    data = json.loads(report.read_text())
    for key in ("prompt_tokens", "prefill_tok_s", "decode_tok_s", "memory", "text", "policy_params", "weight_sha256"):
        assert key in data
    assert data["memory"]["plan"]["total"] > data["memory"]["plan"]["weights"] > 0
    assert data["memory"]["peak_rss"] > 0
