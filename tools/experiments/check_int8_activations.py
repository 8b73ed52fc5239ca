"""What int8 decode activations (``edgekv compile --decode-activations int8``) change on SmolLM2:
next-token distributions against the same artifact with fp32 activations, and the README demo's
answer from both.

    python tools/experiments/check_int8_activations.py --fp32-act ART --int8-act ART [--tokens 1000]
                                                       [--threads 2] [--out docs/results]

Teacher forcing as ``check_weights_fidelity.py`` (its text, runtime calls and metrics: top-1
agreement, KL(P_fp32act ‖ P_int8act) in nats, the largest relative logit difference), both
artifacts run by the native runtime; ``--tokens`` ≤ the budget so nothing is evicted and the
difference is the activations' rounding only. Then ``edgekv-run ART --prompt-file
examples/long_document.txt --chat --quiet`` (greedy) on each: the two answers, and whether they are
the same text. For scale: llama.cpp's own int8 activations against fp32 on the same model are in
``weights_fidelity.md`` (its "llama.cpp vs fp32" row).

Writes int8_activations.json and int8_activations.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.experiments.check_weights_fidelity import (compare, git_commit, progress_bar, run_artifact,  # noqa: E402
                                                     text_ids)

DEMO = ROOT / "examples" / "long_document.txt"


def demo_answer(art: Path, threads: int) -> str:
    """The README demo's greedy answer from the native runtime (``edgekv-run``)."""
    run = os.environ.get("EDGEKV_RUN", "edgekv-run")
    out = subprocess.run([run, str(art), "--prompt-file", str(DEMO), "--chat", "--quiet", "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32-act", type=Path, required=True, help="q4 artifact with fp32 decode activations")
    ap.add_argument("--int8-act", type=Path, required=True, help="the same build with --decode-activations int8")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args(argv)
    from edgekv.artifact import Manifest
    from edgekv.evaluation.report import provenance

    acts = {}
    for label, p in (("fp32", args.fp32_act), ("int8", args.int8_act)):
        if not (p / "program.ekv").is_file():
            ap.error(f"{p}: no artifact (edgekv compile --budget 1k --block 128 --policy keydiff --weights q4 "
                     f"--decode-activations {label} -o {p})")
        m = Manifest.read(p)
        acts[label] = (m.weights or {}).get("decode_activations", "fp32")
        if args.tokens > m.budget:
            ap.error(f"--tokens {args.tokens} exceeds {p}'s budget N = {m.budget}")
    origin = provenance([sys.executable, sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    load = os.getloadavg()
    ids = text_ids(args.tokens)
    with progress_bar() as progress:
        ref, run_ref = run_artifact(args.fp32_act, ids, args.threads, progress, "fp32 activations")
        test, run_test = run_artifact(args.int8_act, ids, args.threads, progress, "int8 activations")
    comp = compare(ref, test)
    answers = {label: demo_answer(p, args.threads) for label, p in (("fp32", args.fp32_act), ("int8", args.int8_act))}
    cmd = "python tools/experiments/check_int8_activations.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    data = {"tokens": args.tokens, "threads": args.threads, "command": cmd, "git_commit": git_commit(),
            "decode_activations": acts, "load_before": list(load), "runs": {"fp32": run_ref, "int8": run_test},
            "comparison": comp, "demo_answers": answers, "demo_same_text": answers["fp32"] == answers["int8"],
            "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_activations.json").write_text(json.dumps(data, indent=1) + "\n")
    c = comp
    lines = ["# int8 decode activations against fp32 (SmolLM2-135M, q4 keydiff N = 1K)", "",
             f"Regenerate: `{cmd}`", "",
             f"Teacher forcing on {args.tokens} tokens of `edgekv eval`'s fidelity text (as weights_fidelity.md), native "
             f"runtime, {args.threads} threads; reference: the artifact with fp32 activations ({acts['fp32']}), test: "
             f"int8 ({acts['int8']}). No eviction (tokens ≤ N).", "",
             "| comparison | positions | top-1 agreement | mean KL | median KL | p99 KL | max KL | max rel. logit diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             f"| int8 vs fp32 activations | {c['positions']} | {c['top1_agreement_pct']:.2f} % ({c['top1_disagreements']} differ) | "
             f"{c['kl_mean']:.3g} | {c['kl_median']:.3g} | {c['kl_p99']:.3g} | {c['kl_max']:.3g} (pos {c['kl_max_position']}) | "
             f"{c['rel_max_abs_logit_diff']:.3g} |", "",
             "For scale, llama.cpp (int8 activations) against fp32 on the same weights, weights_fidelity.md: "
             "top-1 96.90 %, mean KL 0.00263.", "",
             "README demo (`edgekv-run ART --prompt-file examples/long_document.txt --chat`, greedy):", "",
             f"- fp32 activations: {answers['fp32']!r}", f"- int8 activations: {answers['int8']!r}",
             f"- same text: {'yes' if data['demo_same_text'] else 'no'}", "",
             f"Commit {data['git_commit']}, load average before: {', '.join(f'{v:.2f}' for v in load)} (shared machine)."]
    (args.out / "int8_activations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
