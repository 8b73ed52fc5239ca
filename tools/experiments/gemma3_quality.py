"""Gemma 3 270M's quality cells (issue 32): passkey and fidelity (KL to the full cache) at 4K, 8K and
16K prompt tokens for KeyDiff, SnapKV++ and DapQ on the global layers (the 15 local layers keep exactly
their window, no policy), the full cache as the ceiling row. Eager engine (`edgekv eval`).

The grid is four `edgekv eval` sweeps, each in its own folder under --out (resumable: a rerun reuses
every prompt an earlier, interrupted run finished, so a larger --prompts adds prompts to a smaller run's):
  passkey-short   passkey at 4K and 8K, needle depths 0.5, 0.1, 0.9, 0.3, 0.7 (up to five per length)
  passkey-16k     passkey at 16K, depths 0.5, 0.1, 0.9 (up to three)
  fidelity-short  fidelity at 4K and 8K, seeds 0 … 4 (up to five texts per length)
  fidelity-16k    fidelity at 16K, seeds 0 … 2 (up to three)
``--prompts K`` takes the first K of each list (default: all). The full cache is each prompt's reference
run (`edgekv eval`'s, against which fidelity is measured): its passkey answers are the ceiling row, with
no second run. Then one table: passkey accuracy with Wilson's 95 % interval, and mean KL / top-1
agreement over the scored window, per (length, policy).

    python tools/experiments/gemma3_quality.py --model /work/wt/models/gemma-3-270m-q4_k_m.gguf \
        [--budget 1k] [--out docs/results/gemma3_quality]
writes <out>.json and <out>.md (and each sweep's results.{json,md} in <out>/)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

POLICIES = "keydiff,snapkv++,dapq"  # the full cache is every prompt's reference run
SWEEPS = {  # name: (task, lengths, depths, seeds), lists in the order --prompts takes them
    "passkey-short": ("passkey", "4k,8k", "0.5,0.1,0.9,0.3,0.7", "0"),
    "fidelity-short": ("fidelity", "4k,8k", "0.5", "0,1,2,3,4"),
    "passkey-16k": ("passkey", "16k", "0.5,0.1,0.9", "0"),
    "fidelity-16k": ("fidelity", "16k", "0.5", "0,1,2"),
}


def first(items: str, k: int | None) -> str:
    return ",".join(items.split(",")[:k] if k else items.split(","))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for k successes of n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def run_sweeps(args) -> dict[str, dict]:
    from rich.console import Console

    from edgekv.evaluation.command import build_spec, run_eval

    console = Console(stderr=True)
    out = {}
    for name, (task, lengths, depths, seeds) in SWEEPS.items():
        if args.only and name not in args.only.split(","):
            continue
        depths, seeds = (first(depths, args.prompts), seeds) if task == "passkey" else (depths, first(seeds, args.prompts))
        spec = build_spec(task, args.policies, args.budget, str(args.block), False,
                          lengths if task == "passkey" else "4k", depths, seeds, 2, "varied", 10,
                          lengths if task == "fidelity" else "2k", args.fidelity_window, 16, None)
        console.print(f"[bold]{name}[/]: {task} at {lengths}, policies {args.policies}, N = {args.budget}")
        out[name] = run_eval(spec, Path(args.out) / name, model_name=args.model, threads=args.threads,
                             console=console, argv=[sys.executable, *sys.argv], resume=True, workers=1)
    return out


def collect(out_dir: Path) -> list[dict]:
    """One row per (task, length, policy) over every sweep folder's results.json that exists."""
    cells: dict[tuple, list[dict]] = {}
    for name in SWEEPS:
        path = out_dir / name / "results.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        prompts = {p["id"]: p for p in data.get("prompts", [])}
        refs = data.get("references", {})
        for ref in (refs.values() if isinstance(refs, dict) else refs):  # the full cache: the ceiling
            meta = prompts.get(ref.get("prompt_id"), {})
            if meta.get("task") == "passkey" and "correct" in ref:
                cells.setdefault(("passkey", meta["length_target"], "full"), []).append(ref)
        for row in data.get("results", []):
            cells.setdefault((row["task"], row["length_target"], row["policy"]), []).append(row)
    rows = []
    for (task, length, policy), rs in sorted(cells.items()):
        errors = sorted({r["error"] for r in rs if r.get("error")})
        ok = [r for r in rs if not r.get("error")]
        cell = {"task": task, "length": length, "policy": policy, "n": len(ok), "errors": errors}
        if task == "passkey" and ok:
            k = sum(bool(r["correct"]) for r in ok)
            cell.update(correct=k, accuracy=k / len(ok), interval95=list(wilson(k, len(ok))),
                        agrees_with_full=sum(bool(r.get("agrees_with_full", policy == "full")) for r in ok))
        elif task == "fidelity" and ok and policy != "full":
            cell.update(mean_kl=sum(r["mean_kl"] for r in ok) / len(ok),
                        max_kl=max(r["max_kl"] for r in ok),
                        top1_agreement=sum(r["top1_agreement"] for r in ok) / len(ok),
                        greedy_prefix_match=sum(r["greedy_prefix_match"] for r in ok) / len(ok))
        rows.append(cell)
    return rows


def markdown(result: dict) -> str:
    order = {p: i for i, p in enumerate(["full", *POLICIES.split(",")])}
    lines = [f"# Gemma 3 270M: passkey and fidelity with per-layer cache kinds ({result['budget']} on the global layers)",
             "", f"`{result['command']}` — eager engine (`edgekv eval`), B = {result['block']}; the 15 local layers keep "
             "exactly their window of 512 (no policy), the 3 global layers run the policy at N; `full` is the ceiling "
             "(every layer, every token). Commit "
             f"`{result['provenance'].get('commit', '')}`; the machine was shared (runs at nice 19).", "",
             "## Passkey (varied haystack, greedy answer of up to 10 tokens)", "",
             "| length | policy | correct | accuracy | Wilson 95 % | same answer as full |", "|---|---|---|---|---|---|"]
    cells = sorted(result["cells"], key=lambda c: (c["length"], order.get(c["policy"], 99)))
    for c in cells:
        if c["task"] != "passkey":
            continue
        if "accuracy" in c:
            lo, hi = c["interval95"]
            lines.append(f"| {c['length'] // 1024}K | {c['policy']} | {c['correct']} / {c['n']} | {c['accuracy']:.2f} | "
                         f"[{lo:.2f}, {hi:.2f}] | {c['agrees_with_full']} / {c['n']} |")
        else:
            lines.append(f"| {c['length'] // 1024}K | {c['policy']} | refused: {'; '.join(c['errors'])} | | | |")
    lines += ["", f"## Fidelity (KL to the full cache over the last {result['fidelity_window']} positions of a natural "
              "text, teacher-forced after the context was evicted; then 16 greedy tokens)", "",
              "| length | policy | texts | mean KL (nats) | max KL | top-1 agreement | greedy prefix match |",
              "|---|---|---|---|---|---|---|"]
    for c in cells:
        if c["task"] != "fidelity" or c["policy"] == "full":
            continue
        if "mean_kl" in c:
            lines.append(f"| {c['length'] // 1024}K | {c['policy']} | {c['n']} | {c['mean_kl']:.4f} | {c['max_kl']:.3f} | "
                         f"{c['top1_agreement']:.3f} | {c['greedy_prefix_match']:.2f} |")
        else:
            lines.append(f"| {c['length'] // 1024}K | {c['policy']} | refused: {'; '.join(c['errors'])} | | | | |")
    missing = [n for n in SWEEPS if n not in result["sweeps_done"]]
    if missing:
        lines += ["", f"Not run yet (or not finished): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="a known name or a GGUF path")
    ap.add_argument("--budget", default="1k", help="N of the global layers")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--fidelity-window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated sweeps to run (default: all)")
    ap.add_argument("--prompts", type=int, default=None, help="the first K depths / seeds of each sweep (default: all)")
    ap.add_argument("--report-only", action="store_true", help="only rebuild the table from the folders")
    ap.add_argument("--out", default="docs/results/gemma3_quality")
    args = ap.parse_args()
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    if not args.report_only:
        run_sweeps(args)
    out = Path(args.out)
    done = [n for n in SWEEPS if (out / n / "results.json").exists()
            and json.loads((out / n / "results.json").read_text()).get("complete")]
    run_args = [a for a in sys.argv[1:] if a != "--report-only"]  # the command that runs (and resumes) the grid
    result = {"command": " ".join(["python", "tools/experiments/gemma3_quality.py", *run_args]),
              "budget": args.budget, "block": args.block, "fidelity_window": args.fidelity_window,
              "sweeps": SWEEPS, "sweeps_done": done, "cells": collect(out), "provenance": prov}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
