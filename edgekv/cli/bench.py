"""`edgekv bench`: edgekv next to its peers (HF, kvpress, llama.cpp, ONNX Runtime); the runs
are ``edgekv/bench/``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..budget import DEFAULT_BLOCK, DEFAULT_BUDGET
from ..errors import USER_ERRORS, InputError
from .common import DEFAULT_POLICY, HELP, check_block, err, fail, merge_model, out, say, setup_threads


def bench_cmd(
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
    from ..bench.machine import machine_info
    from ..bench.report import markdown, plot
    from ..bench.runner import BenchConfig, run_bench
    from ..bench.systems import SYSTEMS
    from ..budget import parse_budget
    from ..corpus import natural_token_ids
    from ..evaluation.command import check_output_folder
    from ..output_files import write_json_atomic
    from ..models import load_model

    try:
        model = merge_model(model, model_opt, "bench") or "smollm2-135m"
        names = [s.strip() for s in systems.split(",") if s.strip()]
        unknown = [s for s in names if s not in SYSTEMS]
        if unknown:
            raise InputError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
        check_block(block)
        from ..evaluation.command import parse_lengths

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
        fail(exc)
