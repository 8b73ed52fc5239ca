"""Issue 16's evaluation: passkey accuracy at 4K and 7K tokens with and without `--question`,
from `edgekv eval` runs (one without the question, one with it, per length), into one table with
95 % intervals, the needle's retention and the full cache's accuracy on the same prompts.

    # the runs (each resumable with --resume; --workers / --ray spread the prompts)
    edgekv eval --task passkey --policies keydiff,lagkv,snapkv++,snapkv --budgets 512,1k --block 128 \\
        --lengths 4k --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 --no-question --threads 1 --out build/eval/sweep16/4k_noq
    edgekv eval ... --policies snapkv++,snapkv,tova --question ... --out build/eval/sweep16/4k_q
    (the same for 7k and 2k; dapq in runs of its own; 2k with --haystack text)
    python tools/results/results_question_sweep.py --collect build/eval/sweep16   # copies results.json here, then tables
    (those runs predate the varied haystack: rerun them with --haystack repeat to reproduce these rows)

    # another grid, e.g. pooling kernels and recent windows at 7K, N = 512 (policy variants name#tag):
    edgekv eval --policies "dapq#k15,dapq#k31" --policy-arg dapq#k15:kernel=15 --policy-arg dapq#k31:kernel=31 \
        --budgets 512 --lengths 7k --question ... --out build/eval/kappa_7k_512/dapq_k
    python tools/results/results_question_sweep.py --collect build/eval/kappa_7k_512 --name question_kappa_7k \
        --title "7K prompts at N = 512 with the question: pooling kernels and recent windows"

Query-agnostic policies (KeyDiff, LagKV) do not read the question (`uses_question` False: the
engine runs them unchanged), so their rows from the run without it stand for both modes and
are marked so. A cell's interval is Wilson's score interval for k correct of n prompts.
Writes docs/results/NAME.{json,md,png} (default question_sweep_repeat: these runs were made on the classic
repeated filler, now a labelled variant; docs/results/question_sweep.md is issue 34's grid on the varied
haystack, tools/results/results_many_questions.py, which quotes this one); raw runs in docs/results/NAME/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from edgekv.evaluation.report import wilson

ROOT = Path(__file__).resolve().parents[2]


def collect(src: Path, raw: Path) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in src.iterdir() if (p / "results.json").is_file()):
        shutil.copyfile(run / "results.json", raw / f"{run.name}.json")


def load_runs(raw: Path) -> list[dict]:
    return [dict(json.loads(p.read_text()), _name=p.stem) for p in sorted(raw.glob("*.json"))]


def cells(runs: list[dict]):
    """(haystack, length, new tokens, budget, policy, question) → rows; and (haystack, length, new
    tokens) → {prompt: full-cache correct}. A policy label may be a variant (``dapq#k15``, ``base_policy``)."""
    from edgekv.policies import REGISTRY, base_policy

    def prompts_of(run: dict) -> tuple[str, int]:  # what makes two runs' prompts comparable
        return run["config"].get("haystack", "repeat"), int(run["config"].get("max_new_tokens", 10))

    # grids with a run without the question: a query-agnostic policy's rows are taken from it
    unasked = {prompts_of(r) for r in runs if not r["config"].get("question")}
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    ceiling: dict[tuple, dict[str, bool]] = defaultdict(dict)
    for run in runs:
        asked = bool(run["config"].get("question"))
        hay, tokens = prompts_of(run)
        lengths = {p["id"]: p["length_target"] for p in run["prompts"]}
        for pid, ref in run["references"].items():
            seen = ceiling[(hay, lengths[pid], tokens)].get(pid)
            if seen is not None and seen != ref["correct"]:
                raise SystemExit(f"the full cache answers {pid} differently in two runs; rerun them")
            ceiling[(hay, lengths[pid], tokens)][pid] = ref["correct"]
        settings = run["config"].get("policy_args") or {}
        for row in run["results"]:
            if row.get("error") or row["policy"] == "full":
                continue
            uses_question = getattr(REGISTRY[base_policy(row["policy"])], "uses_question", False)
            if settings.get(row["policy"]):  # a policy run with --policy-arg: its settings in its label
                row = dict(row, policy=row["policy"] + " [" + ", ".join(
                    f"{k}={v}" for k, v in sorted(settings[row["policy"]].items())) + "]")
            modes = [asked] if uses_question else [False, True]  # query-agnostic: the same run in both
            if asked and not uses_question and (hay, tokens) in unasked:
                continue  # taken from the run without the question
            for mode in modes:
                cell = by_cell[(hay, row["length_target"], tokens, row["budget"], row["policy"], mode)]
                if any(r["prompt_id"] == row["prompt_id"] for r in cell):
                    raise SystemExit(f"{row['policy']} N={row['budget']} ran {row['prompt_id']} in two collected "
                                     f"runs ({run['_name']} and another); keep one of them")
                cell.append(dict(row, _shared=not uses_question))
    return by_cell, ceiling


def summarize(runs: list[dict]) -> dict:
    by_cell, ceiling = cells(runs)
    out = []
    for (hay, length, tokens, budget, policy, asked), rows in sorted(by_cell.items()):
        k, n = sum(r["correct"] for r in rows), len(rows)
        ref = ceiling[(hay, length, tokens)]
        full = [ref[r["prompt_id"]] for r in rows if r["prompt_id"] in ref]
        kept = [r["needle_retention"] for r in rows if r.get("needle_retention") is not None]
        lo, hi = wilson(k, n)
        out.append({"haystack": hay, "length": length, "new_tokens": tokens, "budget": budget, "policy": policy, "question": asked, "correct": k,
                    "prompts": n, "accuracy": k / n if n else None, "interval95": [lo, hi],
                    "needle_retention": sum(kept) / len(kept) if kept else None,
                    "missed": sorted(r["prompt_id"] for r in rows if not r["correct"]),
                    "full_cache_correct": sum(full), "of_full_cache": (k / sum(full)) if sum(full) else None,
                    "question_unused": rows[0]["_shared"]})
    ceilings = [{"haystack": h, "length": L, "new_tokens": t, "correct": sum(v.values()), "prompts": len(v),
                 "interval95": list(wilson(sum(v.values()), len(v)))} for (h, L, t), v in sorted(ceiling.items())]
    return {"cells": out, "full_cache": ceilings}


def markdown(data: dict, title: str = "Passkey with and without `--question`", image: str = "question_sweep.png") -> str:
    lines = [f"## {title} (`tools/results/results_question_sweep.py`)", "",
             "SmolLM2-135M-Instruct on the eager engine, B = 128, passkey prompts (needle at depths 0.1–0.9, seeds 0 "
             "and 1; haystack `repeat`: the classic repeated filler, `text`: natural English from CPython's "
             "`pydoc_data` topics), greedy, exact key among the answer's first *new tokens* (`--max-new-tokens`). A policy run with `--policy-arg` shows its settings in brackets (`name#tag`: a variant label of the run). Without `--question` the question "
             "ends the prompt and each block scores with its own rows; with it, query-aware policies score every block "
             "with the question's queries (KeyDiff and LagKV do not read it: one run stands for both columns, marked °). "
             "95 % Wilson intervals; retention: share of (layer, KV head) caches holding the key's digits after prefill; "
             "\"of full\": accuracy as a share of the full cache's on the same prompts.", "",
             "Runs: " + "; ".join(f"`{r['_name']}`: `{r['meta']['command']}` at {r['meta']['commit'][:12]}"
                                  + ("" if r.get("complete") else " (**partial**: interrupted, resumable)")
                                  for r in data["runs"]), ""]
    lines += ["| haystack | length | new tokens | full cache |", "|---|---:|---:|---|"]
    for c in data["full_cache"]:
        lo, hi = c["interval95"]
        lines.append(f"| {c['haystack']} | {c['length']} | {c['new_tokens']} | {c['correct']}/{c['prompts']} "
                     f"({lo:.0%}–{hi:.0%}) |")
    lines += ["", "| haystack | length | new tokens | N | policy | without --question | with --question | "
                  "retention without / with | of full (with) | missed with |", "|---|---:|---:|---:|---|---|---|---|---:|---|"]
    table = {(c["haystack"], c["length"], c["new_tokens"], c["budget"], c["policy"], c["question"]): c
             for c in data["cells"]}
    keys = sorted({(c["haystack"], c["length"], c["new_tokens"], c["budget"], c["policy"]) for c in data["cells"]})

    def fmt(c):
        if c is None:
            return "—"
        lo, hi = c["interval95"]
        return f"{c['correct']}/{c['prompts']} = {c['accuracy']:.0%} ({lo:.0%}–{hi:.0%})" + ("°" if c["question_unused"] else "")

    for hay, length, tokens, budget, policy in keys:
        a, b = (table.get((hay, length, tokens, budget, policy, False)),
                table.get((hay, length, tokens, budget, policy, True)))
        ret = " / ".join("—" if c is None or c["needle_retention"] is None else f"{c['needle_retention']:.0%}"
                         for c in (a, b))
        share = "—" if b is None or b["of_full_cache"] is None else f"{b['of_full_cache']:.0%}"
        missed = "—" if b is None else ", ".join(m.split("-", 2)[-1] for m in b.get("missed", [])) or "none"
        lines.append(f"| {hay} | {length} | {tokens} | {budget} | {policy} | {fmt(a)} | {fmt(b)} | {ret} | {share} | {missed} |")
    lines += ["", f"![accuracy against budget]({image})"]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one panel per haystack and length, at the grid's usual answer length (the most common)
    counts: dict = defaultdict(int)
    for c in data["cells"]:
        counts[c["new_tokens"]] += 1
    usual = max(counts, key=counts.get)
    panels = sorted({(c["haystack"], c["length"]) for c in data["cells"] if c["new_tokens"] == usual})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    full = {(c["haystack"], c["length"]): c["correct"] / c["prompts"] for c in data["full_cache"]
            if c["prompts"] and c["new_tokens"] == usual}
    for ax, (hay, length) in zip(axes[0], panels):
        mine = [c for c in data["cells"] if (c["haystack"], c["length"], c["new_tokens"]) == (hay, length, usual)]
        for policy in sorted({c["policy"] for c in mine}):
            for asked, style in ((False, "--"), (True, "-")):
                pts = sorted((c["budget"], c["accuracy"], c["interval95"]) for c in mine
                             if c["policy"] == policy and c["question"] == asked)
                if not pts or (asked and any(c["question_unused"] for c in data["cells"] if c["policy"] == policy)):
                    continue
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                err = [[y - p[2][0] for y, p in zip(ys, pts)], [p[2][1] - y for y, p in zip(ys, pts)]]
                ax.errorbar(xs, ys, yerr=err, fmt=style + "o", capsize=3,
                            label=f"{policy}" + (" --question" if asked else ""))
        if (hay, length) in full:
            ax.axhline(full[(hay, length)], color="black", lw=1, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{length}-token prompts, {hay} haystack, {usual} new tokens")
        ax.set_xlabel("budget N (tokens)")
        ax.set_ylabel("passkey accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collect", type=Path, help="copy each RUN/results.json under this folder into the raw folder")
    ap.add_argument("--name", default="question_sweep_repeat",
                    help="docs/results/NAME.{json,md,png}, raw runs in docs/results/NAME/ (another grid: another name)")
    ap.add_argument("--title", default="Labelled variant, the repeated filler (`--haystack repeat`): passkey with and "
                                       "without `--question`")
    args = ap.parse_args()
    raw = ROOT / "docs/results" / args.name
    if args.collect:
        collect(args.collect, raw)
    runs = load_runs(raw)
    if not runs:
        raise SystemExit(f"no runs in {raw}; run the edgekv eval commands in this file's docstring, then --collect")
    from edgekv.evaluation.report import provenance

    data = {"provenance": provenance([sys.argv[0], *sys.argv[1:]]),
            "runs": [{"_name": r["_name"], "meta": r["meta"], "complete": r.get("complete", False)} for r in runs],
            **summarize(runs)}
    out = raw
    text = markdown(data, args.title, f"{args.name}.png")
    (out.with_suffix(".json")).write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(text)
    plot(data, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
