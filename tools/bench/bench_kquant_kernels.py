"""Microbenchmark of the K-quant CPU kernels against Q4_1 on the same shapes, and against the
K-quant kernels of another commit (``--baseline-ref``), interleaved in one run.

Shapes: Qwen2.5-1.5B's gate/up (K = 1536, N = 8960), q/o (K = 1536, N = 1536) and down (K = 8960, N = 1536) projections;
GEMV (decode, M = 1, weights cold: copies cycled past the last-level cache) and GEMM (prefill,
M = 128). Panel width NR = 64, as the compiled Qwen2.5 artifact stores them (``q4kp64``).

    python tools/bench/bench_kquant_kernels.py --baseline-ref main --threads 2   # docs/results/kquant_kernels_t2.{json,md}
    python tools/bench/bench_kquant_kernels.py --baseline-ref main --threads 1 --cpu-time   # ..._t1_cpu.{json,md}

On a shared machine, ``--threads 1 --cpu-time`` (the process's CPU seconds) is the figure that
other jobs disturb least; the wall-clock figures at 2 threads are the ones the runtime sees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.kernel_timing import add_timing_args, clock, kernels_at, start_provenance, time_cold, time_warm  # noqa: E402

SHAPES = [(1536, 8960), (1536, 1536), (8960, 1536)]
NR = 64


def same_text(same) -> str:
    if same is None:
        return ""
    return ", ".join("equal bits" if same[f"{k}_equal_bits"] else f"{same[f'{k}_max_rel_diff']:.1e} rel." for k in ("gemv", "gemm"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, threads=2)
    ap.add_argument("--mcpu", default="znver3")
    ap.add_argument("--rows", type=int, default=128, help="M of the prefill GEMM")
    ap.add_argument("--baseline-ref", default=None, help="git ref whose kquant_dense.py is timed too")
    args = ap.parse_args(argv)
    prov = start_provenance(args)
    timer = clock(args)

    import tvm

    from edgekv.compiler import kquant_formats as kq
    from edgekv.compiler import quant_formats as qf
    from edgekv.compiler.kernels import kquant_dense
    from edgekv.compiler.kernels.quant_dense import build_quant_gemm_kernel, build_quant_gemv_kernel
    from tools.bench.bench_weight_kernels import build, random_block_arrays, weight_copies

    tgt = tvm.target.Target({"kind": "llvm", "mcpu": args.mcpu, "num-cores": args.threads})
    variants = [("Q4_1", None), ("Q4_K", kquant_dense), ("Q6_K", kquant_dense)]
    if args.baseline_ref:
        base = kernels_at(args.baseline_ref, ("kquant_dense",))["kquant_dense"]
        variants[1:1] = [("Q4_K@" + args.baseline_ref, base)]
        variants.append(("Q6_K@" + args.baseline_ref, base))
    rng = np.random.default_rng(0)
    M = args.rows
    rows = []
    for K, N in SHAPES:
        x1 = tvm.runtime.tensor(rng.standard_normal((1, 1, K)).astype(np.float32))
        xm = tvm.runtime.tensor(rng.standard_normal((1, M, K)).astype(np.float32))
        o1 = tvm.runtime.tensor(np.zeros((1, 1, N), np.float32))
        om = tvm.runtime.tensor(np.zeros((1, M, N), np.float32))
        arrays = {g: random_block_arrays(g, K, N, NR, rng) for g in ("Q4_1", "Q4_K", "Q6_K")}
        built = {}
        for label, mod in variants:
            ggml = label.split("@")[0]
            if mod is None:
                fmt = qf.Q4_1
                built[label] = (build(build_quant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, NR), tgt),
                                build(build_quant_gemm_kernel((1, M, K), (1, M, N), fmt, K, N, NR), tgt))
            else:
                fmt = kq.KFORMATS[ggml]
                built[label] = (build(mod.build_kquant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, NR), tgt),
                                build(mod.build_kquant_gemm_kernel((1, M, K), (1, M, N), fmt, K, N, NR), tgt))
        copies = {g: weight_copies(a) for g, a in arrays.items()}
        times = {label: {"gemv": [], "gemv_warm": [], "gemm": []} for label, _ in variants}
        for _ in range(args.reps):  # interleaved: each round times every variant once
            for label, _ in variants:
                gemv, gemm = built[label]
                c = copies[label.split("@")[0]]
                times[label]["gemv"].append(time_cold(gemv, c, x1, o1, timer))
                times[label]["gemv_warm"].append(time_warm(gemv, [x1, *c[0], o1], timer))
                times[label]["gemm"].append(time_warm(gemm, [xm, *c[0], om], timer))
        outputs = {}
        for label, _ in variants:  # the results, to compare each kernel with its baseline's
            gemv, gemm = built[label]
            c = copies[label.split("@")[0]][0]
            gemv(x1, *c, o1)
            gemm(xm, *c, om)
            outputs[label] = (o1.numpy().copy(), om.numpy().copy())
        for label, _ in variants:
            ggml = label.split("@")[0]
            base = outputs.get(f"{ggml}@{args.baseline_ref}") if args.baseline_ref and "@" not in label else None
            same = None if base is None else {
                "gemv_equal_bits": bool(np.array_equal(base[0].view(np.uint32), outputs[label][0].view(np.uint32))),
                "gemm_equal_bits": bool(np.array_equal(base[1].view(np.uint32), outputs[label][1].view(np.uint32))),
                "gemv_max_rel_diff": float(np.abs(base[0] - outputs[label][0]).max() / np.abs(base[0]).max()),
                "gemm_max_rel_diff": float(np.abs(base[1] - outputs[label][1]).max() / np.abs(base[1]).max())}
            nbytes = sum(a.nbytes for a in arrays[ggml])
            tv, tw, tm = (min(times[label][k]) for k in ("gemv", "gemv_warm", "gemm"))
            rows.append({"K": K, "N": N, "NR": NR, "kernel": label, "weight_bytes": nbytes,
                         "gemv_us": tv * 1e6, "gemv_GBps": nbytes / tv / 1e9, "gemv_warm_us": tw * 1e6,
                         "gemm_ms": tm * 1e3, "gemm_GFLOPs": 2 * M * K * N / tm / 1e9, "vs_baseline": same})
            print(rows[-1], flush=True)
        del copies
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python tools/bench/bench_kquant_kernels.py" + (f" --baseline-ref {args.baseline_ref}" if args.baseline_ref else "")
    command += f" --threads {args.threads}" + (" --cpu-time" if args.cpu_time else "")
    note = ("all variants interleaved in one run; best of the rounds; the machine was shared "
            "(other helpers' jobs at nice 19 and the lead's benchmarks may have run)")
    if args.cpu_time:
        note = "times are CPU seconds of the process (not wall): " + note
    result = {"threads": args.threads, "target": str(tgt), "rows_M": M, "commit": commit, "command": command,
              "note": note, "rows": rows, **prov}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"kquant_kernels_t{args.threads}" + ("_cpu" if args.cpu_time else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    lines = ["# K-quant kernels against Q4_1 (Qwen2.5-1.5B shapes, NR = 64)", "",
             f"Regenerate: `{command}`. Target `{tgt}`, {args.threads} threads, commit {commit}. {note}.", "",
             f"| K × N | kernel | GEMV µs (cold) | GEMV GB/s | GEMV µs (warm, in cache) | GEMM M = {M} ms | GEMM GFLOP/s | "
             "results vs the baseline commit's kernel (GEMV, GEMM) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['K']} × {r['N']} | {r['kernel']} | {r['gemv_us']:.0f} | {r['gemv_GBps']:.1f} | "
                     f"{r['gemv_warm_us']:.0f} | {r['gemm_ms']:.2f} | {r['gemm_GFLOPs']:.1f} | {same_text(r['vs_baseline'])} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
