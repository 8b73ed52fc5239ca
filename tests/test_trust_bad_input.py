"""One table of bad input, run against both runtimes (issue 31, items 3 and 6): `edgekv run ARTIFACT`
(Python; the native runtime through ctypes when it is built) and `edgekv-run` (C) get the same
damaged artifact or the same bad option, and both must answer alike — the exit status, and a message
holding the case's words. The table in docs/BAD_INPUT.md is generated from these cases and their
real messages, and checked here against the runs:

    PYTHONPATH=. python tests/test_trust_bad_input.py     # rewrite docs/BAD_INPUT.md (builds the tiny artifact)
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from trust_common import copy_artifact, edgekv, edgekv_run, native_ready  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "BAD_INPUT.md"
PROMPT = "the quick brown fox jumps over the lazy dog"


def _flip_weight_byte(art: Path, tmp: Path) -> None:
    from edgekv.artifact import program_file as pf

    w = [b for b in pf.read(art / "program.ekv").buffers if b.kind == pf.WEIGHT][0]
    with open(art / "params.safetensors", "r+b") as f:
        f.seek(w.a + 7)
        b = f.read(1)[0]
        f.seek(w.a + 7)
        f.write(bytes([b ^ 0x01]))


def _truncate_params(art: Path, tmp: Path) -> None:
    import os

    os.truncate(art / "params.safetensors", (art / "params.safetensors").stat().st_size - 4096)


def _manifest(edit: Callable[[dict], None] | None = None, cut: bool = False):
    def make(art: Path, tmp: Path) -> None:
        p = art / "manifest.json"
        text = p.read_text()
        if cut:
            p.write_text(text[: len(text) // 2])
            return
        data = json.loads(text)
        edit(data)
        p.write_text(json.dumps(data, indent=2))
    return make


def _file(name: str, data: bytes):
    def make(art: Path, tmp: Path) -> None:
        (tmp / name).write_bytes(data)
    return make


def _saved_cache(**differs):
    """A saved document cache (`--save-cache`) of this artifact but for ``differs`` (another policy,
    N ...), written as the runtimes write one; and params.safetensors removed, so that a runtime
    that loaded anything before judging the cache would name the missing weights instead."""
    def make(art: Path, tmp: Path) -> None:
        from edgekv.artifact import Manifest
        from edgekv.artifact import snapshot_file as sf

        ident = {**sf.artifact_identity(art, Manifest.read(art)), **differs}
        sf.write(sf.Snapshot(engine=sf.ENGINE_COMPILED, position=9, tokens=9, made_from=str(art.resolve()),
                             **ident), tmp / "doc.ekv")
        (art / "params.safetensors").unlink()
    return make


@dataclass
class Case:
    name: str  # what the user did
    make: Callable[[Path, Path], None] | None  # damages the artifact copy / writes files into tmp
    args: list[str]  # options after ARTIFACT, the same for both runtimes ({tmp} = the case's folder)
    exit: int  # both runtimes
    words: str  # both messages hold this (a regex)


CASES = [
    Case("one flipped byte in a weight", _flip_weight_byte, ["--prompt", PROMPT], 2, r"fails its checksum"),
    Case("params file cut short", _truncate_params, ["--prompt", PROMPT], 2, r"bytes but the program expects"),
    Case("tokenizer.ekt cut short", lambda art, tmp: __import__("os").truncate(
        art / "tokenizer.ekt", (art / "tokenizer.ekt").stat().st_size - 100), ["--prompt", PROMPT], 2, r"tokenizer\.ekt"),
    Case("manifest.json cut off", _manifest(cut=True), ["--prompt", PROMPT], 2, r"manifest\.json"),
    Case("manifest block is a list", _manifest(lambda m: m.update(block=[m["block"]])), ["--prompt", PROMPT], 2,
         r"'block' is"),
    Case("manifest budget is text", _manifest(lambda m: m.update(budget="abc")), ["--prompt", PROMPT], 2,
         r"'budget' is"),
    Case("manifest format_version is a string", _manifest(lambda m: m.update(format_version="2")),
         ["--prompt", PROMPT], 2, r"'format_version' is"),
    Case("manifest from another compile (budget)", _manifest(lambda m: m.update(budget=m["budget"] + 1)),
         ["--prompt", PROMPT], 2, r"budget"),
    Case("prompt file not UTF-8", _file("latin1.txt", "café crème".encode("latin-1")),
         ["--prompt-file", "{tmp}/latin1.txt"], 2, r"is not UTF-8 text \(byte 0xe9 at offset 3\)"),
    Case("--prompt only whitespace", None, ["--prompt", " \t "], 2, r"the prompt is empty"),
    Case("prompt file only whitespace", _file("blank.txt", b" \n\t\r\n"), ["--prompt-file", "{tmp}/blank.txt"], 2,
         r"the prompt is empty"),
    Case("missing prompt file", None, ["--prompt-file", "{tmp}/nope.txt"], 2, r"nope\.txt"),
    Case("--save-cache into a missing folder", None,
         ["--prompt", PROMPT, "--question", "what jumps?", "--save-cache", "{tmp}/no/such/dir/doc.ekv"], 2,
         r"no/such/dir"),
    Case("--report into a missing folder", None, ["--prompt", PROMPT, "--report", "{tmp}/missing/r.json"], 2,
         r"missing"),
    Case("--load-cache made with another policy (params removed: judged before any load)",
         _saved_cache(policy="h2o", policy_params='{"recent_ratio": 0.5}'),
         ["--load-cache", "{tmp}/doc.ekv", "--question", "what jumps?"], 2, r"made with policy h2o"),
    Case("--load-cache made at another budget (params removed: judged before any load)", _saved_cache(budget=64),
         ["--load-cache", "{tmp}/doc.ekv", "--question", "what jumps?"], 2, r"made at N = 64, B = 8"),
    Case("--load-cache of a file that is no saved cache", _file("junk.ekv", b"not a snapshot" * 40),
         ["--load-cache", "{tmp}/junk.ekv", "--question", "what jumps?"], 2, r"not an edgekv cache snapshot"),
    Case("--threads 0", None, ["--prompt", PROMPT, "--threads", "0"], 2, r"--threads"),
    Case("--threads 999 (clamped, runs)", None, ["--prompt", PROMPT, "--threads", "999", "--max-new-tokens", "4"], 0,
         r"--threads 999 is more than the \d+ usable cores"),
    Case("--temperature -1", None, ["--prompt", PROMPT, "--temperature", "-1"], 2, r"--temperature"),
    Case("--top-p 2", None, ["--prompt", PROMPT, "--top-p", "2"], 2, r"--top-p"),
]


@dataclass
class CliCase:
    """Bad input to a command only the Python CLI has (`eval`), or to `edgekv run MODEL` (the eager
    engine: no artifact, so no `edgekv-run` counterpart); each refused before any model loads."""

    name: str
    args: list[str]  # ({tmp} = the case's folder)
    exit: int
    words: str


CLI_CASES = [
    CliCase("run MODEL, --prompt only whitespace", ["run", "smollm2-135m", "--prompt", " "], 2, r"the prompt is empty"),
    CliCase("run MODEL, --budget not a budget", ["run", "smollm2-135m", "--prompt", "hi", "--budget", "abc"], 2,
            r"cannot read budget 'abc'"),
    CliCase("run MODEL, --budget below one block", ["run", "smollm2-135m", "--prompt", "hi", "--budget", "64"], 2,
            r"smaller than one block"),
    CliCase("run MODEL, an unknown policy", ["run", "smollm2-135m", "--prompt", "hi", "--policy", "nope"], 2,
            r"unknown policy 'nope'"),
    CliCase("run MODEL, --kv-dtype of no format", ["run", "smollm2-135m", "--prompt", "hi", "--kv-dtype", "fp8"], 2,
            r"--kv-dtype 'fp8' is not a KV cache format"),
    CliCase("eval --lengths 0", ["eval", "--lengths", "0", "-o", "{tmp}/eval-out"], 2, r"--lengths '0': give a positive"),
    CliCase("eval --workers 0", ["eval", "--workers", "0", "-o", "{tmp}/eval-out"], 2, r"--workers must be ≥ 1"),
]


def run_cli_case(case: CliCase, tmp: Path) -> tuple[int, str]:
    res = edgekv(*[a.replace("{tmp}", str(tmp)) for a in case.args], timeout=300)
    said = [line.strip() for line in res.stderr.splitlines() if line.startswith(("error:", "warning:"))]
    message = " / ".join(said) if said else " ".join(res.stderr.split())[-300:]
    return res.returncode, message.replace(str(tmp), "DIR")


def cli_row(case: CliCase, got: tuple[int, str]) -> str:
    return f"| {_cell(case.name)} | `edgekv {_cell(' '.join(case.args))}` | {got[0]} | {_cell(got[1])} |"


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.name for c in CLI_CASES])
def test_python_cli_refuses_before_loading(case, tmp_path):
    code, message = run_cli_case(case, tmp_path)
    assert code == case.exit and re.search(case.words, message), f"exit {code}: {message}"
    assert "loading" not in message and "Traceback" not in message
    assert not (tmp_path / "eval-out").exists()  # a refused eval leaves no folder
    assert cli_row(case, (code, message)) in DOC.read_text().splitlines(), (
        f"docs/BAD_INPUT.md is out of date for {case.name!r}: regenerate it with "
        f"`PYTHONPATH=. python tests/test_trust_bad_input.py`\n{cli_row(case, (code, message))}")


RUNTIMES = {"edgekv run": lambda art, args: edgekv("run", art, *args),
            "edgekv-run": lambda art, args: edgekv_run(art, *args)}


def run_case(case: Case, base: Path, tmp: Path) -> dict[str, tuple[int, str]]:
    """Both runtimes on one case: {runtime: (exit status, the first error or warning line)}."""
    art = copy_artifact(base, tmp / "art")
    if case.make is not None:
        case.make(art, tmp)
    args = [a.replace("{tmp}", str(tmp)) for a in case.args]
    got = {}
    for name, run in RUNTIMES.items():
        res = run(art, args)
        said = [line.strip() for line in res.stderr.splitlines() if line.startswith(("error:", "warning:"))]
        message = " / ".join(said) if said else " ".join(res.stderr.split())[-300:]
        got[name] = (res.returncode, message.replace(str(tmp), "DIR"))
    return got


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    pytest.importorskip("tvm")
    if not native_ready():
        pytest.skip("the native runtime is not built: `pip install -e .` builds runtime/ (needs cmake and a C compiler)")
    from trust_common import trust_artifact

    return trust_artifact(tmp_path_factory)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_both_runtimes_answer_alike(case, base, tmp_path):
    got = run_case(case, base, tmp_path)
    for runtime, (code, message) in got.items():
        assert code == case.exit, f"{runtime}: exit {code}: {message}"
        assert re.search(case.words, message), f"{runtime}: {message!r} lacks {case.words!r}"
        assert "Traceback" not in message
    row = table_row(case, got)
    assert row in DOC.read_text().splitlines() or _same_but_machine(row, DOC.read_text()), (
        f"docs/BAD_INPUT.md is out of date for {case.name!r}: regenerate it with "
        f"`PYTHONPATH=. python tests/test_trust_bad_input.py`\n{row}")


def _same_but_machine(row: str, doc: str) -> bool:
    """A row equal up to its numbers: the machine's core count (the --threads clamp names it), and
    the place JSON's decoder names in a cut-off manifest (its paths differ in length per folder)."""
    norm = lambda s: re.sub(r"\d+", "#", s)  # noqa: E731
    return norm(row) in {norm(line) for line in doc.splitlines()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\t", "\\t")


def table_row(case: Case, got: dict) -> str:
    (py_code, py_msg), (c_code, c_msg) = got["edgekv run"], got["edgekv-run"]
    return (f"| {_cell(case.name)} | `{_cell(' '.join(case.args).replace(PROMPT, 'TEXT'))}` | {py_code} | "
            f"{_cell(py_msg)} | {c_code} | {_cell(c_msg)} |")


def write_doc(rows: list[str], cli_rows: list[str]) -> None:
    DOC.write_text("\n".join([
        "# Bad input: what both runtimes say",
        "",
        "Every case runs against `edgekv run ARTIFACT` (Python: the native runtime through ctypes when it is built, "
        "else TVM's) and `edgekv-run ARTIFACT` (C) on the same input — the tiny test artifact, damaged as the case "
        "says, `DIR` its folder. Generated by `PYTHONPATH=. python tests/test_trust_bad_input.py`; "
        "`tests/test_trust_bad_input.py` runs every case and fails when a row here is not what the runtimes say. "
        "Exit 2: refused, before the model loads wherever the input allows it (the artifact's own checks happen "
        "as it opens, before any prompt is read; a saved cache is judged from its header before the artifact "
        "loads); 0: ran; 130: stopped by Ctrl-C (both runtimes stop at the next kernel call, "
        "`tests/test_trust_threads.py`). The native runtime's contract is `program.ekv` "
        "(docs/NATIVE.md); it also refuses a damaged `manifest.json`.",
        "",
        "| the user gave | options | `edgekv run` exit | `edgekv run` says | `edgekv-run` exit | `edgekv-run` says |",
        "|---|---|---:|---|---:|---|",
        *rows,
        "",
        "## The Python CLI alone",
        "",
        "`edgekv run MODEL` (the eager engine) and `edgekv eval` have no `edgekv-run` counterpart. Each case is "
        "refused before any model loads, and a refused `eval` leaves no output folder.",
        "",
        "| the user gave | command | exit | says |",
        "|---|---|---:|---|",
        *cli_rows, ""]))


if __name__ == "__main__":
    import tempfile

    from _pytest.tmpdir import TempPathFactory

    with tempfile.TemporaryDirectory(prefix="edgekv-bad-input-") as root:
        factory = TempPathFactory(given_basetemp=Path(root), retention_count=1, retention_policy="all",
                                  trace=lambda *a: None)
        from trust_common import trust_artifact

        art = trust_artifact(factory)
        rows, cli_rows = [], []
        for i, case in enumerate(CASES):
            tmp = Path(root) / f"case{i}"
            tmp.mkdir()
            rows.append(table_row(case, run_case(case, art, tmp)))
            print(rows[-1], flush=True)
        for i, case in enumerate(CLI_CASES):
            tmp = Path(root) / f"cli{i}"
            tmp.mkdir()
            cli_rows.append(cli_row(case, run_cli_case(case, tmp)))
            print(cli_rows[-1], flush=True)
        write_doc(rows, cli_rows)
    print(f"wrote {DOC}")
