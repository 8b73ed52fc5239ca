"""int8 KV cache against fp32 KV on SmolLM2-135M-Instruct (eager engine, `--kv-dtype int8`).

    python tools/experiments/check_kv_int8.py [--length 2048] [--window 512] [--seeds 0,1] [--budgets 256,512]
                                  [--policies keydiff,snapkv] [--threads 2] [--out docs/results]

Three measurements, on `edgekv eval`'s fidelity text (CPython's pydoc topics,
``edgekv.evaluation.tasks.build_fidelity``: ``--length`` tokens, the last ``--window`` scored):

1. Quantisation error of K and V. The context is prefilled with the full cache in fp32; every
   layer's cached K (post-RoPE) and V rows are quantised three ways and compared with the fp32 rows
   (relative Frobenius error over all rows of all layers, mean and max |x − x̂|, bytes per row):
   per token per 32 channels (the format, ``edgekv/engine/kv_quant.py``), per token per whole row
   (one scale per d channels), and per channel over groups of 32 tokens (KIVI's K grouping; not
   streaming-friendly under eviction, measured for comparison only).
2. Fidelity to the fp32 full cache (``edgekv.evaluation.fidelity``: teacher-forced top-1 agreement
   and KL(P_full ‖ P_run) over the scored window, greedy continuation): the full cache in int8 (no
   eviction: quantisation alone; also with the block's own rows read in fp32, the rule not chosen),
   then for each policy and N: fp32 at N, int8 at the same N, and int8 at the same BYTES (the byte
   budget of fp32 at N, turned into entries by ``budget.parse_budget(..., kv_dtype="int8")``).
3. The relative logit gap of the int8 full cache against fp32 (max |Δlogit| / max |logit| over the
   scored positions): the tolerance tests/test_kv_int8.py states for SmolLM2.

Writes kv_int8.json (with the commit and this command) and kv_int8.md under ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODEL = "smollm2-135m"


def git_commit() -> str:
    from edgekv.evaluation import report

    return report.git_commit(ROOT) or "unknown"


def cpu_name() -> str:
    from edgekv.evaluation.report import machine

    return machine()["cpu"]


# ---- 1. quantisation error ---------------------------------------------------------------------------

def quantisation_errors(model, ids, block: int) -> dict:
    """Errors of the three groupings over the cached K and V of every layer (full fp32 cache of ``ids``)."""
    from edgekv.engine import BlockEngine
    from edgekv.engine.kv_quant import round_trip
    from edgekv.memory import INT8_GROUP
    from edgekv.policies import make_policy

    engine = BlockEngine(model, make_policy("full"), ids.numel(), block)
    engine.prefill(ids)
    d = model.config.head_dim

    def per_channel_over_tokens(x):  # [H, n, d]: a scale per channel over each 32 consecutive tokens
        return round_trip(x.transpose(1, 2).contiguous(), INT8_GROUP).transpose(1, 2)

    groupings = {"per_token_32_channels": (lambda x: round_trip(x), d + 2 * -(-d // INT8_GROUP)),
                 "per_token_whole_row": (lambda x: round_trip(x, d), d + 2),
                 "per_channel_32_tokens": (per_channel_over_tokens, d + 2 * d / INT8_GROUP)}
    out = {}
    for what in ("keys", "values"):
        for name, (quantise, row_bytes) in groupings.items():
            err2 = ref2 = 0.0
            abs_sum, count, worst, worst_layer_rel = 0.0, 0, 0.0, 0.0
            for cache in engine.caches:
                x = getattr(cache, what)[:, : cache.length].double()
                diff = (quantise(x.float()).double() - x)
                e2, r2 = float(diff.pow(2).sum()), float(x.pow(2).sum())
                err2, ref2 = err2 + e2, ref2 + r2
                abs_sum += float(diff.abs().sum())
                count += diff.numel()
                worst = max(worst, float(diff.abs().max()))
                worst_layer_rel = max(worst_layer_rel, (e2 / r2) ** 0.5)
            out.setdefault(what, {})[name] = {"relative_error": (err2 / ref2) ** 0.5, "mean_abs_error": abs_sum / count,
                                              "max_abs_error": worst, "worst_layer_relative_error": worst_layer_rel,
                                              "bytes_per_row": row_bytes, "fp32_bytes_per_row": 4 * d}
    out["rows_per_layer"] = engine.caches[0].length
    del engine
    return out


# ---- 2. fidelity ----------------------------------------------------------------------------------------

def own_rows_fp32_engine(model, budget: int, block: int):
    """An int8 engine whose block attends to its OWN rows in fp32 (older rows dequantised): the rule
    not chosen, measured for comparison. Only the rows written in the current step are swapped."""
    from edgekv.engine import BlockEngine
    from edgekv.engine.cache import Int8LayerCache
    from edgekv.policies import make_policy

    class OwnRowsFp32Cache(Int8LayerCache):
        fresh: tuple | None = None

        def _store_rows(self, start, end, keys, values):
            super()._store_rows(start, end, keys, values)
            self.fresh = (start, end, keys.clone(), values.clone())

        def view(self, n):
            keys, values, positions = super().view(n)
            if self.fresh is not None:
                start, end, k, v = self.fresh
                keys, values = keys.clone(), values.clone()
                keys[:, start:end], values[:, start:end] = k, v  # n ≥ end: the step reads its whole block
                self.fresh = None
            return keys, values, positions

    engine = BlockEngine(model, make_policy("full"), budget, block, kv_dtype="int8")
    engine.caches = [OwnRowsFp32Cache(c.positions.shape[0], c.capacity, model.config.head_dim) for c in engine.caches]
    return engine


def fidelity(model, prompt, spec: dict, progress) -> dict:
    """Every run of measurement 2 on one prompt, scored against the fp32 full cache."""
    from edgekv.budget import parse_budget
    from edgekv.engine import BlockEngine
    from edgekv.evaluation.fidelity import compare, run_trace
    from edgekv.memory import kv_cache_bytes
    from edgekv.policies import make_policy

    cfg, block, greedy = model.config, spec["block"], spec["greedy_tokens"]
    whole = prompt.tokens + greedy

    def trace(label, engine):
        t0 = time.perf_counter()
        task = progress.add_task(label, total=prompt.tokens)
        out = run_trace(engine, prompt.ids, prompt.eval_start, greedy, progress=lambda n: progress.advance(task, n))
        progress.remove_task(task)
        return out, time.perf_counter() - t0

    ref, ref_s = trace(f"seed {prompt.seed} full fp32", BlockEngine(model, make_policy("full"), whole, block))
    runs = []

    def add(label, engine, **fields):
        got, seconds = trace(f"seed {prompt.seed} {label}", engine)
        row = {"seed": prompt.seed, **fields, "budget": engine.budget, "kv_dtype": engine.kv_dtype,
               "kv_cache_bytes": engine.kv_bytes, "eviction_events": engine.stats.eviction_events,
               "seconds": seconds, **compare(ref, got)}
        row["relative_logit_gap"] = float((got.logits - ref.logits).abs().max() / ref.logits.abs().max())
        runs.append(row)

    add("full int8", BlockEngine(model, make_policy("full"), whole, block, kv_dtype="int8"),
        policy="full", comparison="quantisation only (nothing evicted)")
    add("full int8, own rows fp32", own_rows_fp32_engine(model, whole, block), policy="full",
        comparison="quantisation only, the block's own rows read in fp32 (rule not chosen)")
    for policy in spec["policies"]:
        for n in spec["budgets"]:
            byte_budget = kv_cache_bytes(cfg, n + block)  # what an fp32 cache of N + B entries holds (no state)
            n_int8 = parse_budget(f"{byte_budget}B", cfg, block, kv_dtype="int8")
            for kv, budget, comparison in (("fp32", n, "fp32 at N"), ("int8", n, "int8 at the same N"),
                                           ("int8", n_int8, "int8 at the same bytes")):
                add(f"{policy} {kv} N={budget}", BlockEngine(model, make_policy(policy), budget, block, kv_dtype=kv),
                    policy=policy, comparison=comparison, fp32_budget=n, byte_budget=byte_budget)
    return {"seed": prompt.seed, "tokens": prompt.tokens, "eval_start": prompt.eval_start,
            "reference_seconds": ref_s, "runs": runs}


# ---- report ---------------------------------------------------------------------------------------------

def write_markdown(data: dict, path: Path) -> None:
    q = data["quantisation_error"]
    spec = data["spec"]
    lines = ["# int8 KV cache against fp32 KV (SmolLM2-135M-Instruct, eager engine)", "",
             f"Regenerate: `{data['command']}`", "",
             f"Commit `{data['git_commit']}`, CPU: {data['cpu']}, {data['threads']} thread(s), "
             f"{data['seconds']:.0f} s in all.", "",
             "The format (`edgekv/engine/kv_quant.py`): per token, per group of 32 channels, symmetric int8 codes and "
             "one float16 scale s = max|x|/127 per group; quantised when a row is written, dequantised whenever it is "
             "read (the block's own rows, every policy's scores).", "",
             "## 1. Quantisation error of K and V", "",
             f"All {q['rows_per_layer']} rows of every layer's K (post-RoPE) and V after a full-cache fp32 prefill of "
             f"{q['rows_per_layer']} tokens of the fidelity text (seed {spec['seeds'][0]}). Relative error = "
             "‖x − x̂‖ / ‖x‖ over all layers; worst layer = the largest per-layer relative error.", "",
             "| tensor | grouping | relative error | worst layer | mean abs error | max abs error | bytes per row (fp32: "
             f"{q['keys']['per_token_32_channels']['fp32_bytes_per_row']}) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    names = {"per_token_32_channels": "per token, 32 channels (chosen)", "per_token_whole_row": "per token, whole row",
             "per_channel_32_tokens": "per channel, 32 tokens (KIVI-style K; not streaming)"}
    for what in ("keys", "values"):
        for name, label in names.items():
            r = q[what][name]
            lines.append(f"| {what[0].upper()} | {label} | {100 * r['relative_error']:.3f} % | "
                         f"{100 * r['worst_layer_relative_error']:.3f} % | {r['mean_abs_error']:.3g} | "
                         f"{r['max_abs_error']:.3g} | {r['bytes_per_row']:g} |")
    lines += ["", "## 2. Fidelity to the fp32 full cache", "",
              f"Teacher forcing over the last {spec['window']} tokens of {spec['length']}-token texts (seeds "
              f"{', '.join(map(str, spec['seeds']))}), B = {spec['block']}, as `edgekv eval --task fidelity` scores "
              "it (`edgekv/evaluation/fidelity.py`): top-1 agreement and mean KL(P_full ‖ P_run) in nats against the "
              f"fp32 full cache, and the {spec['greedy_tokens']}-token greedy continuation's agreement. Same bytes: the "
              "byte budget of the fp32 cache at N (N + B entries) given to an int8 cache "
              "(`parse_budget(..., kv_dtype=\"int8\")`). Means over the seeds.", "",
              "| policy | run | N | KV cache | top-1 agreement | mean KL | max KL | greedy agreement | max rel. logit gap |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    from collections import defaultdict

    groups = defaultdict(list)
    order = []
    for prompt in data["fidelity"]:
        for r in prompt["runs"]:
            key = (r["policy"], r["comparison"], r.get("fp32_budget"))
            if key not in groups:
                order.append(key)
            groups[key].append(r)
    for key in order:
        rows = groups[key]
        mean = lambda f: sum(r[f] for r in rows) / len(rows)  # noqa: E731
        budgets = sorted({r["budget"] for r in rows})
        lines.append(f"| {key[0]} | {key[1]} | {', '.join(f'{b:,}' for b in budgets)} | "
                     f"{rows[0]['kv_cache_bytes'] / 2**20:.2f} MiB | {100 * mean('top1_agreement'):.2f} % | "
                     f"{mean('mean_kl'):.4f} | {max(r['max_kl'] for r in rows):.3f} | "
                     f"{100 * mean('greedy_token_agreement'):.1f} % | {max(r['relative_logit_gap'] for r in rows):.4f} |")
    lines += ["", "KV cache: the bytes the engine allocated for the run (all layers; the full-cache rows hold the "
              "whole text). The last column is max |logit_run − logit_full| / max |logit_full| over the scored "
              "positions; for the int8 full cache it is quantisation alone, the number tests/test_kv_int8.py bounds.",
              "", "Reading it (means over the seeds, mean KL in nats):", ""]

    def mean_of(policy, comparison, n=None, field="mean_kl"):
        rows = groups[(policy, comparison, n)]
        return sum(r[field] for r in rows) / len(rows)

    alone, own = "quantisation only (nothing evicted)", "quantisation only, the block's own rows read in fp32 (rule not chosen)"
    lines.append(f"- Quantisation alone: KL {mean_of('full', alone):.1e}, top-1 {100 * mean_of('full', alone, field='top1_agreement'):.2f} %; "
                 f"with the block's own rows read in fp32 instead, {mean_of('full', own):.1e} and "
                 f"{100 * mean_of('full', own, field='top1_agreement'):.2f} % — the price of \"everything reads "
                 "dequantised\", far below any eviction's.")
    for policy in spec["policies"]:
        for n in spec["budgets"]:
            fp32_bytes = groups[(policy, "fp32 at N", n)][0]["kv_cache_bytes"]
            int8_bytes = groups[(policy, "int8 at the same N", n)][0]["kv_cache_bytes"]
            same_bytes_n = groups[(policy, "int8 at the same bytes", n)][0]["budget"]
            lines.append(f"- {policy}, N = {n}: fp32 {mean_of(policy, 'fp32 at N', n):.4f}; int8 at the same N "
                         f"{mean_of(policy, 'int8 at the same N', n):.4f} in a {fp32_bytes / int8_bytes:.2f}x smaller "
                         f"cache; int8 at the same bytes (N = {same_bytes_n:,}) "
                         f"{mean_of(policy, 'int8 at the same bytes', n):.4f}.")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=2048, help="fidelity text length in tokens")
    ap.add_argument("--window", type=int, default=512, help="scored positions at the end of the text")
    ap.add_argument("--seeds", default="0,1", help="fidelity texts (comma-separated seeds)")
    ap.add_argument("--budgets", default="256,512", help="fp32 budgets N (comma-separated)")
    ap.add_argument("--policies", default="keydiff,snapkv", help="evicting policies (comma-separated)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--greedy-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite kv_int8.md from --out's kv_int8.json")
    args = ap.parse_args()
    if args.markdown_only:
        write_markdown(json.loads((args.out / "kv_int8.json").read_text()), args.out / "kv_int8.md")
        return

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from edgekv.evaluation.report import provenance
    from edgekv.evaluation.tasks import build_fidelity
    from edgekv.models import load_model

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = {"length": args.length, "window": args.window, "seeds": [int(s) for s in args.seeds.split(",")],
            "budgets": [int(b) for b in args.budgets.split(",")], "policies": args.policies.split(","),
            "block": args.block, "greedy_tokens": args.greedy_tokens}
    t0 = time.perf_counter()
    model = load_model(MODEL)
    prompts = [build_fidelity(model.tokenizer, args.length, seed, args.window) for seed in spec["seeds"]]
    data = {"command": "python tools/experiments/check_kv_int8.py " + " ".join(sys.argv[1:]), "git_commit": git_commit(),
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "model": model.model_id,
            "weight_sha256": model.weight_hash, "spec": spec,
            "load_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, "provenance": origin}
    data["quantisation_error"] = quantisation_errors(model, prompts[0].ids[: prompts[0].eval_start], args.block)
    with Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                  TimeElapsedColumn()) as progress:
        data["fidelity"] = [fidelity(model, p, spec, progress) for p in prompts]
    data["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_int8.json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out / "kv_int8.md")
    print((args.out / "kv_int8.md").read_text())


if __name__ == "__main__":
    main()
