"""Per-kernel speed of the weight formats on SmolLM2's shapes, against the machine's memory bandwidth.

Decode reads every weight once per token, so a GEMV's speed is its weight bytes over the time it
takes: this tool times the q4 (Q4_1), q8 (Q8_0) and fp32 GEMVs (and the prefill GEMMs) that an
artifact of SmolLM2 calls, each with its weights cold (cycling through enough copies to exceed
the last-level cache, as in the model, where 30 layers stream past), and reports GB/s of weight
bytes read next to the machine's read bandwidth.

Bandwidth is measured with a streaming-read kernel built by the same TVM/LLVM (a parallel,
vectorised sum over a 1 GiB fp32 array on the same threads; best of 5 runs).

    python tools/bench/bench_weight_kernels.py            # writes docs/results/weight_kernels.{json,md,png}

``--kquant`` times the formats a q4 artifact keeps from a GGUF (Q4_K, Q6_K, Q5_0, Q8_0) against
Q4_1 on Qwen2.5-1.5B's shapes, interleaved in one run (random valid blocks; the speed does not
depend on the values):

    python tools/bench/bench_weight_kernels.py --kquant   # writes docs/results/weight_kernels_kquant.{json,md}
"""

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

REPO = Path(__file__).resolve().parents[2]
# SmolLM2-135M: (name, K, N, calls per token)
SHAPES = [("q/o proj", 576, 576, 60), ("k/v proj", 576, 192, 60), ("gate/up proj", 576, 1536, 60),
          ("down proj", 1536, 576, 30)]
VOCAB = 49152
COLD_BYTES = 256 << 20  # weight copies cycled per kernel: well past any last-level cache here


def target(threads: int):
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": str(tvm.target.codegen.llvm_get_system_cpu()),
                              "num-cores": threads})


def build(func, tgt):
    import tvm

    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tgt)["main"]


def bandwidth(tgt, threads: int) -> float:
    """GB/s of a parallel vectorised read of 1 GiB."""
    import tvm
    from tvm.script import tirx as T

    n = 1 << 28
    P, L = threads * 8, 16
    chunk = n // P

    @T.prim_func(private=True, s_tir=True)
    def stream_sum(a: T.handle, o: T.handle):
        T.func_attr({"tirx.noalias": True})
        A = T.match_buffer(a, (n,), "float32")
        O = T.match_buffer(o, (P, L), "float32")
        for p in T.parallel(P):
            with T.sblock("part"):
                acc = T.sblock_alloc_buffer((L,), "float32", scope="local")
                for l in T.vectorized(L):
                    acc[l] = T.float32(0)
                for i in T.serial(chunk // L):
                    for l in T.vectorized(L):
                        acc[l] = acc[l] + A[p * chunk + i * L + l]
                for l in T.vectorized(L):
                    O[p, l] = acc[l]

    f = build(stream_sum, tgt)
    a = tvm.runtime.tensor(np.ones(n, np.float32))
    o = tvm.runtime.tensor(np.zeros((P, L), np.float32))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(a, o)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best / 1e9


def time_cold(f, copies: list[list], x, out, reps: int = 3) -> float:
    """Median seconds per call, cycling through the weight copies (each cold when its turn comes)."""
    for args in copies[:2]:
        f(x, *args, out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for args in copies:
            f(x, *args, out)
        times.append((time.perf_counter() - t0) / len(copies))
    return float(np.median(times))


def weight_copies(arrays: list[np.ndarray]) -> list[list]:
    import tvm

    size = sum(a.nbytes for a in arrays)
    count = max(4, COLD_BYTES // size)
    return [[tvm.runtime.tensor(a.copy()) for a in arrays] for _ in range(count)]


# Qwen2.5-Coder-1.5B: (name, K, N, calls per token as Q4_K, as Q6_K) — its Q4_K_M file holds
# attn_v and ffn_down as Q6_K in 14 of the 28 layers, everything else as Q4_K
QWEN_SHAPES = [("q/o proj", 1536, 1536, 56, 0), ("k/v proj", 1536, 256, 42, 14), ("gate/up proj", 1536, 8960, 56, 0),
               ("down proj", 8960, 1536, 14, 14)]


def random_block_arrays(ggml: str, K: int, N: int, nr: int, rng) -> list[np.ndarray]:
    """Panel arrays of random valid blocks (fp16 scales finite) in GGUF type ``ggml``."""
    import gguf

    from edgekv.compiler import kquant_formats as kq
    from edgekv.compiler import quant_formats as qf

    qtype = getattr(gguf.GGMLQuantizationType, ggml)
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // bs * ts), dtype=np.uint8)
    blk = raw.reshape(-1, ts)
    for o in {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2)}[ggml]:
        blk[:, o:o + 2] = (rng.uniform(-1, 1, (blk.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if ggml in kq.KFORMATS:
        return kq.kpanel_arrays(kq.kblocks_from_ggml(raw, kq.KFORMATS[ggml], K), nr)
    fmt = {"Q4_1": qf.Q4_1, "Q8_0": qf.Q8_0}[ggml]
    return qf.panel_arrays(qf.blocks_from_ggml(raw, fmt, K, "gguf"), nr)


def kquant_main(args) -> int:
    """Q4_K / Q6_K / Q5_0 / Q8_0 against Q4_1 on Qwen2.5-1.5B's linear shapes (one run, interleaved)."""
    import tvm
    from rich.progress import track

    from edgekv.compiler import kquant_formats as kq
    from edgekv.compiler import quant_formats as qf
    from edgekv.compiler.kernels.dense import dense_tiles
    from edgekv.compiler.kernels.kquant_dense import build_kquant_gemm_kernel, build_kquant_gemv_kernel
    from edgekv.compiler.kernels.quant_dense import build_quant_gemm_kernel, build_quant_gemv_kernel
    from edgekv.evaluation.report import provenance

    origin = provenance([sys.executable, *sys.argv])
    tgt = target(args.threads)
    bw = bandwidth(tgt, args.threads)
    rng = np.random.default_rng(0)
    M = args.prefill_rows
    formats = ("Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q8_0")
    rows = []
    for name, K, N, calls_q4k, calls_q6k in track(QWEN_SHAPES, description="kernels"):
        nr = dense_tiles(M, K, N, args.threads)[1]
        x1 = tvm.runtime.tensor(rng.standard_normal((1, 1, K)).astype(np.float32))
        xm = tvm.runtime.tensor(rng.standard_normal((1, M, K)).astype(np.float32))
        o1 = tvm.runtime.tensor(np.zeros((1, 1, N), np.float32))
        om = tvm.runtime.tensor(np.zeros((1, M, N), np.float32))
        for ggml in formats:
            arrays = random_block_arrays(ggml, K, N, nr, rng)
            if ggml in kq.KFORMATS:
                fmt = kq.KFORMATS[ggml]
                gemv = build(build_kquant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, nr), tgt)
                gemm = build(build_kquant_gemm_kernel((1, M, K), (1, M, N), fmt, K, N, nr), tgt)
            else:
                fmt = {"Q4_1": qf.Q4_1, "Q8_0": qf.Q8_0}[ggml]
                gemv = build(build_quant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, nr), tgt)
                gemm = build(build_quant_gemm_kernel((1, M, K), (1, M, N), fmt, K, N, nr), tgt)
            copies = weight_copies(arrays)
            nbytes = sum(a.nbytes for a in arrays)
            t1 = time_cold(gemv, copies, x1, o1)
            tm = time_cold(gemm, copies[:4], xm, om)
            rows.append({"kernel": name, "K": K, "N": N, "NR": nr, "weights": ggml, "weight_bytes": nbytes,
                         "bytes_per_weight": nbytes / (K * N), "calls_q4k": calls_q4k, "calls_q6k": calls_q6k,
                         "gemv_us": t1 * 1e6, "gemv_GBps": nbytes / t1 / 1e9,
                         "gemm_ms": tm * 1e3, "gemm_GFLOPs": 2 * M * K * N / tm / 1e9})
            del copies
    # per token, the linear layers (the LM head apart): the file's own mix against all-Q4_1
    def per_token(pick):
        us = nbytes = 0.0
        for name, *_ in QWEN_SHAPES:
            for ggml, calls in pick(name):
                r = next(r for r in rows if r["kernel"] == name and r["weights"] == ggml)
                us += r["gemv_us"] * calls
                nbytes += r["weight_bytes"] * calls
        return {"gemv_ms_per_token": us / 1e3, "weight_MB_per_token": nbytes / 1e6, "GBps": nbytes / us / 1e3}

    calls = {n: (a, b) for n, _, _, a, b in QWEN_SHAPES}
    totals = {"Q4_K_M as kept (Q4_K + Q6_K)": per_token(lambda n: [("Q4_K", calls[n][0]), ("Q6_K", calls[n][1])]),
              "all Q4_1 (requantised, before)": per_token(lambda n: [("Q4_1", sum(calls[n]))])}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    command = "python tools/bench/bench_weight_kernels.py --kquant"
    result = {"bandwidth_GBps": bw, "threads": args.threads, "prefill_rows": M, "rows": rows, "per_token": totals,
              "cpu": cpu, "command": command, "provenance": origin,
              "note": "formats interleaved per shape in one run; the machine may have been shared (other jobs running)"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_kernels_kquant.json").write_text(json.dumps(result, indent=2))
    lines = ["# GGUF formats kept by a q4 artifact, against Q4_1, on Qwen2.5-1.5B's shapes", "",
             f"Regenerate: `{command}`. {cpu}, {args.threads} threads. {result['note']}.", "",
             f"Memory read bandwidth: **{bw:.1f} GB/s**. Weights read cold (copies cycled past the last-level cache).", "",
             f"| kernel | K × N | weights | bytes/weight | GEMV µs | GEMV GB/s | GEMV weights/ns | GEMM (M = {M}) ms | GEMM GFLOP/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['K']} × {r['N']} | {r['weights']} | {r['bytes_per_weight']:.4f} | "
                     f"{r['gemv_us']:.0f} | {r['gemv_GBps']:.1f} | {r['K'] * r['N'] / r['gemv_us'] / 1e3:.2f} | "
                     f"{r['gemm_ms']:.1f} | {r['gemm_GFLOPs']:.0f} |")
    lines += ["", "Per decode token, the 196 linear layers (LM head apart):", "",
              "| weights | weight MB read | GEMV ms | GB/s |", "|---|---:|---:|---:|"]
    for k, t in totals.items():
        lines.append(f"| {k} | {t['weight_MB_per_token']:.1f} | {t['gemv_ms_per_token']:.2f} | {t['GBps']:.1f} |")
    (args.out / "weight_kernels_kquant.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prefill-rows", type=int, default=128)
    ap.add_argument("--kquant", action="store_true", help="Q4_K/Q6_K/Q5_0/Q8_0 against Q4_1 on Qwen2.5-1.5B's shapes")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    if args.kquant:
        return kquant_main(args)
    import tvm

    from edgekv.compiler import quant_formats as qf
    from edgekv.compiler.kernels.dense import build_dense_kernel, build_packed_gemv_kernel, dense_tiles, pack_weight
    from edgekv.compiler.kernels.quant_dense import (build_q8_gemv_nt_kernel, build_quant_gemm_kernel,
                                                     build_quant_gemv_kernel)
    from rich.progress import track

    from edgekv.evaluation.report import provenance

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    tgt = target(args.threads)
    bw = bandwidth(tgt, args.threads)
    rng = np.random.default_rng(0)
    M = args.prefill_rows
    rows = []
    for name, K, N, calls in track(SHAPES, description="kernels"):
        nr = dense_tiles(M, K, N, args.threads)[1]
        w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
        x1 = tvm.runtime.tensor(rng.standard_normal((1, 1, K)).astype(np.float32))
        xm = tvm.runtime.tensor(rng.standard_normal((1, M, K)).astype(np.float32))
        o1 = tvm.runtime.tensor(np.zeros((1, 1, N), np.float32))
        om = tvm.runtime.tensor(np.zeros((1, M, N), np.float32))
        for fmt_name in ("fp32", "q8", "q4"):
            if fmt_name == "fp32":
                arrays = [pack_weight(np.ascontiguousarray(w.T), nr)]
                gemv = build(build_packed_gemv_kernel((1, 1, K), (K, N), (1, 1, N), nr), tgt)
                gemm = build(build_dense_kernel((1, M, K), (K, N), (1, M, N), args.threads, packed_nr=nr), tgt)
            else:
                fmt = qf.LINEAR_FORMAT[fmt_name]
                arrays = qf.panel_arrays(qf.quantize(w, fmt), nr)
                gemv = build(build_quant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, nr), tgt)
                gemm = build(build_quant_gemm_kernel((1, M, K), (1, M, N), fmt, K, N, nr), tgt)
            copies = weight_copies(arrays)
            nbytes = sum(a.nbytes for a in arrays)
            t1 = time_cold(gemv, copies, x1, o1)
            tm = time_cold(gemm, copies, xm, om)
            rows.append({"kernel": name, "K": K, "N": N, "NR": nr, "weights": fmt_name, "weight_bytes": nbytes,
                         "calls_per_token": calls, "gemv_us": t1 * 1e6, "gemv_GBps": nbytes / t1 / 1e9,
                         "gemm_ms": tm * 1e3, "gemm_GFLOPs": 2 * M * K * N / tm / 1e9})
    # the tied LM head (decode: one row of logits), fp32 rows vs Q8_0 rows
    from edgekv.compiler.kernels.dense import build_dense_nt_kernel

    table = rng.standard_normal((VOCAB, 576)).astype(np.float32) * 0.05
    x1 = tvm.runtime.tensor(rng.standard_normal((1, 576)).astype(np.float32))
    o1 = tvm.runtime.tensor(np.zeros((1, VOCAB), np.float32))
    for fmt_name in ("fp32", "q8"):
        if fmt_name == "fp32":
            arrays = [table]
            f = build(build_dense_nt_kernel((1, 576), (VOCAB, 576), (1, VOCAB)), tgt)
        else:
            b = qf.quantize(table, qf.Q8_0)
            arrays = [b.q, b.d]
            f = build(build_q8_gemv_nt_kernel((1, 576), (1, VOCAB), VOCAB, 576), tgt)
        copies = weight_copies(arrays)
        nbytes = sum(a.nbytes for a in arrays)
        t1 = time_cold(f, copies, x1, o1)
        rows.append({"kernel": "LM head (tied)", "K": 576, "N": VOCAB, "NR": 0, "weights": fmt_name,
                     "weight_bytes": nbytes, "calls_per_token": 1, "gemv_us": t1 * 1e6, "gemv_GBps": nbytes / t1 / 1e9,
                     "gemm_ms": None, "gemm_GFLOPs": None})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    totals = {}
    head_format = {"fp32": "fp32", "q8": "q8", "q4": "q8"}  # a q4 artifact keeps the Q8_0 embedding / head
    for fmt_name in ("fp32", "q8", "q4"):
        per = [r for r in rows if r["kernel"] != "LM head (tied)" and r["weights"] == fmt_name]
        per += [r for r in rows if r["kernel"] == "LM head (tied)" and r["weights"] == head_format[fmt_name]]
        us = sum(r["gemv_us"] * r["calls_per_token"] for r in per)
        nbytes = sum(r["weight_bytes"] * r["calls_per_token"] for r in per)
        totals[fmt_name] = {"gemv_ms_per_token": us / 1e3, "weight_MB_per_token": nbytes / 1e6,
                            "GBps": nbytes / us / 1e3}
    result = {"bandwidth_GBps": bw, "threads": args.threads, "prefill_rows": M, "rows": rows, "per_token": totals,
              "cpu": cpu, "commit": commit + ("-dirty" if dirty else ""), "command": "python tools/bench/bench_weight_kernels.py",
              "provenance": origin}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_kernels.json").write_text(json.dumps(result, indent=2))
    lines = ["# Weight-format kernels on SmolLM2's shapes", "",
             f"Regenerate: `{result['command']}`. {cpu}, {args.threads} threads, commit {result['commit']}.", "",
             f"Memory read bandwidth: **{bw:.1f} GB/s** (a TVM-built parallel vectorised sum over 1 GiB of fp32 on "
             f"{args.threads} threads, best of 5). Every kernel below reads its weights cold (copies cycled past the "
             "last-level cache, as 30 layers stream past in the model). GB/s = weight bytes read / time per call.", "",
             f"| kernel | K × N | weights | bytes | GEMV µs | GEMV GB/s | % of bandwidth | GEMM (M = {M}) ms | GEMM GFLOP/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gemm = f"{r['gemm_ms']:.2f} | {r['gemm_GFLOPs']:.0f}" if r["gemm_ms"] is not None else "— | —"
        lines.append(f"| {r['kernel']} | {r['K']} × {r['N']} | {r['weights']} | {r['weight_bytes'] / 1e6:.2f} MB | "
                     f"{r['gemv_us']:.0f} | {r['gemv_GBps']:.1f} | {100 * r['gemv_GBps'] / bw:.0f} % | {gemm} |")
    lines += ["", "Per decode token (every linear layer once, the LM head once; q4 uses the Q8_0 head as artifacts do):", "",
              "| weights | weight MB read | GEMV ms | GB/s | % of bandwidth |", "|---|---:|---:|---:|---:|"]
    for k, t in totals.items():
        lines.append(f"| {k} | {t['weight_MB_per_token']:.1f} | {t['gemv_ms_per_token']:.2f} | {t['GBps']:.1f} | "
                     f"{100 * t['GBps'] / bw:.0f} % |")
    (args.out / "weight_kernels.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = sorted({r["kernel"] for r in rows}, key=[r["kernel"] for r in rows].index)
    for i, fmt_name in enumerate(("fp32", "q8", "q4")):
        vals = [next((r["gemv_GBps"] for r in rows if r["kernel"] == k and r["weights"] == fmt_name), 0) for k in labels]
        ax.bar(np.arange(len(labels)) + (i - 1) * 0.27, vals, 0.27, label=fmt_name)
    ax.axhline(bw, color="k", linestyle="--", label="read bandwidth")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("GB/s of weights")
    ax.set_title("decode GEMVs: weight bytes per second (cold)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "weight_kernels.png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
