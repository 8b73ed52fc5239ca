"""Sweeps: tasks × prompts × policies × budgets × blocks on the block-wise reference engine.

For every prompt the full-cache reference runs once (policy ``full``, budget = prompt +
output, B = the first block size) and every other run of that prompt is scored against it.
Runs whose budget holds the whole prompt and output never evict, so by the engine's
invariant they equal the full cache exactly; they reuse the reference and are marked
``no_eviction``. With an int8 KV cache (``kv_dtype``) every run stores int8 and the reference
stays the fp32 full cache, so such runs are run (they measure what quantisation alone changes).
``full`` itself is run once per prompt through the same path as the policies (an independent
engine run, not the reference) and reported at every budget.

Nothing here is random except the prompt builders, which are seeded (see tasks.py);
given the same thread count, a rerun gives identical numbers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..engine import BlockEngine
from ..models.loaded import LoadedModel
from ..policies import PolicyError, make_policy
from .fidelity import FidelityTrace, compare, run_trace
from .tasks import Prompt, build_fidelity, build_passkey, extract_key

TASKS = ("passkey", "multikey", "fidelity")
ONE_BLOCK = 0  # block value meaning "the whole prompt as one block"


@dataclass
class EvalSpec:
    tasks: list[str]
    policies: list[str]
    budgets: list[int]
    blocks: list[int] = field(default_factory=lambda: [128])  # ONE_BLOCK (0) = B = prompt length
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    keys: int = 2  # needles in the multi-key variant (pass key + distractors)
    haystack: str = "varied"  # tasks.HAYSTACKS; "repeat": the classic filler (a labelled variant)
    max_new_tokens: int = 10
    fidelity_lengths: list[int] = field(default_factory=lambda: [2048])
    fidelity_window: int = 512
    greedy_tokens: int = 16
    policy_args: dict[str, dict[str, str]] = field(default_factory=dict)
    # question-aware prefill (`--question`): passkey prompts' document part is read knowing the
    # question, which query-aware policies score the blocks with; the others run unchanged
    question: bool = False
    # how every run but the fp32 full-cache reference stores K and V (`--kv-dtype`, memory.KV_DTYPES)
    kv_dtype: str = "fp32"
    # compiled artifacts run through the native runtime (`--artifacts`): label → native_runs.ArtifactRun
    # as a dict; each label is also in ``policies`` and runs at the artifact's own N and B
    artifacts: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def block_label(block: int) -> str:
    return "one" if block == ONE_BLOCK else str(block)


def build_prompts(spec: EvalSpec, tokenizer) -> list[Prompt]:
    prompts: list[Prompt] = []
    for task in spec.tasks:
        if task in ("passkey", "multikey"):
            keys = 1 if task == "passkey" else spec.keys
            for length in spec.lengths:
                for depth in spec.depths:
                    for seed in spec.seeds:
                        prompts.append(build_passkey(tokenizer, length, depth, seed, keys=keys, haystack=spec.haystack))
        elif task == "fidelity":
            for length in spec.fidelity_lengths:
                for seed in spec.seeds:
                    prompts.append(build_fidelity(tokenizer, length, seed, spec.fidelity_window))
        else:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return prompts


def output_tokens(spec: EvalSpec, prompt: Prompt) -> int:
    return spec.greedy_tokens if prompt.task == "fidelity" else spec.max_new_tokens


@dataclass
class Outcome:
    """One engine run on one prompt (before comparison with the reference)."""

    seconds: float
    prefill_seconds: float
    eviction_events: int
    passkey: dict | None = None
    trace: FidelityTrace | None = None


def needle_retention(engine: BlockEngine, prompt: Prompt, tokenizer) -> float | None:
    """Fraction of (layer, KV head) caches that still hold the asked needle's key digits."""
    if not prompt.needle_positions:
        return None
    start = prompt.needle_positions[prompt.asked or 0]
    ids = prompt.ids.tolist()
    span = [p for p in range(start, min(start + 24, len(ids)))
            if any(ch.isdigit() for ch in tokenizer.decode([ids[p]]))][:len(prompt.answer or "")]
    if not span:
        return None
    want = torch.tensor(span)
    held = [torch.isin(want, pos).float().mean()  # pos: one KV head's kept positions
            for layer in range(len(engine.caches)) for pos in engine.kept_positions(layer)]
    return float(torch.stack(held).mean())


def read_and_answer(engine: BlockEngine, prompt: Prompt, tokenizer, split: int | None, max_new_tokens: int,
                    eos: tuple[int, ...] = (), progress: Callable[[int], None] | None = None) -> tuple[list[int], float | None]:
    """Prefill a passkey prompt — with ``split``, the document knowing the question (``prompt.ids[split:]``),
    then the question itself — and answer greedily (up to ``max_new_tokens``, a stop id ends it).
    Returns (generated ids, the needle's retention after prefill)."""
    if split:
        engine.prefill(prompt.ids[:split], progress=progress, question=prompt.ids[split:])
        logits = engine.prefill(prompt.ids[split:], progress=progress)
    else:
        logits = engine.prefill(prompt.ids, progress=progress)
    retention = needle_retention(engine, prompt, tokenizer)
    generated: list[int] = []
    for i in range(max_new_tokens):
        token = int(torch.argmax(logits))
        generated.append(token)
        if token in eos or i == max_new_tokens - 1:
            break
        logits = engine.decode(token)
    return generated, retention


def run_one(model: LoadedModel, prompt: Prompt, policy_name: str, policy_args: dict, budget: int, block: int,
            spec: EvalSpec, progress: Callable[[int], None] | None = None, kv_dtype: str = "fp32") -> Outcome:
    if policy_name in spec.artifacts:  # a compiled artifact, through the native runtime
        from .native_runs import NativeEngine

        run = spec.artifacts[policy_name]
        split = prompt.question_start if spec.question and run["question_rows"] and prompt.task != "fidelity" else None
        engine = NativeEngine(run, torch.get_num_threads())
        try:
            return _run_engine(engine, model, prompt, split, spec, progress)
        finally:
            engine.close()
    policy = make_policy(policy_name, policy_args)
    context = prompt.eval_start if prompt.task == "fidelity" else prompt.tokens  # what prefill sees
    b = context if block == ONE_BLOCK else block
    split = prompt.question_start if spec.question and policy.uses_question and prompt.task != "fidelity" else None
    engine = BlockEngine(model, policy, budget, b, question_rows=prompt.tokens - split if split else 0,
                         kv_dtype=kv_dtype)
    return _run_engine(engine, model, prompt, split, spec, progress)


def _run_engine(engine, model: LoadedModel, prompt: Prompt, split: int | None, spec: EvalSpec,
                progress: Callable[[int], None] | None) -> Outcome:
    """One prompt through ``engine`` (a BlockEngine, or native_runs.NativeEngine): its Outcome."""
    t0 = time.perf_counter()
    if prompt.task == "fidelity":
        trace = run_trace(engine, prompt.ids, prompt.eval_start, spec.greedy_tokens, progress=progress)
        out = Outcome(0.0, engine.stats.prefill_seconds, engine.stats.eviction_events, trace=trace)
    else:
        tok = model.tokenizer
        eos = tuple(i for i in [getattr(tok, "eos_token_id", None)] if i is not None)
        generated, retention = read_and_answer(engine, prompt, tok, split, spec.max_new_tokens, eos, progress)
        text = tok.decode(generated, skip_special_tokens=True)
        predicted = extract_key(text)
        out = Outcome(0.0, engine.stats.prefill_seconds, engine.stats.eviction_events, passkey={
            "output_ids": generated, "output_text": text, "predicted": predicted,
            "correct": predicted == prompt.answer, "needle_retention": retention,
            # multikey: the model answered with a distractor needle's value
            "answered_distractor": predicted is not None and predicted in prompt.distractors,
        })
    out.seconds = time.perf_counter() - t0
    return out


def score(prompt: Prompt, ref: Outcome, out: Outcome) -> dict:
    if prompt.task == "fidelity":
        return compare(ref.trace, out.trace)
    p = dict(out.passkey)
    p["agrees_with_full"] = p["output_ids"] == ref.passkey["output_ids"]
    return p


PROMPT_IDENTITY = ("task", "tokens", "seed", "length_target", "depth", "answer", "needle_positions", "asked",
                   "haystack", "eval_start")


class Runner:
    """Runs a spec; ``on_prompt_done`` is called with the partial result after each prompt."""

    def __init__(self, model: LoadedModel, spec: EvalSpec, *, progress_factory=None, on_prompt_done=None,
                 log: Callable[[str], None] | None = None):
        self.model, self.spec = model, spec
        self.progress_factory = progress_factory
        self.on_prompt_done = on_prompt_done
        self.log = log or (lambda msg: None)

    def plan(self, prompts: list[Prompt]) -> list[tuple[Prompt, list[tuple[str, int, int]]]]:
        """Per prompt: the (policy, budget, block) runs that need the engine (others are reused)."""
        spec, plan = self.spec, []
        for prompt in prompts:
            runs = []
            for policy in spec.policies:
                if policy == "full":
                    runs.append(("full", prompt.tokens + output_tokens(spec, prompt), spec.blocks[0]))
                    continue
                if policy in spec.artifacts:  # always run: other kernels, weights and runtime
                    runs.append((policy, spec.artifacts[policy]["budget"], spec.artifacts[policy]["block"]))
                    continue
                for budget in spec.budgets:
                    if self.reuses_reference(prompt, budget):
                        continue  # no eviction: equals the reference
                    for block in spec.blocks:
                        runs.append((policy, budget, block))
            plan.append((prompt, runs))
        return plan

    def policy_params(self, policy: str) -> dict:
        """What a row records of how its policy was set (an artifact: its manifest's policy)."""
        if policy in self.spec.artifacts:
            return self.spec.artifacts[policy]["params"]
        return make_policy(policy, self.spec.policy_args.get(policy, {})).params()

    def grid(self, policy: str) -> list[tuple[int, int]]:
        """The (budget, block) cells a policy's rows fill: the sweep's grid, an artifact's own N and B."""
        if policy in self.spec.artifacts:
            return [(self.spec.artifacts[policy]["budget"], self.spec.artifacts[policy]["block"])]
        return [(budget, block) for budget in self.spec.budgets for block in self.spec.blocks]

    def reuses_reference(self, prompt: Prompt, budget: int) -> bool:
        """A run that cannot differ from the reference: nothing evicted and K/V stored in fp32."""
        return budget >= prompt.tokens + output_tokens(self.spec, prompt) and self.spec.kv_dtype == "fp32"

    def reusable(self, prompt: Prompt, prior: dict | None) -> tuple[dict, list[dict]] | None:
        """The reference row and result rows of ``prompt`` from an earlier run of the same sweep
        (``--resume``), if that run finished the prompt: same prompt tokens and needles, same
        policy parameters, every expected row present. Otherwise None (the prompt runs again)."""
        if not prior or prompt.id not in prior.get("references", {}):
            return None
        meta = next((m for m in prior.get("prompts", []) if m.get("id") == prompt.id), None)
        now = json.loads(json.dumps(prompt.meta()))
        # the fields that define what the model saw and what is scored (fields added to the
        # record later, e.g. multikey distractors, do not make an older run unusable)
        if meta is None or any(meta.get(k) != now.get(k) for k in PROMPT_IDENTITY):
            return None
        rows = [r for r in prior.get("results", []) if r.get("prompt_id") == prompt.id]
        by_key = {(r["policy"], r["budget"], r["mode"]): r for r in rows}
        wanted = []
        for policy in self.spec.policies:
            params = self.policy_params(policy)
            for budget, block in self.grid(policy):
                row = by_key.get((policy, budget, "one_block" if block == ONE_BLOCK else "block"))
                if row is None or row["policy_params"] != json.loads(json.dumps(params)) or (
                        block != ONE_BLOCK and row["block"] != block) or (
                        row.get("kv_dtype", "fp32") != self.spec.kv_dtype):
                    return None
                wanted.append(row)
        return prior["references"][prompt.id], wanted

    def run(self, prompts: list[Prompt], prior: dict | None = None, pool=None) -> dict:
        """Every prompt not reusable from ``prior`` (``--resume``), in this process or over ``pool``
        (``edgekv.evaluation.workers``: local worker processes or a Ray cluster), which hands back
        each prompt's rows; they are put in prompt order, so the result does not depend on where or
        in which order the prompts ran."""
        reused = {p.id: r for p in prompts if (r := self.reusable(p, prior)) is not None}
        if reused:
            self.log(f"--resume: {len(reused)} of {len(prompts)} prompts reused from the earlier results")
        plan = [(i, p, runs) for i, (p, runs) in enumerate(self.plan(prompts)) if p.id not in reused]
        total_tokens = sum(p.tokens * (1 + len(runs)) for _, p, runs in plan)
        bar = self.progress_factory(total_tokens) if self.progress_factory else None
        finished: dict[str, tuple[dict, list[dict]]] = dict(reused)
        t_start = time.perf_counter()

        def collect(partial_rows: dict | None = None, complete: bool = False) -> dict:
            references, results = {}, []
            for p in prompts:  # prompt order, whatever order they finished in
                if p.id in finished:
                    references[p.id], rows = finished[p.id]
                    results.extend(rows)
                elif partial_rows and p.id in partial_rows:
                    references[p.id], rows = partial_rows[p.id]
                    results.extend(rows)
            return {"prompts": [p.meta() for p in prompts], "references": references, "results": results,
                    "complete": complete, "runtime_seconds": time.perf_counter() - t_start}

        try:
            if pool is None:
                for _, prompt, runs in plan:
                    def partial(ref_row, rows, pid=prompt.id):  # after every run (long sweeps)
                        if self.on_prompt_done:
                            self.on_prompt_done(collect({pid: (ref_row, rows)}))
                    finished[prompt.id] = self.run_prompt(prompt, runs, bar, on_run=partial)
                    self.log(f"{prompt.id}: {len(runs)} runs")
            else:
                runs_of = {i: runs for i, _, runs in plan}
                for i, (ref_row, rows) in pool.map_prompts(list(runs_of)):
                    prompt = prompts[i]
                    finished[prompt.id] = (ref_row, rows)
                    if bar:
                        bar.describe(f"{prompt.id} · done")
                        bar.advance(prompt.tokens * (1 + len(runs_of[i])))
                    if self.on_prompt_done:
                        self.on_prompt_done(collect())
                    self.log(f"{prompt.id}: done")
        finally:
            if bar:
                bar.close()
        return collect(complete=True)

    def run_prompt(self, prompt: Prompt, runs: list[tuple[str, int, int]] | None = None, bar=None,
                   on_run: Callable[[dict, list[dict]], None] | None = None) -> tuple[dict, list[dict]]:
        """The reference and every run of one prompt: (reference row, result rows)."""
        spec, model = self.spec, self.model
        if runs is None:
            runs = self.plan([prompt])[0][1]
        describe = (lambda what: bar.describe(f"{prompt.id} · {what}")) if bar else (lambda what: None)
        advance = bar.advance if bar else None
        describe("full (reference)")
        ref = run_one(model, prompt, "full", {}, prompt.tokens + output_tokens(spec, prompt), spec.blocks[0],
                      spec, advance)
        ref_row = self._reference_row(prompt, ref)
        done: dict[tuple[str, int, int], tuple[Outcome | None, str | None]] = {}
        for policy, budget, block in runs:
            describe(f"{policy} N={budget} B={block_label(block)}")
            try:
                done[(policy, budget, block)] = (run_one(model, prompt, policy, spec.policy_args.get(policy, {}),
                                                         budget, block, spec, advance, spec.kv_dtype), None)
            except PolicyError as exc:
                done[(policy, budget, block)] = (None, str(exc))
                if advance:
                    advance(prompt.tokens)
            if on_run:
                on_run(ref_row, self._rows(prompt, ref, done, partial=True))
        return ref_row, self._rows(prompt, ref, done)

    def _reference_row(self, prompt: Prompt, ref: Outcome) -> dict:
        row = {"prompt_id": prompt.id, "policy": "full", "budget": prompt.tokens + output_tokens(self.spec, prompt),
               "block": self.spec.blocks[0], "seconds": ref.seconds}
        if ref.passkey is not None:
            row.update(ref.passkey)
        else:
            row["greedy_ids"] = ref.trace.greedy
            row["greedy_text"] = self.model.tokenizer.decode(ref.trace.greedy)
        return row

    def _rows(self, prompt: Prompt, ref: Outcome, done: dict, partial: bool = False) -> list[dict]:
        spec, rows = self.spec, []
        n_out = output_tokens(spec, prompt)
        full_run = done.get(("full", prompt.tokens + n_out, spec.blocks[0]))
        for policy in spec.policies:
            params = self.policy_params(policy)
            for budget, block in self.grid(policy):
                no_evict = budget >= prompt.tokens + n_out
                reuse = self.reuses_reference(prompt, budget) and policy not in spec.artifacts
                if partial and (full_run is None if policy == "full" else
                                not reuse and (policy, budget, block) not in done):
                    continue
                if policy == "full":
                    out, error = full_run
                elif reuse:
                    out, error = ref, None
                else:
                    out, error = done[(policy, budget, block)]
                row = {
                    "task": prompt.task, "prompt_id": prompt.id, "seed": prompt.seed,
                    "length_target": prompt.length_target, "prompt_tokens": prompt.tokens, "depth": prompt.depth,
                    "policy": policy, "policy_params": params, "budget": budget,
                    "block": (prompt.eval_start if prompt.task == "fidelity" else prompt.tokens)
                    if block == ONE_BLOCK else block,
                    "mode": "one_block" if block == ONE_BLOCK else "block",
                    "no_eviction": bool(no_evict or policy == "full"),
                    "reused_reference": bool(reuse and policy != "full"),
                    "kv_dtype": spec.kv_dtype,
                    "error": error,
                }
                if out is not None:
                    row.update({"seconds": out.seconds, "prefill_seconds": out.prefill_seconds,
                                "eviction_events": out.eviction_events})
                    row.update(score(prompt, ref, out))
                rows.append(row)
        return rows
