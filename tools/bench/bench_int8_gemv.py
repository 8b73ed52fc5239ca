"""Microbenchmark of the decode GEMVs with int8 activations (``kernels/int8_gemv.py``,
``--decode-activations int8``) against the fp32-activation kernels, interleaved in one run, at the
shapes of Qwen2.5-1.5B (Q4_K / Q6_K panels, NR = 64; its untied Q6_K LM head) and SmolLM2-135M
(Q4_1 panels; the tied Q8_0 LM head), weights cold (copies cycled past the last-level cache).

    python tools/bench/bench_int8_gemv.py --threads 1 --cpu-time   # docs/results/int8_gemv_t1_cpu.{json,md}
    python tools/bench/bench_int8_gemv.py --threads 2              # docs/results/int8_gemv_t2.{json,md}

Checks per shape: the int8 kernel's output equals a numpy reference of the same scheme (exact
integer block sums; max relative difference printed), the avx2 and generic paths give the same
bits, and the difference from the fp32-activation kernel (what x's rounding costs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.kernel_timing import add_timing_args, clock, start_provenance, time_cold  # noqa: E402


# (model, weight, GGUF type, K, N, NR, calls per token)
SHAPES = [
    ("qwen2.5-1.5b", "q/o proj", "Q4_K", 1536, 1536, 64, 56),
    ("qwen2.5-1.5b", "k/v proj", "Q4_K", 1536, 256, 64, 42),
    ("qwen2.5-1.5b", "k/v proj", "Q6_K", 1536, 256, 64, 14),
    ("qwen2.5-1.5b", "gate/up proj", "Q4_K", 1536, 8960, 64, 56),
    ("qwen2.5-1.5b", "down proj", "Q4_K", 8960, 1536, 64, 14),
    ("qwen2.5-1.5b", "down proj", "Q6_K", 8960, 1536, 64, 14),
    ("qwen2.5-1.5b", "LM head", "Q6_K", 1536, 151936, 64, 1),
    ("smollm2-135m", "q/o proj", "Q4_1", 576, 576, 64, 60),
    ("smollm2-135m", "k/v proj", "Q4_1", 576, 192, 32, 60),
    ("smollm2-135m", "gate/up proj", "Q4_1", 576, 1536, 64, 60),
    ("smollm2-135m", "down proj", "Q4_1", 1536, 576, 64, 30),
    ("smollm2-135m", "tied LM head", "Q8_0", 576, 49152, 0, 1),
]
def kernels(ggml: str, K: int, N: int, NR: int, isa: str):
    """(fp32-activation kernel, int8 kernel on ``isa``) PrimFuncs for one shape."""
    from edgekv.compiler import kquant_formats as kq
    from edgekv.compiler import quant_formats as qf
    from edgekv.compiler.kernels import int8_gemv as ig
    from edgekv.compiler.kernels.kquant_dense import build_kquant_gemv_kernel
    from edgekv.compiler.kernels.quant_dense import build_q8_gemv_nt_kernel, build_quant_gemv_kernel

    a, c = (1, 1, K), (1, 1, N)
    if ggml == "Q8_0":
        return build_q8_gemv_nt_kernel(a, c, N, K), ig.build_q8_int8_gemv_nt_kernel(a, c, N, K, isa)
    if ggml == "Q4_1":
        return (build_quant_gemv_kernel(a, c, qf.Q4_1, K, N, NR),
                ig.build_q4_int8_gemv_kernel(a, c, qf.Q4_1, K, N, NR, isa))
    fmt = kq.KFORMATS[ggml]
    return build_kquant_gemv_kernel(a, c, fmt, K, N, NR), ig.build_kquant_int8_gemv_kernel(a, c, fmt, K, N, NR, isa)


def weights(ggml: str, K: int, N: int, NR: int, rng):
    """(arrays the kernels take, same-scheme reference ``ref(x)``) for random valid blocks."""
    from tests.test_int8_gemv import kquant_reference, q4_1_reference, quantized_x, random_kblocks

    from edgekv.compiler import kquant_formats as kq
    from edgekv.compiler import quant_formats as qf

    if ggml in ("Q4_K", "Q6_K"):
        b = random_kblocks(ggml, K, N, rng)
        return kq.kpanel_arrays(b, NR), lambda x: kquant_reference(x, b)
    fmt = qf.Q4_1 if ggml == "Q4_1" else qf.Q8_0
    b = qf.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, fmt)
    if ggml == "Q4_1":
        return qf.panel_arrays(b, NR), lambda x: q4_1_reference(x, b)

    def ref(x):
        q, dx, _ = quantized_x(x)
        isum = np.einsum("vbk,bk->vb", b.q.astype(np.int64).reshape(N, -1, 32), q)
        return (b.d.astype(np.float64) * dx.astype(np.float64) * isum).sum(1)

    return [b.q, b.d], ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, threads=2)
    ap.add_argument("--mcpu", default="znver3")
    ap.add_argument("--only", default=None, help="run the shapes of this model only (qwen2.5-1.5b | smollm2-135m)")
    args = ap.parse_args(argv)
    prov = start_provenance(args)
    timer = clock(args)
    import tvm

    from edgekv.compiler.kernels.int8_gemv import int8_isa
    from tools.bench.bench_weight_kernels import build, weight_copies

    tgt = tvm.target.Target({"kind": "llvm", "mcpu": args.mcpu, "num-cores": args.threads})
    isa = int8_isa(tgt)
    rng = np.random.default_rng(0)
    rows = []
    for model, what, ggml, K, N, NR, calls in SHAPES:
        if args.only and model != args.only:
            continue
        arrays, ref = weights(ggml, K, N, NR, rng)
        f32, i8 = (build(f, tgt) for f in kernels(ggml, K, N, NR, isa))
        gen = build(kernels(ggml, K, N, NR, "generic")[1], tgt) if isa != "generic" else None
        xv = rng.standard_normal((1, 1, K)).astype(np.float32)
        x = tvm.runtime.tensor(xv)
        out = tvm.runtime.tensor(np.zeros((1, 1, N), np.float32))
        copies = weight_copies(arrays)
        times = {"fp32": [], "int8": []}
        for _ in range(args.reps):  # interleaved
            times["fp32"].append(time_cold(f32, copies, x, out, timer))
            times["int8"].append(time_cold(i8, copies, x, out, timer))
        got = {}
        for name, f in (("fp32", f32), ("int8", i8), ("generic", gen)):
            if f is not None:
                f(x, *copies[0], out)
                got[name] = out.numpy().reshape(-1).copy()
        r = ref(xv.reshape(-1))
        t32, t8 = min(times["fp32"]), min(times["int8"])
        nbytes = sum(a.nbytes for a in arrays)
        rows.append({"model": model, "weight": what, "type": ggml, "K": K, "N": N, "NR": NR, "calls_per_token": calls,
                     "weight_bytes": nbytes, "fp32_us": t32 * 1e6, "int8_us": t8 * 1e6, "speedup": t32 / t8,
                     "int8_GBps": nbytes / t8 / 1e9,
                     "int8_vs_same_scheme_ref_rel": float(np.abs(got["int8"] - r).max() / np.abs(r).max()),
                     "avx2_equals_generic_bits": (None if "generic" not in got else
                                                  bool(np.array_equal(got["int8"].view(np.uint32), got["generic"].view(np.uint32)))),
                     "int8_vs_fp32_rel": float(np.abs(got["int8"] - got["fp32"]).max() / np.abs(got["fp32"]).max())})
        print(rows[-1], flush=True)
        del copies
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = f"python tools/bench/bench_int8_gemv.py --threads {args.threads}" + (" --cpu-time" if args.cpu_time else "")
    command += f" --only {args.only}" if args.only else ""
    load = os.getloadavg()
    note = (f"fp32 and int8 interleaved in one run, best of {args.reps}, weights cold; the machine was shared "
            f"(load average {load[0]:.1f} at the end; other helpers' jobs at nice 19)")
    if args.cpu_time:
        note = "times are CPU seconds of the process (not wall): " + note
    result = {"threads": args.threads, "target": str(tgt), "isa": isa, "commit": commit, "command": command,
              "note": note, "rows": rows, **prov}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"int8_gemv_t{args.threads}" + ("_cpu" if args.cpu_time else "") + (f"_{args.only}" if args.only else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    lines = ["# Decode GEMVs: int8 activations against fp32 activations", "",
             f"Regenerate: `{command}`. Target `{tgt}` (int8 path: {isa}), {args.threads} threads, commit {commit}. {note}.", "",
             "| model | weight | type | K × N | fp32 act. µs | int8 act. µs | speed-up | int8 GB/s | "
             "int8 vs same-scheme reference | avx2 = generic bits | int8 vs fp32 act. (max rel.) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        same = "—" if r["avx2_equals_generic_bits"] is None else ("yes" if r["avx2_equals_generic_bits"] else "no")
        lines.append(f"| {r['model']} | {r['weight']} | {r['type']} | {r['K']} × {r['N']} | {r['fp32_us']:.0f} | "
                     f"{r['int8_us']:.0f} | {r['speedup']:.2f}× | {r['int8_GBps']:.1f} | {r['int8_vs_same_scheme_ref_rel']:.1e} | "
                     f"{same} | {r['int8_vs_fp32_rel']:.1e} |")
    for model in sorted({r["model"] for r in rows}):  # per token: every GEMV call of the model
        sel = [r for r in rows if r["model"] == model]
        a = sum(r["fp32_us"] * r["calls_per_token"] for r in sel) / 1e3
        b = sum(r["int8_us"] * r["calls_per_token"] for r in sel) / 1e3
        lines.append(f"\n{model}: the GEMVs of one decode token (calls per token × time): fp32 activations {a:.1f} ms, "
                     f"int8 {b:.1f} ms ({a / b:.2f}×).")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
