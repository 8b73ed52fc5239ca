"""The `edgekv` command (typer + rich).

One vocabulary across the subcommands (README, "Using it"): MODEL (or ARTIFACT) is always the
positional argument; ``--budget``/``--block``/``--policy``/``--policy-arg`` (``key=value`` or
``policy:key=value``) mean the same everywhere and share their defaults; ``-o/--output`` is where
a command writes (``--report`` and ``--out`` remain as aliases); ``--threads`` sets the threads of
every runtime (default: the free cores, ``edgekv/threads.py``); ``--mem-limit`` refuses a memory
plan above it; ``--allow-beyond-context`` opts in to positions past the trained context."""

from __future__ import annotations

from .threads import prepare_process

prepare_process()  # before torch / TVM load: thread pools that sleep instead of spinning

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Annotated, Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from .budget import DEFAULT_BLOCK, DEFAULT_BUDGET, human_bytes  # noqa: E402
from .errors import USER_ERRORS, InputError  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="edgekv: long prompts under a hard KV-cache budget")
err = Console(stderr=True)
out = Console()
DEFAULT_POLICY = "keydiff"  # = edgekv.policies.DEFAULT_POLICY (not imported here: it loads torch)

# the help texts of the options every command shares
HELP = {
    "model": "model name (smollm2-135m), GGUF file or HF directory",
    "budget": f"KV budget N per layer and KV head: tokens (1k, 512, 0.5k) or bytes of KV cache (64MiB); default {DEFAULT_BUDGET}",
    "block": f"prompt tokens per block B (default {DEFAULT_BLOCK})",
    "policy": f"eviction policy (`edgekv policies`; default {DEFAULT_POLICY})",
    "policy_arg": "policy parameter key=value, or policy:key=value for one of several policies (repeatable)",
    "threads": "threads for every runtime (torch, TVM); default: the free cores",
    "mem_limit": "refuse when the memory plan (weights + KV cache + activations) is above this, e.g. 1.5GiB",
    "beyond": "allow prompt + output past the model's trained context",
    "question": "a question about the prompt (the document): each is answered from the document's state (repeatable)",
    "save_cache": "save the document's compressed cache to this file, to answer later questions (`edgekv ask`)",
    "load_cache": "answer --question from a saved document cache instead of reading a document",
    "kv_dtype": "how the cache stores K and V: fp32, or int8 (8-bit codes with a float16 scale per 32 "
                "channels: a byte budget buys more entries, by the ratio of the two formats' row bytes); "
                "default fp32; an ARTIFACT stores what it was compiled with (`edgekv compile --kv-dtype`)",
}


# the options `run` and `ask` share, declared once
Temperature = Annotated[float, typer.Option(help="0 = greedy")]
TopP = Annotated[float, typer.Option(help="nucleus sampling mass, in (0, 1]")]
ReportPath = Annotated[Optional[Path], typer.Option("-o", "--output", "--report", help="write the JSON report to this file")]
MemLimit = Annotated[Optional[str], typer.Option(help=HELP["mem_limit"])]
BeyondContext = Annotated[bool, typer.Option(help=HELP["beyond"])]
Threads = Annotated[Optional[int], typer.Option(help=HELP["threads"])]


def _fail(exc: Exception) -> None:
    err.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(2)


def say(msg: str) -> None:
    """One line per phase on stderr, so that long steps show even with output redirected."""
    err.print(f"[dim]edgekv:[/] {msg}", highlight=False)


def warn(msg: str) -> None:
    err.print(f"[yellow]warning:[/] {msg}", highlight=False)


def parse_policy_args(pairs: list[str] | None, policy: str | None = None) -> dict[str, str]:
    """``--policy-arg`` values for one policy (``key=value`` or ``policy:key=value``)."""
    from .policies import policy_arguments

    name = policy or DEFAULT_POLICY
    return policy_arguments(pairs, [name]).get(name, {})


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


def merge_model(positional: str | None, option: str | None, command: str) -> str | None:
    """MODEL is positional in every command; ``--model`` stays as an alias for older scripts."""
    if positional is not None and option is not None and positional != option:
        raise InputError(f"edgekv {command}: MODEL given twice ({positional!r} and --model {option!r}); give it once")
    return positional if positional is not None else option


def check_sampling(temperature: float, top_p: float, max_new_tokens: int) -> None:
    if temperature < 0:
        raise InputError(f"--temperature {temperature:g}: give 0 (greedy) or a positive temperature such as 0.7")
    if not 0 < top_p <= 1:
        raise InputError(f"--top-p {top_p:g}: give a probability mass in (0, 1], e.g. 0.9 (1 = no nucleus cut)")
    if max_new_tokens < 0:
        raise InputError(f"--max-new-tokens {max_new_tokens}: give 0 or more tokens")


def check_block(block: int | None) -> None:
    if block is not None and block <= 0:
        raise InputError(f"--block {block}: give a positive number of prompt tokens per block, e.g. 128")


def parse_mem_limit(mem_limit: str | None) -> int | None:
    from .budget import parse_size

    return parse_size(mem_limit) if mem_limit else None


def setup_threads(threads: int | None):
    """Choose and apply the thread count (torch and TVM), say it in one line; returns the choice."""
    from .threads import apply_threads, choose_threads

    choice = choose_threads(threads)
    apply_threads(choice.count)
    say(f"threads: {choice.count} ({choice.source}" + ("" if choice.source == "--threads" else f": {choice.reason}")
        + ")")
    return choice


def prefill_progress(total: int):
    """A rich progress bar over prompt tokens (shown for long prompts only)."""
    progress = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                        TimeRemainingColumn(), console=err, transient=True)
    task = progress.add_task("prefill", total=total)
    return progress, (lambda n: progress.advance(task, n))


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


@app.command()
def run(
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
):
    """Generate from a long prompt under a KV budget, block by block; print text and a memory table.
    With --question: the prompt is a document, read once, and each question is answered from its
    state (--save-cache keeps that state in a file; --load-cache or `edgekv ask` start from one)."""
    try:
        run_command(model, prompt=prompt, prompt_file=prompt_file, chat=chat, questions=question or [],
                    save_cache=save_cache, load_cache=load_cache, budget=budget, block=block, policy=policy,
                    policy_arg=policy_arg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    seed=seed, output=output, mem_limit=mem_limit, allow_beyond_context=allow_beyond_context,
                    threads=threads, runtime=runtime, kv_dtype=kv_dtype)
    except USER_ERRORS + compiler_errors() as exc:
        _fail(exc)


@app.command()
def ask(
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
):
    """Answer questions about a document read earlier, from its saved cache: no re-reading."""
    try:
        run_command(model, prompt=None, prompt_file=None, chat=None, questions=question or [], save_cache=None,
                    load_cache=snapshot, budget=None, block=None, policy=None, policy_arg=None,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, output=output,
                    mem_limit=mem_limit, allow_beyond_context=allow_beyond_context, threads=threads,
                    runtime=runtime)
    except USER_ERRORS + compiler_errors() as exc:
        _fail(exc)


def check_document_options(prompt, prompt_file, questions, save_cache, load_cache) -> None:
    """--question / --save-cache / --load-cache: what goes with what, before any work."""
    from .document import check_snapshot_destination

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


def is_artifact(path) -> bool:
    return path is not None and (Path(path) / "manifest.json").is_file()


def parse_kv_dtype(kv_dtype: str | None, option: str = "--kv-dtype") -> str | None:
    """``--kv-dtype`` checked against ``memory.KV_DTYPES`` (None: not given)."""
    if kv_dtype is None:
        return None
    from .memory import KVDtypeError, check_kv_dtype

    try:
        return check_kv_dtype(kv_dtype.strip().lower(), option)
    except KVDtypeError as exc:  # its message names the choices from memory.KV_DTYPES
        raise InputError(str(exc)) from None


def run_command(model, *, prompt, prompt_file, chat, questions, save_cache, load_cache, budget, block, policy,
                policy_arg, max_new_tokens, temperature, top_p, seed, output, mem_limit, allow_beyond_context,
                threads, runtime, kv_dtype=None) -> None:
    """`edgekv run` and `edgekv ask`: check everything, run the eager engine or the artifact, print."""
    kv_dtype = parse_kv_dtype(kv_dtype)
    check_writable_early(output)
    check_document_options(prompt, prompt_file, questions, save_cache, load_cache)
    document = bool(questions) or save_cache is not None or load_cache is not None
    text = read_prompt(prompt, prompt_file) if load_cache is None else None
    check_sampling(temperature, top_p, max_new_tokens)
    check_block(block)
    limit = parse_mem_limit(mem_limit)
    saved = None
    if load_cache is not None:  # the saved document decides the model, its settings and the chat form
        from .document import snapshot_settings

        saved = snapshot_settings(load_cache)
        if chat is not None and chat != saved["chat"]:
            raise InputError(f"{load_cache} holds a document read {'with' if saved['chat'] else 'without'} the chat "
                             f"template: ask {'with --chat' if saved['chat'] else 'without --chat'}")
        chat = saved["chat"]
        model = model or saved["made_from"] or None
        if saved["engine"] == "compiled" and not is_artifact(model):
            raise InputError(f"{load_cache} was made with a compiled artifact"
                             + (f" ({saved['made_from']}), which is not there any more" if saved["made_from"] else "")
                             + ": name the artifact it was made with, as MODEL (`edgekv run ARTIFACT --load-cache "
                               "F`) or `edgekv ask F --model ARTIFACT`")
        if saved["engine"] == "eager" and is_artifact(model):
            raise InputError(f"{load_cache} was made by the eager engine (`edgekv run MODEL`), not a compiled artifact: "
                             f"answer from it with the model it was made with ({saved['made_from'] or 'smollm2-135m'})")
        if saved["engine"] == "eager":  # the cache's K/V format is the file's, as N and B are
            from .engine.block_engine import snapshot_kv_dtype

            stored = snapshot_kv_dtype(load_cache)
            if kv_dtype is not None and kv_dtype != stored:
                raise InputError(f"{load_cache} holds its KV cache in {stored}: drop --kv-dtype {kv_dtype} (the saved "
                                 f"cache's own format is used), or make the document's cache again with --kv-dtype "
                                 f"{kv_dtype}")
            kv_dtype = stored
    chat = bool(chat)
    doc = {"questions": questions, "save_cache": save_cache, "load_cache": load_cache, "saved": saved} \
        if document else None
    if is_artifact(model):
        from .job import check_artifact_settings
        from .policies import REGISTRY
        from .runtime import read_manifest

        manifest = read_manifest(model)
        stored = manifest.get("kv_dtype", "fp32")  # an artifact's K/V format is compiled in, as N and B are
        if kv_dtype is not None and kv_dtype != stored:
            raise InputError(f"--kv-dtype {kv_dtype}: the artifact {model} stores its KV cache in {stored}; drop "
                             f"--kv-dtype, or compile the model again with --kv-dtype {kv_dtype}")
        check_artifact_settings(model, manifest, policy=policy,
                                policy_args=_artifact_policy_args(policy_arg, policy, model), budget=budget,
                                block=block)
        name = manifest["policy"]["name"]
        if doc is not None and questions and load_cache is None and getattr(REGISTRY.get(name), "uses_question", False) \
                and not manifest.get("question_rows"):
            warn(f"{model} was compiled without --question-rows, so {name} scores its blocks with their own rows, "
                 "not the question's; compile it with --question-rows N (N ≥ the question's tokens) to read the "
                 "document knowing the question")
        if doc is not None:
            doc["question_scoring"] = bool(manifest.get("question_rows")) and bool(questions) and load_cache is None
        choice = setup_threads(threads)
        result = run_compiled_job(model, text, chat=chat, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed, mem_limit=limit,
                                  allow_beyond_context=allow_beyond_context, runtime=runtime,
                                  threads=choice.count, document=doc)
    else:
        from .policies import make_policy

        if saved is not None:  # options not given come from the saved document (a differing one is refused)
            budget = budget or str(saved["budget"])
            block = block or saved["block"]
        policy = policy or (saved["policy"] if saved is not None else DEFAULT_POLICY)
        args = parse_policy_args(policy_arg, policy)
        if saved is not None and not policy_arg and policy == saved["policy"]:
            args = dict(saved["policy_params"])
        chosen = make_policy(policy, args)  # unknown policy / bad arguments before loading anything
        if doc is not None:
            doc["question_scoring"] = chosen.uses_question and bool(questions) and load_cache is None
        choice = setup_threads(threads)
        result = run_eager_job(model, text, chat=chat, budget=budget or DEFAULT_BUDGET,
                               block=block or DEFAULT_BLOCK, policy=policy, policy_args=args,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                               mem_limit=limit, allow_beyond_context=allow_beyond_context, document=doc,
                               kv_dtype=kv_dtype or "fp32")
    from .threads import threads_in_use

    result.report["threads"] = {**choice.to_dict(), **threads_in_use()}
    err.print(kv_line(result.report), highlight=False)
    out.print(summary_table(result.report))
    if output is not None:
        from .job import write_json_atomic

        write_json_atomic(output, result.report)
        err.print(f"report written to {output}")


def check_writable_early(path) -> None:
    from .job import check_writable

    check_writable(path, "-o/--output")


def _artifact_policy_args(pairs, policy, artifact) -> dict[str, str]:
    from .runtime import read_manifest

    name = policy or read_manifest(artifact)["policy"]["name"]
    from .policies import policy_arguments

    return policy_arguments(pairs, [name]).get(name, {})


def _generate(loaded, text: str, chat: bool, max_new_tokens: int, allow_beyond_context: bool, block: int, run):
    """Encode, check the context, then ``run(ids, on_token, progress, on_phase)`` with streamed text,
    a progress bar on a terminal and one line per phase."""
    from .job import TextStream, check_context, encode_prompt

    ids = encode_prompt(loaded, text, chat)
    check_context(loaded, int(ids.numel()), max_new_tokens, allow_beyond_context)
    stream = TextStream(loaded.tokenizer) if loaded.tokenizer is not None else None

    def on_token(token: int) -> None:
        if stream is not None:
            piece = stream.push(token)
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()

    def on_phase(name: str) -> None:
        if name == "prefill":
            n = int(ids.numel())
            say(f"prefill: {n:,} prompt tokens in {-(-n // block)} block(s) of {block}")
        else:
            say(f"decode: up to {max_new_tokens} tokens")

    bar, advance = prefill_progress(int(ids.numel()))
    show_bar = ids.numel() > 4 * block and err.is_terminal
    if show_bar:
        bar.start()
    try:
        result = run(ids, on_token, advance if show_bar else None, on_phase)
    finally:
        if show_bar:
            bar.stop()
    if stream is not None:
        sys.stdout.write(stream.flush())
    sys.stdout.write("\n")
    sys.stdout.flush()
    return result


def _generate_document(loaded, text: str | None, doc: dict, chat: bool, max_new_tokens: int,
                       allow_beyond_context: bool, block: int, run):
    """The document counterpart of ``_generate``: encode the document and question parts, check the
    context, then ``run(document_ids, questions, on_token, on_question, progress)`` with each answer
    streamed after its question."""
    from .job import TextStream, check_context
    from .models.chat import encode_document, encode_question

    tok = loaded.tokenizer
    if tok is None:
        raise InputError(f"model {loaded.model_id} has no tokenizer; --question needs one (a GGUF or an HF directory "
                         "with tokenizer files)")
    if text is not None and not text.strip():
        raise InputError("the document is empty; pass --prompt TEXT or --prompt-file FILE with some text")
    try:
        doc_ids = encode_document(tok, text, chat) if text is not None else None
        questions = [(q, encode_question(tok, q, chat)) for q in doc["questions"]]
    except ValueError as exc:  # --chat on a model without a usable chat template
        raise InputError(str(exc)) from None
    start = len(doc_ids) if doc_ids is not None else int(doc["saved"]["position"])
    longest = max((len(ids) for _, ids in questions), default=0)
    check_context(loaded, start + longest, max_new_tokens, allow_beyond_context)
    streams = [TextStream(tok) for _ in questions]

    def end_answer(i: int) -> None:
        sys.stdout.write(streams[i].flush() + "\n")
        sys.stdout.flush()

    def on_question(i: int, question: str) -> None:
        if i > 0:
            end_answer(i - 1)
        if len(questions) > 1:
            say(f"question {i + 1} of {len(questions)}: {question}")

    def on_token(i: int, token: int) -> None:
        piece = streams[i].push(token)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    if doc_ids is not None:
        say(f"reading the document: {len(doc_ids):,} tokens in {-(-len(doc_ids) // block)} block(s) of {block}"
            + (f", scored with the question's queries (once per question)" if doc.get("question_scoring") else ""))
    else:
        say(f"answering from {doc['load_cache']}: a document of {doc['saved']['tokens']:,} tokens, read before")
    n = len(doc_ids) if doc_ids is not None else 0
    bar, advance = prefill_progress(n)
    show_bar = n > 4 * block and err.is_terminal
    if show_bar:
        bar.start()
    try:
        result = run(None if doc_ids is None else torch_ids(doc_ids), questions, on_token, on_question,
                     advance if show_bar else None)
    finally:
        if show_bar:
            bar.stop()
    if questions:
        end_answer(len(questions) - 1)
    if doc["save_cache"] is not None:
        say(f"saved the document's cache to {doc['save_cache']} "
            f"({human_bytes(result.report['document']['snapshot_bytes'])}): `edgekv ask {doc['save_cache']} "
            "--question ...` answers from it")
    return result


def torch_ids(ids: list[int]):
    import torch

    return torch.tensor(ids, dtype=torch.long)


def model_reference(model: str | None) -> str:
    """The model as a later `edgekv ask` can open it again: a known name, or an absolute path."""
    if model is None:
        return "smollm2-135m"
    return str(Path(model).resolve()) if Path(model).exists() else model


def new_sampler_factory(temperature: float, top_p: float, seed: int):
    from .engine import Sampler

    return lambda: Sampler(temperature=temperature, top_p=top_p, seed=seed)


def run_eager_job(model, text, *, chat, budget, block, policy, policy_args, max_new_tokens, temperature, top_p, seed,
                  mem_limit, allow_beyond_context, document=None, kv_dtype="fp32"):
    """`edgekv run MODEL`: the eager engine (``document``: --question / --save-cache / --load-cache;
    ``kv_dtype``: --kv-dtype)."""
    from .engine import Sampler
    from .job import run_eager, run_eager_document
    from .models import load_model

    say(f"loading {model or 'smollm2-135m'}")
    loaded = load_model(model, err)
    if document is not None:
        return _generate_document(
            loaded, text, document, chat, max_new_tokens, allow_beyond_context, block,
            lambda doc_ids, questions, on_token, on_question, progress: run_eager_document(
                loaded, doc_ids, questions, policy_name=policy, policy_args=policy_args, budget=budget, block=block,
                max_new_tokens=max_new_tokens, new_sampler=new_sampler_factory(temperature, top_p, seed), chat=chat,
                save_cache=document["save_cache"], load_cache=document["load_cache"], made_from=model_reference(model),
                on_token=on_token, on_question=on_question, progress=progress, mem_limit=mem_limit,
                on_warning=warn, kv_dtype=kv_dtype))
    sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
    return _generate(loaded, text, chat, max_new_tokens, allow_beyond_context, block,
                     lambda ids, on_token, progress, on_phase: run_eager(
                         loaded, ids, policy_name=policy, policy_args=policy_args, budget=budget, block=block,
                         max_new_tokens=max_new_tokens, sampler=sampler, on_token=on_token, progress=progress,
                         mem_limit=mem_limit, on_phase=on_phase, kv_dtype=kv_dtype))


def run_compiled_job(artifact, text, *, chat, max_new_tokens, temperature, top_p, seed, mem_limit,
                     allow_beyond_context, runtime="auto", threads=None, document=None):
    """`edgekv run ARTIFACT`: the one place that runs a compiled artifact (``open_artifact`` picks the runtime)."""
    from .engine import Sampler
    from .job import open_artifact, run_compiled, run_compiled_document

    say(f"loading the artifact {artifact}")
    rt, loaded = open_artifact(artifact, mem_limit=mem_limit, runtime=runtime, threads=threads)
    if allow_beyond_context and hasattr(rt, "allow_beyond_context"):
        rt.allow_beyond_context()
    if document is not None:
        return _generate_document(
            loaded, text, document, chat, max_new_tokens, allow_beyond_context, rt.block,
            lambda doc_ids, questions, on_token, on_question, progress: run_compiled_document(
                rt, loaded, doc_ids, questions, max_new_tokens=max_new_tokens,
                new_sampler=new_sampler_factory(temperature, top_p, seed), chat=chat,
                save_cache=document["save_cache"], load_cache=document["load_cache"], on_token=on_token,
                on_question=on_question, progress=progress, on_warning=warn))
    sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
    return _generate(loaded, text, chat, max_new_tokens, allow_beyond_context, rt.block,
                     lambda ids, on_token, progress, on_phase: run_compiled(
                         rt, loaded, ids, max_new_tokens=max_new_tokens, sampler=sampler, on_token=on_token,
                         progress=progress, on_phase=on_phase))


def compiler_errors() -> tuple[type[Exception], ...]:
    """Errors of the compiled path that are the user's to fix (imported lazily: TVM is optional)."""
    errors: list[type[Exception]] = []
    try:
        from .runtime.host import ArtifactError

        errors.append(ArtifactError)
    except ImportError:
        pass
    try:
        from .compiler.errors import CompileError
        from .compiler.passes.attention_sites import AttentionMatchError
        from .compiler.kernels import UnsupportedPolicyError

        errors += [AttentionMatchError, CompileError, UnsupportedPolicyError]
    except ImportError:
        pass
    return tuple(errors)


@app.command("compile")
def compile_cmd(
    model: Annotated[Optional[str], typer.Argument(help="model name (smollm2-135m), GGUF file, HF directory or an exported decoder .onnx file")] = None,
    budget: Annotated[str, typer.Option(help=HELP["budget"])] = DEFAULT_BUDGET,
    block: Annotated[int, typer.Option(help=HELP["block"])] = DEFAULT_BLOCK,
    policy: Annotated[str, typer.Option(help="eviction policy compiled into the model (`edgekv policies`)")] = DEFAULT_POLICY,
    policy_arg: Annotated[Optional[list[str]], typer.Option(help=HELP["policy_arg"])] = None,
    target: Annotated[str, typer.Option(help="target profile in edgekv/profiles/targets/ (host, ...) or a JSON file")] = "host",
    output: Annotated[Path, typer.Option("-o", "--output", help="artifact directory to write (replaced as a whole when it holds an artifact)")] = Path("build/edgekv"),
    mem_limit: Annotated[Optional[str], typer.Option(help=HELP["mem_limit"])] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(help="for an .onnx model: HF folder with its config.json and tokenizer (default: the .onnx file's folder)")] = None,
    weights: Annotated[Optional[str], typer.Option(help="weight format: q4 (GGML Q4_1 linear layers, Q8_0 embedding), q8 (Q8_0), fp32; default: q4 for a 4-bit source such as SmolLM2's GGUF on the host CPU, else fp32")] = None,
    kv_dtype: Annotated[str, typer.Option(help="KV cache format compiled into the artifact: fp32, or int8 (8-bit "
                                               "codes with a float16 scale per 32 channels, so a byte --budget buys "
                                               "more entries; CPU targets)")] = "fp32",
    question_rows: Annotated[int, typer.Option(help="room for a document's question of up to this many tokens to score "
                                                    "every block (`edgekv run ARTIFACT --question`; query-aware "
                                                    "policies snapkv, snapkv++, tova, h2o, dapq; CPU targets; 0: none)")] = 0,
):
    """Compile a model with block-wise prefill and in-graph eviction into an artifact directory (TVM)."""
    import time
    import warnings

    from .budget import parse_budget
    from .policies import make_policy

    try:
        kv_dtype = parse_kv_dtype(kv_dtype)
        check_output_dir(output)
        check_block(block)
        pol = make_policy(policy, parse_policy_args(policy_arg, policy))
        limit = parse_mem_limit(mem_limit)
        say(f"loading {model or 'smollm2-135m'}")
        loaded = load_compile_input(model, tokenizer)
        n = parse_budget(budget, loaded.config, block, kv_dtype=kv_dtype)
        check_static_cache(loaded.config, n, block)
        from .compiler import compile_model

        t0 = time.perf_counter()
        tmp = staging_dir(output)
        try:
            with err.status("compiling…") as status, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")

                def progress(msg: str) -> None:
                    status.update(msg)
                    if not err.is_terminal:
                        say(msg.replace(str(tmp), str(output)))

                result = compile_model(loaded, pol, n, block, target, tmp, mem_limit=limit, progress=progress,
                                       weights=weights, kv_dtype=kv_dtype, question_rows=question_rows)
            replace_dir(tmp, output)
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        for w in caught:  # re-said with the final directory (the build wrote a staging one)
            err.print(f"[yellow]{w.category.__name__}:[/] {str(w.message).replace(str(tmp), str(output))}")
        manifest = result.manifest
        table = Table(title=f"edgekv compile · {loaded.model_id} · {policy} · N={n} B={block}")
        table.add_column("item")
        table.add_column("value", justify="right")
        table.add_row("artifact", str(output))
        table.add_row("target", json.dumps(manifest["target"]["tvm"]))
        table.add_row("attention sites rewritten", str(manifest["num_layers"]))
        table.add_row("weights", weights_summary(manifest))
        plan = manifest["memory_plan"]
        table.add_row("KV cache format", "int8 codes + float16 scales" if kv_dtype == "int8" else "fp32")
        if manifest.get("question_rows"):
            table.add_row("question rows (scoring every block)", str(manifest["question_rows"]))
        table.add_row("plan: weights / KV cache / activations",
                      f"{human_bytes(plan['weights_bytes'])} / {human_bytes(plan['cache_bytes'])} / "
                      f"{human_bytes(plan['activation_bytes'])}")
        table.add_row("compile time", f"{time.perf_counter() - t0:.1f} s")
        toolchain = (manifest.get("device") or {}).get("toolchain") or {}
        if toolchain:
            table.add_row("device toolchain", str(toolchain.get("status", "")))
            if toolchain.get("finish"):
                table.add_row("finish on a machine with it", str(toolchain["finish"]).replace("<artifact dir>", str(output)))
        out.print(table)
    except USER_ERRORS + compiler_errors() as exc:
        _fail(exc)


def weights_summary(manifest: dict) -> str:
    """``q4 (Q4_1 × 210, Q8_0 × 1, fp32 × 61; 98.9 MiB)`` from an artifact's manifest."""
    w = manifest.get("weights") or {"format": "fp32"}
    parts = ", ".join(f"{k} × {v}" for k, v in (w.get("tensors") or {}).items())
    size = f"; {human_bytes(w['bytes'])}" if "bytes" in w else ""
    return f"{w['format']} ({parts}{size})" if parts else w["format"]


def check_static_cache(cfg, budget: int, block: int) -> None:
    """A compiled cache is one static tensor [H, N (+ B), d] per layer, indexed with 32-bit
    integers by the generated kernels: refuse a budget past that before exporting anything."""
    elements = cfg.num_kv_heads * (budget + block) * cfg.head_dim
    if elements >= 2**31:
        most = (2**31 - 1) // (cfg.num_kv_heads * cfg.head_dim) - block
        raise InputError(f"--budget {budget:,} tokens makes each layer's compiled cache tensor "
                         f"{cfg.num_kv_heads} × {budget + block:,} × {cfg.head_dim} = {elements:,} elements, past the "
                         f"2^31 that compiled kernels index; compile with --budget {most:,} or less (the eager engine, "
                         "`edgekv run MODEL`, allocates only what the prompt needs)")


def check_output_dir(output: Path) -> None:
    """``edgekv compile -o DIR``: a new folder, an empty one, or an earlier artifact (replaced)."""
    if output.exists() and not output.is_dir():
        raise InputError(f"-o {output} is a file; give a directory for the artifact (a new or empty one, or an "
                         "earlier artifact to replace)")
    if output.is_dir() and any(output.iterdir()) and not (output / "manifest.json").is_file():
        raise InputError(f"-o {output} exists and is not an edgekv artifact; choose an empty or new directory")
    parent = output.parent if str(output.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise InputError(f"-o {output}: {parent} is a file, not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        import tempfile

        Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".check", dir=parent)).rmdir()
    except OSError as exc:
        raise InputError(f"-o {output}: cannot write in {parent} ({exc.strerror or exc})") from None


def staging_dir(output: Path) -> Path:
    """A fresh folder beside ``output`` that the build writes; it replaces ``output`` only when
    the build succeeded (so a recompile leaves no file of an earlier target, and a failed one
    leaves the earlier artifact as it was)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".building", dir=output.parent))


def replace_dir(new: Path, output: Path) -> None:
    import shutil

    if output.exists():
        old = output.with_name(f".{output.name}.old-{new.name.split('.')[-2]}")
        output.rename(old)
        new.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(output)


def load_compile_input(model: str | None, tokenizer: Path | None):
    """What `edgekv compile` compiles: an ONNX file (graph and weights from the file) or a model."""
    from .compiler.frontend.onnx_import import is_onnx_path
    from .models import load_model

    if is_onnx_path(model):
        from .compiler.frontend.onnx_model import load_onnx_model

        return load_onnx_model(model, tokenizer)
    if tokenizer is not None:
        raise InputError("--tokenizer is for an .onnx model; a model name, GGUF file or HF folder brings its own")
    return load_model(model, err)


@app.command("export-onnx")
def export_onnx_cmd(
    model: Annotated[Optional[str], typer.Argument(help="model name (smollm2-135m), GGUF file or HF directory")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="folder to write model.onnx, config.json and the tokenizer to")] = Path("build/onnx"),
    form: Annotated[str, typer.Option(help="plain: input_ids, position_ids → logits; past: HF/optimum layout with attention_mask and past_key_values inputs")] = "plain",
):
    """Export a decoder to ONNX with torch.onnx.export (the input of `edgekv compile model.onnx`)."""
    from .models import load_model

    try:
        from .compiler.frontend.onnx_export import FORMS, export_onnx

        if form not in FORMS:
            raise InputError(f"unknown --form {form!r}; one of {', '.join(FORMS)}")
        from .evaluation.command import check_output_folder

        check_output_folder(output)
        say(f"loading {model or 'smollm2-135m'}")
        loaded = load_model(model, err)
        with err.status(f"exporting {loaded.model_id} to ONNX ({form})…"):
            path = export_onnx(loaded, output, form)
        out.print(f"wrote {path} (+ config.json, tokenizer); compile it with: edgekv compile {path}")
    except ImportError as exc:
        _fail(InputError(f"exporting to ONNX needs `onnx` and `onnxscript` ({exc.name} is missing): "
                         "pip install -e '.[compile]'"))
    except USER_ERRORS as exc:
        _fail(exc)


@app.command("policies")
def list_policies():
    """List the eviction policies: what each does, and its parameters (`--policy-arg key=value`)."""
    from .policies import REGISTRY

    table = Table(title="eviction policies")
    table.add_column("name", no_wrap=True)
    table.add_column("what it does")
    table.add_column("parameters (defaults)")
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        params = cls().params()
        table.add_row(name, cls.summary or "—", ", ".join(f"{k}={v}" for k, v in params.items()) or "—")
    out.print(table)


@app.command("cache")
def cache_cmd(
    clear: Annotated[bool, typer.Option(help="delete edgekv's cached model copies (they are rebuilt on next use)")] = False,
):
    """Show edgekv's model cache (converted copies of GGUF models), or clear it with --clear."""
    import shutil

    from .models.loader import cached_conversions
    from .models.sources import cache_root

    root = cache_root()
    entries = cached_conversions()
    total = sum(e["bytes"] for e in entries)
    out.print(f"edgekv cache: {root} (EDGEKV_CACHE moves it)", soft_wrap=True, highlight=False)
    table = Table(title="converted models")
    table.add_column("converted copy")
    table.add_column("of")
    table.add_column("source sha256", no_wrap=True)
    table.add_column("size", justify="right")
    for e in entries:
        table.add_row(e["path"].name, e["source"], (e["sha256"] or "?")[:12], human_bytes(e["bytes"]))
    out.print(table)
    if not clear:
        err.print(f"{len(entries)} converted cop{'y' if len(entries) == 1 else 'ies'}, {human_bytes(total)}; "
                  "`edgekv cache --clear` deletes them (or delete the folder yourself)", soft_wrap=True)
        return
    for e in entries:
        shutil.rmtree(e["path"], ignore_errors=True)
    err.print(f"deleted {len(entries)} converted cop{'y' if len(entries) == 1 else 'ies'} ({human_bytes(total)}); "
              "the next run converts its model again (~30 s)")


from .simulate.cli import simulate_cmd  # noqa: E402 - the command lives in edgekv/simulate

app.command("simulate")(simulate_cmd)


@app.command("eval")
def eval_(
    model: Annotated[Optional[str], typer.Argument(help=HELP["model"])] = None,
    task: Annotated[str, typer.Option(help="passkey, multikey, fidelity or all (comma-separated)")] = "passkey",
    policies: Annotated[str, typer.Option("--policy", "--policies", help="comma-separated policies, or 'all' (see `edgekv policies`); name#tag runs a variant beside the default, "
                  "set with --policy-arg name#tag:key=value")] = "full,keydiff,snapkv,tova,streaming,h2o",
    budgets: Annotated[str, typer.Option("--budget", "--budgets", help="comma-separated budgets N: 128,256,512,1k")] = "128,256,512,1k",
    block: Annotated[str, typer.Option(help="block size(s) B, comma-separated; 'one' = the whole prompt as one block")] = "128",
    one_block: Annotated[bool, typer.Option(help="also run every budget with the whole prompt as one block")] = False,
    lengths: Annotated[str, typer.Option(help="passkey prompt lengths in tokens")] = "1k,2k,4k",
    depths: Annotated[str, typer.Option(help="needle depths (0 = start of the haystack, 1 = end)")] = "0.1,0.5,0.9",
    seeds: Annotated[str, typer.Option(help="seeds (haystack offset, key values)")] = "0,1",
    keys: Annotated[int, typer.Option(help="needles in the multi-key task: the pass key + distractors of other kinds")] = 2,
    haystack: Annotated[str, typer.Option(help="'repeat' (the classic passkey filler) or 'text' (natural text: harder)")] = "repeat",
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated for a passkey answer")] = 10,
    fidelity_lengths: Annotated[str, typer.Option(help="fidelity text lengths in tokens")] = "2k",
    fidelity_window: Annotated[int, typer.Option(help="last positions of the text that are scored")] = 512,
    greedy_tokens: Annotated[int, typer.Option(help="greedy continuation length compared with the full cache")] = 16,
    policy_arg: Annotated[Optional[list[str]], typer.Option(help=HELP["policy_arg"])] = None,
    model_opt: Annotated[Optional[str], typer.Option("--model", hidden=True, help="alias of MODEL")] = None,
    threads: Annotated[Optional[int], typer.Option(help=HELP["threads"])] = None,
    output: Annotated[Path, typer.Option("-o", "--output", "--out", help="folder for results.json, results.md and plots")] = Path("eval-out"),
    resume: Annotated[bool, typer.Option(help="reuse the prompts an earlier (interrupted) run in --output finished")] = False,
    allow_beyond_context: Annotated[bool, typer.Option(help=HELP["beyond"])] = False,
    question: Annotated[bool, typer.Option("--question/--no-question", help="passkey tasks: read the document knowing its question, which query-aware policies score the blocks with (as `edgekv run --question`)")] = False,
    kv_dtype: Annotated[str, typer.Option(help=HELP["kv_dtype"] + "; the full-cache reference is always fp32")] = "fp32",
    workers: Annotated[Optional[int], typer.Option(help="worker processes, one prompt at a time each (default: cores / --threads; 1 = this process)")] = None,
    ray: Annotated[Optional[str], typer.Option(help="run the prompts on Ray: 'auto' (the instance on this machine, started if none) or a cluster ADDRESS; nodes need edgekv and the model")] = None,
):
    """Accuracy sweeps on the real model: passkey retrieval and fidelity to the full cache.

    The prompts run over local worker processes (--workers) or a Ray cluster (--ray); the results
    are the same as in one process with the same --threads, in the same order."""
    from .evaluation.command import build_spec, check_output_folder, run_eval

    try:
        model = merge_model(model, model_opt, "eval")
        spec = build_spec(task, policies, budgets, block, one_block, lengths, depths, seeds, keys, haystack,
                          max_new_tokens, fidelity_lengths, fidelity_window, greedy_tokens, policy_arg, question,
                          kv_dtype=parse_kv_dtype(kv_dtype))
        check_output_folder(output)
        setup_threads(threads)
        data = run_eval(spec, output, model_name=model, console=err, argv=["edgekv", *sys.argv[1:]],
                        resume=resume, allow_beyond_context=allow_beyond_context, workers=workers, ray=ray,
                        threads=threads)
        out.print((output / "results.md").read_text())
        err.print("written: " + ", ".join(data["_files"]))
    except USER_ERRORS as exc:
        _fail(exc)


def main():  # pragma: no cover
    app()


@app.command()
def bench(
    model: Annotated[Optional[str], typer.Argument(help=HELP["model"])] = None,
    prompt_lengths: Annotated[str, typer.Option(help="timed prompt lengths (within the model's context)")] = "1k,4k,8k",
    memory_only_lengths: Annotated[str, typer.Option(help="edgekv-only lengths past the context (memory only)")] = "16k,32k",
    budget: Annotated[str, typer.Option(help=HELP["budget"])] = DEFAULT_BUDGET,
    block: Annotated[int, typer.Option(help=HELP["block"])] = DEFAULT_BLOCK,
    policy: Annotated[str, typer.Option(help=HELP["policy"])] = DEFAULT_POLICY,
    systems: Annotated[str, typer.Option(help="systems to run")] = "edgekv-eager,edgekv-compiled,hf,kvpress,llamacpp,onnxruntime",
    artifact: Annotated[Optional[Path], typer.Option(help="compiled artifact for edgekv-compiled and edgekv-native")] = None,
    fp32_artifact: Annotated[Optional[Path], typer.Option(help="the same build with --weights fp32, for edgekv-native-fp32 (what quantised weights change)")] = None,
    onnx: Annotated[Optional[Path], typer.Option(help="ONNX file (past_key_values form, `edgekv export-onnx --form past`) for the onnxruntime peer")] = None,
    decode_tokens: Annotated[int, typer.Option("--max-new-tokens", "--decode-tokens", help="tokens decoded after the prompt")] = 32,
    repeats: Annotated[int, typer.Option(help="runs per point (median reported)")] = 3,
    threads: Annotated[Optional[int], typer.Option(help=HELP["threads"] + " (every system)")] = None,
    model_opt: Annotated[Optional[str], typer.Option("--model", hidden=True, help="alias of MODEL")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", "--out", help="output folder (JSON, markdown, plot)")] = Path("bench-results"),
    question_tokens: Annotated[int, typer.Option(help="time question-aware prefill: the prompt's last Q tokens are its question, whose rows score every block (edgekv-eager; edgekv-compiled with an artifact compiled with --question-rows ≥ Q); peers read the whole prompt")] = 0,
):
    """Prefill/decode speed and peak RSS of edgekv next to HF, kvpress, llama.cpp and ONNX Runtime (one process per run)."""
    from .bench.report import markdown, plot
    from .bench.runner import BenchConfig, run_bench
    from .bench.systems import SYSTEMS
    from .budget import parse_budget
    from .corpus import natural_token_ids
    from .evaluation.command import check_output_folder
    from .job import write_json_atomic
    from .models import load_model

    try:
        model = merge_model(model, model_opt, "bench") or "smollm2-135m"
        names = [s.strip() for s in systems.split(",") if s.strip()]
        unknown = [s for s in names if s not in SYSTEMS]
        if unknown:
            raise InputError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
        check_block(block)
        from .evaluation.command import parse_lengths

        lengths = parse_lengths(prompt_lengths, "--prompt-lengths")
        if question_tokens < 0 or (question_tokens and question_tokens >= min(lengths)):
            raise InputError(f"--question-tokens {question_tokens}: give 0 (none) or fewer tokens than the shortest "
                             "--prompt-lengths")
        if question_tokens and "edgekv-native" in names:
            raise InputError("--question-tokens: edgekv-native takes a question as text (edgekv-run --question), not "
                             "ids; time the compiled path with edgekv-compiled, or drop edgekv-native from --systems")
        mem_lengths = parse_lengths(memory_only_lengths, "--memory-only-lengths") if memory_only_lengths.strip() else []
        if onnx is not None and not onnx.is_file():
            raise InputError(f"--onnx {onnx} is not a file; export one with `edgekv export-onnx --form past -o DIR`")
        check_output_folder(output)
        choice = setup_threads(threads)
        say(f"loading {model}")
        loaded = load_model(model, err)
        cfg = BenchConfig(model=model, systems=names, lengths=lengths, memory_only_lengths=mem_lengths,
                          budget=parse_budget(budget, loaded.config, block), block=block, policy=policy,
                          decode_tokens=decode_tokens, repeats=repeats, threads=choice.count,
                          artifact=str(artifact) if artifact else None, onnx=str(onnx) if onnx else None,
                          fp32_artifact=str(fp32_artifact) if fp32_artifact else None, question_tokens=question_tokens)
        results = run_bench(cfg, lambda n: natural_token_ids(loaded.tokenizer, n).tolist(), err)
        results["machine"] = machine_info()
        results["command"] = "edgekv bench " + " ".join(sys.argv[2:])
        output.mkdir(parents=True, exist_ok=True)
        write_json_atomic(output / "bench.json", results)
        (output / "bench.md").write_text(markdown(results))
        plot(results, str(output / "bench.png"))
        out.print(markdown(results))
        err.print(f"results in {output}/bench.json, bench.md, bench.png")
    except USER_ERRORS as exc:
        _fail(exc)


def machine_info() -> dict:
    """What a results file records about where it was measured."""
    import os
    import platform

    import torch

    from .evaluation.report import _git_commit

    full = _git_commit(Path(__file__).resolve().parent) or ""  # "<hash>[-dirty]", as eval records it
    commit = full[:7] + ("-dirty" if full.endswith("-dirty") else "")
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "commit": commit}
