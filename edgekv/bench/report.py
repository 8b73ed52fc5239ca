"""Benchmark output: the ratio table (edgekv / peer, same run), markdown and a plot."""

from __future__ import annotations

from ..units import human_bytes


def _row(results, system, length):
    for r in results["runs"]:
        if r["system"] == system and r["length"] == length:
            return r
    return None


def own_rss(r: dict) -> int:
    """The system's own peak memory (``worker.py``): older results have only the process peak."""
    return r.get("own_rss") or r["peak_rss"]


def markdown(results: dict) -> str:
    cfg = results["config"]
    systems = [s for s in cfg["systems"] if s not in results["skipped"]]
    lines = [f"Model `{cfg['model']}`, policy `{cfg['policy']}`, N = {cfg['budget']}, B = {cfg['block']}, "
             f"{cfg['threads']} threads, decode {cfg['decode_tokens']} tokens, median of {cfg['repeats']} runs, "
             "each run in its own process.", "",
             "| system | prompt | prefill tok/s | decode tok/s | peak RSS | own RSS |", "|---|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['length']} | error: {r['error'][:80]} | | | |")
            continue
        dec = f"{r['decode_tok_s']:.1f}" if r.get("decode_tok_s") else "—"
        pre = f"{r['prefill_tok_s']:.1f}" if not r["memory_only"] else f"({r['prefill_tok_s']:.1f}, memory run)"
        lines.append(f"| {r['system']} | {r['length']} | {pre} | {dec} | {human_bytes(r['peak_rss'])} | "
                     f"{human_bytes(own_rss(r))} |")
    lines += ["", "own RSS: a system run inside the Python worker (HF, kvpress, llama.cpp, ONNX Runtime, "
              "edgekv eager/compiled) is charged its process peak less the interpreter's RSS before it loaded "
              "anything (Python + torch); `edgekv-run` is its own C process, charged all of it. Memory ratios "
              "below use own RSS."]
    # peers of each edgekv system: the other projects, and the fp32 build of the same artifact
    peers = [s for s in systems if not s.startswith("edgekv")] + [s for s in systems if s == "edgekv-native-fp32"]
    for ours in [s for s in systems if s.startswith("edgekv") and s != "edgekv-native-fp32"]:
        lines += ["", f"**{ours} / peer** (ratio > 1: edgekv faster; memory ratio < 1: edgekv smaller)", "",
                  "| peer | prompt | prefill | decode | own RSS |", "|---|---:|---:|---:|---:|"]
        for peer in peers:
            for length in cfg["lengths"]:
                a, b = _row(results, ours, length), _row(results, peer, length)
                if not a or not b or "error" in a or "error" in b:
                    continue
                dec = f"{a['decode_tok_s'] / b['decode_tok_s']:.2f}×" if a.get("decode_tok_s") and b.get("decode_tok_s") else "—"
                lines.append(f"| {peer} | {length} | {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}× | {dec} | "
                             f"{own_rss(a) / own_rss(b):.2f}× |")
    if "edgekv-native" in systems and "edgekv-compiled" in systems:
        # the native runtime against the TVM VM runtime on the same artifact, and its memory against its plan
        lines += ["", "**edgekv-native / edgekv-compiled** (the same artifact; native runtime vs TVM's VM), and the "
                  "native process's peak RSS against its static plan (weights + KV cache + activations)", "",
                  "| prompt | prefill | decode | peak RSS | native peak RSS / plan | native start-up (load + first "
                  "block) |", "|---:|---:|---:|---:|---:|---:|"]
        for r in results["runs"]:
            if r["system"] != "edgekv-native" or "error" in r:
                continue
            b = _row(results, "edgekv-compiled", r["length"])
            if not b or "error" in b:
                continue
            dec = f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}×" if r.get("decode_tok_s") and b.get("decode_tok_s") else "—"
            plan = f"{r['peak_rss'] / r['plan_bytes']:.3f}" if r.get("plan_bytes") else "—"
            start = f"{r['startup_seconds']:.2f} s" if r.get("startup_seconds") is not None else "—"
            label = f"{r['length']}" + (" (memory run)" if r["memory_only"] else "")
            lines.append(f"| {label} | {r['prefill_tok_s'] / b['prefill_tok_s']:.2f}× | {dec} | "
                         f"{r['peak_rss'] / b['peak_rss']:.2f}× | {plan} | {start} |")
    machine = results.get("machine")
    if machine:
        lines.append(f"\nMeasured on {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}, "
                     f"commit {machine['commit'] or '?'}, load average {machine.get('load', '?')} before the run; "
                     f"command: `{results.get('command', 'edgekv bench')}`. A single busy 2-core machine: "
                     "read ratios from one run, not absolute speeds across runs.")
    for system, why in results["skipped"].items():
        lines.append(f"\n- `{system}` not measured: {why}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    systems = sorted({r["system"] for r in results["runs"]})
    for s in systems:
        rows = sorted((r for r in results["runs"] if r["system"] == s and "error" not in r), key=lambda r: r["length"])
        timed = [r for r in rows if not r["memory_only"]]
        if timed:
            ax1.plot([r["length"] for r in timed], [r["prefill_tok_s"] for r in timed], marker="o", label=s)
        ax2.plot([r["length"] for r in rows], [r["peak_rss"] / 2**20 for r in rows], marker="o", label=s)
    ax1.set(xlabel="prompt tokens", ylabel="prefill tok/s", xscale="log", title="prefill speed")
    ax2.set(xlabel="prompt tokens", ylabel="peak RSS (MiB)", xscale="log", title="peak memory")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
