"""The native runtime on aarch64, on a real model: the same generation on this x86-64 machine and
under qemu-user.

Compiles the model twice with the same policy, budget and block — for this CPU (``--target
host``) and for aarch64 Linux (``--target aarch64-linux``, then ``backend.finish.finish`` with the cross
gcc) —, builds ``runtime/`` natively and cross (``runtime/cmake/aarch64-linux-gnu.cmake``),
runs each ``edgekv-run`` on its artifact with the same text prompt (tokenized by the native
tokenizer) and compares prompt length, generated ids and text. The aarch64 run goes through
``qemu-aarch64-static -L /usr/aarch64-linux-gnu``, so its times are emulation times, not a phone's.
Writes docs/results/native_aarch64.{json,md}.

    apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static cmake ninja-build
    python tools/experiments/check_native_aarch64.py                       # SmolLM2, keydiff, N = 512, B = 128
    python tools/experiments/check_native_aarch64.py --reuse               # keep the artifacts and runtimes of a previous run
    python tools/experiments/check_native_aarch64.py --render              # only rewrite the .md from the recorded .json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSROOT = "/usr/aarch64-linux-gnu"


def sh(cmd: list, **kw) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    print("+", shlex.join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"failed (exit {r.returncode}): {shlex.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
    except OSError:
        return "missing"
    return out.splitlines()[0].strip() if out else "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_runtime(build_dir: Path, reuse: bool, *cmake_args: str) -> Path:
    import tvm_ffi.libinfo

    exe = build_dir / "edgekv-run"
    if not (reuse and exe.is_file()):
        sh(["cmake", "-S", ROOT / "runtime", "-B", build_dir, "-G", "Ninja",
            f"-DEDGEKV_TVM_FFI_INCLUDE={tvm_ffi.libinfo.find_include_path()}", *cmake_args])
    sh(["ninja", "-C", build_dir, "-j", "2"])  # incremental: a no-op when nothing changed
    return exe


def compile_artifacts(args, work: Path) -> dict[str, float]:
    """Compile (or, with --reuse, keep) the host and the finished aarch64 artifact; seconds each."""
    from edgekv.compiler import compile_model, import_model
    from edgekv.compiler.backend.finish import finish
    from edgekv.compiler.errors import ToolchainNeededWarning
    from edgekv.models import load_model
    from edgekv.policies import make_policy

    seconds: dict[str, float] = {}
    todo = [t for t in ("host", "aarch64") if not (args.reuse and (work / t / "program.ekv").is_file()
                                                   and (work / t / "model.so").is_file())]
    if not todo:
        return seconds
    model = load_model(args.model)
    imported = import_model(model, args.block)
    for target in todo:
        t0 = time.perf_counter()
        if target == "host":
            compile_model(model, make_policy(args.policy), args.budget, args.block, "host", work / "host",
                          imported=imported, kv_dtype=args.kv_dtype)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ToolchainNeededWarning)
                compile_model(model, make_policy(args.policy), args.budget, args.block, "aarch64-linux",
                              work / "aarch64", imported=imported, kv_dtype=args.kv_dtype)
            os.environ.setdefault("EDGEKV_AARCH64_CC", args.cross_cc)
            finish(work / "aarch64")
        seconds[target] = round(time.perf_counter() - t0, 1)
    return seconds


def run(cmd: list, artifact: Path, prompt_file: Path, report: Path, max_new: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    sh([*cmd, artifact, "--prompt-file", prompt_file, "--max-new-tokens", max_new, "--report", report, "--quiet"])
    return json.loads(report.read_text()), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--kv-dtype", default="fp32", choices=("fp32", "int8"), help="the artifacts' KV cache format")
    ap.add_argument("--prompt-chars", type=int, default=2600,
                    help="the prompt: this many characters of the bundled natural text (edgekv.corpus)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--cross-cc", default="aarch64-linux-gnu-gcc", help="links model.tar (EDGEKV_AARCH64_CC)")
    ap.add_argument("--runtime-cc", choices=("gcc", "clang"), default="gcc",
                    help="compiler of the aarch64 runtime: aarch64-linux-gnu-gcc or clang --target=aarch64-linux-gnu")
    ap.add_argument("--work", default=str(ROOT / "build" / "native_aarch64"))
    ap.add_argument("--reuse", action="store_true", help="keep artifacts and runtime builds already in --work")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "native_aarch64"))
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json of the last run, run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render:
        out.with_suffix(".md").write_text(render(json.loads(out.with_suffix(".json").read_text())))
        return

    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None or shutil.which(args.cross_cc) is None:
        sys.exit("needs qemu-user and the aarch64 cross compiler: apt-get install -y gcc-aarch64-linux-gnu "
                 "libc6-dev-arm64-cross qemu-user-static")
    from edgekv.evaluation.report import provenance

    origin = provenance([sys.executable, *sys.argv])  # before the long work: the commit that ran
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    compile_s = compile_artifacts(args, work)
    host_exe = build_runtime(work / "runtime-host", args.reuse)
    a64_exe = build_runtime(work / "runtime-aarch64", args.reuse,
                            f"-DCMAKE_TOOLCHAIN_FILE={ROOT / 'runtime' / 'cmake' / 'aarch64-linux-gnu.cmake'}",
                            f"-DEDGEKV_CROSS_COMPILER={args.runtime_cc}")

    from edgekv.corpus import natural_text

    prompt = work / "prompt.txt"
    prompt.write_text(natural_text()[: args.prompt_chars])
    load = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: times are only as good as this
    host, host_s = run([host_exe], work / "host", prompt, work / "report-host.json", args.max_new_tokens)
    a64, a64_s = run([qemu, "-L", SYSROOT, a64_exe], work / "aarch64", prompt, work / "report-aarch64.json",
                     args.max_new_tokens)
    same = host["generated_ids"] == a64["generated_ids"]
    first_diff = next((i for i, (a, b) in enumerate(zip(host["generated_ids"], a64["generated_ids"])) if a != b), None)

    def side(rep: dict, wall: float) -> dict:
        keys = ("target", "threads", "prompt_tokens", "generated_tokens", "generated_ids", "text", "load_seconds",
                "prefill_seconds", "decode_seconds", "prefill_tok_s", "decode_tok_s", "cache_lengths")
        return {**{k: rep.get(k) for k in keys}, "wall_seconds": round(wall, 2),
                "peak_rss_bytes": rep.get("memory", {}).get("peak_rss_bytes")}

    record = {
        "command": " ".join(["python tools/experiments/check_native_aarch64.py", shlex.join(sys.argv[1:])]).strip(),
        "model": args.model, "policy": args.policy, "budget": args.budget, "block": args.block,
        "kv_dtype": args.kv_dtype,
        "prompt_chars": args.prompt_chars, "max_new_tokens": args.max_new_tokens,
        "ids_equal": same, "first_difference": first_diff,
        "prompt_tokens_equal": host["prompt_tokens"] == a64["prompt_tokens"],
        "host": side(host, host_s), "aarch64_qemu": side(a64, a64_s),
        "compile_seconds": compile_s,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "qemu": tool_version([qemu, "--version"]),
                    "cross_cc": tool_version([args.cross_cc, "--version"]),
                    "runtime_cc": tool_version(["clang" if args.runtime_cc == "clang" else "aarch64-linux-gnu-gcc",
                                                "--version"]),
                    "load_average_before_runs": load},
        "date": time.strftime("%Y-%m-%d"),
        "provenance": origin,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(record))
    print(render(record))


def render(r: dict) -> str:
    h, a = r["host"], r["aarch64_qemu"]
    verdict = ("**equal**" if r["ids_equal"] else f"**different** from generated token {r['first_difference']}")

    def fmt(x, nd=2):
        return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    compile_line = (", ".join(f"{k} {v} s" for k, v in r["compile_seconds"].items())
                    if r["compile_seconds"] else "artifacts reused from an earlier run (--reuse)")
    rows = [
        ("edgekv-run", "x86-64, native", "aarch64, qemu-user"),
        ("artifact target", h["target"], a["target"]),
        ("threads", h["threads"], a["threads"]),
        ("prompt tokens (native tokenizer)", h["prompt_tokens"], a["prompt_tokens"]),
        ("KV cache entries per layer at the end", fmt(h["cache_lengths"][0] if h["cache_lengths"] else None),
         fmt(a["cache_lengths"][0] if a["cache_lengths"] else None)),
        ("prefill seconds", fmt(h["prefill_seconds"]), fmt(a["prefill_seconds"])),
        ("decode seconds", fmt(h["decode_seconds"]), fmt(a["decode_seconds"])),
        ("decode tokens/s", fmt(h["decode_tok_s"]), fmt(a["decode_tok_s"])),
        ("wall seconds (whole command)", fmt(h["wall_seconds"]), fmt(a["wall_seconds"])),
        ("peak RSS MiB", fmt(h["peak_rss_bytes"] / 2**20, 0) if h["peak_rss_bytes"] else "—",
         fmt(a["peak_rss_bytes"] / 2**20, 0) if a["peak_rss_bytes"] else "—"),
    ]
    table = "\n".join(f"| {x} | {y} | {z} |" for x, y, z in rows[1:])
    return f"""# The native runtime on aarch64 (qemu-user) against x86-64

Regenerate: `{r['command']}` ({r['date']}{', commit ' + str(r['provenance']['commit']) if r.get('provenance') else ''}).

{r['model']}, policy {r['policy']}, budget N = {r['budget']}, block B = {r['block']}, KV cache {r.get('kv_dtype', 'fp32')}; the prompt is the first
{r['prompt_chars']} characters of the bundled natural text (`edgekv.corpus`), {r['max_new_tokens']} new tokens,
greedy. One artifact per CPU from the same model and settings: `--target host` (this CPU's
vector width, packed weights) and `--target aarch64-linux` (NEON, TVM's layouts; linked by
`python -m edgekv.compiler.backend.finish` with `{r['machine']['cross_cc']}`). The aarch64
`edgekv-run` is cross-built with `runtime/cmake/aarch64-linux-gnu.cmake` (`{r['machine']['runtime_cc']}`) and runs under
`{r['machine']['qemu']}`: its times are emulation on this machine, not a phone's.

Generated ids: {verdict}; prompt token counts {'equal' if r['prompt_tokens_equal'] else 'DIFFERENT'}.

| | {rows[0][1]} | {rows[0][2]} |
|---|---|---|
{table}

Host ids:    `{h['generated_ids']}`
aarch64 ids: `{a['generated_ids']}`

Host text: {json.dumps(h['text'])}

aarch64 text: {json.dumps(a['text'])}

Compile times: {compile_line}. Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, load average
before the runs {r['machine'].get('load_average_before_runs', 'not recorded')} (1, 5, 15 min; the machine may be
shared with other work, which slows both sides).
"""


if __name__ == "__main__":
    main()
