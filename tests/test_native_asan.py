"""The native runtime under AddressSanitizer + UndefinedBehaviorSanitizer: a whole run through
``edgekv-run`` (the command users call), and a seeded fuzz pass over its inputs — random
truncations and byte flips of program.ekv and tokenizer.ekt, truncations of the params file —
each a clear error (or, where a flip hits bytes nothing reads, a normal run), never a crash, a
sanitizer report or a hang."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

tvm = pytest.importorskip("tvm")

from edgekv.artifact import PARAMS_FILE, PROGRAM_FILE, TOKENIZER_FILE  # noqa: E402
from edgekv.compiler import compile_model  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.runtime import native  # noqa: E402

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
SANITIZER_MARKS = ("AddressSanitizer", "LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer")
ENV = {"ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1:exitcode=86",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87", "PATH": os.environ.get("PATH", "")}
PROMPT = "Read this: the cat sat on the mat. 猫 🐈‍⬛ — what sat on the mat?"


@pytest.fixture(scope="module")
def asan_run(tmp_path_factory):
    """edgekv-run built from runtime/ with -DEDGEKV_ASAN=ON."""
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        pytest.skip("cmake and a C compiler are needed for the AddressSanitizer build (apt-get install cmake gcc)")
    build = tmp_path_factory.mktemp("asan-build")
    ffi = subprocess.run(["python", "-c", "import tvm_ffi.libinfo as l; print(l.find_include_path())"],
                         capture_output=True, text=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run(["cmake", "-S", str(RUNTIME_DIR), "-B", str(build), *gen, "-DEDGEKV_ASAN=ON",
                          "-DCMAKE_BUILD_TYPE=Debug", f"-DEDGEKV_TVM_FFI_INCLUDE={ffi.stdout.strip()}"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stderr
    made = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return build / "edgekv-run"


def _toy_artifact(out: Path, kv_dtype: str = "fp32", policy: str = "keydiff", args: dict | None = None,
                  question_rows: int = 0) -> Path:
    """A tiny model with a small trained byte-level BPE tokenizer and a chat template, so the
    tokenizer file is part of the artifact and of the fuzzing."""
    from test_native_tokenizer import _toy_tokenizer

    tok = _toy_tokenizer()
    model = tiny_random_model(seed=2, layers=2, vocab=len(tok))
    model.tokenizer = tok
    model.chat = True
    compile_model(model, make_policy(policy, args or {}), 24, 8, target={"kind": "llvm", "opt-level": 0, "num-cores": 2},
                  out_dir=out, kv_dtype=kv_dtype, question_rows=question_rows)
    assert (out / TOKENIZER_FILE).is_file()
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return _toy_artifact(tmp_path_factory.mktemp("asan-art") / "art")


def run(exe, *args, timeout=60):
    res = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=ENV, timeout=timeout)
    bad = [m for m in SANITIZER_MARKS if m in res.stderr]
    assert not bad, res.stderr[-4000:]
    return res


def test_whole_run_is_clean_under_asan(asan_run, artifact, tmp_path):
    report = tmp_path / "r.json"
    res = run(asan_run, artifact, "--prompt", PROMPT, "--chat", "--max-new-tokens", 24, "--report", report,
              "--threads", 2, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(report.read_text())
    assert got["generated_tokens"] > 0 and got["status"] == "ok"
    if native.cli_path() is not None:  # the same answer as the release build
        plain = tmp_path / "plain.json"
        ref = subprocess.run([str(native.cli_path()), str(artifact), "--prompt", PROMPT, "--chat", "--max-new-tokens",
                              "24", "--report", str(plain), "--quiet"], capture_output=True, text=True)
        assert ref.returncode == 0, ref.stderr
        assert json.loads(plain.read_text())["generated_ids"] == got["generated_ids"]


def _mutants(src: Path, rng: random.Random, n: int):
    """n corrupted copies of a file's bytes: truncations and 1–8 byte flips."""
    data = src.read_bytes()
    for _ in range(n):
        if rng.random() < 0.35:
            yield f"truncate {src.name}", data[: rng.randrange(len(data))]
        else:
            b = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
            yield f"flip {src.name}", bytes(b)


def test_fuzzed_inputs_fail_cleanly(asan_run, artifact, tmp_path):
    rng = random.Random(20261125)
    work = tmp_path / "art"
    shutil.copytree(artifact, work)
    cases = [(PROGRAM_FILE, m) for m in _mutants(artifact / PROGRAM_FILE, rng, 140)]
    cases += [(TOKENIZER_FILE, m) for m in _mutants(artifact / TOKENIZER_FILE, rng, 120)]
    size = (artifact / PARAMS_FILE).stat().st_size
    cases += [(PARAMS_FILE, ("truncate params", None, rng.randrange(size))) for _ in range(40)]
    refused = {PROGRAM_FILE: 0, TOKENIZER_FILE: 0, PARAMS_FILE: 0}
    for i, (name, case) in enumerate(cases):
        target = work / name
        if name == PARAMS_FILE:
            shutil.copy(artifact / name, target)
            with open(target, "r+b") as f:
                f.truncate(case[2])
        else:
            target.write_bytes(case[1])
        # most cases only open the artifact; every fifth one also runs a prompt through it
        args = ["--check"] if i % 5 else ["--prompt", PROMPT, "--chat", "--max-new-tokens", 4, "--quiet"]
        res = run(asan_run, work, *args, timeout=120)
        assert res.returncode in (0, 2), (case[0], res.returncode, res.stderr[-2000:])
        if res.returncode == 2:
            assert "error: " in res.stderr and len(res.stderr) < 2000, res.stderr
            refused[name] += 1
        shutil.copy(artifact / name, target)
    # every part is checksummed or size-checked: nearly every corruption is refused at open
    assert refused[PARAMS_FILE] == 40
    assert refused[PROGRAM_FILE] >= 0.9 * 140, refused
    assert refused[TOKENIZER_FILE] >= 0.9 * 120, refused


def test_document_snapshots_under_asan(asan_run, artifact, tmp_path):
    """Read once, ask twice, then answer from the saved cache; then seeded corruptions of that
    cache (truncations, byte flips), each refused with one error line or — where a flip hits
    padding nothing reads — answered normally, never a crash or a sanitizer report."""
    snap, report = tmp_path / "doc.ekv", tmp_path / "r.json"
    res = run(asan_run, artifact, "--prompt", PROMPT, "--chat", "--question", "What sat?", "--question", "Where?",
              "--max-new-tokens", 4, "--save-cache", snap, "--report", report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    first = json.loads(report.read_text())["answers"]
    res = run(asan_run, artifact, "--load-cache", snap, "--question", "Where?", "--max-new-tokens", 4, "--report",
              report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(report.read_text())["answers"][0]["generated_ids"] == first[1]["generated_ids"]
    rng = random.Random(20261126)
    refused = 0
    cases = list(_mutants(snap, rng, 60))
    for what, blob in cases:
        bad = tmp_path / "bad.ekv"
        bad.write_bytes(blob)
        res = run(asan_run, artifact, "--load-cache", bad, "--question", "Where?", "--max-new-tokens", 2, "--quiet",
                  timeout=120)
        assert res.returncode in (0, 2), (what, res.returncode, res.stderr[-2000:])
        if res.returncode == 2:
            assert "error: " in res.stderr and len(res.stderr) < 2000, res.stderr
            refused += 1
    assert refused >= 0.9 * len(cases), refused  # the header and every tensor carry a CRC-32


def test_int8_cache_run_and_snapshot_under_asan(asan_run, tmp_path):
    """An artifact with an int8 KV cache (int8 codes, float16 scales as cache fields): a whole run,
    a saved document and an answer from it, clean under the sanitizers and equal to the release build."""
    art = _toy_artifact(tmp_path / "art", kv_dtype="int8")
    snap, report = tmp_path / "doc.ekv", tmp_path / "r.json"
    res = run(asan_run, art, "--prompt", PROMPT * 3, "--chat", "--question", "What sat?", "--max-new-tokens", 6,
              "--save-cache", snap, "--report", report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    first = json.loads(report.read_text())["answers"][0]["generated_ids"]
    res = run(asan_run, art, "--load-cache", snap, "--question", "What sat?", "--max-new-tokens", 6, "--report",
              report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(report.read_text())["answers"][0]["generated_ids"] == first
    if native.cli_path() is not None:
        plain = tmp_path / "plain.json"
        ref = subprocess.run([str(native.cli_path()), str(art), "--load-cache", str(snap), "--question", "What sat?",
                              "--max-new-tokens", "6", "--report", str(plain), "--quiet"], capture_output=True, text=True)
        assert ref.returncode == 0, ref.stderr
        assert json.loads(plain.read_text())["answers"][0]["generated_ids"] == first


def test_question_rows_under_asan(asan_run, tmp_path):
    """An artifact compiled with --question-rows (SnapKV++): the document read once per question,
    knowing it, the first question's state saved; clean under the sanitizers and equal to the
    release build; a question longer than the rows is refused with the fix."""
    art = _toy_artifact(tmp_path / "art", policy="snapkv++", args={"window": 4, "kernel": 3}, question_rows=24)
    snap, report = tmp_path / "doc.ekv", tmp_path / "r.json"
    ask = ["--prompt", PROMPT * 3, "--chat", "--question", "What sat?", "--question", "Where?", "--max-new-tokens", 6]
    res = run(asan_run, art, *ask, "--save-cache", snap, "--report", report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(report.read_text())
    assert data["document_reads"] == 2
    if native.cli_path() is not None:
        plain = tmp_path / "plain.json"
        ref = subprocess.run([str(native.cli_path()), str(art), *map(str, ask), "--report", str(plain), "--quiet"],
                             capture_output=True, text=True)
        assert ref.returncode == 0, ref.stderr
        assert [a["generated_ids"] for a in json.loads(plain.read_text())["answers"]] == \
            [a["generated_ids"] for a in data["answers"]]
    res = run(asan_run, art, "--prompt", PROMPT, "--chat", "--question", "why " * 40, "--max-new-tokens", 2, "--quiet")
    assert res.returncode != 0 and "--question-rows" in res.stderr, res.stderr


def test_reconstruct_document_under_asan(asan_run, tmp_path):
    """`--compress reconstruct` (runtime/src/reconstruct.c fills each block's rows from the program's
    repeat-prompt settings, here the toy tokenizer's chat form): a document longer than N read, a
    question answered, the cache saved and answered from again; clean under the sanitizers and equal to
    the release build."""
    art = _toy_artifact(tmp_path / "art", policy="reconstruct", args={"prompt_rows": 48})  # the toy BPE: 45 rows
    snap, report = tmp_path / "doc.ekv", tmp_path / "r.json"
    ask = ["--prompt", PROMPT * 3, "--chat", "--question", "What sat?", "--max-new-tokens", 6]
    res = run(asan_run, art, *ask, "--save-cache", snap, "--report", report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    first = json.loads(report.read_text())["answers"][0]["generated_ids"]
    res = run(asan_run, art, "--load-cache", snap, "--question", "What sat?", "--max-new-tokens", 6, "--report",
              report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(report.read_text())["answers"][0]["generated_ids"] == first
    # the document only, saved without a question (`--save-cache` alone), then asked from the file
    only = tmp_path / "only.ekv"
    res = run(asan_run, art, "--prompt", PROMPT * 3, "--chat", "--save-cache", only, "--quiet", timeout=300)
    assert res.returncode == 0 and only.stat().st_size > 0, res.stderr
    # several questions: each loads the file again (the report's snapshot strings outlive those loads)
    res = run(asan_run, art, "--load-cache", only, "--question", "What sat?", "--question", "Who sat?", "--question",
              "What sat?", "--max-new-tokens", 6, "--report", report, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(report.read_text())
    assert data["made_for_question"] == "" and len(data["answers"]) == 3
    assert data["answers"][0]["generated_ids"] == data["answers"][2]["generated_ids"] == first
    if native.cli_path() is not None:
        plain = tmp_path / "plain.json"
        ref = subprocess.run([str(native.cli_path()), str(art), *map(str, ask), "--report", str(plain), "--quiet"],
                             capture_output=True, text=True)
        assert ref.returncode == 0, ref.stderr
        assert json.loads(plain.read_text())["answers"][0]["generated_ids"] == first
