"""`edgekv simulate`: a run under an enforced memory cap in a child process, with roofline
estimates on phone profiles; the flow is ``edgekv/simulate/command.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ..budget import DEFAULT_BLOCK, DEFAULT_BUDGET
from ..errors import USER_ERRORS, InputError
from .common import DEFAULT_POLICY, HELP, err, fail, read_prompt, say, setup_threads

# two help texts of its own: simulate passes --policy-arg to one policy only, and --budget matters to evicting ones
SIMULATE_HELP = {
    "policy_arg": "policy parameter key=value, or policy:key=value (repeatable)",
    "budget": f"KV budget N per layer and KV head for evicting policies: tokens (1k, 512) or bytes (64MiB); default {DEFAULT_BUDGET}",
}


def simulate_cmd(
    model: Annotated[Optional[str], typer.Argument(help="MODEL (smollm2-135m, GGUF file, HF directory, tiny:SEED) or an ARTIFACT directory (manifest.json)")] = None,
    device: Annotated[Optional[list[str]], typer.Option(help="device profile(s) from edgekv/profiles/devices (name or .json path; repeatable or comma list; default: all)")] = None,
    mem_limit: Annotated[Optional[str], typer.Option(help="memory cap for the child, e.g. 1.5GiB (default: the smallest chosen device's app-usable RAM); a plan above it is refused")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="file holding the prompt")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    policy: Annotated[Optional[list[str]], typer.Option(help=f"eviction policy; repeat or comma-list to compare (full = the whole cache, N = prompt + output); default {DEFAULT_POLICY}")] = None,
    policy_arg: Annotated[Optional[list[str]], typer.Option(help=SIMULATE_HELP["policy_arg"])] = None,
    budget: Annotated[str, typer.Option(help=SIMULATE_HELP["budget"])] = DEFAULT_BUDGET,
    block: Annotated[int, typer.Option(help=HELP["block"])] = DEFAULT_BLOCK,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 16,
    allow_beyond_context: Annotated[bool, typer.Option(help=HELP["beyond"])] = False,
    mechanism: Annotated[str, typer.Option(help="cap mechanism: auto (cgroup2 if delegated, else rlimit-data), cgroup2, rlimit-data, rlimit-as")] = "auto",
    unit: Annotated[Optional[str], typer.Option(help="compute unit for estimates: cpu, gpu, npu (default: each profile's default)")] = None,
    all_units: Annotated[bool, typer.Option(help="estimate on every compute unit of every device")] = False,
    threads: Annotated[Optional[int], typer.Option(help=HELP["threads"] + " (in the child)")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="kill a child still running after this many seconds")] = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", "--report", help="write the JSON report to this file")] = None,
    sweep_json: Annotated[Optional[Path], typer.Option(help="write the sweep (longest prompt per cap, speed estimates) as JSON")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="write the sweep plot (.png/.svg/.pdf)")] = None,
):
    """Run MODEL/ARTIFACT under an enforced memory cap in a child process; report fit, peak
    memory and host time, with roofline estimates of prefill/decode time on phone profiles.
    Exit status: 0 when every run fits the cap; 1 when a run did not fit or failed (the report
    is written); 2 when nothing could run (every plan above the cap, or a bad option)."""
    from ..policies import policy_arguments
    from ..simulate.command import SimRequest, simulate
    from ..simulate.limits import LimitError
    from ..simulate.profiles import ProfileError
    from ..simulate.runner import FITS, REFUSED

    try:
        text = read_prompt(prompt, prompt_file)
        names = [p.strip() for x in (policy or [DEFAULT_POLICY]) for p in x.split(",") if p.strip()]
        args = policy_arguments(policy_arg, names)
        if len(names) > 1 and any(args.values()):
            raise InputError("--policy-arg applies to one policy; run one --policy at a time to pass arguments")
        req = SimRequest(model=model, text=text, devices=device, mem_limit=mem_limit, policies=names,
                         policy_args=args.get(names[0], {}) if len(names) == 1 else {}, budget=budget, block=block,
                         max_new_tokens=max_new_tokens, chat=chat, allow_beyond_context=allow_beyond_context,
                         mechanism=mechanism, unit=unit, all_units=all_units, threads=None, timeout_s=timeout,
                         report=output, sweep_json=sweep_json, plot=plot)
        req.threads = setup_threads(threads).count
        result = simulate(req, Console(width=max(Console().width, 120)), err, say=say)
    except (*USER_ERRORS, ProfileError, LimitError) as exc:
        fail(exc)
    runs = result["runs"]
    if all(r["status"] == REFUSED for r in runs):
        from ..units import human_bytes

        need = ", ".join(f"{r['policy']} N={r['budget']:,} needs {human_bytes(r['plan']['total'])}" for r in runs)
        err.print(f"[bold red]error:[/] the memory plan is above the cap of {human_bytes(result['cap_bytes'])} "
                  f"({result['cap_source']}): {need}; nothing ran and no report was written. Raise --mem-limit, "
                  "or lower --budget or --block")
        raise typer.Exit(2)
    if any(r["status"] != FITS for r in runs):
        err.print("[bold yellow]not every run fits:[/] " + ", ".join(f"{r['policy']}: {r['status']}" for r in runs))
        raise typer.Exit(1)
