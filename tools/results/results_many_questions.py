"""Many questions of one saved document (issue 34): each document is read ONCE without the question,
its compressed cache saved (the `run --save-cache` path: `Session.save_cache`) and every question asked
of that cache (the `edgekv ask` path: `Session.load_cache` before each), against the question-aware
ceiling (the document read again knowing each question) and the full cache.

    # the grid of issue 34 (SmolLM2, B = 128, 10 documents per cell; hours on two cores)
    python tools/results/results_many_questions.py --tasks passkey,multikey --lengths 4k,7k,16k \\
        --budgets 512,1k --documents 10
    # the cell that fits a shared machine (what docs/results/question_sweep.md holds), under the lock:
    flock /work/wt/heavy.lock python tools/results/results_many_questions.py --tasks passkey,multikey \\
        --lengths 7k --budgets 1k --documents 10
    # the tables again from the recorded rows (no model run):
    python tools/results/results_many_questions.py --report-only

Methods (``--methods``, ``edgekv.evaluation.questions.parse_method``): ``POLICY`` reads without the
question and reuses one cache; ``POLICY:q`` reads knowing each question (the ceiling, one read per
question); ``compress:MODE`` reads with a compression mode (``compress:reconstruct``: issue 34's
``--compress reconstruct``, its own policy; a tree without it reports the method unavailable). Every row is appended
to OUT/rows.jsonl as it finishes, so an interrupted grid continues where it stopped (same command).
Writes docs/results/NAME.{json,md,png} (default question_sweep) and the rows to docs/results/NAME/rows.jsonl.
A cell's interval is Wilson's 95 % score interval for k correct of n questions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.results.results_question_sweep import wilson  # noqa: E402

MODEL = "smollm2-135m"


def row_key(r: dict) -> tuple:
    return (r["document"], r["method"], r["budget"], r["ask"], r["block"])


def load_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_grid(args, rows_path: Path) -> None:
    import torch
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from edgekv.evaluation.command import parse_lengths
    from edgekv.evaluation.questions import ask_document, build_document, compress_unavailable, parse_methods
    from edgekv.models import load_model

    from edgekv.policies import make_policy, policy_arguments

    methods = parse_methods(args.methods)  # bad names fail before the model loads
    runnable = [m for m in methods if compress_unavailable(m.compress) is None]  # the others report it
    policy_args = policy_arguments(args.policy_arg, list(dict.fromkeys(m.policy for m in runnable)))
    for m in runnable:
        make_policy(m.policy, policy_args.get(m.policy, {}))  # bad arguments too
    lengths, budgets = parse_lengths(args.lengths, "--lengths"), parse_lengths(args.budgets, "--budgets")
    tasks = [t for t in args.tasks.split(",") if t]
    asks = [a for a in args.ask.split(",") if a]
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    done = {row_key(r) for r in load_rows(rows_path)}
    docs = [build_document(model.tokenizer, task, length, i, haystack=args.haystack, keys=args.keys)
            for length in lengths for i in range(args.documents) for task in tasks]
    # cheap runs first: one read per document (a saved cache, or a ceiling on one-question documents), every
    # such method on a document before the next document; the ceiling on many-question documents (a read per
    # question) after. An interrupted grid has the same documents in every cheap cell.
    plan = []
    for expensive in (False, True):
        for doc in docs:
            for ask in asks:
                for m in [m for m in methods if (m.question_known and len(doc.questions) > 1) == expensive]:
                    for budget in ([None] if m.policy == "full" else budgets):
                        if (doc.id, m.label, budget, ask, args.block) not in done:
                            reads = len(doc.questions) if (m.question_known and ask == "snapshot") else 1
                            plan.append((doc, m, budget, ask, reads * doc.tokens))
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    from edgekv.evaluation.report import provenance

    runs_path = rows_path.parent / "runs.json"  # written first: an interrupted grid keeps its provenance
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    runs.append(dict(provenance([sys.argv[0], *sys.argv[1:]]), model=model.model_id, rows_added=len(plan),
                     threads=args.threads))
    runs_path.write_text(json.dumps(runs, indent=1))
    meta_path = rows_path.parent / "documents.json"
    known = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    known.update({d.id: d.meta() for d in docs})
    meta_path.write_text(json.dumps(known, indent=1))
    with Progress(TextColumn("[bold]questions[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("tokens"), TimeElapsedColumn(), TimeRemainingColumn()) as progress:
        bar = progress.add_task("", total=sum(p[-1] for p in plan))
        for doc, m, budget, ask, tokens in plan:
            progress.update(bar, description=f"{doc.id} · {m.label} N={budget or 'full'} · {ask}")
            advanced = [0]

            def step(n: int) -> None:
                advanced[0] += n
                progress.advance(bar, n)

            rows = ask_document(model, doc, m, budget or 0, args.block, ask=ask, max_new_tokens=args.max_new_tokens,
                                progress=step, policy_args=policy_args.get(m.policy, {}))
            progress.advance(bar, tokens - advanced[0])  # an unavailable method reads nothing
            with rows_path.open("a") as f:
                for r in rows:
                    r["budget"] = budget
                    f.write(json.dumps(r) + "\n")


def summarize(rows: list[dict]) -> dict:
    """Cells (haystack, task, length, budget, ask, method) → k/n with intervals, the share of the full
    cache's correct answers on the same questions, retention, reads per document."""
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    full: dict[tuple, bool] = {}
    for r in rows:
        if r["method"] == "full":
            full[(r["document"], r["question"], r["ask"])] = r.get("correct", False)
    for r in rows:
        by_cell[(r["haystack"], r["task"], r["length_target"], r["budget"], r["ask"], r["method"])].append(r)
    cells = []
    for (hay, task, length, budget, ask, method), rs in sorted(by_cell.items(), key=lambda kv: str(kv[0])):
        if any("unavailable" in r for r in rs):
            cells.append({"haystack": hay, "task": task, "length": length, "budget": budget, "ask": ask,
                          "method": method, "unavailable": rs[0]["unavailable"], "documents": len({r["document"] for r in rs})})
            continue
        k, n = sum(r["correct"] for r in rs), len(rs)
        ref = [full.get((r["document"], r["question"], ask)) for r in rs]
        kf = sum(1 for x in ref if x)
        both = sum(1 for r, x in zip(rs, ref) if x and r["correct"])
        kept = [r["needle_retention"] for r in rs if r.get("needle_retention") is not None]
        docs = defaultdict(list)
        for r in rs:
            docs[r["document"]].append(r["correct"])
        lo, hi = wilson(k, n)
        cells.append({"haystack": hay, "task": task, "length": length, "budget": budget, "ask": ask, "method": method,
                      "question_known": rs[0]["question_known"], "compress": rs[0].get("compress"),
                      "correct": k, "questions": n, "documents": len(docs), "accuracy": k / n, "interval95": [lo, hi],
                      "documents_all_correct": sum(all(v) for v in docs.values()),
                      "full_cache_correct": kf, "of_full_cache": (k / kf) if kf else None,
                      "correct_where_full_is": both,
                      "answered_other": sum(bool(r.get("answered_other")) for r in rs),
                      "needle_retention": sum(kept) / len(kept) if kept else None,
                      "document_reads_per_document": sum({r["document"]: r["document_reads"] for r in rs}.values())
                      / len(docs),
                      "document_seconds": sum(r["document_seconds"] for r in rs) / n,
                      "missed": sorted(f"{r['document'].split('-')[2]}·{r['answer']}" for r in rs if not r["correct"])})
    return {"cells": cells}


def fmt(c: dict | None) -> str:
    if c is None:
        return "—"
    if "unavailable" in c:
        return "unavailable"
    lo, hi = c["interval95"]
    return f"{c['correct']}/{c['questions']} = {c['accuracy']:.0%} ({lo:.0%}–{hi:.0%})"


def markdown(data: dict, name: str, notes: str) -> str:
    p = data["provenance"]
    lines = [f"## Many questions of one saved document (`tools/results/results_many_questions.py`)", "",
             "SmolLM2-135M-Instruct on the eager engine (a `Session`), block-wise B = 128, greedy, exact match. "
             "Each document is read once **without** the question, its cache saved (`Session.save_cache`, the "
             "`run --save-cache` path) and every question asked of that one cache (`Session.load_cache` before "
             "each, the `edgekv ask` path). `POLICY:q` is the question-aware ceiling: the document read again "
             "knowing each question (it cannot reuse one cache). `full`: a budget that holds everything. Haystack "
             "`varied`: natural prose from Newton's *Opticks* (public domain) and the Python reference "
             "(`edgekv/corpus.py`), needles in four phrasings (`tasks.NEEDLE_PHRASINGS`); `passkey`: one pass key "
             "per document (depths 0.1–0.9 by document); `multikey`: four 5-digit codes of different kinds at spread "
             "depths, each asked separately of the same cache. 95 % Wilson intervals over questions; \"of full\": "
             "correct answers as a share of the full cache's on the same questions; retention: share of (layer, KV "
             "head) caches holding the asked value's tokens after the document's read.", "",
             f"Tables made by `{p['command']}` at {p['commit'][:12]}, {p['started']}; rows: `{name}/rows.jsonl`. "
             "Grid runs: " + "; ".join(f"`{r['command']}` at {r['commit'][:12]} ({r['started']}, {r['rows_added']} "
                                       "method runs planned)" for r in data.get("runs", [])) + ".", ""]
    if notes:
        lines += [notes.strip(), ""]
    table = {(c["haystack"], c["task"], c["length"], c["budget"], c["ask"], c["method"]): c for c in data["cells"]}
    groups = sorted({(c["haystack"], c["task"], c["length"], c["ask"]) for c in data["cells"]})
    order = ["full"]
    for c in data["cells"]:
        if c["method"] not in order:
            order.append(c["method"])
    order = ["full"] + sorted(order[1:], key=lambda m: (":q" in m, m.startswith("compress:"), m))
    for hay, task, length, ask in groups:
        budgets = sorted({c["budget"] for c in data["cells"] if (c["haystack"], c["task"], c["length"], c["ask"])
                          == (hay, task, length, ask) and c["budget"] is not None})
        lines += [f"### {task}, {length} tokens, {hay} haystack, asked from the {'saved cache' if ask == 'snapshot' else 'conversation (turns)'}", "",
                  "| method | question known | " + " | ".join(f"N = {b}" for b in budgets) + " | of full | retention | reads / doc |",
                  "|---|---|" + "---|" * len(budgets) + "---:|---:|---:|"]
        for m in order:
            cs = [table.get((hay, task, length, None if m == "full" else b, ask, m)) for b in (budgets if m != "full" else [None])]
            if all(c is None for c in cs):
                continue
            if m == "full":
                cs = cs * len(budgets)
            last = next((c for c in reversed(cs) if c is not None and "unavailable" not in c), None)
            share = "—" if last is None or last.get("of_full_cache") is None else f"{last['of_full_cache']:.0%}"
            ret = "—" if last is None or last.get("needle_retention") is None else f"{last['needle_retention']:.0%}"
            reads = "—" if last is None else f"{last['document_reads_per_document']:.0f}"
            known = "yes (rebuilt per question)" if ":q" in m else "no (one saved cache)"
            lines.append(f"| {m} | {known} | " + " | ".join(fmt(c) for c in cs) + f" | {share} | {ret} | {reads} |")
        lines.append("")
    unavailable = {c["method"]: c["unavailable"] for c in data["cells"] if "unavailable" in c}
    for m, why in unavailable.items():
        lines.append(f"- `{m}` unavailable: {why}.")
    lines += ["", f"![accuracy per method]({name}.png)", ""]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in data["cells"] if "unavailable" not in c]
    panels = sorted({(c["haystack"], c["task"], c["length"], c["ask"]) for c in cells})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        mine = sorted((c for c in cells if (c["haystack"], c["task"], c["length"], c["ask"]) == key),
                      key=lambda c: (c["method"] != "full", ":q" in c["method"], c["method"], c["budget"] or 0))
        labels = [c["method"] + ("" if c["budget"] is None else f"\nN={c['budget']}") for c in mine]
        ys = [c["accuracy"] for c in mine]
        err = [[y - c["interval95"][0] for y, c in zip(ys, mine)], [c["interval95"][1] - y for y, c in zip(ys, mine)]]
        colors = ["black" if c["method"] == "full" else ("tab:orange" if ":q" in c["method"] else "tab:blue")
                  for c in mine]
        ax.bar(range(len(mine)), ys, yerr=err, capsize=3, color=colors)
        ax.set_xticks(range(len(mine)), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("share of questions answered")
        ax.set_title(f"{key[1]} · {key[2]} tokens · {key[0]} · {key[3]}\nblue: one saved cache, orange: question known", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from edgekv.evaluation.questions import DEFAULT_METHODS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="passkey,multikey", help="passkey, multikey, multifact (comma-separated)")
    ap.add_argument("--lengths", default="7k")
    ap.add_argument("--budgets", default="1k")
    ap.add_argument("--documents", type=int, default=10, help="documents per (task, length) cell")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--ask", default="snapshot", help="snapshot (each question from the saved cache), turns (one "
                                                    "conversation, SCBench's multi-turn), or both")
    ap.add_argument("--policy-arg", action="append", help="POLICY:key=value (a variant: dapq#k15:kernel=15 with "
                                                          "the method dapq#k15:q), as every edgekv command takes it")
    ap.add_argument("--keys", type=int, default=4, help="needles in a multikey / multifact document")
    ap.add_argument("--haystack", default="varied")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: two contended threads are far slower)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", type=Path, default=ROOT / "build/eval/question_sweep", help="where rows.jsonl grows")
    ap.add_argument("--name", default="question_sweep", help="docs/results/NAME.{json,md,png}")
    ap.add_argument("--notes", type=Path, help="a markdown file whose text goes under the header (what ran, what did not)")
    ap.add_argument("--report-only", action="store_true", help="the tables from docs/results/NAME/rows.jsonl only")
    args = ap.parse_args()
    raw = ROOT / "docs/results" / args.name
    if not args.report_only:
        run_grid(args, args.out / "rows.jsonl")
        raw.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.out / "rows.jsonl", raw / "rows.jsonl")
        for extra in ("documents.json", "runs.json"):
            if (args.out / extra).is_file():
                shutil.copyfile(args.out / extra, raw / extra)
    rows = load_rows(raw / "rows.jsonl")
    if not rows:
        raise SystemExit(f"no rows in {raw}/rows.jsonl; run this command without --report-only first")
    from edgekv.evaluation.report import provenance

    runs_path = raw / "runs.json"
    data = {"provenance": provenance([sys.argv[0], *sys.argv[1:]]),
            "runs": json.loads(runs_path.read_text()) if runs_path.is_file() else [], **summarize(rows)}
    notes = args.notes.read_text() if args.notes else ""
    text = markdown(data, args.name, notes)
    repeat = ROOT / "docs/results" / f"{args.name}_repeat.md"
    if repeat.is_file():  # the earlier sweep on the classic filler, kept as a labelled variant
        text += ("\n---\n\nThe earlier sweep, on the **repeated filler** (a labelled variant now; its numbers are not "
                 "comparable with the tables above), as `tools/results/results_question_sweep.py` writes it to "
                 f"[{repeat.name}]({repeat.name}):\n\n" + repeat.read_text().replace("## ", "### ", 1)
                 .replace("](question_sweep_repeat.png)", f"]({args.name}_repeat.png)"))
    raw.with_suffix(".json").write_text(json.dumps(data, indent=1))
    raw.with_suffix(".md").write_text(text)
    plot(data, raw.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
