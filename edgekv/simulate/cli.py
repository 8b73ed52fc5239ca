"""The typer command behind ``edgekv simulate`` (registered by ``edgekv/cli.py`` in one line)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console


def simulate_cmd(
    model: Annotated[Optional[str], typer.Argument(help="MODEL (smollm2-135m, GGUF file, HF directory, tiny:SEED) or an ARTIFACT directory (manifest.json)")] = None,
    device: Annotated[Optional[list[str]], typer.Option(help="device profile(s) from compile/devices (name or .json path; repeatable or comma list; default: all)")] = None,
    mem_limit: Annotated[Optional[str], typer.Option(help="memory cap for the child, e.g. 1.5GiB (default: the smallest chosen device's app-usable RAM)")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="file holding the prompt")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    policy: Annotated[Optional[list[str]], typer.Option(help="eviction policy; repeat or comma-list to compare (full = the whole cache, N = prompt + output)")] = None,
    policy_arg: Annotated[Optional[list[str]], typer.Option(help="policy parameter key=value (only with a single --policy)")] = None,
    budget: Annotated[str, typer.Option(help="KV budget N per layer and KV head for evicting policies: 512, 2k, or bytes 64MiB")] = "512",
    block: Annotated[int, typer.Option(help="prompt tokens per block B")] = 128,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 16,
    allow_beyond_context: Annotated[bool, typer.Option(help="allow prompt + output past the model's trained context")] = False,
    mechanism: Annotated[str, typer.Option(help="cap mechanism: auto (cgroup2 if delegated, else rlimit-data), cgroup2, rlimit-data, rlimit-as")] = "auto",
    unit: Annotated[Optional[str], typer.Option(help="compute unit for estimates: cpu, gpu, npu (default: each profile's default)")] = None,
    all_units: Annotated[bool, typer.Option(help="estimate on every compute unit of every device")] = False,
    threads: Annotated[Optional[int], typer.Option(help="torch threads in the child (default: all cores)")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="kill a child still running after this many seconds")] = None,
    report: Annotated[Optional[Path], typer.Option(help="write the JSON report here")] = None,
    sweep_json: Annotated[Optional[Path], typer.Option(help="write the sweep (longest prompt per cap, speed estimates) as JSON")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="write the sweep plot (.png/.svg/.pdf)")] = None,
):
    """Run MODEL/ARTIFACT under an enforced memory cap in a child process; report fit, peak
    memory and host time, with roofline estimates of prefill/decode time on phone profiles."""
    from ..cli import parse_policy_args, read_prompt
    from ..errors import USER_ERRORS
    from .command import SimRequest, simulate
    from .limits import LimitError
    from .profiles import ProfileError

    err = Console(stderr=True)
    try:
        text = read_prompt(prompt, prompt_file)
        req = SimRequest(model=model, text=text, devices=device, mem_limit=mem_limit, policies=policy or ["keydiff"],
                         policy_args=parse_policy_args(policy_arg), budget=budget, block=block,
                         max_new_tokens=max_new_tokens, chat=chat, allow_beyond_context=allow_beyond_context,
                         mechanism=mechanism, unit=unit, all_units=all_units, threads=threads, timeout_s=timeout,
                         report=report, sweep_json=sweep_json, plot=plot)
        if policy_arg and len([p for x in (policy or []) for p in x.split(",") if p.strip()]) > 1:
            from ..errors import InputError

            raise InputError("--policy-arg applies to one policy; run one --policy at a time to pass arguments")
        simulate(req, Console(width=max(Console().width, 120)), err)
    except (*USER_ERRORS, ProfileError, LimitError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
