"""edgekv-run against llama.cpp's own llama-bench on the same GGUF, same threads, one run, interleaved:
prefill tok/s, decode tok/s at the prompt's depth, and peak RSS of each.

    python -m tools.bench.bench_llama_cpp --artifact build/art-keydiff-q4 [--prompt-lengths 1k,8k]
        [--threads 2] [--decode-tokens 32] [--rounds 2] [--out docs/results/peer_llama_cpp]
    # several models in one run, interleaved: one --model per --artifact
    python -m tools.bench.bench_llama_cpp --artifact build/smol --model smollm2-135m \
        --artifact build/qwen --model qwen2.5-coder-1.5b

* llama.cpp: `llama-bench` built by tools/bench/build_llama_cpp.py (the sources llama-cpp-python's
  sdist vendors, GGML_NATIVE=ON, Release): pp<L>, and tg<T> at depth L (`-d L`), each with flash
  attention off and on (`--flash-attn off|on`: one of them); the better one is the peer's figure and all
  are recorded. Peak RSS: the
  llama-bench process of the tg run (its context holds L + T tokens), from `wait4`.
* edgekv: `edgekv-run ARTIFACT --prompt-ids @FILE --max-new-tokens T+1 --warmup --ignore-eos --report`
  (the first new token comes from the prefill; T decode steps are timed); peak RSS from its report.
* Each round runs every length on both systems, the order alternating between rounds; the
  figures are medians over rounds.

Writes <out>.json, <out>.md and <out>.png. The GGUF is the model's (edgekv.models.sources)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        try:
            out.append(int(float(p[:-1]) * 1024) if p.endswith("k") else int(p))
        except ValueError:
            raise SystemExit(f"error: --prompt-lengths {text!r}: give token counts such as 1k,8k or 1024,8192") from None
    if not out or min(out) <= 0:
        raise SystemExit(f"error: --prompt-lengths {text!r}: give at least one positive length")
    return out


def run_edgekv(exe: Path, artifact: Path, ids: list[int], threads: int, decode_tokens: int) -> dict:
    from edgekv.bench.llama_cpp import run_measured

    with tempfile.TemporaryDirectory() as d:
        id_file, report = Path(d) / "ids.txt", Path(d) / "report.json"
        id_file.write_text(",".join(map(str, ids)))  # a file: 8K ids exceed one argument's limit
        cmd = [str(exe), str(artifact), "--prompt-ids", "@" + str(id_file), "--max-new-tokens", str(decode_tokens + 1),
               "--threads", str(threads), "--warmup", "--ignore-eos", "--allow-beyond-context", "--quiet",
               "--report", str(report)]
        _, _, wait_peak = run_measured(cmd)
        r = json.loads(report.read_text())
    return {"prefill_tok_s": len(ids) / r["prefill_seconds"], "decode_tok_s": decode_tokens / r["decode_seconds"],
            "peak_rss": r["memory"]["peak_rss_bytes"], "peak_rss_wait4": wait_peak,
            "plan_bytes": r["memory"]["plan"]["total_bytes"], "threads": r.get("threads", threads)}


FLASH_ATTN = {"both": (False, True), "off": (False,), "on": (True,)}


def run_llama(gguf: Path, length: int, threads: int, decode_tokens: int, flash_attn=(False, True)) -> dict:
    from edgekv.bench.llama_cpp import llama_bench

    runs = {}
    for fa in flash_attn:
        runs[f"pp_fa{int(fa)}"] = llama_bench(gguf, threads, prompt=length, flash_attn=fa)
        runs[f"tg_fa{int(fa)}"] = llama_bench(gguf, threads, generate=decode_tokens, depth=length, flash_attn=fa)
    pp = max((r for k, r in runs.items() if k.startswith("pp_")), key=lambda r: r["tok_s"])
    tg = max((r for k, r in runs.items() if k.startswith("tg_")), key=lambda r: r["tok_s"])
    return {"prefill_tok_s": pp["tok_s"], "decode_tok_s": tg["tok_s"], "peak_rss": tg["peak_rss"],
            "prefill_flash_attn": pp["flash_attn"], "decode_flash_attn": tg["flash_attn"], "runs": runs}


def median_of(rounds: list[dict], key: str):
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(raw: dict[str, dict[int, list[dict]]], lengths: list[int]) -> list[dict]:
    rows = []
    for length in lengths:
        e, llm = raw["edgekv"][length], raw["llama.cpp"][length]
        row = {"length": length}
        for name, runs in (("edgekv", e), ("llama.cpp", llm)):
            row[name] = {k: median_of(runs, k) for k in ("prefill_tok_s", "decode_tok_s", "peak_rss")}
        for fa in (0, 1):
            if any(f"pp_fa{fa}" not in r["runs"] for r in llm):
                continue  # a setting not run (--flash-attn)
            row["llama.cpp"][f"prefill_tok_s_fa{fa}"] = statistics.median(r["runs"][f"pp_fa{fa}"]["tok_s"] for r in llm)
            row["llama.cpp"][f"decode_tok_s_fa{fa}"] = statistics.median(r["runs"][f"tg_fa{fa}"]["tok_s"] for r in llm)
            row["llama.cpp"][f"peak_rss_fa{fa}"] = statistics.median(r["runs"][f"tg_fa{fa}"]["peak_rss"] for r in llm)
        row["edgekv"]["plan_bytes"] = median_of(e, "plan_bytes")
        row["ratio"] = {k: row["edgekv"][k] / row["llama.cpp"][k] for k in ("prefill_tok_s", "decode_tok_s", "peak_rss")}
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    m, b = result["meta"], result["llama_cpp_build"]
    L = ["# edgekv-run against llama.cpp's llama-bench (same GGUF, same threads, one run)", "",
         f"Regenerate: `{m['command']}`.", "",
         f"**The machine was shared during this run** (other jobs on its {m['machine']['cores']} cores; load "
         f"average {m['load_before']} before, {m['load_after']} after): read the ratios, taken from one interleaved "
         "run, not the absolute speeds; the figures for docs are rerun on a quiet machine.", "",
         f"Machine: {m['machine']['cpu']}, {result['threads']} threads for both. Commit {m['commit']}. "
         f"Model: `{Path(result['gguf']).name}` ({result['model']}). edgekv: `{result['artifact_summary']}`. "
         f"llama.cpp: llama-bench from llama-cpp-python {b.get('llama_cpp_python')}'s vendored sources "
         f"({b.get('version', '?').splitlines()[0] if b.get('version') else '?'}), "
         f"{' '.join(f for f in b.get('cmake_flags', []) if 'NATIVE' in f or 'BUILD_TYPE' in f)}; its KV cache F16, full.", "",
         f"Decode: {result['decode_tokens']} tokens after the prompt (llama-bench `tg{result['decode_tokens']} -d L`); "
         f"medians of {result['rounds']} interleaved rounds. "
         + ("llama.cpp's figure is the better of flash attention off / on (both in the second table)."
            if result.get("flash_attn", "both") == "both" else
            f"llama.cpp ran with flash attention **{result['flash_attn']}** only (`--flash-attn {result['flash_attn']}`: "
            "off was the better setting in every row of the previous run with both)."), "",
         "| prompt | edgekv prefill tok/s | llama.cpp prefill tok/s | × | edgekv decode tok/s | llama.cpp decode tok/s "
         "| × | edgekv peak RSS | llama.cpp peak RSS | × |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        e, p, x = r["edgekv"], r["llama.cpp"], r["ratio"]
        L.append(f"| {r['length']} | {e['prefill_tok_s']:.1f} | {p['prefill_tok_s']:.1f} | {x['prefill_tok_s']:.2f}× "
                 f"| {e['decode_tok_s']:.1f} | {p['decode_tok_s']:.1f} | {x['decode_tok_s']:.2f}× "
                 f"| {e['peak_rss'] / MIB:.0f} MiB | {p['peak_rss'] / MIB:.0f} MiB | {x['peak_rss']:.2f}× |")
    L += ["", "× = edgekv / llama.cpp (speed: above 1 is edgekv faster; RSS: below 1 is edgekv smaller).", "",
          "| prompt | llama.cpp pp, FA off / on | tg at depth, FA off / on | peak RSS (tg run), FA off / on | edgekv plan |",
          "|---:|---:|---:|---:|---:|"]
    def pair(p, key, scale=1.0, unit=""):
        return " / ".join(f"{p[f'{key}_fa{fa}'] / scale:.{0 if unit else 1}f}" if f"{key}_fa{fa}" in p else "—"
                          for fa in (0, 1)) + unit

    for r in result["rows"]:
        p = r["llama.cpp"]
        L.append(f"| {r['length']} | {pair(p, 'prefill_tok_s')} | {pair(p, 'decode_tok_s')} "
                 f"| {pair(p, 'peak_rss', MIB, ' MiB')} | {r['edgekv']['plan_bytes'] / MIB:.0f} MiB |")
    prof = result.get("decode_profile")
    if prof:
        L += ["", f"Where an edgekv decode token goes at depth {prof['depth']} (`python -m tools.bench.profile_decode "
              f"--depth {prof['depth']} --threads 1 --clock cpu`: CPU time of each kernel call on one thread, median of "
              f"{prof['tokens']} tokens; {prof['token_seconds'] * 1e3:.1f} ms per token uninstrumented, the kernels "
              f"{prof['kernels_seconds'] * 1e3:.1f} ms instrumented, the VM's own calls included as elementwise):", "",
              "| kernels | ms per token | share |", "|---|---:|---:|"]
        L += [f"| {k} | {v['seconds'] * 1e3:.2f} | {v['share'] * 100:.1f} % |" for k, v in prof["by_kind"].items()]
        L += ["", "| kernel | calls per token | ms per token |", "|---|---:|---:|"]
        L += [f"| `{k['name']}` | {k['calls_per_token']} | {k['seconds'] * 1e3:.2f} |" for k in prof["kernels"][:10]]
    L += ["", f"Wall time of the run: {result['wall_seconds']:.0f} s. Every run (both systems, every round, each "
          "flash-attention setting) is in the JSON.", ""]
    return "\n".join(L)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return
    lengths = [r["length"] for r in result["rows"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, title, scale in ((axes[0], "prefill_tok_s", "prefill tok/s", 1), (axes[1], "decode_tok_s", "decode tok/s", 1),
                                  (axes[2], "peak_rss", "peak RSS (MiB)", MIB)):
        xs = range(len(lengths))
        for off, name in ((-0.2, "edgekv"), (0.2, "llama.cpp")):
            ax.bar([x + off for x in xs], [r[name][key] / scale for r in result["rows"]], width=0.4, label=name)
        ax.set_xticks(list(xs), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_title(title)
        ax.set_xlabel("prompt tokens")
    axes[0].legend()
    fig.suptitle(f"edgekv-run vs llama-bench, {result['model']}, {result['threads']} threads (shared machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, action="append", required=True,
                    help="a compiled artifact (`edgekv compile ... -o DIR`); repeat it with --model for several "
                         "models in one interleaved run")
    ap.add_argument("--model", action="append", default=None,
                    help="the model whose GGUF llama.cpp runs (the artifact's; one per --artifact, in order; "
                         "default smollm2-135m)")
    ap.add_argument("--prompt-lengths", default="1k,8k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians over them)")
    ap.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="both",
                    help="llama.cpp's flash-attention settings to run: both (its figure is the better one), off or on "
                         "(half the llama-bench time)")
    ap.add_argument("--profile-depth", type=int, default=1024,
                    help="also profile one edgekv decode token of the first artifact after this many prompt tokens, "
                         "per kernel, in CPU time on one thread (tools/bench/profile_decode.py); 0: skip")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/peer_llama_cpp",
                    help="path stem: writes <out>.json, <out>.md, <out>.png")
    args = ap.parse_args(argv)
    lengths = parse_lengths(args.prompt_lengths)
    models = args.model or ["smollm2-135m"]
    if len(models) != len(args.artifact):
        raise SystemExit(f"error: {len(args.artifact)} --artifact but {len(models)} --model: give one --model per "
                         "--artifact, in the same order")
    if args.threads < 1 or args.decode_tokens < 1 or args.rounds < 1:
        raise SystemExit("error: --threads, --decode-tokens and --rounds must be at least 1")
    for artifact in args.artifact:
        if not (artifact / "program.ekv").is_file():
            raise SystemExit(f"error: --artifact {artifact} holds no program.ekv: compile one with "
                             "`edgekv compile smollm2-135m --budget 1k --policy keydiff --weights q4 -o DIR`")
    from edgekv.bench.llama_cpp import build_dir, find_binary
    from edgekv.runtime import native

    exe = native.cli_path()
    if exe is None:
        raise SystemExit("error: edgekv-run is not built (`pip install -e .` builds runtime/)")
    try:
        find_binary("llama-bench")
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    console = Console(stderr=True)
    from edgekv.corpus import natural_token_ids
    from edgekv.evaluation.report import provenance
    from edgekv.models import load_model
    from edgekv.models.sources import resolve

    systems = []  # one per (artifact, model)
    for artifact, model in zip(args.artifact, models):
        src = resolve(model, console)
        if src.kind != "gguf":
            raise SystemExit(f"error: --model {model} is not a GGUF model: llama.cpp runs GGUF files")
        tokenizer = load_model(model, console, lazy=True).tokenizer  # the tokenizer only: no fp32 copy
        manifest = json.loads((artifact / "manifest.json").read_text()) if (artifact / "manifest.json").exists() else {}
        systems.append({"model": model, "gguf": src.path, "artifact": artifact, "manifest": manifest,
                        "ids": {n: natural_token_ids(tokenizer, n).tolist() for n in lengths},
                        "raw": {"edgekv": {n: [] for n in lengths}, "llama.cpp": {n: [] for n in lengths}}})
    meta = provenance(["python", "-m", "tools.bench.bench_llama_cpp", *(argv if argv is not None else sys.argv[1:])])
    meta["load_before"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    import time

    t0 = time.perf_counter()
    steps = args.rounds * len(lengths) * 2 * len(systems)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("bench", total=steps)
        for rnd in range(args.rounds):
            for s in systems:
                for n in lengths:
                    order = ("edgekv", "llama.cpp") if (rnd + lengths.index(n)) % 2 == 0 else ("llama.cpp", "edgekv")
                    for name in order:
                        progress.update(task, description=f"round {rnd + 1}: {s['model']}: {name} @ {n} tokens")
                        r = (run_edgekv(exe, s["artifact"], s["ids"][n], args.threads, args.decode_tokens)
                             if name == "edgekv" else run_llama(s["gguf"], n, args.threads, args.decode_tokens,
                                                                FLASH_ATTN[args.flash_attn]))
                        r["round"] = rnd
                        s["raw"][name][n].append(r)
                        progress.advance(task)
    meta["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    wall = time.perf_counter() - t0
    decode_profile = None
    if args.profile_depth > 0:  # in a child: one thread, CPU time (a shared machine disturbs it least)
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "tools.bench.profile_decode", "--artifact", str(args.artifact[0]),
                            "--depth", str(args.profile_depth), "--threads", "1", "--clock", "cpu",
                            "--json", f"{d}/p.json"], check=True, cwd=ROOT, capture_output=True)
            decode_profile = json.loads(Path(f"{d}/p.json").read_text())
    build_json = build_dir() / "build.json"
    sections = []
    for i, s in enumerate(systems):
        manifest = s["manifest"]
        sections.append({
            "meta": meta, "model": s["model"], "gguf": str(s["gguf"]), "artifact": str(s["artifact"]),
            "artifact_summary": ", ".join(f"{k} {manifest[k]}" for k in ("policy", "budget", "block", "weights")
                                          if k in manifest) or str(s["artifact"]),
            "threads": args.threads, "decode_tokens": args.decode_tokens, "rounds": args.rounds, "lengths": lengths,
            "flash_attn": args.flash_attn,
            "llama_cpp_build": json.loads(build_json.read_text()) if build_json.exists() else {},
            "wall_seconds": wall, "machine_shared": True, "interleaved_with": [m for m in models if m != s["model"]],
            "rows": summarize(s["raw"], lengths), "decode_profile": decode_profile if i == 0 else None,
            "runs": {k: {str(n): v for n, v in d.items()} for k, d in s["raw"].items()},
        })
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(sections[0] if len(sections) == 1 else {"sections": sections},
                                                   indent=1, default=str))
    text = "\n".join(markdown(s) for s in sections)
    if len(sections) > 1:
        text = (f"All {len(sections)} models below ran in one run, their rounds interleaved "
                f"({', '.join(models)}).\n\n") + text
    out.with_suffix(".md").write_text(text)
    for i, s in enumerate(sections):
        plot(s, out.with_suffix(".png") if i == 0 else out.with_name(f"{out.name}_{s['model']}.png"))
    console.print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
