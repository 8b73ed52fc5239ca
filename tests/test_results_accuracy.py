"""tools/results_accuracy.py: the accuracy notes quote numbers only through {{...}} fields filled
from the eval JSON, and a field that matches nothing stops the regeneration."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "results_accuracy.py"


def _tool():
    spec = importlib.util.spec_from_file_location("results_accuracy", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(policy, budget, length, prompt, correct, retention):
    return {"task": "passkey", "mode": "block", "policy": policy, "budget": budget, "length_target": length,
            "prompt_id": prompt, "correct": correct, "needle_retention": retention, "error": None}


ROWS = [_row("keydiff", 512, 4096, "p1", True, 1.0), _row("keydiff", 512, 4096, "p2", False, 0.5),
        _row("keydiff", 1024, 7168, "p3", False, 0.0), _row("snapkv", 512, 4096, "p1", False, 0.25),
        {**_row("snapkv", 512, 4096, "p2", False, 0.0), "error": "boom"}]


def test_notes_fields_are_filled_from_the_rows():
    ra = _tool()
    text = ("kd {{passkey block accuracy keydiff}} at 4K {{passkey block accuracy keydiff L=4096}}, "
            "retention {{ passkey block needle_retention snapkv N=512 }}; {{passkey block prompts}} prompts, "
            "{{passkey block prompts L=7168}} at 7K")
    assert ra.fill_notes(text, {"results": ROWS}) == ("kd 33 % at 4K 50 %, retention 25 %; 3 prompts, 1 at 7K")


@pytest.mark.parametrize("field, says", [
    ("{{passkey block accuracy tova}}", "matches no run"),
    ("{{passkey block accuracy keydiff L=2048}}", "matches no run"),
    ("{{passkey block speed keydiff}}", "the metric is one of"),
    ("{{passkey block}}", "cannot read"),
    ("{{passkey block accuracy keydiff B=128}}", "cannot read"),
])
def test_a_notes_field_that_matches_nothing_stops_the_section(field, says):
    with pytest.raises(SystemExit, match=says):
        _tool().fill_notes(f"x {field} y", {"results": ROWS})
