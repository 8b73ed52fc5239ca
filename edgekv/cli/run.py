"""`edgekv run` and `edgekv ask`: parse and check every option, hand the run to ``edgekv/job.py``
(``plan_run`` then ``run_plan``: the eager engine or a compiled artifact), stream its text and print
the memory table."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..errors import USER_ERRORS, InputError
from ..output_files import check_writable
from ..units import human_bytes
from .common import (HELP, BeyondContext, MemLimit, NoVerify, ReportPath, Temperature, Threads, TopP, cancelled,
                     check_block, check_sampling, compiler_errors, err, fail, out, parse_kv_dtype, parse_mem_limit,
                     prefill_progress, read_prompt, say, setup_threads, warn)


def kv_line(report: dict) -> str:
    """What the budget saved: the KV cache held next to the full cache of the same sequence."""
    cmp = report["memory"]["vs_full_cache"]
    held, full = cmp["kv_cache"], cmp["full_cache"]
    int8 = report.get("kv_dtype") == "int8"
    line = (f"KV cache {human_bytes(held)} ({'int8, ' if int8 else ''}N={report['budget_tokens']:,}, "
            f"B={report['block']}) vs {human_bytes(full)} for the full {'fp32 ' if int8 else ''}cache of "
            f"{cmp['sequence_tokens']:,} tokens")
    if cmp["saved_fraction"] > 0:
        return line + f": {100 * cmp['saved_fraction']:.0f} % saved"
    if held > full and (report.get("document") or {}).get("saved_cache"):
        return line + ": a saved cache keeps its full N + B entries, room for later questions"
    if report["engine"] == "eager":
        return line + ": the budget holds the whole sequence, nothing was evicted"
    return line + ": the artifact's fixed cache is larger than this sequence needs"


def summary_table(report: dict) -> Table:
    mem = report["memory"]
    table = Table(title=f"edgekv {report['engine']} · {report['model']} · {report['policy']} · N={report['budget_tokens']} B={report['block']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda v: f"{v:,.1f}" if v is not None else "—"  # noqa: E731
    doc = report.get("document")
    table.add_row("document tokens" if doc else "prompt tokens", f"{report['prompt_tokens']:,}")
    table.add_row("generated tokens", f"{report['generated_tokens']:,}")
    table.add_row("prefill tok/s", fmt(report["prefill_tok_s"]))
    if doc:
        if doc["document_prefill_seconds"]:
            table.add_row("document read (s)", f"{doc['document_prefill_seconds']:,.2f}")
        elif doc["document_prefill_seconds_when_saved"]:
            table.add_row("document read when saved (s)", f"{doc['document_prefill_seconds_when_saved']:,.2f}")
        for i, a in enumerate(doc["answers"], 1):
            where = "from the saved cache" if a["load_seconds"] else "after reading"
            table.add_row(f"question {i}: first token {where} (s)", f"{a['time_to_first_token_seconds']:,.3f}")
    table.add_row("decode tok/s", fmt(report["decode_tok_s"]))
    threads = report.get("threads") or {}
    if threads.get("count"):
        table.add_row("threads", f"{threads['count']} ({threads.get('source', '')})")
    table.add_row(f"KV cache (plan{', int8' if report.get('kv_dtype') == 'int8' else ''})",
                  human_bytes(mem["plan"]["kv_cache"]))
    cmp = mem.get("vs_full_cache")
    if cmp:
        table.add_row("KV cache of the full cache (same tokens)", human_bytes(cmp["full_cache"]))
    table.add_row("peak memory plan (weights+KV+activations)", human_bytes(mem["plan"]["total"]))
    table.add_row("peak memory measured (process RSS)", human_bytes(mem["peak_rss"]))
    if mem.get("device_peak"):
        table.add_row(f"device memory held ({report.get('device', 'device')})", human_bytes(mem["device_peak"]))
    return table


def run_cmd(
    model: Annotated[Optional[str], typer.Argument(help="model name (smollm2-135m), GGUF file, HF directory, or a compiled artifact directory")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="prompt text")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="file holding the prompt")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="wrap the prompt in the model's chat template (with --load-cache: the saved document's form)")] = None,
    question: Annotated[Optional[list[str]], typer.Option(help=HELP["question"])] = None,
    save_cache: Annotated[Optional[Path], typer.Option(help=HELP["save_cache"])] = None,
    load_cache: Annotated[Optional[Path], typer.Option(help=HELP["load_cache"])] = None,
    budget: Annotated[Optional[str], typer.Option(help=HELP["budget"] + "; an artifact's own when running one")] = None,
    block: Annotated[Optional[int], typer.Option(help=HELP["block"])] = None,
    policy: Annotated[Optional[str], typer.Option(help=HELP["policy"])] = None,
    policy_arg: Annotated[Optional[list[str]], typer.Option(help=HELP["policy_arg"])] = None,
    compress: Annotated[Optional[str], typer.Option(help=COMPRESS_HELP)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    output: ReportPath = None,
    mem_limit: MemLimit = None,
    allow_beyond_context: BeyondContext = False,
    threads: Threads = None,
    runtime: Annotated[str, typer.Option(help="for an ARTIFACT: native (the C runtime, no TVM), tvm (TVM's VM), "
                                              "or auto (native when built)")] = "auto",
    kv_dtype: Annotated[Optional[str], typer.Option(help=HELP["kv_dtype"] + " (with --load-cache: the saved "
                                                                           "cache's)")] = None,
    no_verify: NoVerify = False,
):
    """Generate from a long prompt under a KV budget, block by block; print text and a memory table.
    With --question: the prompt is a document, read once, and each question is answered from its
    state (--save-cache keeps that state in a file; --load-cache or `edgekv ask` start from one)."""
    try:
        run_command(model, prompt=prompt, prompt_file=prompt_file, chat=chat, questions=question or [],
                    save_cache=save_cache, load_cache=load_cache, budget=budget, block=block,
                    policy=compressed(policy, compress), policy_arg=policy_arg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    seed=seed, output=output, mem_limit=mem_limit, allow_beyond_context=allow_beyond_context,
                    threads=threads, runtime=runtime, kv_dtype=kv_dtype, no_verify=no_verify)
    except USER_ERRORS + compiler_errors() as exc:
        fail(exc)
    except KeyboardInterrupt as exc:  # the native runtime's Cancelled too: it stopped at its next kernel
        cancelled(exc)


def ask_cmd(
    snapshot: Annotated[Path, typer.Argument(help="a saved document cache (`edgekv run ... --save-cache FILE`)")],
    question: Annotated[Optional[list[str]], typer.Option(help="a question about the saved document (repeatable)")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="the model or artifact the cache was made with (default: the one it names)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate per answer")] = 64,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Annotated[int, typer.Option(help="sampling seed (each question starts from it)")] = 0,
    output: ReportPath = None,
    mem_limit: MemLimit = None,
    allow_beyond_context: BeyondContext = False,
    threads: Threads = None,
    runtime: Annotated[str, typer.Option(help="for a compiled artifact's cache: native, tvm or auto")] = "auto",
    no_verify: NoVerify = False,
):
    """Answer questions about a document read earlier, from its saved cache: no re-reading."""
    try:
        run_command(model, prompt=None, prompt_file=None, chat=None, questions=question or [], save_cache=None,
                    load_cache=snapshot, budget=None, block=None, policy=None, policy_arg=None,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, output=output,
                    mem_limit=mem_limit, allow_beyond_context=allow_beyond_context, threads=threads,
                    runtime=runtime, no_verify=no_verify)
    except USER_ERRORS + compiler_errors() as exc:
        fail(exc)
    except KeyboardInterrupt as exc:  # the native runtime's Cancelled too: it stopped at its next kernel
        cancelled(exc)


COMPRESS_HELP = ("how the document is compressed as it is read: reconstruct (KVzip's reconstruction score, "
                 "block-wise: query-agnostic, for a cache saved once and asked anything; about 2x the prefill "
                 "time) or none (the --policy alone)")


def compressed(policy: Optional[str], compress: Optional[str]) -> Optional[str]:
    """--compress MODE: the policy that reads the document (``policies.compress_policy``)."""
    from ..policy_labels import compress_policy

    return compress_policy(policy, compress)


def check_document_options(prompt, prompt_file, questions, save_cache, load_cache) -> None:
    """--question / --save-cache / --load-cache: what goes with what, before any work."""
    from ..document import check_snapshot_destination

    for q in questions:
        if not q.strip():
            raise InputError("--question is empty; give the question's text")
    if load_cache is not None:
        if prompt is not None or prompt_file is not None:
            raise InputError("--load-cache holds the document already: drop --prompt/--prompt-file")
        if save_cache is not None:
            raise InputError("give --save-cache or --load-cache, not both")
        if not questions:
            raise InputError(f"{load_cache} is a saved document: give at least one --question to answer from it")
    check_snapshot_destination(save_cache)


def run_command(model, *, prompt, prompt_file, chat, questions, save_cache, load_cache, budget, block, policy,
                policy_arg, max_new_tokens, temperature, top_p, seed, output, mem_limit, allow_beyond_context,
                threads, runtime, kv_dtype=None, no_verify=False) -> None:
    """`edgekv run` and `edgekv ask`: check every option, then the run (``edgekv/job.py``), printed.
    The checks come first and load nothing heavy: ``job`` (torch) is imported after them."""
    kv_dtype = parse_kv_dtype(kv_dtype)
    check_writable(output, "-o/--output")
    check_document_options(prompt, prompt_file, questions, save_cache, load_cache)
    text = read_prompt(prompt, prompt_file) if load_cache is None else None
    check_sampling(temperature, top_p, max_new_tokens)
    check_block(block)
    from .. import job

    settings = job.RunSettings(model=model, text=text, chat=chat, questions=list(questions), save_cache=save_cache,
                               load_cache=load_cache, budget=budget, block=block, policy=policy, policy_arg=policy_arg,
                               kv_dtype=kv_dtype, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=seed, mem_limit=parse_mem_limit(mem_limit),
                               allow_beyond_context=allow_beyond_context, runtime=runtime, output=output,
                               verify="off" if no_verify else "default")
    console = CliRunConsole()
    plan = job.plan_run(settings, console)
    job.run_plan(plan, console, threads=setup_threads(threads))
    if output is not None:
        err.print(f"report written to {output}")


class CliRunConsole:
    """A run on the terminal: phases and warnings on stderr, the text streamed to stdout, a progress
    bar over long prefills (on a terminal only), then the KV line and the summary table."""

    log = err

    def say(self, message: str) -> None:
        say(message)

    def warn(self, message: str) -> None:
        warn(message)

    def text(self, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    @contextmanager
    def prefill_progress(self, tokens: int, block: int):
        bar, advance = prefill_progress(tokens)
        shown = tokens > 4 * block and err.is_terminal
        if shown:
            bar.start()
        try:
            yield advance if shown else None
        finally:
            if shown:
                bar.stop()

    def report(self, report: dict) -> None:
        err.print(kv_line(report), highlight=False)
        out.print(summary_table(report))
