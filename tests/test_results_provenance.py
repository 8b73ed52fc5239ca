"""Every tool that writes a results JSON records where it came from (quick tier, structural).

A tool under tools/ whose source writes a JSON file must call
``edgekv.evaluation.report.provenance(...)`` (the command, the commit, when, the machine) and put
it in what it writes; a tool that writes only scratch JSON (a temporary report it reads back) is
listed in EXEMPT with the reason. The check reads the sources only: no tool is run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
# what writing a JSON file looks like in tools/: json.dumps into a file, json.dump, or edgekv's writers
WRITES_JSON = re.compile(r"write_text\(\s*json\.dumps|json\.dump\(|write_json_atomic\(|write_json\(")
# tool path under tools/ (e.g. "bench/x.py") -> why it writes no results JSON (scratch files only)
EXEMPT: dict[str, str] = {}


def _writers() -> list[str]:
    return sorted(p.relative_to(TOOLS).as_posix() for p in TOOLS.rglob("*.py") if WRITES_JSON.search(p.read_text()))


def test_the_scan_finds_the_results_writers():
    # a few known writers of docs/results/*.json, one per kind of tool: the pattern still sees them
    assert {"experiments/check_kv_int8.py", "results/pick_demo.py", "bench/measure_threads.py",
            "bench/bench_snapshot.py"} <= set(_writers())


@pytest.mark.parametrize("tool", [t for t in _writers() if t not in EXEMPT])
def test_results_writer_records_provenance(tool):
    assert "provenance(" in (TOOLS / tool).read_text(), (
        f"tools/{tool} writes a JSON file but records no provenance: add "
        "edgekv.evaluation.report.provenance([sys.executable, *sys.argv]), captured before the run, to what it "
        "writes (or list it in EXEMPT with the reason if it writes scratch JSON only)")


def test_exemptions_are_current():
    for tool, reason in EXEMPT.items():
        path = TOOLS / tool
        assert path.is_file(), f"EXEMPT names tools/{tool}, which is gone"
        assert reason.strip(), f"EXEMPT[{tool!r}] needs a reason"
        assert WRITES_JSON.search(path.read_text()), f"tools/{tool} writes no JSON any more: drop it from EXEMPT"
