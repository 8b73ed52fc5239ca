"""tools/results/results_accuracy.py: the accuracy notes quote numbers only through {{...}} fields filled
from the eval JSON, and a field that matches nothing stops the regeneration."""

from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _tool():
    from tools.results import results_accuracy

    return results_accuracy


def _row(policy, budget, length, prompt, correct, retention):
    return {"task": "passkey", "mode": "block", "block": 128, "policy": policy, "budget": budget,
            "length_target": length, "prompt_id": prompt, "correct": correct, "agrees_with_full": correct,
            "needle_retention": retention, "no_eviction": False, "error": None}


ROWS = [_row("keydiff", 512, 4096, "p1", True, 1.0), _row("keydiff", 512, 4096, "p2", False, 0.5),
        _row("keydiff", 1024, 7168, "p3", False, 0.0), _row("snapkv", 512, 4096, "p1", False, 0.25),
        {**_row("snapkv", 512, 4096, "p2", False, 0.0), "error": "boom"}]


def test_a_field_averages_budgets_as_the_tables_do():
    """Each budget's mean first, then their mean: an errored run does not tilt the figure."""
    rows = [_row("tova", 512, 4096, "p1", True, 1.0), _row("tova", 512, 4096, "p2", True, 1.0),
            _row("tova", 1024, 4096, "p1", False, 0.0),
            {**_row("tova", 1024, 4096, "p2", False, 0.0), "error": "boom"}]
    assert _tool().fill_notes("{{passkey block accuracy tova}}", {"results": rows}) == "50 %"


def test_committed_accuracy_section_is_its_json_and_notes(tmp_path):
    """docs/results/accuracy.md is what the tool makes from the committed runs and notes (the
    command in tools/results/run_accuracy_sweeps.sh): no hand edit, no stale figure."""
    pytest.importorskip("matplotlib")
    ra = _tool()
    res = RESULTS
    runs = ["passkey_block", "passkey_block_seed1", "passkey_block_long", "passkey_block_7k", "passkey_one",
            "fidelity_block", "multikey_block"]
    out = tmp_path / "accuracy.md"
    ra.main([*(str(res / f"accuracy_{r}.json") for r in runs), "--notes", str(res / "accuracy_notes.md"),
             "-o", str(out)])
    assert out.read_text() == (res / "accuracy.md").read_text()


def test_notes_fields_are_filled_from_the_rows():
    ra = _tool()
    text = ("kd {{passkey block accuracy keydiff}} at 4K {{passkey block accuracy keydiff L=4096}}, "
            "retention {{ passkey block needle_retention snapkv N=512 }}; {{passkey block prompts}} prompts, "
            "{{passkey block prompts L=7168}} at 7K")
    assert ra.fill_notes(text, {"results": ROWS}) == ("kd 25 % at 4K 50 %, retention 25 %; 3 prompts, 1 at 7K")


@pytest.mark.parametrize("field, says", [
    ("{{passkey block accuracy tova}}", "matches no run"),
    ("{{passkey block accuracy keydiff L=2048}}", "matches no run"),
    ("{{passkey block speed keydiff}}", "the metric is one of"),
    ("{{passkey block}}", "cannot read"),
    ("{{passkey block accuracy keydiff B=128}}", "cannot read"),
    ("{{passkey block accuracy {keydiff}}", "malformed"),
    ("{{passkey block accuracy keydiff}", "malformed"),
])
def test_a_notes_field_that_matches_nothing_stops_the_section(field, says):
    with pytest.raises(SystemExit, match=says):
        _tool().fill_notes(f"x {field} y", {"results": ROWS})
