"""One eager run: prompt → block-wise prefill → decode → report (used by `edgekv run`)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .budget import parse_budget
from .engine import BlockEngine, Sampler
from .errors import InputError
from .memory import peak_rss_bytes, plan_memory
from .models.loaded import LoadedModel
from .policies import make_policy


def check_writable(path: str | os.PathLike | None, what: str = "--report") -> None:
    """Refuse an unwritable output path before any work starts."""
    if path is None:
        return
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise InputError(f"{what} {p} is a directory; give a file path such as {p / 'report.json'}")
    if not parent.is_dir():
        raise InputError(f"{what} {p}: the folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{what} {p} is not writable; choose a path you can write to")


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write via a temporary file and rename, so a failed run never leaves half a file."""
    p = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is an ordinary file
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def encode_prompt(model: LoadedModel, text: str, chat: bool) -> torch.Tensor:
    if not text or not text.strip():
        raise InputError("the prompt is empty; pass --prompt TEXT or --prompt-file FILE with some text")
    tok = model.tokenizer
    if tok is None:
        raise InputError(f"model {model.model_id} has no tokenizer; use a GGUF or an HF directory with tokenizer files")
    if chat:
        if not getattr(tok, "chat_template", None):
            raise InputError(f"--chat: model {model.model_id} has no chat template; run without --chat")
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tok(text)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def check_context(model: LoadedModel, prompt_tokens: int, max_new: int, allow_beyond: bool) -> None:
    limit = model.config.max_position
    if prompt_tokens + max_new > limit and not allow_beyond:
        raise InputError(
            f"prompt ({prompt_tokens} tokens) + output ({max_new}) = {prompt_tokens + max_new} tokens is past "
            f"{model.model_id}'s trained context of {limit}. Eviction keeps memory bounded at any length, but "
            f"positions past {limit} degrade quality: shorten the prompt, or opt in with --allow-beyond-context"
        )


@dataclass
class RunResult:
    text: str
    generated_ids: list[int]
    report: dict = field(default_factory=dict)


def run_eager(model: LoadedModel, prompt_ids: torch.Tensor, *, policy_name: str, policy_args: dict,
              budget: str, block: int, max_new_tokens: int, sampler: Sampler, on_token=None,
              progress=None) -> RunResult:
    n_budget = parse_budget(budget, model.config, block)
    policy = make_policy(policy_name, policy_args)
    engine = BlockEngine(model, policy, n_budget, block)
    plan = plan_memory(model.config, model.weight_bytes, engine.capacity, block, len(policy.entry_state))
    eos = tuple(i for i in [getattr(model.tokenizer, "eos_token_id", None)] if i is not None)
    t0 = time.perf_counter()
    ids = engine.generate(prompt_ids, max_new_tokens, sampler, eos_ids=eos, on_token=on_token, progress=progress)
    wall = time.perf_counter() - t0
    s = engine.stats
    text = model.tokenizer.decode(ids, skip_special_tokens=True) if model.tokenizer is not None else ""
    report = {
        "engine": "eager",
        "model": model.model_id,
        "weight_sha256": model.weight_hash,
        "policy": policy_name,
        "policy_params": policy.params(),
        "budget_tokens": n_budget,
        "block": block,
        "prompt_tokens": int(prompt_ids.numel()),
        "generated_tokens": len(ids),
        "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else None,
        "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else None,
        "prefill_seconds": s.prefill_seconds,
        "decode_seconds": s.decode_seconds,
        "wall_seconds": wall,
        "eviction_events": s.eviction_events,
        "cache_lengths": engine.cache_lengths(),
        "memory": {
            "plan": plan.to_dict(),
            "kv_cache_allocated": engine.kv_bytes,
            "peak_rss": peak_rss_bytes(),
        },
        "text": text,
        "torch_threads": torch.get_num_threads(),
    }
    return RunResult(text=text, generated_ids=ids, report=report)


@dataclass
class ArtifactModel:
    """What prompt encoding and the context check need from a compiled artifact."""

    model_id: str
    config: object
    tokenizer: object
    chat: bool


RUNTIMES = ("auto", "native", "tvm")


def open_artifact(path, *, runtime: str = "auto", threads: int | None = None) -> tuple[object, ArtifactModel]:
    """Load a compiled artifact (refusing a corrupt or mismatched one) and describe its model.

    ``runtime``: ``native`` (the C runtime, no TVM in the process), ``tvm`` (HostRuntime, TVM's
    Relax VM) or ``auto`` — native when it is built and the artifact carries a program."""
    from .artifact import PROGRAM_FILE, read_manifest
    from .models.config import ModelConfig
    from .runtime import native

    if runtime not in RUNTIMES:
        raise InputError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    manifest = read_manifest(path)
    has_program = (Path(path) / PROGRAM_FILE).is_file()
    use_native = runtime == "native" or (runtime == "auto" and native.available() and has_program)
    if use_native:
        if not has_program:
            raise InputError(f"{path} has no {PROGRAM_FILE} for the native runtime; recompile it with this edgekv, "
                             "or run it with --runtime tvm")
        try:
            rt = native.NativeRuntime(path, threads=threads)
        except native.NativeRuntimeMissing as exc:
            raise InputError(str(exc)) from None
    else:
        from .runtime import HostRuntime

        rt = HostRuntime(path)
    model = manifest["model"]
    return rt, ArtifactModel(model_id=model["id"], config=ModelConfig(**model["config"]), tokenizer=rt.tokenizer,
                             chat=bool(model.get("chat")))


def run_compiled(rt, described: ArtifactModel, prompt_ids: torch.Tensor, *, max_new_tokens: int, sampler: Sampler,
                 on_token=None, progress=None) -> RunResult:
    """The compiled counterpart of ``run_eager``: same report keys, measured by the host runtime."""
    eos = tuple(i for i in [getattr(described.tokenizer, "eos_token_id", None)] if i is not None)
    t0 = time.perf_counter()
    ids = rt.generate(prompt_ids.numpy(), max_new_tokens, sampler=lambda logits: sampler(torch.from_numpy(logits)),
                      eos_ids=eos, on_token=on_token, progress=progress)
    wall = time.perf_counter() - t0
    s = rt.stats
    plan = rt.manifest["memory_plan"]
    text = described.tokenizer.decode(ids, skip_special_tokens=True) if described.tokenizer is not None else ""
    native = hasattr(rt, "memory_plan")
    report = {
        "engine": "compiled",
        "runtime": "native" if native else "tvm",
        "threads": getattr(rt, "threads", None),
        "artifact": str(rt.path),
        "target": rt.manifest["target"],
        "model": described.model_id,
        "weight_sha256": rt.manifest["model"]["weight_hash"],
        "policy": rt.manifest["policy"]["name"],
        "policy_params": rt.manifest["policy"]["params"],
        "budget_tokens": rt.budget,
        "block": rt.block,
        "prompt_tokens": int(prompt_ids.numel()),
        "generated_tokens": len(ids),
        "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else None,
        "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else None,
        "prefill_seconds": s.prefill_seconds,
        "decode_seconds": s.decode_seconds,
        "wall_seconds": wall,
        "cache_lengths": rt.cache_lengths(),
        "memory": {
            "plan": rt.memory_plan() if native else {
                "weights": plan["weights_bytes"], "kv_cache": plan["cache_bytes"],
                "activations": plan["activation_bytes"], "total": plan["total_bytes"]},
            "peak_rss": max(s.peak_rss_bytes, peak_rss_bytes()),
        },
        "text": text,
    }
    return RunResult(text=text, generated_ids=ids, report=report)
