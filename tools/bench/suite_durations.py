"""The test suite's cost, test by test: wall time and CPU time (this process and the processes it
waited for: native builds, `edgekv-run`, eval workers) of every setup / call / teardown, summed by
file, written as JSON and a Markdown table.

    python -m tools.bench.suite_durations                       # the default suite (addopts), serial
    python -m tools.bench.suite_durations -- -n 2 --dist loadfile   # as the README runs it (pytest-xdist)
    python -m tools.bench.suite_durations -- -m slow tests/test_opencl.py
    python -m tools.bench.suite_durations --out /tmp/suite -- tests/test_quantized.py

CPU seconds are the figure to compare on a shared machine: wall time grows with the machine's
load, CPU time much less (the load average at the start and end is recorded beside them). Writes
``<out>.json`` and ``<out>.md`` (default ``docs/results/suite_durations``). Under xdist the run's wall
time is the figure CI sees; the tests' summed wall is more (the workers overlap). tests/conftest.py
reads the default JSON's per-file CPU seconds to hand the costliest files to xdist's workers first."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# This module is also the pytest plugin (``-p tools.bench.suite_durations``), so that under
# pytest-xdist (``-- -n 2 --dist loadfile``) every worker loads it too: the process that runs a phase
# (setup / call / teardown) measures its CPU seconds and sends them in the phase's report
# (``user_properties``), and the process that reports (xdist's controller, or the only process of a
# serial run) gathers each report's wall seconds (its ``duration``) and CPU seconds into ``ROWS``.
_PHASE_CPU = "suite_durations_cpu_s"
ROWS: dict[str, dict] = {}
_phase_cpu: dict[tuple[str, str], float] = {}


def _measured(item, phase):
    c0 = _cpu()
    try:
        return (yield)
    finally:
        _phase_cpu[(item.nodeid, phase)] = _cpu() - c0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _measured(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _measured(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _measured(item, "teardown"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cpu = _phase_cpu.pop((item.nodeid, call.when), None)
    if cpu is not None:
        report.user_properties.append((_PHASE_CPU, round(cpu, 3)))
    return report


def pytest_runtest_logreport(report):
    row = ROWS.setdefault(report.nodeid, {"test": report.nodeid, "file": report.nodeid.split("::")[0],
                                          "outcome": "passed"})
    row[f"{report.when}_wall_s"] = round(report.duration, 3)
    cpu = dict(report.user_properties).get(_PHASE_CPU)
    if cpu is not None:
        row[f"{report.when}_cpu_s"] = cpu
    if report.outcome != "passed" and row["outcome"] == "passed":
        row["outcome"] = report.outcome


def summarize(rows: list[dict]) -> dict:
    for r in rows:
        r["wall_s"] = round(sum(r.get(f"{p}_wall_s", 0.0) for p in ("setup", "call", "teardown")), 3)
        r["cpu_s"] = round(sum(r.get(f"{p}_cpu_s", 0.0) for p in ("setup", "call", "teardown")), 3)
    by_file: dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0, "setup_wall_s": 0.0})
    for r in rows:
        f = by_file[r["file"]]
        f["tests"] += 1
        f["wall_s"] += r["wall_s"]
        f["cpu_s"] += r["cpu_s"]
        f["setup_wall_s"] += r.get("setup_wall_s", 0.0)
    files = sorted(({"file": k, **{n: round(v, 2) if isinstance(v, float) else v for n, v in d.items()}}
                    for k, d in by_file.items()), key=lambda d: -d["wall_s"])
    return {"tests": sorted(rows, key=lambda r: -r["wall_s"]), "files": files,
            "total_wall_s": round(sum(r["wall_s"] for r in rows), 1),
            "total_cpu_s": round(sum(r["cpu_s"] for r in rows), 1)}


def markdown(data: dict, top: int) -> str:
    lines = ["# Test suite durations", "",
             f"`{data['provenance']['command']}` at {data['provenance']['commit']}, "
             f"{data['provenance']['started']}; {data['count']} tests, {data['outcomes']}; run wall "
             f"{data['run_wall_s']} s; sum of test wall {data['total_wall_s']} s, CPU {data['total_cpu_s']} s "
             f"({os.cpu_count()} cores; load average {data['load_before']} before, {data['load_after']} after: "
             "wall times grow with the load, CPU times much less).", "",
             "## By file", "", "| file | tests | wall s | CPU s | of which setup wall s |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {f['file']} | {f['tests']} | {f['wall_s']} | {f['cpu_s']} | {f['setup_wall_s']} |" for f in data["files"]]
    lines += ["", f"## The {top} longest tests (setup + call + teardown)", "",
              "| test | wall s | CPU s | setup wall s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['test']} | {r['wall_s']} | {r['cpu_s']} | {r.get('setup_wall_s', 0.0)} |"
              for r in data["tests"][:top]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import pytest

    from edgekv.evaluation.report import provenance

    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/suite_durations", help="writes OUT.json and OUT.md")
    ap.add_argument("--top", type=int, default=40, help="tests in the Markdown table")
    args = ap.parse_args(ours)
    prov = provenance([sys.executable, "-m", "tools.bench.suite_durations", *argv])
    import importlib

    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    code = pytest.main(["-p", "no:cacheprovider", "-p", "tools.bench.suite_durations", *pytest_args])
    data = {"provenance": prov, "pytest_args": pytest_args, "exit_code": int(code),
            "run_wall_s": round(time.perf_counter() - t0, 1), "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}
    # the module -p loaded (imported after the run, so that pytest could load it itself), not __main__
    rows = list(importlib.import_module("tools.bench.suite_durations").ROWS.values())
    data["count"] = len(rows)
    outcomes: dict[str, int] = defaultdict(int)
    for r in rows:
        outcomes[r["outcome"]] += 1
    data["outcomes"] = dict(outcomes)
    data.update(summarize(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(data, args.top))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}: {data['count']} tests, "
          f"sum wall {data['total_wall_s']} s, CPU {data['total_cpu_s']} s, run {data['run_wall_s']} s")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
