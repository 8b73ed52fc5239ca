"""Why SnapKV misses long-prompt passkeys that SnapKV++ finds (issue 16): one factor at a time.

SnapKV and SnapKV++ share the window votes (the last w = 32 rows' attention, summed over the
window); they differ in three things: the GQA reduction (mean vs sum of the group's query heads —
a constant factor, the same ranking), the pooling (average vs max) and its kernel (7 vs 63 below
SnapKV++'s length threshold). This runs SnapKV with each pooling × kernel combination next to
SnapKV++ itself on ``edgekv eval``'s passkey prompts with the whole prompt as one block (as the
issue's evidence was measured), greedy, exact key, and the needle's retention: the fraction of
(layer, KV head) caches that still hold the key's digits after prefill.

Writes ``docs/results/snapkv_pooling.{json,md,png}``.

    python tools/check_snapkv_pooling.py [--budget 512] [--lengths 4096,7168] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = [  # (label, policy, arguments)
    ("snapkv avg κ=7 (default)", "snapkv", {}),
    ("snapkv max κ=7", "snapkv", {"pooling": "max"}),
    ("snapkv avg κ=63", "snapkv", {"kernel": 63}),
    ("snapkv max κ=63", "snapkv", {"pooling": "max", "kernel": 63}),
    ("snapkv no pooling (κ=1)", "snapkv", {"kernel": 1}),
    ("snapkv++ (max κ=63, group sum)", "snapkv++", {}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--lengths", default="4096,7168")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    from rich.progress import track

    from edgekv.evaluation.report import meta
    from edgekv.evaluation.runner import ONE_BLOCK, EvalSpec, run_one
    from edgekv.evaluation.tasks import build_passkey
    from edgekv.models import load_model
    from edgekv.threads import apply_threads

    if args.threads:
        apply_threads(args.threads)
    model = load_model("smollm2-135m")
    spec = EvalSpec(tasks=["passkey"], policies=[], budgets=[args.budget], blocks=[ONE_BLOCK])
    prompts = [build_passkey(model.tokenizer, int(L), float(d), int(s)) for L in args.lengths.split(",")
               for d in args.depths.split(",") for s in args.seeds.split(",")]
    rows = []
    for p in track(prompts, description="passkey prompts × variants"):
        row = {"id": p.id, "length": p.length_target, "tokens": int(p.ids.numel()), "depth": p.depth, "answer": p.answer}
        for label, policy, policy_args in VARIANTS:
            out = run_one(model, p, policy, policy_args, args.budget, ONE_BLOCK, spec).passkey
            row[label] = {"correct": out["correct"], "retention": out["needle_retention"], "text": out["output_text"]}
        rows.append(row)
    data = {**meta(model, [sys.executable, *sys.argv]), "budget": args.budget, "block": "one (the whole prompt)",
            "variants": [{"label": lab, "policy": pol, "args": a} for lab, pol, a in VARIANTS], "prompts": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "snapkv_pooling.json").write_text(json.dumps(data, indent=1))
    (args.out / "snapkv_pooling.md").write_text(markdown(data))
    plot(data, args.out / "snapkv_pooling.png")
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
    lines = ["# SnapKV against SnapKV++, one factor at a time\n",
             f"SmolLM2-135M-Instruct, N = {data['budget']}, the whole prompt as one block, passkey prompts "
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
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(lengths)
    for i, n in enumerate(lengths):
        ax.barh([y + i * width for y in range(len(labels))], [cells[(lab, n)] or 0 for lab in labels], height=width,
                label=f"{n} tokens")
    ax.set_yticks([y + width * (len(lengths) - 1) / 2 for y in range(len(labels))], labels)
    ax.set_xlabel("needle retention (share of layer × KV-head caches holding the key)")
    ax.set_title(f"SnapKV pooling × kernel, N = {data['budget']}, one block")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
