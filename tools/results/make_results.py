"""Regenerate docs/RESULTS.md from the section files under docs/results/ (SECTIONS, in order).

Each section is written by the command that measured it, and names it: a tool under tools/
(tools/README.md lists which tool writes which file) or an edgekv command:
  bench/bench.md         edgekv bench --out docs/results/bench   (speed + memory, peers side by side)
  bench_native/bench.md  edgekv bench --systems edgekv-compiled,edgekv-native -o docs/results/bench_native
  bench_q4/bench.md      edgekv bench --artifact <q4> --fp32-artifact <fp32>
                         --systems edgekv-native,edgekv-native-fp32,edgekv-compiled,llamacpp
  eval_rocketkv/results.md  edgekv eval --task fidelity --policy snapkv++,rocketkv --budget 2k --fidelity-lengths 4k
  eval_kv_int8/{fp32,int8}/results.md  edgekv eval --task passkey --policy keydiff,snapkv++ --lengths 4k,7k
                --budget 594 (fp32) / --budget 2535 --kv-dtype int8: the N that 32MiB buys in each format
  eval_kv_int8/fidelity_{fp32,int8}/results.md  the same pair, --task fidelity --fidelity-lengths 4k,7k
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = [
    ("The README's main job", "demo.md"),
    ("Threads: idle and loaded", "threads.md"),
    ("Accuracy on SmolLM2-135M", "accuracy.md"),
    ("Speed and memory, peers side by side", "bench/bench.md"),
    ("The native runtime against TVM's VM on the same artifact (a quiet run)", "bench_native/bench.md"),
    ("Against llama.cpp's own llama-bench (same GGUF, same threads, one run)", "peer_llama_cpp.md"),
    ("4-bit weights: speed and memory against llama.cpp (one run)", "bench_q4/bench.md"),
    ("4-bit weights: the kernels against the memory bandwidth", "weight_kernels.md"),
    ("4-bit weights: fidelity against fp32 and llama.cpp", "weights_fidelity.md"),
    ("4-bit weights: passkey answers against fp32", "weights_passkey.md"),
    ("Compiled kernels on the host CPU", "compiled.md"),
    ("Compile time", "compile_time.md"),
    ("Compiled model vs the reference engine: KeyDiff", "compiled_agreement.md"),
    ("Compiled model vs the reference engine: DapQ", "compiled_agreement_dapq.md"),
    ("Compiled model vs the reference engine: D2O", "compiled_agreement_d2o.md"),
    ("ONNX input vs the torch.export path", "onnx_agreement.md"),
    ("Native runtime vs HostRuntime and the eager engine", "native_agreement.md"),
    ("Native runtime footprint", "native_footprint.md"),
    ("Native runtime on aarch64 (qemu-user)", "native_aarch64.md"),
    ("Native runtime on aarch64 (qemu-user), int8 KV cache", "native_aarch64_int8.md"),
    ("The OpenCL path end to end (PoCL)", "opencl.md"),
    ("The OpenCL path with 4-bit weights (PoCL)", "opencl_q4.md"),
    ("Read once, ask many: saved document caches", "snapshot.md"),
    ("RocketKV's sparse decode against SnapKV++, compiled", "rocketkv.md"),
    ("An int8 KV cache against fp32 (eager engine)", "kv_int8.md"),
    ("An int8 KV cache compiled (native runtime)", "kv_int8_compiled.md"),
    ("RocketKV's fidelity against SnapKV++ (eager, teacher-forced through decode)", "eval_rocketkv/results.md"),
    ("Passkey at equal KV bytes (32 MiB): fp32 cache, N = 594", "eval_kv_int8/fp32/results.md"),
    ("Passkey at equal KV bytes (32 MiB): int8 cache, N = 2535", "eval_kv_int8/int8/results.md"),
    ("Fidelity at equal KV bytes (32 MiB), 4K and 7K texts: fp32 cache, N = 594", "eval_kv_int8/fidelity_fp32/results.md"),
    ("Fidelity at equal KV bytes (32 MiB), 4K and 7K texts: int8 cache, N = 2535",
     "eval_kv_int8/fidelity_int8/results.md"),
    ("SnapKV against SnapKV++ on long passkeys: pooling and kernel", "snapkv_pooling.md"),
    ("Many questions of one saved document, varied haystack (the repeated-filler `--question` sweep quoted)",
     "question_sweep.md"),
    ("The `--question` demo: a 7K-token document", "question_demo.md"),
    ("7K prompts at N = 512 with the question: pooling kernels", "question_kappa_7k.md"),
    ("What the 7K, N = 512 misses are", "question_misses.md"),
    ("DapQ's switches one at a time", "dapq_ablation.md"),
    ("Memory-limited simulation and device estimates", "simulate.md"),
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    results = ROOT / "docs" / "results"
    parts = ["# edgekv results\n",
             "Every number below is produced by a command in this repository; each section names its "
             "command, the machine and the commit. Sections not yet measured say so.\n"]
    for title, name in SECTIONS:
        parts.append(f"## {title}\n")
        path = results / name
        if path.is_file():
            text = path.read_text().strip()
            # section files carry their own top heading; demote it under ours
            lines = text.splitlines()
            if lines and lines[0].startswith("# "):
                lines = lines[1:]
            body = "\n".join(("#" + l) if l.startswith("#") else l for l in lines)
            if "/" in name:  # a results folder of its own (edgekv bench / eval -o docs/results/<folder>)
                folder = name.rsplit("/", 1)[0]
                body = re.sub(r"\]\(([^)/:]+\.png)\)", lambda m: f"](results/{folder}/{m.group(1)})", body)
            else:
                body = body.replace("](", "](results/").replace("](results/http", "](http").replace("](results/results/", "](results/")
            parts.append(body + "\n")
        else:
            parts.append(f"Not measured yet (`{name}` is missing).\n")
    (ROOT / "docs" / "RESULTS.md").write_text("\n".join(parts))
    print("wrote docs/RESULTS.md")


if __name__ == "__main__":
    main()
