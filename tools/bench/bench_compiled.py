"""Benchmark of the compiled host path (issue 8): where a block's time goes, GEMM GFLOP/s vs
torch (weights cache-resident and streamed from memory, packed and unpacked), attention vs SDPA,
whole-model prefill/decode tok/s vs the eager engine, HF eager and llama.cpp in one run, compile
time, eviction share, and the issue's targets. Writes a JSON results file and the markdown
section ``docs/results/compiled.md``.

    nice -n 10 python tools/bench/bench_compiled.py                       # SmolLM2, N=1K, B=128, KeyDiff
    python tools/bench/bench_compiled.py --prompts 2048 --skip hf,eager   # quicker partial run

Every number is wall time on the machine it runs on; the load average (``uptime``) before and
after is recorded, because this box is shared and the load moves the numbers by 2–3×.
Torch (eager engine, HF, GEMM peer) runs with as many threads as the compiled target's cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


# TVM's thread-pool workers busy-wait for a while after each parallel region; torch's threads
# started right after would share the 2 cores with them (measured: torch GEMMs 10-60x slower).
# Every switch between TVM and torch work waits this long first.
QUIESCE_S = 1.0


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def kind_of(name: str) -> str:
    if "attention" in name:
        return "block attention"
    if "score" in name and "select" not in name:
        return "eviction: score"
    if "select" in name or "append" in name:
        return "eviction: select+compact"
    if "matmul" in name:
        return "GEMM"
    if "take" in name:
        return "embedding gather"
    return "elementwise/norm/RoPE (fused)"


def profile_block(rt, reps: int = 3) -> dict:
    """Per-kernel wall time of one *evicting* prefill block (cache already full), median of reps."""
    import tvm

    B, N = rt.block, rt.budget
    rng = np.random.default_rng(0)
    per: dict[str, list[float]] = collections.defaultdict(list)
    per_cpu: dict[str, list[float]] = collections.defaultdict(list)  # process CPU time (all threads)
    totals = []
    for rep in range(reps):
        rt.reset()
        for s in range(0, N, B):
            rt.step_block(rng.integers(0, 1000, B))
        agg: dict[str, float] = collections.defaultdict(float)
        cpu_agg: dict[str, float] = collections.defaultdict(float)
        start: dict[str, float] = {}

        cpu_start: dict[str, float] = {}

        def instr(func, name, before, ret, *args):
            if before:
                start[name], cpu_start[name] = time.perf_counter(), time.process_time()
            else:
                agg[name] += time.perf_counter() - start.pop(name, time.perf_counter())
                cpu_agg[name] += time.process_time() - cpu_start.pop(name, time.process_time())
            return 0

        tok = tvm.runtime.tensor(rng.integers(0, 1000, B).astype("int64"))
        pos = tvm.runtime.tensor(np.arange(N, N + B, dtype="int64"))
        nv = tvm.runtime.tensor(np.array([B], "int32"))
        rt.vm.set_instrument(instr)
        t0 = time.perf_counter()
        rt.call_prefill_block(tok, pos, nv)
        totals.append(time.perf_counter() - t0)
        rt.vm.set_instrument(None) if hasattr(rt.vm, "set_instrument") else None
        for k, v in agg.items():
            per[k].append(v)
            per_cpu[k].append(cpu_agg[k])
    rt.reset()
    med = {k: statistics.median(v) for k, v in per.items()}
    med_cpu = {k: statistics.median(v) for k, v in per_cpu.items()}
    kinds: dict[str, float] = collections.defaultdict(float)
    kinds_cpu: dict[str, float] = collections.defaultdict(float)
    for k, v in med.items():
        kinds[kind_of(k)] += v
        kinds_cpu[kind_of(k)] += med_cpu[k]
    tot = sum(kinds.values())
    evict = kinds.get("eviction: score", 0.0) + kinds.get("eviction: select+compact", 0.0)
    return {
        "block_seconds_instrumented": statistics.median(totals),
        "kernels_seconds": tot,
        "by_kind": {k: {"seconds": v, "share": v / tot, "cpu_seconds": kinds_cpu[k]}
                    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k, "seconds": v, "cpu_seconds": med_cpu[k], "kind": kind_of(k)} for k, v in
                        sorted(med.items(), key=lambda kv: -kv[1])[:15]],
        "eviction_share": evict / tot,
    }


def gemm_shapes(cfg, block: int) -> list[tuple[str, int, int, int]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    hd = cfg.head_dim
    kv = cfg.num_kv_heads * hd
    out = []
    for m in (block, 1):
        out += [(f"q/o proj (M={m})", m, d, d), (f"k/v proj (M={m})", m, d, kv), (f"gate/up (M={m})", m, d, f),
                (f"down (M={m})", m, f, d)]
    return out


def _time_pair(f_tvm, f_torch, reps: int) -> dict:
    """Interleaved timing of two callables (TVM, torch): per rep, 5 calls each; wall (min) and
    process CPU time (median) per call. At one thread CPU time is the figure that survives a
    loaded box (a lost timeslice costs wall time, not CPU time)."""
    f_tvm(), f_torch()
    out = {"tvm_wall": [], "torch_wall": [], "tvm_cpu": [], "torch_cpu": []}
    for _ in range(reps):
        for key, f in (("tvm", f_tvm), ("torch", f_torch)):
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(5):
                f()
            out[f"{key}_wall"].append((time.perf_counter() - w0) / 5)
            out[f"{key}_cpu"].append((time.process_time() - c0) / 5)
    return {"tvm_wall_s": min(out["tvm_wall"]), "torch_wall_s": min(out["torch_wall"]),
            "tvm_cpu_s": statistics.median(out["tvm_cpu"]), "torch_cpu_s": statistics.median(out["torch_cpu"])}


COLD_BYTES = 512 << 20  # weights cycled per "cold" pass: more than the last-level cache holds


def bench_gemm(shapes, target_obj, block: int, model_cores: int, reps: int = 5) -> list[dict]:
    """Each shape with the kernels the model runs — weights packed into NR-wide column panels
    (``pack_weights.py``; NR as the model's build picks it for ``model_cores``), the
    register-blocked GEMM for M = B and the panel GEMV for M = 1 — against the same kernels on
    the unpacked [K, N] weight and torch.matmul. *hot*: one weight, called again and again
    (cache-resident); *cold*: a new copy of the weight on every call, cycling through
    ``COLD_BYTES`` of copies, as in the model, where each block streams every weight from memory."""
    import torch
    import tvm

    from edgekv.compiler.kernels.dense import (build_dense_kernel, build_gemv_kernel, build_packed_gemv_kernel,
                                               dense_tiles, pack_weight)

    def compiled(f):
        return tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target_obj)["main"]

    res = []
    for name, M, K, Nn in shapes:
        nr = dense_tiles(block, K, Nn, model_cores)[1]
        a_shape, w_shape, c_shape = (M, K), (K, Nn), (M, Nn)
        if M == 1:
            packed = compiled(build_packed_gemv_kernel(a_shape, w_shape, c_shape, nr))
            plain = compiled(build_gemv_kernel(a_shape, w_shape, c_shape))
        else:
            packed = compiled(build_dense_kernel(a_shape, w_shape, c_shape, model_cores, packed_nr=nr))
            plain = compiled(build_dense_kernel(a_shape, w_shape, c_shape, model_cores))
        rng = np.random.default_rng(0)
        copies = max(2, COLD_BYTES // (K * Nn * 4))
        xa = rng.standard_normal((M, K)).astype("float32")
        wa = [rng.standard_normal((K, Nn)).astype("float32") for _ in range(copies)]
        xt, out = tvm.runtime.tensor(xa), tvm.runtime.tensor(np.zeros((M, Nn), "float32"))
        w_plain = [tvm.runtime.tensor(w) for w in wa]
        w_packed = [tvm.runtime.tensor(pack_weight(w, nr)) for w in wa]
        xtt, w_torch = torch.from_numpy(xa), [torch.from_numpy(w) for w in wa]
        packed(xt, w_packed[0], out)
        err = float(np.abs(out.numpy() - xa @ wa[0]).max() / np.abs(xa @ wa[0]).max())
        runs = {
            "tvm_packed_hot": lambda: [packed(xt, w_packed[0], out) for _ in range(copies)],
            "tvm_packed_cold": lambda: [packed(xt, w, out) for w in w_packed],
            "tvm_unpacked_cold": lambda: [plain(xt, w, out) for w in w_plain],
            "torch_hot": lambda: [torch.matmul(xtt, w_torch[0]) for _ in range(copies)],
            "torch_cold": lambda: [torch.matmul(xtt, w) for w in w_torch],
        }
        cpu = {k: [] for k in runs}
        for f in runs.values():
            f()  # first touch of every copy
        for _ in range(reps):  # interleaved, so a load swing hits every variant alike
            for k, f in runs.items():
                c0 = time.process_time()
                f()
                cpu[k].append((time.process_time() - c0) / copies)
        flop = 2.0 * M * K * Nn
        row = {"name": name, "M": M, "K": K, "N": Nn, "NR": nr, "copies": copies, "max_rel_err": err}
        row.update({f"{k}_gflops": flop / statistics.median(v) / 1e9 for k, v in cpu.items()})
        res.append(row)
        print(f"  gemm {name}: packed hot/cold {row['tvm_packed_hot_gflops']:.0f}/{row['tvm_packed_cold_gflops']:.0f}, "
              f"unpacked cold {row['tvm_unpacked_cold_gflops']:.0f}, torch hot/cold {row['torch_hot_gflops']:.0f}/"
              f"{row['torch_cold_gflops']:.0f} GFLOP/s", flush=True)
    return res


def bench_attention(cfg, budget: int, block: int, target_obj, reps: int = 7) -> list[dict]:
    """The block attention kernel (cache full, whole block valid) and the decode one (B = 1) at
    the model's shapes vs torch's scaled_dot_product_attention on the same tensors (GQA heads
    repeated, causal mask over the block part)."""
    import torch
    import tvm

    from edgekv.compiler.kernels import build_attention

    Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G, scale = Hq // H, 1.0 / np.sqrt(D)
    res = []
    for name, Bq in ((f"prefill block (B={block})", block), ("decode (B=1)", 1)):
        f = build_attention(Hq, H, budget, Bq, D, scale).with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": f}), target=target_obj)
        rng = np.random.default_rng(0)
        q, kb, vb = (rng.standard_normal(s).astype("float32") for s in [(1, Hq, Bq, D), (1, H, Bq, D), (1, H, Bq, D)])
        kc, vc = (rng.standard_normal((H, budget, D)).astype("float32") for _ in range(2))
        args = [tvm.runtime.tensor(x) for x in (q, kb, vb, kc, vc, np.array([budget], "int32"),
                                                np.array([Bq], "int32"), np.zeros((1, Hq, Bq, D), "float32"))]
        keys = torch.from_numpy(np.repeat(np.concatenate([kc, kb[0]], 1), G, 0))[None]
        vals = torch.from_numpy(np.repeat(np.concatenate([vc, vb[0]], 1), G, 0))[None]
        mask = torch.zeros(Bq, budget + Bq)
        mask[:, budget:] = torch.triu(torch.full((Bq, Bq), float("-inf")), 1)
        qt = torch.from_numpy(q)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qt, keys, vals, attn_mask=mask, scale=scale)

        lib["main"](*args)
        err = float(np.abs(args[-1].numpy() - sdpa().numpy()).max())
        t = _time_pair(lambda: lib["main"](*args), sdpa, reps)
        flop = 4.0 * Hq * Bq * (budget + (Bq + 1) / 2) * D
        res.append({"name": name, "Hq": Hq, "H": H, "N": budget, "B": Bq, "D": D, **t, "max_abs_err": err,
                    "tvm_gflops": flop / t["tvm_cpu_s"] / 1e9, "torch_gflops": flop / t["torch_cpu_s"] / 1e9})
        print(f"  attention {name}: tvm {res[-1]['tvm_gflops']:.1f} GFLOP/s, torch sdpa {res[-1]['torch_gflops']:.1f}",
              flush=True)
    return res


def kernels_child(args) -> int:
    """``--kernels-child``: the per-kernel comparisons in a process of its own, so TVM's pool
    (sized when first used, from TVM_NUM_THREADS) and torch run the same thread count."""
    import torch
    import tvm

    from edgekv.compiler import resolve_target
    from edgekv.models import load_model

    torch.set_num_threads(args.kernel_threads)
    _, tgt = resolve_target(args.target)
    model_cores = int(tgt.get("num-cores", 1))  # the panels' width follows the model's build
    tgt = dict(tgt, **{"num-cores": args.kernel_threads})
    cfg = load_model(args.model).config
    target_obj = tvm.target.Target(tgt)
    out = {"threads": args.kernel_threads, "tvm_pool_threads": int(tvm.get_global_func("runtime.NumThreads")()),
           "torch_threads": torch.get_num_threads(), "load_before": load_avg(),
           "gemm": bench_gemm(gemm_shapes(cfg, args.block), target_obj, args.block, model_cores),
           "attention": bench_attention(cfg, args.budget, args.block, target_obj)}
    out["load_after"] = load_avg()
    Path(args.kernels_child).write_text(json.dumps(out))
    return 0


def run_kernels(args) -> dict:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "kernels.json"
        env = dict(os.environ, TVM_NUM_THREADS=str(args.kernel_threads), OMP_NUM_THREADS=str(args.kernel_threads))
        subprocess.run([sys.executable, __file__, "--kernels-child", str(out), "--kernel-threads", str(args.kernel_threads),
                        "--model", args.model, "--budget", str(args.budget), "--block", str(args.block),
                        "--target", args.target], check=True, env=env)
        return json.loads(out.read_text())


def prompt_ids(model, length: int) -> np.ndarray:
    text = ""
    for p in sorted((REPO.parent / "shared" / "research").glob("*.md")) + sorted((REPO / "docs").rglob("*.md")):
        text += p.read_text(errors="ignore") + "\n"
        if len(text) > 8 * length:
            break
    ids = list(model.tokenizer.encode(text)) if model.tokenizer is not None else []
    while len(ids) < length:
        ids = ids + ids if ids else list(range(length))
    return np.asarray(ids[:length], dtype=np.int64)


def bench_compiled_run(rt, ids, decode_tokens: int) -> dict:
    rt.reset()
    rt.step_block(ids[: rt.block])  # warm-up
    rt.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    logits = rt.prefill(ids)
    pre, pre_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(decode_tokens):
        logits = rt.decode(int(np.argmax(logits)))
    dec, dec_cpu = time.perf_counter() - t0, time.process_time() - c0
    blocks = rt.stats.block_seconds
    return {"prefill_seconds": pre, "prefill_tok_s": len(ids) / pre, "decode_seconds": dec,
            "decode_tok_s": decode_tokens / dec, "block_seconds_median": statistics.median(blocks),
            "prefill_cpu_seconds": pre_cpu, "decode_cpu_seconds": dec_cpu}


def bench_eager_run(model, policy, budget, block, ids, decode_tokens: int) -> dict:
    import torch

    from edgekv.engine import BlockEngine

    ids_t = torch.from_numpy(ids)
    with torch.no_grad():
        BlockEngine(model, policy, budget, block).prefill(ids_t[:block])
        eng = BlockEngine(model, policy, budget, block)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = eng.prefill(ids_t)
        pre, pre_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(decode_tokens):
            logits = eng.decode(int(logits.argmax()))
        dec, dec_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"prefill_seconds": pre, "prefill_tok_s": len(ids) / pre, "decode_seconds": dec,
            "decode_tok_s": decode_tokens / dec, "prefill_cpu_seconds": pre_cpu, "decode_cpu_seconds": dec_cpu}


def bench_hf_run(hf, ids, decode_tokens: int) -> dict:
    import torch

    from edgekv.bench.systems import hf_generate

    ids_t = torch.from_numpy(ids)
    hf_generate(hf, ids_t[:128], 1)
    c0 = time.process_time()
    pre, dec = hf_generate(hf, ids_t, decode_tokens)
    return {"prefill_seconds": pre, "prefill_tok_s": len(ids) / pre, "decode_seconds": dec,
            "prefill_decode_cpu_seconds": time.process_time() - c0,
            "decode_tok_s": decode_tokens / dec, "attn_implementation": getattr(hf.config, "_attn_implementation", None)}


def block_gflop(cfg, budget: int, block: int) -> dict[str, float]:
    """GFLOP of one evicting prefill block (cache full): the linear layers (q, k, v, o, gate, up,
    down; the LM head runs on one row) and the block attention over N cache + causal block keys."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    kv = cfg.num_kv_heads * cfg.head_dim
    gemm = 2.0 * block * L * (2 * d * d + 2 * d * kv + 3 * d * f)
    attn = 4.0 * cfg.num_heads * block * (budget + (block + 1) / 2) * cfg.head_dim * L
    return {"GEMM": gemm / 1e9, "block attention": attn / 1e9}


def bench_llamacpp_run(model_name: str, ids, threads: int, decode_tokens: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same GGUF file and the same prompt ids, full cache:
    the runner of ``edgekv bench`` called in-process, so it is timed like the rows beside it."""
    import torch

    from edgekv.bench.systems import run_llamacpp

    c0 = time.process_time()
    v = run_llamacpp(torch.from_numpy(ids), {"model": model_name, "threads": threads, "block": 128,
                                             "decode_tokens": decode_tokens})
    n = len(ids)
    return {"prefill_seconds": v["prefill_seconds"], "prefill_tok_s": n / v["prefill_seconds"],
            "decode_seconds": v["decode_seconds"], "decode_tok_s": decode_tokens / v["decode_seconds"],
            "prefill_decode_cpu_seconds": time.process_time() - c0}


def load_sentence(r: dict) -> str:
    """What the load average says about the run: a quiet box, or one shared with other work."""
    worst = max(max(r["load_before"]), max(r.get("load_after", r["load_before"])))
    cores = os.cpu_count() or 1
    if worst <= 0.5 + cores:  # the benchmark's own threads account for up to `cores`
        return (f"1/5/15-min load average {r['load_before']} before and {r.get('load_after')} after the run on "
                f"{cores} cores: on average no more runnable work than the benchmark's own threads.\n")
    return (f"**The machine was shared**: 1/5/15-min load average {r['load_before']} before and "
            f"{r.get('load_after')} after the run on {cores} cores, so every time here includes other work; "
            "compare rows of one run, not runs.\n")


def write_markdown(r: dict, path: Path) -> None:
    L = []
    a = r["setup"]
    L.append("# Compiled host path: speed (issue 8)\n" if "e2e" in r or "profile" in r else
             "# Compiled host path: compile time (issue 8)\n")
    L.append(f"Generated by `tools/bench/bench_compiled.py` on {r['date']} — {a['model']}, policy {a['policy']}, "
             f"N = {a['budget']}, B = {a['block']}, {a.get('weights', 'fp32')} weights, target `{a['target']}` ({a['threads']} threads for TVM "
             f"and torch alike; TVM_NUM_THREADS={a.get('tvm_num_threads_env')}, this process may run on "
             f"{a.get('cpus_allowed')} CPUs). CPU: {a['cpu']}. Commit `{r.get('commit', 'not recorded')}`, command "
             f"`{r.get('command', 'not recorded')}`.\n")
    L.append(load_sentence(r))
    if "compile" in r:
        c = r["compile"]
        L.append("## Compile\n")
        L.append("| phase | seconds |\n|---|---|")
        for k, v in c["timings"].items():
            L.append(f"| {k} | {v:.1f} |")
        L.append(f"| **total (compile_model)** | **{c['total_seconds']:.1f}** |\n")
    if "profile" in r:
        p = r["profile"]
        L.append("## Where an evicting block's time goes (cache full, B tokens in, per-kernel wall time)\n")
        L.append(f"Instrumented block: {p['block_seconds_instrumented']*1e3:.0f} ms (sum of kernels "
                 f"{p['kernels_seconds']*1e3:.0f} ms; median of {p.get('reps', 3)} blocks).\n")
        L.append("CPU ms: process CPU time over all threads (at one TVM thread, the kernel's own time without "
                 "the timeslices other tenants took).\n")
        L.append("| kernel kind | ms per block | share | CPU ms | GFLOP/s in the model |\n|---|---|---|---|---|")
        gflop = a.get("block_gflop", {})
        for k, v in p["by_kind"].items():
            rate = f"{gflop[k] / v['seconds']:.0f}" if k in gflop and v["seconds"] else ""
            L.append(f"| {k} | {v['seconds']*1e3:.1f} | {100*v['share']:.1f} % | {v.get('cpu_seconds', 0)*1e3:.1f} | "
                     f"{rate} |")
        L.append(f"\n**Eviction share (score + select/compaction): {100*p['eviction_share']:.2f} %** (goal ≤ 2 %).\n")
        L.append("Largest kernels:\n\n| kernel | kind | ms | CPU ms |\n|---|---|---|---|")
        for k in p["top_kernels"][:10]:
            L.append(f"| `{k['name']}` | {k['kind']} | {k['seconds']*1e3:.1f} | {k.get('cpu_seconds', 0)*1e3:.1f} |")
        L.append("")
    if "kernels" in r:
        k = r["kernels"]
        L.append(f"## Kernels vs torch on the same shape ({k['threads']} thread: TVM pool {k['tvm_pool_threads']}, "
                 f"torch {k['torch_threads']}, one process, interleaved)\n")
        L.append("GFLOP/s from the median process *CPU time* per call (at one thread it does not count time "
                 "other work takes). GEMM rows: the kernels the model runs (weights packed into NR-wide column "
                 "panels; M = B: register-blocked GEMM, M = 1: panel GEMV) with the weight cache-resident (*hot*) "
                 "and with a new copy of the weight on every call (*cold*, cycling through 512 MiB of copies: "
                 "what a block does, streaming every weight from memory), the same kernel on the unpacked [K, N] "
                 f"weight (cold), and torch.matmul (oneDNN). Load {k['load_before']} → {k['load_after']}.\n")
        L.append("| kernel | shape (NR) | packed hot | packed cold | unpacked cold | torch hot | torch cold | "
                 "packed / torch (cold) |\n|---|---|---|---|---|---|---|---|")
        for g in k["gemm"]:
            L.append(f"| GEMM {g['name']} | {g['M']}×{g['K']}×{g['N']} ({g['NR']}) | {g['tvm_packed_hot_gflops']:.0f} | "
                     f"{g['tvm_packed_cold_gflops']:.0f} | {g['tvm_unpacked_cold_gflops']:.0f} | "
                     f"{g['torch_hot_gflops']:.0f} | {g['torch_cold_gflops']:.0f} | "
                     f"{g['tvm_packed_cold_gflops'] / g['torch_cold_gflops']:.2f} |")
        L.append("\n| kernel | shape | TVM GFLOP/s | torch GFLOP/s | TVM / torch |\n|---|---|---|---|---|")
        for g in k["attention"]:
            L.append(f"| attention {g['name']} vs SDPA | Hq {g['Hq']}, H {g['H']}, N {g['N']}, d {g['D']} | "
                     f"{g['tvm_gflops']:.1f} | {g['torch_gflops']:.1f} | {g['tvm_gflops']/g['torch_gflops']:.2f} |")
        L.append("")
    if "e2e" in r:
        L.append("## Whole model: prefill and decode\n")
        L.append("| prompt | system | prefill tok/s | decode tok/s | prefill s | CPU s (prefill + decode) |\n"
                 "|---|---|---|---|---|---|")
        for plen, rows in r["e2e"].items():
            for sysname, v in rows.items():
                if "error" in v:
                    L.append(f"| {plen} | {sysname} | — | — | {v['error']} | |")
                else:
                    cpu = v.get("prefill_decode_cpu_seconds",
                                v.get("prefill_cpu_seconds", float("nan")) + v.get("decode_cpu_seconds", float("nan")))
                    L.append(f"| {plen} | {sysname} | {v['prefill_tok_s']:.0f} | {v['decode_tok_s']:.1f} | "
                             f"{v['prefill_seconds']:.1f} | {cpu:.1f} |")
        L.append("")
        L.append(f"Decode: {a['decode_tokens']} greedy tokens after the prompt (compiled and eager engine: N = "
                 f"{a['budget']} cache; HF: full cache at the prompt's length). Each system ran "
                 f"{a.get('repeats', 1)}× per prompt in alternating order after a one-block warm-up; the table "
                 "shows its median prefill run and the median decode speed (every run with its load average is "
                 "in the JSON). llama.cpp runs its own kernels on the GGUF's quantised weights (Q4_1: the file the model ships as), "
                 f"the eager engine and HF fp32 (dequantised from it), the compiled artifact {a.get('weights', 'fp32')}.\n")
    if r.get("targets"):
        L.append("## Targets (issue 8)\n")
        L.append("| target | measured | met? |\n|---|---|---|")
        for t in r["targets"]:
            L.append(f"| {t['target']} | {t['measured']} | {t['met']} |")
        L.append("")
    gap = prefill_gap(r)
    if gap:
        L.append("## How far the prefill target is, kernel by kernel\n")
        L.extend(gap)
        L.append("")
    if r.get("notes"):
        L.append("## Notes\n")
        for n in r["notes"]:
            L.append(f"- {n}")
        L.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(L))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--target", default="host")
    ap.add_argument("--weights", default="fp32", choices=["fp32", "q8", "q4"],
                    help="the artifact's weights (fp32: the same numbers HF and the eager engine run; the "
                         "q4 artifact against llama.cpp is `edgekv bench`'s docs/results/bench_q4)")
    ap.add_argument("--prompts", default="2048,8192", help="prompt lengths for the whole-model runs")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs per system and prompt (order alternates)")
    ap.add_argument("--artifact", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "edgekv_bench_compiled"))
    ap.add_argument("--reuse-artifact", action="store_true", help="skip compiling when --artifact exists")
    ap.add_argument("--skip", default="", help="comma list of: compile-time,profile,gemm,e2e,eager,hf,llamacpp")
    ap.add_argument("--kernel-threads", type=int, default=1, help="threads for the kernel-vs-torch comparison")
    ap.add_argument("--kernels-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(REPO / "docs" / "results" / "compiled.json"))
    ap.add_argument("--md", default=str(REPO / "docs" / "results" / "compiled.md"))
    ap.add_argument("--note", action="append", default=[], help="a line for the Notes section")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if args.kernels_child:
        return kernels_child(args)

    import torch

    from edgekv.compiler import compile_model, resolve_target
    from edgekv.models import load_model
    from edgekv.policies import make_policy
    from edgekv.runtime import HostRuntime

    _, tgt = resolve_target(args.target)
    # the target's cores, but no more than this process may run on (a pinned shell on a shared
    # box: two threads on one CPU make every parallel region wait for a descheduled thread)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = min(int(tgt.get("num-cores", os.cpu_count() or 1)), allowed)
    torch.set_num_threads(threads)
    # TVM sizes its pool on first use from TVM_NUM_THREADS, else from the CPUs this process may
    # run on; pin it to the target's cores so TVM and torch run the same count
    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    from edgekv.evaluation.report import provenance

    r: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load_avg(),
               **provenance([sys.executable, *sys.argv])}
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except Exception:  # noqa: BLE001
        pass
    r["setup"] = {"model": args.model, "policy": args.policy, "budget": args.budget, "block": args.block,
                  "target": json.dumps(tgt), "threads": threads, "cpu": f"{cpu} ({os.cpu_count()} cores visible)",
                  "weights": args.weights, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
                  "tvm_num_threads_env": os.environ.get("TVM_NUM_THREADS"),
                  "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    model = load_model(args.model)
    policy = make_policy(args.policy)
    r["setup"]["block_gflop"] = block_gflop(model.config, args.budget, args.block)
    art = Path(args.artifact)
    if not (args.reuse_artifact and (art / "manifest.json").exists()):
        print("compiling …", flush=True)
        t0 = time.perf_counter()
        res = compile_model(model, policy, args.budget, args.block, target=args.target, out_dir=art,
                            weights=args.weights)
        total = time.perf_counter() - t0
        if "compile-time" not in skip:
            r["compile"] = {"total_seconds": total, "timings": res.manifest["timings"]}
        print(f"  compiled in {total:.1f} s", flush=True)
    rt = HostRuntime(art, expected_weight_hash=model.weight_hash)
    built = rt.manifest.weights["format"]
    if built != args.weights:
        raise SystemExit(f"{art} holds {built} weights, not --weights {args.weights}: drop --reuse-artifact "
                         f"or pass --weights {built}")
    if "profile" not in skip:
        print("profiling an evicting block …", flush=True)
        r["profile"] = profile_block(rt)
        r["profile"]["reps"] = 3
        for k, v in r["profile"]["by_kind"].items():
            print(f"  {k:32s} {v['seconds']*1e3:8.1f} ms {100*v['share']:5.1f} %", flush=True)
    if "gemm" not in skip:
        import tvm

        print(f"kernels vs torch at {args.kernel_threads} thread(s) …", flush=True)
        r["kernels"] = run_kernels(args)
    if "e2e" not in skip:
        r["e2e"] = {}
        hf = None
        for plen in [int(x) for x in args.prompts.split(",") if x]:
            ids = prompt_ids(model, plen)
            systems = ["edgekv compiled"] + ([] if "eager" in skip else ["edgekv eager (BlockEngine)"]) + (
                [] if "hf" in skip else ["HF transformers (full cache)"]) + (
                [] if "llamacpp" in skip else ["llama.cpp (full cache, same GGUF)"])
            runs: dict[str, list] = {k: [] for k in systems}
            # repeats alternate the order (A B C, C B A, …) so a load swing hits every system alike;
            # the table reports each system's best run, the JSON keeps all of them
            for rep in range(args.repeats):
                for name in (systems if rep % 2 == 0 else systems[::-1]):
                    print(f"prompt {plen}: {name} (run {rep + 1}) …", flush=True)
                    time.sleep(QUIESCE_S)
                    try:
                        if name == "edgekv compiled":
                            v = bench_compiled_run(rt, ids, args.decode_tokens)
                        elif name.startswith("edgekv eager"):
                            v = bench_eager_run(model, policy, args.budget, args.block, ids, args.decode_tokens)
                        elif name.startswith("llama.cpp"):
                            v = bench_llamacpp_run(args.model, ids, threads, args.decode_tokens)
                        else:
                            hf = hf or model.to_hf().eval()
                            v = bench_hf_run(hf, ids, args.decode_tokens)
                    except Exception as e:  # noqa: BLE001
                        v = {"error": f"{type(e).__name__}: {e}"}
                    v["load"] = load_avg()
                    runs[name].append(v)
                    print(f"  {v}", flush=True)
            rows = {}
            for name, vs in runs.items():
                ok = [v for v in vs if "error" not in v]
                if not ok:
                    rows[name] = vs[0]
                    continue
                # the median run by prefill speed (the table's row), decode as the median of the runs
                ranked = sorted(ok, key=lambda v: v["prefill_tok_s"])
                row = dict(ranked[(len(ranked) - 1) // 2])
                row["decode_tok_s"] = statistics.median(v["decode_tok_s"] for v in ok)
                row["runs"] = vs
                rows[name] = row
            r["e2e"][str(plen)] = rows
    r["load_after"] = load_avg()
    r["targets"] = targets(r)
    r["notes"] = list(args.note)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=2))
    write_markdown(r, Path(args.md))
    print(f"wrote {args.json} and {args.md}")
    return 0


def prefill_gap(r: dict) -> list[str]:
    """Lines that turn the prefill target into a time budget per block and set each kernel kind's
    share of the measured block against it (from this run's profile and whole-model rows)."""
    e2e, p = r.get("e2e", {}), r.get("profile")
    longest = max(e2e, key=int) if e2e else None
    if not longest or not p:
        return []
    c, h = e2e[longest].get("edgekv compiled"), e2e[longest].get("HF transformers (full cache)")
    if not c or not h or "error" in c or "error" in h:
        return []
    B = r["setup"]["block"]
    need = 2 * h["prefill_tok_s"]
    budget_ms = 1e3 * B / need
    block_ms = 1e3 * B / c["prefill_tok_s"]
    out = [f"2× HF at {longest} tokens is {need:.0f} tok/s: a block of {B} tokens must take ≤ {budget_ms:.0f} ms "
           f"end to end; it takes {block_ms:.0f} ms ({c['prefill_tok_s']:.0f} tok/s, the median run), "
           f"{block_ms / budget_ms:.2f}× the budget. The profiled block (a timer around every kernel call) "
           f"took {p['block_seconds_instrumented'] * 1e3:.0f} ms, its kernels {p['kernels_seconds'] * 1e3:.0f} ms; "
           "the table scales each kernel kind's profiled time by the factor that would bring the whole block "
           "to the budget, i.e. what each kind must reach if all improve alike.\n"]
    gflop = r["setup"].get("block_gflop", {})
    scale = budget_ms / block_ms  # every kernel faster by the same factor would just meet the target
    out.append("| kernel kind | ms now | ms if all shrink alike to the budget | GFLOP/s now → needed |\n"
               "|---|---|---|---|")
    for k, v in p["by_kind"].items():
        ms = v["seconds"] * 1e3
        rate = (f"{gflop[k] / v['seconds']:.0f} → {gflop[k] / (v['seconds'] * scale):.0f}"
                if k in gflop and v["seconds"] else "")
        out.append(f"| {k} | {ms:.1f} | {ms * scale:.1f} | {rate} |")
    return out


def targets(r: dict) -> list[dict]:
    out = []
    e2e = r.get("e2e", {})
    longest = max(e2e, key=int) if e2e else None
    if longest:
        rows = e2e[longest]
        c, h = rows.get("edgekv compiled"), rows.get("HF transformers (full cache)")
        if c and h and "error" not in h:
            ratio = c["prefill_tok_s"] / h["prefill_tok_s"]
            out.append({"target": f"compiled prefill ≥ 2× HF eager at {longest} tokens",
                        "measured": f"{ratio:.2f}× ({c['prefill_tok_s']:.0f} vs {h['prefill_tok_s']:.0f} tok/s)",
                        "met": "yes" if ratio >= 2 else "no"})
            dr = c["decode_tok_s"] / h["decode_tok_s"]
            out.append({"target": "decode at N = 1K ≥ HF eager decode (full cache, same position)",
                        "measured": f"{dr:.2f}× ({c['decode_tok_s']:.1f} vs {h['decode_tok_s']:.1f} tok/s)",
                        "met": "yes" if dr >= 1 else "no"})
    if "profile" in r:
        s = r["profile"]["eviction_share"]
        out.append({"target": "eviction ≤ 2 % of an evicting block", "measured": f"{100*s:.2f} %",
                    "met": "yes" if s <= 0.02 else "no"})
    if "compile" in r:
        t = r["compile"]["total_seconds"]
        out.append({"target": "compile < 5 min", "measured": f"{t:.0f} s", "met": "yes" if t < 300 else "no"})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
