"""Choose the README's main job from measurements on the real model.

Runs candidate prompts (``tools/results/make_example_prompt.py``: document lengths × questions whose
right answer is a checkable phrase) through the eager engine, as `edgekv run --chat` does,
greedy:
  - the full cache (the model's own answer with everything kept; a candidate it gets wrong is dropped),
  - the question without the document (does the model know the answer anyway?),
  - each policy × budget.
Every answer, whether it is right, its prompt tokens, KV bytes and time go to
docs/results/demo.json (resumable: runs already in the file are not repeated). The choice is the
run with the smallest KV cache whose answer is right at that budget *and at every larger budget
tried* for the same policy and prompt (so a one-off lucky answer is not chosen), preferring a
question the model cannot answer without the document; it is then re-run with 1 and 2 threads
(different floating-point summation orders) and must be right in both. The chosen prompt is
written to examples/long_document.txt and docs/results/demo.md summarises everything.

    python -m tools.results.pick_demo                       # the whole sweep (~1 h on 2 cores), resumable
    python -m tools.results.pick_demo --choose-only         # re-choose from the JSON, rewrite the example and demo.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from edgekv.threads import prepare_process

ROOT = Path(__file__).resolve().parents[2]

prepare_process()  # before anything imports torch: its thread pools read the settings once

from tools.results import make_example_prompt as mep  # noqa: E402

OUT_JSON = ROOT / "docs" / "results" / "demo.json"
OUT_MD = ROOT / "docs" / "results" / "demo.md"
LENGTHS = [1500, 2500, 4000]
POLICIES = ["keydiff", "lagkv", "snapkv++", "streaming"]
BUDGETS = [256, 512, 1024]
MAX_NEW = 48
MAX_BUDGET_SHARE = 0.5  # a "real budget" keeps at most half of the prompt's tokens


def key(run: dict) -> str:
    return f"{run['tokens']}|{run['question']}|{run['policy']}|{run['budget']}"


def load(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"runs": []}


def save(path: Path, data: dict) -> None:
    from edgekv.output_files import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def one_run(model, text: str, policy: str, budget: int | None, threads: int) -> dict:
    """``edgekv run --chat --prompt-file F --policy P --budget N`` (budget None: the full cache)."""
    from edgekv.engine import Sampler
    from edgekv.engine.session import open_eager_session
    from edgekv.job import encode_prompt, run
    from edgekv.memory import kv_cache_bytes
    from edgekv.threads import apply_threads

    apply_threads(threads)
    ids = encode_prompt(model, text, chat=True)
    n = int(ids.numel())
    b = str(budget if budget is not None else max(n + MAX_NEW, 128))
    t0 = time.perf_counter()
    session = open_eager_session(model, policy if budget is not None else "full", {}, b, 128, n + MAX_NEW, None)
    res = run(session, model, prompt_ids=ids, max_new_tokens=MAX_NEW, new_sampler=Sampler)
    full_kv = kv_cache_bytes(model.config, n + len(res.generated_ids))
    return {"prompt_tokens": n, "answer": res.text.strip(), "generated_tokens": len(res.generated_ids),
            "seconds": round(time.perf_counter() - t0, 1),
            "kv_bytes": res.report["memory"]["plan"]["kv_cache"], "full_kv_bytes": full_kv, "threads": threads}


def sweep(args) -> dict:
    from edgekv.evaluation.report import provenance
    from edgekv.job import encode_prompt
    from edgekv.models import load_model
    from edgekv.threads import default_threads

    data = load(args.json)
    # the latest sweep, stamped before it runs (--choose-only keeps the file's own)
    data["provenance"] = provenance([sys.executable, *sys.argv])
    done = {key(r) for r in data["runs"]}
    threads = args.threads or default_threads()
    model = load_model(args.model)
    data["setup"] = {"model": model.model_id, "lengths": args.lengths, "questions": args.questions,
                     "policies": args.policies, "budgets": args.budgets, "max_new_tokens": MAX_NEW, "block": 128,
                     "chat": True, "greedy": True}
    for tokens in args.lengths:
        for qid in args.questions:
            q = mep.QUESTIONS_BY_ID[qid]
            text = mep.build(tokens, qid)
            plan = [("full", None)]
            if tokens == args.lengths[0]:
                plan.append(("none", None))  # the question alone (once per question)
            plan += [(p, b) for p in args.policies for b in args.budgets]
            full_right = None
            n_prompt = int(encode_prompt(model, text, chat=True).numel())
            for policy, budget in plan:
                run = {"tokens": tokens, "question": qid, "policy": policy, "budget": budget}
                if key(run) in done:
                    prior = next(r for r in data["runs"] if key(r) == key(run))
                    if policy == "full":
                        full_right = prior["right"]
                    continue
                if policy not in ("full", "none") and full_right is False:
                    continue  # the model gets it wrong with everything kept: nothing to learn
                if policy == "none":
                    body = f"Question: {q.text[0].upper() + q.text[1:]} Answer in one or two sentences.\nAnswer:"
                    run.update(one_run(model, body, "full", None, threads))
                else:
                    if budget is not None and budget > MAX_BUDGET_SHARE * n_prompt:
                        continue  # keeps more than half the prompt: not a real budget
                    run.update(one_run(model, text, policy, budget, threads))
                run["right"] = q.is_right(run["answer"])
                if policy == "full":
                    full_right = run["right"]
                data["runs"].append(run)
                done.add(key(run))
                save(args.json, data)
                print(f"{tokens:>5} {qid:<17} {policy:<9} {str(budget):>5} {run['prompt_tokens']:>5} tok "
                      f"{'RIGHT' if run['right'] else 'wrong'} {run['seconds']:>5.1f}s  {run['answer'][:90]!r}",
                      flush=True)
    return data


def candidates(data: dict, tokenizer=None) -> list[dict]:
    """Runs whose answer is right at their budget and at every larger budget tried (same prompt and
    policy), with the full cache right too; best first."""
    runs = data["runs"]
    by = {key(r): r for r in runs}
    no_doc = {r["question"]: r["right"] for r in runs if r["policy"] == "none"}

    def reliability(r: dict) -> float:
        """Share of the prompts of this length that the full cache answers right which this policy
        also answers right at this budget (one lucky prompt is not a setting that works)."""
        answerable = {x["question"] for x in runs if x["tokens"] == r["tokens"] and x["policy"] == "full" and x["right"]}
        got = [by.get(f"{r['tokens']}|{q}|{r['policy']}|{r['budget']}") for q in answerable]
        return sum(bool(g and g["right"]) for g in got) / len(answerable)

    out = []
    for r in runs:
        if r["policy"] in ("full", "none") or not r["right"] or r.get("note"):
            continue
        full = by.get(f"{r['tokens']}|{r['question']}|full|None")
        if not full or not full["right"]:
            continue
        larger = [x for x in runs if x["tokens"] == r["tokens"] and x["question"] == r["question"]
                  and x["policy"] == r["policy"] and x["budget"] is not None and x["budget"] > r["budget"]
                  and not x.get("note")]
        if not all(x["right"] for x in larger):
            continue
        out.append({**r, "robust_budgets": sorted([r["budget"]] + [x["budget"] for x in larger]),
                    "answerable_without_document": bool(no_doc.get(r["question"])),
                    "kv_share": r["kv_bytes"] / r["full_kv_bytes"], "ends_by_itself": ends_by_itself(r, tokenizer),
                    "reliability": reliability(r)})
    # prefer: a policy and budget right on every prompt of this length that the full cache answers, a
    # question that needs the document, an answer that ends by itself (the model stops instead of
    # rambling on to the token limit), the smallest share of the full cache, a longer prompt
    out.sort(key=lambda c: (-c["reliability"], c["answerable_without_document"], not c["ends_by_itself"],
                            round(c["kv_share"], 2), -c["prompt_tokens"]))
    return out


def ends_by_itself(run: dict, tokenizer) -> bool:
    """The model stopped (EOS) before the token limit."""
    if "generated_tokens" in run:
        return run["generated_tokens"] < MAX_NEW
    if tokenizer is None:
        return False
    return len(tokenizer(run["answer"])["input_ids"]) < MAX_NEW - 2  # runs recorded before the count was


def verify(model, cand: dict) -> list[dict]:
    text = mep.build(cand["tokens"], cand["question"])
    q = mep.QUESTIONS_BY_ID[cand["question"]]
    checks = []
    for threads in (1, 2):
        r = one_run(model, text, cand["policy"], cand["budget"], threads)
        checks.append({"threads": threads, "answer": r["answer"], "right": q.is_right(r["answer"])})
        print(f"verify {cand['policy']} N={cand['budget']} threads={threads}: "
              f"{'RIGHT' if checks[-1]['right'] else 'wrong'} {r['answer'][:90]!r}", flush=True)
    return checks


def choose(args, data: dict) -> dict:
    from edgekv.models import load_model

    model = load_model(args.model)
    cands = candidates(data, model.tokenizer)
    if not cands:
        raise SystemExit("no candidate answered right under an evicting budget; widen the sweep")
    data.setdefault("verified", {})
    for c in cands:
        k = key(c)
        if k not in data["verified"]:
            data["verified"][k] = verify(model, c)
            save(args.json, data)
        if all(v["right"] for v in data["verified"][k]):
            data["choice"] = {"document_tokens": c["tokens"], "question": c["question"], "policy": c["policy"],
                              "budget": c["budget"], "prompt_tokens": c["prompt_tokens"], "answer": c["answer"],
                              "kv_bytes": c["kv_bytes"], "full_kv_bytes": c["full_kv_bytes"],
                              "robust_budgets": c["robust_budgets"],
                              "answerable_without_document": c["answerable_without_document"],
                              "ends_by_itself": c["ends_by_itself"], "reliability": c["reliability"],
                              "verified": data["verified"][k],
                              "command": (f"edgekv run --prompt-file examples/long_document.txt --chat "
                                          f"--budget {c['budget']} --policy {c['policy']}")}
            break
    else:
        raise SystemExit("no candidate stayed right with 1 and 2 threads")
    data["machine"] = {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()}
    command = ("python -m tools.results.pick_demo " + " ".join(sys.argv[1:])).strip()
    data.setdefault("commands", [])  # every invocation that added runs or chose (the sweep is resumable)
    if command not in data["commands"]:
        data["commands"].append(command)
    save(args.json, data)
    EXAMPLE = mep.EXAMPLE
    EXAMPLE.write_text(mep.build(data["choice"]["document_tokens"], data["choice"]["question"]))
    OUT_MD.write_text(markdown(data))
    print(f"chose {data['choice']['command']} — wrote {EXAMPLE}, {args.json}, {OUT_MD}")
    return data


def _cpu() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def markdown(data: dict) -> str:
    from edgekv.units import human_bytes

    c = data["choice"]
    runs = data["runs"]
    L = ["# The README's main job, chosen by measurement", "",
         "<!-- generated by tools/results/pick_demo.py from docs/results/demo.json; do not edit by hand -->", "",
         "Commands (in order; the sweep resumes from the JSON): " + ", ".join(f"`{c}`" for c in data["commands"])
         + f" on {data['machine']['cpu']} ({data['machine']['cores']} cores"
         + (f", latest sweep at commit {data['provenance']['commit']}" if data.get("provenance") else "") + "). "
         f"SmolLM2-135M-Instruct, eager engine, chat template, greedy, {data['setup']['max_new_tokens']} new tokens, "
         f"B = {data['setup']['block']}. A candidate is a document length × a question whose right answer is a "
         "checkable phrase (`tools/results/make_example_prompt.py`); it is dropped when the full cache answers it wrongly.", "",
         f"**Chosen:** `{c['command']}` — {c['prompt_tokens']:,} prompt tokens, question `{c['question']}`, "
         f"policy {c['policy']} at N = {c['budget']}: right at N = {', '.join(map(str, c['robust_budgets']))}, "
         f"right with 1 and 2 threads; KV cache {human_bytes(c['kv_bytes'])} against "
         f"{human_bytes(c['full_kv_bytes'])} for the full cache ({100 * (1 - c['kv_bytes'] / c['full_kv_bytes']):.0f} % "
         "saved). " + ("The model cannot answer this question without the document."
                       if not c["answerable_without_document"] else
                       "The model answers this question without the document too (no candidate needed it)."), "",
         f"Answer: “{c['answer']}”", "",
         "How the choice is made: among runs whose answer is right at their budget and at every larger budget "
         "tried for the same prompt and policy (and right with the full cache), prefer the policy and budget that "
         "answer right on the most prompts of that length the full cache answers, then a question the model cannot "
         "answer without the document, then an answer that ends by itself rather than running on to the token "
         "limit, then the smallest KV cache as a share of the full cache, then the longer prompt; the first that "
         f"is still right when re-run with 1 and with 2 threads is chosen (this one: right on "
         f"{100 * c['reliability']:.0f} % of those prompts).", "",
         "## Right answers per candidate (✓ right, ✗ wrong, – not run or budget above half the prompt)", ""]
    questions = list(dict.fromkeys(r["question"] for r in runs))
    lengths = sorted({r["tokens"] for r in runs})
    no_doc = {r["question"]: r for r in runs if r["policy"] == "none"}
    pols = data["setup"]["policies"]
    budgets = data["setup"]["budgets"]
    head = ["document", "question", "prompt tokens", "no document", "full"] + [f"{p} {b}" for p in pols for b in budgets]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    by = {key(r): r for r in runs}
    seen: dict[tuple, list[int]] = {}  # two requested lengths can give the same document
    for t in lengths:
        for qid in questions:
            full = by.get(f"{t}|{qid}|full|None")
            if full:
                seen.setdefault((qid, full["prompt_tokens"]), []).append(t)
    for (qid, n), ts in seen.items():
        t = ts[0]
        full = by[f"{t}|{qid}|full|None"]
        cells = ["/".join(f"~{x}" for x in ts), qid, f"{n:,}", "✓" if no_doc.get(qid, {}).get("right") else "✗",
                 "✓" if full["right"] else "✗"]
        for p in pols:
            for b in budgets:
                r = by.get(f"{t}|{qid}|{p}|{b}")
                cells.append("–" if r is None or r.get("note") else ("✓" if r["right"] else "✗"))
        L.append("| " + " | ".join(cells) + " |")
    lost = []  # requested lengths at which the full cache answered no question
    for t in lengths:
        fulls = [r for r in runs if r["tokens"] == t and r["policy"] == "full"]
        if fulls and not any(r["right"] for r in fulls):
            lost.append(min(r["prompt_tokens"] for r in fulls))
    if lost:
        L += ["", f"With prompts of {min(lost):,} tokens and longer the full cache answered none of the questions: "
                  "at those lengths the model itself, not eviction, loses the answer, so the main job uses the "
                  "shorter document."]
    L += ["", "Right answers by policy and budget (candidates the full cache answers):", ""]
    L.append("| policy | " + " | ".join(f"N={b}" for b in budgets) + " |")
    L.append("|---|" + "---:|" * len(budgets))
    for p in pols:
        cells = []
        for b in budgets:
            rs = [r for r in runs if r["policy"] == p and r["budget"] == b and not r.get("note")]
            cells.append(f"{sum(r['right'] for r in rs)}/{len(rs)}" if rs else "–")
        L.append(f"| {p} | " + " | ".join(cells) + " |")
    L.append("")
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=LENGTHS)
    ap.add_argument("--questions", type=lambda s: s.split(","), default=[q.id for q in mep.QUESTIONS])
    ap.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    ap.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=BUDGETS)
    ap.add_argument("--threads", type=int, default=None, help="threads for the sweep (default: edgekv's default)")
    ap.add_argument("--json", type=Path, default=OUT_JSON)
    ap.add_argument("--choose-only", action="store_true", help="choose from the JSON without running the sweep")
    args = ap.parse_args()
    data = load(args.json) if args.choose_only else sweep(args)
    choose(args, data)


if __name__ == "__main__":
    main()
