"""Regenerate docs/results/simulate.md (+ simulate_sweep.png, simulate.json, simulate_sweep.json).

Runs `edgekv simulate` on SmolLM2-135M with a ~16.5K-token natural-text prompt (past the
model's 8K window, by --allow-beyond-context) under a 1.5 GiB cap, once with KeyDiff at
N = 512 and once with the full cache, and writes the section for docs/RESULTS.md from the
JSON the command wrote. The prompt is CPython's own `pydoc_data.topics` text (offline).

    nice -n 10 python tools/results/results_simulate.py              # run (several minutes on 2 cores)
    python tools/results/results_simulate.py --from-json             # sweep, plot and .md from the last JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results"
GiB = 2**30


def long_prompt(target_tokens: int, count=None) -> str:
    """Natural English from the Python reference (topics in sorted order) + a question about the
    start; ``count`` (text → tokens) stops it just past ``target_tokens`` (else ~1.7 tokens a word)."""
    from pydoc_data.topics import topics

    count = count or (lambda text: int(len(text.split()) * 1.7))
    head = "Read the following excerpt of the Python language reference.\n\n"
    tail = "\n\nQuestion: according to the first section of the excerpt, what is it about? Answer briefly.\nAnswer:"
    parts, tokens = [], 0
    for key in sorted(topics):
        text = topics[key].strip()
        n = count(text) + 2
        if tokens + n > target_tokens:  # cut the last section at a paragraph to land just past the target
            paras, kept = text.split("\n\n"), []
            for para in paras:
                kept.append(para)
                if tokens + count("\n\n".join(kept)) > target_tokens:
                    break
            parts.append("\n\n".join(kept))
            break
        parts.append(text)
        tokens += n
    return head + "\n\n".join(parts) + tail


def run(args) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
        from edgekv.simulate.source import describe

        tok = describe(args.model).tokenizer
        fh.write(long_prompt(args.tokens, (lambda t: len(tok(t)["input_ids"])) if tok is not None else None))
        prompt_file = fh.name
    # -S passes on: a run from a worktree (PYTHONPATH, no site) must not import an editable install's tree
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-c", "from edgekv.cli import app; app()",
           "simulate", args.model,
           "--prompt-file", prompt_file, "--allow-beyond-context", "--mem-limit", args.mem_limit,
           "--policy", args.policies, "--budget", args.budget, "--max-new-tokens", str(args.max_new_tokens),
           "--report", str(OUT / "simulate.json"), "--sweep-json", str(OUT / "simulate_sweep.json"),
           "--plot", str(OUT / "simulate_sweep.png"), "--all-units"]
    shown = ["edgekv", "simulate", args.model, "--prompt-file", "<16.5K-token text>", *cmd[cmd.index("--prompt-file") + 2:]]
    shown = [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c for c in shown]
    env = {**os.environ, "COLUMNS": "150"}
    from edgekv.evaluation.report import provenance

    # simulate.json gets the same provenance as every results file (the command it ran, its commit),
    # taken before the run writes into docs/results (which would mark the tree dirty)
    origin = {**provenance([sys.executable, *sys.argv]), "simulate_command": " ".join(shown)}
    t0 = time.time()
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    report = OUT / "simulate.json"
    if report.is_file():
        report.write_text(json.dumps({**json.loads(report.read_text()), "provenance": origin}, indent=2))
    meta = {"command": " ".join(shown), "commit": origin["commit"], "wall_s": round(time.time() - t0),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "nice": os.nice(0)}
    (OUT / "simulate_meta.json").write_text(json.dumps(meta, indent=2))
    os.unlink(prompt_file)
    (OUT / "simulate_console.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode not in (0, 1):  # 1: a run did not fit its cap (a result; the report is written)
        sys.exit(f"edgekv simulate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"simulate finished in {time.time() - t0:.0f} s")


def mib(n) -> str:
    return "—" if n is None else f"{n / 2**20:,.0f} MiB"


def all_units(rep: dict):
    """Roofline estimates on every unit of every device for the runs in the report (arithmetic only)."""
    from edgekv.simulate.profiles import load_profile
    from edgekv.simulate.roofline import estimate
    from edgekv.simulate.source import describe
    from edgekv.simulate.work import GeometryWork, Schedule

    work = GeometryWork(describe(rep["model"]).config)
    rows = []
    for name in rep["devices"]:
        prof = load_profile(name)
        for unit in prof.units:
            cells, prec = [], ""
            for r in rep["runs"]:
                sched = Schedule(rep["prompt_tokens"], rep["max_new_tokens"], r["budget"], rep["block"], r["policy"] != "full")
                e = estimate(prof, work, sched, unit)
                prec = e.precision
                cells.append(f"{e.prefill_s:,.1f} s · {e.decode_tok_s:,.0f} tok/s")
            rows.append((name, unit, prec, cells))
    return rows


def replot() -> None:
    """Recompute the sweep (arithmetic on the measured report) and redraw the plot."""
    from edgekv.simulate.profiles import load_profile
    from edgekv.simulate.source import describe
    from edgekv.simulate.sweep import plot, sweep_from_runs, write_json
    from edgekv.simulate.work import GeometryWork

    rep = json.loads((OUT / "simulate.json").read_text())
    target = describe(rep["model"])
    profiles = [load_profile(n) for n in rep["devices"]]
    sweep = sweep_from_runs(target, rep["runs"], rep["block"], rep["max_new_tokens"], profiles,
                            GeometryWork(target.config), rep["mechanism"]["name"])
    write_json(OUT / "simulate_sweep.json", sweep)
    plot(sweep, OUT / "simulate_sweep.png")


def write_md() -> None:
    rep = json.loads((OUT / "simulate.json").read_text())
    sweep = json.loads((OUT / "simulate_sweep.json").read_text())
    meta = json.loads((OUT / "simulate_meta.json").read_text())
    command = meta["command"]
    L = []
    L.append("## `edgekv simulate`: does it fit a phone, and how fast would it be there?\n")
    lb, la = meta["loadavg_before"], meta["loadavg_after"]
    L.append(f"Generated by `tools/results/results_simulate.py` on {rep['time']} ({platform.machine()}, "
             f"{os.cpu_count()} cores, shared with other jobs: load average {lb[0]:.1f} at the start, {la[0]:.1f} "
             f"at the end; run at nice {meta['nice']}; {meta['wall_s']:,} s in all; commit "
             f"`{meta.get('commit', 'not recorded')}`). Command:\n")
    L.append(f"```\n{command}\n```\n")
    m = rep["mechanism"]
    L.append(f"Model {rep['model']} (fp32 weights), prompt **{rep['prompt_tokens']:,} tokens** (past the 8,192-token "
             f"trained context, by `--allow-beyond-context`), {rep['max_new_tokens']} new tokens, B = {rep['block']}. "
             f"Cap **{mib(rep['cap_bytes'])}** enforced on a child process with **{m['name']}** — {m['reason']}. "
             f"What the cap measures: {m['measures']}.\n")
    L.append("| policy | N | static plan | measured peak | peak RSS | result | host prefill | host decode |")
    L.append("|---|---:|---:|---:|---:|---|---:|---:|")
    for r in rep["runs"]:
        if r["fits"]:
            res = f"**fits** ({mib(r['cap'] - r['measured_peak'])} headroom)"
            pre = f"{r['host']['prefill_seconds']:,.0f} s ({r['host']['prefill_tok_s']:,.0f} tok/s)"
            dec = f"{r['host']['decode_tok_s']:,.1f} tok/s"
        else:
            res = f"**does not fit**: needs " + (f"> {mib(r['cap'])}" if r.get("needs_lower_bound") else f"≈ {mib(r['needs_bytes'])}") + (" (refused before start)" if r["status"].startswith("refused") else f" ({r['exit']})")
            pre = dec = "—"
        L.append(f"| {r['policy']} | {r['budget']:,} | {mib(r['plan']['total'])} | {mib(r['measured_peak'])} "
                 f"({r['measured_peak_field']}) | {mib(r['peak_rss'])} | {res} | {pre} | {dec} |")
    L.append("")
    for r in rep["runs"]:
        if not r["fits"] and r.get("needs_basis"):
            L.append(f"*{r['policy']}*: needs ≈ {mib(r['needs_bytes'])} = {r['needs_basis']}. "
                     f"Child: {r['exit']}; `{(r['error'] or '').splitlines()[0][:160] if r['error'] else ''}`\n")
    L.append("**Estimated on the device profiles** (`edgekv/profiles/devices/*.json`; ideal roofline lower bounds from "
             f"peak figures — real kernels reach a fraction of both peaks; work counted from {rep['work_source']}):\n")
    L.append("| device (unit, precision) | policy | prefill | decode |")
    L.append("|---|---|---:|---:|")
    for r in rep["runs"]:
        for e in r["estimates"]:
            L.append(f"| {e['device']} ({e['unit']}, {e['precision']}) | {r['policy']} N={r['budget']:,} | "
                     f"{e['prefill_s']:,.1f} s ({e['prefill_tok_s']:,.0f} tok/s, {e['prefill_bound']}) | "
                     f"{e['decode_tok_s']:,.1f} tok/s at {e['decode_context']:,} cached ({e['decode_bound']}) |")
    L.append("")
    L.append("Every compute unit (same counts; an NPU without an fp32 rate is estimated as the narrower build it "
             "has, which this fp32 artifact is not):\n")
    L.append("| device | unit | precision | " + " | ".join(f"{r['policy']} N={r['budget']:,}: prefill · decode" for r in rep["runs"]) + " |")
    L.append("|---|---|---|" + "---:|" * len(rep["runs"]))
    for dev, unit, prec, cells in all_units(rep):
        L.append(f"| {dev} | {unit} | {prec} | " + " | ".join(cells) + " |")
    L.append("")
    L.append(f"**Sweep** — longest prompt that fits, from the static plan + the runtime overhead measured above "
             f"({mib(sweep['runtime_overhead_bytes'])}: {sweep['runtime_overhead_source']}):\n")
    labels = [s["label"] for s in sweep["series"]]
    L.append("| cap | " + " | ".join(labels) + " |")
    L.append("|---|" + "---:|" * len(labels))
    shown = {0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0}  # the JSON has the full grid
    rows = [(f"{c / GiB:g} GiB", [s["max_prompt"][i] for s in sweep["series"]]) for i, c in enumerate(sweep["caps_bytes"])
            if c / GiB in shown]
    rows += [(f"{d['name']} app-usable ({d['app_usable_bytes'] / GiB:g} GiB)", [d["max_prompt"][lb] for lb in labels])
             for d in sweep["devices"]]
    for name, vals in rows:
        L.append(f"| {name} | " + " | ".join("any length" if v is None else ("none" if v == 0 else f"{v:,}") for v in vals) + " |")
    L.append("")
    L.append("![simulate sweep](simulate_sweep.png)\n")
    L.append("Reading it: the KV cache of an evicting policy is fixed at N + B entries per layer and head, so its "
             "memory does not grow with the prompt — above its threshold it fits any length. The full cache grows by "
             f"{rep.get('kv_bytes_per_token', 46440):,} bytes per token for this model, so each cap has a longest "
             "prompt. Device estimates are for the fp32 build as compiled (an NPU without fp32 is estimated as an "
             "fp16/int8 build and says so); figures and their public sources are in `edgekv/profiles/devices/`, many are "
             "estimates and marked as such. Host times are the eager PyTorch engine on a shared 2-core box, not the "
             "compiled artifact. Files: `docs/results/simulate.json` (full report), `simulate_sweep.json`, "
             "`simulate_console.txt` (the command's own tables).\n")
    (OUT / "simulate.md").write_text("\n".join(L))
    print(f"wrote {OUT / 'simulate.md'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16500)
    ap.add_argument("--mem-limit", default="1.5GiB")
    ap.add_argument("--policies", default="keydiff,full")
    ap.add_argument("--budget", default="512")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--from-json", action="store_true",
                    help="no new run: recompute the sweep and plot from the last simulate.json and rewrite the .md")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not a.from_json:
        run(a)
    replot()
    write_md()
