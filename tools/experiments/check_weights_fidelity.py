"""Weights fidelity on SmolLM2: the q4 artifact's next-token distributions against the fp32
artifact and against llama.cpp running the same GGUF.

    python tools/experiments/check_weights_fidelity.py [--tokens 1000] [--fp32 build/art-keydiff]
                                           [--q4 build/art-keydiff-q4] [--threads 2] [--out docs/results]

Teacher forcing on the first ``--tokens`` tokens of `edgekv eval`'s fidelity text (seed 0:
CPython's pydoc topics, `edgekv.evaluation.tasks.build_fidelity`), so every position gets
logits: the native runtime gets the first token through ``prefill([t0])`` and each following
one through ``decode(t)``; llama.cpp (`llama_cpp.Llama`, ``logits_all=True``) evaluates the same
ids (no BOS added anywhere). ``--tokens`` may not exceed either artifact's budget N, so nothing
is evicted and the differences come from the weights and kernels only.

Three comparisons (reference → test): fp32 → q4, llama.cpp → q4 and fp32 → llama.cpp (llama.cpp's
own deviation: it quantises activations to 8 bits for its Q4_1 dot products). Per comparison:
top-1 agreement, mean / max KL(P_ref ‖ P_test) in nats (log-softmax in float64) and the largest
per-position max |logit difference| / max |reference logit|.

Writes weights_fidelity.json, weights_fidelity.md and weights_fidelity.png (per-position KL)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

MODEL = "smollm2-135m"
# (key, reference, test, label)
COMPARISONS = (("q4_vs_fp32", "fp32", "q4", "q4 vs fp32 (reference fp32)"),
               ("q4_vs_llama_cpp", "llama_cpp", "q4", "q4 vs llama.cpp (reference llama.cpp)"),
               ("llama_cpp_vs_fp32", "fp32", "llama_cpp", "llama.cpp vs fp32 (reference fp32)"))


def progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                    TimeElapsedColumn(), TimeRemainingColumn())


def git_commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if dirty else "")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def text_ids(n: int) -> list[int]:
    """The first ``n`` tokens of `edgekv eval`'s fidelity text (seed 0), model tokenizer."""
    from edgekv.evaluation.tasks import build_fidelity
    from edgekv.models import load_model

    tok = load_model(MODEL).tokenizer
    return build_fidelity(tok, n, seed=0, window=1).ids.tolist()


def run_artifact(path: Path, ids: list[int], threads: int, progress, label: str) -> tuple[np.ndarray, dict]:
    """Teacher-forced logits [n, V] (float32) from the native runtime: prefill([t0]), decode(t)."""
    from edgekv.runtime import native

    rt = native.NativeRuntime(path, threads=threads)
    if len(ids) > rt.budget:
        raise SystemExit(f"{path}: {len(ids)} tokens exceed the budget N = {rt.budget} (eviction would happen)")
    out = np.empty((len(ids), rt.vocab_size), dtype=np.float32)
    task = progress.add_task(label, total=len(ids))
    rt.reset()
    t0 = time.perf_counter()
    out[0] = rt.prefill([ids[0]])
    progress.advance(task)
    for i, t in enumerate(ids[1:], start=1):
        out[i] = rt.decode(t)
        progress.advance(task)
    seconds = time.perf_counter() - t0
    weights = (rt.manifest.weights if rt.manifest is not None else None) or {"format": "fp32"}
    info = {"path": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), "budget": rt.budget,
            "block": rt.block, "policy": rt.policy, "threads": rt.threads, "weights_format": weights.get("format"),
            "weights_tensors": weights.get("tensors"), "cache_lengths_after": sorted(set(rt.cache_lengths())),
            "seconds": seconds}
    rt.close()
    return out, info


def run_llama_cpp(gguf: Path, ids: list[int], threads: int, progress) -> tuple[np.ndarray, dict]:
    """Teacher-forced logits [n, V] from llama.cpp on the same GGUF (``logits_all``), same ids."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + 8, logits_all=True, n_threads=threads, verbose=False)
    task = progress.add_task("llama.cpp", total=len(ids))
    llm.reset()
    t0 = time.perf_counter()
    step = llm.n_batch
    for s in range(0, len(ids), step):  # what Llama.eval does internally, in n_batch chunks, shown as progress
        chunk = ids[s:s + step]
        llm.eval(chunk)
        progress.advance(task, len(chunk))
    seconds = time.perf_counter() - t0
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    cp = llm.context_params
    ggml_types = {getattr(llama_cpp, n): n[len("GGML_TYPE_"):] for n in dir(llama_cpp) if n.startswith("GGML_TYPE_")
                  and isinstance(getattr(llama_cpp, n), int)}
    info = {"llama_cpp_python": llama_cpp.__version__, "gguf": str(gguf), "n_ctx": llm.n_ctx(), "n_batch": llm.n_batch,
            "threads": threads, "kv_cache_type_k": ggml_types.get(int(cp.type_k), int(cp.type_k)),
            "kv_cache_type_v": ggml_types.get(int(cp.type_v), int(cp.type_v)), "bos_prepended": False,
            "seconds": seconds}
    del llm
    return out, info


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, test: np.ndarray, chunk: int = 128) -> dict:
    """Top-1 agreement, KL(P_ref ‖ P_test) per position (nats, float64), relative max |Δlogit|."""
    n = ref.shape[0]
    kl = np.empty(n)
    rel = np.empty(n)
    agree = np.empty(n, dtype=bool)
    for s in range(0, n, chunk):
        r, t = ref[s:s + chunk], test[s:s + chunk]
        lr, lt = log_softmax64(r), log_softmax64(t)
        kl[s:s + chunk] = (np.exp(lr) * (lr - lt)).sum(axis=-1)
        diff = np.abs(r.astype(np.float64) - t.astype(np.float64)).max(axis=-1)
        rel[s:s + chunk] = diff / np.abs(r.astype(np.float64)).max(axis=-1)
        agree[s:s + chunk] = r.argmax(axis=-1) == t.argmax(axis=-1)
    kl = np.maximum(kl, 0.0)  # float64 rounding can leave -1e-17 where the distributions are equal
    return {"positions": n, "top1_agreement_pct": 100.0 * agree.mean(), "top1_disagreements": int((~agree).sum()),
            "disagreement_positions": np.flatnonzero(~agree).tolist(), "kl_mean": float(kl.mean()),
            "kl_median": float(np.median(kl)), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "kl_max_position": int(kl.argmax()), "rel_max_abs_logit_diff": float(rel.max()),
            "rel_max_abs_logit_diff_position": int(rel.argmax()), "per_position_kl": [float(f"{v:.4g}") for v in kl]}


def write_markdown(data: dict, path: Path) -> None:
    n = data["tokens"]
    a = data["runs"]
    lines = ["# Weights fidelity: q4 against fp32 and llama.cpp (SmolLM2-135M)", "",
             f"Regenerate: `{data['command']}`", "",
             f"Teacher forcing on the first {n} tokens of `edgekv eval`'s fidelity text (seed 0, the model's tokenizer, "
             "no BOS): every position's next-token logits from the fp32 artifact "
             f"(`{a['fp32']['path']}`), the q4 artifact (`{a['q4']['path']}`, weights "
             f"{', '.join(f'{v} {k}' for k, v in (a['q4']['weights_tensors'] or {}).items())}) — both {a['q4']['policy']}, "
             f"N = {a['q4']['budget']}, B = {a['q4']['block']}, run by the native runtime (prefill of the first token, "
             f"then one decode per token) — and llama.cpp (llama-cpp-python {a['llama_cpp']['llama_cpp_python']}, "
             f"`logits_all`, KV cache {a['llama_cpp']['kv_cache_type_k']}/{a['llama_cpp']['kv_cache_type_v']}) on the "
             f"same GGUF (`{Path(a['llama_cpp']['gguf']).name}`), fed the same ids.", "",
             f"{n} tokens ≤ N = {a['q4']['budget']}: no eviction happens (cache lengths after the run: fp32 "
             f"{a['fp32']['cache_lengths_after']}, q4 {a['q4']['cache_lengths_after']}), so the differences come from "
             "the weights and kernels only.", "",
             "KL is KL(P_ref ‖ P_test) in nats, log-softmax in float64; the logit column is the largest, over "
             "positions, of max |logit_test − logit_ref| / max |logit_ref| at that position.", "",
             "| comparison | positions | top-1 agreement | mean KL | median KL | p99 KL | max KL | max rel. logit diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, _ref, _test, label in COMPARISONS:
        c = data["comparisons"][key]
        lines.append(f"| {label} | {c['positions']} | {c['top1_agreement_pct']:.2f} % ({c['top1_disagreements']} differ) "
                     f"| {c['kl_mean']:.3g} | {c['kl_median']:.3g} | {c['kl_p99']:.3g} | {c['kl_max']:.3g} "
                     f"(pos {c['kl_max_position']}) | {c['rel_max_abs_logit_diff']:.3g} |")
    lines += ["", "The q4 artifact's Q4_1 blocks (and the Q8_0 embedding / tied LM head) are the GGUF's bytes, and the "
              "fp32 artifact holds the same GGUF dequantised, so q4 vs fp32 differs by summation order (and the "
              "dequantise-as-you-read kernels) only. llama.cpp quantises the activations to 8 bits (Q8_1) for its "
              "Q4_1 dot products (Q8_0 for the head)"
              + (", which is why the llama.cpp vs fp32 row is the larger." if data["comparisons"]["llama_cpp_vs_fp32"]["kl_mean"]
                 > data["comparisons"]["q4_vs_fp32"]["kl_mean"] else "; here it is not the larger: look into it."), "",
              f"Time (teacher forcing, {data['threads']} threads; not a benchmark, see the load average): fp32 {a['fp32']['seconds']:.1f} s, q4 "
              f"{a['q4']['seconds']:.1f} s, llama.cpp {a['llama_cpp']['seconds']:.1f} s.", "",
              f"Commit `{data['git_commit']}`, CPU: {data['cpu']}, load average before the run: "
              f"{', '.join(f'{x:.2f}' for x in data['load_before'])}.", "",
              "![per-position KL](weights_fidelity.png)"]
    path.write_text("\n".join(lines) + "\n")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    floor = 1e-16  # a log axis cannot show 0: exact agreement is drawn there
    for key, label, colour in (("q4_vs_fp32", "q4 vs fp32", "tab:blue"),
                               ("q4_vs_llama_cpp", "q4 vs llama.cpp", "tab:orange")):
        kl = np.maximum(np.asarray(data["comparisons"][key]["per_position_kl"]), floor)
        ax.plot(np.arange(kl.size), kl, lw=0.7, color=colour, label=f"{label} (mean {kl.mean():.2g})")
    ax.set_yscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("KL(P_ref ‖ P_q4), nats")
    ax.set_title(f"SmolLM2-135M, teacher forcing on {data['tokens']} tokens of fidelity text")
    ax.legend(loc="center right", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="teacher-forced tokens (at most the artifacts' budget)")
    ap.add_argument("--fp32", type=Path, default=ROOT / "build" / "art-keydiff")
    ap.add_argument("--q4", type=Path, default=ROOT / "build" / "art-keydiff-q4")
    ap.add_argument("--threads", type=int, default=2, help="threads for the native runtime and llama.cpp")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args(argv)

    from edgekv.artifact import Manifest
    from edgekv.evaluation.report import provenance
    from edgekv.models import sources

    if args.tokens < 2:
        ap.error("--tokens must be at least 2")
    for p in (args.fp32, args.q4):
        if not (p / "program.ekv").is_file():
            ap.error(f"{p}: no artifact (build it: edgekv compile {MODEL} --budget 1k --block 128 --policy keydiff "
                     f"--weights {'q4' if p == args.q4 else 'fp32'} -o {p})")
        budget = Manifest.read(p).budget
        if args.tokens > budget:
            ap.error(f"--tokens {args.tokens} exceeds {p}'s budget N = {budget}: eviction would mix into the comparison")

    # before the long work: the commit that ran
    origin = provenance([sys.executable, sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    load_before = os.getloadavg()
    ids = text_ids(args.tokens)
    gguf = sources.resolve(MODEL).path
    logits, runs = {}, {}
    with progress_bar() as progress:
        logits["fp32"], runs["fp32"] = run_artifact(args.fp32, ids, args.threads, progress, "fp32 artifact")
        logits["q4"], runs["q4"] = run_artifact(args.q4, ids, args.threads, progress, "q4 artifact")
        logits["llama_cpp"], runs["llama_cpp"] = run_llama_cpp(gguf, ids, args.threads, progress)
    for k, v in logits.items():
        if not np.isfinite(v).all():
            raise SystemExit(f"{k}: non-finite logits")
    comps = {key: {"reference": ref, "test": test, **compare(logits[ref], logits[test])}
             for key, ref, test, _label in COMPARISONS}
    cmd = "python tools/experiments/check_weights_fidelity.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    data = {"model": MODEL, "tokens": args.tokens, "text": "edgekv eval fidelity text, seed 0 (build_fidelity)",
            "ids_head": ids[:16], "threads": args.threads, "command": cmd, "git_commit": git_commit(),
            "cpu": cpu_name(), "load_before": list(load_before), "runs": runs, "comparisons": comps,
            "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights_fidelity.json").write_text(json.dumps(data, indent=1) + "\n")
    write_markdown(data, args.out / "weights_fidelity.md")
    plot(data, args.out / "weights_fidelity.png")
    for key, _ref, _test, label in COMPARISONS:
        c = comps[key]
        print(f"{label:40s} top-1 {c['top1_agreement_pct']:6.2f} %  KL mean {c['kl_mean']:.3g} max {c['kl_max']:.3g}  "
              f"rel logit {c['rel_max_abs_logit_diff']:.3g}")
    print(f"wrote {args.out / 'weights_fidelity.json'}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
