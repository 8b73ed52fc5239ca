"""Microbenchmark of the prefill GEMMs' register tile: the fp32 GEMM (``dense.py``, packed panels)
and the Q4_1 one (``quant_dense.py``) as this checkout builds them (``register_tile.py``'s tile
for this CPU) against the same kernels at another commit (``--baseline-ref``), interleaved in
one run, on SmolLM2-135M's and Qwen2.5-1.5B's linear shapes at M = 128 (the prefill block),
with the panel width NR the compile picks for 2 threads (``dense_tiles``). Also checks that
both give the same bits.

    python tools/bench/bench_gemm_tiles.py --baseline-ref main --threads 1 --cpu-time   # docs/results/gemm_tiles_t1_cpu.{json,md}

On a shared machine, ``--threads 1 --cpu-time`` (the process's CPU seconds) is the figure that
other jobs disturb least. Run at normal priority under the heavy lock (docs: every figure from a
command).
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
from tools.bench.kernel_timing import add_timing_args, clock, kernels_at, start_provenance, time_warm  # noqa: E402

# (model, projection, K, N)
SHAPES = [("SmolLM2", "q/o", 576, 576), ("SmolLM2", "k/v", 576, 192), ("SmolLM2", "gate/up", 576, 1536),
          ("SmolLM2", "down", 1536, 576), ("Qwen2.5-1.5B", "q/o", 1536, 1536), ("Qwen2.5-1.5B", "k/v", 1536, 256),
          ("Qwen2.5-1.5B", "gate/up", 1536, 8960), ("Qwen2.5-1.5B", "down", 8960, 1536)]

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, threads=1)
    ap.add_argument("--rows", type=int, default=128, help="M of the prefill GEMM (the block)")
    ap.add_argument("--baseline-ref", default="main", help="git ref whose dense.py / quant_dense.py are timed too")
    args = ap.parse_args(argv)
    prov = start_provenance(args)
    timer = clock(args)

    import tvm

    from edgekv.compiler import quant_formats as qf
    from edgekv.compiler.kernels import dense, quant_dense
    from edgekv.compiler.kernels.register_tile import subpanel_cols, tile_rows, vector_registers
    from tools.bench.bench_weight_kernels import build, random_block_arrays, target

    tgt = target(args.threads)
    base = kernels_at(args.baseline_ref, ("dense", "quant_dense"))
    ref = args.baseline_ref
    M = args.rows
    rng = np.random.default_rng(0)
    rows = []
    for model, proj, K, N in SHAPES:
        nr = dense.dense_tiles(M, K, N, 2)[1]  # as the compile for 2 threads packs it
        x = tvm.runtime.tensor(rng.standard_normal((1, M, K)).astype(np.float32))
        wf = rng.standard_normal((K, N)).astype(np.float32)
        fp32 = [tvm.runtime.tensor(dense.pack_weight(wf, nr))]
        q4 = [tvm.runtime.tensor(a) for a in random_block_arrays("Q4_1", K, N, nr, rng)]
        variants = {}
        for label, dmod, qmod in (("this", dense, quant_dense), (ref, base["dense"], base["quant_dense"])):
            variants[("fp32", label)] = (build(dmod.build_dense_kernel((1, M, K), (K, N), (1, M, N), args.threads,
                                                                       packed_nr=nr), tgt), fp32)
            variants[("Q4_1", label)] = (build(qmod.build_quant_gemm_kernel((1, M, K), (1, M, N), qf.Q4_1, K, N, nr),
                                               tgt), q4)
        outs = {key: tvm.runtime.tensor(np.zeros((1, M, N), np.float32)) for key in variants}
        times = {key: [] for key in variants}
        for _ in range(args.reps):  # interleaved: each round times every variant once
            for key, (f, w) in variants.items():
                times[key].append(time_warm(f, [x, *w, outs[key]], timer))
        for fmt in ("fp32", "Q4_1"):
            new, old = outs[(fmt, "this")].numpy(), outs[(fmt, ref)].numpy()
            t_new, t_old = min(times[(fmt, "this")]), min(times[(fmt, ref)])
            rows.append({"model": model, "proj": proj, "K": K, "N": N, "NR": nr, "format": fmt,
                         "baseline_ms": t_old * 1e3, "ms": t_new * 1e3,
                         "baseline_GFLOPs": 2 * M * K * N / t_old / 1e9, "GFLOPs": 2 * M * K * N / t_new / 1e9,
                         "speedup": t_old / t_new,
                         "equal_bits": bool(np.array_equal(new.view(np.uint32), old.view(np.uint32))),
                         "max_rel_diff": float(np.abs(new - old).max() / np.abs(old).max())})
            print(rows[-1], flush=True)
    regs = vector_registers(tgt)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    base_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True, text=True).stdout.strip()
    command = f"python tools/bench/bench_gemm_tiles.py --baseline-ref {ref} --threads {args.threads}"
    command += " --cpu-time" if args.cpu_time else ""
    load = os.getloadavg()
    note = ("both commits' kernels interleaved in one run; best of the rounds; the machine was shared "
            f"(load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end, on {os.cpu_count()} cores: other "
            "helpers' jobs at nice 19)")
    if args.cpu_time:
        note = "times are CPU seconds of the process (not wall): " + note
    result = {"threads": args.threads, "target": str(tgt), "rows_M": M, "commit": commit, "baseline": f"{ref} ({base_commit})",
              "tile": {"lanes": regs.lanes, "registers": regs.count}, "command": command, "note": note, "rows": rows, **prov}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gemm_tiles_t{args.threads}" + ("_cpu" if args.cpu_time else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Prefill GEMM register tile: this commit against {ref} (M = {M})", "",
             f"Regenerate: `{command}`. Target `{tgt}` ({regs.lanes} fp32 lanes × {regs.count} vector registers), "
             f"{args.threads} thread(s), commit {commit} against {ref} at {base_commit}. {note}.", "",
             f"| model | projection | K × N | NR | format | {ref} ms | ms | {ref} GFLOP/s | GFLOP/s | speed-up | results |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        same = "equal bits" if r["equal_bits"] else f"{r['max_rel_diff']:.1e} rel."
        lines.append(f"| {r['model']} | {r['proj']} | {r['K']} × {r['N']} | {r['NR']} | {r['format']} | "
                     f"{r['baseline_ms']:.2f} | {r['ms']:.2f} | {r['baseline_GFLOPs']:.1f} | {r['GFLOPs']:.1f} | "
                     f"{r['speedup']:.2f}× | {same} |")
    ns = subpanel_cols(64, regs)
    lines += ["", f"Tile on this CPU at M = {M}: MR × NS = {tile_rows(M, ns, regs)} × {ns} (`register_tile.py`); "
              "the baseline's: MR × NR, 4 × 64 at NR = 64, 8 × 32 at NR = 32: 32 accumulators (ymm on AVX2, twice the register file)."]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
