"""Where a decode token's time goes: per-kernel wall time of the compiled ``decode`` function of an
artifact, after a prompt of --depth tokens, through TVM's VM instrument (a timer around every
kernel call; the host runtime, the same kernels as edgekv-run).

    python -m tools.bench.profile_decode --artifact DIR [--depth 1024] [--tokens 16] [--threads 2] [--json FILE]

With --clock cpu --threads 1 the figures are CPU time, which a busy machine disturbs least.
Prints the kernels by share (grouped: quantised GEMV, tied LM head, attention, eviction,
elementwise) and the token's total with and without the instrument."""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def kind_of(name: str) -> str:
    n = name.lower()
    if "gemv_nt" in n or "nt_q8" in n or "lm_head" in n:
        return "LM head (tied, Q8_0 NT GEMV)"
    if "gemv" in n or "quant" in n or "matmul" in n or "dense" in n:
        return "linear GEMV"
    if "attn" in n or "attention" in n or "softmax" in n:
        return "attention"
    if "score" in n or "evict" in n or "select" in n or "compact" in n or "keydiff" in n:
        return "eviction"
    if "take" in n:
        return "embedding gather"
    return "elementwise/norm/RoPE"


def profile(artifact: Path, depth: int, tokens: int, threads: int, clock=time.perf_counter) -> dict:
    import tvm

    from edgekv.runtime import HostRuntime
    from edgekv.threads import apply_threads

    apply_threads(threads)
    rt = HostRuntime(artifact)
    rng = np.random.default_rng(0)
    logits = rt.prefill(rng.integers(100, 20000, depth))
    tok = int(np.argmax(logits))
    for _ in range(3):  # warm-up
        tok = int(np.argmax(rt.decode(tok)))
    plain = []
    for _ in range(tokens):
        t0 = clock()
        tok = int(np.argmax(rt.decode(tok)))
        plain.append(clock() - t0)
    per: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, int] = collections.defaultdict(int)
    totals = []
    for _ in range(tokens):
        agg: dict[str, float] = collections.defaultdict(float)
        start: dict[str, float] = {}

        def instr(func, name, before, ret, *args):
            if before:
                start[name] = clock()
            else:
                agg[name] += clock() - start.pop(name)
                calls[name] += 1
            return 0

        rt.vm.set_instrument(instr)
        t0 = clock()
        tok = int(np.argmax(rt.decode(tok)))
        totals.append(clock() - t0)
        rt.vm.set_instrument(None)
        for k, v in agg.items():
            per[k].append(v)
    med = {k: statistics.median(v) for k, v in per.items()}
    kernels = sum(med.values())
    kinds: dict[str, float] = collections.defaultdict(float)
    for k, v in med.items():
        kinds[kind_of(k)] += v
    return {
        "artifact": str(artifact), "clock": clock.__name__, "depth": depth, "tokens": tokens, "threads": threads,
        "token_seconds": statistics.median(plain), "token_seconds_instrumented": statistics.median(totals),
        "kernels_seconds": kernels, "vm_overhead_seconds": statistics.median(totals) - kernels,
        "by_kind": {k: {"seconds": v, "share": v / kernels} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels": [{"name": k, "seconds": v, "calls_per_token": calls[k] // (tokens), "kind": kind_of(k)}
                    for k, v in sorted(med.items(), key=lambda kv: -kv[1])],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or the process's CPU time (with --threads 1: each kernel's own work, not the "
                         "time other processes took the core on a shared machine)")
    args = ap.parse_args(argv)
    if not (args.artifact / "program.ekv").is_file():
        raise SystemExit(f"error: --artifact {args.artifact} holds no program.ekv (`edgekv compile ... -o DIR`)")
    from edgekv.evaluation.report import provenance

    meta = provenance([sys.executable, *sys.argv])
    r = profile(args.artifact, args.depth, args.tokens, args.threads,
                time.process_time if args.clock == "cpu" else time.perf_counter)
    print(f"decode token at depth {r['depth']}: {r['token_seconds'] * 1e3:.2f} ms ({1 / r['token_seconds']:.1f} tok/s); "
          f"instrumented {r['token_seconds_instrumented'] * 1e3:.2f} ms, kernels {r['kernels_seconds'] * 1e3:.2f} ms")
    for k, v in r["by_kind"].items():
        print(f"  {k:32s} {v['seconds'] * 1e3:7.3f} ms  {v['share'] * 100:5.1f} %")
    for k in r["kernels"][:20]:
        print(f"    {k['name'][:60]:60s} {k['seconds'] * 1e3:7.3f} ms  x{k['calls_per_token']}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, **r}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
