"""Where a compile's memory goes, measured on parts: a random model at Qwen2.5-1.5B's geometry
(hidden 1536, FFN 8960, 12 / 2 heads, head dim 128, vocab 151,936, untied head) truncated to a few
layers, compiled q4 KeyDiff (N = 8K, B = 128, host) in a child process per run, each run's peak RSS
(``ru_maxrss`` of the child) and time; the same runs with another checkout's code (``--baseline``,
e.g. /work/main) interleaved, and a linear fit per side extrapolated to 28 layers.

    flock /work/wt/heavy.lock /work/wt/capped 12 python tools/bench/compile_memory.py --layers 1,2 \\
        --baseline /work/main -o docs/results/compile_memory

``--gguf FILE``: the same on the real file instead — its config truncated to L layers, the weights
left in the file (``models.gguf_weights.GGUFWeights``: what ``edgekv compile`` does), so the
K-quant blocks, the embedding's Q8_0 re-store and the F32 tensors are the real ones.
``--command 'edgekv compile …'``: one whole compile under ``/usr/bin/time -v`` (max RSS, wall
time), written to the same results files.

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


GGUF_CHILD = r'''
import io, contextlib, resource, sys, time
from pathlib import Path
from transformers import AutoConfig
from edgekv.models.config import config_from_hf
from edgekv.models.gguf_weights import GGUFWeights
from edgekv.models.loaded import LoadedModel
from edgekv.models.loader import check_gguf, _gguf_arch
from edgekv.compiler import compile_model
from edgekv.policies import make_policy
layers, path = int(sys.argv[1]), Path(sys.argv[2])
reader = check_gguf(path)
with contextlib.redirect_stderr(io.StringIO()):
    hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
hf.num_hidden_layers = layers
w = GGUFWeights(path, reader, hf, _gguf_arch(reader))
model = LoadedModel(model_id=f"{path.stem}-{layers}-layers", config=config_from_hf(hf), hf_config=hf, weights=w,
                    source=path, known_weight_hash="parts")
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
r = compile_model(model, make_policy("keydiff"), 8192, 128, target="host", weights="q4")
print("RESULT", loaded, w.fp32_bytes, time.perf_counter() - t0, sum(int(a.nbytes) for _, a in r.params))
'''


def run(code_root: str, layers: int, vocab: int, gguf: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("EDGEKV_SITE", "/work/wtsite"),
                                                                    code_root])))
    t0 = time.perf_counter()
    argv = [GGUF_CHILD, str(layers), gguf] if gguf else [CHILD, str(layers), str(vocab)]
    proc = subprocess.run([sys.executable, "-c", *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if proc.returncode != 0 or line is None:
        return {"code": code_root, "layers": layers, "error": proc.stderr[-2000:], "returncode": proc.returncode}
    loaded, weight_bytes, compile_s, *stored = line.split()[1:]
    return {"code": code_root, "layers": layers, "peak_rss_bytes_upper": peak, "loaded_rss_bytes": int(loaded),
            "fp32_weight_bytes": int(weight_bytes), "compile_s": float(compile_s), "wall_s": wall,
            **({"params_bytes": int(stored[0])} if stored else {})}


def run_command(command: str) -> dict:
    """One whole compile under ``/usr/bin/time -v``: its max RSS and wall time, and its output's tail."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "bash", "-c", command], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    field = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in proc.stderr.splitlines()
             if ln.startswith("\t") and ":" in ln}
    return {"command": command, "returncode": proc.returncode, "wall_s": wall,
            "max_rss_bytes": int(field.get("Maximum resident set size (kbytes)", 0)) * 1024,
            "user_s": float(field.get("User time (seconds)", 0)), "system_s": float(field.get("System time (seconds)", 0)),
            "output_tail": (proc.stdout + proc.stderr)[-3000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--baseline", default=None, help="another checkout to measure in the same run (e.g. /work/main)")
    ap.add_argument("--gguf", default=None, help="measure parts of this GGUF (its first L layers, weights in the file)")
    ap.add_argument("--command", default=None, help="measure one whole compile command under /usr/bin/time -v")
    ap.add_argument("-o", "--out", default="docs/results/compile_memory")
    args = ap.parse_args()
    if args.command:
        return write_command_result(args)
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])  # captured before the run
    here = str(Path(__file__).resolve().parents[2])
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for code in ([args.baseline] if args.baseline else []) + [here]:
            # RUSAGE_CHILDREN is a high-water mark over all children: run each in its own wrapper
            out = subprocess.run([sys.executable, __file__, "--one", code, str(layers), str(args.vocab),
                                  *([args.gguf] if args.gguf else [])], capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else
                        {"code": code, "layers": layers, "error": out.stderr[-2000:]})
            print(rows[-1], flush=True)
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores, shared with other jobs",
              "what": (f"q4 KeyDiff N=8192 B=128 host compile of {Path(args.gguf).name}'s first L layers, weights "
                       "left in the file" if args.gguf else
                       "q4 KeyDiff N=8192 B=128 host compile of a random model at Qwen2.5-1.5B geometry, L layers"),
              "rows": rows, "provenance": prov}
    ok = sorted((r["layers"], r["peak_rss_bytes_upper"], r["compile_s"]) for r in rows
                if "error" not in r and r["code"] == here)
    if len(ok) >= 2 and ok[-1][0] != ok[0][0]:  # a line through the smallest and largest: per layer and at 28
        (l0, m0, t0), (l1, m1, t1) = ok[0], ok[-1]
        per_m, per_t = (m1 - m0) / (l1 - l0), (t1 - t0) / (l1 - l0)
        result["extrapolated_28_layers"] = {"peak_rss_bytes": int(m0 + per_m * (28 - l0)), "per_layer_rss_bytes": int(per_m),
                                            "compile_s": t0 + per_t * (28 - l0), "per_layer_s": per_t}
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
    if "extrapolated_28_layers" in result:
        e = result["extrapolated_28_layers"]
        lines += ["", f"A line through the smallest and largest runs, at 28 layers: peak {e['peak_rss_bytes'] / 2**30:.2f} GiB "
                  f"({e['per_layer_rss_bytes'] / 2**20:.0f} MiB per layer), compile {e['compile_s']:.0f} s "
                  f"({e['per_layer_s']:.1f} s per layer)."]
    lines += ["", "The machine was shared with other jobs (2 cores, 24 GiB, several helpers): times are upper bounds."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


def write_command_result(args) -> None:
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    r = run_command(args.command)
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores, shared with other jobs", **r, "provenance": prov}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    gib = 2 ** 30
    lines = ["# One whole compile (issue 30)", "", f"`{' '.join(sys.argv)}` — {result['machine']}.", "",
             "| command | exit | wall | user + sys CPU | max RSS |", "|---|---|---|---|---|",
             f"| `{r['command']}` | {r['returncode']} | {r['wall_s']:.0f} s | {r['user_s'] + r['system_s']:.0f} s | "
             f"{r['max_rss_bytes'] / gib:.2f} GiB |", "",
             "Max RSS is `/usr/bin/time -v`'s (the process tree's largest resident set). The machine was shared with "
             "other jobs (2 cores, 24 GiB, several helpers): the wall time is an upper bound.", "",
             "Output's tail:", "", "```", r["output_tail"].strip(), "```"]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--one":
        print(json.dumps(run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *(sys.argv[5:]))))
    else:
        main()
