"""`edgekv compile` (a model or an exported .onnx file → an artifact folder, written beside the
destination and swapped in when the build succeeded) and `edgekv export-onnx`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..artifact import Keys, Manifest, is_artifact
from ..artifact.staging import replace_dir, staging_dir
from ..budget import DEFAULT_BLOCK, DEFAULT_BUDGET
from ..errors import USER_ERRORS, InputError
from ..units import human_bytes
from .common import (DEFAULT_POLICY, HELP, check_block, compiler_errors, err, fail, out, parse_kv_dtype,
                     parse_mem_limit, parse_policy_args, say)

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
    compress: Annotated[Optional[str], typer.Option(help="document compression compiled in: reconstruct (KVzip's "
                                                         "reconstruction score, block-wise; replaces --policy) or none")] = None,
    decode_activations: Annotated[Optional[str], typer.Option(help="the decode GEMVs' activations: int8 (x quantised "
                                                                   "per 32 to 8 bits and integer dot products, as "
                                                                   "llama.cpp's Q8_0 / Q8_K: faster, results move "
                                                                   "slightly) or fp32; quantised weights on a CPU "
                                                                   "target; default: docs/COMPILER.md")] = None,
):
    """Compile a model with block-wise prefill and in-graph eviction into an artifact directory (TVM)."""
    import time
    import warnings

    from ..budget import parse_budget
    from ..policies import make_policy

    try:
        kv_dtype = parse_kv_dtype(kv_dtype)
        if decode_activations is not None:  # the vocabulary, before the model loads
            from ..compiler.passes.quantize_weights import DECODE_ACTIVATIONS

            decode_activations = decode_activations.strip().lower()
            if decode_activations not in DECODE_ACTIVATIONS:
                fail(f"--decode-activations {decode_activations!r}: use one of {', '.join(DECODE_ACTIVATIONS)}")
        check_output_dir(output)
        check_block(block)
        if compress not in (None, "none"):  # the mode's policy reads the document (a chosen other one is refused)
            from ..policies import compress_policy

            policy = compress_policy(None if policy == DEFAULT_POLICY else policy, compress)
        pol = make_policy(policy, parse_policy_args(policy_arg, policy))
        limit = parse_mem_limit(mem_limit)
        from ..compiler.backend.target import resolve_target

        resolve_target(target)  # an unknown --target is refused before the model loads (a 1.5B loads for minutes)
        say(f"loading {model or 'smollm2-135m'}")
        loaded = load_compile_input(model, tokenizer)
        n = parse_budget(budget, loaded.config, block, kv_dtype=kv_dtype)
        check_static_cache(loaded.config, n, block)
        from ..compiler import compile_model

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
                                       weights=weights, kv_dtype=kv_dtype, question_rows=question_rows,
                                       decode_activations=decode_activations)
            replace_dir(tmp, output)
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        for w in caught:  # re-said with the final directory (the build wrote a staging one)
            err.print(f"[yellow]{w.category.__name__}:[/] {str(w.message).replace(str(tmp), str(output))}")
        manifest = Manifest.from_json(result.manifest)
        table = Table(title=f"edgekv compile · {loaded.model_id} · {policy} · N={n} B={block}")
        table.add_column("item")
        table.add_column("value", justify="right")
        table.add_row("artifact", str(output))
        table.add_row("target", json.dumps(manifest.target.tvm))
        table.add_row("attention sites rewritten", str(manifest.num_layers))
        table.add_row("weights", weights_summary(manifest))
        plan = manifest.memory_plan
        table.add_row("KV cache format", "int8 codes + float16 scales" if kv_dtype == "int8" else "fp32")
        if manifest.question_rows:
            table.add_row("question rows (scoring every block)", str(manifest.question_rows))
        table.add_row("plan: weights / KV cache / activations",
                      f"{human_bytes(plan.weights_bytes)} / {human_bytes(plan.cache_bytes)} / "
                      f"{human_bytes(plan.activation_bytes)}")
        table.add_row("compile time", f"{time.perf_counter() - t0:.1f} s")
        toolchain = manifest.toolchain
        if toolchain:
            table.add_row("device toolchain", str(toolchain.get(Keys.Toolchain.STATUS, "")))
            if toolchain.get(Keys.Toolchain.FINISH):
                table.add_row("finish on a machine with it",
                              str(toolchain[Keys.Toolchain.FINISH]).replace("<artifact dir>", str(output)))
        out.print(table)
    except USER_ERRORS + compiler_errors() as exc:
        fail(exc)


def weights_summary(manifest: Manifest) -> str:
    """``q4 (Q4_1 × 210, Q8_0 × 1, fp32 × 61; 98.9 MiB)`` from an artifact's manifest."""
    W = Keys.Weights
    w = manifest.weights or {W.FORMAT: "fp32"}
    parts = ", ".join(f"{k} × {v}" for k, v in (w.get(W.TENSORS) or {}).items())
    size = f"; {human_bytes(w[W.BYTES])}" if W.BYTES in w else ""
    act = f"; {w[W.DECODE_ACTIVATIONS]} decode activations" if str(w.get(W.DECODE_ACTIVATIONS, "fp32")).startswith("int8") else ""
    return f"{w[W.FORMAT]} ({parts}{size}{act})" if parts else w[W.FORMAT]


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
    if output.is_dir() and any(output.iterdir()) and not is_artifact(output):
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



def load_compile_input(model: str | None, tokenizer: Path | None):
    """What `edgekv compile` compiles: an ONNX file (graph and weights from the file) or a model."""
    from ..compiler.frontend.onnx_import import is_onnx_path
    from ..models import load_model

    if is_onnx_path(model):
        from ..compiler.frontend.onnx_model import load_onnx_model

        return load_onnx_model(model, tokenizer)
    if tokenizer is not None:
        raise InputError("--tokenizer is for an .onnx model; a model name, GGUF file or HF folder brings its own")
    return load_model(model, err, lazy=True)  # a K-quant GGUF's weights stay in the file (no fp32 copy)


def export_onnx_cmd(
    model: Annotated[Optional[str], typer.Argument(help="model name (smollm2-135m), GGUF file or HF directory")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="folder to write model.onnx, config.json and the tokenizer to")] = Path("build/onnx"),
    form: Annotated[str, typer.Option(help="plain: input_ids, position_ids → logits; past: HF/optimum layout with attention_mask and past_key_values inputs")] = "plain",
):
    """Export a decoder to ONNX with torch.onnx.export (the input of `edgekv compile model.onnx`)."""
    from ..models import load_model

    try:
        from ..compiler.frontend.onnx_export import FORMS, export_onnx

        if form not in FORMS:
            raise InputError(f"unknown --form {form!r}; one of {', '.join(FORMS)}")
        from ..evaluation.command import check_output_folder

        check_output_folder(output)
        say(f"loading {model or 'smollm2-135m'}")
        loaded = load_model(model, err)
        with err.status(f"exporting {loaded.model_id} to ONNX ({form})…"):
            path = export_onnx(loaded, output, form)
        out.print(f"wrote {path} (+ config.json, tokenizer); compile it with: edgekv compile {path}")
    except ImportError as exc:
        fail(InputError(f"exporting to ONNX needs `onnx` and `onnxscript` ({exc.name} is missing): "
                         "pip install -e '.[compile]'"))
    except USER_ERRORS as exc:
        fail(exc)
