"""The eager engine as a ``Session`` (``edgekv/session.py``): a BlockEngine with the memory plan it
was checked against before its caches were allocated, and the policy as the user named it."""

from __future__ import annotations

import torch

from ..budget import parse_budget
from ..memory import MemoryPlan, cache_capacity, check_plan, plan_memory
from ..models.loaded import LoadedModel
from ..policies import make_policy
from ..policies.base import PolicyError
from ..session import SessionStats
from .block_engine import BlockEngine


class EagerSession:
    """``engine``: the BlockEngine (tests and tools step it directly)."""

    def __init__(self, engine: BlockEngine, plan: MemoryPlan, policy_name: str):
        self.engine, self.plan, self.policy_name = engine, plan, policy_name
        self.budget, self.block = engine.budget, engine.block

    @property
    def position(self) -> int:
        return self.engine.position

    @property
    def question_rows(self) -> int:
        return self.engine.question_rows

    @property
    def snapshot_info(self) -> dict:
        return self.engine.snapshot_info

    def prefill(self, prompt_ids, progress=None, question=None):
        return self.engine.prefill(prompt_ids, progress=progress, question=question)

    def decode(self, token_id: int):
        return self.engine.decode(token_id)

    def reset(self) -> None:
        self.engine.reset()

    def save_cache(self, path, question: str | None = None, chat: bool = False, made_from: str = "") -> None:
        self.engine.save_cache(path, question=question, chat=chat, made_from=made_from)

    def load_cache(self, path) -> str:
        return self.engine.load_cache(path)

    def cache_lengths(self) -> list[int]:
        return self.engine.cache_lengths()

    def describe(self) -> dict:
        e = self.engine
        return {"engine": "eager", "model": e.model.model_id, "weight_sha256": e.model.weight_hash,
                "policy": self.policy_name, "policy_params": e.policy.params(), "budget_tokens": e.budget,
                "block": e.block, "kv_dtype": e.kv_dtype, "cache_capacity": e.capacity, **self._cache_kinds()}

    def _cache_kinds(self) -> dict:
        """A family with sliding-window layers: which layers hold a ring (and its size), which the policy."""
        e = self.engine
        local = [i for i, is_local in enumerate(e.local) if is_local]
        if not local:
            return {}
        return {"cache_kinds": {"local_layers": local, "global_layers": e.global_layers,
                                "sliding_window": e.cfg.sliding_window, "ring_capacity": e.caches[local[0]].capacity}}

    def session_stats(self) -> SessionStats:
        e, s = self.engine, self.engine.stats
        return SessionStats(prefill_tokens=s.prefill_tokens, prefill_seconds=s.prefill_seconds,
                            decode_tokens=s.decode_tokens, decode_seconds=s.decode_seconds,
                            cache_lengths=e.cache_lengths(), memory_plan=self.plan.to_dict(),
                            planned_kv_bytes=self.plan.kv_cache, eviction_events=s.eviction_events,
                            kv_cache_allocated=e.kv_bytes, torch_threads=torch.get_num_threads())


def open_eager_session(model: LoadedModel, policy_name: str, policy_args: dict, budget: str, block: int,
                       max_tokens: int | None, mem_limit: int | None, question_rows: int = 0,
                       kv_dtype: str = "fp32", compress: str | None = None) -> EagerSession:
    """The engine of a run, its memory plan checked against ``mem_limit`` and the machine before the
    caches are allocated. ``max_tokens`` (prompt + output) bounds the caches; None gives them their
    full N + B, as a saved document cache needs for any later question. ``question_rows``: room for
    a question scoring the blocks (a query-aware policy's). ``kv_dtype``: the caches' K/V format
    (``--kv-dtype``); a byte budget and the plan count it. ``compress``: a document compression mode
    (``--compress reconstruct``), which reads with its own policy instead of ``policy_name``; the plan
    counts the extra rows its steps carry."""
    from ..policies import COMPRESS_MODES

    n_budget = parse_budget(budget, model.config, block, kv_dtype=kv_dtype)
    if compress not in (None, "none"):
        if compress not in COMPRESS_MODES:
            raise PolicyError(f"compress={compress!r} is not a compression mode; known: {', '.join(COMPRESS_MODES)}")
        policy_name, policy_args = COMPRESS_MODES[compress], (policy_args if policy_name == COMPRESS_MODES[compress]
                                                              else {})
    policy = make_policy(policy_name, policy_args)
    policy.check_budget(n_budget, block)
    question_rows = question_rows if policy.uses_question else 0
    extra_rows = max(int(getattr(policy, "max_extra_tokens", 0)), question_rows)
    capacity = cache_capacity(n_budget, block, extra_rows, max_tokens)
    plan = plan_memory(model.config, model.weight_bytes, capacity, block, len(policy.entry_state), kv_dtype=kv_dtype,
                       max_tokens=max_tokens, extra_rows=extra_rows)
    check_plan(plan, mem_limit=mem_limit, resident=model.weight_bytes,
               hint="lower --budget or --block, or shorten the prompt"
               + ("" if kv_dtype == "int8" else ", or store the cache in int8 (--kv-dtype int8)"))
    engine = BlockEngine(model, policy, n_budget, block, max_tokens=max_tokens, question_rows=question_rows,
                         kv_dtype=kv_dtype)
    return EagerSession(engine, plan, policy_name)
