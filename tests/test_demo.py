"""The README's first command (issue 18): it is the main job that tools/results/pick_demo.py chose by
measurement, the example prompt is the one that tool wrote, and — on the real model — it
prints a right answer under a budget that evicts, with what the budget saved."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from tools.results import make_example_prompt as mep

ROOT = Path(__file__).resolve().parent.parent
CHOICE = json.loads((ROOT / "docs" / "results" / "demo.json").read_text())["choice"]


def readme_first_command() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up on a fresh machine.*?```\n(.*?)```", text, re.S).group(1)
    return block.strip().split(" && ", 1)[1]


def test_readme_runs_the_measured_choice():
    assert readme_first_command() == CHOICE["command"]
    assert CHOICE["budget"] < CHOICE["prompt_tokens"] / 2  # a real budget: most of the prompt is evicted
    assert all(v["right"] for v in CHOICE["verified"])


def test_example_prompt_is_the_chosen_candidate():
    expected = mep.build(CHOICE["document_tokens"], CHOICE["question"])
    assert (ROOT / "examples" / "long_document.txt").read_text() == expected


def test_readme_main_job_answers_right_under_its_budget(smol, tmp_path):
    from edgekv.cli import app

    args = readme_first_command().split()[2:]  # after "edgekv run"
    args = [str(ROOT / a) if a.startswith("examples/") else a for a in args]
    report = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["run", *args, "-o", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    question = mep.QUESTIONS_BY_ID[CHOICE["question"]]
    assert question.is_right(data["text"]), data["text"]
    assert result.stdout.startswith(data["text"])  # the answer is what the console shows first
    assert max(data["cache_lengths"]) <= CHOICE["budget"] < data["prompt_tokens"]
    saved = data["memory"]["vs_full_cache"]
    assert saved["kv_cache"] < saved["full_cache"] and saved["saved_fraction"] > 0.5
    assert "% saved" in " ".join(result.stderr.split())
