"""The `edgekv` command (typer + rich)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .budget import human_bytes
from .errors import USER_ERRORS, InputError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="edgekv: long prompts under a hard KV-cache budget")
err = Console(stderr=True)
out = Console()


def _fail(exc: Exception) -> None:
    err.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(2)


def parse_policy_args(pairs: list[str] | None) -> dict[str, str]:
    args = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise InputError(f"--policy-arg {pair!r} is not key=value; e.g. --policy-arg sinks=4")
        key, value = pair.split("=", 1)
        args[key.strip()] = value.strip()
    return args


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise InputError("give either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read --prompt-file {prompt_file}: {exc}") from None
    if prompt is None:
        raise InputError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompt


def prefill_progress(total: int):
    """A rich progress bar over prompt tokens (shown for long prompts only)."""
    progress = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                        TimeRemainingColumn(), console=err, transient=True)
    task = progress.add_task("prefill", total=total)
    return progress, (lambda n: progress.advance(task, n))


def summary_table(report: dict) -> Table:
    mem = report["memory"]
    table = Table(title=f"edgekv {report['engine']} · {report['model']} · {report['policy']} · N={report['budget_tokens']} B={report['block']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda v: f"{v:,.1f}" if v is not None else "—"  # noqa: E731
    table.add_row("prompt tokens", f"{report['prompt_tokens']:,}")
    table.add_row("generated tokens", f"{report['generated_tokens']:,}")
    table.add_row("prefill tok/s", fmt(report["prefill_tok_s"]))
    table.add_row("decode tok/s", fmt(report["decode_tok_s"]))
    table.add_row("KV cache (plan)", human_bytes(mem["plan"]["kv_cache"]))
    table.add_row("peak memory plan (weights+KV+activations)", human_bytes(mem["plan"]["total"]))
    table.add_row("peak memory measured (process RSS)", human_bytes(mem["peak_rss"]))
    return table


@app.command()
def run(
    model: Annotated[Optional[str], typer.Argument(help="model name (smollm2-135m), GGUF file, HF directory, or a compiled artifact directory")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="file holding the prompt")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    budget: Annotated[str, typer.Option(help="KV budget N per layer and KV head: 2k, 512, 0.5k, or bytes: 512MiB")] = "2k",
    block: Annotated[int, typer.Option(help="prompt tokens per block B")] = 128,
    policy: Annotated[str, typer.Option(help="eviction policy")] = "keydiff",
    policy_arg: Annotated[Optional[list[str]], typer.Option(help="policy parameter key=value (repeatable)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass")] = 1.0,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    report: Annotated[Optional[Path], typer.Option(help="write a JSON report here")] = None,
    allow_beyond_context: Annotated[bool, typer.Option(help="allow prompt + output past the model's trained context")] = False,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: all cores)")] = None,
):
    """Generate from a long prompt under a KV budget, block by block; print text and a memory table."""
    from .engine import Sampler
    from .job import check_context, check_writable, encode_prompt, run_eager, write_json_atomic
    from .models import load_model
    from .policies import make_policy

    try:
        check_writable(report)
        text = read_prompt(prompt, prompt_file)
        if max_new_tokens < 0:
            raise InputError("--max-new-tokens must be ≥ 0")
        make_policy(policy, parse_policy_args(policy_arg))  # unknown policy / bad args before loading anything
        sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
        if threads:
            import torch

            torch.set_num_threads(threads)
        loaded = load_model(model, err)
        ids = encode_prompt(loaded, text, chat)
        check_context(loaded, int(ids.numel()), max_new_tokens, allow_beyond_context)
        generated: list[int] = []
        printed = [""]

        def stream(token: int) -> None:
            generated.append(token)
            so_far = loaded.tokenizer.decode(generated, skip_special_tokens=True)
            if so_far.startswith(printed[0]):
                sys.stdout.write(so_far[len(printed[0]):])
                sys.stdout.flush()
                printed[0] = so_far

        bar, advance = prefill_progress(int(ids.numel()))
        show_bar = ids.numel() > 4 * block
        if show_bar:
            bar.start()
        try:
            result = run_eager(loaded, ids, policy_name=policy, policy_args=parse_policy_args(policy_arg),
                               budget=budget, block=block, max_new_tokens=max_new_tokens, sampler=sampler,
                               on_token=stream, progress=advance if show_bar else None)
        finally:
            if show_bar:
                bar.stop()
        sys.stdout.write("\n")
        out.print(summary_table(result.report))
        if report is not None:
            write_json_atomic(report, result.report)
            err.print(f"report written to {report}")
    except USER_ERRORS as exc:
        _fail(exc)


@app.command("policies")
def list_policies():
    """List the eviction policies and their parameters."""
    from .policies import REGISTRY

    table = Table(title="eviction policies")
    table.add_column("name")
    table.add_column("parameters (defaults)")
    for name in sorted(REGISTRY):
        params = REGISTRY[name]().params()
        table.add_row(name, ", ".join(f"{k}={v}" for k, v in params.items()) or "—")
    out.print(table)


def main():  # pragma: no cover
    app()
