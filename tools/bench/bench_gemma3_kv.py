"""Gemma 3's per-layer cache kinds against a uniform cache, in the eager engine: KV bytes (the engine's
allocated cache buffers and the memory plan's count) and the process's peak RSS after a prefill of
``--tokens`` tokens, each case in its own child process so that peaks do not mix.

Cases (same model, policy, budget N and block B):
  kinds     local layers a ring of window + B, global layers the policy's N + B (edgekv's Gemma 3)
  uniform   every layer the policy's N + B (what an engine without per-layer kinds allocates; the model
            is run with the window off, so this row is a memory baseline, not a quality one)
  full      every layer the whole sequence (bytes from the memory plan only; not run)

    python tools/bench/bench_gemma3_kv.py --model gemma3-270m --tokens 8192 --out docs/results/gemma3_kv
writes gemma3_kv.json and gemma3_kv.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path


def child(args) -> dict:
    import resource
    import time

    import torch

    from edgekv.corpus import natural_token_ids
    from edgekv.engine.block_engine import BlockEngine
    from edgekv.memory import current_rss_bytes, kv_cache_bytes, plan_memory
    from edgekv.models import load_model
    from edgekv.policies import make_policy

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    described = {"layer_kinds": list(model.config.layer_kinds), "sliding_window": model.config.sliding_window,
                 "full_cache_kv_bytes": kv_cache_bytes(model.config, args.tokens)}  # every layer, every token
    if args.case == "uniform":  # every layer global: the cache a uniform budget allocates
        model.config = dataclasses.replace(model.config, layer_kinds=(), sliding_window=0)
    ids = natural_token_ids(model.tokenizer, args.tokens)
    rss_loaded = current_rss_bytes()
    policy = make_policy(args.policy, {})
    engine = BlockEngine(model, policy, args.budget, args.block)
    plan = plan_memory(model.config, model.weight_bytes, engine.capacity, args.block, len(policy.entry_state))
    t0 = time.perf_counter()
    logits = engine.prefill(ids)
    seconds = time.perf_counter() - t0
    return {"case": args.case, "tokens": int(ids.numel()), "kv_bytes_allocated": engine.kv_bytes,
            "kv_bytes_planned": plan.kv_cache, "cache_lengths": engine.cache_lengths(),
            "rss_after_load": rss_loaded, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "prefill_seconds": seconds, "top_token": int(logits.argmax()), **described}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/gemma3_kv")
    ap.add_argument("--child", dest="case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print("EKV-RESULT " + json.dumps(child(args)))
        return
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])  # captured before the run
    rows = []
    for case in ("kinds", "uniform"):
        cmd = [sys.executable, __file__, "--child", case, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("EKV-RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"case {case} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        rows.append(json.loads(line[len("EKV-RESULT "):]))
    kinds_of_layers, window, full = rows[0]["layer_kinds"], rows[0]["sliding_window"], rows[0]["full_cache_kv_bytes"]
    result = {"command": " ".join(["python", "tools/bench/bench_gemma3_kv.py", *sys.argv[1:]]),
              "model": args.model, "policy": args.policy, "budget": args.budget, "block": args.block,
              "tokens": args.tokens, "layer_kinds": kinds_of_layers, "sliding_window": window,
              "full_cache_kv_bytes": full, "rows": rows, "machine": platform.platform(),
              "provenance": prov,
              "note": "shared machine (other jobs ran beside it): RSS and seconds are indicative; KV bytes are exact"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    mib = 2 ** 20
    kinds, uniform = rows
    lines = [
        f"# Gemma 3 per-layer cache kinds vs a uniform cache ({args.model}, {args.tokens} tokens)", "",
        f"`{result['command']}` — eager engine, policy {args.policy}, N = {args.budget}, B = {args.block}; "
        f"{kinds_of_layers.count('local')} local layers (window {window}) and "
        f"{kinds_of_layers.count('global')} global layers. {result['note']}.", "",
        "| cache | KV bytes allocated | KV bytes planned | peak RSS | prefill s |", "|---|---|---|---|---|",
    ]
    for r, name in ((kinds, "per-layer kinds (ring W + B local, N + B global)"), (uniform, "uniform N + B every layer")):
        lines.append(f"| {name} | {r['kv_bytes_allocated'] / mib:.2f} MiB | {r['kv_bytes_planned'] / mib:.2f} MiB | "
                     f"{r['peak_rss'] / mib:.0f} MiB | {r['prefill_seconds']:.1f} |")
    lines.append(f"| full cache of {args.tokens} tokens every layer (planned) | — | {full / mib:.2f} MiB | — | — |")
    lines += ["", f"KV bytes: per-layer kinds {kinds['kv_bytes_allocated'] / uniform['kv_bytes_allocated']:.2f}× "
                  f"the uniform cache, {kinds['kv_bytes_allocated'] / full:.3f}× the full cache."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
