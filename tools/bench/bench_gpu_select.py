"""The GPU select + compaction kernel before and after issue 35, timed on an OpenCL device (PoCL
here; any device pyopencl sees) from profiling events, for SmolLM2's shapes (3 KV heads, head dim
64): N = 512 and N = 8192, a prefill step (a full cache and a block of B = 128 rows: 128
evictions) and a decode step (B = 1: one eviction).

"before" is ``build_select_compact_kernel_gpu`` as of ``--before`` (default: the commit before the
work-group select; one work-group per head, n − N rounds of a minimum search, then a second launch
of one work-item for ``fill``); "after" is this tree's. Both run on the same random inputs and
must leave the same cache (checked). Each is built with PoCL's optimiser and with
``-cl-opt-disable`` (the runtime builds eviction kernels unoptimised on PoCL, docs/TARGETS.md).
Times are the sum of the kernel's launches per step (median of ``--repeat`` runs, each on fresh
inputs copied in on the device), not wall time; PoCL runs on the host CPU, so these say how the
work scales, not what a GPU does — ``device_tests/gpu_check.sh`` measures a GPU.

    python -m tools.bench.bench_gpu_select                       # writes docs/results/gpu_select.{json,md}
    python -m tools.bench.bench_gpu_select --shapes 512 --repeat 3 --out /tmp/gs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "f72df0f"  # main before the work-group select (issue 35)
H, D = 3, 64
_KERNEL = re.compile(r"__kernel void (\w+)\(([^)]*)\)\s*\{")
_LAUNCH = re.compile(r'T\.thread_binding\((\d+), thread="(blockIdx|threadIdx)\.x"\)')


def builder_at(rev: str):
    """``build_select_compact_kernel_gpu`` from ``edgekv/compiler/kernels/select.py`` at git ``rev``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:edgekv/compiler/kernels/select.py"],
                         capture_output=True, text=True, check=True).stdout
    # a file of its own: TVMScript reads a kernel's source back through inspect
    path = Path(tempfile.mkdtemp(prefix="edgekv-select-")) / ("select_at_" + re.sub(r"\W", "_", rev) + ".py")
    path.write_text(src)
    name = "edgekv.compiler.kernels." + path.stem  # its relative imports resolve in edgekv's package
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.build_select_compact_kernel_gpu


def opencl_program(func, ctx, options):
    """(program, [(kernel, [buffer names])], [(groups, local)]) of a thread-bound PrimFunc."""
    import pyopencl as cl
    import tvm

    ex = tvm.compile(tvm.IRModule({"sel": func.with_attr("global_symbol", "sel")}),
                     target=tvm.target.Target("opencl", host="llvm"))
    src = ex.mod.imports[0].inspect_source()
    kernels = [(m.group(1), [re.match(r"__global \w+\* restrict (\w+)_ptr$", a.strip()).group(1)
                             for a in m.group(2).split(",")]) for m in _KERNEL.finditer(src)]
    ext = [int(e) for e, _ in _LAUNCH.findall(func.script())]
    launches = [(ext[i], ext[i + 1]) for i in range(0, len(ext), 2)]
    return cl.Program(ctx, src).build(options=options), kernels, launches


def inputs(N, B, nf, nv, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "k_cache": rng.standard_normal((H, N, D)).astype("float32"),
        "v_cache": rng.standard_normal((H, N, D)).astype("float32"),
        "pos_cache": np.tile(np.arange(N, dtype="int32"), (H, 1)),
        "fill": np.array([nf], "int32"),
        "k_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
        "v_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
        "pos_blk": np.arange(nf, nf + B, dtype="int32"),
        "n_valid": np.array([nv], "int32"),
        "score": rng.standard_normal((H, N + B)).astype("float32"),
    }


def time_kernel(func, arrays, ctx, options, repeat):
    """(median µs of the step's launches, launches, the final cache) on fresh copies of ``arrays``."""
    import pyopencl as cl

    prog, kernels, launches = opencl_program(func, ctx, options)
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    mf = cl.mem_flags
    pristine = {k: cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(v))
                for k, v in arrays.items()}
    work = {k: cl.Buffer(ctx, mf.READ_WRITE, size=v.nbytes) for k, v in arrays.items()}
    handles = [(cl.Kernel(prog, name), args) for name, args in kernels]
    times = []
    for _ in range(repeat + 1):  # the first run warms up
        for k in arrays:
            cl.enqueue_copy(queue, work[k], pristine[k])
        events = [k(queue, (g * l,), (l,), *[work[a] for a in args]) for (k, args), (g, l) in zip(handles, launches)]
        queue.finish()
        times.append(sum(e.profile.end - e.profile.start for e in events) / 1e3)
    out = {k: np.empty_like(v) for k, v in arrays.items() if k in ("k_cache", "v_cache", "pos_cache", "fill")}
    for k, v in out.items():
        cl.enqueue_copy(queue, v, work[k])
    queue.finish()
    return float(np.median(times[1:])), launches, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="512,8192", help="cache budgets N, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--before", default=BEFORE, help="git revision of the 'before' kernel")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_select"), help="path stem of .json/.md")
    args = ap.parse_args(argv)
    try:
        import pyopencl as cl
    except ImportError:
        print("needs pyopencl and an OpenCL device: pip install pyopencl; apt-get install pocl-opencl-icd")
        return 2
    from edgekv.compiler.kernels.select import build_select_compact_kernel_gpu
    from edgekv.evaluation.report import provenance

    prov = provenance([sys.executable, *sys.argv])
    dev = next(d for p in cl.get_platforms() for d in p.get_devices())
    ctx = cl.Context([dev])
    before = builder_at(args.before)
    rows = []
    for N in (int(x) for x in args.shapes.split(",")):
        for step, B, nv in (("prefill", 128, 128), ("decode", 1, 1)):
            a = inputs(N, B, N, nv, seed=N + B)
            caches = {}
            for which, build in (("before", before), ("after", build_select_compact_kernel_gpu)):
                func = build(H, N, B, D, "float32", True, 0)
                for opt in ("-cl-opt-disable", ""):
                    if which == "before" and opt == "":
                        continue  # the runtime never ran it optimised on PoCL: it miscompiled (docs/TARGETS.md)
                    t0 = time.time()
                    us, launches, cache = time_kernel(func, a, ctx, opt, args.repeat)
                    caches[(which, opt)] = cache
                    rows.append({"N": N, "B": B, "step": step, "evictions": nv, "kernel": which,
                                 "build": "unoptimised" if opt else "optimised", "kernel_us": round(us, 1),
                                 "launches": [f"{g}x{loc}" for g, loc in launches],
                                 "single_work_item_launches": sum(1 for g, loc in launches if g * loc == 1)})
                    print(f"N={N} {step:7s} {which:6s} {rows[-1]['build']:11s} {us:10.1f} us  launches "
                          f"{rows[-1]['launches']}  ({time.time() - t0:.0f} s)", flush=True)
            ref = caches[("before", "-cl-opt-disable")]
            for key, cache in caches.items():
                k = min(N + nv, N)
                for name in ("k_cache", "v_cache", "pos_cache", "fill"):
                    x, y = ref[name], cache[name]
                    if name != "fill":
                        x, y = x[:, :k], y[:, :k]
                    if not np.array_equal(x, y):
                        raise SystemExit(f"N={N} {step}: {key} leaves a different {name} than the 'before' kernel")
    result = {"meta": {**prov, "device": f"{dev.platform.name} / {dev.name}", "before": args.before,
                       "heads": H, "head_dim": D, "repeat": args.repeat,
                       "what": "sum of the select step's kernel launches, OpenCL profiling events, median"},
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# GPU select + compaction on {result['meta']['device']}", "",
             f"`{prov['command']}` at {prov['commit']}; SmolLM2 shapes (3 KV heads, d = 64); kernel time "
             "from OpenCL profiling events (median). PoCL runs on the host CPU: this is how the work "
             "scales, not GPU speed.", "",
             "| N | step | kernel | build | µs | launches (groups×local) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['step']} (B = {r['B']}) | {r['kernel']} | {r['build']} | {r['kernel_us']} | "
              f"{', '.join(r['launches'])} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
