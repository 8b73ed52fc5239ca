"""The `edgekv` command (typer + rich)."""

from __future__ import annotations

import json
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
    runtime: Annotated[str, typer.Option(help="for an artifact: native (C runtime), tvm (TVM's VM), or auto")] = "auto",
):
    """Generate from a long prompt under a KV budget, block by block; print text and a memory table."""
    from .engine import Sampler
    from .job import (check_context, check_writable, encode_prompt, open_artifact, run_compiled, run_eager,
                      write_json_atomic)
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
        compiled = model is not None and (Path(model) / "manifest.json").is_file()
        if compiled:
            if policy_arg or budget_given(budget, block, policy):
                raise InputError("a compiled artifact fixes --policy, --budget and --block at compile time; "
                                 "drop them or recompile with `edgekv compile`")
            runtime_, loaded = open_artifact(model, runtime=runtime, threads=threads)
        else:
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
            if compiled:
                result = run_compiled(runtime_, loaded, ids, max_new_tokens=max_new_tokens, sampler=sampler,
                                      on_token=stream, progress=advance if show_bar else None)
            else:
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
    except USER_ERRORS + compiler_errors() as exc:
        _fail(exc)


RUN_DEFAULTS = {"budget": "2k", "block": 128, "policy": "keydiff"}


def budget_given(budget: str, block: int, policy: str) -> bool:
    """Whether the user changed a setting that a compiled artifact fixes (typer gives no 'was set' flag)."""
    return (budget, block, policy) != (RUN_DEFAULTS["budget"], RUN_DEFAULTS["block"], RUN_DEFAULTS["policy"])


def compiler_errors() -> tuple[type[Exception], ...]:
    """Errors of the compiled path that are the user's to fix (imported lazily: TVM is optional)."""
    try:
        from .compiler.attention_sites import AttentionMatchError
        from .compiler.build import CompileError
        from .compiler.kernels import UnsupportedPolicyError
        from .runtime.host import ArtifactError
    except ImportError:
        return ()
    return (AttentionMatchError, CompileError, UnsupportedPolicyError, ArtifactError)


@app.command("compile")
def compile_cmd(
    model: Annotated[Optional[str], typer.Argument(help="model name (smollm2-135m), GGUF file, HF directory or an exported decoder .onnx file")] = None,
    budget: Annotated[str, typer.Option(help="KV budget N per layer and KV head (8k, 1024, 512MiB)")] = "2k",
    block: Annotated[int, typer.Option(help="prompt tokens per block B")] = 128,
    policy: Annotated[str, typer.Option(help="eviction policy compiled into the model")] = "keydiff",
    policy_arg: Annotated[Optional[list[str]], typer.Option(help="policy parameter key=value (repeatable)")] = None,
    target: Annotated[str, typer.Option(help="target profile in compile/ (host, ...) or a JSON file")] = "host",
    output: Annotated[Path, typer.Option("-o", "--output", help="artifact directory to write")] = Path("build/edgekv"),
    mem_limit: Annotated[Optional[str], typer.Option(help="refuse if the static memory plan exceeds this (1.5GiB)")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(help="for an .onnx model: HF folder with its config.json and tokenizer (default: the .onnx file's folder)")] = None,
):
    """Compile a model with block-wise prefill and in-graph eviction into an artifact directory (TVM)."""
    import time

    from .budget import parse_budget, parse_size
    from .policies import make_policy

    try:
        if output.exists() and any(output.iterdir()) and not (output / "manifest.json").is_file():
            raise InputError(f"-o {output} exists and is not an edgekv artifact; choose an empty or new directory")
        pol = make_policy(policy, parse_policy_args(policy_arg))
        limit = parse_size(mem_limit) if mem_limit else None
        loaded = load_compile_input(model, tokenizer)
        n = parse_budget(budget, loaded.config, block)
        from .compiler import compile_model

        t0 = time.perf_counter()
        with err.status("compiling…") as status:
            result = compile_model(loaded, pol, n, block, target, output, mem_limit=limit,
                                   progress=lambda msg: status.update(msg))
        manifest = result.manifest
        table = Table(title=f"edgekv compile · {loaded.model_id} · {policy} · N={n} B={block}")
        table.add_column("item")
        table.add_column("value", justify="right")
        table.add_row("artifact", str(output))
        table.add_row("target", json.dumps(manifest["target"]["tvm"]))
        table.add_row("attention sites rewritten", str(manifest["num_layers"]))
        plan = manifest["memory_plan"]
        table.add_row("plan: weights / KV cache / activations",
                      f"{human_bytes(plan['weights_bytes'])} / {human_bytes(plan['cache_bytes'])} / "
                      f"{human_bytes(plan['activation_bytes'])}")
        table.add_row("compile time", f"{time.perf_counter() - t0:.1f} s")
        toolchain = (manifest.get("device") or {}).get("toolchain") or {}
        if toolchain:
            table.add_row("device toolchain", str(toolchain.get("status", "")))
            if toolchain.get("finish"):
                table.add_row("finish on a machine with it", str(toolchain["finish"]))
        out.print(table)
    except USER_ERRORS + compiler_errors() as exc:
        _fail(exc)


def load_compile_input(model: str | None, tokenizer: Path | None):
    """What `edgekv compile` compiles: an ONNX file (graph and weights from the file) or a model."""
    from .compiler.onnx_import import is_onnx_path
    from .models import load_model

    if is_onnx_path(model):
        from .compiler.onnx_model import load_onnx_model

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
        from .compiler.onnx_export import FORMS, export_onnx

        if form not in FORMS:
            raise InputError(f"unknown --form {form!r}; one of {', '.join(FORMS)}")
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
    """List the eviction policies and their parameters."""
    from .policies import REGISTRY

    table = Table(title="eviction policies")
    table.add_column("name")
    table.add_column("parameters (defaults)")
    for name in sorted(REGISTRY):
        params = REGISTRY[name]().params()
        table.add_row(name, ", ".join(f"{k}={v}" for k, v in params.items()) or "—")
    out.print(table)


from .simulate.cli import simulate_cmd  # noqa: E402 - the command lives in edgekv/simulate

app.command("simulate")(simulate_cmd)


@app.command("eval")
def eval_(
    task: Annotated[str, typer.Option(help="passkey, multikey, fidelity or all (comma-separated)")] = "passkey",
    policies: Annotated[str, typer.Option(help="comma-separated policies, or 'all' (see `edgekv policies`)")] = "full,keydiff,snapkv,tova,streaming,h2o",
    budgets: Annotated[str, typer.Option(help="comma-separated budgets N: 128,256,512,1k")] = "128,256,512,1k",
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
    policy_arg: Annotated[Optional[list[str]], typer.Option(help="policy:key=value (repeatable)")] = None,
    model: Annotated[Optional[str], typer.Option(help="model name, GGUF file or HF directory")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (1 is fastest on a busy 2-core box)")] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="folder for results.json, results.md and plots")] = Path("eval-out"),
    resume: Annotated[bool, typer.Option(help="reuse the prompts an earlier (interrupted) run in --out finished")] = False,
):
    """Accuracy sweeps on the real model: passkey retrieval and fidelity to the full cache."""
    from .evaluation.command import build_spec, run_eval

    try:
        spec = build_spec(task, policies, budgets, block, one_block, lengths, depths, seeds, keys, haystack,
                          max_new_tokens, fidelity_lengths, fidelity_window, greedy_tokens, policy_arg)
        data = run_eval(spec, out_dir, model_name=model, threads=threads, console=err, argv=["edgekv", *sys.argv[1:]],
                        resume=resume)
        out.print((out_dir / "results.md").read_text())
        err.print("written: " + ", ".join(data["_files"]))
    except USER_ERRORS as exc:
        _fail(exc)


def main():  # pragma: no cover
    app()


@app.command()
def bench(
    model: Annotated[str, typer.Option(help="model name or GGUF path")] = "smollm2-135m",
    prompt_lengths: Annotated[str, typer.Option(help="timed prompt lengths (within the model's context)")] = "1k,4k,8k",
    memory_only_lengths: Annotated[str, typer.Option(help="edgekv-only lengths past the context (memory only)")] = "16k,32k",
    budget: Annotated[str, typer.Option(help="edgekv KV budget N")] = "1k",
    block: Annotated[int, typer.Option(help="block size B")] = 128,
    policy: Annotated[str, typer.Option(help="edgekv eviction policy")] = "keydiff",
    systems: Annotated[str, typer.Option(help="systems to run")] = "edgekv-eager,edgekv-compiled,hf,kvpress,llamacpp,onnxruntime",
    artifact: Annotated[Optional[Path], typer.Option(help="compiled artifact for edgekv-compiled")] = None,
    onnx: Annotated[Optional[Path], typer.Option(help="ONNX file (past_key_values form, `edgekv export-onnx --form past`) for the onnxruntime peer")] = None,
    decode_tokens: Annotated[int, typer.Option(help="tokens decoded after the prompt")] = 32,
    repeats: Annotated[int, typer.Option(help="runs per point (median reported)")] = 3,
    threads: Annotated[int, typer.Option(help="threads for every system")] = 2,
    out_dir: Annotated[Path, typer.Option("--out", help="output folder (JSON, markdown, plot)")] = Path("bench-results"),
):
    """Prefill/decode speed and peak RSS of edgekv next to HF, kvpress, llama.cpp and ONNX Runtime (one process per run)."""
    from .bench.report import markdown, plot
    from .bench.runner import BenchConfig, run_bench
    from .bench.systems import SYSTEMS
    from .budget import parse_budget
    from .corpus import natural_token_ids
    from .job import check_writable, write_json_atomic
    from .models import load_model

    try:
        names = [s.strip() for s in systems.split(",") if s.strip()]
        unknown = [s for s in names if s not in SYSTEMS]
        if unknown:
            raise InputError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
        lengths = [parse_budget(x, block=1) for x in prompt_lengths.split(",") if x.strip()]
        mem_lengths = [parse_budget(x, block=1) for x in memory_only_lengths.split(",") if x.strip()]
        out_dir.mkdir(parents=True, exist_ok=True)
        check_writable(out_dir / "bench.json", "--out")
        if onnx is not None and not onnx.is_file():
            raise InputError(f"--onnx {onnx} is not a file; export one with `edgekv export-onnx --form past -o DIR`")
        loaded = load_model(model, err)
        cfg = BenchConfig(model=model, systems=names, lengths=lengths, memory_only_lengths=mem_lengths,
                          budget=parse_budget(budget, loaded.config, block), block=block, policy=policy,
                          decode_tokens=decode_tokens, repeats=repeats, threads=threads,
                          artifact=str(artifact) if artifact else None, onnx=str(onnx) if onnx else None)
        results = run_bench(cfg, lambda n: natural_token_ids(loaded.tokenizer, n).tolist(), err)
        results["machine"] = machine_info()
        results["command"] = "edgekv bench " + " ".join(sys.argv[2:])
        write_json_atomic(out_dir / "bench.json", results)
        (out_dir / "bench.md").write_text(markdown(results))
        plot(results, str(out_dir / "bench.png"))
        out.print(markdown(results))
        err.print(f"results in {out_dir}/bench.json, bench.md, bench.png")
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
