"""RocketKV (SnapKV++ eviction + sparse decode attention) against SnapKV++ alone, compiled (issue 17).

Two artifacts of one build — the same model, N, B and weights; the policy is the only difference —
run in the native runtime on the same prompts:

- decode: natural-text prompts of ``--lengths`` tokens, then ``--decode`` greedy tokens. A prompt
  shorter than N leaves the cache room for the decoded tokens (stage 2 reads its summaries and top-k
  rows only); a longer one fills the cache, so every decode step also evicts (stage 1's score reads
  every key, the compaction moves rows, and RocketKV rebuilds its summaries). Reported: decode tok/s
  from the runtime's own timer (the median of ``--repeats`` runs), the KV bytes one decode step's
  attention reads (``Policy.decode_bytes_per_step`` at each step's cache fill, averaged), and how
  many greedy tokens the two policies share.
- passkey: ``edgekv eval``'s passkey prompts (``--passkey-lengths`` × depths × seeds; longer than N,
  so stage 1 evicts), answered greedily, exact match on the key.

Writes ``docs/results/rocketkv.{json,md}``.

    python tools/bench/bench_rocketkv.py [--budget 2048] [--build build/rocketkv] [--rebuild]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("snapkv++", "rocketkv")


def greedy(rt, ids: list[int], tokens: int) -> tuple[list[int], list[int], float]:
    """(generated tokens, cache fill before each decode step, decode tok/s) from a fresh prompt."""
    rt.reset()
    logits = rt.prefill(ids)
    out, fills = [], []
    start = rt.stats.decode_seconds
    for _ in range(tokens):
        token = int(logits.argmax())
        out.append(token)
        fills.append(max(rt.cache_lengths()) + 1)  # the rows this step attends over: the cache and the new token
        logits = rt.decode(token)
    seconds = rt.stats.decode_seconds - start
    return out, fills, tokens / seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--lengths", default="1536,4096")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--passkey-lengths", default="4096,7168")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--build", type=Path, default=REPO / "build" / "rocketkv")
    ap.add_argument("--rebuild", action="store_true", help="compile the artifacts again even if they exist")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    from rich.progress import track

    from edgekv.evaluation.report import meta, provenance
    from edgekv.compiler.driver import compile_or_reuse
    from edgekv.evaluation.tasks import answer_passkeys, build_passkey, natural_text
    from edgekv.models import load_model
    from edgekv.policies import make_policy
    from edgekv.runtime import native

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    model = load_model("smollm2-135m")
    cfg = model.config
    arts = {name: compile_or_reuse(model, make_policy(name), args.budget, args.block,
                                   args.build / name.replace("+", "p"), rebuild=args.rebuild) for name in POLICIES}
    runtimes = {name: native.NativeRuntime(path) for name, path in arts.items()}
    policies = {name: make_policy(name) for name in POLICIES}
    tok = model.tokenizer
    text = tok(" ".join(natural_text(seed=0, min_words=12000)))["input_ids"]
    decode_rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = text[:length]
        row = {"prompt_tokens": length, "decode_tokens": args.decode}
        generated = {}
        for name, rt in runtimes.items():
            speeds = []
            for _ in range(args.repeats):
                generated[name], fills, speed = greedy(rt, ids, args.decode)
                speeds.append(speed)
            per_step = [policies[name].decode_bytes_per_step(f, cfg.head_dim, args.budget,
                                                             num_kv_heads=cfg.num_kv_heads, num_layers=cfg.num_layers)
                        for f in fills]
            row[name] = {"decode_tok_s": statistics.median(speeds), "runs_tok_s": speeds,
                         "attention_bytes_per_step": statistics.mean(per_step),
                         "cache_fill": [fills[0], fills[-1]]}
        a, b = generated.values()
        row["same_greedy_tokens"] = sum(x == y for x, y in zip(a, b))
        row["speedup"] = row["rocketkv"]["decode_tok_s"] / row["snapkv++"]["decode_tok_s"]
        row["bytes_ratio"] = row["rocketkv"]["attention_bytes_per_step"] / row["snapkv++"]["attention_bytes_per_step"]
        decode_rows.append(row)
    prompts = [build_passkey(tok, int(L), float(d), int(s), haystack="repeat") for L in args.passkey_lengths.split(",")
               for d in args.depths.split(",") for s in args.seeds.split(",")]
    passkey = answer_passkeys(runtimes, prompts, tok, progress=lambda p: track(p, description="passkey prompts"))
    data = {**meta(model, [sys.executable, *sys.argv]), **origin, "budget": args.budget, "block": args.block,
            "weights": json.loads((arts["rocketkv"] / "manifest.json").read_text()).get("weights", {}).get("format"),
            "stage2": {k: v for k, v in policies["rocketkv"].plan(args.budget, cfg.head_dim).__dict__.items()},
            "decode": decode_rows, "passkey": passkey}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rocketkv.json").write_text(json.dumps(data, indent=1))
    (args.out / "rocketkv.md").write_text(markdown(data))
    print(markdown(data))
    return 0


def markdown(data: dict) -> str:
    from edgekv.evaluation.tasks import passkey_table

    s2 = data["stage2"]
    lines = ["# RocketKV vs SnapKV++, compiled (native runtime)\n",
             f"SmolLM2-135M-Instruct, N = {data['budget']}, B = {data['block']}, {data['weights']} weights; "
             f"stage 2: traffic {s2['traffic']}, page {s2['page']}, channels {s2['channels']}, top-k {s2['topk']}. "
             f"Commit `{data['commit']}`, command `{data['command']}`.\n",
             "| prompt | cache fill while decoding | snapkv++ tok/s | rocketkv tok/s | speed ratio | attention MB/step "
             "snapkv++ | rocketkv | bytes ratio | same greedy tokens |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["decode"]:
        a, b = r["snapkv++"], r["rocketkv"]
        lines.append(f"| {r['prompt_tokens']} | {a['cache_fill'][0]}–{a['cache_fill'][1]} | {a['decode_tok_s']:.1f} | "
                     f"{b['decode_tok_s']:.1f} | {r['speedup']:.2f}× | {a['attention_bytes_per_step'] / 1e6:.2f} | "
                     f"{b['attention_bytes_per_step'] / 1e6:.2f} | {r['bytes_ratio']:.2f} | "
                     f"{r['same_greedy_tokens']}/{r['decode_tokens']} |")
    lines.append("\nAttention bytes: what one decode step's attention reads from the KV cache, all layers "
                 "(`Policy.decode_bytes_per_step`). A prompt shorter than N leaves the cache room: decode appends, "
                 "stage 2 reads the summaries and the top-k rows. A longer prompt keeps the cache full: every "
                 "decode step also evicts (SnapKV++'s score reads every key, the compaction moves rows) and "
                 "RocketKV then rebuilds its summaries, which the speed ratio carries; the paper never evicts "
                 "generated tokens (docs/policies.md, rocketkv).")
    lines.append("\nPasskey (greedy, exact key):\n")
    lines += passkey_table(data["passkey"], list(POLICIES))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
