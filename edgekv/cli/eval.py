"""`edgekv eval`: accuracy sweeps (passkey, multi-key, fidelity); the flow is
``edgekv/evaluation/command.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import USER_ERRORS
from .common import HELP, err, fail, merge_model, out, parse_kv_dtype, setup_threads


def eval_cmd(
    model: Annotated[Optional[str], typer.Argument(help=HELP["model"])] = None,
    task: Annotated[str, typer.Option(help="passkey, multikey, fidelity or all (comma-separated)")] = "passkey",
    policies: Annotated[str, typer.Option("--policy", "--policies", help="comma-separated policies, 'all' (see `edgekv policies`), or 'none' (only --artifacts beside the full-cache reference); name#tag runs a variant beside the default, "
                  "set with --policy-arg name#tag:key=value")] = "full,keydiff,snapkv,tova,streaming,h2o",
    budgets: Annotated[str, typer.Option("--budget", "--budgets", help="comma-separated budgets N: 128,256,512,1k")] = "128,256,512,1k",
    block: Annotated[str, typer.Option(help="block size(s) B, comma-separated; 'one' = the whole prompt as one block")] = "128",
    one_block: Annotated[bool, typer.Option(help="also run every budget with the whole prompt as one block")] = False,
    lengths: Annotated[str, typer.Option(help="passkey prompt lengths in tokens")] = "1k,2k,4k",
    depths: Annotated[str, typer.Option(help="needle depths (0 = start of the haystack, 1 = end)")] = "0.1,0.5,0.9",
    seeds: Annotated[str, typer.Option(help="seeds (haystack offset, key values)")] = "0,1",
    keys: Annotated[int, typer.Option(help="needles in the multi-key task: the pass key + distractors of other kinds")] = 2,
    haystack: Annotated[str, typer.Option(help="'varied' (natural prose from two offline sources, varied needle "
                                                "phrasings), 'repeat' (the classic passkey filler) or 'text' "
                                                "(the Python reference alone)")] = "varied",
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
    artifacts: Annotated[Optional[str], typer.Option("--artifacts", "--artifact", help="compiled artifacts (comma-separated folders from `edgekv compile`) run through the native runtime beside the policies, each at its own N and B and scored against the same full-cache reference; e.g. --policy full --artifacts build/kd1k,build/snapq1k")] = None,
    workers: Annotated[Optional[int], typer.Option(help="worker processes, one prompt at a time each (default: cores / --threads; 1 = this process)")] = None,
    ray: Annotated[Optional[str], typer.Option(help="run the prompts on Ray: 'auto' (the instance on this machine, started if none) or a cluster ADDRESS; nodes need edgekv and the model")] = None,
):
    """Accuracy sweeps on the real model: passkey retrieval and fidelity to the full cache.

    The prompts run over local worker processes (--workers) or a Ray cluster (--ray); the results
    are the same as in one process with the same --threads, in the same order."""
    from ..evaluation.command import build_spec, check_output_folder, run_eval

    try:
        model = merge_model(model, model_opt, "eval")
        spec = build_spec(task, policies, budgets, block, one_block, lengths, depths, seeds, keys, haystack,
                          max_new_tokens, fidelity_lengths, fidelity_window, greedy_tokens, policy_arg, question,
                          kv_dtype=parse_kv_dtype(kv_dtype), artifacts=artifacts)
        check_output_folder(output)
        setup_threads(threads)
        data = run_eval(spec, output, model_name=model, console=err, argv=["edgekv", *sys.argv[1:]],
                        resume=resume, allow_beyond_context=allow_beyond_context, workers=workers, ray=ray,
                        threads=threads)
        out.print((output / "results.md").read_text())
        err.print("written: " + ", ".join(data["_files"]))
    except USER_ERRORS as exc:
        fail(exc)
