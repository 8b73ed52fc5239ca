"""The GPU check's driver (called by gpu_check.sh; Python's standard library only: the GPU machine
needs nothing installed). Reassembles the prepared parts, runs every case whose files are all there
with the prebuilt edgekv-run, and prints one line per case: ids equal to the CPU artifact's, prefill
and decode speed (and their ratio to the CPU artifact's two-thread speed, measured where the parts
were prepared), device memory against the plan, and the exit status (a crash at teardown shows as
139). Writes the same as JSON to --out."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def assemble(parts: list[Path], work: Path) -> tuple[dict, dict]:
    """Every file whose chunks are all among `parts`, written under `work` and checked; returns
    (files present, files missing → the parts they need)."""
    index = None
    # chunks are kept under work/blobs: a file cut across parts that arrive in separate runs
    # (one upload per call) is complete once the run with its last part comes
    store = work / "blobs"
    store.mkdir(parents=True, exist_ok=True)
    for p in parts:
        idx = p / "index.json"
        if not idx.is_file():
            sys.exit(f"gpu_check: {p} is not a part written by prepare_gpu_check.py (no index.json)")
        index = index or json.loads(idx.read_text())
        for b in (p / "blobs").iterdir():
            kept = store / b.name
            if not (kept.is_file() and kept.stat().st_size == b.stat().st_size):
                shutil.copyfile(b, kept)
    blobs: dict[str, Path] = {b.name: b for b in store.iterdir()}
    present, missing = {}, {}
    for rel, info in index["files"].items():
        dest = work / rel
        need = sorted({part for name, part in info["chunks"] if name not in blobs})
        if need:
            missing[rel] = need
            continue
        if not (dest.is_file() and dest.stat().st_size == info["size"]):
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as f:
                for name, _ in info["chunks"]:
                    data = blobs[name].read_bytes()
                    f.write(gzip.decompress(data) if name.endswith(".gz") else data)
            os.chmod(dest, info["mode"])
        digest = hashlib.sha256(dest.read_bytes()).hexdigest()
        if digest != info["sha256"]:
            sys.exit(f"gpu_check: {rel} does not match its sha256 after reassembly: prepare the parts again")
        present[rel] = info
    return present, missing


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "no nvidia-smi output"
    except (OSError, subprocess.TimeoutExpired):
        return "nvidia-smi not found"


def run_case(work: Path, case: dict, reports: Path, timeout: float) -> dict:
    art = work / case["artifact"]
    report = reports / (case["name"].replace(" ", "_") + ".json")
    report.unlink(missing_ok=True)
    cmd = [str(work / "bin" / "edgekv-run"), str(art), *case["args"], "--warmup", "--quiet", "--report", str(report)]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)
        rc, err = res.returncode, res.stderr.strip()
    except subprocess.TimeoutExpired:
        rc, err = "timeout", f"no exit within {timeout:.0f} s"
    out = {"name": case["name"], "exit": rc, "wall_s": round(time.perf_counter() - t0, 2)}
    if rc != 0:
        out["stderr_tail"] = err[-600:]
    if report.is_file():
        rep = json.loads(report.read_text())
        exp = case["expected"]
        ids, want = rep.get("generated_ids", []), exp["ids"]
        same = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        mem = rep.get("memory", {})
        out.update({
            "ids_equal": ids == want, "ids_equal_prefix": same, "ids": len(ids),
            "prefill_tok_s": rep.get("prefill_tok_s"), "decode_tok_s": rep.get("decode_tok_s"),
            "cpu_prefill_tok_s": exp["prefill_tok_s"], "cpu_decode_tok_s": exp["decode_tok_s"],
            "cpu": f"{exp['cpu']}, {exp['threads']} threads",
            "device": mem.get("device"), "device_bytes_peak": mem.get("device_bytes_peak"),
            "plan_bytes": mem.get("plan", {}).get("total_bytes"), "prompt_tokens": rep.get("prompt_tokens"),
            "status": rep.get("status"),
        })
    return out


def repeat_open(work: Path, case: dict, times: int, timeout: float) -> dict:
    """Open, run and close the artifact `times` times in one process (edgekv-run --repeat-open)."""
    cmd = [str(work / "bin" / "edgekv-run"), str(work / case["artifact"]), *case["args"], "--quiet",
           "--repeat-open", str(times)]
    try:
        res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)
        return {"name": case["name"] + f" open/close x{times}", "exit": res.returncode, "stderr_tail": res.stderr[-400:]}
    except subprocess.TimeoutExpired:
        return {"name": case["name"] + f" open/close x{times}", "exit": "timeout"}


def launches(work: Path, case: dict, timeout: float) -> dict:
    """Kernel launches per decode token (runs of 1 and 17 new tokens, launch traces counted) and,
    on OpenCL, the device time per kernel from profiling events (EDGEKV_OPENCL_PROFILE=1)."""
    prompt, args = [], list(case["args"])
    while args:  # the case's arguments without its token count (given here) and --ignore-eos
        a = args.pop(0)
        if a == "--max-new-tokens":
            args.pop(0)
        elif a != "--ignore-eos":
            prompt.append(a)
    base = [str(work / "bin" / "edgekv-run"), str(work / case["artifact"]), *prompt, "--ignore-eos", "--quiet"]
    trace = {"EDGEKV_OPENCL_TRACE": "1", "EDGEKV_CUDA_TRACE": "1"}
    counts = []
    for new in (1, 17):
        res = subprocess.run([*base, "--max-new-tokens", str(new)], cwd=work, capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, **trace})
        counts.append(sum(1 for ln in res.stderr.splitlines() if ln.startswith(("edgekv opencl: ", "edgekv cuda: "))))
    out = {"name": case["name"] + " launches", "exit": res.returncode, "launches_per_decode_token": (counts[1] - counts[0]) / 16,
           "launches_prefill_and_first_token": counts[0]}
    if "opencl" in case["artifact"]:
        res = subprocess.run([*base, "--max-new-tokens", "17"], cwd=work, capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, "EDGEKV_OPENCL_PROFILE": "1"})
        kernels = []
        for ln in res.stderr.splitlines():
            if ln.startswith("edgekv opencl profile: "):
                name, _, n, _, ns = ln.split()[3:8]
                kernels.append({"kernel": name, "launches": int(n), "ms": int(ns) / 1e6})
        kernels.sort(key=lambda k: -k["ms"])
        out["device_ms_total"] = round(sum(k["ms"] for k in kernels), 3)
        out["top_kernels"] = kernels[:12]
    return out


def line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['name']}: skipped ({r['skipped']})"
    s = f"{r['name']}: exit {r['exit']}"
    if "ids_equal" in r:
        s += f"; ids {'equal' if r['ids_equal'] else 'DIFFER at %d' % r['ids_equal_prefix']} ({r['ids']})"
        if r.get("prefill_tok_s"):
            s += (f"; prefill {r['prefill_tok_s']:.0f} tok/s ({r['prefill_tok_s'] / r['cpu_prefill_tok_s']:.1f}x cpu),"
                  f" decode {r['decode_tok_s']:.1f} tok/s ({r['decode_tok_s'] / r['cpu_decode_tok_s']:.1f}x cpu)")
        if r.get("device_bytes_peak") is not None and r.get("plan_bytes"):
            s += f"; device {r['device_bytes_peak'] / 1e6:.1f} MB vs plan {r['plan_bytes'] / 1e6:.1f} MB"
    if "launches_per_decode_token" in r:
        s += f"; {r['launches_per_decode_token']:.0f} launches per decode token"
        for k in r.get("top_kernels", [])[:8]:
            s += f"\n    {k['ms']:9.2f} ms {k['launches']:6d}x {k['kernel']}"
    if r.get("exit") not in (0, None) and r.get("stderr_tail"):
        s += "\n    " + r["stderr_tail"].replace("\n", "\n    ")
    return s


def markdown(gpu: str, cpu: str, results: list[dict]) -> str:
    """The results as a table (docs/results/gpu_check.md is this file, copied from a GPU run)."""
    rows = ["| case | exit | ids vs CPU artifact | prefill tok/s (× CPU) | decode tok/s (× CPU) | device MB / plan MB |",
            "|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r['name']} | skipped: {r['skipped'][:80]} | | | | |")
            continue
        ids = "" if "ids_equal" not in r else ("equal" if r["ids_equal"] else f"differ at {r['ids_equal_prefix']}")
        pre = dec = mem = ""
        if r.get("prefill_tok_s"):
            pre = f"{r['prefill_tok_s']:.0f} ({r['prefill_tok_s'] / r['cpu_prefill_tok_s']:.1f}×)"
            dec = f"{r['decode_tok_s']:.1f} ({r['decode_tok_s'] / r['cpu_decode_tok_s']:.1f}×)"
        if r.get("device_bytes_peak") is not None and r.get("plan_bytes"):
            mem = f"{r['device_bytes_peak'] / 1e6:.1f} / {r['plan_bytes'] / 1e6:.1f}"
        rows.append(f"| {r['name']} | {r['exit']} | {ids} | {pre} | {dec} | {mem} |")
    head = (f"# GPU check\n\nGPU: {gpu}. CPU figures: the CPU artifact of the same model, policy, N and B "
            f"at 2 threads on {cpu}, where the inputs were prepared (`device_tests/prepare_gpu_check.py`). "
            f"Written by `device_tests/gpu_check.sh ... --out`.\n\n")
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "edgekv-gpu-check")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--launches", action="store_true",
                    help="also count launches per decode token (SmolLM2 8K cases) and time OpenCL kernels")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    present, missing = assemble(args.parts, work)
    cases = json.loads((work / "cases.json").read_text())
    reports = work / "reports"
    reports.mkdir(exist_ok=True)
    print(f"gpu: {gpu_name()}; CPU figures from {cases['made_on']}", flush=True)
    results = []
    for case in cases["cases"]:
        if args.only and args.only not in case["name"]:
            continue
        if case.get("not_built"):
            r = {"name": case["name"], "skipped": f"not built: {case['not_built'][:200]}"}
        else:
            need = sorted({p for rel, ps in missing.items() if rel.startswith(case["artifact"] + "/") for p in ps})
            r = ({"name": case["name"], "skipped": f"needs part(s) {need}"} if need
                 else run_case(work, case, reports, args.timeout))
        results.append(r)
        print(line(r), flush=True)
        if args.launches and case["name"].startswith("smollm2") and "8k" in case["name"] and "skipped" not in r:
            rl = launches(work, case, args.timeout)
            results.append(rl)
            print(line(rl), flush=True)
        if case.get("repeat_open") and "skipped" not in r:
            rr = repeat_open(work, case, 5, args.timeout)
            results.append(rr)
            print(line(rr), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"gpu": gpu_name(), "cpu_figures_from": cases["made_on"], "results": results},
                                       indent=1))
        args.out.with_suffix(".md").write_text(markdown(gpu_name(), cases["made_on"], results))
    bad = [r for r in results if "skipped" not in r and (r.get("exit") != 0 or r.get("ids_equal") is False)]
    print(f"{len(results) - len(bad)} of {len(results)} fine or skipped; {len(bad)} failed", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
