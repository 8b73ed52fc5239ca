"""The `--question` demo on the real model (issue 16's "done when"): a 7K-token document with a
pass key, read block-wise at N = 512 by SnapKV++ through the `edgekv run` command — once with the
question appended to the document as one prompt (the block-wise default: each block scores with
its own rows), once with `--question` (every block scores with the question's queries).

Candidates (needle depth, seed) are tried in order; each is recorded. The demo is the first one
whose answer is right with `--question` and wrong without; with ``--compiled`` the same document
and question also run through a SmolLM2 artifact compiled with `--question-rows` (native runtime).

    python tools/experiments/question_demo.py                      # docs/results/question_demo.{json,md}
    python tools/experiments/question_demo.py --compiled           # + the compiled artifact (compiles ~2-5 min)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from edgekv.evaluation.report import provenance
from edgekv.evaluation.tasks import INTRO, build_passkey, extract_key
from edgekv.evaluation.tasks import QUESTION as EVAL_QUESTION
from edgekv.output_files import write_json_atomic
from edgekv.models import load_model
from edgekv.models.chat import QUESTION_SEPARATOR

ROOT = Path(__file__).resolve().parents[2]


# `edgekv eval` starts the assistant's turn with "The pass key is" for the model; a user of `edgekv run`
# cannot, so the question asks for the number (the full cache answers it so)
QUESTION = "What is the pass key? Answer with the number only."


def documents(tokenizer, length: int, depth: float, seed: int) -> tuple[str, str]:
    """(document, answer) of ``edgekv eval``'s passkey prompt: the user turn before its question."""
    p = build_passkey(tokenizer, length, depth, seed, haystack="repeat")  # its recorded results
    text = tokenizer.decode(p.ids.tolist())
    return text[text.index(INTRO): text.index(QUESTION_SEPARATOR + EVAL_QUESTION)], p.answer


def edgekv_run(model: str, doc: Path, report: Path, question: str | None, args) -> dict:
    cmd = [sys.executable, "-m", "edgekv", "run", model, "--prompt-file", str(doc), "--chat",
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "-o", str(report)]
    if question is not None:
        cmd += ["--question", question]
    if not Path(model).is_dir():  # an artifact carries its own policy, N and B
        cmd += ["--policy", args.policy, "--budget", str(args.budget), "--block", str(args.block)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    data = json.loads(report.read_text())
    text = data["document"]["answers"][0]["text"] if question is not None else data["text"]
    return {"command": "edgekv " + shlex.join(cmd[3:]).replace(str(ROOT) + "/", ""), "answer_text": text,
            "seconds": time.perf_counter() - t0, "question_scoring": data.get("question_scoring", False),
            "prompt_tokens": data.get("document", {}).get("document_tokens") or data.get("prompt_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=7168)
    ap.add_argument("--candidates", default="0.5:0,0.3:0,0.7:0,0.5:1,0.3:1,0.7:1",
                    help="needle depth:seed pairs, tried in order")
    ap.add_argument("--policy", default="snapkv++")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="also run an artifact compiled with --question-rows")
    ap.add_argument("--question-rows", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/question_demo")
    args = ap.parse_args()
    work = ROOT / "build/question_demo"
    work.mkdir(parents=True, exist_ok=True)
    tok = load_model("smollm2-135m").tokenizer
    rows, demo = [], None
    for pair in args.candidates.split(","):
        depth, seed = float(pair.split(":")[0]), int(pair.split(":")[1])
        doc, answer = documents(tok, args.length, depth, seed)
        doc_file, whole_file = work / f"doc_d{depth:g}_s{seed}.txt", work / f"whole_d{depth:g}_s{seed}.txt"
        doc_file.write_text(doc)
        whole_file.write_text(doc + QUESTION_SEPARATOR + QUESTION)  # the same text as one prompt
        row = {"depth": depth, "seed": seed, "answer": answer, "document": str(doc_file.relative_to(ROOT))}
        row["with_question"] = edgekv_run("smollm2-135m", doc_file, work / "with.json", QUESTION, args)
        row["without_question"] = edgekv_run("smollm2-135m", whole_file, work / "without.json", None, args)
        for k in ("with_question", "without_question"):
            row[k]["predicted"] = extract_key(row[k]["answer_text"])
            row[k]["correct"] = row[k]["predicted"] == answer
        print(f"depth {depth} seed {seed}: with --question {row['with_question']['predicted']}, without "
              f"{row['without_question']['predicted']} (answer {answer})", flush=True)
        rows.append(row)
        if row["with_question"]["correct"] and not row["without_question"]["correct"]:
            demo = row
            break
    if demo is not None and args.compiled:
        art = work / f"art-{args.policy}-n{args.budget}-q{args.question_rows}"
        cmd = [sys.executable, "-m", "edgekv", "compile", "smollm2-135m", "--policy", args.policy, "--budget",
               str(args.budget), "--block", str(args.block), "--question-rows", str(args.question_rows), "-o", str(art)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        demo["compile_seconds"] = time.perf_counter() - t0
        doc_file = ROOT / demo["document"]
        for k, q, f in (("compiled_with_question", QUESTION, doc_file),
                        ("compiled_without_question", None, doc_file.with_name(doc_file.name.replace("doc_", "whole_")))):
            demo[k] = edgekv_run(str(art), f, work / f"{k}.json", q, args)
            demo[k]["predicted"] = extract_key(demo[k]["answer_text"])
            demo[k]["correct"] = demo[k]["predicted"] == demo["answer"]
    data = {"provenance": provenance(sys.argv), "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                              for k, v in vars(args).items()},
            "question": QUESTION, "candidates": rows, "demo": demo}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out.with_suffix(".json"), data)
    md = ["## `--question` on a 7K-token document (`tools/experiments/question_demo.py`)", "",
          f"SmolLM2-135M-Instruct, {args.policy}, N = {args.budget}, B = {args.block}, a {args.length}-token pass-key "
          f"document, question \"{QUESTION}\". Without `--question` the question is appended to the document and "
          "the whole text is one prompt (each block scores with its own rows); with it, every block scores with "
          "the question's queries.", "",
          f"commit {data['provenance']['commit']} · `{data['provenance']['command']}`", "",
          "| depth | seed | answer | without --question | with --question |", "|---:|---:|---|---|---|"]
    for r in rows:
        md.append(f"| {r['depth']:g} | {r['seed']} | {r['answer']} | {r['without_question']['predicted']} "
                  f"({'right' if r['without_question']['correct'] else 'wrong'}) | {r['with_question']['predicted']} "
                  f"({'right' if r['with_question']['correct'] else 'wrong'}) |")
    if demo is not None:
        md += ["", "The demo (the first candidate answered only with the question):", "", "```",
               demo["with_question"]["command"], "```", "",
               f"answers \"{demo['with_question']['answer_text'].strip()}\"; without `--question` (`"
               f"{demo['without_question']['command']}`) it answers \"{demo['without_question']['answer_text'].strip()}\"."]
        if "compiled_with_question" in demo:
            c, w = demo["compiled_with_question"], demo["compiled_without_question"]
            md += ["", f"Compiled (`--question-rows {args.question_rows}`, q4 weights, native runtime): with the "
                       f"question \"{c['answer_text'].strip()}\" ({'right' if c['correct'] else 'wrong'}), without "
                       f"\"{w['answer_text'].strip()}\" ({'right' if w['correct'] else 'wrong'})."]
    else:
        md += ["", "No candidate was answered with `--question` and missed without it."]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
