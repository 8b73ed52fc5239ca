"""The ONNX input path on the real model: SmolLM2 → ONNX → `edgekv compile model.onnx`.

For each ONNX form (plain: input_ids, position_ids → logits; past: HF/optimum layout with
attention_mask and past_key_values inputs):
  1. export SmolLM2-135M with torch.onnx.export (`edgekv.compiler.frontend.onnx_export`);
  2. ONNX Runtime on that file vs HF transformers on the same prompt (whole prompt, all positions);
  3. compile from the ONNX file and from torch.export (same policy, N, B), run the prompt block by
     block through both artifacts: kept positions after every block (all layers × KV heads) and
     last-token logits, then a few decode steps;
  4. compile from the ONNX file at full budget (N ≥ prompt + decode): last-token logits vs ONNX
     Runtime on the whole prompt, and after each decode step.
Writes docs/results/onnx_agreement.{json,md}.

    python tools/experiments/check_onnx_path.py --budget 512 --tokens 1024 --forms plain,past
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from edgekv.compiler import compile_model
from edgekv.compiler.frontend.onnx_export import export_onnx, onnxruntime_logits
from edgekv.compiler.frontend.onnx_model import load_onnx_model
from edgekv.corpus import natural_token_ids
from edgekv.evaluation.report import provenance
from edgekv.models import load_model
from edgekv.policies import make_policy
from edgekv.runtime import HostRuntime

ROOT = Path(__file__).resolve().parents[2]
DECODE = 3


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def timed_compile(model, policy, budget, block, out):
    t0 = time.perf_counter()
    compile_model(model, make_policy(policy), budget, block, "host", out)
    return HostRuntime(out), time.perf_counter() - t0


def compare_artifacts(rt_onnx, rt_torch, ids, block, layers):
    """Block by block: kept entries identical (all layers × heads) and the worst logits error."""
    same = total = 0
    worst = 0.0
    for start in range(0, ids.size, block):
        chunk = ids[start:start + block]
        a, b = rt_onnx.step_block(chunk), rt_torch.step_block(chunk)
        worst = max(worst, rel(a, b))
        for layer in range(layers):
            ka, kb = rt_onnx.kept_positions(layer), rt_torch.kept_positions(layer)
            for h in range(ka.shape[0]):
                sa, sb = set(ka[h].tolist()), set(kb[h].tolist())
                total += len(sb)
                same += len(sa & sb)
    decode_worst = 0.0
    for _ in range(DECODE):
        tok = int(np.argmax(a))
        a, b = rt_onnx.decode(tok), rt_torch.decode(tok)
        decode_worst = max(decode_worst, rel(a, b))
    return {"kept_entries_compared": total, "kept_entries_identical": same, "prefill_logits_max_rel": worst,
            "decode_logits_max_rel": decode_worst, "same_argmax_after_decode": int(np.argmax(a)) == int(np.argmax(b))}


def full_budget_vs_ort(rt, path, ids):
    logits = rt.prefill(ids)
    errs = [rel(logits, onnxruntime_logits(path, ids)[-1])]
    seq = ids.tolist()
    for _ in range(DECODE):
        seq.append(int(np.argmax(logits)))
        logits = rt.decode(seq[-1])
        errs.append(rel(logits, onnxruntime_logits(path, seq)[-1]))
    return {"prefill_last_logits_rel": errs[0], "decode_logits_max_rel": max(errs[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--forms", default="plain,past")
    ap.add_argument("--work", default="build/onnx-check", help="folder for the ONNX exports and artifacts")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "onnx_agreement"))
    args = ap.parse_args()
    work = Path(args.work)
    model = load_model("smollm2-135m")
    ids = natural_token_ids(model.tokenizer, args.tokens).numpy()
    with torch.no_grad():
        hf_logits = model.to_hf()(torch.from_numpy(ids)[None]).logits[0].numpy()
    rt_torch, torch_compile_s = timed_compile(model, args.policy, args.budget, args.block, work / "torch")
    full_budget = -(-(ids.size + DECODE) // args.block) * args.block
    result = {"model": "smollm2-135m", "policy": args.policy, "budget": args.budget, "block": args.block,
              "prompt_tokens": int(ids.size), "full_budget": full_budget, "decode_steps": DECODE,
              "torch_compile_s": torch_compile_s, "load": " ".join(f"{x:.1f}" for x in os.getloadavg()), "forms": {},
              **provenance([sys.executable, *sys.argv])}
    for form in args.forms.split(","):
        t0 = time.perf_counter()
        path = export_onnx(model, work / f"onnx-{form}", form)
        row = {"export_s": time.perf_counter() - t0, "onnx_bytes": path.stat().st_size}
        row["ort_vs_hf_all_positions_rel"] = rel(onnxruntime_logits(path, ids), hf_logits)
        onnx_model = load_onnx_model(path)
        rt_onnx, row["compile_s"] = timed_compile(onnx_model, args.policy, args.budget, args.block, work / f"art-{form}")
        rt_torch.reset()
        row["vs_torch_artifact"] = compare_artifacts(rt_onnx, rt_torch, ids, args.block, model.config.num_layers)
        rt_full, row["full_compile_s"] = timed_compile(onnx_model, "full", full_budget, args.block, work / f"full-{form}")
        row["full_budget_vs_ort"] = full_budget_vs_ort(rt_full, path, ids)
        result["forms"][form] = row
        print(form, json.dumps(row, indent=2), flush=True)
        write(result, args)  # after every form: a long run cut short keeps what it measured


def write(result: dict, args) -> None:
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result, args))


def markdown(r: dict, args) -> str:
    lines = [
        "# ONNX input: SmolLM2-135M exported to ONNX, compiled from the ONNX file",
        "",
        f"`python tools/experiments/check_onnx_path.py --policy {args.policy} --budget {args.budget} --block {args.block} "
        f"--tokens {args.tokens} --forms {args.forms}` — {r['prompt_tokens']} prompt tokens of natural text, "
        f"{r['decode_steps']} greedy decode steps, fp32, target `host`, load average {r['load']} (shared 2-core box). "
        f"Commit `{r.get('commit', 'not recorded')}`.",
        "",
        "| | " + " | ".join(r["forms"]) + " |",
        "|---|" + "---|" * len(r["forms"]),
    ]
    rows = [
        ("ONNX Runtime on the exported file vs HF transformers (all positions, max rel.)",
         lambda f: f"{f['ort_vs_hf_all_positions_rel']:.1e}"),
        (f"kept entries identical, ONNX artifact vs torch.export artifact ({r['policy']}, N = {r['budget']}, "
         f"B = {r['block']}, after every block, all layers × KV heads)",
         lambda f: f"{f['vs_torch_artifact']['kept_entries_identical']:,} / {f['vs_torch_artifact']['kept_entries_compared']:,}"),
        ("prefill logits, ONNX vs torch artifact (worst block, max rel.)",
         lambda f: f"{f['vs_torch_artifact']['prefill_logits_max_rel']:.1e}"),
        (f"decode logits, ONNX vs torch artifact ({r['decode_steps']} steps, max rel.)",
         lambda f: f"{f['vs_torch_artifact']['decode_logits_max_rel']:.1e}"),
        (f"full budget (N = {r['full_budget']}): ONNX artifact vs ONNX Runtime, last prompt token (rel.)",
         lambda f: f"{f['full_budget_vs_ort']['prefill_last_logits_rel']:.1e}"),
        ("full budget: decode steps vs ONNX Runtime on prompt + generated tokens (max rel.)",
         lambda f: f"{f['full_budget_vs_ort']['decode_logits_max_rel']:.1e}"),
        ("export / compile (policy) / compile (full) time",
         lambda f: f"{f['export_s']:.0f} / {f['compile_s']:.0f} / {f['full_compile_s']:.0f} s"),
    ]
    for name, fmt in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(f) for f in r["forms"].values()) + " |")
    lines += ["", f"torch.export artifact compile time: {r['torch_compile_s']:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
