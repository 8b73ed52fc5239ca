"""Threads under load: the README's main job, idle and with busy processes beside it, before and
after edgekv's thread defaults (issue 18). Writes docs/results/threads.json and threads.md.

Each run is the real command line in its own process — `edgekv run` on the eager engine and,
with --artifact, on a compiled artifact — and its JSON report gives prefill and decode tok/s.
A *loaded* run is the same command with ``--busy`` processes (``python -c "while True: pass"``)
started beside it. *before* runs the code of ``--before-rev`` (exported with ``git archive``
into a temporary folder, imported instead of this checkout), *after* this checkout; both with
their default thread choice unless a row names ``--threads``.

    python tools/bench/measure_threads.py --artifact build/kd            # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import signal
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT_JSON = ROOT / "docs" / "results" / "threads.json"
OUT_MD = ROOT / "docs" / "results" / "threads.md"
DEMO = ROOT / "docs" / "results" / "demo.json"
BEFORE_REV = "f8f2f98"  # the tree issue 18 started from

# run the `edgekv` CLI of a given source tree (the editable install's finder would import this
# checkout whatever PYTHONPATH says, so it is taken out first)
BOOT = ("import sys\n"
        "tree = sys.argv.pop(1)\n"
        "if tree != '-':\n"
        "    sys.meta_path = [f for f in sys.meta_path if 'editable' not in type(f).__module__]\n"
        "    sys.path.insert(0, tree)\n"
        "    for m in [m for m in sys.modules if m == 'edgekv' or m.startswith('edgekv.')]:\n"
        "        del sys.modules[m]\n"
        "from edgekv.cli import app\n"
        "sys.argv[0] = 'edgekv'\n"
        "app()\n")


def export_tree(rev: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="edgekv-before-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "edgekv", "compile"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
    return d


def procs_running() -> int:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running"):
            return int(line.split()[1])
    return -1


def wait_quiet(max_wait_s: float, quiet_s: float = 3.0) -> dict:
    """Wait until no other process is runnable for ``quiet_s`` seconds in a row (the box is shared:
    another user's job would make an "idle" run a loaded one). Gives up after ``max_wait_s``."""
    from edgekv.threads import other_runnable

    t0 = time.time()
    quiet_since = None
    while time.time() - t0 < max_wait_s:
        if other_runnable() == 0:
            quiet_since = quiet_since or time.time()
            if time.time() - quiet_since >= quiet_s:
                return {"waited_s": round(time.time() - t0, 1), "quiet": True}
        else:
            quiet_since = None
        time.sleep(0.5)
    return {"waited_s": round(time.time() - t0, 1), "quiet": False}


def one_run(tree: str, argv: list[str], busy: int, timeout: int, env: dict | None = None,
            max_wait_s: float = 0) -> dict:
    report = Path(tempfile.mkstemp(prefix="edgekv-threads-", suffix=".json")[1])
    quiet = wait_quiet(max_wait_s) if max_wait_s > 0 else {"waited_s": 0, "quiet": None}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(1.0 if busy else 0.2)
        before = {"loadavg": os.getloadavg()[0], "procs_running": procs_running(), **quiet}
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:  # runnable tasks on the machine while the run runs
            while not stop.wait(0.25):
                samples.append(procs_running())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", BOOT, tree, *argv, "--report", str(report)],
                                  capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
        finally:
            stop.set()
            sampler.join()
        wall = time.perf_counter() - t0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip()[-600:], "wall_s": wall}
    data = json.loads(report.read_text())
    report.unlink()
    threads = data.get("threads") or {}
    ours = threads.get("count") or threads.get("torch") or data.get("torch_threads") or 1
    mean_running = statistics.mean(samples) if samples else None
    # other work during the run: what ran beyond this run's own threads and the busy processes (the
    # sampling thread of this tool counts too: one)
    background = max(0.0, mean_running - ours - busy - 1) if mean_running is not None else None
    before["mean_procs_running"] = mean_running
    before["background"] = background
    before["clean"] = background is not None and background <= 0.5
    return {"prefill_tok_s": data["prefill_tok_s"], "decode_tok_s": data["decode_tok_s"],
            "prefill_s": data["prefill_seconds"], "decode_s": data["decode_seconds"], "wall_s": wall,
            "prompt_tokens": data["prompt_tokens"], "generated_tokens": data["generated_tokens"],
            "threads": threads.get("count"), "threads_torch": threads.get("torch", data.get("torch_threads")),
            "threads_tvm": threads.get("tvm"), "thread_source": threads.get("source", "default (old code)"),
            "text": data.get("text", "")[:200], **before}


def median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, help="a host artifact of the main job (edgekv compile ... -o DIR)")
    ap.add_argument("--before-rev", default=BEFORE_REV)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside a loaded run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--extra-threads", default="1,2", help="after-code rows with these explicit --threads (eager)")
    ap.add_argument("--systems", default="eager,compiled", help="which systems' rows to run")
    ap.add_argument("--variant", action="append", default=[],
                    help="an extra after-code row: SYSTEM:ITEM[,ITEM] where an ITEM is ENV=VALUE or --option=VALUE "
                         "(e.g. compiled:--threads=2,TVM_BIND_THREADS=1), to compare a setting with edgekv's default")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--attempts", type=int, default=3,
                    help="runs per measurement until one had no other work beside it (background <= 0.5 runnable)")
    ap.add_argument("--wait-quiet", type=float, default=120,
                    help="before each run, wait up to this many seconds for no other runnable process (0: don't)")
    ap.add_argument("--json", type=Path, default=OUT_JSON)
    ap.add_argument("--md", type=Path, default=OUT_MD)
    args = ap.parse_args()

    from edgekv.evaluation.report import provenance

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # run the clean-up (busy processes, temp tree)
    choice = json.loads(DEMO.read_text())["choice"]
    job = ["--prompt-file", str(ROOT / "examples" / "long_document.txt"), "--chat",
           "--max-new-tokens", str(args.max_new_tokens)]
    eager = ["run", *job, "--budget", str(choice["budget"]), "--policy", choice["policy"]]
    configs = [("eager", "before", [], {}), ("eager", "after", [], {})]
    configs += [("eager", "after", ["--threads", t], {}) for t in args.extra_threads.split(",") if t]
    if args.artifact:
        configs += [("compiled", "before", [], {}), ("compiled", "after", [], {})]
    systems = args.systems.split(",")
    configs = [c for c in configs if c[0] in systems]
    for v in args.variant:
        system, _, items = v.partition(":")
        opts = [e for e in items.split(",") if e.startswith("--")]
        env = dict(e.split("=", 1) for e in items.split(",") if e and not e.startswith("--"))
        configs.append((system, "after", [x for o in opts for x in o.split("=", 1)], env))
    before_tree = export_tree(args.before_rev)
    rows = []
    plan = []
    for system, code, extra, env in configs:
        label = " ".join(extra) or "default"
        if env:
            label += " + " + " ".join(f"{k}={v}" for k, v in env.items())
        for busy in (0, args.busy):
            rows.append({"system": system, "code": code, "threads_option": label, "env": env, "busy": busy,
                         "runs": []})
            plan.append((rows[-1], system, code, extra, env))
    try:
        # interleaved (every configuration idle and loaded, then again): background work on a shared box
        # then drifts over all configurations alike instead of over some of them
        for rep in range(args.repeats):
            for row, system, code, extra, env in plan:
                argv = (eager if system == "eager" else ["run", str(args.artifact), *job]) + extra
                tree = str(before_tree) if code == "before" else "-"
                attempts = []
                for _ in range(args.attempts):  # again while other work ran beside it (shared box)
                    r = one_run(tree, argv, row["busy"], args.timeout, env, args.wait_quiet)
                    attempts.append(r)
                    if r.get("clean") or "error" in r:
                        break
                r = dict(attempts[-1], attempts=len(attempts),
                         discarded=[{k: a.get(k) for k in ("prefill_tok_s", "decode_tok_s", "background")}
                                    for a in attempts[:-1]])
                row["runs"].append(r)
                print(f"{system:<8} {code:<6} {row['threads_option']:<12} busy={row['busy']} #{rep}: "
                      + (f"prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s, "
                         f"threads {r['threads'] or r['threads_torch']} (tvm {r['threads_tvm']}), "
                         f"background {r['background']:.2f} (clean {r['clean']}, attempt {r['attempts']}), "
                         f"waited {r['waited_s']} s for quiet ({r['quiet']})"
                         if "error" not in r else f"ERROR {r['error']}"), flush=True)
        for row in rows:
            row.update({"prefill_tok_s": median(row["runs"], "prefill_tok_s"),
                        "decode_tok_s": median(row["runs"], "decode_tok_s"), "wall_s": median(row["runs"], "wall_s")})
    finally:
        subprocess.run(["rm", "-rf", str(before_tree)])
    result = {"command": "python tools/bench/measure_threads.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()},
              "commit": _commit(), "before_rev": args.before_rev, "job": eager, "artifact": str(args.artifact or ""),
              "busy": args.busy, "repeats": args.repeats, "rows": rows, "provenance": origin}
    result["summary"] = summary(rows)
    from edgekv.output_files import write_json_atomic

    write_json_atomic(args.json, result)
    args.md.write_text(markdown(result))
    print(f"wrote {args.json} and {args.md}")


def summary(rows: list[dict]) -> list[dict]:
    """Per configuration: idle and loaded speeds and loaded / idle ratios (prefill, decode)."""
    out = []
    keys = list(dict.fromkeys((r["system"], r["code"], r["threads_option"]) for r in rows))
    for k in keys:
        idle = next(r for r in rows if (r["system"], r["code"], r["threads_option"]) == k and r["busy"] == 0)
        loaded = next(r for r in rows if (r["system"], r["code"], r["threads_option"]) == k and r["busy"] > 0)

        def ratio(key):
            a, b = idle.get(key), loaded.get(key)
            return b / a if a and b else None

        out.append({"system": k[0], "code": k[1], "threads_option": k[2],
                    "idle_prefill": idle["prefill_tok_s"], "loaded_prefill": loaded["prefill_tok_s"],
                    "idle_decode": idle["decode_tok_s"], "loaded_decode": loaded["decode_tok_s"],
                    "prefill_ratio": ratio("prefill_tok_s"), "decode_ratio": ratio("decode_tok_s"),
                    "wall_ratio": (loaded["wall_s"] / idle["wall_s"]) if idle.get("wall_s") and loaded.get("wall_s")
                    else None,
                    "threads_idle": [r.get("threads") or r.get("threads_torch") for r in idle["runs"]],
                    "threads_loaded": [r.get("threads") or r.get("threads_torch") for r in loaded["runs"]]})
    return out


def _cpu() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _commit() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "edgekv"], capture_output=True,
                               text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def markdown(res: dict) -> str:
    f = lambda v, d=0: "—" if v is None else f"{v:,.{d}f}"  # noqa: E731
    L = ["# Threads: idle and loaded (issue 18)", "",
         "<!-- generated by tools/bench/measure_threads.py from docs/results/threads.json; do not edit by hand -->", "",
         f"Command: `{res['command']}` on {res['date']}, {res['machine']['cpu']} ({res['machine']['cores']} cores), "
         f"commit {res['commit']}. The job: `edgekv {' '.join(res['job'][:1])} --prompt-file examples/long_document.txt "
         f"{' '.join(res['job'][3:])}`" + (f"; compiled: `edgekv run {res['artifact']} ...` with the same prompt"
                                            if res["artifact"] else "") + ". "
         f"*Loaded* = {res['busy']} busy process(es) (`python -c \"while True: pass\"`) beside the run. *before* = "
         f"the code at {res['before_rev']} (torch with all cores and its OpenMP defaults; TVM's own pool size), "
         f"*after* = this tree (edgekv/threads.py). Medians of {res['repeats']} runs. The box is shared: each run "
         "first waits for no other runnable process, and is repeated (up to a limit) when other work ran beside "
         "it — `background`, the mean number of other runnable tasks during the run, and `clean` (≤ 0.5) per run "
         f"in the JSON: {sum(1 for r in res['rows'] for x in r['runs'] if x.get('clean'))} of "
         f"{sum(len(r['runs']) for r in res['rows'])} kept runs are clean.", "",
         "| system | code | --threads | threads used (idle / loaded) | prefill tok/s idle | loaded | loaded/idle | "
         "decode tok/s idle | loaded | loaded/idle |",
         "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in res["summary"]:
        L.append(f"| {s['system']} | {s['code']} | {s['threads_option']} | "
                 f"{'/'.join(map(str, s['threads_idle']))} · {'/'.join(map(str, s['threads_loaded']))} | "
                 f"{f(s['idle_prefill'])} | {f(s['loaded_prefill'])} | {f(s['prefill_ratio'], 2)} | "
                 f"{f(s['idle_decode'], 1)} | {f(s['loaded_decode'], 1)} | {f(s['decode_ratio'], 2)} |")
    after = [s for s in res["summary"] if s["code"] == "after" and s["threads_option"] == "default"]
    worst = min((min(x for x in (s["prefill_ratio"], s["decode_ratio"]) if x is not None) for s in after),
                default=None)
    L += ["", "Rows with `+ ENV=VALUE` or an explicit `--threads` are the alternatives the defaults were chosen "
              "against (same job, same interleaving). *Loaded* with an explicit thread count emulates load that "
              "arrives after the thread choice (the default choice sees a busy process that is already there)."]
    L += ["", f"Goal: a loaded run of the main job within 2× of an idle one with the defaults — the worst "
              f"loaded/idle ratio of the *after* defaults is {f(worst, 2)} "
              f"({'met' if worst is not None and worst >= 0.5 else 'not met'}).", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
