"""Read a document once, ask many questions: what a saved cache costs and saves (issue 20).

    python tools/bench/bench_snapshot.py [--lengths 4k,7k] [--budget 512] [--block 128] [--seeds 0,1]
                                   [--agnostic keydiff,lagkv,streaming] [--aware snapkv++,snapkv,tova,h2o,dapq]
                                   [--out docs/results]

On SmolLM2, for documents of each length holding three facts of different kinds (a pass key, a
door code, a room number — each a 5-digit number in the repeated-filler haystack of the passkey
task), with one question per fact:

* size: our snapshot at N (eager and compiled, fp32) against our own full fp32 cache of the same
  document (a `full` snapshot) and llama.cpp's state file after the same document
  (`llama_state_save_file`: its full f16 cache; needs `llama-cpp-python`, the `bench` extra);
* time to first token of a follow-up question: from the snapshot (load + the question's
  prefill) against re-reading the document (document + question), for the eager engine,
  HostRuntime and the native runtime (`edgekv-run --save-cache` / `--load-cache`);
* multi-question accuracy: query-agnostic policies answer every question from ONE snapshot;
  query-aware policies re-read the document for each question (the question's queries score
  the last block); the full cache is the ceiling.

Writes snapshot.json, snapshot.md and snapshot.png."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

KINDS = ("pass key", "door code", "room number")
INTRO = ("There are three numbers hidden inside a lot of irrelevant text: a pass key, a door code and a room "
         "number. Find them and memorize them. I will quiz you about them.\n\n")


def parse_len(s: str) -> int:
    return int(float(s[:-1]) * 1024) if s.lower().endswith("k") else int(s)


def make_document(tok, length: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """~``length`` tokens of filler with the three facts at depths 0.2 / 0.5 / 0.8."""
    from edgekv.evaluation.tasks import REPEAT_FILLER, needle_paragraph

    rng = random.Random(seed * 7919 + length)
    values = [str(rng.randrange(10000, 100000)) for _ in KINDS]
    unit = [s.strip().rstrip(".") + "." for s in REPEAT_FILLER.split(". ") if s.strip()]
    per = len(tok(" " + " ".join(unit), add_special_tokens=False)["input_ids"]) / len(unit)
    n_sent = int((length - 150) / per)
    sents = (unit * (n_sent // len(unit) + 2))[:n_sent]
    pieces, last = [], 0
    for depth, kind, value in zip((0.2, 0.5, 0.8), KINDS, values):
        cut = int(depth * n_sent)
        pieces.append(" ".join(sents[last:cut]))
        pieces.append(needle_paragraph(value, kind).strip())
        last = cut
    pieces.append(" ".join(sents[last:]))
    return INTRO + "\n\n".join(pieces), list(zip(KINDS, values))


def question(kind: str) -> str:
    return f"What is the {kind} mentioned in the text above?"


def question_ids(tok, kind: str) -> list[int]:
    """The question part, then the answer's start in the assistant turn (as the passkey task
    does: SmolLM2-135M answers with the number only when the reply is started for it)."""
    from edgekv.models.chat import encode_question

    return encode_question(tok, question(kind), True) + tok(f"The {kind} is", add_special_tokens=False)["input_ids"]


def answer_ok(text: str, value: str) -> bool:
    from edgekv.evaluation.tasks import extract_key

    return extract_key(text) == value


def eager_engine(model, name, budget, block):
    from edgekv.engine import BlockEngine
    from edgekv.policies import make_policy

    return BlockEngine(model, make_policy(name, {}), budget, block)


def answer(engine, q_ids, tok, new_tokens=12) -> tuple[str, float]:
    """Greedy answer and the seconds to its first token (question prefill + one sample)."""
    import torch

    t0 = time.perf_counter()
    logits = engine.prefill(torch.tensor(q_ids))
    first = time.perf_counter() - t0
    ids = [int(logits.argmax())]
    for _ in range(new_tokens - 1):
        if ids[-1] == tok.eos_token_id:
            break
        ids.append(int(engine.decode(ids[-1]).argmax()))
    return tok.decode(ids, skip_special_tokens=True), first


def accuracy(model, tok, docs, args, work: Path) -> list[dict]:
    import torch

    from edgekv.models.chat import encode_document

    rows = []
    for name in ["full"] + args.agnostic + args.aware:
        ok = total = 0
        for length, seed, text, facts in docs:
            d_ids = encode_document(tok, text, True)
            budget = len(d_ids) + 128 if name == "full" else args.budget
            if name == "full" or name in args.agnostic:  # one reading, one snapshot, every question from it
                eng = eager_engine(model, name, budget, args.block)
                eng.prefill(torch.tensor(d_ids))
                snap = work / f"{name}-{length}-{seed}.ekv"
                eng.save_cache(snap)
                for kind, value in facts:
                    e = eager_engine(model, name, budget, args.block)
                    e.load_cache(snap)
                    ok += answer_ok(answer(e, question_ids(tok, kind), tok)[0], value)
                    total += 1
                snap.unlink()
            else:  # query-aware: the document read again for each question
                for kind, value in facts:
                    e = eager_engine(model, name, budget, args.block)
                    e.prefill(torch.tensor(d_ids))
                    ok += answer_ok(answer(e, question_ids(tok, kind), tok)[0], value)
                    total += 1
        rows.append({"policy": name, "workflow": "one snapshot, every question" if name == "full" or
                     name in args.agnostic else "document re-read per question", "correct": ok, "questions": total})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def llama_state_bytes(d_ids: list[int], work: Path) -> int | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from edgekv.models.sources import resolve

    llm = Llama(model_path=str(resolve("smollm2-135m").path), n_ctx=len(d_ids) + 64, verbose=False)
    llm.eval(d_ids)
    path = work / "llama.state"
    import llama_cpp

    tokens = (llama_cpp.llama_token * len(d_ids))(*d_ids)
    llama_cpp.llama_state_save_file(llm.ctx, str(path).encode(), tokens, len(d_ids))
    return path.stat().st_size


def sizes_and_ttft(model, tok, doc, args, work: Path) -> dict:
    import torch

    from edgekv.compiler import compile_model
    from edgekv.models.chat import encode_document
    from edgekv.policies import make_policy
    from edgekv.runtime import HostRuntime, native

    length, seed, text, facts = doc
    d_ids = encode_document(tok, text, True)
    q_ids = question_ids(tok, facts[1][0])
    out: dict = {"length": length, "document_tokens": len(d_ids), "question_tokens": len(q_ids)}
    # sizes
    eng = eager_engine(model, "keydiff", args.budget, args.block)
    eng.prefill(torch.tensor(d_ids))
    eng.save_cache(work / "kd.ekv")
    out["snapshot_bytes"] = (work / "kd.ekv").stat().st_size
    full = eager_engine(model, "full", len(d_ids) + 128, args.block)
    full.prefill(torch.tensor(d_ids))
    full.save_cache(work / "full.ekv")
    out["full_fp32_snapshot_bytes"] = (work / "full.ekv").stat().st_size
    del full
    (work / "full.ekv").unlink()
    out["llama_cpp_state_bytes"] = llama_state_bytes(d_ids, work)
    # time to first token, eager
    fresh = eager_engine(model, "keydiff", args.budget, args.block)
    t0 = time.perf_counter()
    fresh.prefill(torch.tensor(d_ids))
    doc_s = time.perf_counter() - t0
    _, q_s = answer(fresh, q_ids, tok, 1)
    t0 = time.perf_counter()
    e = eager_engine(model, "keydiff", args.budget, args.block)
    e.load_cache(work / "kd.ekv")
    load_s = time.perf_counter() - t0
    _, q2_s = answer(e, q_ids, tok, 1)
    out["eager"] = {"fresh_ttft_s": doc_s + q_s, "snapshot_ttft_s": load_s + q2_s, "load_s": load_s}
    # compiled: HostRuntime and the native runtime on one artifact
    art = work / "art"
    if not (art / "program.ekv").is_file():
        compile_model(model, make_policy("keydiff", {}), args.budget, args.block, out_dir=art)
    rt = HostRuntime(art)
    t0 = time.perf_counter()
    rt.prefill(d_ids)
    rt.prefill(q_ids)
    fresh_s = time.perf_counter() - t0
    rt.reset()
    rt.prefill(d_ids)
    rt.save_cache(work / "hr.ekv")
    rt2 = HostRuntime(art)
    t0 = time.perf_counter()
    rt2.load_cache(work / "hr.ekv")
    rt2.prefill(q_ids)
    out["compiled"] = {"fresh_ttft_s": fresh_s, "snapshot_ttft_s": time.perf_counter() - t0}
    exe = native.cli_path()
    if exe is not None:
        docf = work / "doc.txt"
        docf.write_text(text)
        rep1, rep2 = work / "n1.json", work / "n2.json"
        subprocess.run([str(exe), str(art), "--prompt-file", str(docf), "--chat", "--question", question(facts[1][0]),
                        "--save-cache", str(work / "n.ekv"), "--max-new-tokens", "1", "--quiet", "--report", str(rep1)],
                       check=True, capture_output=True)
        subprocess.run([str(exe), str(art), "--load-cache", str(work / "n.ekv"), "--chat", "--question",
                        question(facts[1][0]), "--max-new-tokens", "1", "--quiet", "--report", str(rep2)], check=True,
                       capture_output=True)
        r1, r2 = json.loads(rep1.read_text()), json.loads(rep2.read_text())
        out["native"] = {"fresh_ttft_s": r1["document_prefill_seconds"] + r1["answers"][0]["time_to_first_token_seconds"],
                         "snapshot_ttft_s": r2["answers"][0]["time_to_first_token_seconds"],
                         "snapshot_bytes": (work / "n.ekv").stat().st_size}
    return out


def cli_check(doc, args, work: Path) -> dict:
    """The workflow as a user runs it, through the `edgekv` command: read the document once with
    --save-cache, then `edgekv ask` three questions in one call; each answer against an
    uninterrupted `edgekv run --prompt-file DOC --question Q` of the same document and question."""
    length, seed, text, facts = doc
    docf = work / "cli-doc.txt"
    docf.write_text(text)
    snap, made = work / "cli.ekv", work / "cli-made.json"
    common = ["--chat", "--budget", str(args.budget), "--block", str(args.block), "--max-new-tokens", "12"]
    edgekv = [sys.executable, "-m", "edgekv"]
    subprocess.run([*edgekv, "run", "--prompt-file", str(docf), *common, "--save-cache", str(snap), "-o", str(made)],
                   check=True, capture_output=True)
    questions = [question(kind) for kind, _ in facts]
    asked = work / "cli-ask.json"
    subprocess.run([*edgekv, "ask", str(snap), *sum((["--question", q] for q in questions), []), "--max-new-tokens",
                    "12", "-o", str(asked)], check=True, capture_output=True)
    from_snapshot = json.loads(asked.read_text())["document"]["answers"]
    rows = []
    for (kind, value), q, a in zip(facts, questions, from_snapshot):
        one = work / "cli-one.json"
        subprocess.run([*edgekv, "run", "--prompt-file", str(docf), *common, "--question", q, "-o", str(one)],
                       check=True, capture_output=True)
        ref = json.loads(one.read_text())["document"]["answers"][0]
        rows.append({"question": q, "answer": a["text"], "fact": value, "has_fact": value in a["text"],
                     "equal_to_uninterrupted": a["generated_ids"] == ref["generated_ids"],
                     "load_seconds": a["load_seconds"], "question_prefill_seconds": a["question_prefill_seconds"],
                     "time_to_first_token_seconds": a["time_to_first_token_seconds"],
                     "uninterrupted_document_seconds": json.loads(one.read_text())["document"]["document_prefill_seconds"]})
    made_doc = json.loads(made.read_text())["document"]
    return {"document_tokens": made_doc["document_tokens"], "document_prefill_seconds": made_doc["document_prefill_seconds"],
            "snapshot_bytes": made_doc["snapshot_bytes"], "answers": rows,
            "commands": ["edgekv run --prompt-file DOC " + " ".join(common) + " --save-cache doc.ekv",
                         "edgekv ask doc.ekv " + " ".join(f'--question "{q}"' for q in questions) + " --max-new-tokens 12",
                         "edgekv run --prompt-file DOC " + " ".join(common) + ' --question "Q"   (each Q)']}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4k,7k")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--agnostic", default="keydiff,lagkv,streaming")
    ap.add_argument("--aware", default="snapkv++,snapkv,tova,h2o,dapq")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args()
    args.agnostic = [p for p in args.agnostic.split(",") if p]
    args.aware = [p for p in args.aware.split(",") if p]

    from edgekv.evaluation.report import provenance
    from edgekv.models import load_model

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    model = load_model("smollm2-135m")
    tok = model.tokenizer
    lengths = [parse_len(x) for x in args.lengths.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    docs = [(L, s, *make_document(tok, L, s)) for L in lengths for s in seeds]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        timing = [sizes_and_ttft(model, tok, next(x for x in docs if x[0] == L), args, work) for L in lengths]
        for t in timing:
            print(json.dumps(t), flush=True)
        cli = cli_check(next(x for x in docs if x[0] == max(lengths)), args, work)
        print(json.dumps(cli), flush=True)
        acc = accuracy(model, tok, docs, args, work)
    data = {"model": "smollm2-135m", "budget": args.budget, "block": args.block, "lengths": lengths, "seeds": seeds,
            "timing": timing, "cli": cli, "accuracy": acc, "command": "python tools/bench/bench_snapshot.py " + " ".join(sys.argv[1:]),
            "load_before": os.getloadavg(), "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "snapshot.json").write_text(json.dumps(data, indent=2))
    write_markdown(data, args.out / "snapshot.md")
    plot(data, args.out / "snapshot.png")


def mib(b):
    return "—" if b is None else f"{b / 2**20:.1f} MiB"


def write_markdown(data: dict, path: Path) -> None:
    lines = ["# Read once, ask many: saved caches", "",
             f"Regenerate: `{data['command']}` (SmolLM2-135M, N = {data['budget']}, B = {data['block']}, documents of "
             f"{', '.join(str(x) for x in data['lengths'])} tokens with three facts each)"
             + (f"; commit {data['provenance']['commit']}." if data.get("provenance") else "."), "",
             "| document | our snapshot (N) | our full fp32 cache | llama.cpp state file (full f16) |",
             "|---:|---:|---:|---:|"]
    for t in data["timing"]:
        lines.append(f"| {t['document_tokens']} | {mib(t['snapshot_bytes'])} | {mib(t['full_fp32_snapshot_bytes'])} | "
                     f"{mib(t['llama_cpp_state_bytes']) if t['llama_cpp_state_bytes'] else 'llama-cpp-python not installed'} |")
    lines += ["", "Time to first token of a follow-up question (seconds): re-reading the document vs from the snapshot",
              "", "| document | runtime | re-read | from snapshot | speed-up |", "|---:|---|---:|---:|---:|"]
    for t in data["timing"]:
        for rt in ("eager", "compiled", "native"):
            if rt in t:
                a, b = t[rt]["fresh_ttft_s"], t[rt]["snapshot_ttft_s"]
                lines.append(f"| {t['document_tokens']} | {rt} | {a:.2f} | {b:.2f} | {a / b:.0f}× |")
    cli = data["cli"]
    lines += ["", f"The workflow through the command line, on the {cli['document_tokens']}-token document: read once "
              f"({cli['document_prefill_seconds']:.1f} s, snapshot {mib(cli['snapshot_bytes'])}), then three questions "
              "in one `edgekv ask`; each answer compared with an uninterrupted `edgekv run --question` of the same "
              "document and question:", "", *[f"    {c}" for c in cli["commands"]], "",
              "| question | load (s) | question prefill (s) | first token (s) | uninterrupted run's document read (s) "
              "| same tokens as uninterrupted | answer holds the fact |", "|---|---:|---:|---:|---:|:---:|:---:|"]
    for r in cli["answers"]:
        lines.append(f"| {r['question']} | {r['load_seconds']:.3f} | {r['question_prefill_seconds']:.3f} | "
                     f"{r['time_to_first_token_seconds']:.3f} | {r['uninterrupted_document_seconds']:.1f} | "
                     f"{'yes' if r['equal_to_uninterrupted'] else 'NO'} | {'yes' if r['has_fact'] else 'no'} |")
    lines += ["", "Multi-question accuracy (each document: 3 questions; the answer's first number must be the fact)",
              "", "| policy | workflow | correct |", "|---|---|---:|"]
    for r in data["accuracy"]:
        lines.append(f"| {r['policy']} | {r['workflow']} | {r['correct']}/{r['questions']} |")
    lines += ["", "Query-agnostic policies (KeyDiff, LagKV, streaming) make a cache that does not depend on the "
              "question, so one reading serves every question. Query-aware policies (SnapKV, SnapKV++, TOVA, H2O, "
              "DapQ) are the workflow that re-reads the document per question; but until the question's queries "
              "score the blocks (issue 16, not built yet) each block is scored with its own last rows, so a "
              "re-read gives them the same cache as one snapshot would: their row is the policy's accuracy, not a "
              "gain from re-reading.", f"\nLoad average before the run: {data['load_before']}."]
    path.write_text("\n".join(lines) + "\n")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels, fresh, snap = [], [], []
    for t in data["timing"]:
        for rt in ("eager", "compiled", "native"):
            if rt in t:
                labels.append(f"{rt}\n{t['document_tokens']}")
                fresh.append(t[rt]["fresh_ttft_s"])
                snap.append(t[rt]["snapshot_ttft_s"])
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], fresh, 0.4, label="re-read the document")
    ax1.bar([i + 0.2 for i in x], snap, 0.4, label="from the snapshot")
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set(ylabel="seconds to first token", title="follow-up question")
    ax1.legend()
    acc = data["accuracy"]
    ax2.bar([r["policy"] for r in acc], [r["correct"] / max(r["questions"], 1) for r in acc])
    ax2.set(ylabel="correct answers", title="three questions per document", ylim=(0, 1))
    ax2.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
