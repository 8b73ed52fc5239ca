"""`edgekv run` and `edgekv ask`: check every option, run the eager engine or a compiled
artifact (``edgekv/job.py``), stream the text and print the memory table."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..artifact import is_artifact
from ..budget import DEFAULT_BLOCK, DEFAULT_BUDGET
from ..errors import USER_ERRORS, InputError
from ..units import human_bytes
from .common import (DEFAULT_POLICY, HELP, BeyondContext, MemLimit, ReportPath, Temperature, Threads, TopP,
                     check_block, check_sampling, compiler_errors, err, fail, out, parse_kv_dtype, parse_mem_limit,
                     parse_policy_args, prefill_progress, read_prompt, say, setup_threads, warn)


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
        fail(exc)


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
):
    """Answer questions about a document read earlier, from its saved cache: no re-reading."""
    try:
        run_command(model, prompt=None, prompt_file=None, chat=None, questions=question or [], save_cache=None,
                    load_cache=snapshot, budget=None, block=None, policy=None, policy_arg=None,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, output=output,
                    mem_limit=mem_limit, allow_beyond_context=allow_beyond_context, threads=threads,
                    runtime=runtime)
    except USER_ERRORS + compiler_errors() as exc:
        fail(exc)


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
        from ..document import snapshot_settings

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
            from ..engine.block_engine import snapshot_kv_dtype

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
        from ..job import check_artifact_settings
        from ..policies import REGISTRY
        from ..runtime import read_manifest

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
        from ..policies import make_policy

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
    from ..threads import threads_in_use

    result.report["threads"] = {**choice.to_dict(), **threads_in_use()}
    err.print(kv_line(result.report), highlight=False)
    out.print(summary_table(result.report))
    if output is not None:
        from ..job import write_json_atomic

        write_json_atomic(output, result.report)
        err.print(f"report written to {output}")


def check_writable_early(path) -> None:
    from ..job import check_writable

    check_writable(path, "-o/--output")


def _artifact_policy_args(pairs, policy, artifact) -> dict[str, str]:
    from ..runtime import read_manifest

    name = policy or read_manifest(artifact)["policy"]["name"]
    from ..policies import policy_arguments

    return policy_arguments(pairs, [name]).get(name, {})


def _generate(loaded, text: str, chat: bool, max_new_tokens: int, allow_beyond_context: bool, block: int, run):
    """Encode, check the context, then ``run(ids, on_token, progress, on_phase)`` with streamed text,
    a progress bar on a terminal and one line per phase."""
    from ..job import TextStream, check_context, encode_prompt

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
    from ..job import TextStream, check_context
    from ..models.chat import encode_document, encode_question

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
    from ..engine import Sampler

    return lambda: Sampler(temperature=temperature, top_p=top_p, seed=seed)


def run_eager_job(model, text, *, chat, budget, block, policy, policy_args, max_new_tokens, temperature, top_p, seed,
                  mem_limit, allow_beyond_context, document=None, kv_dtype="fp32"):
    """`edgekv run MODEL`: the eager engine (``document``: --question / --save-cache / --load-cache;
    ``kv_dtype``: --kv-dtype)."""
    from ..engine import Sampler
    from ..job import run_eager, run_eager_document
    from ..models import load_model

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
    from ..engine import Sampler
    from ..job import open_artifact, run_compiled, run_compiled_document

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
