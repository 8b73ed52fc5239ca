"""The README demo on SmolLM2-135M through the APK's own arm64 libraries under qemu-aarch64, against
``edgekv-run`` on this host (issue 33, deliverable 7).

The .so files are taken out of the built APK (android/build.sh) and loaded, runtime first and
RTLD_LOCAL as ``System.loadLibrary`` does, by android/test/jni_harness.c on the aarch64 glibc with
the two-function bionic shim (android/test/bionic_shim.c), then driven through the JNI bridge's
own functions on an ``android-cpu`` artifact (linked by android/finish.sh): the document is read
block by block, then two questions are answered, the second from the saved cache. The same
document and questions go through ``edgekv-run --chat --question ...`` on a host (``--target host``)
artifact of the same model, policy, N and B, and the generated ids are compared. Every instruction
of the phone's code is emulated, so a run is slow; ``--limit-s`` stops it and the results say how
far the prefill got (the harness prints each block as it finishes). Writes
docs/results/android_qemu_smollm2.{json,md}.

    edgekv compile smollm2-135m --budget 512 --block 128 --policy keydiff --target android-cpu -o build/smol-android
    android/finish.sh build/smol-android
    edgekv compile smollm2-135m --budget 512 --block 128 --policy keydiff --target host -o build/smol-host
    android/build.sh
    python tools/experiments/check_android_qemu.py --android build/smol-android --host build/smol-host \\
        --apk build/android/edgekv-demo.apk [--document readme|opening] [--limit-s 3000]
    python tools/experiments/check_android_qemu.py --render        # only rewrite the .md from the .json

    apt-get install -y qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross android-libnativehelper-dev
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANDROID = ROOT / "android"
SYSROOT = Path("/usr/aarch64-linux-gnu")
OUT = ROOT / "docs" / "results" / "android_qemu_smollm2"
README_QUESTION = "What is the Wi-Fi password of the training lab? Answer in one or two sentences."
SECOND_QUESTION = "Which course are the notes for?"


def build_kit(apk: Path, d: Path) -> dict:
    """The APK's .so files, the bionic shim (libc.so, libm.so, libdl.so over glibc) and the JNI
    harness, all aarch64, in ``d``."""
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None or shutil.which("aarch64-linux-gnu-gcc") is None:
        raise SystemExit("qemu-aarch64 or aarch64-linux-gnu-gcc missing: apt-get install -y qemu-user-static "
                         "gcc-aarch64-linux-gnu libc6-dev-arm64-cross")
    libs, shim = d / "apk-lib", d / "shim"
    libs.mkdir(parents=True, exist_ok=True)
    shim.mkdir(exist_ok=True)
    with zipfile.ZipFile(apk) as z:
        for name in z.namelist():
            if name.startswith("lib/arm64-v8a/") and name.endswith(".so"):
                (libs / Path(name).name).write_bytes(z.read(name))
    gcc = "aarch64-linux-gnu-gcc"
    for lib, extra in (("libc.so", ["-DSHIM_LIBC"]), ("libm.so", ["-Wl,--no-as-needed", "-lm"]),
                       ("libdl.so", ["-Wl,--no-as-needed", "-lc"])):
        defines = [e for e in extra if e.startswith("-D")]
        links = [e for e in extra if not e.startswith("-D")]
        subprocess.run([gcc, "-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", *defines,
                        f"-Wl,-soname,{lib}", "-o", str(shim / lib), str(ANDROID / "test" / "bionic_shim.c"), *links],
                       check=True)
    harness = d / "jni_harness"
    subprocess.run([gcc, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-I/usr/include/android/nativehelper",
                    "-o", str(harness), str(ANDROID / "test" / "jni_harness.c"), "-ldl"], check=True)
    return {"libs": libs, "shim": shim, "harness": harness, "qemu": qemu}


def run_harness(kit: dict, artifact: Path, doc: Path, work: Path, questions: list[str], max_new: int,
                chat: bool = True, threads: int = 2, limit_s: float | None = None) -> dict:
    """The harness under qemu; stopped after ``limit_s``. Its output (or None when stopped), the
    wall time, and the blocks and tokens with the second each finished at."""
    env = [f"LD_LIBRARY_PATH={kit['shim']}", f"HARNESS_THREADS={threads}"] + (["HARNESS_CHAT=1"] if chat else [])
    cmd = [kit["qemu"], "-L", str(SYSROOT), *sum((["-E", e] for e in env), []), str(kit["harness"]),
           str(kit["libs"] / "libedgekv_runtime.so"), str(kit["libs"] / "libedgekv_jni.so"), str(artifact), str(doc),
           str(work / "doc.ekv"), str(max_new), *questions]
    err = work / "harness.stderr"
    start = time.monotonic()
    with open(err, "w") as stderr:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            out, _ = p.communicate(timeout=limit_s)
            stopped = False
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            stopped = True
    wall = time.monotonic() - start
    text = err.read_text()
    blocks = [(int(a), int(b), float(t))
              for a, b, t in re.findall(r"harness: block (\d+)/(\d+) tokens at ([\d.]+) s", text)]
    tokens = [(int(i), float(t)) for i, t in re.findall(r"harness: token (-?\d+) at ([\d.]+) s", text)]
    result = None
    if not stopped:
        if p.returncode != 0:
            raise SystemExit(f"the harness failed ({p.returncode}):\n{out[-2000:]}\n{text[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
    return {"result": result, "wall_s": wall, "stopped": stopped, "blocks": blocks, "tokens": tokens}


def host_answers(artifact: Path, doc: Path, work: Path, questions: list[str], max_new: int, chat: bool = True):
    from edgekv.runtime import native

    cli = native.cli_path()
    if cli is None:
        raise SystemExit("edgekv-run is not built: pip install -e .")
    report = work / "host-run.json"
    start = time.monotonic()
    subprocess.run([str(cli), str(artifact), "--prompt-file", str(doc), *(["--chat"] if chat else []),
                    *sum((["--question", q] for q in questions), []), "--max-new-tokens", str(max_new),
                    "--report", str(report), "--quiet"], check=True, capture_output=True, text=True)
    wall = time.monotonic() - start
    data = json.loads(report.read_text())
    return (data["document"]["answers"] if "document" in data else data["answers"]), wall


def utf16(units) -> str:
    return b"".join(u.to_bytes(2, "little") for u in units).decode("utf-16-le", errors="replace")


def demo_document(which: str) -> tuple[str, list[str]]:
    """The README's document without its closing question (asked as the first question instead),
    or only its opening paragraph (the slow test's shorter variant)."""
    text = (ROOT / "examples" / "long_document.txt").read_text(encoding="utf-8")
    if which == "opening":
        return text[:text.index("reference.") + len("reference.")], ["What is the Wi-Fi password of the training lab?",
                                                                      SECOND_QUESTION]
    return text[:text.rindex("Question:")].rstrip() + "\n", [README_QUESTION, SECOND_QUESTION]


def _num(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def render(data: dict) -> str:
    q, h = data["qemu"], data["host"]
    lines = [f"# The README demo through the APK's own libraries under qemu-aarch64 ({data['document']})", "",
             f"Regenerate: `{data['provenance']['command']}` ({data['provenance']['started'][:10]}).", "",
             "SmolLM2-135M-Instruct, keydiff, N = 512, B = 128, `--chat`, greedy. The APK's `libedgekv_runtime.so` "
             "and `libedgekv_jni.so` (built by `android/build.sh` for aarch64-linux-android24) run under "
             f"`{data['qemu_version']}` with the bionic shim, driven through the bridge's JNI functions "
             "(android/test/jni_harness.c) on an `android-cpu` artifact linked by `android/finish.sh`; the host "
             "side is `edgekv-run` on a `--target host` artifact of the same model and settings. Times under qemu "
             "are emulation on this machine (shared with other work, 2 cores), not a phone's.", "",
             "| | APK libraries, qemu-aarch64 | edgekv-run, x86-64 |", "|---|---|---|",
             f"| document tokens | {q['document_tokens']} | {h.get('document_tokens', '—')} |",
             f"| prefill reached | {q['prefill_done']}/{q['document_tokens']} tokens | all |",
             f"| wall seconds | {q['wall_s']:.0f}{' (stopped at the limit)' if q['stopped'] else ''} | "
             f"{h['wall_s']:.1f} |",
             f"| prefill seconds per token | {_num(q['s_per_prefill_token'])} | — |", ""]
    if q["stopped"] and not q["s_per_prefill_token"]:
        lines += [f"**Stopped** after {q['wall_s']:.0f} s before the first block of the document was read.", ""]
    elif q["stopped"]:
        lines += [f"**Stopped** after {q['wall_s']:.0f} s (`--limit-s {data['limit_s']:.0f}`) with "
                  f"{q['prefill_done']} of {q['document_tokens']} document tokens read: at "
                  f"{q['s_per_prefill_token']:.2f} s per token the whole prefill would take about "
                  f"{q['s_per_prefill_token'] * q['document_tokens'] / 60:.0f} min here. No answer to compare.", ""]
    else:
        lines += [f"Generated ids: **{'equal' if data['ids_equal'] else 'DIFFERENT'}** for both questions.", ""]
        for i, (a, b) in enumerate(zip(q["answers"], h["answers"])):
            lines += [f"Question {i + 1}: {data['questions'][i]!r}", "",
                      f"- qemu ids: `{a['generated_ids']}`", f"- host ids: `{b['generated_ids']}`",
                      f"- qemu text: {a['text']!r}", f"- host text: {b['text']!r}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--android", type=Path, help="android-cpu artifact after android/finish.sh")
    ap.add_argument("--host", type=Path, help="--target host artifact of the same model and settings")
    ap.add_argument("--apk", type=Path, default=ROOT / "build" / "android" / "edgekv-demo.apk")
    ap.add_argument("--document", choices=("readme", "opening"), default="readme")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-s", type=float, default=3000.0, help="stop the qemu run after this many seconds")
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the recorded .json")
    args = ap.parse_args(argv)
    if args.render:
        args.out.with_suffix(".md").write_text(render(json.loads(args.out.with_suffix(".json").read_text())))
        return 0
    if args.android is None or args.host is None:
        ap.error("--android and --host are required (see the usage above)")
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    text, questions = demo_document(args.document)
    with tempfile.TemporaryDirectory(prefix="android-qemu-") as tmp:
        work = Path(tmp)
        kit = build_kit(args.apk, work / "kit")
        doc = work / "doc.txt"
        doc.write_text(text, encoding="utf-8")
        host, host_wall = host_answers(args.host, doc, work, questions, args.max_new_tokens)
        q = run_harness(kit, args.android, doc, work, questions, args.max_new_tokens, threads=args.threads,
                        limit_s=args.limit_s)
        qv = subprocess.run([kit["qemu"], "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    res = q["result"]
    total = res["document_tokens"] if res else (q["blocks"][-1][1] if q["blocks"] else 0)
    done = total if res else (q["blocks"][-1][0] if q["blocks"] else 0)
    prefill_s = q["blocks"][-1][2] - (q["blocks"][0][2] if len(q["blocks"]) > 1 else 0) if q["blocks"] else 0
    per_token = (q["blocks"][-1][2] / q["blocks"][-1][0]) if q["blocks"] and q["blocks"][-1][0] else None
    answers = [{"generated_ids": a["generated_ids"], "text": "".join(utf16(t[1]) for t in a["tokens"]),
                "prefillTokens": a.get("prefillTokens")} for a in res["answers"]] if res else []
    host_rows = [{"generated_ids": a["generated_ids"], "text": a.get("text", "")} for a in host]
    data = {"provenance": prov, "document": args.document, "questions": questions,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "limit_s": args.limit_s,
            "qemu_version": qv, "android_artifact": str(args.android), "host_artifact": str(args.host),
            "qemu": {"document_tokens": total, "prefill_done": done, "stopped": q["stopped"], "wall_s": q["wall_s"],
                     "prefill_s": prefill_s, "s_per_prefill_token": per_token, "blocks": q["blocks"],
                     "answers": answers},
            "host": {"wall_s": host_wall, "answers": host_rows},
            "ids_equal": bool(res) and [a["generated_ids"] for a in answers] == [a["generated_ids"] for a in host_rows],
            "machine_shared": True}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(data))
    print(render(data))
    return 0 if (q["stopped"] or data["ids_equal"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
