"""What default weight verification costs at start-up (issue 31): the native runtime's open of a
SmolLM2 q4 artifact with ``--no-verify`` (trusting the file), with a full check of every weight's
CRC-32 (the first open of a file, or ``--verify-weights``), and with the stamp an earlier clean
check left (every later open); the same with the file's pages evicted from the page cache first
(a cold start: the check reads the file from storage, which the first prefill would read anyway);
the Python host runtime's check (zlib); and the same on a synthetic 1 GiB params file (the
SmolLM2 artifact with filler weights appended up to 1 GiB, each with its CRC — the check's cost
depends only on the bytes), to say how it scales.

    python tools/bench/bench_weights_verify.py --artifact DIR [--repeats 5] [--big-gib 1] [--out docs/results]

DIR: a SmolLM2 q4 artifact for the host CPU (``edgekv compile smollm2-135m -o DIR``); it is copied
(the copy gets per-weight CRCs when it was compiled before program format 1.2). Writes
weights_verify.json and weights_verify.md. Open times are the median of ``--repeats``, the modes
interleaved."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from edgekv.artifact import PARAMS_FILE, PROGRAM_FILE  # noqa: E402
from edgekv.artifact import program_file as pf  # noqa: E402
from edgekv.artifact.weights_check import STAMP_FILE, verify_weights  # noqa: E402

FILLER_TENSOR = 4 << 20  # bytes per synthetic weight


def prepare(src: Path, dest: Path, total_bytes: int | None = None) -> Path:
    """A copy of ``src`` whose program carries per-weight CRCs; with ``total_bytes``, the params
    file grown to that size by filler weights the program lists (and no function reads)."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(STAMP_FILE, "*.bin"))
    prog = pf.read(dest / PROGRAM_FILE)
    params = dest / PARAMS_FILE
    if total_bytes is not None:
        rng = os.urandom(FILLER_TENSOR)
        with open(params, "ab") as f:
            size = f.tell()
            i = 0
            while size + FILLER_TENSOR <= total_bytes:
                # each tensor distinct (its index in front), so the CRCs differ
                chunk = i.to_bytes(8, "little") + rng[8:]
                f.write(chunk)
                prog.buffers.append(pf.Buffer(pf.WEIGHT, "uint8", (FILLER_TENSOR,), f"synthetic_filler_{i}", size,
                                              FILLER_TENSOR))
                size += FILLER_TENSOR
                i += 1
        prog.settings["params_bytes"] = params.stat().st_size
    prog.settings.pop(pf.WEIGHT_CRCS, None)
    pf.fill_weight_crcs(prog, params)
    prog.settings["params_crc32"] = zlib.crc32(params.read_bytes())
    pf.write(prog, dest / PROGRAM_FILE)
    return dest


def evict_pages(path: Path) -> None:
    """Drop the file's clean pages from the page cache (the next read comes from storage)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_open(native, art: Path, verify: str, cold: bool, threads: int) -> tuple[float, str, float]:
    if verify == "stamped":  # a clean check's stamp in place
        native.NativeRuntime(art, verify="default", threads=threads).close()
    else:
        (art / STAMP_FILE).unlink(missing_ok=True)
    if cold:
        evict_pages(art / PARAMS_FILE)
    t0 = time.perf_counter()
    rt = native.NativeRuntime(art, verify={"stamped": "default", "full": "always", "off": "off"}[verify],
                              threads=threads)
    seconds = time.perf_counter() - t0
    how, check = rt.weights_check.how, rt.weights_check.seconds
    rt.close()
    return seconds, how, check


def measure(native, art: Path, repeats: int, threads: int) -> dict:
    rows = {}
    for cold in (False, True):
        samples: dict[str, list] = {"off": [], "full": [], "stamped": []}
        checks: dict[str, list] = {k: [] for k in samples}
        for _ in range(repeats):
            for mode in samples:  # interleaved
                s, how, check = time_open(native, art, mode, cold, threads)
                samples[mode].append(s)
                checks[mode].append(check)
        rows["cold" if cold else "warm"] = {
            mode: {"open_seconds_median": statistics.median(v), "open_seconds_all": v,
                   "check_seconds_median": statistics.median(checks[mode])} for mode, v in samples.items()}
    t0 = time.perf_counter()
    (art / STAMP_FILE).unlink(missing_ok=True)
    verify_weights(art, PARAMS_FILE, PROGRAM_FILE, mode="always")
    rows["python_check_seconds"] = time.perf_counter() - t0
    rows["params_bytes"] = (art / PARAMS_FILE).stat().st_size
    rows["weights"] = sum(1 for b in pf.read(art / PROGRAM_FILE).buffers if b.kind == pf.WEIGHT)
    return rows


def write_md(result: dict, path: Path) -> None:
    lines = ["# Weight verification at start-up (issue 31)", "",
             "Generated by `python tools/bench/bench_weights_verify.py " + result["command_args"] + "`.",
             f"Machine: {result['machine']}; {result['threads']} kernel threads. **The machine was shared with other "
             "work while this ran**: figures are medians of interleaved repeats; the lead reruns them on a quiet "
             "machine for the docs.", "",
             "The native runtime's `ekv_model_open` (program, library, weights mapped, tokenizer) per way of "
             "trusting the weights: `--no-verify` (off), a full check of every weight's CRC-32 (the first open of a "
             "file, or `--verify-weights`), and the stamp a clean check leaves beside the artifact (every later "
             "open of the same file). *cold*: the params file's pages evicted from the page cache before each open "
             "(the check reads it from storage; without the check the first prefill reads those pages instead).", "",
             "| artifact | params | weights | pages | off (s) | full check (s) | of which CRC (s) | stamped (s) "
             "| check MB/s | Python check (s) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["artifacts"].items():
        for pages in ("warm", "cold"):
            m = r[pages]
            crc = m["full"]["check_seconds_median"]
            mbs = r["params_bytes"] / 1e6 / crc if crc > 0 else float("nan")
            lines.append(f"| {name} | {r['params_bytes'] / 2**20:,.0f} MiB | {r['weights']} | {pages} | "
                         f"{m['off']['open_seconds_median']:.3f} | {m['full']['open_seconds_median']:.3f} | "
                         f"{crc:.3f} | {m['stamped']['open_seconds_median']:.3f} | {mbs:,.0f} | "
                         + (f"{r['python_check_seconds']:.3f} |" if pages == "warm" else "— |"))  # timed warm only
    lines += ["", "Scaling: the check reads every weight byte once, so its cost is the params size over the "
              "check's throughput (the `check MB/s` column; the CRC runs on the kernel threads, slicing by 8): linear "
              "in the file size, paid on the first open of a file only — later opens cost a `stat` of the params "
              "file and a read of the stamp while the file is unchanged (size, device, inode, mtime and ctime).", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True, help="a SmolLM2 q4 artifact for this CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big-gib", type=float, default=1.0, help="the synthetic params file's size (0: skip it)")
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: edgekv's choice)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args(argv)
    from edgekv.runtime import native
    from edgekv.threads import choose_threads

    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])  # captured before the run
    threads = args.threads or choose_threads(None).count
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores ({platform.processor() or 'cpu'})",
              "threads": threads, "repeats": args.repeats, "artifacts": {}, "provenance": prov,
              "command_args": f"--artifact {args.artifact} --repeats {args.repeats} --big-gib {args.big_gib}"}
    with tempfile.TemporaryDirectory(prefix="edgekv-verify-", dir=os.environ.get("EDGEKV_BENCH_TMP")) as tmp:
        art = prepare(args.artifact, Path(tmp) / "smollm2")
        result["artifacts"]["SmolLM2-135M q4"] = measure(native, art, args.repeats, threads)
        print(json.dumps(result["artifacts"]["SmolLM2-135M q4"]["warm"], indent=1), flush=True)
        if args.big_gib > 0:
            shutil.rmtree(art)
            big = prepare(args.artifact, Path(tmp) / "big", int(args.big_gib * 2**30))
            result["artifacts"][f"SmolLM2 + filler to {args.big_gib:g} GiB"] = measure(native, big, args.repeats,
                                                                                        threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights_verify.json").write_text(json.dumps(result, indent=2))
    write_md(result, args.out / "weights_verify.md")
    print((args.out / "weights_verify.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
