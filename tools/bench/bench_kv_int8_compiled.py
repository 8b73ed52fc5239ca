"""The int8 KV cache compiled (issue 17): fp32 against int8 artifacts of one model, in the native runtime.

Artifacts of SmolLM2-135M-Instruct (keydiff, B = 128, the default q4 weights; only the KV format and
N differ):

- same N (``--budget``, default 2,048), fp32 and int8: what the format costs and saves at one N —
  the static plan (KV bytes, arena), prefill and decode tok/s and the process's peak RSS from
  ``edgekv-run --report`` (one process per run, ``--repeats`` runs, the median), on the same
  ``--length``-token natural-text prompt; how many greedy tokens the two share; and how far the
  compiled int8 artifact's last prompt logits are from the eager int8 engine's (``BlockEngine(...,
  kv_dtype="int8")``, the oracle) and from the fp32 artifact's (KL, nats).
- equal bytes (``--bytes-of-fp32-budget``, default 512): fp32 at N = 512 against int8 at the N whose
  K/V/positions take the same bytes (``memory.kv_bytes_per_token``), each compiled; ``edgekv eval``'s passkey prompts
  (``--passkey-lengths`` × depths × seeds) answered greedily through the native runtime, exact match.

Writes ``docs/results/kv_int8_compiled.{json,md}``.

    python tools/bench/bench_kv_int8_compiled.py [--build build/kv_int8] [--rebuild]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICY = "keydiff"

def timed_run(art: Path, ids: list[int], decode: int) -> dict:
    """One ``edgekv-run`` process over the prompt ids: its report (tok/s, peak RSS, plan)."""
    from edgekv.runtime import native

    with tempfile.TemporaryDirectory() as d:
        ids_file, report = Path(d) / "ids.txt", Path(d) / "r.json"
        ids_file.write_text(",".join(map(str, ids)))
        res = subprocess.run([str(native.cli_path()), str(art), "--prompt-ids", f"@{ids_file}", "--max-new-tokens",
                              str(decode), "--ignore-eos", "--warmup", "--report", str(report), "--quiet"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"edgekv-run {art}: {res.stderr[-2000:]}")
        return json.loads(report.read_text())


def kl(p_logits, q_logits) -> float:
    """KL(p ‖ q) of two logit vectors, in nats."""
    import torch

    p = torch.log_softmax(torch.as_tensor(p_logits, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.as_tensor(q_logits, dtype=torch.float64), -1)
    return float((p.exp() * (p - q)).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite kv_int8_compiled.md from the JSON a run wrote (after a wording change)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--bytes-of-fp32-budget", type=int, default=512,
                    help="the equal-bytes pair: fp32 at this N, int8 at the N its KV bytes buy")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--passkey-lengths", default="4096,7168")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--build", type=Path, default=REPO / "build" / "kv_int8")
    ap.add_argument("--rebuild", action="store_true", help="compile the artifacts again even if they exist")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    if args.markdown_only:
        (args.out / "kv_int8_compiled.md").write_text(markdown(json.loads((args.out / "kv_int8_compiled.json").read_text())))
        return 0
    import torch
    from rich.progress import track

    from edgekv.engine import BlockEngine
    from edgekv.evaluation.report import meta, provenance
    from edgekv.compiler.driver import compile_or_reuse
    from edgekv.evaluation.tasks import answer_passkeys, build_passkey, natural_text
    from edgekv.memory import kv_bytes_per_token
    from edgekv.models import load_model
    from edgekv.policies import make_policy
    from edgekv.runtime import native

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    model = load_model("smollm2-135m")
    cfg = model.config
    # a compiled cache holds N rows per layer and KV head: equal bytes is N · bytes per token equal
    fp32_bytes = args.bytes_of_fp32_budget * kv_bytes_per_token(cfg, "fp32")
    equal_n = fp32_bytes // kv_bytes_per_token(cfg, "int8")
    plan = {("fp32", args.budget), ("int8", args.budget), ("fp32", args.bytes_of_fp32_budget), ("int8", equal_n)}
    arts = {key: compile_or_reuse(model, make_policy(POLICY), key[1], args.block, args.build / f"{key[0]}-n{key[1]}",
                                  rebuild=args.rebuild, kv_dtype=key[0])
            for key in track(sorted(plan), description="compiling")}

    tok = model.tokenizer
    ids = tok(" ".join(natural_text(seed=0, min_words=12000)))["input_ids"][: args.length]
    speed = []
    for (kv, n), art in sorted(arts.items(), key=lambda kv_n: (kv_n[0][1], kv_n[0][0])):
        runs = [timed_run(art, ids, args.decode) for _ in range(args.repeats)]
        manifest = json.loads((art / "manifest.json").read_text())
        speed.append({"kv_dtype": kv, "budget": n, "prompt_tokens": len(ids), "decode_tokens": args.decode,
                      "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
                      "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                      "peak_rss_bytes": statistics.median(r["memory"]["peak_rss_bytes"] for r in runs),
                      "runtime_alloc_peak_bytes": runs[0]["memory"]["runtime_alloc_peak_bytes"],
                      "plan": manifest["memory_plan"], "generated_ids": runs[0]["generated_ids"],
                      "runs": [{"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"],
                                "peak_rss_bytes": r["memory"]["peak_rss_bytes"]} for r in runs]})

    # same N: the compiled int8 cache against the eager int8 engine and the fp32 artifact
    prompt = torch.tensor(ids)
    compiled = {kv: native.NativeRuntime(arts[(kv, args.budget)]) for kv in ("fp32", "int8")}
    last = {kv: rt.prefill(ids) for kv, rt in compiled.items()}
    engines, logits = {}, {}
    for kv, threads in (("fp32", 2), ("int8", 2), ("int8", 1)):
        torch.set_num_threads(threads)
        engines[(kv, threads)] = BlockEngine(model, make_policy(POLICY), args.budget, args.block, kv_dtype=kv)
        logits[(kv, threads)] = engines[(kv, threads)].prefill(prompt).numpy()
    eager = {kv: logits[(kv, 2)] for kv in ("fp32", "int8")}

    def moved(a, b) -> int:
        """Kept rows in one run and not the other, over every layer and KV head."""
        return sum(len(set(x.tolist()) ^ set(y.tolist())) for layer in range(cfg.num_layers)
                   for x, y in zip(a(layer), b(layer)))

    kept = {"compiled_int8": lambda layer: compiled["int8"].kept_positions(layer),
            **{f"eager_{kv}_{t}": (lambda layer, e=e: e.kept_positions(layer).numpy()) for (kv, t), e in engines.items()}}
    same = {r["kv_dtype"]: r["generated_ids"] for r in speed if r["budget"] == args.budget}
    # the fp32 pair shows what compiling alone changes (kernels, weight layout)
    agreement = {"kl_compiled_int8_vs_eager_int8": kl(eager["int8"], last["int8"]),
                 "kl_compiled_fp32_vs_eager_fp32": kl(eager["fp32"], last["fp32"]),
                 "argmax_equal_eager": int(eager["int8"].argmax()) == int(last["int8"].argmax()),
                 "kl_int8_vs_fp32_compiled": kl(last["fp32"], last["int8"]),
                 "kl_int8_vs_fp32_eager": kl(eager["fp32"], eager["int8"]),
                 # the int8 format's rounding turns float-order differences (another thread count, the
                 # compiled kernels) into a neighbouring code now and then, and eviction near-ties amplify
                 # them: the eager engine at 1 and 2 threads measures that on its own
                 "kl_eager_int8_1_vs_2_threads": kl(logits[("int8", 2)], logits[("int8", 1)]),
                 "kept_rows_differing_compiled_vs_eager_int8": moved(kept["compiled_int8"], kept["eager_int8_2"]),
                 "kept_rows_differing_eager_int8_1_vs_2_threads": moved(kept["eager_int8_1"], kept["eager_int8_2"]),
                 "kept_rows_differing_eager_fp32_vs_compiled_fp32": moved(
                     lambda layer: compiled["fp32"].kept_positions(layer), kept["eager_fp32_2"]),
                 "kept_rows": cfg.num_layers * cfg.num_kv_heads * args.budget,
                 "same_greedy_tokens": sum(a == b for a, b in zip(same["fp32"], same["int8"])),
                 "decode_tokens": args.decode}

    prompts = [build_passkey(tok, int(L), float(d), int(s)) for L in args.passkey_lengths.split(",")
               for d in args.depths.split(",") for s in args.seeds.split(",")]
    pair = {"fp32": arts[("fp32", args.bytes_of_fp32_budget)], "int8": arts[("int8", equal_n)]}
    passkey = answer_passkeys({kv: native.NativeRuntime(art) for kv, art in pair.items()}, prompts, tok,
                              progress=lambda p: track(p, description="passkey prompts"))

    data = {**meta(model, [sys.executable, *sys.argv]), **origin, "policy": POLICY, "block": args.block,
            "weights": json.loads(arts[("int8", args.budget)].joinpath("manifest.json").read_text())["weights"]["format"],
            "same_n": args.budget, "equal_bytes": {"bytes": fp32_bytes, "fp32_budget": args.bytes_of_fp32_budget,
                                                   "int8_budget": equal_n},
            "speed": speed, "agreement": agreement, "passkey": passkey}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_int8_compiled.json").write_text(json.dumps(data, indent=1))
    (args.out / "kv_int8_compiled.md").write_text(markdown(data))
    print(markdown(data))
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def markdown(data: dict) -> str:
    from edgekv.evaluation.tasks import passkey_table

    eq = data["equal_bytes"]
    ag = data["agreement"]
    lines = ["# The int8 KV cache, compiled (native runtime)\n",
             f"SmolLM2-135M-Instruct, {data['policy']}, B = {data['block']}, {data['weights']} weights. "
             f"Commit `{data['commit']}`, command `{data['command']}`.\n",
             "| KV format | N | KV cache (plan) MiB | arena MiB | runtime allocations MiB | peak RSS MiB | "
             "prefill tok/s | decode tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["speed"]:
        lines.append(f"| {r['kv_dtype']} | {r['budget']:,} | {_mib(r['plan']['cache_bytes'])} | "
                     f"{_mib(r['plan']['arena_bytes'])} | {_mib(r['runtime_alloc_peak_bytes'])} | "
                     f"{_mib(r['peak_rss_bytes'])} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    first = data["speed"][0]
    lines.append(f"\nOne {first['prompt_tokens']:,}-token natural-text prompt, then {first['decode_tokens']} greedy "
                 "tokens; each row the median of its `edgekv-run --report` processes (one process per run, so the "
                 "peak RSS is one artifact's; the weights are mapped, so RSS counts the pages read). Runtime "
                 "allocations: the native runtime's own peak (caches, arena, inputs, kernel workspaces). The arena "
                 "holds one layer's dequantised K/V while its step runs (`compiler/passes/int8_cache.py`).\n")
    lines.append(f"At N = {data['same_n']:,}, last prompt token: the compiled int8 artifact is KL "
                 f"{ag['kl_compiled_int8_vs_eager_int8']:.2e} nats from the eager int8 engine (argmax "
                 f"{'equal' if ag['argmax_equal_eager'] else 'different'}), where the compiled fp32 artifact is KL "
                 f"{ag['kl_compiled_fp32_vs_eager_fp32']:.2e} from the eager fp32 engine. int8 against fp32: KL "
                 f"{ag['kl_int8_vs_fp32_compiled']:.2e} compiled, {ag['kl_int8_vs_fp32_eager']:.2e} eager; "
                 f"{ag['same_greedy_tokens']}/{ag['decode_tokens']} greedy tokens are the same in both formats "
                 "(compiled).\n")
    lines.append(f"Why the int8 pair is further apart than the fp32 pair: of {ag['kept_rows']:,} kept rows (all layers "
                 f"and KV heads), compiled and eager int8 keep {ag['kept_rows_differing_compiled_vs_eager_int8']:,} "
                 f"differently; the eager int8 engine at 1 and at 2 torch threads keeps "
                 f"{ag['kept_rows_differing_eager_int8_1_vs_2_threads']:,} differently (its logits KL "
                 f"{ag['kl_eager_int8_1_vs_2_threads']:.2e}), and compiled against eager fp32 "
                 f"{ag['kept_rows_differing_eager_fp32_vs_compiled_fp32']:,}. Rounding to int8 turns a float-order "
                 "difference of 1e-7 into a neighbouring code now and then, an eviction near-tie turns that into "
                 "another kept row, and the next layers see another cache: run-to-run sensitivity of the format, "
                 "which the compiled path shares with the eager engine (tests/test_compiler_kv_int8.py holds the "
                 "two to the same rows on a tiny model, and the kernels to the same bits).\n")
    lines.append(f"Passkey at equal KV bytes ({_mib(eq['bytes'])} MiB: fp32 N = {eq['fp32_budget']:,}, int8 N = "
                 f"{eq['int8_budget']:,}), greedy, exact key:\n")
    lines += passkey_table(data["passkey"], ["fp32", "int8"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
