"""One vocabulary across the CLI (issue 18): MODEL positional everywhere, `-o/--output` (with the
old `--report` / `--out` spellings), one `--policy-arg` form, shared defaults, the options each
command's messages advise exist; plus `edgekv policies`, `edgekv cache` and the model cache
keyed by content, and the truncated-GGUF message."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from edgekv.budget import DEFAULT_BLOCK, DEFAULT_BUDGET
from edgekv.cli import app
from edgekv.errors import InputError
from edgekv.policies import REGISTRY, PolicyError, policy_arguments

runner = CliRunner()
COMMANDS = ["run", "compile", "simulate", "eval", "bench", "export-onnx"]


def help_of(command: str) -> str:
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"})
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("command", COMMANDS)
def test_model_is_positional_and_output_is_dash_o(command):
    text = help_of(command)
    assert re.search(r"Usage: \S+ \S+ \[OPTIONS\] \[model\]", text), text
    assert "-o" in text and "--output" in text


@pytest.mark.parametrize("command,alias", [("run", "--report"), ("simulate", "--report"), ("eval", "--out"),
                                           ("bench", "--out")])
def test_old_spellings_remain(command, alias):
    assert alias in help_of(command)


@pytest.mark.parametrize("command", ["run", "compile", "simulate", "bench"])
def test_shared_defaults(command):
    text = " ".join(help_of(command).split())
    assert f"default {DEFAULT_BUDGET}" in text and f"default {DEFAULT_BLOCK}" in text


@pytest.mark.parametrize("command", ["run", "simulate", "eval", "bench"])
def test_threads_everywhere_a_model_runs(command):
    assert "--threads" in help_of(command)


def test_the_option_the_context_check_advises_exists_where_it_is_raised():
    for command in ("run", "simulate", "eval"):
        assert "--allow-beyond-context" in help_of(command)


def test_policy_arguments_one_form():
    assert policy_arguments(["sinks=4"], ["streaming"]) == {"streaming": {"sinks": "4"}}
    assert policy_arguments(["streaming:sinks=4"], ["streaming"]) == {"streaming": {"sinks": "4"}}
    # several policies: key=value goes to each one that has the argument
    got = policy_arguments(["window=16", "lagkv:sinks=8"], ["snapkv", "tova", "lagkv", "dapq"])
    assert got == {"snapkv": {"window": "16"}, "dapq": {"window": "16"}, "lagkv": {"sinks": "8"}}
    with pytest.raises(PolicyError, match="none of the chosen policies"):
        policy_arguments(["colour=red"], ["snapkv", "tova"])
    with pytest.raises(PolicyError, match="not among the chosen"):
        policy_arguments(["h2o:recent_ratio=0.3"], ["snapkv"])
    with pytest.raises(PolicyError, match="key=value or policy:key=value"):
        policy_arguments(["sinks"], ["streaming"])


def test_eval_takes_both_policy_arg_forms_and_the_model_either_way():
    from edgekv.evaluation.command import build_spec

    spec = build_spec("passkey", "streaming,lagkv", "128", "128", False, "1k", "0.5", "0", 2, "repeat", 10, "2k", 512,
                      16, ["sinks=2", "lagkv:lag=32"])
    assert spec.policy_args == {"streaming": {"sinks": "2"}, "lagkv": {"sinks": "2", "lag": "32"}}
    from edgekv.cli.common import merge_model

    assert merge_model("m", None, "eval") == merge_model(None, "m", "eval") == "m"
    with pytest.raises(InputError, match="MODEL given twice"):
        merge_model("a", "b", "eval")


def test_eval_and_bench_refuse_an_output_that_is_a_file_before_any_work(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for command in (["eval"], ["bench", "--systems", "edgekv-eager"]):
        r = runner.invoke(app, [*command, "-o", str(f)])
        assert r.exit_code == 2 and "is a file" in r.output and "Traceback" not in r.output, r.output
        assert f.read_text() == "x"


def test_policies_say_what_each_does():
    r = runner.invoke(app, ["policies"], env={"COLUMNS": "250"})
    assert r.exit_code == 0
    for name, cls in REGISTRY.items():
        assert cls.summary, name
        assert name in r.output
        assert cls.summary.split(":")[0].split(" ")[0] in r.output


# ---- the model cache ---------------------------------------------------------------------------

@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_conversions_are_keyed_by_content(cache, tmp_path):
    from edgekv.models.loader import converted_dir

    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c.gguf"
    for p, data in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (c, b"GGUF other bytes")):
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
    assert converted_dir(a) == converted_dir(b) != converted_dir(c)
    # an earlier copy of the same content (say, under the old path/mtime key) is reused
    old = cache / "converted" / "m-oldkey"
    old.mkdir(parents=True)
    from edgekv.models.loader import CONVERSION_FORMAT, source_sha256

    (old / "edgekv.json").write_text(json.dumps({"source": str(c), "source_sha256": source_sha256(c),
                                                 "format": CONVERSION_FORMAT}))
    assert converted_dir(c) == old


def test_cache_command_lists_and_clears(cache):
    d = cache / "converted" / "m-123"
    d.mkdir(parents=True)
    (d / "edgekv.json").write_text(json.dumps({"source": "/x/m.gguf", "source_sha256": "ab" * 32, "format": 1}))
    (d / "model.safetensors").write_bytes(b"0" * 2048)
    r = runner.invoke(app, ["cache"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "m-123" in r.output and "--clear" in r.output and str(cache) in r.output
    r = runner.invoke(app, ["cache", "--clear"])
    assert r.exit_code == 0 and "deleted 1 converted copy" in r.output
    assert not d.exists()


def test_truncated_gguf_says_so(smol, cache, tmp_path):
    from edgekv.models.sources import KNOWN_MODELS, fetch_known_gguf

    src = fetch_known_gguf(KNOWN_MODELS["smollm2-135m"])
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as fh:
        cut.write_bytes(fh.read(src.stat().st_size // 3))
    r = runner.invoke(app, ["run", str(cut), "--prompt", "hi"])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in flat, r.output
    assert "is truncated or corrupt" in flat and "download the file again" in flat
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(b"GGUF\x03\x00\x00\x00")
    r = runner.invoke(app, ["run", str(header_only), "--prompt", "hi"])
    assert r.exit_code == 2 and "is truncated or corrupt" in " ".join(r.output.split()), r.output


def test_running_out_of_memory_while_loading_is_not_called_damage(tiny_dir, monkeypatch):
    """Under `edgekv simulate`'s cap, reading the weights can fail to allocate: that is "does not
    fit" (a MemoryError for the child), not a damaged file."""
    import safetensors.torch

    from edgekv.models import load_model
    from edgekv.models.errors import ModelError

    def no_memory(path, *a, **k):
        raise safetensors.SafetensorError("Error while deserializing: Cannot allocate memory (os error 12)")

    monkeypatch.setattr(safetensors.torch, "load_file", no_memory)
    with pytest.raises(MemoryError) as info:
        load_model(str(tiny_dir))
    assert isinstance(info.value, ModelError)
    assert "not enough memory to load the weights" in str(info.value) and "damaged" not in str(info.value)


@pytest.mark.parametrize("args,message", [
    (["bench", "--prompt-lengths", "x"], "--prompt-lengths 'x': write token counts"),
    (["eval", "--lengths", "1k,zz"], "--lengths 'zz': write token counts"),
    (["eval", "--threads", "-1"], "--threads -1: give a thread count of 1 or more"),
])
def test_list_options_name_themselves(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and message in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


def test_export_onnx_to_a_file_is_refused(tiny_dir, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    r = runner.invoke(app, ["export-onnx", str(tiny_dir), "-o", str(f)])
    assert r.exit_code == 2 and "is a file" in r.output and "Traceback" not in r.output, r.output


def test_compile_refuses_an_unknown_target_before_loading_the_model(tmp_path):
    """The target is judged first: the model path does not exist, so a refusal that names the
    target (and not the missing model) shows nothing was loaded before it."""
    r = runner.invoke(app, ["compile", str(tmp_path / "absent.gguf"), "--target", "cpu", "-o", str(tmp_path / "art")])
    assert r.exit_code == 2, r.output
    assert "unknown target 'cpu'" in r.output and "host" in r.output
    assert "loading" not in r.output
