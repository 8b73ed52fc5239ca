"""The test suite's cost, test by test: wall time and CPU time (this process and the processes it
waited for: native builds, `edgekv-run`, eval workers) of every setup / call / teardown, summed by
file, written as JSON and a Markdown table.

    python -m tools.bench.suite_durations                       # the default suite (addopts)
    python -m tools.bench.suite_durations -- -m slow tests/test_opencl.py
    python -m tools.bench.suite_durations --out /tmp/suite -- tests/test_quantized.py

CPU seconds are the figure to compare on a shared machine: wall time grows with the machine's
load, CPU time much less (the load average at the start and end is recorded beside them). Writes
``<out>.json`` and ``<out>.md`` (default ``docs/results/suite_durations``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Recorder:
    """A pytest plugin: wall and CPU seconds of each phase of each test."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def _phase(self, item, phase):
        row = self.rows.setdefault(item.nodeid, {"test": item.nodeid, "file": item.nodeid.split("::")[0],
                                                 "outcome": "passed"})
        w0, c0 = time.perf_counter(), _cpu()
        yield
        row[f"{phase}_wall_s"] = round(time.perf_counter() - w0, 3)
        row[f"{phase}_cpu_s"] = round(_cpu() - c0, 3)


def _plugin():
    import pytest

    rec = Recorder()

    class Plugin:
        rows = rec.rows

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_setup(self, item):
            yield from rec._phase(item, "setup")

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            yield from rec._phase(item, "call")

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_teardown(self, item):
            yield from rec._phase(item, "teardown")

        def pytest_runtest_logreport(self, report):
            row = rec.rows.get(report.nodeid)
            if row is not None and report.outcome != "passed" and row["outcome"] == "passed":
                row["outcome"] = report.outcome

    return Plugin()


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
    plugin = _plugin()
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    code = pytest.main(["-p", "no:cacheprovider", *pytest_args], plugins=[plugin])
    data = {"provenance": prov, "pytest_args": pytest_args, "exit_code": int(code),
            "run_wall_s": round(time.perf_counter() - t0, 1), "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}
    rows = list(plugin.rows.values())
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
