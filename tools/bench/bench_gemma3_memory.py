"""Gemma 3 270M's KV bytes, peak RSS and speed at long prompts (issue 32): `edgekv-run` on an artifact with
per-layer cache kinds (the 15 local layers a cache of their window, the 3 global layers the policy at N)
against llama.cpp's `llama-bench` on the same GGUF (its own SWA cache: the local layers' window, the global
layers every token), same threads, interleaved, at each prompt length; plus what a uniform cache would
hold (arithmetic, below).

    python -m tools.bench.bench_gemma3_memory --artifact build/g3-kd1k \
        [--model /work/wt/models/gemma-3-270m-q4_k_m.gguf] [--lengths 8k,16k,32k] [--threads 2]
        [--decode-tokens 16] [--rounds 1] [--llama-flash-attn 1] [--out docs/results/gemma3_memory]

* edgekv: `edgekv-run ARTIFACT --prompt-ids @FILE --max-new-tokens T+1 --warmup --ignore-eos --report`
  (tools/bench/bench_llama_cpp.py's `run_edgekv`): prefill and decode tok/s, peak RSS from its report; KV
  bytes are the artifact's memory plan (`cache_bytes`, the buffers the runtime allocates: fixed, whatever
  the prompt's length).
* llama.cpp: `llama-bench -p L` (prefill) and `-n T -d L` (decode at depth L) with `-v`; its KV bytes are
  the sizes it prints for its two caches (non-SWA and SWA) in the decode run, whose context holds L + T
  tokens; peak RSS of that process (GNU time).
* Uniform caches (not built: the compiler gives a Gemma 3 local layer its window, never a policy cache):
  "uniform N" = N + B entries on every layer at the artifact's per-entry bytes (what an engine without
  per-layer kinds allocates for the same N on the global layers); "full fp32" = every layer every token at
  edgekv's fp32 rows; "llama.cpp full (swa-full)" = every layer every token at llama.cpp's f16 rows (its
  non-SWA cache's bytes per cell and layer, measured, times 18 layers). These are arithmetic, marked so.

Each round runs every length on both systems, the order alternating; figures are medians over rounds.
Writes <out>.json, <out>.md and <out>.png."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tools.bench.bench_llama_cpp import parse_lengths, run_edgekv

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")


def run_llama(gguf: Path, length: int, threads: int, decode_tokens: int, flash_attn: bool) -> dict:
    """llama-bench pp<length> and tg<decode_tokens> at depth <length>, verbose: tok/s, the decode run's peak
    RSS and the KV caches it printed (one line per cache: MiB, cells, layers)."""
    from edgekv.bench.llama_cpp import find_binary, run_measured

    exe = str(find_binary("llama-bench"))
    out = {"flash_attn": flash_attn}
    for kind, extra in (("pp", ["-p", str(length), "-n", "0", "-d", "0"]),
                        ("tg", ["-p", "0", "-n", str(decode_tokens), "-d", str(length)])):
        cmd = [exe, "-m", str(gguf), "-t", str(threads), *extra, "-fa", "1" if flash_attn else "0", "-r", "1",
               "-o", "json", "-v"]
        stdout, stderr, peak = run_measured(cmd)
        row = json.loads(stdout)[0]
        caches = [{"mib": float(m[1]), "cells": int(m[2]), "layers": int(m[3])} for m in KV_LINE.finditer(stderr)]
        out[kind] = {"tok_s": float(row["avg_ts"]), "peak_rss": peak, "kv_caches": caches, "command": " ".join(cmd),
                     "type_k": row.get("type_k")}
    tg = out["tg"]
    return {"prefill_tok_s": out["pp"]["tok_s"], "decode_tok_s": tg["tok_s"], "peak_rss": tg["peak_rss"],
            "kv_bytes": int(sum(c["mib"] for c in tg["kv_caches"]) * MIB), "kv_caches": tg["kv_caches"], "runs": out}


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def arithmetic(manifest: dict, llama_caches: list[dict], length: int) -> dict:
    """KV bytes of caches that were not built (see the module doc)."""
    cache, kinds = manifest["cache"], manifest.get("cache_kinds") or []
    fields = {f: d for f, d in manifest["cache_fields"]}
    size = {"float32": 4, "int32": 4, "int8": 1, "float16": 2}

    def layer_bytes(shapes: dict) -> int:
        total = 0
        for f, shape in shapes.items():
            n = 1
            for s in shape:
                n *= s
            total += n * size.get(fields.get(f, "float32"), 4)
        return total

    g = next((i for i, k in enumerate(kinds) if k["kind"] == "global"), 0)
    entries = kinds[g]["entries"] if kinds else manifest["budget"]
    per_entry = layer_bytes({f: s for f, s in cache[g].items() if f != "fill"}) / entries  # k, v, pos (+ state)
    layers = len(cache)
    block = manifest["block"]
    kv_row = 2 * cache[g]["k"][0] * cache[g]["k"][2] * 4  # K and V of one token, fp32, all KV heads
    non_swa = next((c for c in llama_caches if c["layers"] and c["layers"] < layers // 2), None)
    llama_row = non_swa["mib"] * MIB / (non_swa["cells"] * non_swa["layers"]) if non_swa else None
    return {"uniform_n_bytes": int(per_entry * (manifest["budget"] + block) * layers),
            "full_fp32_bytes": int(kv_row * length * layers),
            "llama_full_f16_bytes": int(llama_row * length * layers) if llama_row else None}


def summarize(raw: dict, lengths: list[int], manifest: dict) -> list[dict]:
    rows = []
    for n in lengths:
        e, llm = raw["edgekv"][n], raw["llama.cpp"][n]
        row = {"length": n,
               "edgekv": {k: median_of(e, k) for k in ("prefill_tok_s", "decode_tok_s", "peak_rss", "plan_bytes")},
               "llama.cpp": {k: median_of(llm, k) for k in ("prefill_tok_s", "decode_tok_s", "peak_rss", "kv_bytes")}}
        row["edgekv"]["kv_bytes"] = int(manifest["memory_plan"]["cache_bytes"])
        row["arithmetic"] = arithmetic(manifest, llm[-1]["kv_caches"] if llm else [], n)
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    m = result["meta"]
    L = [f"# Gemma 3 270M: KV bytes, peak RSS and speed at long prompts (edgekv-run vs llama.cpp)", "",
         f"Regenerate: `{result['command']}` (commit `{m.get('commit', '')}`).", "",
         f"**Shared machine** ({m['machine']['cores']} cores; load average {result['load_before']} before, "
         f"{result['load_after']} after; other helpers' jobs at nice 19): read the KV bytes as exact, the speeds "
         "and RSS as one interleaved run's.", "",
         f"edgekv: `{result['artifact_summary']}`, {result['threads']} threads. llama.cpp: `llama-bench` (its SWA "
         f"cache, KV f16, flash attention {'on' if result['llama_flash_attn'] else 'off'}), {result['threads']} threads, "
         f"same GGUF. Decode: {result['decode_tokens']} tokens after the prompt; medians of {result['rounds']} "
         "round(s).", "",
         "## KV bytes", "",
         "| prompt | edgekv, per-layer kinds (measured plan) | llama.cpp SWA cache (measured) | uniform N + B every layer "
         "(arithmetic) | full cache fp32 every layer (arithmetic) | llama.cpp full attention, f16 (arithmetic) |",
         "|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        a = r["arithmetic"]
        llama_full = f"{a['llama_full_f16_bytes'] / MIB:.1f} MiB" if a["llama_full_f16_bytes"] else "—"
        L.append(f"| {r['length'] // 1024}K | {r['edgekv']['kv_bytes'] / MIB:.1f} MiB | "
                 f"{r['llama.cpp']['kv_bytes'] / MIB:.1f} MiB | {a['uniform_n_bytes'] / MIB:.1f} MiB | "
                 f"{a['full_fp32_bytes'] / MIB:.1f} MiB | {llama_full} |")
    L += ["", "edgekv's rows are fp32 (K and V of a token: 2 KiB per layer), llama.cpp's f16 (1 KiB): at the same "
          "entries edgekv's bytes are twice llama.cpp's. edgekv's cache does not grow with the prompt: the local "
          "layers keep their window, the global layers N.", "",
          "## Peak RSS and speed", "",
          "| prompt | edgekv peak RSS | llama.cpp peak RSS | edgekv prefill tok/s | llama.cpp prefill tok/s | "
          "edgekv decode tok/s | llama.cpp decode tok/s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        e, p = r["edgekv"], r["llama.cpp"]
        L.append(f"| {r['length'] // 1024}K | {e['peak_rss'] / MIB:.0f} MiB | {p['peak_rss'] / MIB:.0f} MiB | "
                 f"{e['prefill_tok_s']:.0f} | {p['prefill_tok_s']:.0f} | {e['decode_tok_s']:.1f} | "
                 f"{p['decode_tok_s']:.1f} |")
    L += ["", "The uniform and full rows are arithmetic, not runs: the compiler gives a Gemma 3 local layer its window "
          "and never a policy cache, so a uniform Gemma artifact is not built (a uniform N cache on the local layers "
          "would also change what they attend to); llama-bench has no switch for llama.cpp's `--swa-full`. "
          "Quality at these budgets: [gemma3_quality.md](gemma3_quality.md).", "",
          f"Wall time: {result['wall_seconds']:.0f} s. Every run is in the JSON.", ""]
    return "\n".join(L)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return
    rows = result["rows"]
    labels = [f"{r['length'] // 1024}K" for r in rows]
    xs = list(range(len(rows)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    kv = (("edgekv kinds", lambda r: r["edgekv"]["kv_bytes"]), ("llama.cpp SWA", lambda r: r["llama.cpp"]["kv_bytes"]),
          ("uniform N (arith.)", lambda r: r["arithmetic"]["uniform_n_bytes"]),
          ("full fp32 (arith.)", lambda r: r["arithmetic"]["full_fp32_bytes"]))
    w = 0.2
    for i, (name, get) in enumerate(kv):
        axes[0].bar([x + (i - 1.5) * w for x in xs], [get(r) / MIB for r in rows], width=w, label=name)
    axes[0].set_yscale("log")
    axes[0].set_title("KV bytes (MiB, log)")
    axes[0].legend(fontsize=7)
    for ax, key, title, scale in ((axes[1], "peak_rss", "peak RSS (MiB)", MIB), (axes[2], "decode_tok_s", "decode tok/s", 1)):
        for off, name in ((-0.2, "edgekv"), (0.2, "llama.cpp")):
            ax.bar([x + off for x in xs], [r[name][key] / scale for r in rows], width=0.4, label=name)
        ax.set_title(title)
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("prompt tokens")
    fig.suptitle(f"Gemma 3 270M, {result['threads']} threads (shared machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True, help="a Gemma 3 artifact (`edgekv compile ... -o DIR`)")
    ap.add_argument("--model", default="gemma3-270m", help="the GGUF llama.cpp runs (a known name or a path)")
    ap.add_argument("--lengths", default="8k,16k,32k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--llama-flash-attn", type=int, choices=(0, 1), default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/gemma3_memory")
    args = ap.parse_args(argv)
    lengths = parse_lengths(args.lengths)
    if args.threads < 1 or args.decode_tokens < 1 or args.rounds < 1:
        raise SystemExit("error: --threads, --decode-tokens and --rounds must be at least 1")
    manifest_path = args.artifact / "manifest.json"
    if not (args.artifact / "program.ekv").is_file() or not manifest_path.is_file():
        raise SystemExit(f"error: --artifact {args.artifact} holds no program.ekv / manifest.json: compile one with "
                         "`edgekv compile gemma3-270m --policy keydiff --budget 1k -o DIR`")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("cache_kinds"):
        raise SystemExit(f"error: --artifact {args.artifact} has no per-layer cache kinds (not a Gemma 3 artifact)")
    from edgekv.bench.llama_cpp import find_binary
    from edgekv.corpus import natural_token_ids
    from edgekv.evaluation.report import provenance
    from edgekv.models import load_model
    from edgekv.models.sources import resolve
    from edgekv.runtime import native

    exe = native.cli_path()
    if exe is None:
        raise SystemExit("error: edgekv-run is not built (`pip install -e .` builds runtime/)")
    try:
        find_binary("llama-bench")
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    console = Console(stderr=True)
    src = resolve(args.model, console)
    if src.kind != "gguf":
        raise SystemExit(f"error: --model {args.model} is not a GGUF model: llama.cpp runs GGUF files")
    tokenizer = load_model(args.model, console, lazy=True).tokenizer
    ids = {n: natural_token_ids(tokenizer, n).tolist() for n in lengths}
    meta = provenance(["python", "-m", "tools.bench.bench_gemma3_memory", *(argv if argv is not None else sys.argv[1:])])
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    raw = {"edgekv": {n: [] for n in lengths}, "llama.cpp": {n: [] for n in lengths}}
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("bench", total=args.rounds * len(lengths) * 2)
        for rnd in range(args.rounds):
            for n in lengths:
                order = ("edgekv", "llama.cpp") if (rnd + lengths.index(n)) % 2 == 0 else ("llama.cpp", "edgekv")
                for name in order:
                    progress.update(task, description=f"round {rnd + 1}: {name} @ {n} tokens")
                    r = (run_edgekv(exe, args.artifact, ids[n], args.threads, args.decode_tokens) if name == "edgekv"
                         else run_llama(src.path, n, args.threads, args.decode_tokens, bool(args.llama_flash_attn)))
                    r["round"] = rnd
                    raw[name][n].append(r)
                    progress.advance(task)
    kinds = [k["kind"] for k in manifest["cache_kinds"]]
    result = {"command": meta["command"] if "command" in meta else "", "meta": meta, "model": args.model,
              "gguf": str(src.path), "artifact": str(args.artifact),
              "artifact_summary": f"{manifest['policy']['name']}, N = {manifest['budget']} on {kinds.count('global')} "
                                  f"global layers, {kinds.count('local')} local layers a cache of their window, "
                                  f"B = {manifest['block']}, weights {(manifest.get('weights') or {}).get('format')}",
              "cache_kinds": manifest["cache_kinds"], "memory_plan": manifest["memory_plan"],
              "threads": args.threads, "decode_tokens": args.decode_tokens, "rounds": args.rounds,
              "llama_flash_attn": args.llama_flash_attn, "load_before": load_before,
              "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()), "wall_seconds": time.perf_counter() - t0,
              "rows": summarize(raw, lengths, manifest), "raw": {k: {str(n): v for n, v in d.items()} for k, d in raw.items()}}
    result["command"] = " ".join(["python", "-m", "tools.bench.bench_gemma3_memory",
                                  *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
