"""Refusals before the slow part, in the user's own words (issue 31, items 4 and 5): an empty or
non-UTF-8 prompt is refused before any model loads; `eval --lengths 0` speaks of lengths, not
budgets, and a refused eval leaves no output folder; a manifest's format_version of the wrong
type is named as such; help and errors are not cut at 80 columns when piped. `edgekv --help` and
the refusals made before a model loads import no torch, numpy or TVM (their time is printed, not
asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trust_common import edgekv


@pytest.mark.parametrize("prompt_bytes, words", [(b" \n\t ", "the prompt is empty"),
                                                 (b"caf\xe9", "is not UTF-8 text (byte 0xe9 at offset 3)")])
def test_bad_prompt_is_refused_before_the_model_loads(tmp_path, prompt_bytes, words):
    f = tmp_path / "p.txt"
    f.write_bytes(prompt_bytes)
    # a model name that would take seconds to load: the refusal must come first
    res = edgekv("run", "smollm2-135m", "--prompt-file", f, timeout=120)
    assert res.returncode == 2 and words in res.stderr, res.stderr
    assert "loading" not in res.stderr


def test_eval_lengths_zero_speaks_of_lengths_and_leaves_no_folder(tmp_path):
    out = tmp_path / "eval-out"
    res = edgekv("eval", "--lengths", "0", "-o", out, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "--lengths '0': give a positive token count" in res.stderr and "budget" not in res.stderr.lower()
    assert not out.exists()


def test_format_version_of_the_wrong_type_is_named(tmp_path):
    from edgekv.artifact import ArtifactError, Manifest

    (tmp_path / "manifest.json").write_text(json.dumps({"format": "edgekv-artifact", "format_version": "2"}))
    with pytest.raises(ArtifactError, match=r"'format_version' is str \"2\", expected an integer"):
        Manifest.read(tmp_path)


def test_piped_help_keeps_option_names_whole():
    t0 = time.perf_counter()
    res = edgekv("--help", timeout=120)
    print(f"\nedgekv --help: {time.perf_counter() - t0:.2f} s (shared machine)")
    assert res.returncode == 0
    res = edgekv("run", "--help", timeout=120)
    assert res.returncode == 0
    assert "--policy-arg" in res.stdout and "--no-verify" in res.stdout
    assert "…" not in res.stdout  # nothing cut to fit 80 columns


# runs `edgekv ARGS` in this process and prints the heavy modules it loaded, whatever the exit
_IMPORTS = """
import sys
from edgekv.cli import app
try:
    app(sys.argv[1:])
except SystemExit:
    pass
print("LOADED", sorted(m for m in ("torch", "numpy", "tvm", "transformers", "safetensors") if m in sys.modules))
"""


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["ask", "--help"], ["compile", "--help"],
                                  ["run", "smollm2-135m", "--prompt", " "],
                                  ["run", "smollm2-135m", "--prompt", "hi", "--temperature", "-1"],
                                  ["run", "smollm2-135m", "--prompt", "hi", "--question", "q", "--save-cache",
                                   "/no/such/dir/doc.ekv"]],
                         ids=["help", "run-help", "ask-help", "compile-help", "empty-prompt", "temperature",
                              "save-cache-dir"])
def test_help_and_early_refusals_load_nothing_heavy(args):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _IMPORTS, *args], capture_output=True, text=True, timeout=120)
    print(f"\nedgekv {' '.join(args)}: {time.perf_counter() - t0:.2f} s (shared machine)")
    assert "Traceback" not in res.stderr, res.stderr
    assert "LOADED []" in res.stdout, res.stdout + res.stderr


@pytest.fixture(scope="module")
def eager_cache(tmp_path_factory):
    """The tiny HF model (trust_common's byte tokenizer) and a document cache the eager engine saved
    from it (streaming, N = 32, B = 8)."""
    from edgekv.models import tiny_random_model
    from trust_common import byte_tokenizer

    root = tmp_path_factory.mktemp("eager-cache")
    hf = root / "hf"
    tiny_random_model(0).to_hf().save_pretrained(hf)
    byte_tokenizer().save_pretrained(hf)
    saved = root / "doc.ekv"
    res = edgekv("run", hf, "--prompt", "the quick brown fox jumps over the lazy dog", "--question", "what jumps?",
                 "--save-cache", saved, "--policy", "streaming", "--budget", "32", "--block", "8",
                 "--max-new-tokens", "2", timeout=300)
    assert res.returncode == 0, res.stderr
    return hf, saved


@pytest.mark.parametrize("option, words", [(["--budget", "64"], "was made at N = 32, B = 8; this run has N = 64"),
                                           (["--block", "16"], "was made at N = 32, B = 8; this run has N = 32, B = 16"),
                                           (["--policy", "h2o"], "was made with policy streaming")])
def test_eager_cache_of_other_settings_is_refused_before_the_model_loads(eager_cache, option, words):
    hf, saved = eager_cache
    res = edgekv("run", hf, "--load-cache", saved, "--question", "what jumps?", *option, timeout=300)
    assert res.returncode == 2 and words in res.stderr, res.stderr
    assert "loading" not in res.stderr  # the model was not loaded: the header was read first
