"""Passkey accuracy of a q4 artifact against the fp32 artifact of the same build (issue 14).

Both artifacts (same model, policy, N, B; ``--weights q4`` and ``--weights fp32``) answer the
same passkey prompts (``edgekv eval``'s ``build_passkey``: lengths × depths × seeds) through the
native runtime, greedily, as ``edgekv eval`` scores them (the first number in the answer). Writes
``docs/results/weights_passkey.{json,md,png}``.

    python tools/experiments/check_weights_passkey.py [--q4 build/art-keydiff-q4] [--fp32 build/art-keydiff]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q4", type=Path, default=REPO / "build" / "art-keydiff-q4")
    ap.add_argument("--fp32", type=Path, default=REPO / "build" / "art-keydiff")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    from rich.progress import track

    from edgekv.evaluation.report import provenance
    from edgekv.evaluation.tasks import build_passkey, extract_key
    from edgekv.runtime import native

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    arts = {"q4": args.q4, "fp32": args.fp32}
    manifests = {k: json.loads((p / "manifest.json").read_text()) for k, p in arts.items()}
    for k, m in manifests.items():
        fmt = (m.get("weights") or {}).get("format", "fp32")
        if fmt != k:
            raise SystemExit(f"--{k} {arts[k]} holds {fmt} weights")
    keys = ("policy", "budget", "block")
    a, b = ({k: (m["policy"]["name"] if k == "policy" else m[k]) for k in keys} for m in manifests.values())
    if a != b or manifests["q4"]["model"]["weight_hash"] != manifests["fp32"]["model"]["weight_hash"]:
        raise SystemExit(f"the artifacts are not the same build: {a} vs {b}")
    runtimes = {k: native.NativeRuntime(p) for k, p in arts.items()}
    tok = runtimes["q4"].tokenizer
    eos = {t for t in (getattr(tok, "eos_token_id", None),) if t is not None}
    prompts = [build_passkey(tok, int(L), float(d), int(s), haystack="repeat") for L in args.lengths.split(",")
               for d in args.depths.split(",") for s in args.seeds.split(",")]
    rows = []
    for p in track(prompts, description="passkey prompts"):
        row = {"id": p.id, "tokens": p.tokens, "depth": p.depth, "answer": p.answer}
        for k, rt in runtimes.items():
            rt.reset()
            out = []
            for t in rt.generate(p.ids.tolist(), args.max_new_tokens, eos_ids=tuple(eos)):
                if int(t) in eos:
                    break
                out.append(int(t))
            text = tok.decode(out)
            row[k] = {"text": text, "predicted": extract_key(text), "correct": extract_key(text) == p.answer,
                      "tokens": out}
        row["same_tokens"] = row["q4"]["tokens"] == row["fp32"]["tokens"]
        rows.append(row)
    acc = {k: sum(r[k]["correct"] for r in rows) / len(rows) for k in arts}
    same = sum(r["same_tokens"] for r in rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    result = {"build": a, "model": manifests["q4"]["model"]["id"], "accuracy": acc, "same_answers": same,
              "prompts": len(rows), "rows": rows, "commit": commit + ("-dirty" if dirty else ""),
              "command": "python tools/experiments/check_weights_passkey.py", "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights_passkey.json").write_text(json.dumps(result, indent=2))
    lines = ["# Passkey accuracy: q4 against fp32 weights", "",
             f"Regenerate: `{result['command']}`. Model `{result['model']}`, policy `{a['policy']}`, N = {a['budget']}, "
             f"B = {a['block']}, both artifacts through the native runtime, greedy, {args.max_new_tokens} tokens, scored "
             f"as `edgekv eval` scores passkey (the first number in the answer); {len(rows)} prompts "
             f"(lengths {args.lengths}, depths {args.depths}, seeds {args.seeds}). Commit {result['commit']}.", "",
             f"| weights | correct | accuracy |", "|---|---:|---:|"]
    for k in arts:
        lines.append(f"| {k} | {sum(r[k]['correct'] for r in rows)} / {len(rows)} | {100 * acc[k]:.0f} % |")
    lines += ["", f"The two artifacts generated the same tokens on {same} of {len(rows)} prompts.", "",
              "| prompt | tokens | answer | q4 | fp32 |", "|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['id']} | {r['tokens']} | {r['answer']} | {r['q4']['predicted']} "
                     f"{'✓' if r['q4']['correct'] else '✗'} | {r['fp32']['predicted']} {'✓' if r['fp32']['correct'] else '✗'} |")
    lines += ["", "![passkey accuracy by length](weights_passkey.png)"]
    (args.out / "weights_passkey.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    buckets = sorted({int(r["id"].split("-L")[1].split("-")[0]) for r in rows})
    for i, k in enumerate(arts):
        vals = [100 * sum(r[k]["correct"] for r in rows if f"-L{L}-" in r["id"]) /
                max(1, sum(f"-L{L}-" in r["id"] for r in rows)) for L in buckets]
        ax.bar([j + (i - 0.5) * 0.38 for j in range(len(buckets))], vals, 0.38, label=k)
    ax.set_xticks(range(len(buckets)), [str(L) for L in buckets])
    ax.set(xlabel="prompt length (tokens)", ylabel="passkey accuracy (%)", ylim=(0, 105),
           title=f"{a['policy']}, N = {a['budget']}: q4 vs fp32 weights")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "weights_passkey.png", dpi=110)
    print("\n".join(lines[:9]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
