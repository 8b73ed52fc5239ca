"""OpenCL launches per decode token and per prefill block, and the device time split by kind, on PoCL.

An OpenCL artifact run by the native runtime launches one OpenCL kernel per device kernel call of
its host code. With ``EDGEKV_OPENCL_PROFILE=1`` the runtime (runtime/src/device_opencl.c) records a
profiling event per launch and prints, at close, every kernel's launches and device nanoseconds.
This tool runs an artifact three times with that on and takes differences, so that loading,
the first block, the kernel build and the `prepare` function cancel out:

  A: a prompt of ``--blocks`` full blocks, one new token (the token comes from the prefill logits)
  D: the same prompt, 1 + ``--decode`` new tokens      → (D - A) / decode = one decode token
  P: a prompt of ``--blocks`` + 1 full blocks, one token → P - A = one prefill block

Each kernel is classed by its name (GEMV, GEMM, attention, score, select, norm, RoPE, ...). PoCL
runs OpenCL on this machine's CPU, so times say where a CPU spends the kernels' time, not what a
GPU would; the launch counts are the target's own (the same kernels on every OpenCL device).

    # an artifact built by this checkout (SmolLM2 q4 KeyDiff, N = 512, B = 128), recorded as "after"
    python tools/bench/opencl_launches.py --compile after
    # an artifact built elsewhere (e.g. by main's code), recorded as "before"
    python tools/bench/opencl_launches.py --artifact before=/tmp/kd_main
    # the q4 GEMV schedule candidates on a SmolLM2-shaped two-layer model (--schedules)
    python tools/bench/opencl_launches.py --schedules

Results merge into docs/results/opencl_launches.json (one entry per label, each with its own
provenance) and the markdown table docs/results/opencl_launches.md is rewritten from all entries.
``EDGEKV_RUN`` picks the edgekv-run binary (default: the one on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
PROFILE_LINE = re.compile(r"^edgekv opencl profile: (\S+) launches (\d+) ns (\d+)$")
TRACE_LINE = re.compile(r"^edgekv opencl: (\S+) groups (\d+)x(\d+)x(\d+) local (\d+)x(\d+)x(\d+)$")
SMOLLM2 = ["smollm2-135m", "--target", "opencl-host", "--weights", "q4", "--policy", "keydiff", "--budget", "512",
           "--block", "128"]
# name patterns, first match wins: the kinds the time split reports (the fused decode kernels of
# passes/gate_up_silu.py and passes/norm_gemv.py are GEMVs with a prologue / epilogue)
KINDS = [("gemv", r"matmul_(.*gemv|nt_)|^norm_(qkv_rope|gate_up_silu)_|^gate_up_silu_"), ("gemm", r"matmul"), ("attention", r"_attention_"),
         ("select", r"_select_"), ("score", r"_score_"), ("observe", r"_observe_"),
         ("norm", r"rms_norm|power|mean|rsqrt"), ("rope", r"sin|cos|negative|concatenate"),
         ("embedding", r"take"), ("elementwise", r".")]


def kind_of(name: str) -> str:
    return next(k for k, rx in KINDS if re.search(rx, name))


def runner() -> str:
    exe = os.environ.get("EDGEKV_RUN") or shutil.which("edgekv-run")
    if not exe:
        sys.exit("no edgekv-run: pip install -e . (or set EDGEKV_RUN to a build of runtime/)")
    return exe


def prompt_ids(n: int, vocab: int) -> str:
    """n deterministic token ids spread over the vocabulary (no special ids at its start)."""
    lo = min(100, vocab // 4)
    return ",".join(str(lo + (i * 7919) % (vocab - lo)) for i in range(n))


def run_once(artifact: Path, n_prompt: int, new_tokens: int, vocab: int) -> dict:
    """{kernel: {launches, ns, groups, local}} of one run of ``artifact``."""
    env = dict(os.environ, EDGEKV_OPENCL_PROFILE="1", EDGEKV_OPENCL_TRACE="1")
    cmd = [runner(), str(artifact), "--prompt-ids", prompt_ids(n_prompt, vocab), "--max-new-tokens",
           str(new_tokens), "--ignore-eos", "--quiet"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:2])} failed ({out.returncode}): {out.stderr[-2000:]}")
    kernels: dict[str, dict] = {}
    for line in out.stderr.splitlines():
        m = PROFILE_LINE.match(line)
        if m:
            k = kernels.setdefault(m.group(1), {})
            k["launches"], k["ns"] = int(m.group(2)), int(m.group(3))
            continue
        m = TRACE_LINE.match(line)
        if m:
            k = kernels.setdefault(m.group(1), {})
            k["groups"] = [int(x) for x in m.group(2, 3, 4)]
            k["local"] = [int(x) for x in m.group(5, 6, 7)]
    if not any("launches" in k for k in kernels.values()):
        sys.exit(f"{artifact}: the runtime printed no profile: is {runner()} built with EDGEKV_OPENCL_PROFILE support?")
    return kernels


def difference(more: dict, base: dict, per: int) -> dict:
    """Per-kernel (more - base) / per, kernels that launch in it only."""
    out = {}
    for name, k in more.items():
        b = base.get(name, {})
        n = (k.get("launches", 0) - b.get("launches", 0)) / per
        if n > 0:
            out[name] = {"kind": kind_of(name), "launches": n, "ms": (k.get("ns", 0) - b.get("ns", 0)) / per / 1e6,
                         "groups": k.get("groups"), "local": k.get("local")}
    return out


def split(kernels: dict) -> dict:
    """{kind: {launches, ms}} and the totals."""
    kinds: dict[str, dict] = {}
    for k in kernels.values():
        s = kinds.setdefault(k["kind"], {"launches": 0.0, "ms": 0.0})
        s["launches"] += k["launches"]
        s["ms"] += k["ms"]
    return {"launches": sum(k["launches"] for k in kernels.values()), "ms": sum(k["ms"] for k in kernels.values()),
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"]))}


def measure(artifact: Path, blocks: int, decode: int) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    block, vocab = int(manifest["block"]), int(manifest["model"]["config"]["vocab_size"])
    a = run_once(artifact, blocks * block, 1, vocab)
    d = run_once(artifact, blocks * block, 1 + decode, vocab)
    p = run_once(artifact, (blocks + 1) * block, 1, vocab)
    per_token, per_block = difference(d, a, decode), difference(p, a, 1)
    single = sorted({n for n, k in {**per_token, **per_block}.items()
                     if k["groups"] and k["local"] and all(x == 1 for x in k["groups"] + k["local"])})
    return {"artifact": str(artifact), "model": manifest["model"].get("id") or manifest["model"].get("name"),
            "policy": manifest["policy"]["name"] if isinstance(manifest["policy"], dict) else manifest["policy"],
            "budget": manifest["budget"], "block": block, "layers": manifest["num_layers"],
            "prompt_blocks": blocks, "decode_tokens": decode,
            "decode_token": {**split(per_token), "kernels": per_token},
            "prefill_block": {**split(per_block), "kernels": per_block},
            "single_work_item_kernels": single}


def compile_smollm2(out: Path, extra: list[str] | None = None) -> list[str]:
    cmd = ["edgekv", "compile", *SMOLLM2, *(extra or []), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return cmd


def schedule_trials(work: Path, choices: list[str], blocks: int, decode: int) -> dict:
    """Each q4 GEMV schedule choice on a SmolLM2-shaped two-layer model (hidden 576, 9 / 3 heads of
    64, MLP 1536): the per-token device time of its GEMVs."""
    from edgekv.compiler import compile_model
    from edgekv.models import tiny_random_model
    from edgekv.policies import make_policy
    from edgekv.compiler.backend.target import resolve_target

    model = tiny_random_model(seed=1, layers=2, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                              vocab=2048, tie_embeddings=True)
    out = {}
    for choice in choices:
        profile = dict(resolve_target("opencl-host")[0])
        profile["gpu_schedule"] = {**profile.get("gpu_schedule", {}), "gemv": choice}
        art = work / f"sched-{choice}"
        if art.exists():
            shutil.rmtree(art)
        compile_model(model, make_policy("keydiff"), 64, 32, profile, out_dir=art, weights="q4")
        r = measure(art, blocks, decode)
        gemv = {n: k for n, k in r["decode_token"]["kernels"].items() if k["kind"] == "gemv"}
        out[choice] = {"gemv_ms_per_token": sum(k["ms"] for k in gemv.values()),
                       "gemv_kernels": {n: {"ms": k["ms"], "groups": k["groups"], "local": k["local"]}
                                        for n, k in gemv.items()},
                       "decode_token_ms": r["decode_token"]["ms"], "launches_per_token": r["decode_token"]["launches"]}
        print(f"{choice}: GEMVs {out[choice]['gemv_ms_per_token']:.3f} ms per token "
              f"(all kernels {r['decode_token']['ms']:.3f} ms)", flush=True)
    return out


# ---- the markdown table ------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.1f}"


def markdown(doc: dict) -> str:
    runs = doc.get("runs", {})
    lines = ["# OpenCL launches per decode token and per prefill block (PoCL)", "",
             "Written by `tools/bench/opencl_launches.py` (each entry's command and commit are in "
             "`opencl_launches.json`). Launch counts are the artifact's own; times are PoCL's device time "
             "(OpenCL profiling events) on this machine's CPU, per decode token / per prefill block.", ""]
    if runs:
        lines += ["| run | model | launches / decode token | per layer | launches / block | device ms / token "
                  "| device ms / block | single-work-item kernels |", "|---|---|---|---|---|---|---|---|"]
        for label, r in runs.items():
            lines.append(f"| {label} | {r['model']} {r['policy']} N={r['budget']} B={r['block']} | "
                         f"{_fmt(r['decode_token']['launches'])} | {r['decode_token']['launches'] / r['layers']:.1f} | "
                         f"{_fmt(r['prefill_block']['launches'])} | {r['decode_token']['ms']:.2f} | "
                         f"{r['prefill_block']['ms']:.1f} | {len(r['single_work_item_kernels'])} |")
        for phase, title in (("decode_token", "one decode token"), ("prefill_block", "one prefill block")):
            lines += ["", f"## Time split by kind: {title}", "",
                      "| kind | " + " | ".join(f"{lbl} launches | {lbl} ms | {lbl} %" for lbl in runs) + " |",
                      "|---|" + "---|---|---|" * len(runs)]
            kinds = sorted({k for r in runs.values() for k in r[phase]["kinds"]})
            for kind in kinds:
                cells = []
                for r in runs.values():
                    s = r[phase]["kinds"].get(kind, {"launches": 0, "ms": 0.0})
                    total = r[phase]["ms"] or 1.0
                    cells.append(f"{_fmt(s['launches'])} | {s['ms']:.2f} | {100 * s['ms'] / total:.0f}")
                lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        for label, r in runs.items():
            lines += ["", f"## Kernels of one decode token: {label}", "",
                      "| kernel | kind | launches | ms | groups | local |", "|---|---|---|---|---|---|"]
            for name, k in sorted(r["decode_token"]["kernels"].items(), key=lambda kv: -kv[1]["ms"]):
                lines.append(f"| `{name}` | {k['kind']} | {_fmt(k['launches'])} | {k['ms']:.3f} | "
                             f"{'x'.join(map(str, k['groups'] or []))} | {'x'.join(map(str, k['local'] or []))} |")
    if doc.get("schedules"):
        s = doc["schedules"]
        lines += ["", "## q4 GEMV schedule candidates (PoCL)", "", s.get("about", ""), "",
                  "| gpu_schedule.gemv | GEMV ms / token | all kernels ms / token | GEMV share | launches / token |",
                  "|---|---|---|---|---|"]
        for choice, t in s["trials"].items():
            lines.append(f"| `{choice}` | {t['gemv_ms_per_token']:.3f} | {t['decode_token_ms']:.3f} | "
                         f"{100 * t['gemv_ms_per_token'] / t['decode_token_ms']:.0f}% | {_fmt(t['launches_per_token'])} |")
        lines += ["", "The GEMV share of the token's kernel time is the figure to compare: the machine is shared, "
                      "and a busy moment stretches every kernel of a run alike."]
        lines += ["", f"Command: `{s['provenance']['command']}` (commit {s['provenance']['commit']})."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from edgekv.evaluation.report import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", action="append", default=[], metavar="LABEL=DIR",
                    help="measure an existing OpenCL artifact under LABEL")
    ap.add_argument("--compile", action="append", default=[], metavar="LABEL",
                    help="compile SmolLM2 q4 KeyDiff N=512 B=128 for opencl-host with this checkout, then measure it")
    ap.add_argument("--schedules", nargs="?", const="dlight-gemv,dlight-lowbatch,rows-256,rows-64",
                    help="q4 GEMV schedule choices to compare on a SmolLM2-shaped model (comma separated)")
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown from the JSON")
    ap.add_argument("--blocks", type=int, default=2, help="full prompt blocks before the measured token / block")
    ap.add_argument("--decode", type=int, default=8, help="decode tokens measured")
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgekv-opencl-launches"))
    ap.add_argument("--json", type=Path, default=RESULTS / "opencl_launches.json")
    ap.add_argument("--md", type=Path, default=RESULTS / "opencl_launches.md")
    args = ap.parse_args(argv)
    if args.render:
        args.md.write_text(markdown(json.loads(args.json.read_text())))
        return 0
    if not (args.artifact or args.compile or args.schedules):
        ap.error("give --artifact LABEL=DIR, --compile LABEL or --schedules")
    prov = provenance([sys.executable, *sys.argv])
    doc = json.loads(args.json.read_text()) if args.json.exists() else {}
    doc.setdefault("runs", {})
    args.work.mkdir(parents=True, exist_ok=True)
    todo = []
    for spec in args.artifact:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"--artifact {spec!r}: write LABEL=DIR")
        todo.append((label, Path(path), None))
    for label in args.compile:
        art = args.work / label
        todo.append((label, art, compile_smollm2(art)))
    for label, art, compile_cmd in todo:
        r = measure(art, args.blocks, args.decode)
        r["provenance"] = {**prov, **({"compile": " ".join(compile_cmd)} if compile_cmd else {})}
        doc["runs"][label] = r
        print(f"{label}: {r['decode_token']['launches']:.0f} launches per decode token, "
              f"{r['prefill_block']['launches']:.0f} per block; {r['decode_token']['ms']:.2f} ms / token", flush=True)
    if args.schedules:
        doc["schedules"] = {"about": "SmolLM2-shaped two-layer random model (hidden 576, 9 / 3 heads of 64, MLP 1536, "
                                     "q4), N = 64, B = 32; device time of the decode token's GEMVs on PoCL.",
                            "provenance": prov,
                            "trials": schedule_trials(args.work, args.schedules.split(","), args.blocks, args.decode)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    args.md.write_text(markdown(doc))
    print(f"wrote {args.json} and {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
