"""What the native runtime costs beside the model, against linking TVM's own runtime instead:
file sizes, shared-library dependencies, and the peak RSS of loading and checking an artifact
(`edgekv-run ARTIFACT --check`) with and without TVM's runtime libraries in the process.

    python tools/bench/native_footprint.py [--artifact DIR] [--out docs/results]

Writes native_footprint.json and native_footprint.md (docs/RESULTS.md includes the table).
Without --artifact it compiles a tiny random model (the numbers are then about the runtime,
not the weights)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def peak_rss_kib(cmd: list[str], env: dict | None = None) -> int:
    """Peak RSS of a command, from GNU time's %M (KiB)."""
    res = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr[-800:]}")
    return int(res.stderr.strip().splitlines()[-1])


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args()

    import tvm
    import tvm_ffi

    from edgekv.evaluation.report import provenance
    from edgekv.runtime import native

    origin = provenance([sys.executable, *sys.argv])  # before the work: the commit that ran
    exe, lib = native.cli_path(), native.library_path()
    if exe is None or lib is None:
        sys.exit("the native runtime is not built: pip install -e .")
    tmp = tempfile.TemporaryDirectory()
    art = args.artifact
    if art is None:
        from edgekv.compiler import compile_model
        from edgekv.models import tiny_random_model
        from edgekv.policies import make_policy

        art = Path(tmp.name) / "tiny"
        compile_model(tiny_random_model(0), make_policy("keydiff", {}), 64, 16, target="host", out_dir=art)
    tvm_lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime.so"
    ffi_lib = Path(tvm_ffi.__file__).parent / "lib" / "libtvm_ffi.so"
    check = [str(exe), str(art), "--check"]
    rss_native = peak_rss_kib(check)
    rss_with_tvm = peak_rss_kib(check, {"LD_PRELOAD": f"{ffi_lib}:{tvm_lib}"})
    rss_import_tvm = peak_rss_kib([sys.executable, "-c", "import tvm"])
    data = {
        "artifact": str(art),
        "files_bytes": {"edgekv-run": exe.stat().st_size, "libedgekv_runtime.so": lib.stat().st_size,
                        "libtvm_runtime.so": tvm_lib.stat().st_size, "libtvm_ffi.so": ffi_lib.stat().st_size},
        "needed": {"edgekv-run": needed(exe), "libedgekv_runtime.so": needed(lib),
                   "libtvm_runtime.so": needed(tvm_lib), "libtvm_ffi.so": needed(ffi_lib)},
        "peak_rss_kib": {"edgekv-run --check": rss_native,
                         "edgekv-run --check with TVM's runtime libraries loaded": rss_with_tvm,
                         "python -c 'import tvm'": rss_import_tvm},
        "provenance": origin,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "native_footprint.json").write_text(json.dumps(data, indent=2))
    mib = lambda kib: f"{kib / 1024:.1f} MiB"  # noqa: E731
    lines = ["# Native runtime footprint", "",
             "Regenerate: `python tools/bench/native_footprint.py` (artifact: "
             f"{'a tiny random model' if args.artifact is None else args.artifact}; commit {origin['commit']}).", "",
             "| file | bytes | needs |", "|---|---:|---|"]
    for name, size in data["files_bytes"].items():
        lines.append(f"| {name} | {size:,} | {', '.join(data['needed'][name])} |")
    lines += ["", "| process | peak RSS |", "|---|---:|"]
    for name, kib in data["peak_rss_kib"].items():
        lines.append(f"| {name} | {mib(kib)} |")
    lines += ["", "TVM's runtime would bring the Relax VM, its object system and libstdc++ to run what the "
              "program file already lists as plain kernel calls; the kernels themselves need only the few "
              "functions `runtime/src/kernel_abi.c` provides. So the runtime provides them itself."]
    (args.out / "native_footprint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
