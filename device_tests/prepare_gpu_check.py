"""Prepare the inputs of `device_tests/gpu_check.sh`: everything a machine with an NVIDIA GPU and
nothing else installed (no Python packages, no network, no compiler) needs to check the GPU path.

    python device_tests/prepare_gpu_check.py OUT [--max-part-mib 56] [--no-smollm2 | --no-tiny] [--no-unfused] [--row-tiled]
                                                 [--targets opencl-host,cuda-host]

Writes under OUT:
- `full/`: `bin/edgekv-run` (built from runtime/ here: the OpenCL and CUDA devices are loaded with
  dlopen, so the binary needs neither at build time), the tiny random Llama's GPU artifacts for
  every policy that compiles for the GPU, SmolLM2 KeyDiff (N = 512, B = 128, q4) GPU artifacts, the
  prompts, and `cases.json`: per case the artifact, the edgekv-run arguments, and what the CPU
  artifact of the same model, policy, N and B gave here (greedy ids, prefill / decode tok/s at
  --threads 2, this machine's CPU named).
- `part1/ … partK/`: the same files packed into parts of at most `--max-part-mib` each (a device
  machine that takes one upload of limited size gets them one part per call), large files cut into
  chunks, identical files stored once, and an index in every part. `gpu_check.sh` reassembles
  whatever parts it is given, checks every file's sha256, and runs the cases whose files are all
  there (it says which part a skipped case needs).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_BUDGET, TINY_BLOCK, TINY_NEW = 24, 8, 32
SMOL_BUDGET, SMOL_BLOCK, SMOL_NEW = 512, 128, 64
SMOL_LONG = 8000  # prompt tokens of the long case (SmolLM2's context is 8,192)
CHUNK = 16 << 20


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_runtime(out: Path) -> Path:
    """edgekv-run, Release, from runtime/ (the binary the check runs)."""
    build = out / "runtime-build"
    shutil.rmtree(build, ignore_errors=True)  # a cache from another checkout would refuse this one
    subprocess.run(["cmake", "-S", str(ROOT / "runtime"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DEDGEKV_BUILD_CLI=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], check=True,
                   stdout=subprocess.DEVNULL)
    return build / "edgekv-run"


def run_cpu(run: Path, art: Path, args: list[str], report: Path) -> dict:
    """The CPU artifact's answer and speed on this machine (two threads, as the issue's baseline)."""
    cmd = [str(run), str(art), *args, "--threads", "2", "--warmup", "--quiet", "--report", str(report)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip()}")
    rep = json.loads(report.read_text())
    return {"ids": rep["generated_ids"], "prefill_tok_s": rep["prefill_tok_s"], "decode_tok_s": rep["decode_tok_s"],
            "prompt_tokens": rep["prompt_tokens"], "threads": rep["threads"], "cpu": cpu_name()}


def compile_gpu(model, policy: str, args: dict, budget: int, block: int, target: str, out: Path, **kw) -> str | None:
    """Compile for one GPU target; None when done, else why it was not (a target this edgekv lacks)."""
    from edgekv.compiler import compile_model
    from edgekv.policies import make_policy

    if (out / "program.ekv").is_file():
        return None
    try:
        compile_model(model, make_policy(policy, args), budget, block, target=target, out_dir=out, **kw)
    except Exception as exc:  # noqa: BLE001 — recorded in cases.json and printed by the check
        shutil.rmtree(out, ignore_errors=True)
        return f"{type(exc).__name__}: {exc}"
    return None


def tiny_cases(full: Path, work: Path, run: Path, targets: list[str]) -> list[dict]:
    import numpy as np

    from edgekv.compiler import compile_model
    from edgekv.compiler.policy_kernels import gpu_policy_names
    from edgekv.models import tiny_random_model
    from edgekv.policies import make_policy

    model = tiny_random_model(seed=1, layers=2)
    prompt = ",".join(str(int(x)) for x in np.random.default_rng(3).integers(1, 250, 70))
    (full / "tiny").mkdir(parents=True, exist_ok=True)
    (full / "tiny" / "prompt-ids.txt").write_text(prompt)
    setup = {"full": ({}, 128), "lagkv": ({"sinks": 2, "lag": 4}, TINY_BUDGET), "dapq": ({"window": 4}, TINY_BUDGET)}
    cases = []
    for policy in sorted(gpu_policy_names()):
        args, budget = setup.get(policy, ({}, TINY_BUDGET))
        cpu = work / "tiny" / f"{policy}-cpu"
        if not (cpu / "program.ekv").is_file():
            compile_model(model, make_policy(policy, args), budget, TINY_BLOCK,
                          target={"kind": "llvm", "opt-level": 0, "num-cores": 2}, out_dir=cpu)
        run_args = ["--prompt-ids", "@tiny/prompt-ids.txt", "--max-new-tokens", str(TINY_NEW), "--ignore-eos"]
        expected = run_cpu(run, cpu, ["--prompt-ids", prompt, *run_args[2:]], work / "tiny" / f"{policy}-cpu.json")
        for target in targets:
            rel = f"tiny/{policy}-{target}"
            why = compile_gpu(model, policy, args, budget, TINY_BLOCK, target, full / rel)
            cases.append({"name": f"tiny {policy} {target}", "artifact": rel, "args": run_args, "expected": expected,
                          "not_built": why, "repeat_open": policy == "keydiff"})
            print(f"tiny {policy} {target}: {'built' if why is None else why}", flush=True)
    return cases


def unfused_profile(target: str) -> dict:
    """``target``'s profile with every decode-launch fusion (``gpu_schedule.FUSIONS``) turned off."""
    from edgekv.compiler.backend.gpu_schedule import FUSIONS
    from edgekv.profiles import profile_dir

    profile = json.loads((profile_dir("targets") / f"{target}.json").read_text())
    profile["name"] = f"{profile.get('name', target)}-unfused"
    profile.setdefault("gpu_schedule", {}).update({name: False for name in FUSIONS})
    return profile


def row_tiled_profile(target: str) -> dict:
    """``target``'s profile with the block step's attention row-tiled (gpu_schedule.block_attention)."""
    from edgekv.profiles import profile_dir

    profile = json.loads((profile_dir("targets") / f"{target}.json").read_text())
    profile["name"] = f"{profile.get('name', target)}-rt"
    profile.setdefault("gpu_schedule", {})["block_attention"] = "row-tiled"
    return profile


def smollm2_cases(full: Path, work: Path, run: Path, targets: list[str], unfused: bool = True,
                  row_tiled: bool = False) -> list[dict]:
    from edgekv.compiler import compile_model
    from edgekv.corpus import natural_token_ids
    from edgekv.models import load_model
    from edgekv.policies import make_policy

    loaded = load_model()
    (full / "smollm2").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "examples" / "long_document.txt", full / "smollm2" / "long_document.txt")
    ids = natural_token_ids(loaded.tokenizer, SMOL_LONG).tolist()
    (full / "smollm2" / "prompt-8k-ids.txt").write_text(",".join(map(str, ids)))
    cpu = work / "smollm2" / "keydiff-cpu"
    if not (cpu / "program.ekv").is_file():
        compile_model(loaded, make_policy("keydiff", {}), SMOL_BUDGET, SMOL_BLOCK, target="host", out_dir=cpu)
    prompts = {
        "demo": ["--prompt-file", "smollm2/long_document.txt", "--chat"],
        "8k": ["--prompt-ids", "@smollm2/prompt-8k-ids.txt"],
    }
    gen = ["--max-new-tokens", str(SMOL_NEW), "--ignore-eos"]
    cases = []
    for label, pargs in prompts.items():
        here = [a.replace("smollm2/", str(full / "smollm2") + "/") for a in pargs]
        expected = run_cpu(run, cpu, [*here, *gen], work / "smollm2" / f"cpu-{label}.json")
        print(f"smollm2 cpu {label}: {expected['prefill_tok_s']:.0f} / {expected['decode_tok_s']:.1f} tok/s", flush=True)
        for target in targets:
            # each target as its profile ships it, with the decode-launch fusions off (whether they
            # pay: fewer launches, hand-scheduled GEMVs) and with the row-tiled block-step attention:
            # which is faster is for the GPU to say
            variants = [(target, target)] + ([(f"{target}-unfused", unfused_profile(target))] if unfused else []) + (
                [(f"{target}-rt", row_tiled_profile(target))] if row_tiled else [])
            for variant, profile in variants:
                rel = f"smollm2/keydiff-{variant}"
                why = compile_gpu(loaded, "keydiff", {}, SMOL_BUDGET, SMOL_BLOCK, profile, full / rel)
                cases.append({"name": f"smollm2 keydiff {variant} {label}", "artifact": rel, "args": [*pargs, *gen],
                              "expected": expected, "not_built": why, "repeat_open": False})
    return cases


def squeeze(name: str, chunk: bytes) -> tuple[str, bytes]:
    """A chunk gzipped when that saves a tenth (host code, kernel sources, PTX: 3–10×; q4 weights
    hardly); the name says which (`.gz`), so the check needs nothing but Python's gzip."""
    packed = gzip.compress(chunk, compresslevel=6, mtime=0)
    return (name + ".gz", packed) if len(packed) < 0.9 * len(chunk) else (name, chunk)


def pack(full: Path, out: Path, max_part: int) -> list[Path]:
    """Cut `full` into parts of at most `max_part` bytes: identical files stored once, files over
    CHUNK bytes in chunks; each part holds the index of every file and which blob holds which bytes."""
    files, blobs = {}, {}
    for path in sorted(p for p in full.rglob("*") if p.is_file()):
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        rel = path.relative_to(full).as_posix()
        files[rel] = {"sha256": digest, "size": len(data), "mode": path.stat().st_mode & 0o777}
        if digest not in blobs:
            blobs[digest] = [squeeze(f"{digest[:16]}.{i:03d}", data[o:o + CHUNK])
                             for i, o in enumerate(range(0, max(len(data), 1), CHUNK))]
    # small files (binary, prompts, tiny artifacts) first, so part 1 runs the tiny cases on its own
    order = sorted(blobs, key=lambda d: sum(len(c) for _, c in blobs[d]))
    parts: list[list[tuple[str, bytes]]] = [[]]
    size = 0
    for digest in order:
        for name, chunk in blobs[digest]:
            if parts[-1] and size + len(chunk) > max_part:
                parts.append([])
                size = 0
            parts[-1].append((name, chunk))
            size += len(chunk)
    where = {name: i + 1 for i, part in enumerate(parts) for name, _ in part}
    for rel, info in files.items():
        info["chunks"] = [[name, where[name]] for name, _ in blobs[info["sha256"]]]
    dirs = []
    for i, part in enumerate(parts, 1):
        d = out / f"part{i}"
        shutil.rmtree(d, ignore_errors=True)
        (d / "blobs").mkdir(parents=True)
        for name, chunk in part:
            (d / "blobs" / name).write_bytes(chunk)
        (d / "index.json").write_text(json.dumps({"parts": len(parts), "files": files}, indent=1))
        dirs.append(d)
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-part-mib", type=float, default=56)
    ap.add_argument("--targets", default="opencl-host,cuda-host")
    ap.add_argument("--no-smollm2", action="store_true", help="tiny models only (one small part)")
    ap.add_argument("--no-tiny", action="store_true", help="SmolLM2 only (a recheck of its speed)")
    ap.add_argument("--row-tiled", action="store_true",
                    help="SmolLM2 also with the row-tiled block-step attention (gpu_schedule.block_attention)")
    ap.add_argument("--no-unfused", action="store_true",
                    help="SmolLM2 only as each target's profile ships it (not also with the decode-launch fusions off)")
    args = ap.parse_args()
    out = args.out.resolve()
    full, work = out / "full", out / "work"
    full.mkdir(parents=True, exist_ok=True)
    (full / "bin").mkdir(exist_ok=True)
    run = build_runtime(out)
    shutil.copy(run, full / "bin" / "edgekv-run")
    targets = [t for t in args.targets.split(",") if t]
    cases = [] if args.no_tiny else tiny_cases(full, work, run, targets)
    if not args.no_smollm2:
        cases += smollm2_cases(full, work, run, targets, unfused=not args.no_unfused, row_tiled=args.row_tiled)
    (full / "cases.json").write_text(json.dumps({"made_on": cpu_name(), "cases": cases}, indent=1))
    parts = pack(full, out, int(args.max_part_mib * (1 << 20)))
    for p in parts:
        mib = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / (1 << 20)
        print(f"{p}: {mib:.1f} MiB")
    print(f"run there: device_tests/gpu_check.sh {' '.join(str(p) for p in parts)}")


if __name__ == "__main__":
    sys.exit(main())
