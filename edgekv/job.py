"""One run of `edgekv run` / `edgekv ask`: encode the prompt, open a ``Session`` (the eager engine,
or a compiled artifact in the native runtime or TVM's VM), run it (``run``: a prompt, or a document
and its questions) and build its report (``edgekv/run_report.py``).

A command assembles a run in two calls: ``plan_run`` turns its parsed options (``RunSettings``)
into a ``RunPlan`` — the saved document's settings where it decides them, the artifact's checked
— and ``run_plan`` opens the session, feeds it and saves the report, telling a ``RunConsole``
what happens (the CLI prints it; the defaults say nothing)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .artifact import Manifest
from .budget import DEFAULT_BLOCK, DEFAULT_BUDGET, parse_budget
from .document import run_document
from .engine.session import open_eager_session
from .errors import InputError
from .models.loaded import LoadedModel
from .output_files import write_json_atomic
from .policies import DEFAULT_POLICY
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
                  threads: int | None = None, verify: str = "default") -> tuple[Session, ArtifactModel]:
    """Load a compiled artifact for ``edgekv run ARTIFACT`` and describe its model: refuses a corrupt
    or mismatched one, one compiled for another target (before anything tries to load it), and one
    whose memory plan does not fit ``mem_limit`` or the machine (before its caches are allocated).
    This is the one place that picks the runtime that runs an artifact: ``native`` (the C runtime,
    no TVM in the process), ``tvm`` (HostRuntime, TVM's Relax VM) or ``auto`` — native when it is
    built and the artifact carries a program. ``verify``: the weights' checksums at open, by either
    runtime (``default``: checked, or trusted from a stamp of an earlier check of the same file;
    ``always``; ``off``: ``--no-verify``)."""
    from .artifact import PROGRAM_FILE, ArtifactError
    from .artifact_target import artifact_runs_here, device_artifact_message
    from .memory import MemoryPlan, check_plan
    from .models.config import ModelConfig
    from .runtime import native

    if runtime not in RUNTIMES:
        raise InputError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    manifest = Manifest.read(path)
    if not artifact_runs_here(manifest):
        raise ArtifactError(device_artifact_message(path, manifest))
    mp = manifest.memory_plan
    if mp is not None:
        check_plan(MemoryPlan(weights=int(mp.weights_bytes), kv_cache=int(mp.cache_bytes),
                              activations=int(mp.activation_bytes)), mem_limit=mem_limit,
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
            rt = native.NativeRuntime(path, threads=threads, mem_limit=mem_limit, verify=verify)
        except native.NativeRuntimeMissing as exc:
            raise InputError(str(exc)) from None
    else:
        from .runtime import HostRuntime

        rt = HostRuntime(path, verify=verify)
    return rt, ArtifactModel(model_id=manifest.model_id, config=ModelConfig(**manifest.model_config),
                             tokenizer=rt.tokenizer, chat=manifest.chat)


def check_artifact_settings(path, manifest: Manifest, *, policy: str | None, policy_args: dict[str, str] | None,
                            budget: str | None, block: int | None) -> None:
    """The rule for options that a compiled artifact fixes at compile time (policy, its arguments,
    budget, block): an option the user gave must equal the artifact's value — then it is
    accepted — and any that differs is refused, naming the artifact's settings."""
    from .policies import make_policy

    fixed_policy = manifest.policy_name
    fixed_params = dict(manifest.policy_params)
    fixed_budget, fixed_block = int(manifest.budget), int(manifest.block)
    differs = []
    if policy is not None and policy != fixed_policy:
        differs.append(f"--policy {policy}")
    if block is not None and int(block) != fixed_block:
        differs.append(f"--block {block}")
    if budget is not None:
        from .models.config import ModelConfig

        n = parse_budget(budget, ModelConfig(**manifest.model_config), fixed_block,
                         kv_dtype=manifest.kv_dtype)  # bytes buy entries of the artifact's format
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


# ---- a run assembled from a command's settings: which session, plain or document, its report -----

@dataclass
class RunSettings:
    """`edgekv run` / `edgekv ask` with its options parsed and checked one by one: what to open
    (``model``: a model or an artifact; ``load_cache``: a saved document) and what to feed it."""

    model: str | None
    text: str | None  # the prompt, or the document (None: --load-cache holds it)
    chat: bool | None = None  # None: not given (the saved document's form, else without)
    questions: list[str] = field(default_factory=list)
    save_cache: Path | None = None
    load_cache: Path | None = None
    budget: str | None = None
    block: int | None = None
    policy: str | None = None
    policy_arg: list[str] | None = None  # --policy-arg pairs, as given
    kv_dtype: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    mem_limit: int | None = None
    allow_beyond_context: bool = False
    runtime: str = "auto"
    output: Path | None = None  # the report's file
    verify: str = "default"  # an artifact's weights: checked at open ("off": --no-verify)
    compress: str | None = None  # --compress: a document compression mode, which reads with its own policy

    @property
    def document(self) -> bool:
        """A document run: questions answered from one reading, or a reading saved for later."""
        return bool(self.questions) or self.save_cache is not None or self.load_cache is not None


@dataclass
class RunPlan:
    """``RunSettings`` resolved: ``settings`` with the model, chat form, N, B, policy and K/V format
    the run uses (an artifact's stay its own), the policy's arguments, the saved document's
    header (``saved``), and whether the document is read knowing the questions."""

    settings: RunSettings
    artifact: bool
    policy_args: dict = field(default_factory=dict)
    saved: dict | None = None
    question_scoring: bool = False


class RunConsole:
    """What a run tells whoever started it. This one says nothing; the CLI's prints.
    ``log``: the console the model loader reports on (None: its own)."""

    log = None

    def say(self, message: str) -> None:
        """One line per phase."""

    def warn(self, message: str) -> None:
        """Something the user may want to change, not an error."""

    def text(self, piece: str) -> None:
        """Generated text, streamed as it comes (each answer ends with a newline)."""

    @contextmanager
    def prefill_progress(self, tokens: int, block: int):
        """Around a prefill of ``tokens`` in blocks of ``block``: yields ``advance(n)`` (None: no progress)."""
        yield None

    def report(self, report: dict) -> None:
        """The run's report, complete, before it is saved."""


def _settings_from_snapshot(s: RunSettings) -> dict:
    """--load-cache / `edgekv ask`: the saved document decides the model, its chat form and (eager)
    its K/V format; ``s`` is updated, an option that contradicts the file is refused."""
    from .artifact import is_artifact
    from .document import snapshot_settings

    load_cache = s.load_cache
    saved = snapshot_settings(load_cache)
    if s.chat is not None and s.chat != saved["chat"]:
        raise InputError(f"{load_cache} holds a document read {'with' if saved['chat'] else 'without'} the chat "
                         f"template: ask {'with --chat' if saved['chat'] else 'without --chat'}")
    s.chat = saved["chat"]
    s.model = s.model or saved["made_from"] or None
    if saved["engine"] == "compiled" and not is_artifact(s.model):
        raise InputError(f"{load_cache} was made with a compiled artifact"
                         + (f" ({saved['made_from']}), which is not there any more" if saved["made_from"] else "")
                         + ": name the artifact it was made with, as MODEL (`edgekv run ARTIFACT --load-cache "
                           "F`) or `edgekv ask F --model ARTIFACT`")
    if saved["engine"] == "eager" and is_artifact(s.model):
        raise InputError(f"{load_cache} was made by the eager engine (`edgekv run MODEL`), not a compiled artifact: "
                         f"answer from it with the model it was made with ({saved['made_from'] or 'smollm2-135m'})")
    if saved["engine"] == "eager":  # the cache's K/V format is the file's, as N and B are
        from .engine.block_engine import snapshot_kv_dtype

        stored = snapshot_kv_dtype(load_cache)
        if s.kv_dtype is not None and s.kv_dtype != stored:
            raise InputError(f"{load_cache} holds its KV cache in {stored}: drop --kv-dtype {s.kv_dtype} (the saved "
                             f"cache's own format is used), or make the document's cache again with --kv-dtype "
                             f"{s.kv_dtype}")
        s.kv_dtype = stored
    return saved


def plan_run(settings: RunSettings, console: RunConsole | None = None) -> RunPlan:
    """Resolve ``settings`` before anything is loaded: the saved document's settings (--load-cache),
    then an artifact's fixed ones checked against the options given (``check_artifact_settings``),
    or the eager policy made from its name and arguments (an unknown one is refused here)."""
    import dataclasses

    from .artifact import is_artifact
    from .policies import REGISTRY, make_policy, policy_arguments

    console = console or RunConsole()
    s = dataclasses.replace(settings, questions=list(settings.questions))
    if s.compress is not None:  # the mode's own policy (another --policy refused); policies.compress_policy
        from .policies import compress_policy

        s.policy, s.compress = compress_policy(s.policy, s.compress), None
    saved = _settings_from_snapshot(s) if s.load_cache is not None else None
    s.chat = bool(s.chat)
    asked = bool(s.questions) and s.load_cache is None  # a document read now, knowing its questions
    if is_artifact(s.model):
        manifest = Manifest.read(s.model)
        stored = manifest.kv_dtype  # an artifact's K/V format is compiled in, as N and B are
        if s.kv_dtype is not None and s.kv_dtype != stored:
            raise InputError(f"--kv-dtype {s.kv_dtype}: the artifact {s.model} stores its KV cache in {stored}; drop "
                             f"--kv-dtype, or compile the model again with --kv-dtype {s.kv_dtype}")
        name = manifest.policy_name
        chosen = s.policy or name
        args = policy_arguments(s.policy_arg, [chosen]).get(chosen, {})
        check_artifact_settings(s.model, manifest, policy=s.policy, policy_args=args, budget=s.budget, block=s.block)
        if s.document and asked and getattr(REGISTRY.get(name), "uses_question", False) and not manifest.question_rows:
            console.warn(f"{s.model} was compiled without --question-rows, so {name} scores its blocks with their own "
                         "rows, not the question's; compile it with --question-rows N (N ≥ the question's tokens) to "
                         "read the document knowing the question")
        if s.load_cache is not None:  # another artifact's, policy's, N's or B's cache: refused before the load
            from .artifact import snapshot_file as sf

            sf.check_matches(sf.read_header(s.load_cache), s.load_cache, engine=sf.ENGINE_COMPILED,
                             **sf.artifact_identity(s.model, manifest))
        return RunPlan(s, artifact=True, policy_args=args, saved=saved,
                       question_scoring=s.document and bool(manifest.question_rows) and asked)
    if saved is not None:  # options not given come from the saved document (a differing one is refused)
        s.budget = s.budget or str(saved["budget"])
        s.block = s.block or saved["block"]
    s.policy = s.policy or (saved["policy"] if saved is not None else DEFAULT_POLICY)
    args = policy_arguments(s.policy_arg, [s.policy]).get(s.policy, {})
    if saved is not None and not s.policy_arg and s.policy == saved["policy"]:
        args = dict(saved["policy_params"])
    chosen = make_policy(s.policy, args)  # unknown policy / bad arguments before loading anything
    s.budget, s.block = s.budget or DEFAULT_BUDGET, s.block or DEFAULT_BLOCK
    s.kv_dtype = s.kv_dtype or "fp32"
    _check_budget_text(s.budget, int(s.block))
    if s.load_cache is not None:
        _check_cache_fits_model(s, chosen)
    return RunPlan(s, artifact=False, policy_args=args, saved=saved,
                   question_scoring=s.document and chosen.uses_question and asked)


def _check_budget_text(budget: str, block: int) -> None:
    """--budget read before the model loads: a token budget whole (N ≥ B), a byte budget's size
    readable — its tokens need the model's geometry and are counted when the engine opens."""
    from .units import is_size, parse_size

    if is_size(str(budget).strip()):
        parse_size(str(budget).strip())
    else:
        parse_budget(budget, None, block)


def _check_cache_fits_model(s: RunSettings, policy) -> None:
    """--load-cache with the eager engine: the saved cache's weights, policy, N and B against this
    run's, from the file's header and the model file's remembered hash — before the model loads
    (the engine checks the same again when it maps the cache back). A byte --budget needs the
    model's geometry, so it alone is compared after the load."""
    import json

    from .artifact import snapshot_file as sf
    from .units import is_size

    snap = sf.read_header(s.load_cache)
    budget = snap.budget if is_size(str(s.budget).strip()) else parse_budget(s.budget, None, int(s.block))
    sf.check_matches(snap, s.load_cache, engine=sf.ENGINE_EAGER, weight_hash=_known_weight_hash(s.model) or
                     snap.weight_hash, policy=policy.name, policy_params=json.dumps(policy.params(), sort_keys=True),
                     budget=budget, block=int(s.block))


def _known_weight_hash(model: str | None) -> str | None:
    """The weight hash the eager engine will record for ``model``, when it is known without loading
    the weights: a GGUF's sha256 (remembered per file), or a converted folder's source hash; None
    for an HF folder of its own (its hash is of the loaded tensors)."""
    import json

    from .models.loader import source_sha256
    from .models.sources import resolve

    src = resolve(model)
    if src.kind == "gguf":
        return source_sha256(src.path)
    meta = Path(src.path) / "edgekv.json"
    try:
        return json.loads(meta.read_text()).get("source_sha256") if meta.is_file() else None
    except (OSError, ValueError):
        return None


def model_reference(model: str | None) -> str:
    """The model as a later `edgekv ask` can open it again: a known name, or an absolute path."""
    if model is None:
        return "smollm2-135m"
    return str(Path(model).resolve()) if Path(model).exists() else model


def new_sampler_factory(temperature: float, top_p: float, seed: int):
    from .engine import Sampler

    return lambda: Sampler(temperature=temperature, top_p=top_p, seed=seed)


def run_plan(plan: RunPlan, console: RunConsole | None = None, threads=None) -> RunResult:
    """Open the plan's session — the eager engine (its caches sized for this run) or the artifact
    (``open_artifact`` picks the runtime) — run the prompt or the document on it (``run``), and
    save the report to ``settings.output``. ``threads``: the ``threads.ThreadChoice`` the command
    applied (its count goes to the native runtime, its record into the report)."""
    from .threads import threads_in_use

    console = console or RunConsole()
    s = plan.settings
    if plan.artifact:
        console.say(f"loading the artifact {s.model}")
        rt, model = open_artifact(s.model, mem_limit=s.mem_limit, runtime=s.runtime,
                                  threads=threads.count if threads is not None else None, verify=s.verify)
        if s.allow_beyond_context and hasattr(rt, "allow_beyond_context"):
            rt.allow_beyond_context()
        block, made_from = rt.block, ""
        open_session = lambda max_tokens, question_rows: rt  # noqa: E731 - the artifact's cache is fixed
    else:
        from .models import load_model

        console.say(f"loading {s.model or 'smollm2-135m'}")
        model = load_model(s.model, console.log)
        block, made_from = s.block, model_reference(s.model)

        def open_session(max_tokens, question_rows):
            return open_eager_session(model, s.policy, plan.policy_args, s.budget, s.block, max_tokens, s.mem_limit,
                                      question_rows=question_rows, kv_dtype=s.kv_dtype)
    if s.document:
        result = _run_document(plan, model, block, open_session, made_from, console)
    else:
        result = _run_prompt(s, model, block, open_session, console)
    if threads is not None:
        result.report["threads"] = {**threads.to_dict(), **threads_in_use()}
    console.report(result.report)
    if s.output is not None:
        write_json_atomic(s.output, result.report)
    return result


def _run_prompt(s: RunSettings, model, block: int, open_session, console: RunConsole) -> RunResult:
    """Encode, check the context, open the session with room for prompt + output, run with the
    text streamed and one line per phase."""
    ids = encode_prompt(model, s.text, s.chat)
    check_context(model, int(ids.numel()), s.max_new_tokens, s.allow_beyond_context)
    stream = TextStream(model.tokenizer) if model.tokenizer is not None else None

    def on_token(token: int) -> None:
        if stream is not None:
            piece = stream.push(token)
            if piece:
                console.text(piece)

    def on_phase(name: str) -> None:
        if name == "prefill":
            n = int(ids.numel())
            console.say(f"prefill: {n:,} prompt tokens in {-(-n // block)} block(s) of {block}")
        else:
            console.say(f"decode: up to {s.max_new_tokens} tokens")

    with console.prefill_progress(int(ids.numel()), block) as advance:
        session = open_session(int(ids.numel()) + s.max_new_tokens, 0)
        result = run(session, model, prompt_ids=ids, max_new_tokens=s.max_new_tokens,
                     new_sampler=new_sampler_factory(s.temperature, s.top_p, s.seed), on_token=on_token,
                     progress=advance, on_phase=on_phase)
    console.text((stream.flush() if stream is not None else "") + "\n")
    return result


def _run_document(plan: RunPlan, model, block: int, open_session, made_from: str,
                  console: RunConsole) -> RunResult:
    """The document counterpart of ``_run_prompt``: encode the document and the question parts,
    check the context, open the session (full N + B, as a saved state must take any later question,
    and room for the longest question's rows when it scores the blocks), run with each answer
    streamed after its question."""
    from .models.chat import encode_document, encode_question

    s = plan.settings
    tok = model.tokenizer
    if tok is None:
        raise InputError(f"model {model.model_id} has no tokenizer; --question needs one (a GGUF or an HF directory "
                         "with tokenizer files)")
    if s.text is not None and not s.text.strip():
        raise InputError("the document is empty; pass --prompt TEXT or --prompt-file FILE with some text")
    try:
        doc_ids = encode_document(tok, s.text, s.chat) if s.text is not None else None
        questions = [(q, encode_question(tok, q, s.chat)) for q in s.questions]
    except ValueError as exc:  # --chat on a model without a usable chat template
        raise InputError(str(exc)) from None
    start = len(doc_ids) if doc_ids is not None else int(plan.saved["position"])
    longest = max((len(ids) for _, ids in questions), default=0)
    check_context(model, start + longest, s.max_new_tokens, s.allow_beyond_context)
    streams = [TextStream(tok) for _ in questions]

    def end_answer(i: int) -> None:
        console.text(streams[i].flush() + "\n")

    def on_question(i: int, question: str) -> None:
        if i > 0:
            end_answer(i - 1)
        if len(questions) > 1:
            console.say(f"question {i + 1} of {len(questions)}: {question}")

    def on_token(i: int, token: int) -> None:
        piece = streams[i].push(token)
        if piece:
            console.text(piece)

    if doc_ids is not None:
        console.say(f"reading the document: {len(doc_ids):,} tokens in {-(-len(doc_ids) // block)} block(s) of "
                    f"{block}" + (", scored with the question's queries (once per question)"
                                  if plan.question_scoring else ""))
    else:
        console.say(f"answering from {s.load_cache}: a document of {plan.saved['tokens']:,} tokens, read before")
    # the caches hold what this run's longest sequence needs (document + longest question + output:
    # each question continues from the document's state), never more; a cache saved for later
    # questions (--save-cache) keeps its full N + B, and a loaded one has the size it was saved with
    later = s.save_cache is not None or doc_ids is None
    with console.prefill_progress(len(doc_ids) if doc_ids is not None else 0, block) as advance:
        session = open_session(None if later else start + longest + s.max_new_tokens,
                               longest if doc_ids is not None else 0)
        result = run(session, model, document_ids=None if doc_ids is None else torch.tensor(doc_ids, dtype=torch.long),
                     questions=questions, max_new_tokens=s.max_new_tokens,
                     new_sampler=new_sampler_factory(s.temperature, s.top_p, s.seed), chat=s.chat,
                     save_cache=s.save_cache, load_cache=s.load_cache, made_from=made_from, on_token=on_token,
                     on_question=on_question, progress=advance, on_warning=console.warn)
    if questions:
        end_answer(len(questions) - 1)
    if s.save_cache is not None:
        from .units import human_bytes

        console.say(f"saved the document's cache to {s.save_cache} "
                    f"({human_bytes(result.report['document']['snapshot_bytes'])}): `edgekv ask {s.save_cache} "
                    "--question ...` answers from it")
    return result
