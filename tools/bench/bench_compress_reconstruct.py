"""What `--compress reconstruct` costs, and a quick look at what it keeps (issue 34).

    python tools/bench/bench_compress_reconstruct.py cost [--lengths 2k,7k,16k] [--budget 1024] [--block 128]
    python tools/bench/bench_compress_reconstruct.py quality [--length 7k] [--budget 1024] [--seeds 0,1,2,3,4]
                                                            [--haystack text,repeat]

cost: on SmolLM2 (eager engine), a document of each length (the passkey task's natural-text haystack,
its question left out) read with plain KeyDiff and with --compress reconstruct, each in its own
process (so each peak RSS is its own), the two interleaved per length. Records the document's read
time, the ratio, the static memory plan (which counts the reconstruction rows) and the measured peak
RSS. Writes docs/results/compress_reconstruct.{json,md}.

quality: passkey prompts of one length, the document read without the question and saved state
reused for it (the question prefilled after the document, as `edgekv ask` does), answered greedily:
reconstruct against KeyDiff at the same N, and the full cache. Writes
docs/results/compress_reconstruct_quality.{json,md}. The full grid (multi-key, SCBench-style turns,
intervals) is `edgekv eval`'s, not this tool's."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results"
SHARED = ("Measured on a shared machine (2 cores, other jobs running): the ratios of the two modes, "
          "interleaved per length, are the figures to read; absolute times are not quiet-machine figures.")


def parse_len(s: str) -> int:
    return int(float(s[:-1]) * 1024) if s.lower().endswith("k") else int(s)


def document_ids(tok, length: int, seed: int = 0, haystack: str = "text", depth: float = 0.5):
    """(document ids, question ids, answer) of a passkey prompt: the document part is everything
    before the question (``Prompt.question_start``)."""
    from edgekv.evaluation.tasks import build_passkey

    p = build_passkey(tok, length, depth, seed, haystack=haystack)
    return p.ids[: p.question_start], p.ids[p.question_start:], p.answer


CHILD = r"""
import json, resource, sys, time, torch
from edgekv.models import load_model
sys.path.insert(0, {root!r})
from tools.bench.bench_compress_reconstruct import document_ids
from edgekv.engine.session import open_eager_session
model = load_model(None)
doc, _, _ = document_ids(model.tokenizer, {length})
rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
s = open_eager_session(model, "keydiff", {{}}, "{budget}", {block}, None, None, compress={compress!r})
t0 = time.perf_counter()
s.prefill(doc)
dt = time.perf_counter() - t0
print(json.dumps({{"tokens": int(doc.numel()), "seconds": dt, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_after_load": rss_loaded, "plan": s.plan.to_dict(), "capacity": s.engine.capacity,
                  "extra_rows": s.engine.extra_rows, "torch_threads": torch.get_num_threads()}}))
"""


def run_child(length: int, budget: int, block: int, compress: str | None) -> dict:
    code = CHILD.format(root=str(ROOT), length=length, budget=budget, block=block, compress=compress)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({length}, {compress}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cost(args) -> None:
    from edgekv.evaluation.report import provenance

    rows, meta = [], provenance(sys.argv)
    for text in args.lengths.split(","):
        length = parse_len(text)
        plain = run_child(length, args.budget, args.block, None)
        recon = run_child(length, args.budget, args.block, "reconstruct")
        row = {"length": text, "tokens": plain["tokens"], "plain": plain, "reconstruct": recon,
               "time_ratio": recon["seconds"] / plain["seconds"]}
        rows.append(row)
        print(f"{text}: plain {plain['seconds']:.1f} s, reconstruct {recon['seconds']:.1f} s "
              f"({row['time_ratio']:.2f}x); peak RSS {plain['peak_rss'] / 2**20:.0f} / {recon['peak_rss'] / 2**20:.0f} MiB",
              flush=True)
        write_cost(args, rows, meta)  # after every length: a long sweep keeps what it measured


def write_cost(args, rows: list, meta: dict) -> None:
    data = {"meta": meta, "budget": args.budget, "block": args.block, "note": SHARED, "rows": rows}
    (OUT / "compress_reconstruct.json").write_text(json.dumps(data, indent=1) + "\n")
    md = ["# `--compress reconstruct`: cost against plain prefill", "",
          f"SmolLM2-135M, eager engine, N = {args.budget}, B = {args.block}; KeyDiff (plain) against reconstruct, "
          "each length's two runs interleaved, each in its own process. " + SHARED, "",
          f"Command: `{data['meta']['command']}` (commit {data['meta']['commit']}).", "",
          "| document | tokens | plain read (s) | reconstruct read (s) | ratio | plan plain (MiB) | plan reconstruct (MiB) "
          "| peak RSS plain (MiB) | peak RSS reconstruct (MiB) | extra rows / step |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, q = r["plain"], r["reconstruct"]
        md.append(f"| {r['length']} | {r['tokens']:,} | {p['seconds']:.1f} | {q['seconds']:.1f} | {r['time_ratio']:.2f}x "
                  f"| {p['plan']['total'] / 2**20:.0f} | {q['plan']['total'] / 2**20:.0f} | {p['peak_rss'] / 2**20:.0f} "
                  f"| {q['peak_rss'] / 2**20:.0f} | {q['extra_rows']} |")
    md += ["", "The plan is the static plan the session was checked against (weights + KV + one step's activations, "
           "the reconstruction rows counted); the peak RSS also holds the Python interpreter, torch and the tokenizer."]
    (OUT / "compress_reconstruct.md").write_text("\n".join(md) + "\n")


def answer(session, doc, question, tok, new_tokens: int = 8) -> str:
    from edgekv.engine import Sampler
    from edgekv.session import decode_tokens

    session.prefill(doc)
    logits = session.prefill(question)
    return tok.decode(decode_tokens(session, logits, Sampler(), new_tokens, eos_ids=(tok.eos_token_id,)))


def quality(args) -> None:
    from edgekv.engine.session import open_eager_session
    from edgekv.evaluation.report import provenance
    from edgekv.evaluation.tasks import extract_key
    from edgekv.models import load_model

    model = load_model(None)
    tok = model.tokenizer
    length = parse_len(args.length)
    modes = {"full": ("full", str(length + 64), None), "keydiff": ("keydiff", str(args.budget), None),
             "reconstruct": ("keydiff", str(args.budget), "reconstruct")}
    rows = []
    depths = (0.1, 0.3, 0.5, 0.7, 0.9)
    for haystack in args.haystack.split(","):
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            depth = depths[i % len(depths)]
            doc, question, key = document_ids(tok, length, seed, haystack, depth)
            row = {"haystack": haystack, "seed": seed, "depth": depth, "tokens": int(doc.numel()), "answer": key}
            for name, (policy, budget, compress) in modes.items():
                s = open_eager_session(model, policy, {}, budget, args.block, None, None, compress=compress)
                t0 = time.perf_counter()
                said = answer(s, doc, question, tok)
                row[name] = {"text": said, "correct": extract_key(said) == key,
                             "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(haystack, seed, depth, {n: row[n]["correct"] for n in modes}, flush=True)
    data = {"meta": provenance(sys.argv), "length": args.length, "budget": args.budget, "block": args.block,
            "rows": rows, "note": SHARED}
    (OUT / "compress_reconstruct_quality.json").write_text(json.dumps(data, indent=1) + "\n")
    md = [f"# `--compress reconstruct`: passkey at {args.length}, N = {args.budget}, without the question", "",
          f"SmolLM2-135M, eager, B = {args.block}: the document read without its question, the question prefilled "
          "after it (as `edgekv ask` does from a saved cache), 8 tokens greedy, exact match on the 5-digit key. "
          "A quick check on a handful of documents; the grid with intervals is the multi-question evaluation's.", "",
          f"Command: `{data['meta']['command']}` (commit {data['meta']['commit']}).", "",
          "| haystack | documents | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for haystack in args.haystack.split(","):
        sub = [r for r in rows if r["haystack"] == haystack]
        md.append(f"| {haystack} | {len(sub)} | " + " | ".join(
            f"{sum(r[n]['correct'] for r in sub)}/{len(sub)}" for n in modes) + " |")
    md += ["", "| haystack | seed | depth | " + " | ".join(modes) + " |", "|---|---|---|" + "---|" * len(modes)]
    for r in rows:
        md.append(f"| {r['haystack']} | {r['seed']} | {r['depth']} | " + " | ".join(
            ("✓ " if r[n]["correct"] else "✗ ") + repr(r[n]["text"].strip()[:24]).replace("|", "/") for n in modes) + " |")
    (OUT / "compress_reconstruct_quality.md").write_text("\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--lengths", default="2k,7k,16k")
    q = sub.add_parser("quality")
    q.add_argument("--length", default="7k")
    q.add_argument("--seeds", default="0,1,2,3,4")
    q.add_argument("--haystack", default="text,repeat")
    for p in (c, q):
        p.add_argument("--budget", type=int, default=1024)
        p.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    cost(args) if args.what == "cost" else quality(args)


if __name__ == "__main__":
    main()
