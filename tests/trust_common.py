"""Shared by the tests/test_trust_*.py files (issue 31): one tiny compiled artifact with a byte-level
tokenizer, built once per test session, and the two runtimes' entry points run the same way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HOST_FAST = {"name": "host-test", "target": {"kind": "llvm", "opt-level": 0, "num-cores": 2}}


def trust_artifact(tmp_path_factory) -> Path:
    """The tiny model (with its byte-level tokenizer) compiled once for the session (streaming,
    N = 32, B = 8, unoptimised kernels: these tests check refusals, not speed)."""
    from edgekv.models import tiny_random_model

    root = tmp_path_factory.getbasetemp() / "trust-artifact"
    out = root / "art"
    if (out / "program.ekv").is_file():
        return out
    root.mkdir(exist_ok=True)
    hf = root / "hf"
    tiny_random_model(0).to_hf().save_pretrained(hf)
    byte_tokenizer().save_pretrained(hf)  # one both runtimes have (the native one: tokenizer.ekt)
    (root / "host-test.json").write_text(json.dumps(HOST_FAST))
    res = edgekv("compile", hf, "--budget", "32", "--block", "8", "--policy", "streaming",
                 "--target", root / "host-test.json", "-o", out, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def byte_tokenizer():
    """conftest's byte-level tokenizer (256 tokens, one per byte) with GPT-2's pre-tokenizing regex,
    the form the native tokenizer file supports, so that both runtimes read text."""
    from conftest import byte_tokenizer as plain
    from tokenizers import pre_tokenizers

    tok = plain()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


def copy_artifact(art: Path, dest: Path) -> Path:
    shutil.copytree(art, dest)
    (dest / ".params.verified").unlink(missing_ok=True)
    return dest


def edgekv(*args, timeout=300, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`edgekv ...` in a child process, as a user runs it, piped (no terminal width set); ``env``:
    variables to set on top of this process's."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "LINES")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "edgekv", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def edgekv_run(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    from edgekv.runtime import native

    return subprocess.run([str(native.cli_path()), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def native_ready() -> bool:
    from edgekv.runtime import native

    return native.available() and native.cli_path() is not None
