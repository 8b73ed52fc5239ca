"""Why SnapKV misses long-prompt passkeys that SnapKV++ finds (issue 16): one factor at a time.

SnapKV and SnapKV++ share the window votes (the last w = 32 rows' attention, summed over the
window); they differ in three things: the GQA reduction (mean vs sum of the group's query heads —
a constant factor, the same ranking), the pooling (average vs max) and its kernel (7 vs 63 below
SnapKV++'s length threshold). This runs SnapKV with each pooling × kernel combination next to
SnapKV++ itself on ``edgekv eval``'s passkey prompts with the whole prompt as one block (as the
issue's evidence was measured), greedy, exact key, and the needle's retention: the fraction of
(layer, KV head) caches that still hold the key's digits after prefill.

Writes ``docs/results/snapkv_pooling.{json,md,png}``.

``--study dapq`` asks the same of DapQ (issue 16: the paper's best policy, near the bottom here):
its switches one at a time — the softmax domain (prompt + pseudo keys, or the prompt alone),
pooling (none, the paper's silence; max or average at κ = 7 and 63) — next to SnapKV++, block-wise
and as one block. The GQA reduction is not a switch worth running: mean and sum over a group differ
by the constant G, so each KV head keeps the same set. Writes ``docs/results/dapq_ablation.*``.

    python tools/experiments/check_snapkv_pooling.py [--budget 512] [--lengths 4096,7168] [--threads 2]
    python tools/experiments/check_snapkv_pooling.py --study dapq --lengths 2048,4096 --blocks one,128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = [  # (label, policy, arguments)
    ("snapkv avg κ=7 (default)", "snapkv", {}),
    ("snapkv max κ=7", "snapkv", {"pooling": "max"}),
    ("snapkv avg κ=63", "snapkv", {"kernel": 63}),
    ("snapkv max κ=63", "snapkv", {"pooling": "max", "kernel": 63}),
    ("snapkv no pooling (κ=1)", "snapkv", {"kernel": 1}),
    ("snapkv++ (max κ=63, group sum)", "snapkv++", {}),
]
DAPQ_VARIANTS = [
    ("dapq (default: no pooling, prompt+pseudo softmax)", "dapq", {}),
    ("dapq softmax over the prompt only", "dapq", {"softmax_over": "prompt"}),
    ("dapq max κ=7", "dapq", {"pooling": "max", "kernel": 7}),
    ("dapq avg κ=63", "dapq", {"pooling": "avg", "kernel": 63}),
    ("dapq max κ=63", "dapq", {"pooling": "max", "kernel": 63}),
    ("snapkv++ (max κ=63, group sum)", "snapkv++", {}),
]
STUDIES = {"snapkv": ("snapkv_pooling", VARIANTS), "dapq": ("dapq_ablation", DAPQ_VARIANTS)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--lengths", default="4096,7168")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--study", choices=sorted(STUDIES), default="snapkv")
    ap.add_argument("--blocks", default="one", help="'one' (the whole prompt) and/or block sizes, comma-separated")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    from rich.progress import track

    from edgekv.evaluation.report import meta, provenance
    from edgekv.evaluation.runner import ONE_BLOCK, EvalSpec, run_one
    from edgekv.evaluation.tasks import build_passkey
    from edgekv.models import load_model
    from edgekv.threads import apply_threads

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    if args.threads:
        apply_threads(args.threads)
    model = load_model("smollm2-135m")
    stem, variants = STUDIES[args.study]
    blocks = [ONE_BLOCK if b.strip() == "one" else int(b) for b in args.blocks.split(",")]
    spec = EvalSpec(tasks=["passkey"], policies=[], budgets=[args.budget], blocks=blocks)
    prompts = [build_passkey(model.tokenizer, int(L), float(d), int(s)) for L in args.lengths.split(",")
               for d in args.depths.split(",") for s in args.seeds.split(",")]
    labels = [(lab if len(blocks) == 1 else f"{lab} · B={'one' if b == ONE_BLOCK else b}", pol, a, b)
              for b in blocks for lab, pol, a in variants]
    rows = []
    for p in track(prompts, description="passkey prompts × variants"):
        row = {"id": p.id, "length": p.length_target, "tokens": int(p.ids.numel()), "depth": p.depth, "answer": p.answer}
        for label, policy, policy_args, block in labels:
            out = run_one(model, p, policy, policy_args, args.budget, block, spec).passkey
            row[label] = {"correct": out["correct"], "retention": out["needle_retention"], "text": out["output_text"]}
        rows.append(row)
    data = {**meta(model, [sys.executable, *sys.argv]), **origin, "budget": args.budget,
            "block": ", ".join("one (the whole prompt)" if b == ONE_BLOCK else str(b) for b in blocks),
            "study": args.study,
            "variants": [{"label": lab, "policy": pol, "args": a} for lab, pol, a, _ in labels], "prompts": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(data))
    plot(data, args.out / f"{stem}.png")
    print(markdown(data))
    return 0


def _cells(data: dict):
    """(variant label, length) → (correct, prompts, mean retention)."""
    for v in data["variants"]:
        for length in sorted({r["length"] for r in data["prompts"]}):
            rows = [r[v["label"]] for r in data["prompts"] if r["length"] == length]
            kept = [x["retention"] for x in rows if x["retention"] is not None]
            yield v["label"], length, sum(x["correct"] for x in rows), len(rows), (sum(kept) / len(kept) if kept else None)


def markdown(data: dict) -> str:
    lengths = sorted({r["length"] for r in data["prompts"]})
    title = "DapQ's switches, one at a time" if data.get("study") == "dapq" else "SnapKV against SnapKV++, one factor at a time"
    lines = [f"# {title}\n",
             f"SmolLM2-135M-Instruct, N = {data['budget']}, B = {data['block']}, passkey prompts "
             f"({len(data['prompts'])} prompts over the lengths, depths and seeds), greedy, exact key; retention: the share of "
             "(layer, KV head) caches holding the key's digits after prefill. "
             f"Commit `{data['commit']}`, command `{data['command']}`.\n",
             "| variant | " + " | ".join(f"{n} tokens: correct | {n}: retention" for n in lengths) + " |",
             "|---|" + "---:|---:|" * len(lengths)]
    cells = {(lab, n): (c, t, r) for lab, n, c, t, r in _cells(data)}
    for v in data["variants"]:
        parts = []
        for n in lengths:
            c, t, r = cells[(v["label"], n)]
            parts.append(f"{c}/{t} | {r:.0%}" if r is not None else f"{c}/{t} | —")
        lines.append(f"| {v['label']} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in data["prompts"]})
    labels = [v["label"] for v in data["variants"]]
    cells = {(lab, n): r for lab, n, _, _, r in _cells(data)}
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(labels)))
    width = 0.8 / len(lengths)
    for i, n in enumerate(lengths):
        ax.barh([y + i * width for y in range(len(labels))], [cells[(lab, n)] or 0 for lab in labels], height=width,
                label=f"{n} tokens")
    ax.set_yticks([y + width * (len(lengths) - 1) / 2 for y in range(len(labels))], labels)
    ax.set_xlabel("needle retention (share of layer × KV-head caches holding the key)")
    ax.set_title(f"{data.get('study', 'snapkv')} variants, N = {data['budget']}, B = {data['block']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
