"""Compiled Gemma 3 270M against the eager engine: greedy ids with per-layer cache kinds (issue 32).

Compiles `gemma3-270m` (or a GGUF given with --model) with a policy (default KeyDiff) at N on the
global layers; the 15 local layers get a cache of exactly their window (512). A natural-text prompt
longer than the window (default 1,000 tokens) runs through the eager engine (`BlockEngine`: local
rings, the policy on the global layers), the compiled artifact in TVM's runtime (`HostRuntime`) and,
when it is built, the native runtime (`edgekv-run`'s library); then greedy decoding. Records per
runtime: greedy ids equal to the engine's, the last prompt logits' relative error, the global layers'
kept sets after the prompt, the local layers' kept positions (the newest window) and the memory plan's
cache bytes with per-layer kinds against a uniform N cache. Writes docs/results/gemma3_compiled.{json,md}.

    python tools/experiments/check_gemma3_compiled.py --model /path/gemma-3-270m-q4_k_m.gguf --weights fp32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def compare(model, policy_name: str, budget: int, block: int, tokens: int, new_tokens: int, artifact: Path,
            weights: str | None = None, native: bool = True) -> dict:
    """Compile (or reuse) the artifact and compare the runtimes with the engine; the result record."""
    from edgekv.compiler.driver import compile_or_reuse
    from edgekv.corpus import natural_token_ids
    from edgekv.engine import BlockEngine
    from edgekv.policies import make_policy
    from edgekv.runtime import HostRuntime

    t0 = time.perf_counter()
    compile_or_reuse(model, make_policy(policy_name), budget, block, artifact, weights=weights)
    compile_s = time.perf_counter() - t0
    cfg = model.config
    ids = natural_token_ids(model.tokenizer, tokens)
    engine = BlockEngine(model, make_policy(policy_name), budget, block)
    ref_logits = engine.prefill(ids).numpy()
    ref_kept = {layer: np.sort(engine.kept_positions(layer).numpy(), 1) for layer in cfg.global_layers}
    ref_ids = [int(np.argmax(ref_logits))]
    for _ in range(new_tokens - 1):
        ref_ids.append(int(engine.decode(ref_ids[-1]).argmax()))
    runtimes = {"host (TVM)": lambda: HostRuntime(artifact)}
    if native:
        from edgekv.runtime import native as nat

        if nat.available():
            runtimes["native (edgekv-run)"] = lambda: nat.NativeRuntime(artifact)
    out = {}
    for name, open_rt in runtimes.items():
        rt = open_rt()
        logits = np.asarray(rt.prefill(ids.numpy().tolist()))
        kept_same = all(np.array_equal(np.sort(np.asarray(rt.kept_positions(layer)), 1), ref_kept[layer])
                        for layer in cfg.global_layers)
        end = int(ids.numel())
        window = np.arange(max(0, end - cfg.sliding_window), end)
        local_ok = all(np.array_equal(np.sort(np.asarray(rt.kept_positions(layer))[0]), window)  # a ring: any order
                       for layer in cfg.local_layers)
        got = [int(np.argmax(logits))]
        for _ in range(new_tokens - 1):
            got.append(int(np.argmax(rt.decode(got[-1]))))
        out[name] = {"greedy_ids_equal": got == ref_ids, "ids": got,
                     "last_prompt_logits_max_rel_error": float(np.abs(logits - ref_logits).max()
                                                               / np.abs(ref_logits).max()),
                     "global_kept_sets_equal": bool(kept_same), "local_layers_keep_newest_window": bool(local_ok),
                     "cache_lengths": [int(x) for x in rt.cache_lengths()]}
    from edgekv.artifact import Manifest

    m = Manifest.read(artifact)
    kinds = m.cache_kinds
    per_entry = sum(int(np.prod(s)) * 4 for f, s in json.loads((artifact / "manifest.json").read_text())["cache"][
        cfg.global_layers[0]].items() if f in ("k", "v", "pos")) / budget  # bytes per entry of one layer
    return {"policy": policy_name, "budget": budget, "block": block, "prompt_tokens": int(ids.numel()),
            "new_tokens": new_tokens, "weights": (m.weights or {}).get("format", "fp32"),
            "window": cfg.sliding_window, "cache_kinds": [k for k, _ in kinds],
            "plan_cache_bytes": int(m.memory_plan.cache_bytes),
            "uniform_cache_bytes": int(per_entry * budget * cfg.num_layers),
            "engine_ids": ref_ids, "engine_text": model.tokenizer.decode(ref_ids),
            "runtimes": out, "compile_seconds": compile_s}


def markdown(r: dict) -> str:
    local = r["cache_kinds"].count("local")
    rows = "\n".join(f"| {name} | {v['greedy_ids_equal']} | {v['last_prompt_logits_max_rel_error']:.2e} | "
                     f"{v['global_kept_sets_equal']} | {v['local_layers_keep_newest_window']} |"
                     for name, v in r["runtimes"].items())
    mib = 1 << 20
    return (f"Compiled Gemma 3 270M (`{r['policy']}`, N = {r['budget']} on the {len(r['cache_kinds']) - local} global "
            f"layers, the {local} local layers a ring of their window {r['window']} (token p in slot p mod window), B = {r['block']}, "
            f"{r['weights']} weights) against the eager engine on {r['prompt_tokens']} prompt tokens of natural text "
            f"(longer than the window: the local caches slide) and {r['new_tokens']} greedy tokens "
            f"(`{r.get('command', '')}`, commit `{r.get('commit', '')}`; the machine was shared):\n\n"
            "| runtime | greedy ids equal | last prompt logits, max rel. error | global kept sets equal | "
            "local layers keep the newest window |\n|---|---|---|---|---|\n" + rows + "\n\n"
            f"- engine's continuation: {json.dumps(r['engine_text'])}\n"
            f"- the memory plan's cache: {r['plan_cache_bytes'] / mib:.1f} MiB with per-layer kinds, against "
            f"{r['uniform_cache_bytes'] / mib:.1f} MiB for N = {r['budget']} on every layer\n"
            f"- compile (or reuse) time: {r['compile_seconds']:.0f} s\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="a known name or a GGUF path")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--weights", default=None, help="q4 | q8 | fp32 (default: the model's own)")
    ap.add_argument("--artifact", default="build/gemma3-compiled")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gemma3_compiled"))
    args = ap.parse_args()
    from edgekv.evaluation.report import provenance
    from edgekv.models import load_model

    origin = provenance([sys.executable, *sys.argv])
    model = load_model(args.model)
    artifact = Path(args.artifact)
    result = dict(compare(model, args.policy, args.budget, args.block, args.tokens, args.new_tokens, artifact,
                          args.weights), **origin)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
