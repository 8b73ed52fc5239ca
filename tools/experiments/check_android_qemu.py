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
docs/results/android_qemu.{json,md}: the ids from both sides and whether they are equal, the tokens,
the wall times, the exact command, and what was not run (the full README document, with the time
it would take at the measured rates). ``--deadline HH:MM`` (UTC) refuses, before anything runs, a
run that the rates of the last results file say would not finish by then.

    edgekv compile smollm2-135m --budget 512 --block 128 --policy keydiff --target android-cpu -o build/smol-android
    android/finish.sh build/smol-android
    edgekv compile smollm2-135m --budget 512 --block 128 --policy keydiff --target host -o build/smol-host
    android/build.sh
    python tools/experiments/check_android_qemu.py --android build/smol-android --host build/smol-host \\
        --apk build/android/edgekv-demo.apk [--document readme|opening] [--limit-s 3000] [--deadline 18:50]
    python tools/experiments/check_android_qemu.py --render        # the .md (and the estimates) from the .json

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
OUT = ROOT / "docs" / "results" / "android_qemu"
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
                chat: bool = True, threads: int = 2, limit_s: float | None = None, answers_only: bool = False) -> dict:
    """The harness under qemu; stopped after ``limit_s``. Its output (or None when stopped), the
    wall time, and the blocks and tokens with the second each finished at. ``answers_only``: without
    the harness's cancel and missing-artifact checks (the default suite's tiny model runs those)."""
    env = ([f"LD_LIBRARY_PATH={kit['shim']}", f"HARNESS_THREADS={threads}"] + (["HARNESS_CHAT=1"] if chat else [])
           + (["HARNESS_ANSWERS_ONLY=1"] if answers_only else []))
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
    return {"result": result, "wall_s": wall, "stopped": stopped, "blocks": blocks, "tokens": tokens,
            "command": cmd}


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
    answers = data["document"]["answers"] if "document" in data else data["answers"]
    return answers, wall, data.get("document_tokens")


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


def document_token_counts(artifact: Path) -> dict:
    """Tokens of each demo document by the artifact's tokenizer.json, without the chat template's
    few tokens (the estimate adds what the measured run shows they are)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(artifact / "tokenizer" / "tokenizer.json"))
    return {which: len(tok.encode(demo_document(which)[0], add_special_tokens=False).ids)
            for which in ("opening", "readme")}


def rates(data: dict) -> dict | None:
    """Seconds per document token (open included) and per generated token under qemu, from a run
    that read at least one block."""
    q = data["qemu"]
    if not q["s_per_prefill_token"]:
        return None
    per_decode = [a["decode_s_per_token"] for a in q["answers"] if a.get("decode_s_per_token")]
    return {"s_per_prefill_token": q["s_per_prefill_token"],
            "s_per_decode_token": max(per_decode) if per_decode else q["s_per_prefill_token"]}


def estimate_s(data: dict, which: str, max_new: int) -> float | None:
    """How long a run of ``which`` would take under qemu at the rates ``data`` measured: its
    document (plus the chat form's extra tokens as measured) at the document rate, then two
    answers of ``max_new`` tokens, each after the time the measured run took to its first token
    (the cache loaded, the question read; a quarter of ``max_new`` decode tokens where the run
    has no such figure)."""
    r = rates(data)
    counts = data.get("document_token_counts")
    if r is None or not counts:
        return None
    extra = data["qemu"]["document_tokens"] - counts[data["document"]]
    starts = [a.get("to_first_token_s") for a in data["qemu"]["answers"]]
    start = max(starts) if starts and None not in starts else max_new / 4 * r["s_per_decode_token"]
    return r["s_per_prefill_token"] * (counts[which] + extra) + 2 * (start + (max_new - 1) * r["s_per_decode_token"])


def answer_timing(answers: list[dict], tokens: list[tuple[int, float]], document_end_s: float | None = None) -> list[dict]:
    """Each answer's decode seconds per token from the harness's token timeline (the tokens of
    the answers in order), and the seconds to its first token from the end of the document (the
    first answer) or of the answer before (the cache loaded, the question read)."""
    out, at, before = [], 0, document_end_s
    for a in answers:
        n = len(a["generated_ids"])
        times = [t for _, t in tokens[at:at + n]]
        at += n
        a = dict(a, generated_tokens=n)
        if times and before is not None:
            a["to_first_token_s"] = times[0] - before
        if n > 1:
            a["decode_s_per_token"] = (times[-1] - times[0]) / (n - 1)
        before = times[-1] if times else None
        out.append(a)
    return out


def render(data: dict) -> str:
    q, h = data["qemu"], data["host"]
    lines = [f"# The README demo through the APK's own libraries under qemu-aarch64 ({data['document']})", "",
             f"Regenerate: `{data['provenance']['command']}` ({data['provenance']['started'][:10]}).", "",
             "SmolLM2-135M-Instruct, keydiff, N = 512, B = 128, `--chat`, greedy, "
             f"{data['max_new_tokens']} new tokens at most, {data['threads']} kernel threads. The APK's "
             "`libedgekv_runtime.so` and `libedgekv_jni.so` (built by `android/build.sh` for "
             f"aarch64-linux-android24) run under `{data['qemu_version']}` with the bionic shim, driven "
             "through the bridge's JNI functions (android/test/jni_harness.c: open, encode, prefill with "
             "progress, save the document's cache, answer; load the cache, answer) on an `android-cpu` "
             "artifact linked by `android/finish.sh`; the host side is `edgekv-run --chat` on a "
             "`--target host` artifact of the same model and settings. Times under qemu are emulation on "
             "this machine (shared with other work, 2 cores, run at nice 19), not a phone's.", "",
             "| | APK libraries, qemu-aarch64 | edgekv-run, x86-64 |", "|---|---|---|",
             f"| document tokens | {q['document_tokens']} | {h.get('document_tokens') or '—'} |",
             f"| prefill reached | {q['prefill_done']}/{q['document_tokens']} tokens | all |",
             f"| generated tokens | {', '.join(str(a['generated_tokens']) for a in q['answers']) or '—'} | "
             f"{', '.join(str(len(a['generated_ids'])) for a in h['answers'])} |",
             f"| wall seconds | {q['wall_s']:.0f}{' (stopped at the limit)' if q['stopped'] else ''} | "
             f"{h['wall_s']:.1f} |",
             f"| document seconds per token (open included) | {_num(q['s_per_prefill_token'])} | — |",
             f"| decode seconds per token | {', '.join(_num(a.get('decode_s_per_token')) for a in q['answers']) or '—'} | — |",
             f"| seconds to each answer's first token | "
             f"{', '.join(_num(a.get('to_first_token_s')) for a in q['answers']) or '—'} | — |",
             ""]
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
    lines += ["Commands:", "", f"- this tool: `{data['provenance']['command']}`",
              f"- under qemu: `{' '.join(data['qemu_command'])}`", f"- on the host: `{data['host_command']}`", ""]
    if data.get("not_run"):
        lines += ["**Not run:** " + data["not_run"], ""]
    return "\n".join(lines)


def not_run_note(data: dict, max_new: int) -> str | None:
    """What this run left out, with the time the rest would take at the measured rates."""
    if data["document"] == "readme":
        return None
    est = estimate_s(data, "readme", max_new)
    counts = data.get("document_token_counts", {})
    when = f"about {est / 3600:.1f} h under qemu at this run's rates" if est else "an unknown time (no rate measured)"
    return (f"the full README document (`--document readme`: {counts.get('readme', '?')} tokens by the tokenizer "
            f"before the chat form, its closing question and a second one) through the same libraries: {when}. "
            f"The opening paragraph ({data['qemu']['document_tokens']} tokens in the chat form, the slow test's "
            "variant) was run instead: the same libraries and steps over one block instead of a document that "
            "evicts.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--android", type=Path, help="android-cpu artifact after android/finish.sh")
    ap.add_argument("--host", type=Path, help="--target host artifact of the same model and settings")
    ap.add_argument("--apk", type=Path, default=ROOT / "build" / "android" / "edgekv-demo.apk")
    ap.add_argument("--document", choices=("readme", "opening"), default="readme")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-s", type=float, default=3000.0, help="stop the qemu run after this many seconds")
    ap.add_argument("--deadline", help="HH:MM (UTC): refuse a run the last results' rates say would end later")
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix")
    ap.add_argument("--render", action="store_true", help="rewrite the .md and the estimates from the recorded .json")
    args = ap.parse_args(argv)
    if args.render:  # the derived fields (estimates, what was not run) again from the recorded run, and the .md
        data = json.loads(args.out.with_suffix(".json").read_text())
        q = data["qemu"]
        if q.get("tokens") and q["blocks"] and not q["stopped"]:
            q["answers"] = answer_timing(q["answers"], [tuple(t) for t in q["tokens"]], q["blocks"][-1][2])
        data["estimate_s"] = {w: estimate_s(data, w, data["max_new_tokens"]) for w in ("opening", "readme")}
        data["not_run"] = not_run_note(data, data["max_new_tokens"])
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(render(data))
        return 0
    if args.android is None or args.host is None:
        ap.error("--android and --host are required (see the usage above)")
    if args.deadline:
        refusal = deadline_refusal(args)
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    text, questions = demo_document(args.document)
    with tempfile.TemporaryDirectory(prefix="android-qemu-") as tmp:
        work = Path(tmp)
        kit = build_kit(args.apk, work / "kit")
        doc = work / "doc.txt"
        doc.write_text(text, encoding="utf-8")
        host, host_wall, host_doc_tokens = host_answers(args.host, doc, work, questions, args.max_new_tokens)
        q = run_harness(kit, args.android, doc, work, questions, args.max_new_tokens, threads=args.threads,
                        limit_s=args.limit_s, answers_only=True)
        qv = subprocess.run([kit["qemu"], "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    res = q["result"]
    total = res["document_tokens"] if res else (q["blocks"][-1][1] if q["blocks"] else 0)
    done = total if res else (q["blocks"][-1][0] if q["blocks"] else 0)
    prefill_s = q["blocks"][-1][2] - (q["blocks"][0][2] if len(q["blocks"]) > 1 else 0) if q["blocks"] else 0
    per_token = (q["blocks"][-1][2] / q["blocks"][-1][0]) if q["blocks"] and q["blocks"][-1][0] else None
    answers = [{"generated_ids": a["generated_ids"], "text": "".join(utf16(t[1]) for t in a["tokens"]),
                "prefillTokens": a.get("prefillTokens")} for a in res["answers"]] if res else []
    answers = answer_timing(answers, q["tokens"], q["blocks"][-1][2] if res and q["blocks"] else None)
    host_rows = [{"generated_ids": a["generated_ids"], "text": a.get("text", "")} for a in host]
    host_cmd = ("edgekv-run HOST_ARTIFACT --prompt-file DOC --chat "
                + " ".join(f"--question {json.dumps(x)}" for x in questions)
                + f" --max-new-tokens {args.max_new_tokens} --report host-run.json --quiet")
    data = {"provenance": prov, "document": args.document, "questions": questions,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "limit_s": args.limit_s,
            "qemu_version": qv, "android_artifact": str(args.android), "host_artifact": str(args.host),
            "apk": str(args.apk), "qemu_command": [str(c) for c in q["command"]], "host_command": host_cmd,
            "document_token_counts": document_token_counts(args.host),
            "qemu": {"document_tokens": total, "prefill_done": done, "stopped": q["stopped"], "wall_s": q["wall_s"],
                     "prefill_s": prefill_s, "s_per_prefill_token": per_token, "blocks": q["blocks"],
                     "tokens": q["tokens"], "answers": answers},
            "host": {"wall_s": host_wall, "document_tokens": host_doc_tokens, "answers": host_rows},
            "ids_equal": bool(res) and [a["generated_ids"] for a in answers] == [a["generated_ids"] for a in host_rows],
            "machine_shared": True}
    data["estimate_s"] = {w: estimate_s(data, w, args.max_new_tokens) for w in ("opening", "readme")}
    data["not_run"] = not_run_note(data, args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(data))
    print(render(data))
    return 0 if (q["stopped"] or data["ids_equal"]) else 1


def deadline_refusal(args, now=None) -> str | None:
    """Why a run of ``args.document`` would not end by ``args.deadline`` (UTC, today) at the rates
    the last results file recorded; None when it would, or refuses when there are no rates.
    ``now``: an aware datetime (the clock when not given)."""
    import datetime as dt

    hh, mm = (int(x) for x in args.deadline.split(":"))
    now = now or dt.datetime.now(dt.timezone.utc)
    left = (now.replace(hour=hh, minute=mm, second=0, microsecond=0) - now).total_seconds()
    last = args.out.with_suffix(".json")
    if not last.exists():
        return f"no rates recorded in {last}: run --document opening first, then --deadline can estimate"
    est = estimate_s(json.loads(last.read_text()), args.document, args.max_new_tokens)
    if est is None:
        return f"{last} has no measured rate (its run read no block): run --document opening first"
    if est > left:
        return (f"--document {args.document} would take about {est / 60:.0f} min under qemu at the rates in {last}, "
                f"and {max(left, 0) / 60:.0f} min are left until {args.deadline} UTC: not started")
    return None


if __name__ == "__main__":
    raise SystemExit(main())
