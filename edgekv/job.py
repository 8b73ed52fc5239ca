"""One run of `edgekv run` / `edgekv ask`: encode the prompt, open a ``Session`` (the eager engine,
or a compiled artifact in the native runtime or TVM's VM), run it (``run``: a prompt, or a document
and its questions) and build its report (``edgekv/run_report.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .budget import parse_budget
from .document import run_document
from .engine import Sampler
from .engine.session import open_eager_session
from .errors import InputError
from .models.loaded import LoadedModel
# the CLI imports its output-file helpers from here until it moves onto edgekv.output_files
from .output_files import check_writable, write_json_atomic  # noqa: F401
from .run_report import build_report
from .session import Session, generate


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


@dataclass
class ArtifactModel:
    """What prompt encoding and the context check need from a compiled artifact."""

    model_id: str
    config: object
    tokenizer: object
    chat: bool


RUNTIMES = ("auto", "native", "tvm")


def open_artifact(path, *, mem_limit: int | None = None, runtime: str = "auto",
                  threads: int | None = None) -> tuple[Session, ArtifactModel]:
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


# ---- the one run path: any Session, a prompt or a document with its questions ------------------

def _eos_ids(tokenizer) -> tuple[int, ...]:
    return tuple(i for i in [getattr(tokenizer, "eos_token_id", None)] if i is not None)


def _torch_sampler(sampler):
    """A ``Sampler`` (torch) over a session's own logits: torch from the eager engine (taken as
    they are), numpy from the compiled runtimes (shared, not copied)."""
    return lambda logits: sampler(torch.as_tensor(logits))


def run(session: Session, model, *, prompt_ids=None, document_ids=None, questions=None, max_new_tokens: int,
        new_sampler, on_token=None, progress=None, on_phase=None, chat: bool = False, save_cache=None,
        load_cache=None, made_from: str = "", on_question=None, on_warning=None) -> RunResult:
    """Run ``session`` and report. ``model``: what encoded the input (a LoadedModel or an
    ArtifactModel: its tokenizer and config). ``new_sampler()``: a fresh ``Sampler`` (one per
    answer, so a seeded answer does not depend on the ones before it).

    Without ``questions`` (None): one prompt, ``prompt_ids``, then up to ``max_new_tokens``;
    ``on_token(token)`` streams them and ``on_phase(name)`` is called when prefill and decode start.

    With ``questions`` ([(text, question-part ids)], possibly empty with ``save_cache``): a document
    run (``document.run_document``): ``document_ids`` read once (None: ``load_cache`` holds it),
    ``on_question(i, text)`` before question i and ``on_token(i, token)`` for its answer. A session
    whose blocks score with a question's rows (a query-aware eager policy, an artifact compiled with
    ``--question-rows``) reads the document once per question, knowing it."""
    eos = _eos_ids(model.tokenizer)
    if questions is None:
        first = [True]

        def token_cb(token: int) -> None:
            if first[0] and on_phase is not None:
                on_phase("decode")
            first[0] = False
            if on_token is not None:
                on_token(token)

        if on_phase is not None:
            on_phase("prefill")
        t0 = time.perf_counter()
        ids = generate(session, prompt_ids, _torch_sampler(new_sampler()), max_new_tokens, eos_ids=eos,
                       on_token=token_cb, progress=progress)
        wall = time.perf_counter() - t0
        report = build_report(session, model, prompt_tokens=int(torch.as_tensor(prompt_ids).numel()),
                              generated_ids=ids, wall_seconds=wall)
        return RunResult(text=report["text"], generated_ids=ids, report=report)

    scoring = session.question_rows > 0 and document_ids is not None and bool(questions)
    longest = max((len(ids) for _, ids in questions), default=0)
    if scoring and longest > session.question_rows:  # an eager session is opened with room for the longest
        raise InputError(f"a --question has {longest} tokens and the artifact {session.describe().get('artifact')} "
                         f"was compiled for questions of at most {session.question_rows}; shorten it, or compile "
                         f"again with --question-rows {longest} or more")
    doc = run_document(session, document_ids=document_ids, questions=questions,
                       new_sampler=lambda: _torch_sampler(new_sampler()), max_new_tokens=max_new_tokens,
                       eos_ids=eos, chat=chat, save_cache=save_cache, load_cache=load_cache, made_from=made_from,
                       progress=progress, on_token=on_token, on_question=on_question, question_scoring=scoring,
                       on_warning=on_warning)
    report = build_report(session, model, document=doc, question_scoring=scoring)
    return RunResult(text=report["text"], generated_ids=[t for a in doc.answers for t in a.generated_ids],
                     report=report)


# ---- the entry points the CLI calls: open the session, then ``run`` ----------------------------

def run_eager(model: LoadedModel, prompt_ids: torch.Tensor, *, policy_name: str, policy_args: dict,
              budget: str, block: int, max_new_tokens: int, sampler: Sampler, on_token=None,
              progress=None, mem_limit: int | None = None, on_phase=None, kv_dtype: str = "fp32") -> RunResult:
    """``edgekv run`` on the eager engine. The caches hold no more than prompt + output needs
    (``memory.cache_capacity``) and the memory plan is checked against ``mem_limit`` and the
    memory the machine has left before they are allocated. ``kv_dtype``: ``--kv-dtype``."""
    session = open_eager_session(model, policy_name, policy_args, budget, block,
                                 int(prompt_ids.numel()) + max_new_tokens, mem_limit, kv_dtype=kv_dtype)
    return run(session, model, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, new_sampler=lambda: sampler,
               on_token=on_token, progress=progress, on_phase=on_phase)


def run_compiled(rt, described: ArtifactModel, prompt_ids: torch.Tensor, *, max_new_tokens: int, sampler: Sampler,
                 on_token=None, progress=None, on_phase=None) -> RunResult:
    """The compiled counterpart of ``run_eager`` (``rt`` from ``open_artifact``)."""
    return run(rt, described, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, new_sampler=lambda: sampler,
               on_token=on_token, progress=progress, on_phase=on_phase)


def run_eager_document(model: LoadedModel, document_ids, questions, *, policy_name: str, policy_args: dict,
                       budget: str, block: int, max_new_tokens: int, new_sampler, chat: bool = False,
                       save_cache=None, load_cache=None, made_from: str = "", on_token=None, on_question=None,
                       progress=None, mem_limit: int | None = None, on_warning=None,
                       kv_dtype: str = "fp32") -> RunResult:
    """``edgekv run MODEL --question ...`` / ``--save-cache`` / ``--load-cache`` on the eager engine.
    The caches get their full N + B (a saved state must take any later question), and room for the
    longest question's rows when a query-aware policy reads the document knowing it."""
    longest = max((len(ids) for _, ids in questions), default=0)
    session = open_eager_session(model, policy_name, policy_args, budget, block, None, mem_limit,
                                 question_rows=longest if document_ids is not None else 0, kv_dtype=kv_dtype)
    return run(session, model, document_ids=document_ids, questions=questions, max_new_tokens=max_new_tokens,
               new_sampler=new_sampler, chat=chat, save_cache=save_cache, load_cache=load_cache,
               made_from=made_from, on_token=on_token, on_question=on_question, progress=progress,
               on_warning=on_warning)


def run_compiled_document(rt, described: ArtifactModel, document_ids, questions, *, max_new_tokens: int,
                          new_sampler, chat: bool = False, save_cache=None, load_cache=None, on_token=None,
                          on_question=None, progress=None, on_warning=None) -> RunResult:
    """The compiled counterpart of ``run_eager_document`` (HostRuntime or the native runtime). An
    artifact compiled with ``--question-rows`` reads the document once per question, knowing it,
    as the eager engine does; one compiled without scores with the blocks' own rows (the caller
    warns). A question longer than the artifact's rows is refused before any reading."""
    return run(rt, described, document_ids=document_ids, questions=questions, max_new_tokens=max_new_tokens,
               new_sampler=new_sampler, chat=chat, save_cache=save_cache, load_cache=load_cache,
               on_token=on_token, on_question=on_question, progress=progress, on_warning=on_warning)
