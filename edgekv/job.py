"""One eager run: prompt → block-wise prefill → decode → report (used by `edgekv run`)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .budget import parse_budget
from .engine import BlockEngine, Sampler
from .errors import InputError
from .memory import peak_rss_bytes, plan_memory
from .models.loaded import LoadedModel
from .policies import make_policy


def check_writable(path: str | os.PathLike | None, what: str = "--output") -> None:
    """Refuse an output file that cannot be written, before any work starts. The test is the
    write itself: a temporary file is created (and removed) in the target's folder, as
    ``write_json_atomic`` will do at the end — permission bits alone do not tell (root, read-only
    file systems, /proc)."""
    if path is None:
        return
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise InputError(f"{what} {p} is a directory; give a file path such as {p / 'report.json'}")
    if parent.exists() and not parent.is_dir():
        raise InputError(f"{what} {p}: {parent} is a file, not a folder; choose another path")
    if not parent.is_dir():
        raise InputError(f"{what} {p}: the folder {parent} does not exist; create it or choose another path")
    if p.exists() and not p.is_file():  # a device such as /dev/null: written in place
        try:
            with open(p, "a"):
                pass
        except OSError as exc:
            raise InputError(f"{what} {p} is not writable ({exc.strerror}); choose a path you can write to") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".check", dir=parent)
        os.close(fd)
        os.unlink(tmp)
        if p.exists():
            with open(p, "a"):
                pass
    except OSError as exc:
        raise InputError(f"{what} {p} is not writable: cannot create a file in {parent} ({exc.strerror or exc}); "
                         "choose a path you can write to") from None


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write via a temporary file and rename, so a failed run never leaves half a file
    (a path that exists and is not a regular file, such as /dev/stdout, is written in place)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_file():
        with open(p, "w") as fh:
            json.dump(data, fh, indent=2)
        return
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


class TextStream:
    """Incremental detokenisation for streamed output: ``push(token)`` returns the new text to
    print. Byte-level tokenizers split one character's UTF-8 bytes over several tokens (猫, emoji):
    text that ends in an incomplete character (decoded as U+FFFD) is held back until the
    character is complete. Only a window of recent tokens is decoded per step (the offsets
    of text-generation-inference's streamer), so the cost does not grow with the output, and the
    output never stops when a later token changes how earlier ones decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # first token of the decode window
        self.read = 0  # tokens already turned into printed text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            new = text[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character stays U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


@dataclass
class RunResult:
    text: str
    generated_ids: list[int]
    report: dict = field(default_factory=dict)


def kv_comparison(cfg, kv_bytes: int, sequence_tokens: int) -> dict:
    """The KV cache a run held next to what the full cache of the same sequence would hold (in
    fp32, the format the model computes in, whatever ``--kv-dtype`` the run stored)."""
    from .memory import kv_cache_bytes

    full = kv_cache_bytes(cfg, sequence_tokens)
    return {"kv_cache": kv_bytes, "full_cache": full, "sequence_tokens": sequence_tokens,
            "saved_fraction": (1 - kv_bytes / full) if full else 0.0}


def eager_engine(model: LoadedModel, policy_name: str, policy_args: dict, budget: str, block: int,
                 max_tokens: int | None, mem_limit: int | None, question_rows: int = 0, kv_dtype: str = "fp32"):
    """The engine of a run and its memory plan, checked against ``mem_limit`` and the machine
    before the caches are allocated. ``max_tokens`` (prompt + output) bounds the caches; None
    gives them their full N + B, as a saved document cache needs for any later question.
    ``question_rows``: room for a question scoring the blocks (a query-aware policy's).
    ``kv_dtype``: the caches' K/V format (``--kv-dtype``); a byte budget and the plan count it."""
    from .memory import cache_capacity, check_plan

    n_budget = parse_budget(budget, model.config, block, kv_dtype=kv_dtype)
    policy = make_policy(policy_name, policy_args)
    policy.check_budget(n_budget, block)
    question_rows = question_rows if policy.uses_question else 0
    capacity = cache_capacity(n_budget, block, max(int(getattr(policy, "max_extra_tokens", 0)), question_rows),
                              max_tokens)
    plan = plan_memory(model.config, model.weight_bytes, capacity, block, len(policy.entry_state), kv_dtype=kv_dtype)
    check_plan(plan, mem_limit=mem_limit, resident=model.weight_bytes,
               hint="lower --budget or --block, or shorten the prompt"
               + ("" if kv_dtype == "int8" else ", or store the cache in int8 (--kv-dtype int8)"))
    return BlockEngine(model, policy, n_budget, block, max_tokens=max_tokens, question_rows=question_rows,
                       kv_dtype=kv_dtype), plan


def run_eager(model: LoadedModel, prompt_ids: torch.Tensor, *, policy_name: str, policy_args: dict,
              budget: str, block: int, max_new_tokens: int, sampler: Sampler, on_token=None,
              progress=None, mem_limit: int | None = None, on_phase=None, kv_dtype: str = "fp32") -> RunResult:
    """``edgekv run`` on the eager engine. The caches hold no more than prompt + output needs
    (``memory.cache_capacity``) and the memory plan is checked against ``mem_limit`` and the
    memory the machine has left before they are allocated. ``on_phase(name)`` is called when
    prefill and decode start. ``kv_dtype``: ``--kv-dtype``."""
    n_prompt = int(prompt_ids.numel())
    engine, plan = eager_engine(model, policy_name, policy_args, budget, block, n_prompt + max_new_tokens, mem_limit,
                                kv_dtype=kv_dtype)
    policy, n_budget = engine.policy, engine.budget
    eos = tuple(i for i in [getattr(model.tokenizer, "eos_token_id", None)] if i is not None)
    t0 = time.perf_counter()
    first = [True]

    def token_cb(token: int) -> None:
        if first[0] and on_phase is not None:
            on_phase("decode")
        first[0] = False
        if on_token is not None:
            on_token(token)

    if on_phase is not None:
        on_phase("prefill")
    ids = engine.generate(prompt_ids, max_new_tokens, sampler, eos_ids=eos, on_token=token_cb, progress=progress)
    wall = time.perf_counter() - t0
    s = engine.stats
    text = model.tokenizer.decode(ids, skip_special_tokens=True) if model.tokenizer is not None else ""
    from .threads import threads_in_use

    report = {
        "engine": "eager",
        "model": model.model_id,
        "weight_sha256": model.weight_hash,
        "policy": policy_name,
        "policy_params": policy.params(),
        "budget_tokens": n_budget,
        "block": block,
        "kv_dtype": engine.kv_dtype,
        "cache_capacity": engine.capacity,
        "prompt_tokens": n_prompt,
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
            "vs_full_cache": kv_comparison(model.config, plan.kv_cache, n_prompt + len(ids)),
        },
        "text": text,
        "generated_ids": list(ids),
        "torch_threads": torch.get_num_threads(),
        "threads": threads_in_use(),
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


def open_artifact(path, *, mem_limit: int | None = None, runtime: str = "auto",
                  threads: int | None = None) -> tuple[object, ArtifactModel]:
    """Load a compiled artifact for ``edgekv run ARTIFACT`` and describe its model: refuses a corrupt
    or mismatched one, one compiled for another target (before anything tries to load it), and one
    whose memory plan does not fit ``mem_limit`` or the machine (before its caches are allocated).
    This is the one place that picks the runtime that runs an artifact: ``native`` (the C runtime,
    no TVM in the process), ``tvm`` (HostRuntime, TVM's Relax VM) or ``auto`` — native when it is
    built and the artifact carries a program."""
    from .artifact import PROGRAM_FILE
    from .artifact_target import artifact_runs_here, device_artifact_message
    from .memory import MemoryPlan, check_plan
    from .models.config import ModelConfig
    from .runtime import ArtifactError, read_manifest
    from .runtime import native

    if runtime not in RUNTIMES:
        raise InputError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    manifest = read_manifest(path)
    if not artifact_runs_here(manifest):
        raise ArtifactError(device_artifact_message(path, manifest))
    mp = manifest.get("memory_plan") or {}
    if mp:
        check_plan(MemoryPlan(weights=int(mp["weights_bytes"]), kv_cache=int(mp["cache_bytes"]),
                              activations=int(mp["activation_bytes"])), mem_limit=mem_limit,
                   hint="the plan is fixed at compile time: recompile with a lower --budget or --block")
    has_program = (Path(path) / PROGRAM_FILE).is_file()
    from .artifact_target import needs_native_device

    if needs_native_device(manifest):  # OpenCL: TVM's Python runtime has no OpenCL device
        if runtime == "tvm":
            raise InputError(f"{path} runs on OpenCL, which TVM's Python runtime (--runtime tvm) does not have: run it "
                             "with --runtime native (the default)")
        runtime = "native"
    if runtime == "native" or (runtime == "auto" and native.available() and has_program):
        if not has_program:
            raise InputError(f"{path} has no {PROGRAM_FILE} for the native runtime; recompile it with this edgekv, "
                             "or run it with --runtime tvm")
        try:
            rt = native.NativeRuntime(path, threads=threads, mem_limit=mem_limit)
        except native.NativeRuntimeMissing as exc:
            raise InputError(str(exc)) from None
    else:
        from .runtime import HostRuntime

        rt = HostRuntime(path)
    model = manifest["model"]
    return rt, ArtifactModel(model_id=model["id"], config=ModelConfig(**model["config"]), tokenizer=rt.tokenizer,
                             chat=bool(model.get("chat")))


def check_artifact_settings(path, manifest: dict, *, policy: str | None, policy_args: dict[str, str] | None,
                            budget: str | None, block: int | None) -> None:
    """The rule for options that a compiled artifact fixes at compile time (policy, its arguments,
    budget, block): an option the user gave must equal the artifact's value — then it is
    accepted — and any that differs is refused, naming the artifact's settings."""
    from .policies import make_policy

    fixed_policy = manifest["policy"]["name"]
    fixed_params = dict(manifest["policy"].get("params") or {})
    fixed_budget, fixed_block = int(manifest["budget"]), int(manifest["block"])
    differs = []
    if policy is not None and policy != fixed_policy:
        differs.append(f"--policy {policy}")
    if block is not None and int(block) != fixed_block:
        differs.append(f"--block {block}")
    if budget is not None:
        from .models.config import ModelConfig

        n = parse_budget(budget, ModelConfig(**manifest["model"]["config"]), fixed_block,
                         kv_dtype=manifest.get("kv_dtype", "fp32"))  # bytes buy entries of the artifact's format
        if n != fixed_budget:
            differs.append(f"--budget {budget}" + (f" ({n} tokens)" if str(n) != str(budget).strip() else ""))
    if policy_args:
        given = make_policy(policy or fixed_policy, policy_args).params() if (policy or fixed_policy) else {}
        for key in policy_args:
            if key in given and given[key] != fixed_params.get(key):
                differs.append(f"--policy-arg {key}={policy_args[key]}")
    if differs:
        args = "".join(f" --policy-arg {k}={v}" for k, v in fixed_params.items())
        raise InputError(
            f"{path} was compiled with --policy {fixed_policy} --budget {fixed_budget} --block {fixed_block}"
            f"{args}; {', '.join(differs)} differ{'s' if len(differs) == 1 else ''}. A compiled artifact's settings "
            f"are fixed: drop the option{'s' if len(differs) > 1 else ''} (or give the artifact's own value), "
            f"or recompile with `edgekv compile MODEL ... -o DIR`")


def run_compiled(rt, described: ArtifactModel, prompt_ids: torch.Tensor, *, max_new_tokens: int, sampler: Sampler,
                 on_token=None, progress=None, on_phase=None) -> RunResult:
    """The compiled counterpart of ``run_eager``: same report keys, measured by the runtime."""
    from .threads import threads_in_use

    first = [True]
    user_on_token = on_token

    def on_token(token: int) -> None:  # noqa: F811 - wraps the caller's callback
        if first[0] and on_phase is not None:
            on_phase("decode")
        first[0] = False
        if user_on_token is not None:
            user_on_token(token)

    if on_phase is not None:
        on_phase("prefill")
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
        "artifact": str(rt.path),
        "target": rt.manifest["target"],
        "model": described.model_id,
        "weight_sha256": rt.manifest["model"]["weight_hash"],
        "policy": rt.manifest["policy"]["name"],
        "policy_params": rt.manifest["policy"]["params"],
        "budget_tokens": rt.budget,
        "block": rt.block,
        "kv_dtype": rt.manifest.get("kv_dtype", "fp32"),
        "prompt_tokens": int(prompt_ids.numel()),
        "generated_tokens": len(ids),
        "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else None,
        "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else None,
        "prefill_seconds": s.prefill_seconds,
        "decode_seconds": s.decode_seconds,
        "wall_seconds": wall,
        "cache_lengths": rt.cache_lengths(),
        "device": rt.info["device"] if native else "cpu",
        "memory": {
            "plan": _compiled_plan(rt),
            "peak_rss": max(s.peak_rss_bytes, peak_rss_bytes()),
            **({"device_peak": int(s.device_bytes_peak)} if native and s.device_bytes_peak else {}),
            "vs_full_cache": kv_comparison(described.config, plan["cache_bytes"], int(prompt_ids.numel()) + len(ids)),
        },
        "text": text,
        "generated_ids": list(ids),
        "threads": {**threads_in_use(), **({"native": rt.threads} if native else {})},
    }
    return RunResult(text=text, generated_ids=ids, report=report)


# ---- a document read once, questions answered from its state (edgekv/document.py) ----------------

def document_report(doc, tokenizer, cfg, kv_bytes: int) -> dict:
    """The report keys a one-shot run has, for a document run (the document is the prompt; the
    answers are the output), plus the document's own section. Fills each answer's text."""
    answers = doc.answers
    for a in answers:
        a.text = tokenizer.decode(a.generated_ids, skip_special_tokens=True) if tokenizer is not None else ""
    decoded = sum(max(0, len(a.generated_ids) - 1) for a in answers)
    decode_s = sum(a.decode_seconds for a in answers)
    longest = max((a.question_tokens + len(a.generated_ids) for a in answers), default=0)
    return {
        "prompt_tokens": doc.document_tokens,
        "generated_tokens": sum(len(a.generated_ids) for a in answers),
        "prefill_tok_s": doc.document_tokens / doc.prefill_seconds if doc.prefill_seconds else None,
        "decode_tok_s": decoded / decode_s if decode_s else None,
        "prefill_seconds": doc.prefill_seconds,
        "decode_seconds": decode_s,
        "text": "\n\n".join(a.text for a in answers),
        "vs_full_cache": kv_comparison(cfg, kv_bytes, doc.document_tokens + longest),
        "document": doc.to_dict(),
    }


def run_eager_document(model: LoadedModel, document_ids, questions, *, policy_name: str, policy_args: dict,
                       budget: str, block: int, max_new_tokens: int, new_sampler, chat: bool = False,
                       save_cache=None, load_cache=None, made_from: str = "", on_token=None, on_question=None,
                       progress=None, mem_limit: int | None = None, on_warning=None,
                       kv_dtype: str = "fp32") -> RunResult:
    """``edgekv run MODEL --question ...`` / ``--save-cache`` / ``--load-cache`` on the eager engine.
    The caches get their full N + B (a saved state must take any later question). A query-aware
    policy reads the document knowing each question (``document.run_document``, question scoring)."""
    from .document import run_document
    from .threads import threads_in_use

    longest = max((len(ids) for _, ids in questions), default=0)
    engine, plan = eager_engine(model, policy_name, policy_args, budget, block, None, mem_limit,
                                question_rows=longest if document_ids is not None else 0, kv_dtype=kv_dtype)
    eos = tuple(i for i in [getattr(model.tokenizer, "eos_token_id", None)] if i is not None)
    scoring = engine.policy.uses_question and document_ids is not None and bool(questions)
    doc = run_document(engine, document_ids=document_ids, questions=questions, new_sampler=new_sampler,
                       max_new_tokens=max_new_tokens, eos_ids=eos, chat=chat, save_cache=save_cache,
                       load_cache=load_cache, made_from=made_from, progress=progress, on_token=on_token,
                       on_question=on_question, question_scoring=scoring, on_warning=on_warning)
    fields = document_report(doc, model.tokenizer, model.config, plan.kv_cache)
    report = {
        "engine": "eager", "model": model.model_id, "weight_sha256": model.weight_hash, "policy": policy_name,
        "policy_params": engine.policy.params(), "budget_tokens": engine.budget, "block": block,
        "kv_dtype": engine.kv_dtype, "cache_capacity": engine.capacity,
        **{k: v for k, v in fields.items() if k != "vs_full_cache"},
        "question_scoring": scoring,
        "eviction_events": engine.stats.eviction_events, "cache_lengths": engine.cache_lengths(),
        "memory": {"plan": plan.to_dict(), "kv_cache_allocated": engine.kv_bytes, "peak_rss": peak_rss_bytes(),
                   "vs_full_cache": fields["vs_full_cache"]},
        "torch_threads": torch.get_num_threads(), "threads": threads_in_use(),
    }
    return RunResult(text=report["text"], generated_ids=[t for a in doc.answers for t in a.generated_ids],
                     report=report)


def run_compiled_document(rt, described: ArtifactModel, document_ids, questions, *, max_new_tokens: int,
                          new_sampler, chat: bool = False, save_cache=None, load_cache=None, on_token=None,
                          on_question=None, progress=None, on_warning=None) -> RunResult:
    """The compiled counterpart of ``run_eager_document`` (HostRuntime or the native runtime). An
    artifact compiled with ``--question-rows`` reads the document once per question, knowing it,
    as the eager engine does (``question_scoring``); one compiled without scores with the blocks'
    own rows (the caller warns). A question longer than the artifact's rows is refused before any
    reading, with the fix."""
    from .document import run_document
    from .errors import InputError
    from .threads import threads_in_use

    q_rows = int(rt.manifest.get("question_rows", 0))
    scoring = q_rows > 0 and document_ids is not None and bool(questions)
    longest = max((len(ids) for _, ids in questions), default=0)
    if scoring and longest > q_rows:
        raise InputError(f"a --question has {longest} tokens and the artifact {rt.path} was compiled for questions "
                         f"of at most {q_rows}; shorten it, or compile again with --question-rows {longest} or more")
    eos = tuple(i for i in [getattr(described.tokenizer, "eos_token_id", None)] if i is not None)
    doc = run_document(rt, document_ids=None if document_ids is None else np.asarray(document_ids),
                       questions=questions, new_sampler=lambda: _numpy_sampler(new_sampler()),
                       max_new_tokens=max_new_tokens, eos_ids=eos, chat=chat, save_cache=save_cache,
                       load_cache=load_cache, progress=progress, on_token=on_token, on_question=on_question,
                       question_scoring=scoring, on_warning=on_warning)
    plan = rt.manifest["memory_plan"]
    native = hasattr(rt, "memory_plan")
    fields = document_report(doc, described.tokenizer, described.config, plan["cache_bytes"])
    report = {
        "engine": "compiled", "runtime": "native" if native else "tvm", "artifact": str(rt.path),
        "target": rt.manifest["target"], "model": described.model_id,
        "weight_sha256": rt.manifest["model"]["weight_hash"], "policy": rt.manifest["policy"]["name"],
        "policy_params": rt.manifest["policy"]["params"], "budget_tokens": rt.budget, "block": rt.block,
        "kv_dtype": rt.manifest.get("kv_dtype", "fp32"), "question_scoring": scoring, "question_rows": q_rows,
        **{k: v for k, v in fields.items() if k != "vs_full_cache"}, "cache_lengths": rt.cache_lengths(),
        "memory": {"plan": _compiled_plan(rt), "peak_rss": max(rt.stats.peak_rss_bytes, peak_rss_bytes()),
                   "vs_full_cache": fields["vs_full_cache"]},
        "threads": {**threads_in_use(), **({"native": rt.threads} if native else {})},
    }
    return RunResult(text=report["text"], generated_ids=[t for a in doc.answers for t in a.generated_ids],
                     report=report)


def _numpy_sampler(sampler):
    return lambda logits: sampler(torch.from_numpy(logits))


def _compiled_plan(rt) -> dict:
    """The plan of a compiled run: the native runtime's own (exact), else the manifest's."""
    if hasattr(rt, "memory_plan"):
        return rt.memory_plan()
    plan = rt.manifest["memory_plan"]
    return {"weights": plan["weights_bytes"], "kv_cache": plan["cache_bytes"],
            "activations": plan["activation_bytes"], "total": plan["total_bytes"]}
