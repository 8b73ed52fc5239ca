"""What every `edgekv` command shares: the option vocabulary (help texts and the options
declared once), the console (``say``/``warn``/``fail``), and the checks and parsers of the
options that mean the same in every command (README, "Using it")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..budget import DEFAULT_BLOCK, DEFAULT_BUDGET, DEFAULT_POLICY
from ..errors import InputError

# Piped or redirected, rich would wrap at 80 columns and cut option names in half: a console
# that is not a terminal gets a wide width (a line is never wrapped mid-message), a terminal its own.
PIPED_WIDTH = 10_000


def _console(stderr: bool) -> Console:
    import sys

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=PIPED_WIDTH)


err = _console(stderr=True)
out = _console(stderr=False)

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
NoVerify = Annotated[bool, typer.Option("--no-verify", help="for an ARTIFACT: trust its weights, skipping the check of "
                                        "each weight's checksum at open (a corrupt params file is refused otherwise; "
                                        "a clean check is remembered beside the artifact until the file changes)")]


def fail(exc: Exception) -> None:
    """A user error (``errors.USER_ERRORS``): one line on stderr, no traceback, exit status 2."""
    err.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(2)


def cancelled(exc: KeyboardInterrupt) -> None:
    """Ctrl-C: one line saying what stopped, no traceback, exit status 130 (as edgekv-run's). The
    process ends here, without the interpreter's teardown: with torch and TVM loaded that takes
    seconds on a busy machine, and the user asked to stop now (every file edgekv writes is written
    whole or not at all, so nothing is left half-done)."""
    import sys

    what = str(exc) or "cancelled (Ctrl-C)"
    err.print(f"\n[dim]edgekv:[/] {what}; nothing more was written", highlight=False)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(130)


def say(msg: str) -> None:
    """One line per phase on stderr, so that long steps show even with output redirected."""
    err.print(f"[dim]edgekv:[/] {msg}", highlight=False)


def warn(msg: str) -> None:
    err.print(f"[yellow]warning:[/] {msg}", highlight=False)


def parse_policy_args(pairs: list[str] | None, policy: str | None = None) -> dict[str, str]:
    """``--policy-arg`` values for one policy (``key=value`` or ``policy:key=value``)."""
    from ..policies import policy_arguments

    name = policy or DEFAULT_POLICY
    return policy_arguments(pairs, [name]).get(name, {})


# whitespace that makes no prompt, the same bytes edgekv-run's check_text skips
PROMPT_SPACE = " \t\n\r\v\f"


def check_text(option: str, data: bytes) -> str:
    """The text rules of both runtimes (edgekv-run's ``check_text`` in runtime/cli/edgekv_run.c):
    strict UTF-8, refused at its first bad byte, and not only whitespace. Returns the text."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{option} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                         "save it as UTF-8") from None
    if not text.strip(PROMPT_SPACE):
        raise InputError("the prompt is empty; pass --prompt TEXT or --prompt-file FILE with some text")
    return text


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt, checked before anything loads (``check_text``)."""
    if prompt is not None and prompt_file is not None:
        raise InputError("give either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            data = prompt_file.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read --prompt-file {prompt_file}: {exc.strerror or exc}") from None
        return check_text(f"--prompt-file {prompt_file}", data)
    if prompt is None:
        raise InputError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return check_text("--prompt", prompt.encode("utf-8", "surrogateescape"))


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
    from ..units import parse_size

    return parse_size(mem_limit) if mem_limit else None


def setup_threads(threads: int | None):
    """Choose and apply the thread count (torch and TVM), say it in one line; returns the choice."""
    from ..threads import apply_threads, choose_threads

    choice = choose_threads(threads)
    if choice.clamped:
        warn(f"--threads {choice.asked} is more than the {choice.cores} usable cores here (affinity, physical and "
             f"big cores, CPU quota): using {choice.count}; threads beyond the cores only wait for each other")
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


def parse_kv_dtype(kv_dtype: str | None, option: str = "--kv-dtype") -> str | None:
    """``--kv-dtype`` checked against ``memory.KV_DTYPES`` (None: not given)."""
    if kv_dtype is None:
        return None
    from ..memory import KVDtypeError, check_kv_dtype

    try:
        return check_kv_dtype(kv_dtype.strip().lower(), option)
    except KVDtypeError as exc:  # its message names the choices from memory.KV_DTYPES
        raise InputError(str(exc)) from None


def compiler_errors() -> tuple[type[Exception], ...]:
    """Errors of the compiled path that are the user's to fix. ``ArtifactError`` is light and always
    caught; the compiler's are taken only from modules already loaded (an error a module raised
    means the module is loaded), so a refusal made before any model loads imports neither TVM nor
    torch just to name the errors it does not have."""
    import sys

    from ..artifact.errors import ArtifactError

    errors: list[type[Exception]] = [ArtifactError]
    for module, names in (("edgekv.compiler.passes.attention_sites", ("AttentionMatchError",)),
                          ("edgekv.compiler.errors", ("CompileError",)),
                          ("edgekv.compiler.policy_kernels", ("UnsupportedPolicyError",))):
        loaded = sys.modules.get(module)
        errors += [getattr(loaded, name) for name in names if loaded is not None and hasattr(loaded, name)]
    return tuple(errors)
