"""A compiled artifact answering a document question in both runtimes, from one command: the C CLI
`edgekv-run` (its own tokenizer, tokenizer.ekt: no Python) and `edgekv run ARTIFACT` (the native
runtime through Python, the HF tokenizer); the answer, whether the generated ids are equal, prefill
and decode tok/s, peak RSS against the artifact's memory plan.

    python tools/bench/native_answer.py --artifact build/qwen-kd8k [--prompt-file examples/long_document.txt]
        [--max-new-tokens 48] [--threads 2] [-o docs/results/native_answer_qwen]

Writes ``<out>.json`` and ``<out>.md`` (greedy decoding; the prompt is wrapped in the chat template)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def run_both(artifact: Path, prompt_file: Path, max_new: int, threads: int) -> dict:
    from edgekv.runtime import native

    exe = native.cli_path()
    if exe is None:
        raise SystemExit("error: edgekv-run is not built (`pip install -e .` builds runtime/)")
    with tempfile.TemporaryDirectory() as d:
        c_report, py_report = Path(d) / "c.json", Path(d) / "py.json"
        common = ["--prompt-file", str(prompt_file), "--chat", "--max-new-tokens", str(max_new), "--threads", str(threads)]
        c = subprocess.run([str(exe), str(artifact), *common, "--report", str(c_report)], capture_output=True, text=True)
        py = subprocess.run([sys.executable, "-m", "edgekv", "run", str(artifact), *common, "--runtime", "native",
                             "-o", str(py_report)], capture_output=True, text=True, env=dict(os.environ, COLUMNS="160"))
        if c.returncode != 0 or py.returncode != 0:
            raise SystemExit(f"error: edgekv-run exit {c.returncode}: {c.stderr[-1500:]}\n"
                             f"edgekv run exit {py.returncode}: {py.stderr[-1500:]}")
        return {"edgekv-run": json.loads(c_report.read_text()), "edgekv run": json.loads(py_report.read_text()),
                "edgekv-run_stderr_tail": c.stderr[-600:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--prompt-file", type=Path, default=ROOT / "examples/long_document.txt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", default=str(ROOT / "docs/results/native_answer_qwen"))
    args = ap.parse_args(argv)
    if not (args.artifact / "program.ekv").is_file():
        raise SystemExit(f"error: --artifact {args.artifact} holds no program.ekv: compile one with `edgekv compile`")
    if not args.prompt_file.is_file():
        raise SystemExit(f"error: --prompt-file {args.prompt_file} does not exist")
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    r = run_both(args.artifact, args.prompt_file, args.max_new_tokens, args.threads)
    c, py = r["edgekv-run"], r["edgekv run"]
    plan = c["memory"]["plan"]["total_bytes"]
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, shared with other jobs (load {load_before} before, "
                   f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} after)",
        "artifact": str(args.artifact), "model": c.get("model"), "policy": c.get("policy"),
        "budget_tokens": c.get("budget_tokens"), "prompt_file": str(args.prompt_file),
        "prompt_tokens": {"edgekv-run": c["prompt_tokens"], "edgekv run": py["prompt_tokens"]},
        "ids_equal": c["generated_ids"] == py["generated_ids"], "answer": c["text"], "answer_python": py["text"],
        "generated_ids": c["generated_ids"],
        "edgekv-run": {"prefill_tok_s": c["prefill_tok_s"], "decode_tok_s": c["decode_tok_s"],
                       "peak_rss_bytes": c["memory"]["peak_rss_bytes"], "plan_bytes": plan, "threads": c.get("threads"),
                       "load_seconds": c.get("load_seconds")},
        "edgekv run": {"prefill_tok_s": py["prefill_tok_s"], "decode_tok_s": py["decode_tok_s"],
                       "peak_rss_bytes": py["memory"]["peak_rss"], "plan_bytes": py["memory"]["plan"]["total"]},
        "provenance": prov, "reports": {"edgekv-run": c, "edgekv run": py},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    e, p = result["edgekv-run"], result["edgekv run"]
    md = ["# A compiled artifact answering a document question, in both runtimes", "",
          f"`{' '.join(sys.argv)}` — {result['machine']}: speeds are what a shared machine gave, not figures "
          "for docs.", "",
          f"Artifact `{args.artifact}` ({result['model']}, {result['policy']}, N = {result['budget_tokens']}); prompt "
          f"`{args.prompt_file.name}` in the chat template, {c['prompt_tokens']} tokens; greedy.", "",
          f"Answer (edgekv-run, its own tokenizer): **{c['text'].strip()}**", "",
          f"Generated ids equal between edgekv-run and `edgekv run ARTIFACT`: **{result['ids_equal']}** "
          f"({len(c['generated_ids'])} tokens; prompt tokens {c['prompt_tokens']} / {py['prompt_tokens']}).", "",
          "| runtime | prefill tok/s | decode tok/s | peak RSS | memory plan | RSS − plan |", "|---|---:|---:|---:|---:|---:|",
          f"| edgekv-run (C) | {e['prefill_tok_s']:.1f} | {e['decode_tok_s']:.1f} | {e['peak_rss_bytes'] / MIB:.0f} MiB | "
          f"{plan / MIB:.0f} MiB | {(e['peak_rss_bytes'] - plan) / MIB:+.0f} MiB |",
          f"| edgekv run (Python + native) | {p['prefill_tok_s']:.1f} | {p['decode_tok_s']:.1f} | "
          f"{p['peak_rss_bytes'] / MIB:.0f} MiB | {p['plan_bytes'] / MIB:.0f} MiB | "
          f"{(p['peak_rss_bytes'] - p['plan_bytes']) / MIB:+.0f} MiB |", "",
          f"Threads: {args.threads} asked ({e['threads']} used by edgekv-run). The Python process's RSS includes torch "
          "and the HF tokenizer."]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if result["ids_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
