"""The native runtime against HostRuntime (TVM's VM) and the eager engine on SmolLM2, for every
compiled policy: the same artifact, the same prompt.

    python tools/experiments/check_native_vs_host.py [--policies keydiff,lagkv] [--budget 256] [--block 128]
                                         [--prompt-tokens 2048] [--new-tokens 32] [--out docs/results]

Per policy: kept positions of every layer after every block (native vs HostRuntime), last-token
logits (relative max difference), greedy tokens over --new-tokens; then `edgekv-run` (the C
command, its own process) on a text prompt with --chat against the eager engine's text for the
same policy and budget, and its peak RSS against the plan. Writes native_agreement.json/.md."""

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


def prompt_ids(tok, n: int) -> list[int]:
    from edgekv.corpus import natural_text

    ids = tok(natural_text())["input_ids"]
    return ids[:n]


def compare_policy(model, name: str, budget: int, block: int, ids: list[int], new_tokens: int, work: Path,
                   question_text: str) -> dict:
    from edgekv.compiler import compile_model
    from edgekv.engine import BlockEngine, Sampler
    from edgekv.policies import make_policy
    from edgekv.runtime import HostRuntime, native

    from edgekv.job import encode_prompt

    chat_ids = encode_prompt(model, question_text, chat=True).tolist()
    if name == "full":  # everything kept: the budget holds the longer prompt and the answer
        budget = max(len(ids), len(chat_ids)) + new_tokens + 64
    art = work / name
    t0 = time.perf_counter()
    compile_model(model, make_policy(name, {}), budget, block, out_dir=art)
    row: dict = {"policy": name, "compile_seconds": time.perf_counter() - t0}
    host, nat = HostRuntime(art), native.NativeRuntime(art)
    host.prepare(ids)
    kept_host, logits_host = [], None
    for s in range(0, len(ids), block):
        logits_host = host.step_block(ids[s: s + block])
        kept_host.append([host.kept_positions(layer) for layer in range(host.num_layers)])
    kept_nat: list = []
    logits_nat = nat.prefill(ids, on_block=lambda rt: kept_nat.append(
        [rt.kept_positions(layer) for layer in range(rt.num_layers)]))
    same = sum(int(np.array_equal(a, b)) for x, y in zip(kept_host, kept_nat) for a, b in zip(x, y))
    row["kept_identical"] = f"{same}/{len(kept_host) * host.num_layers}"
    row["logits_rel_diff"] = float(np.abs(logits_nat - logits_host).max() / np.abs(logits_host).max())
    host.reset()
    nat.reset()
    row["greedy_identical"] = host.generate(ids, new_tokens) == nat.generate(ids, new_tokens)
    del host, nat
    # the C command on text, against the eager engine with the same policy and budget
    import torch

    eng = BlockEngine(model, make_policy(name, {}), budget, block)
    eos = model.tokenizer.eos_token_id
    eager_ids = eng.generate(torch.tensor(chat_ids), new_tokens, Sampler(), eos_ids=(eos,))
    eager_text = model.tokenizer.decode(eager_ids, skip_special_tokens=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(question_text)
    report = work / f"{name}-run.json"
    res = subprocess.run([str(native.cli_path()), str(art), "--prompt-file", f.name, "--chat", "--max-new-tokens",
                          str(new_tokens), "--quiet", "--report", str(report)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"edgekv-run failed for {name}: {res.stderr}")
    r = json.loads(report.read_text())
    row["edgekv_run_text_equals_eager"] = r["text"] == eager_text
    row["edgekv_run_ids_equal_eager"] = r["generated_ids"] == eager_ids
    row["edgekv_run_prompt_tokens"] = r["prompt_tokens"]
    row["eager_prompt_tokens"] = len(chat_ids)
    row["peak_rss_bytes"] = r["memory"]["peak_rss_bytes"]
    row["plan_bytes"] = r["memory"]["plan"]["total_bytes"]
    row["rss_over_plan"] = r["memory"]["peak_rss_bytes"] / r["memory"]["plan"]["total_bytes"]
    row["text"] = r["text"]
    return row


def readme_demo(model, work: Path, budget: int = 512, block: int = 128, policy: str = "keydiff",
                new_tokens: int = 64) -> dict:
    """The README's main job, native: `edgekv-run` started with an empty environment (`env -i`, no
    PATH, so no Python can be found or started) on an artifact compiled at the demo's policy and
    budget, against `edgekv run` on the eager engine (the README's first command)."""
    import shutil

    from edgekv.compiler import compile_model
    from edgekv.policies import make_policy
    from edgekv.runtime import native

    demo = ROOT / "examples" / "long_document.txt"
    art = work / "demo"
    compile_model(model, make_policy(policy, {}), budget, block, out_dir=art)
    eager = work / "demo-eager.json"
    subprocess.run([sys.executable, "-m", "edgekv", "run", "--prompt-file", str(demo), "--chat", "--budget",
                    str(budget), "--policy", policy, "--max-new-tokens", str(new_tokens), "-o", str(eager)],
                   check=True, capture_output=True)
    report = work / "demo-native.json"
    cmd = [shutil.which("env"), "-i", str(native.cli_path()), str(art), "--prompt-file", str(demo), "--chat",
           "--max-new-tokens", str(new_tokens), "--quiet", "--report", str(report)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"edgekv-run failed on the demo: {res.stderr}")
    e, n = json.loads(eager.read_text()), json.loads(report.read_text())
    return {"command": "env -i " + " ".join(cmd[2:]).replace(str(work), "<artifact dir>").replace(str(ROOT) + "/", ""),
            "policy": policy, "budget": budget, "block": block, "eager_text": e["text"], "native_text": n["text"],
            "text_equal": e["text"] == n["text"], "ids_equal": e.get("generated_ids") == n["generated_ids"],
            "peak_rss_bytes": n["memory"]["peak_rss_bytes"], "plan_bytes": n["memory"]["plan"]["total_bytes"],
            "rss_over_plan": n["memory"]["peak_rss_bytes"] / n["memory"]["plan"]["total_bytes"],
            "native_prefill_tok_s": n.get("prefill_tok_s"), "eager_prefill_tok_s": e.get("prefill_tok_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=None, help="comma list (default: every registered policy)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args()

    from edgekv.evaluation.report import provenance
    from edgekv.models import load_model
    from edgekv.compiler.policy_kernels import compiled_policy_names

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    model = load_model("smollm2-135m")
    names = args.policies.split(",") if args.policies else compiled_policy_names()
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    question = (ROOT / "examples" / "long_document.txt").read_text()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            print(f"== {name}", flush=True)
            rows.append(compare_policy(model, name, args.budget, args.block, ids, args.new_tokens, Path(d), question))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "text"}), flush=True)
        demo = readme_demo(model, Path(d))
        print(json.dumps(demo), flush=True)
    data = {"model": "smollm2-135m", "budget": args.budget, "block": args.block, "prompt_tokens": len(ids),
            "new_tokens": args.new_tokens, "rows": rows, "readme_demo": demo,
            "command": "python tools/experiments/check_native_vs_host.py " + " ".join(sys.argv[1:]), "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "native_agreement.json").write_text(json.dumps(data, indent=2))
    lines = ["# Native runtime vs HostRuntime and the eager engine (SmolLM2)", "",
             f"Regenerate: `python tools/experiments/check_native_vs_host.py --budget {args.budget} --block {args.block} "
             f"--prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens}` (commit {origin['commit']}).", "",
             f"Native vs HostRuntime on the same artifact: a {len(ids)}-token prompt (CPython's pydoc text), "
             f"N = {args.budget}, B = {args.block}; kept positions of every layer after every block, last-token "
             f"logits, {args.new_tokens} greedy tokens. Then `edgekv-run` (its own process, native tokenizer) on "
             "examples/long_document.txt with --chat against the eager engine (`edgekv run` without an artifact) at "
             "the same policy and budget, and its peak RSS against the plan.", "",
             "| policy | kept identical (blocks × layers) | logits rel. diff | greedy tokens | edgekv-run text = eager | "
             "peak RSS / plan |", "|---|---|---:|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['kept_identical']} | {r['logits_rel_diff']:.1e} | "
                     f"{'identical' if r['greedy_identical'] else 'DIFFER'} | "
                     f"{'yes' if r['edgekv_run_text_equals_eager'] else 'NO'} | {r['rss_over_plan']:.3f} |")
    lines += ["", f"The README's main job natively (`edgekv-run` with an empty environment: no PATH, no Python), "
              f"{demo['policy']} at N = {demo['budget']}, B = {demo['block']}, against the eager engine's "
              f"`edgekv run --prompt-file examples/long_document.txt --chat --budget {demo['budget']} --policy "
              f"{demo['policy']}`:", "", f"    {demo['command']}", "",
              f"- text equal to the eager engine's: **{'yes' if demo['text_equal'] else 'NO'}** "
              f"(token ids {'equal' if demo['ids_equal'] else 'differ'})",
              f"- answer: {demo['native_text']!r}",
              f"- peak RSS {demo['peak_rss_bytes'] / 2**20:.0f} MiB against a plan of {demo['plan_bytes'] / 2**20:.0f} MiB "
              f"= {demo['rss_over_plan']:.3f} × the plan"]
    (args.out / "native_agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
