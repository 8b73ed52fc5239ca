"""The OpenCL path on SmolLM2 (issue 19): the same model, policy, N and B compiled for this CPU
(`--target host`) and for OpenCL with this machine as host (`--target opencl-host`), both run by
the native runtime — the OpenCL one on whatever OpenCL device is present (PoCL here: OpenCL on
the CPU, `apt-get install pocl-opencl-icd`).

    python tools/experiments/check_opencl.py [--policies keydiff,lagkv] [--budget 256] [--prompt-tokens 640]
                                 [--new-tokens 32] [--out docs/results]

1. The README's main job (`--prompt-file examples/long_document.txt --chat`, KeyDiff, N = 512):
   `edgekv-run` on each artifact, their texts and token ids compared; prefill / decode speed and
   the device memory held against the plan.
2. Every policy (`--policies`, default all): a `--prompt-tokens` prompt of CPython's pydoc text;
   kept positions of every layer after every block, the last-token logits (1e-4 relative) and
   `--new-tokens` greedy tokens, OpenCL against the CPU artifact.

Writes opencl.json and opencl.md. Speeds on PoCL say nothing about a phone GPU: PoCL runs the
kernels on the CPU (and builds edgekv's eviction kernels unoptimised: docs/TARGETS.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "long_document.txt"


def build(model, name: str, budget: int, block: int, work: Path, weights: str = "fp32") -> tuple[Path, Path, dict]:
    from edgekv.compiler import compile_model
    from edgekv.policies import make_policy

    cpu, ocl = work / f"{name}-{budget}-cpu", work / f"{name}-{budget}-opencl"
    t0 = time.perf_counter()
    if not (cpu / "program.ekv").is_file():
        compile_model(model, make_policy(name, {}), budget, block, out_dir=cpu, weights=weights)
    t1 = time.perf_counter()
    if not (ocl / "program.ekv").is_file():
        compile_model(model, make_policy(name, {}), budget, block, target="opencl-host", out_dir=ocl,
                      weights=weights)
    return cpu, ocl, {"compile_cpu_s": t1 - t0, "compile_opencl_s": time.perf_counter() - t1}


def run_cli(art: Path, report: Path, new_tokens: int) -> dict:
    from edgekv.runtime import native

    res = subprocess.run([str(native.cli_path()), str(art), "--prompt-file", str(DEMO), "--chat", "--max-new-tokens",
                          str(new_tokens), "--quiet", "--report", str(report)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"edgekv-run {art}: {res.stderr.strip()}")
    return json.loads(report.read_text())


def demo(model, work: Path, weights: str = "fp32", budget: int = 512, block: int = 128, new_tokens: int = 64) -> dict:
    cpu, ocl, times = build(model, "keydiff", budget, block, work, weights)
    c = run_cli(cpu, work / "demo-cpu.json", new_tokens)
    o = run_cli(ocl, work / "demo-ocl.json", new_tokens)
    mem = o["memory"]
    return {"policy": "keydiff", "budget": budget, "block": block, "prompt_tokens": o["prompt_tokens"],
            "cpu_text": c["text"], "opencl_text": o["text"], "text_equal": c["text"] == o["text"],
            "ids_equal": c["generated_ids"] == o["generated_ids"], "device": mem.get("device"),
            "device_bytes_peak": mem.get("device_bytes_peak"), "plan_bytes": mem["plan"]["total_bytes"],
            "opencl_prefill_tok_s": o.get("prefill_tok_s"), "opencl_decode_tok_s": o.get("decode_tok_s"),
            "cpu_prefill_tok_s": c.get("prefill_tok_s"), "cpu_decode_tok_s": c.get("decode_tok_s"),
            "opencl_load_s": o.get("load_seconds"), **times}


def agree(model, name: str, budget: int, block: int, ids: list[int], new_tokens: int, work: Path,
          weights: str = "fp32") -> dict:
    from edgekv.runtime import native

    cpu, ocl, times = build(model, name, budget if name != "full" else len(ids) + new_tokens + 64, block, work,
                            weights)
    out = {}
    for tag, art in (("cpu", cpu), ("opencl", ocl)):
        rt = native.NativeRuntime(art)
        kept: list = []
        t0 = time.perf_counter()
        logits = rt.prefill(ids, on_block=lambda r: kept.append([np.sort(r.kept_positions(i), axis=1)
                                                                 for i in range(r.num_layers)]))
        prefill_s = time.perf_counter() - t0
        tokens, cur = [], logits
        for _ in range(new_tokens):  # greedy, continuing from the prompt's state
            tokens.append(int(np.argmax(cur)))
            cur = rt.decode(tokens[-1])
        out[tag] = {"kept": kept, "logits": logits, "tokens": tokens, "prefill_s": prefill_s,
                    "device": rt.info["device"]}
        rt.close()
    c, o = out["cpu"], out["opencl"]
    same = sum(int(np.array_equal(a, b)) for x, y in zip(c["kept"], o["kept"]) for a, b in zip(x, y))
    return {"policy": name, "kept_identical": f"{same}/{len(c['kept']) * len(c['kept'][0])}",
            "logits_rel_diff": float(np.abs(o["logits"] - c["logits"]).max() / np.abs(c["logits"]).max()),
            "greedy_identical": c["tokens"] == o["tokens"], "device": o["device"],
            "opencl_prefill_s": o["prefill_s"], "cpu_prefill_s": c["prefill_s"], **times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=None, help="comma list (default: every registered policy)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=640)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--weights", choices=("fp32", "q8", "q4"), default="fp32",
                    help="weight format of both artifacts (q4: the dequantising kernels, dlight-scheduled on OpenCL)")
    ap.add_argument("--name", default="opencl", help="results file stem (<out>/<name>.json and .md)")
    args = ap.parse_args()

    from edgekv.corpus import natural_text
    from edgekv.evaluation.report import provenance
    from edgekv.models import load_model
    from edgekv.compiler.policy_kernels import gpu_policy_names
    from edgekv.runtime import native

    reason = native.opencl_unavailable_reason()
    if reason:
        sys.exit(f"cannot run the OpenCL path here: {reason}")
    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    model = load_model("smollm2-135m")
    ids = model.tokenizer(natural_text())["input_ids"][: args.prompt_tokens]
    names = args.policies.split(",") if args.policies else gpu_policy_names()  # the ones with GPU kernels
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        demo_row = None if args.skip_demo else demo(model, work, args.weights)
        if demo_row:
            print(json.dumps(demo_row), flush=True)
        rows = []
        for name in names:
            rows.append(agree(model, name, args.budget, args.block, ids, args.new_tokens, work, args.weights))
            print(json.dumps(rows[-1]), flush=True)
    command = "python tools/experiments/check_opencl.py " + " ".join(sys.argv[1:])
    data = {"model": "smollm2-135m", "weights": args.weights, "budget": args.budget, "block": args.block,
            "prompt_tokens": len(ids),
            "new_tokens": args.new_tokens, "demo": demo_row, "rows": rows, "command": command.strip(),
            "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=2))
    write_markdown(data, args.out / f"{args.name}.md")


def write_markdown(data: dict, path: Path) -> None:
    mib = lambda b: f"{b / 2**20:.1f} MiB" if b else "—"  # noqa: E731
    lines = ["# The OpenCL path on SmolLM2: an OpenCL artifact against the CPU artifact", "",
             f"Regenerate: `{data['command']}`"
             + (f" (commit {data['provenance']['commit']})" if data.get("provenance") else "")
             + f". Weights: {data.get('weights', 'fp32')} in both artifacts. Both "
             "artifacts run in the native runtime; the OpenCL one on "
             f"{(data['rows'] or [{}])[0].get('device') or (data['demo'] or {}).get('device')}.", ""]
    d = data["demo"]
    if d:
        lines += [f"**The README's main job** (examples/long_document.txt with --chat, {d['prompt_tokens']} tokens, "
                  f"KeyDiff N = {d['budget']}, B = {d['block']}), `edgekv-run` on each artifact:", "",
                  f"- same text as the CPU artifact: **{'yes' if d['text_equal'] else 'NO'}** (token ids "
                  f"{'equal' if d['ids_equal'] else 'differ'}); answer: {d['opencl_text']!r}",
                  f"- device memory held {mib(d['device_bytes_peak'])} against a plan of {mib(d['plan_bytes'])}",
                  f"- OpenCL: prefill {d['opencl_prefill_tok_s']:.1f} tok/s, decode {d['opencl_decode_tok_s']:.2f} tok/s, "
                  f"opening the artifact {d['opencl_load_s']:.1f} s (its kernels built, or taken from a cache: this "
                  f"one's, or the driver's); the CPU artifact: {d['cpu_prefill_tok_s']:.0f} / "
                  f"{d['cpu_decode_tok_s']:.1f} tok/s. PoCL runs the kernels on the CPU: these speeds say nothing "
                  "about a phone's GPU", ""]
    lines += [f"**Every policy**: {data['prompt_tokens']}-token prompt (CPython's pydoc text), N = {data['budget']}, "
              f"B = {data['block']}; kept positions of every layer after every block, last-token logits, "
              f"{data['new_tokens']} greedy tokens.", "",
              "| policy | kept identical (blocks × layers) | logits rel. diff | greedy tokens |", "|---|---|---:|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['policy']} | {r['kept_identical']} | {r['logits_rel_diff']:.1e} | "
                     f"{'identical' if r['greedy_identical'] else 'DIFFER'} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
