"""Sweep: the longest prompt that fits under a cap, per policy and budget, and the estimated
speed on each device as the prompt grows. JSON + a matplotlib plot.

Fit is decided the same way a run is: static plan (``plan_for``) + the runtime overhead the
child measured under the cap (Python, torch, tokenizer, allocator: the measured peak minus
the plan). An evicting policy's plan does not depend on the prompt length, so it fits any
length or none; the full cache grows with the prompt, so it has a longest prompt."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .profiles import DeviceProfile
from .roofline import estimate
from .runner import plan_for
from .source import Target
from .work import Schedule, WorkModel

GiB = 2**30
DEFAULT_CAPS = [0.5 + 0.125 * i for i in range(45)]  # 0.5 … 6 GiB
DEFAULT_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
MAX_SEARCH = 1 << 24
DEFAULT_OVERHEAD = 450 * 2**20  # only when no run measured one (flagged in the output)


@dataclass(frozen=True)
class Series:
    policy: str
    budget: int | None  # None: `full` (N = prompt + output)
    policy_args: tuple = ()

    @property
    def label(self) -> str:
        return "full cache" if self.policy == "full" else f"{self.policy} N={self.budget:,}"


def need_bytes(target: Target, s: Series, prompt: int, block: int, max_new: int, overhead: int) -> int:
    n = prompt + max_new if s.policy == "full" else s.budget
    return plan_for(target, s.policy, dict(s.policy_args), max(n, 1), block).total + overhead


def longest_prompt(target: Target, s: Series, cap: int, block: int, max_new: int, overhead: int) -> float:
    """Longest prompt (tokens) whose need ≤ cap: math.inf for any length, 0 for none."""
    if s.policy != "full":
        return math.inf if need_bytes(target, s, 0, block, max_new, overhead) <= cap else 0
    if need_bytes(target, s, 1, block, max_new, overhead) > cap:
        return 0
    lo, hi = 1, MAX_SEARCH
    if need_bytes(target, s, hi, block, max_new, overhead) <= cap:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need_bytes(target, s, mid, block, max_new, overhead) <= cap:
            lo = mid
        else:
            hi = mid
    return lo


def run_sweep(target: Target, series: list[Series], block: int, max_new: int, overhead: int, overhead_source: str,
              profiles: list[DeviceProfile], work: WorkModel, caps: list[int] | None = None,
              lengths: list[int] | None = None, unit: str | None = None, mechanism: str = "") -> dict:
    caps = caps or [int(c * GiB) for c in DEFAULT_CAPS]
    lengths = lengths or DEFAULT_LENGTHS

    def enc(x: float):
        return None if math.isinf(x) else int(x)

    out = {
        "model": target.model_id, "block": block, "max_new_tokens": max_new, "mechanism": mechanism,
        "runtime_overhead_bytes": overhead, "runtime_overhead_source": overhead_source,
        "trained_context": target.config.max_position,
        "caps_bytes": caps, "series": [], "devices": [], "speed": [], "work_source": work.source,
        "notes": "max_prompt null = any length (memory does not grow with the prompt); estimates are ideal "
                 "roofline lower bounds from the profiles' peak figures",
    }
    for s in series:
        row = {"label": s.label, "policy": s.policy, "budget": s.budget,
               "max_prompt": [enc(longest_prompt(target, s, c, block, max_new, overhead)) for c in caps]}
        if s.policy != "full":
            row["need_bytes"] = need_bytes(target, s, 0, block, max_new, overhead)
        out["series"].append(row)
    for p in profiles:
        cap = p.app_usable_bytes
        out["devices"].append({
            "name": p.name, "app_usable_bytes": cap,
            "max_prompt": {s.label: enc(longest_prompt(target, s, cap, block, max_new, overhead)) for s in series},
        })
        u = unit if unit in p.units else p.default_unit
        for s in series:
            pre, dec = [], []
            for n in lengths:
                budget = n + max_new if s.policy == "full" else s.budget
                e = estimate(p, work, Schedule(n, max_new, budget, block, s.policy != "full"), u)
                pre.append(e.prefill_tok_s)
                dec.append(e.decode_tok_s)
            out["speed"].append({"device": p.name, "unit": u, "precision": e.precision, "series": s.label,
                                 "prompt_tokens": lengths, "prefill_tok_s": pre, "decode_tok_s": dec})
    return out


def measured_points(runs: list[dict]) -> list[dict]:
    """The runs of one invocation as points on the fit plot (cap, prompt, fitted or not)."""
    return [{"label": "full cache" if r["policy"] == "full" else f"{r['policy']} N={r['budget']:,}",
             "cap_bytes": r["cap"], "prompt_tokens": r["prompt_tokens"], "fits": bool(r["fits"]),
             "status": r["status"]} for r in runs if r["status"] != "not run (cross-compiled artifact)"]


def _atomic(path: Path, write) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=path.suffix, dir=path.parent or ".")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the user's usual permissions
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2)))


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ax = axes[0]
    caps = [c / GiB for c in data["caps_bytes"]]
    finite = [v for s in data["series"] for v in s["max_prompt"] if v]
    top = max([data["trained_context"] * 8] + [v * 2 for v in finite])
    for s in data["series"]:
        ys = [top if v is None else (v if v > 0 else float("nan")) for v in s["max_prompt"]]
        style = "--" if s["policy"] == "full" else "-"
        ax.plot(caps, ys, style, marker="o", ms=2.5, label=s["label"] + (" (nothing fits left of the line)" if s["policy"] != "full" else ""))
    points = data.get("measured", [])
    for i, m in enumerate(points):
        dx = 0.07 * (i - (len(points) - 1) / 2)  # runs at the same cap and length side by side
        ax.plot([m["cap_bytes"] / GiB + dx], [m["prompt_tokens"]], "P" if m["fits"] else "X", ms=10,
                color="tab:green" if m["fits"] else "tab:red", zorder=5,
                label=f"measured run: {m['label']}, {m['prompt_tokens']:,} tokens — " + ("fits" if m["fits"] else "does not fit"))
    ax.axhline(data["trained_context"], color="grey", ls=":", lw=1)
    ax.text(caps[-1], data["trained_context"] * 0.75, f"trained context {data['trained_context']:,}", fontsize=8,
            color="grey", ha="right", va="top")
    ax.axhline(top, color="black", lw=0.5)
    ax.text(caps[-1], top * 1.15, "any length (memory independent of the prompt)", fontsize=8, ha="right")
    for d in data["devices"]:
        ax.axvline(d["app_usable_bytes"] / GiB, color="tab:purple", ls=":", lw=1)
        ax.text(d["app_usable_bytes"] / GiB, 2, d["name"], rotation=90, fontsize=7, color="tab:purple", va="bottom")
    ax.set_yscale("log")
    ax.set_ylim(1, top * 3)
    ax.set_xlabel("memory cap (GiB)")
    ax.set_ylabel("longest prompt that fits (tokens)")
    ax.set_title(f"{data['model']}: longest prompt under a cap\n(plan + measured runtime overhead "
                 f"{data['runtime_overhead_bytes'] / 2**20:,.0f} MiB, {data['mechanism']})", fontsize=9)
    ax.legend(fontsize=7, loc="center right")
    colors = {}
    for i, key in enumerate(("decode_tok_s", "prefill_tok_s")):
        ax = axes[1 + i]
        for sp in data["speed"]:
            c = colors.setdefault(sp["device"], f"C{len(colors)}")
            style = "--" if sp["series"] == "full cache" else "-"
            ax.plot(sp["prompt_tokens"], sp[key], style, color=c, marker=".",
                    label=f"{sp['device']} ({sp['unit']}) · {sp['series']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tokens / s (estimate)")
        ax.set_title(("decode" if key == "decode_tok_s" else "prefill") +
                     " speed, ideal roofline on the device\n(fp32 as built; dashed = full cache)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=6.5, loc="lower left")
    fig.tight_layout()
    _atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png"))
    plt.close(fig)


def sweep_from_runs(target: Target, runs: list[dict], block: int, max_new: int, profiles: list[DeviceProfile],
                    work: WorkModel, mechanism: str, unit: str | None = None) -> dict:
    """The sweep for one invocation's runs (``Outcome.to_dict()``): their policies and budgets
    plus the full cache, with the runtime overhead the children measured."""
    measured = [r["runtime_overhead"] for r in runs if r["fits"] and r.get("runtime_overhead") is not None]
    if measured:
        overhead, src = max(measured), f"measured in this invocation's child runs ({mechanism}, max over fitting runs)"
    else:
        partial = [r["runtime_overhead"] for r in runs if r.get("runtime_overhead") is not None]
        overhead = max(partial) if partial else DEFAULT_OVERHEAD
        src = ("measured after model load in a run that did not fit" if partial else
               "NOT measured (no run fitted): default 450 MiB")
    series: list[Series] = []
    for r in runs:
        s = Series(r["policy"], None if r["policy"] == "full" else r["budget"])
        if s not in series:
            series.append(s)
    if Series("full", None) not in series:
        series.append(Series("full", None))
    sweep = run_sweep(target, series, block, max_new, int(overhead), src, profiles, work, unit=unit, mechanism=mechanism)
    sweep["measured"] = measured_points(runs)
    return sweep
