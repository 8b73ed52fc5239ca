"""Regenerate the accuracy section of docs/RESULTS.md from `edgekv eval` JSON files.

    python tools/results/results_accuracy.py RUN1/results.json [RUN2/results.json ...] \
        [--notes docs/results/accuracy_notes.md] [-o docs/results/accuracy.md]

Writes docs/results/accuracy.md (a section file that docs/RESULTS.md includes) and the
plots beside it (docs/results/accuracy_*.png). Every number comes from the JSON; the
machine, commit, command and runtime of each run are recorded. The observed orderings are
computed here and set against the papers' orderings (research digests: KeyDiff ≥ SnapKV ≥
TOVA ≥ Sink ≥ H2O under blocks; DapQ ≥ SnapKV); a hand-written discussion can be merged in
with --notes. The discussion quotes no number by hand: it writes ``{{task mode metric policy
[L=length] [N=budget]}}`` (a mean over the matching runs, e.g. ``{{passkey block accuracy keydiff
L=7168}}``) or ``{{task mode prompts [L=length]}}`` (how many prompts), filled in from the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from edgekv.evaluation import report

ROOT = Path(__file__).resolve().parents[2]

PAPER_BLOCK_ORDER = ["keydiff", "snapkv", "tova", "streaming", "h2o"]  # KeyDiff Table 1 (Sink = streaming)
PAPER_PAIRS = [("dapq", "snapkv", "DapQ ≥ SnapKV (DapQ paper)"),
               ("keydiff", "snapkv", "KeyDiff ≥ SnapKV under blocks (KeyDiff Table 1)"),
               ("snapkv", "tova", "SnapKV ≥ TOVA under blocks"),
               ("tova", "streaming", "TOVA ≥ Sink under blocks"),
               ("streaming", "h2o", "Sink ≥ H2O under blocks")]
HEADLINE = {"passkey": ("accuracy", "pct", True), "multikey": ("accuracy", "pct", True),
            "fidelity": ("mean_kl", "kl", False)}
# (task, metric, kind, higher is better) used for the orderings against the papers
ORDER_METRICS = [("passkey", "accuracy", "pct", True), ("passkey", "needle_retention", "pct", True),
                 ("multikey", "accuracy", "pct", True), ("fidelity", "mean_kl", "kl", False),
                 ("fidelity", "top1_agreement", "pct", True), ("fidelity", "greedy_prefix_match", "pct", True)]


def load(paths: list[Path]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if data.get("schema") != report.SCHEMA:
            raise SystemExit(f"{p}: not an edgekv eval result (schema {data.get('schema')!r})")
        data["summary"] = report.summarize(data["results"])  # always recomputed from the raw rows
        data["_path"] = str(p)
        runs.append(data)
    return runs


def merge(runs: list[dict]) -> dict:
    """One result set from several runs (different prompts or modes); the summary is recomputed."""
    seen, results, prompts, refs = set(), [], {}, {}
    for r in runs:
        for row in r["results"]:
            key = (row["task"], row["prompt_id"], row["policy"], row["budget"], row["mode"], row["block"])
            if key not in seen:
                seen.add(key)
                results.append(row)
        prompts.update({p["id"]: p for p in r["prompts"]})
        refs.update(r["references"])
    return {"results": results, "summary": report.summarize(results), "prompts": list(prompts.values()),
            "references": refs, "meta": runs[0]["meta"]}


def policy_means(summary: list[dict], task: str, mode: str, metric: str, budgets: set | None = None) -> dict:
    acc = defaultdict(list)
    for s in summary:
        if s["task"] == task and s["mode"] == mode and s.get(metric) is not None:
            if budgets is None or s["budget"] in budgets:
                acc[s["policy"]].append(s[metric])
    return {p: sum(v) / len(v) for p, v in acc.items()}


def ordering(means: dict, higher_better: bool) -> str:
    items = sorted((p for p in means if p != "full"), key=lambda p: -means[p] if higher_better else means[p])
    return " > ".join(items)


def fmt(v, kind):
    return "—" if v is None else (f"{100 * v:.0f}%" if kind == "pct" else f"{v:.3f}")


# the metrics the notes may quote, and how each is printed: the ones the orderings use
NOTE_METRICS = {metric: kind for _, metric, kind, _ in ORDER_METRICS}
NOTE_FIELD = re.compile(r"\{\{([^{}]+)\}\}")


def note_value(rows: list[dict], spec: str) -> str:
    """One ``{{...}}`` of the notes, from the merged raw rows (see the module docstring): the rows
    the filters select, averaged as the tables are (``policy_means``: each budget's mean, then
    their mean)."""
    words = spec.split()
    filters = dict(w.split("=", 1) for w in words if "=" in w)
    words = [w for w in words if "=" not in w]
    if len(words) < 3 or set(filters) - {"L", "N"}:
        raise SystemExit(f"notes: cannot read {{{{{spec}}}}}; write {{{{task mode metric policy [L=..] [N=..]}}}} "
                         "or {{task mode prompts [L=..]}}")
    task, mode = words[0], {"block": "block", "one": "one_block"}.get(words[1], words[1])
    sel = [r for r in rows if r["task"] == task and r["mode"] == mode
           and ("L" not in filters or str(r["length_target"]) == filters["L"])
           and ("N" not in filters or str(r["budget"]) == filters["N"])]
    if words[2] == "prompts" and len(words) == 3:
        prompts = {r["prompt_id"] for r in sel if r.get("error") is None}
        value = str(len(prompts)) if prompts else None
    else:
        if len(words) != 4 or words[2] not in NOTE_METRICS:
            raise SystemExit(f"notes: {{{{{spec}}}}}: the metric is one of {', '.join(NOTE_METRICS)} (or 'prompts')")
        mean = policy_means(report.summarize(sel), task, mode, words[2]).get(words[3])
        value = None if mean is None else fmt(mean, NOTE_METRICS[words[2]]).replace("%", " %")
    if value is None:
        raise SystemExit(f"notes: {{{{{spec}}}}} matches no run in these results; fix the notes or add the run")
    return value


def fill_notes(text: str, merged: dict) -> str:
    """The notes with every ``{{...}}`` replaced by its value from the results; a brace pair
    left over (a malformed field) stops the section rather than printing as text."""
    out = NOTE_FIELD.sub(lambda m: note_value(merged["results"], m.group(1).strip()), text)
    for i, line in enumerate(out.splitlines(), 1):
        if "{{" in line or "}}" in line:
            raise SystemExit(f"notes: line {i} has a malformed {{{{...}}}} field: {line.strip()!r}")
    return out


def block_vs_one(runs: list[dict], task: str, metric: str, kind: str) -> tuple[list[str], dict, dict]:
    """Mean over budgets for each policy, block-wise vs one block, over the prompts and budgets
    present in both modes (the block-wise sweep may cover more prompts than the one-block run)."""
    rows = [r for r in merge(runs)["results"] if r["task"] == task]
    both = ({r["prompt_id"] for r in rows if r["mode"] == "block"}
            & {r["prompt_id"] for r in rows if r["mode"] == "one_block"})
    summary = report.summarize([r for r in rows if r["prompt_id"] in both])
    b_budgets = {s["budget"] for s in summary if s["task"] == task and s["mode"] == "block"}
    o_budgets = {s["budget"] for s in summary if s["task"] == task and s["mode"] == "one_block"}
    common = b_budgets & o_budgets
    if not common:
        return [], {}, {}
    blk = policy_means(summary, task, "block", metric, common)
    one = policy_means(summary, task, "one_block", metric, common)
    lines = [f"Mean {metric.replace('_', ' ')} over budgets {', '.join(map(str, sorted(common)))}, on the "
             f"{len(both)} prompts run both ways ({', '.join(sorted(both))}):", "",
             "| policy | block-wise (B=128) | one block | one block − block-wise |", "|---|---:|---:|---:|"]
    for p in sorted(set(blk) & set(one), key=lambda p: (p != "full", p)):
        delta = one[p] - blk[p]
        d = f"{100 * delta:+.0f} pt" if kind == "pct" else f"{delta:+.3f}"
        lines.append(f"| {p} | {fmt(blk[p], kind)} | {fmt(one[p], kind)} | {d} |")
    return lines, blk, one


def comparison_plot(blk: dict, one: dict, task: str, metric: str, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pols = sorted((set(blk) & set(one)) - {"full"})
    if not pols:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(pols) + 2), 3.6))
    x = range(len(pols))
    ax.bar([i - 0.2 for i in x], [blk[p] for p in pols], width=0.4, label="block-wise (B=128)")
    ax.bar([i + 0.2 for i in x], [one[p] for p in pols], width=0.4, label="one block (B = prompt)")
    if "full" in blk:
        ax.axhline(blk["full"], color="black", linestyle="--", linewidth=1, label="full cache")
    ax.set_xticks(list(x), pols, rotation=20)
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(f"{task}: block-wise vs one block (mean over budgets)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def pair_lines(runs: list[dict]) -> list[str]:
    lines = []
    summary = merge(runs)["summary"]
    for task, metric, kind, higher in ORDER_METRICS:
        means = policy_means(summary, task, "block", metric)
        if not means:
            continue
        for a, b, claim in PAPER_PAIRS:
            if a in means and b in means:
                tie = abs(means[a] - means[b]) < 1e-9
                holds = means[a] >= means[b] if higher else means[a] <= means[b]
                verdict = "tie" if tie else ("holds" if holds else "**does not hold**")
                lines.append(f"| {task} · {metric.replace('_', ' ')} | {claim} | {fmt(means[a], kind)} vs "
                             f"{fmt(means[b], kind)} | {verdict} |")
    return lines


def by_length(merged: dict, task: str = "passkey", metric: str = "correct") -> list[str]:
    """Block-wise accuracy per policy and prompt length (mean over budgets, depths and seeds)."""
    rows = [r for r in merged["results"] if r["task"] == task and r["mode"] == "block" and r.get("error") is None]
    lengths = sorted({r["length_target"] for r in rows})
    if len(lengths) < 2:
        return []
    cell = defaultdict(list)
    for r in rows:
        cell[(r["policy"], r["length_target"])].append(float(r[metric]))
    n = {L: len({r["prompt_id"] for r in rows if r["length_target"] == L}) for L in lengths}
    out = [f"### {task}, block-wise: accuracy by prompt length (mean over budgets, depths and seeds)", "",
           "| policy | " + " | ".join(f"{L} tok ({n[L]} prompt{'s' if n[L] > 1 else ''})" for L in lengths) + " |",
           "|---|" + "---:|" * len(lengths)]
    for p in sorted({r["policy"] for r in rows}, key=lambda p: (p != "full", p)):
        vals = [cell.get((p, L)) for L in lengths]
        out.append(f"| {p} | " + " | ".join(fmt(sum(v) / len(v), "pct") if v else "—" for v in vals) + " |")
    return out + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="results.json files written by `edgekv eval`")
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "docs" / "results" / "accuracy.md")
    ap.add_argument("--notes", type=Path, default=None, help="hand-written discussion merged into the section")
    args = ap.parse_args(argv)
    runs = load(args.results)
    out_dir = args.output.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["## Accuracy (`edgekv eval`)", "",
          "<!-- generated by tools/results/results_accuracy.py from the JSON listed below; do not edit by hand -->", "",
          "Model: SmolLM2-135M-Instruct on the block-wise reference engine (eager PyTorch, fp32). "
          "Passkey prompts use the chat template; haystack and fidelity text are "
          "`pydoc_data.topics` (the Python language reference that ships with CPython), so "
          "everything runs offline. Budget N = KV entries kept per layer and KV head.", "",
          "### Runs", "", "| run | raw results | command | commit | machine | runtime |", "|---|---|---|---|---|---:|"]
    for i, r in enumerate(runs, 1):
        m = r["meta"]
        mach = f"{m['machine']['cpu']}, {m['machine']['cores']} cores, torch {m['machine']['torch']}, " \
               f"{m['machine']['torch_threads']} thread(s)"
        path = Path(r["_path"]).resolve()
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        md.append(f"| {i} | `{shown}` | `{m['command']}` | {m.get('commit') or 'uncommitted'} | {mach} | "
                  f"{r.get('runtime_seconds', 0) / 60:.1f} min{'' if r.get('complete') else ' (incomplete)'} |")
    md.append("")
    # orderings against the papers
    summary = merge(runs)["summary"]
    md += ["### Orderings against the papers", "",
           f"Paper (KeyDiff Table 1, LongBench, Llama 3.x 3B/8B, B = 128): {' ≥ '.join(PAPER_BLOCK_ORDER)}; "
           "DapQ paper: DapQ ≥ SnapKV.", ""]
    for task, metric, kind, higher in ORDER_METRICS:
        for mode in ("block", "one_block"):
            means = policy_means(summary, task, mode, metric)
            if means:
                label = "block-wise" if mode == "block" else "one block"
                budgets = sorted({s["budget"] for s in summary if s["task"] == task and s["mode"] == mode})
                md.append(f"- {task}, {label}, {metric.replace('_', ' ')} ({'higher' if higher else 'lower'} is "
                          f"better), mean over N = {', '.join(map(str, budgets))}: "
                          + ", ".join(f"{p} {fmt(v, kind)}" for p, v in sorted(means.items(), key=lambda kv: -kv[1] if higher else kv[1]))
                          + f" → observed order **{ordering(means, higher)}**")
    pairs = pair_lines(runs)
    if pairs:
        md += ["", "Pairwise claims, block-wise (B = 128), mean over budgets:", "",
               "| task · metric | claim | observed | verdict |", "|---|---|---|---|", *pairs]
    md.append("")
    merged = merge(runs)  # the raw results of every run, for the notes, tables and plots
    if args.notes and args.notes.exists():
        md += [fill_notes(args.notes.read_text().strip(), merged), ""]
    md += by_length(merged)
    md += ["### Tables", "", report.markdown(merged, heading="####")]
    for p in report.plot(merged, out_dir, prefix="accuracy_"):
        md.append(f"![{p.stem}]({p.name})")
    md.append("")
    for task, (metric, kind, _) in HEADLINE.items():
        lines, blk, one = block_vs_one(runs, task, metric, kind)
        if lines:
            md += [f"### Block-wise vs one block: {task}", "", *lines, ""]
            png = comparison_plot(blk, one, task, metric, out_dir / f"accuracy_block_vs_one_{task}.png")
            if png:
                md += [f"![block vs one block, {task}]({png.name})", ""]
    args.output.write_text("\n".join(md).rstrip() + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
