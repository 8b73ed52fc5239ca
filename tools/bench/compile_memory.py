"""Where a compile's memory goes, measured on parts: a random model at Qwen2.5-1.5B's geometry
(hidden 1536, FFN 8960, 12 / 2 heads, head dim 128, vocab 151,936, untied head) truncated to a few
layers, compiled q4 KeyDiff (N = 8K, B = 128, host) in a child process per run, each run's peak RSS
(``ru_maxrss`` of the child) and time; the same runs with another checkout's code (``--baseline``,
e.g. /work/main) interleaved, and a linear fit per side extrapolated to 28 layers.

    flock /work/wt/heavy.lock /work/wt/capped 12 python tools/bench/compile_memory.py --layers 1,2 \\
        --baseline /work/main -o docs/results/compile_memory

Writes ``<out>.json`` and ``<out>.md``. The weights are random (the fp32 → Q4_1 quantiser runs on
every matrix: a real Q4_K_M file keeps most of its blocks), so the figures bound the real compile's
layout step from above; the export, passes and TVM build are the same graph."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import resource, sys, time, torch
from transformers import Qwen2Config
from edgekv.models.config import config_from_hf
from edgekv.models.loaded import LoadedModel
from edgekv.compiler import compile_model
from edgekv.policies import make_policy
layers, vocab = int(sys.argv[1]), int(sys.argv[2])
hf = Qwen2Config(vocab_size=vocab, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                 rms_norm_eps=1e-6)
g = torch.Generator().manual_seed(0)
def rnd(*shape):
    return torch.randn(*shape, generator=g) * 0.02
w = {"model.embed_tokens.weight": rnd(vocab, 1536), "lm_head.weight": rnd(vocab, 1536),
     "model.norm.weight": torch.ones(1536)}
for i in range(layers):
    p = f"model.layers.{i}."
    w |= {p + "input_layernorm.weight": torch.ones(1536), p + "post_attention_layernorm.weight": torch.ones(1536),
          p + "self_attn.q_proj.weight": rnd(1536, 1536), p + "self_attn.q_proj.bias": rnd(1536),
          p + "self_attn.k_proj.weight": rnd(256, 1536), p + "self_attn.k_proj.bias": rnd(256),
          p + "self_attn.v_proj.weight": rnd(256, 1536), p + "self_attn.v_proj.bias": rnd(256),
          p + "self_attn.o_proj.weight": rnd(1536, 1536), p + "mlp.gate_proj.weight": rnd(8960, 1536),
          p + "mlp.up_proj.weight": rnd(8960, 1536), p + "mlp.down_proj.weight": rnd(1536, 8960)}
model = LoadedModel(model_id=f"qwen-geometry-{layers}", config=config_from_hf(hf), hf_config=hf, weights=w)
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
compile_model(model, make_policy("keydiff"), 8192, 128, target="host", weights="q4")
print("RESULT", loaded, sum(t.numel() * 4 for t in w.values()), time.perf_counter() - t0)
'''


def run(code_root: str, layers: int, vocab: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("EDGEKV_SITE", "/work/wtsite"),
                                                                    code_root])))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(layers), str(vocab)], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if proc.returncode != 0 or line is None:
        return {"code": code_root, "layers": layers, "error": proc.stderr[-2000:], "returncode": proc.returncode}
    loaded, weight_bytes, compile_s = line.split()[1:]
    return {"code": code_root, "layers": layers, "peak_rss_bytes_upper": peak, "loaded_rss_bytes": int(loaded),
            "fp32_weight_bytes": int(weight_bytes), "compile_s": float(compile_s), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--baseline", default=None, help="another checkout to measure in the same run (e.g. /work/main)")
    ap.add_argument("-o", "--out", default="docs/results/compile_memory")
    args = ap.parse_args()
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])  # captured before the run
    here = str(Path(__file__).resolve().parents[2])
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for code in ([args.baseline] if args.baseline else []) + [here]:
            # RUSAGE_CHILDREN is a high-water mark over all children: run each in its own wrapper
            out = subprocess.run([sys.executable, __file__, "--one", code, str(layers), str(args.vocab)],
                                 capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else
                        {"code": code, "layers": layers, "error": out.stderr[-2000:]})
            print(rows[-1], flush=True)
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores, shared with other jobs",
              "what": "q4 KeyDiff N=8192 B=128 host compile of a random model at Qwen2.5-1.5B geometry, L layers",
              "rows": rows, "provenance": prov}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = ["# Compile memory on parts (issue 30)", "", f"`{' '.join(sys.argv)}` — {result['machine']}.", "",
             "| code | layers | fp32 weights | RSS after load | peak RSS | compile s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['code']} | {r['layers']} | failed | | | |")
            continue
        gib = 2 ** 30
        lines.append(f"| {r['code']} | {r['layers']} | {r['fp32_weight_bytes'] / gib:.2f} GiB | "
                     f"{r['loaded_rss_bytes'] / gib:.2f} GiB | {r['peak_rss_bytes_upper'] / gib:.2f} GiB | "
                     f"{r['compile_s']:.0f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
