"""``edgekv simulate``: the whole flow behind the CLI command (which only parses options).

profiles → cap + mechanism → target (MODEL or ARTIFACT) → prompt ids → per policy: plan
check, child run under the cap, roofline estimates per device → tables → (sweep, plot,
report written atomically, only after everything else succeeded)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..budget import DEFAULT_BLOCK, DEFAULT_BUDGET, parse_budget
from ..errors import InputError
from ..memory import kv_bytes_per_token
from ..policies import make_policy
from ..units import human_bytes, parse_size
from . import limits
from .profiles import load_profiles
from .report import run_table, summary_table
from .roofline import estimate, estimate_all_units
from .runner import Job, Outcome, run_job
from .source import describe
from .sweep import plot, sweep_from_runs, write_json
from .work import GeometryWork, Schedule, work_from_manifest

@dataclass
class SimRequest:
    model: str | None
    text: str | None = None
    prompt_ids: list[int] | None = None
    devices: list[str] | None = None
    mem_limit: str | int | None = None
    policies: list[str] = field(default_factory=lambda: ["keydiff"])
    policy_args: dict = field(default_factory=dict)
    budget: str = DEFAULT_BUDGET
    block: int = DEFAULT_BLOCK
    max_new_tokens: int = 16
    chat: bool = False
    allow_beyond_context: bool = False
    mechanism: str = "auto"
    unit: str | None = None
    all_units: bool = False
    threads: int | None = None
    timeout_s: float | None = None
    report: Path | None = None
    sweep_json: Path | None = None
    plot: Path | None = None


def _policies(names: list[str]) -> list[str]:
    out = []
    for n in names or ["keydiff"]:
        out += [p.strip() for p in str(n).split(",") if p.strip()]
    return out


def simulate(req: SimRequest, console: Console | None = None, err: Console | None = None, say=None) -> dict:
    """Run the request; returns the result. ``say(line)``: one line per phase (the CLI's)."""
    from ..job import check_context, encode_prompt
    from ..output_files import check_writable

    console = console or Console()
    err = err or Console(stderr=True)
    for path, what in ((req.report, "--report"), (req.sweep_json, "--sweep-json"), (req.plot, "--plot")):
        check_writable(path, what)
    if req.plot is not None and Path(req.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise InputError(f"--plot {req.plot}: give a .png, .svg or .pdf file name")
    if req.block <= 0:
        raise InputError("--block must be a positive number of tokens")
    if req.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be ≥ 1")
    profiles = load_profiles(req.devices)
    if req.unit is not None:
        for p in profiles:
            if req.unit not in p.units:
                raise InputError(f"--unit {req.unit}: device {p.name} has no such compute unit ({', '.join(p.units)})")
    mech = limits.choose(req.mechanism)
    if req.mem_limit is None:
        cap = min(p.app_usable_bytes for p in profiles)
        cap_note = f"app-usable RAM of {min(profiles, key=lambda p: p.app_usable_bytes).name} (the smallest chosen device)"
    else:
        cap = req.mem_limit if isinstance(req.mem_limit, int) else parse_size(req.mem_limit)
        cap_note = "--mem-limit"
    policies = _policies(req.policies)
    for name in policies:
        make_policy(name, req.policy_args if len(policies) == 1 else {})
    target = describe(req.model)
    if target.kind == "artifact":
        m = target.manifest
        policies = [m.policy_name]
        policy_args = dict(m.policy_params)
        block = m.block
        err.print(f"artifact {target.artifact_dir}: policy {policies[0]}, N={m.budget}, B={block} from its manifest")
    else:
        policy_args, block = req.policy_args, req.block
    if req.prompt_ids is not None:
        ids = [int(i) for i in req.prompt_ids]
        if not ids:
            raise InputError("the prompt is empty")
    else:
        if target.tokenizer is None:
            raise InputError(f"model {target.model_id} has no tokenizer; give prompt token ids")
        ids = encode_prompt(target.as_loaded_like(), req.text or "", req.chat).tolist()
    check_context(target.as_loaded_like(), len(ids), req.max_new_tokens, req.allow_beyond_context)
    work = GeometryWork(target.config) if target.kind == "model" else work_from_manifest(target.manifest, target.config)

    err.print(f"memory cap {human_bytes(cap)} ({cap_note}) via [bold]{mech.name}[/]: {mech.reason}")
    runs: list[dict] = []
    outcomes: list[Outcome] = []
    for name in policies:
        args = policy_args if (len(policies) == 1 or target.kind == "artifact") else {}
        if target.kind == "artifact":
            n_budget = target.manifest.budget
        elif name == "full":
            n_budget = len(ids) + req.max_new_tokens
        else:
            n_budget = parse_budget(req.budget, target.config, block)
        job = Job(target, ids, name, args, n_budget, block, req.max_new_tokens, cap, mech, req.threads, req.timeout_s)
        progress = Progress(TextColumn(f"{name} N={n_budget:,}"), TextColumn("{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("tokens"), TimeElapsedColumn(), console=err, transient=True)
        task = progress.add_task("starting", total=len(ids))
        if say is not None:
            say(f"simulate: {name} N={n_budget:,} B={block}, {len(ids):,} prompt tokens, cap {human_bytes(cap)}")

        def on_stage(stage: str) -> None:
            progress.update(task, description=stage)
            if say is not None and not err.is_terminal:
                say(f"simulate: {name}: {stage}")

        with progress:
            outcome = run_job(job, on_progress=lambda n: progress.update(task, completed=n), on_stage=on_stage)
        sched = Schedule(len(ids), req.max_new_tokens, n_budget, block, name != "full")
        ests = []
        for p in profiles:
            ests += estimate_all_units(p, work, sched) if req.all_units else [estimate(p, work, sched, req.unit)]
        title = (f"edgekv simulate · {target.model_id} · {name} N={n_budget:,} B={block} · "
                 f"prompt {len(ids):,} tokens · {outcome.engine}")
        console.print(run_table(title, outcome, ests, work.source))
        outcomes.append(outcome)
        runs.append({**outcome.to_dict(), "estimates": [e.to_dict() for e in ests]})
    if len(outcomes) > 1:
        console.print(summary_table(outcomes))

    result = {
        "command": "simulate", "model": target.model_id, "target_kind": target.kind,
        "artifact": str(target.artifact_dir) if target.artifact_dir else None,
        "prompt_tokens": len(ids), "max_new_tokens": req.max_new_tokens, "block": block,
        "cap_bytes": cap, "cap_source": cap_note,
        "mechanism": {"name": mech.name, "reason": mech.reason, "measures": mech.measures},
        "kv_bytes_per_token": kv_bytes_per_token(target.config),
        "work_source": work.source, "runs": runs,
        "devices": {p.name: {"file": str(p.path), "app_usable_bytes": p.app_usable_bytes,
                             "bandwidth_GBps": p.bandwidth.value, "sources": p.sources()} for p in profiles},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    from .runner import REFUSED

    if all(o.status == REFUSED for o in outcomes):
        return result  # nothing ran: the caller reports the refusal, and nothing is written
    if req.sweep_json is not None or req.plot is not None:
        sweep = sweep_from_runs(target, runs, block, req.max_new_tokens, profiles, work, mech.name, req.unit)
        result["sweep"] = sweep
        for d in sweep["devices"]:
            err.print(f"{d['name']} (app-usable {human_bytes(d['app_usable_bytes'])}): longest prompt " +
                      ", ".join(f"{k} {'any length' if v is None else f'{v:,}'}" for k, v in d["max_prompt"].items()))
        if req.sweep_json is not None:
            write_json(req.sweep_json, sweep)
            err.print(f"sweep written to {req.sweep_json}")
        if req.plot is not None:
            plot(sweep, req.plot)
            err.print(f"plot written to {req.plot}")
    if req.report is not None:
        write_json(req.report, result)
        err.print(f"report written to {req.report}")
    return result


__all__ = ["SimRequest", "simulate"]
