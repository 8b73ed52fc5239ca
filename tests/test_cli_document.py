"""Read a document once, ask many questions, through the CLI (issue 20): `edgekv run --question
... --save-cache`, `edgekv ask`, `edgekv run --load-cache`, for the eager engine and a compiled
artifact in both of its runtimes. An answer from a saved cache equals the answer of one
uninterrupted run of the same document and question; bad input is refused before any work."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from edgekv.artifact import snapshot_file as sf
from edgekv.cli import app

runner = CliRunner()
DOC = "The cat sat on the mat. The dog lay by the door. " * 12
QUESTIONS = ["Where is the cat?", "Who lay by the door?", "What sat on the mat?"]
SETTINGS = ["--budget", "32", "--block", "8"]
# the artifacts here are compiled for this CPU at LLVM opt-level 0 (what is checked is the document
# path, not the machine code; half the compile time of the host profile's opt-level 3)
HOST_FAST = {"name": "host-test", "target": {"kind": "llvm", "opt-level": 0, "num-cores": 2}}


def fast_target(root) -> list[str]:
    path = root / "host-test.json"
    path.write_text(json.dumps(HOST_FAST))
    return ["--target", str(path)]


def cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join((result.stdout + result.stderr).split())


def answers(report_path) -> list[list[int]]:
    return [a["generated_ids"] for a in json.loads(report_path.read_text())["document"]["answers"]]


def refused(code, text, message, *unwritten):
    assert code == 2, text
    assert message in text, text
    assert "Traceback" not in text
    for path in unwritten:
        assert not path.exists(), path


@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("doc") / "doc.txt"
    p.write_text(DOC)
    return p


def test_eager_save_then_ask_equals_one_uninterrupted_run(tiny_dir, doc_file, tmp_path):
    snap = tmp_path / "doc.ekv"
    code, text = cli("run", tiny_dir, "--prompt-file", doc_file, *SETTINGS, *sum((["--question", q] for q in QUESTIONS), []),
                     "--max-new-tokens", 6, "--save-cache", snap, "-o", tmp_path / "all.json")
    assert code == 0, text
    together = answers(tmp_path / "all.json")
    assert len(together) == 3 and all(len(a) == 6 for a in together)
    header = sf.read_header(snap)
    assert header.made_from == str(tiny_dir.resolve()) and header.document_seconds > 0 and not header.chat
    for i, q in enumerate(QUESTIONS):  # each question alone, from a fresh process state
        code, text = cli("run", tiny_dir, "--prompt-file", doc_file, *SETTINGS, "--question", q, "--max-new-tokens", 6,
                         "-o", tmp_path / f"one{i}.json")
        assert code == 0, text
        assert answers(tmp_path / f"one{i}.json") == [together[i]]
    # `ask` finds the model by itself; `run --load-cache` is the same thing
    code, text = cli("ask", snap, "--question", QUESTIONS[2], "--question", QUESTIONS[0], "--max-new-tokens", 6,
                     "-o", tmp_path / "ask.json")
    assert code == 0, text
    assert answers(tmp_path / "ask.json") == [together[2], together[0]]
    report = json.loads((tmp_path / "ask.json").read_text())["document"]
    assert report["loaded_cache"] == str(snap) and report["document_prefill_seconds"] == 0
    assert all(a["load_seconds"] > 0 for a in report["answers"]) and len(report["time_to_first_token"]) == 2
    code, text = cli("run", tiny_dir, "--load-cache", snap, "--question", QUESTIONS[1], "--max-new-tokens", 6,
                     "-o", tmp_path / "load.json")
    assert code == 0, text
    assert answers(tmp_path / "load.json") == [together[1]]


def test_eager_bad_document_options(tiny_dir, doc_file, tmp_path):
    snap = tmp_path / "doc.ekv"
    assert cli("run", tiny_dir, "--prompt-file", doc_file, *SETTINGS, "--max-new-tokens", 2, "--save-cache", snap)[0] == 0
    out = tmp_path / "r.json"
    refused(*cli("run", tiny_dir, "--load-cache", snap, "--prompt", "x", "--question", "q", "-o", out),
            "--load-cache holds the document already: drop --prompt/--prompt-file", out)
    refused(*cli("ask", snap, "-o", out), "give at least one --question", out)
    refused(*cli("run", tiny_dir, "--prompt-file", doc_file, "--question", "  ", "-o", out), "--question is empty", out)
    refused(*cli("run", tiny_dir, "--load-cache", snap, "--save-cache", tmp_path / "b.ekv", "--question", "q"),
            "give --save-cache or --load-cache, not both", tmp_path / "b.ekv")
    refused(*cli("ask", tmp_path / "missing.ekv", "--question", "q"), "does not exist")
    refused(*cli("ask", doc_file, "--question", "q"), "is not an edgekv cache snapshot")
    refused(*cli("run", tiny_dir, "--load-cache", snap, "--budget", "64", "--question", "q", "-o", out),
            "was made at N = 32, B = 8; this run has N = 64", out)
    refused(*cli("run", tiny_dir, "--load-cache", snap, "--policy", "lagkv", "--question", "q", "-o", out),
            "was made with policy keydiff", out)
    refused(*cli("run", tiny_dir, "--load-cache", snap, "--chat", "--question", "q", "-o", out),
            "holds a document read without the chat template: ask without --chat", out)
    folder = tmp_path / "no-such-folder" / "doc.ekv"
    refused(*cli("run", tiny_dir, "--prompt-file", doc_file, "--save-cache", folder), "--save-cache", folder)
    corrupt = tmp_path / "corrupt.ekv"
    data = bytearray(snap.read_bytes())
    data[-10] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    refused(*cli("ask", corrupt, "--question", "q", "-o", out), "fails its checksum", out)


tvm = pytest.importorskip("tvm")


@pytest.fixture(scope="module")
def artifact(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("doc-art") / "art"
    code, text = cli("compile", tiny_dir, *SETTINGS, *fast_target(out.parent), "-o", out)
    assert code == 0, text
    return out


@pytest.mark.parametrize("runtime", ["native", "tvm"])
def test_compiled_save_then_ask_equals_one_uninterrupted_run(artifact, doc_file, tmp_path, runtime):
    from edgekv.runtime import native

    if runtime == "native" and not native.available():
        pytest.skip("the native runtime is not built (pip install -e .)")
    snap = tmp_path / "doc.ekv"
    code, text = cli("run", artifact, "--prompt-file", doc_file, *sum((["--question", q] for q in QUESTIONS[:2]), []),
                     "--max-new-tokens", 6, "--save-cache", snap, "-o", tmp_path / "all.json", "--runtime", runtime)
    assert code == 0, text
    together = answers(tmp_path / "all.json")
    assert json.loads((tmp_path / "all.json").read_text())["runtime"] == runtime
    code, text = cli("run", artifact, "--prompt-file", doc_file, "--question", QUESTIONS[1], "--max-new-tokens", 6,
                     "-o", tmp_path / "one.json", "--runtime", runtime)
    assert code == 0, text
    assert answers(tmp_path / "one.json") == [together[1]]
    assert sf.read_header(snap).made_from == str(artifact.resolve())
    for other in ("native", "tvm"):  # a snapshot from one runtime answers in the other
        if other == "native" and not native.available():
            continue
        code, text = cli("ask", snap, "--question", QUESTIONS[1], "--max-new-tokens", 6, "-o", tmp_path / "ask.json",
                         "--runtime", other)
        assert code == 0, text
        assert answers(tmp_path / "ask.json") == [together[1]]


def test_compiled_snapshot_needs_its_artifact(artifact, doc_file, tiny_dir, tmp_path):
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(artifact, moved)
    snap = tmp_path / "doc.ekv"
    assert cli("run", moved, "--prompt-file", doc_file, "--max-new-tokens", 2, "--save-cache", snap)[0] == 0
    shutil.rmtree(moved)
    out = tmp_path / "r.json"
    refused(*cli("ask", snap, "--question", "q", "-o", out),
            "was made with a compiled artifact", out)
    refused(*cli("ask", snap, "--question", "q", "--model", tiny_dir, "-o", out),
            "was made with a compiled artifact", out)
    code, text = cli("ask", snap, "--question", "q", "--model", artifact, "--max-new-tokens", 2)  # the same program
    assert code == 0, text
    eager = tmp_path / "eager.ekv"
    assert cli("run", tiny_dir, "--prompt-file", doc_file, *SETTINGS, "--max-new-tokens", 2, "--save-cache", eager)[0] == 0
    refused(*cli("ask", eager, "--question", "q", "--model", artifact, "-o", out),
            "was made by the eager engine", out)


@pytest.fixture(scope="module")
def question_artifact(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("question-art") / "art"
    code, text = cli("compile", tiny_dir, *SETTINGS, *fast_target(out.parent), "--policy", "snapkv",
                     "--policy-arg", "window=4",
                     "--question-rows", 32, "-o", out)
    assert code == 0, text
    assert "question rows" in text
    return out


@pytest.mark.parametrize("runtime", ["native", "tvm"])
def test_compiled_question_rows_answer_as_the_eager_engine(question_artifact, tiny_dir, doc_file, tmp_path, runtime):
    """`edgekv run ARTIFACT --question` on an artifact compiled with --question-rows reads the
    document once per question, knowing it, and answers with the eager engine's tokens."""
    from edgekv.runtime import native

    if runtime == "native" and not native.available():
        pytest.skip("the native runtime is not built (pip install -e .)")
    asked = sum((["--question", q] for q in QUESTIONS[:2]), [])
    code, text = cli("run", question_artifact, "--prompt-file", doc_file, *asked, "--max-new-tokens", 6,
                     "-o", tmp_path / "c.json", "--runtime", runtime)
    assert code == 0, text
    assert "compiled without --question-rows" not in text
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["question_scoring"] is True and report["document"]["document_reads"] == 2
    code, text = cli("run", tiny_dir, "--prompt-file", doc_file, *asked, "--max-new-tokens", 6, *SETTINGS,
                     "--policy", "snapkv", "--policy-arg", "window=4", "-o", tmp_path / "e.json")
    assert code == 0, text
    assert answers(tmp_path / "c.json") == answers(tmp_path / "e.json")
    # a question longer than the artifact's rows: refused before reading, with the limit and the fix
    code, text = cli("run", question_artifact, "--prompt-file", doc_file, "--question", "why " * 40,
                     "--max-new-tokens", 2, "-o", tmp_path / "x.json", "--runtime", runtime)
    refused(code, text, "was compiled for questions of at most 32", tmp_path / "x.json")
    assert "--question-rows" in text


def test_artifact_without_question_rows_warns_and_runs(artifact, doc_file, tmp_path):
    code, text = cli("run", artifact, "--prompt-file", doc_file, "--question", QUESTIONS[0], "--max-new-tokens", 2,
                     "--policy", "keydiff", "-o", tmp_path / "r.json")
    assert code == 0, text  # keydiff is query-agnostic: no warning
    assert "question-rows" not in text
