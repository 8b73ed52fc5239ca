"""Run every (system, prompt length, repetition) in its own process and collect medians."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from rich.progress import Progress

from .systems import NEEDS


@dataclass
class BenchConfig:
    model: str = "smollm2-135m"
    systems: list[str] = field(default_factory=lambda: ["edgekv-eager", "edgekv-compiled", "hf", "kvpress", "llamacpp"])
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    memory_only_lengths: list[int] = field(default_factory=lambda: [16384, 32768])
    budget: int = 1024
    block: int = 128
    policy: str = "keydiff"
    decode_tokens: int = 32
    repeats: int = 3
    threads: int = 1  # the CLI passes edgekv.threads.choose_threads(--threads)
    artifact: str | None = None
    onnx: str | None = None  # past_key_values-form ONNX file for the onnxruntime peer
    fp32_artifact: str | None = None  # the same build with fp32 weights (edgekv-native-fp32)
    question_tokens: int = 0  # the prompt's last Q tokens as its question (question-aware prefill)
    timeout: int = 900


def installed(system: str) -> bool:
    module = NEEDS.get(system)
    if system in ("edgekv-native", "edgekv-native-fp32"):
        from ..runtime import native

        return native.cli_path() is not None
    if system == "llamacpp":  # llama.cpp's own llama-bench, built by tools/bench/build_llama_cpp.py
        from .llama_cpp import find_binary

        try:
            return find_binary("llama-bench").is_file()
        except RuntimeError:
            return False
    return module is None or importlib.util.find_spec(module) is not None


def run_once(cfg: BenchConfig, system: str, ids: list[int], decode_tokens: int) -> dict:
    spec = {"system": system, "ids": ids, "model": cfg.model, "budget": cfg.budget, "block": cfg.block,
            "policy": cfg.policy, "decode_tokens": decode_tokens, "threads": cfg.threads, "artifact": cfg.artifact,
            "onnx": cfg.onnx, "fp32_artifact": cfg.fp32_artifact, "question_tokens": cfg.question_tokens}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([sys.executable, "-m", "edgekv.bench.worker", fh.name], capture_output=True, text=True,
                              env=env, timeout=cfg.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {cfg.timeout} s"}
    finally:
        os.unlink(fh.name)
    for line in proc.stdout.splitlines():
        if line.startswith("EDGEKV_BENCH "):
            return json.loads(line[len("EDGEKV_BENCH "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no runs"}
    out = {"repeats": len(ok)}
    for key in ("prefill_tok_s", "decode_tok_s", "peak_rss", "own_rss", "prefill_seconds", "decode_seconds",
                "startup_seconds", "plan_bytes"):
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def run_bench(cfg: BenchConfig, prompt_ids_for, console=None) -> dict:
    """prompt_ids_for(length) → list of token ids. Returns the results dictionary."""
    plan = []
    skipped = {}
    for system in cfg.systems:
        if not installed(system):
            skipped[system] = ("not built (llama-bench: `python tools/bench/build_llama_cpp.py` builds it)"
                               if system == "llamacpp" else
                               f"not installed ({NEEDS[system]}; the `bench` extra installs the peers, "
                               "`pip install -e .` builds edgekv-run)")
            continue
        if system in ("edgekv-compiled", "edgekv-native") and not cfg.artifact:
            skipped[system] = "no artifact given (--artifact DIR from `edgekv compile`)"
            continue
        if system == "edgekv-native-fp32" and not cfg.fp32_artifact:
            skipped[system] = "no fp32 artifact given (--fp32-artifact DIR from `edgekv compile --weights fp32`)"
            continue
        if system == "onnxruntime" and not cfg.onnx:
            skipped[system] = "no ONNX file given (--onnx FILE from `edgekv export-onnx --form past`)"
            continue
        for length in cfg.lengths:
            plan.append((system, length, cfg.decode_tokens))
        if system.startswith("edgekv"):
            for length in cfg.memory_only_lengths:
                plan.append((system, length, 0))
    results: dict = {"config": cfg.__dict__, "skipped": skipped, "runs": []}
    # the systems side by side at each length, and the repeats as rounds over all points
    # (A B C at 1K, A B C at 4K, ...; then again), so that a change in the machine's load during
    # the run falls on every system alike, not on whichever ran then
    plan.sort(key=lambda p: (p[2] == 0, p[1]))
    by_point: dict = {}
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("benchmark", total=len(plan) * cfg.repeats)
        for rep in range(cfg.repeats):
            for system, length, decode in plan:
                ids = prompt_ids_for(length)
                progress.update(task, description=f"{system} @ {length} ({rep + 1}/{cfg.repeats})")
                if console is not None and not console.is_terminal:  # no live bar: one line per run
                    console.print(f"bench: {system} @ {length} tokens ({rep + 1}/{cfg.repeats})", highlight=False)
                by_point.setdefault((system, length, decode), []).append(run_once(cfg, system, ids, decode))
                progress.advance(task)
    for (system, length, decode), runs in by_point.items():
        results["runs"].append({"system": system, "length": length, "memory_only": decode == 0,
                                "raw": runs, **summarize(runs)})
    return results
