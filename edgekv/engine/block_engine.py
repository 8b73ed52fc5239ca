"""The reference engine: block-wise prefill and decode with a fixed-size cache (eager PyTorch).

This is the oracle every compiled result is checked against, so it is written for
clarity: one block step runs every layer as
    RMSNorm → q/k/v → RoPE at the tokens' original positions → write block K/V after the cache
    → attention of the block's queries over cache ⊕ block (causal inside the block)
    → o_proj, residual, RMSNorm, SwiGLU MLP, residual
    → the policy cuts this layer's cache ⊕ block back to ≤ N (per KV head).
Decode is the same step with B = 1. The whole prompt's KV never exists: each layer holds
at most N + B entries (+ a policy's pseudo rows) at any moment.

A family's differences are fields of its ``ModelConfig`` (``models/config.py``), read here, never a
second engine: the norm's (offset + w) scale, QK-norm, the four norms per layer, the MLP's
activation, the embedding scale, the attention scale, the output logits' softcap, and each layer's kind. A local
(sliding-window) layer attends to the last ``sliding_window`` positions through a ring of window + B
entries (``cache.RingLayerCache``), with its own RoPE base, and no policy: only global layers score,
evict and hold N + B.

``kv_dtype`` picks how the caches store K and V (``memory.KV_DTYPES``): fp32, or int8 with float16
scales per 32 channels (``kv_quant``), where the rule is "quantise on write, everything reads
dequantised": the block is quantised as it is written, before its own attention, so the block's
queries, the cached rows' attention and every policy read the same dequantised values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..memory import DEFAULT_KV_DTYPE, cache_capacity, check_kv_dtype, ring_capacity
from ..models.config import LOCAL
from ..models.loaded import LoadedModel
from ..policies.base import EvictionContext, Policy, PolicyError
from .cache import LayerCache, RingLayerCache, new_layer_cache


@dataclass
class StepRecord:
    """What happened in one step (used by tests and reports)."""

    start: int
    length: int
    evicted: bool
    kept_positions: list[torch.Tensor] | None = None  # per layer [H, k] when recording


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    eviction_events: int = 0
    steps: list[StepRecord] = field(default_factory=list)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap if cap else x


def activation(name: str):
    if name == "gelu_tanh":
        return lambda t: F.gelu(t, approximate="tanh")
    return F.silu


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF (half-split) layout. x [heads, b, d]; cos/sin [b, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class BlockEngine:
    def __init__(self, model: LoadedModel, policy: Policy, budget: int, block: int = 128, *,
                 record_kept: bool = False, max_tokens: int | None = None, question_rows: int = 0,
                 kv_dtype: str = DEFAULT_KV_DTYPE):
        """``max_tokens``: prompt + output when known; the caches then hold no more entries than
        the sequence can fill (``memory.cache_capacity``), whatever the budget. ``question_rows``:
        room for a question of that many tokens scoring the blocks (``prefill(..., question=)``).
        ``kv_dtype``: the caches' K/V format, "fp32" or "int8" (``memory.KV_DTYPES``)."""
        self.kv_dtype = check_kv_dtype(kv_dtype, "kv_dtype")
        if budget <= 0:
            raise PolicyError("the budget must be a positive number of tokens")
        if block <= 0:
            raise PolicyError("the block size must be a positive number of tokens")
        policy.check_budget(budget, block)
        policy.check_model(model.config)
        self.model, self.policy, self.budget, self.block = model, policy, budget, block
        self.cfg = model.config
        self.record_kept = record_kept
        self.scale = self.cfg.attention_scale
        self.local = [self.cfg.layer_kind(i) == LOCAL for i in range(self.cfg.num_layers)]
        self.global_layers = [i for i, local in enumerate(self.local) if not local]
        self.max_tokens = max_tokens
        self.extra_rows = int(getattr(policy, "max_extra_tokens", 0))
        self.question_rows = int(question_rows) if policy.uses_question else 0
        self._question: tuple[torch.Tensor, torch.Tensor] | None = None  # during prefill(question=)
        self.capacity = cache_capacity(budget, block, max(self.extra_rows, self.question_rows), max_tokens)
        self.layer_budgets = self._layer_budgets()
        self.caches = self._new_caches()
        self.position = 0  # next token's position
        self.stats = EngineStats()
        w = model.weights
        norms = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                 "post_feedforward_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")
        self._layers = [
            {name: w.get(f"model.layers.{i}.{name}") for name in (
                *norms, "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
            for i in range(self.cfg.num_layers)
        ]
        offset = self.cfg.norm_offset
        if offset:  # Gemma's RMSNorm scales by (1 + w): add the offset once, not in every step
            for lw in self._layers:
                for name in norms:
                    if lw[name] is not None:
                        lw[name] = lw[name] + offset
        self._final_norm = w["model.norm.weight"] + offset
        self._activation = activation(self.cfg.mlp_activation)

    def _new_caches(self, capacity: int | None = None) -> list[LayerCache | RingLayerCache]:
        ring = ring_capacity(self.cfg.sliding_window, self.block, None if capacity else self.max_tokens)
        return [RingLayerCache(self.cfg.num_kv_heads, ring, self.cfg.head_dim, self.kv_dtype) if local
                else new_layer_cache(self.cfg.num_kv_heads, capacity or self.capacity, self.cfg.head_dim,
                                     self.policy.entry_state, self.kv_dtype) for local in self.local]

    def reset(self) -> None:
        """A new sequence: empty caches (per-entry state too), position 0, fresh counters."""
        self.caches = self._new_caches()
        self.position = 0
        self.layer_budgets = self._layer_budgets()
        self.stats = EngineStats()

    def _layer_budgets(self) -> list[int]:
        """N_l of every layer; a local layer's is its window (it keeps exactly that, no policy)."""
        return [self.cfg.sliding_window if local else min(self.budget, self.policy.layer_budget(i, self.budget))
                for i, local in enumerate(self.local)]

    # ---- accounting -------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """Bytes the engine allocated for caches (all layers): fixed at construction (int8: codes and
        scales; the float32 rows a step dequantises live only while that layer runs)."""
        return sum(c.nbytes for c in self.caches)

    def cache_lengths(self) -> list[int]:
        return [c.length for c in self.caches]

    def kept_positions(self, layer: int) -> torch.Tensor:
        c = self.caches[layer]
        return c.positions[:, : c.length].clone()

    # ---- one step ---------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, local: bool = False):
        m = self.model
        inv_freq, s = (m.local_inv_freq, m.local_attention_scaling) if local else (m.inv_freq, m.attention_scaling)
        freqs = positions.double()[:, None] * inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * s).float(), (emb.sin() * s).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_eps)

    def _attend(self, q, keys, values, mask):
        """Attention of q [Hq, r, d] over keys / values [Hkv, n, d] under mask [r, n]."""
        return F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask[None, None], scale=self.scale, enable_gqa=True)[0]

    def _local_attention(self, cache: RingLayerCache, q, k, v, all_pos, b: int):
        """A sliding-window layer: the block's real rows written into the ring in place, the rows
        after it (pseudo / question rows) only attended alongside, never stored (they would
        overwrite live slots); every query sees the keys of its window, itself included."""
        cache.write_block(k[:, :b], v[:, :b], all_pos[:b])
        keys, values, key_pos = cache.view()
        key_pos = key_pos[0].long()
        if all_pos.numel() > b:
            keys, values = torch.cat([keys, k[:, b:]], dim=1), torch.cat([values, v[:, b:]], dim=1)
            key_pos = torch.cat([key_pos, all_pos[b:]])
        window = self.cfg.sliding_window
        mask = (key_pos[None, :] <= all_pos[:, None]) & (key_pos[None, :] > all_pos[:, None] - window)
        return self._attend(q, keys, values, mask)

    def _project(self, lw, h, name, heads):
        out = F.linear(h, lw[f"self_attn.{name}_proj.weight"], lw.get(f"self_attn.{name}_proj.bias"))
        return out.view(h.shape[0], heads, self.cfg.head_dim).transpose(0, 1)

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, *, all_logits: bool = False, extra=None,
             decoding: bool = False) -> torch.Tensor:
        """Run one block of real tokens (positions continue from self.position).

        ``extra`` = (ids, positions) of pseudo tokens appended after the block (DapQ); their
        queries are handed to the policy and their K/V never stay in the cache. ``decoding``: a
        generated token (``decode``), whose attention the policy may replace
        (``Policy.decode_attention``); prompt tokens always attend densely.
        Returns logits of the last real token [vocab] (or of every real token [b, vocab])."""
        cfg = self.cfg
        b = token_ids.shape[0]
        positions = torch.arange(self.position, self.position + b, dtype=torch.long)
        ids, all_pos = token_ids, positions
        n_extra = 0
        if extra is not None:
            n_extra = extra[0].shape[0]
            ids = torch.cat([token_ids, extra[0]])
            all_pos = torch.cat([positions, extra[1].long()])
        ropes = {False: self._rope(all_pos), True: self._rope(all_pos, local=True) if any(self.local) else None}
        x = self.model.weights["model.embed_tokens.weight"][ids]
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        record = StepRecord(start=self.position, length=b, evicted=False,
                            kept_positions=[] if self.record_kept else None)
        for layer, (lw, cache) in enumerate(zip(self._layers, self.caches)):
            local = self.local[layer]
            cos, sin = ropes[local]
            h = self._norm(x, lw["input_layernorm.weight"])
            q, k = self._project(lw, h, "q", cfg.num_heads), self._project(lw, h, "k", cfg.num_kv_heads)
            if cfg.qk_norm:
                q, k = self._norm(q, lw["self_attn.q_norm.weight"]), self._norm(k, lw["self_attn.k_norm.weight"])
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            v = self._project(lw, h, "v", cfg.num_kv_heads)
            if local:
                x = self._finish_layer(lw, x, self._local_attention(cache, q, k, v, all_pos, b), b + n_extra)
                if record.kept_positions is not None:
                    record.kept_positions.append(self.kept_positions(layer))
                continue
            old = cache.length
            cache.write(old, k, v, all_pos)
            n_all = old + b + n_extra
            # what the cache holds, the block's own rows included (int8: dequantised, never the
            # rows just projected): attention and the policy below read only this
            keys, values, key_pos = cache.view(n_all)
            attn = None
            if decoding and not n_extra:
                attn = self.policy.decode_attention(layer, q, cache, n_all, budget=self.budget, scale=self.scale)
            if attn is None:
                # Causal by original position: cache entries precede the block, so only the block
                # (and pseudo rows after it) is masked. Positions are shared by all heads for the
                # block's own entries, and every cached position is < the block's first.
                mask = key_pos[0][None, :].long() <= all_pos[:, None]
                attn = self._attend(q, keys, values, mask)
            x = self._finish_layer(lw, x, attn, b + n_extra)
            compacted = self._evict(layer, cache, old + b, q, all_pos, b, n_extra, (keys, values, key_pos))
            record.evicted = record.evicted or compacted
            self.policy.after_step(layer, cache, compacted, budget=self.budget)
            if record.kept_positions is not None:
                record.kept_positions.append(self.kept_positions(layer))
        self.position += b
        self.stats.steps.append(record)
        if record.evicted:
            self.stats.eviction_events += 1
        x = x[:b] if all_logits else x[b - 1 : b]
        logits = softcap(F.linear(self._norm(x, self._final_norm), self.model.lm_head), cfg.final_softcap)
        return logits if all_logits else logits[0]

    def _finish_layer(self, lw, x, attn, rows: int):
        """o_proj and the MLP with their residuals (with the family's post-norms when it has four)."""
        out = F.linear(attn.transpose(0, 1).reshape(rows, -1), lw["self_attn.o_proj.weight"])
        if self.cfg.sandwich_norms:
            x = x + self._norm(out, lw["post_attention_layernorm.weight"])
            h = self._norm(x, lw["pre_feedforward_layernorm.weight"])
        else:
            x = x + out
            h = self._norm(x, lw["post_attention_layernorm.weight"])
        gate, up = F.linear(h, lw["mlp.gate_proj.weight"]), F.linear(h, lw["mlp.up_proj.weight"])
        out = F.linear(self._activation(gate) * up, lw["mlp.down_proj.weight"])
        return x + (self._norm(out, lw["post_feedforward_layernorm.weight"]) if self.cfg.sandwich_norms else out)

    def _evict(self, layer, cache, n, q, all_pos, b, n_extra, read) -> bool:
        """``read``: the step's (keys, values, positions) of cache ⊕ block ⊕ extra rows as the
        attention read them (an int8 cache dequantises once per step, not once per reader)."""
        policy = self.policy
        budget = self.layer_budgets[layer]
        must = n > budget
        if not must and not policy.observes_every_step:
            cache.length = n
            return False
        all_keys, all_values, all_key_pos = read
        keys, values, key_pos = all_keys[:, :n], all_values[:, :n], all_key_pos[:, :n]
        ctx = EvictionContext(
            layer=layer, num_layers=self.cfg.num_layers, budget=budget, keys=keys, values=values,
            positions=key_pos, n_cache=n - b, is_prefill=b > 1, scale=self.scale,
            state={name: buf[:, :n] for name, buf in cache.state.items()},
        )
        if policy.needs_queries:
            ctx.queries, ctx.query_positions = q[:, :b], all_pos[:b]
        if n_extra:
            ctx.extra_queries, ctx.extra_query_positions = q[:, b:], all_pos[b:]
            ctx.extra_keys = all_keys[:, n : n + n_extra]
            ctx.extra_is_question = self._question is not None
        if policy.observes_every_step:
            policy.observe(ctx)
        if not must:
            cache.length = n
            return False
        cache.compact(n, policy.select(ctx))
        return True

    # ---- prefill / decode ---------------------------------------------------------------
    def prepare(self, prompt_ids: torch.Tensor) -> None:
        """The policy's per-prompt setup (``Policy.prepare``) and the layer budgets that may depend
        on the prompt (D2O); ``prefill`` calls it, a caller stepping blocks itself calls it first."""
        self.policy.prepare(torch.as_tensor(prompt_ids, dtype=torch.long).flatten(), self)
        self.layer_budgets = self._layer_budgets()

    def prefill(self, prompt_ids: torch.Tensor, progress=None, all_logits: bool = False,
                question: torch.Tensor | None = None) -> torch.Tensor:
        """Block-wise prefill of the whole prompt; returns the last token's logits
        (or every prompt token's logits with ``all_logits``, for teacher-forced evaluation).

        ``question``: the ids that will follow this prompt (a document's question, `--question`).
        A query-aware policy (``uses_question``) then scores every evicting block with the
        question's queries: its tokens run after the block at their true future positions, as
        extra rows that never enter the cache. The question itself is not prefilled here."""
        import time

        prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        if prompt_ids.numel() == 0:
            raise PolicyError("the prompt is empty; give at least one token")
        self._question = self._question_rows(question, self.position + prompt_ids.numel())
        if self.position == 0:  # a new sequence; a continuation keeps the per-prompt state
            self.prepare(prompt_ids)
        else:
            self.policy.prepare_continuation(prompt_ids, self.position, self)
        outs = []
        t0 = time.perf_counter()
        try:
            for start in range(0, prompt_ids.numel(), self.block):
                chunk = prompt_ids[start : start + self.block]
                extra = self.extra_rows_for(chunk.numel())
                outs.append(self.step(chunk, all_logits=all_logits, extra=extra))
                if progress is not None:
                    progress(chunk.numel())
        finally:
            self._question = None
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_tokens += prompt_ids.numel()
        return torch.cat(outs) if all_logits else outs[-1]

    def _question_rows(self, question, end: int):
        """(ids, positions end…) of a question that scores the blocks, or None (no question, or a
        policy that does not use one)."""
        if question is None or not self.policy.uses_question:
            return None
        ids = torch.as_tensor(question, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise PolicyError("the question is empty; give its text")
        if ids.numel() > self.question_rows:
            raise PolicyError(f"the question has {ids.numel()} tokens and this engine has room for {self.question_rows} "
                              "question rows; make it with question_rows of at least the question's length")
        return ids, torch.arange(end, end + ids.numel(), dtype=torch.long)

    def extra_rows_for(self, b: int):
        """Extra rows go with blocks that trigger eviction in some layer: the question's (when
        ``prefill`` has one), else the policy's pseudo rows (DapQ). Public for whoever steps the
        engine block by block (``step(chunk, extra=...)``) as ``prefill`` does."""
        extra = self._question if self._question is not None else self.policy.extra_tokens()
        if extra is None:
            return None
        if not self.global_layers:
            return None
        if getattr(self.policy, "rows_every_block", False):  # reconstruct: each block scores its own entries
            return extra
        if max(self.caches[i].length for i in self.global_layers) + b <= min(self.layer_budgets[i]
                                                                           for i in self.global_layers):
            return None
        return extra

    # ---- snapshots (edgekv/artifact/snapshot_file.py) -----------------------------------
    def _snapshot_identity(self) -> dict:
        import json

        return {"weight_hash": self.model.weight_hash, "policy": self.policy.name,
                "policy_params": json.dumps(self.policy.params(), sort_keys=True), "budget": self.budget,
                "block": self.block}

    def save_cache(self, path, question: str | None = None, chat: bool = False, made_from: str = "") -> None:
        """Save every layer's cache buffers, lengths, the position and the policy's per-prompt
        state to one file, atomically. ``made_from``: the model as given to `edgekv run` (a name,
        or an absolute path), which `edgekv ask` opens to continue from the file."""
        import json

        from ..artifact import snapshot_file as sf

        tensors = {}
        for layer, c in enumerate(self.caches):
            for f, t in enumerate(c.stored_tensors()):  # int8: codes and scales as stored, nothing requantised
                tensors[(layer, f)] = t.numpy()
        extra = json.dumps({"lengths": self.cache_lengths(), "layer_budgets": self.layer_budgets,
                            "policy_state": self.policy.state_dict(), "kv_dtype": self.kv_dtype})
        sf.write(sf.Snapshot(engine=sf.ENGINE_EAGER, position=self.position, tokens=self.stats.prefill_tokens,
                             question=question or "", chat=chat, extra=extra, tensors=tensors, made_from=made_from,
                             document_seconds=self.stats.prefill_seconds, **self._snapshot_identity()),
                 path)

    def load_cache(self, path) -> str:
        """Map a snapshot back (the cache buffers become views of the copy-on-write mapping);
        returns the question it was made with ("")."""
        import json

        from ..artifact import snapshot_file as sf

        snap = sf.read(path)
        sf.check_matches(snap, path, engine=sf.ENGINE_EAGER, **self._snapshot_identity())
        state = json.loads(snap.extra or "{}")
        self._check_snapshot_kv_dtype(state, path)
        capacity = self._snapshot_capacity(snap, path)
        caches = self.caches if capacity == self.capacity else self._new_caches(capacity)
        restored = []  # every layer checked before the engine takes the file's buffers
        for layer, c in enumerate(caches):
            tensors = []
            for f, cur in enumerate(c.stored_tensors()):
                data = snap.tensors.get((layer, f))
                if data is None or data.nbytes != cur.numel() * cur.element_size():
                    raise sf.SnapshotError(f"{path}: its cache layout differs from this engine's")
                tensors.append(torch.from_numpy(data.view(cur.numpy().dtype).reshape(tuple(cur.shape))))
            restored.append(tensors)
        if capacity != self.capacity:
            self.capacity, self.caches = capacity, caches
            if self.policy.uses_question:
                self.question_rows = max(self.question_rows, capacity - self.budget - self.block)
        for layer, (c, tensors) in enumerate(zip(self.caches, restored)):
            c.restore_tensors(tensors)
            c.length = int(state["lengths"][layer])
        self.layer_budgets = list(state.get("layer_budgets", self.layer_budgets))
        self.policy.load_state_dict(state.get("policy_state", {}))
        self.position = snap.position
        self.snapshot_info = snap.info()
        return snap.question

    def _check_snapshot_kv_dtype(self, state: dict, path) -> None:
        """A snapshot holds K/V in the format its engine stored (``kv_dtype`` in its state; files from
        before int8 caches existed are fp32): this engine must store the same one."""
        from ..artifact import snapshot_file as sf

        saved = state.get("kv_dtype", "fp32")
        if saved != self.kv_dtype:
            raise sf.SnapshotError(
                f"{path} holds its KV cache in {saved} (made with --kv-dtype {saved}) and this engine stores "
                f"{self.kv_dtype}: load it with --kv-dtype {saved} (BlockEngine(..., kv_dtype={saved!r})), or make it "
                f"again with --kv-dtype {self.kv_dtype}")

    def _snapshot_capacity(self, snap, path) -> int:
        """The capacity of the snapshot's caches (the engine takes it): the engine that saved it may
        have had room for a question's rows (``question_rows``) or a shorter sequence; any capacity
        from N + B up continues correctly."""
        first_global = self.global_layers[0]  # a local layer's ring has its own fixed capacity
        keys = snap.tensors.get((first_global, 0))
        per_entry = (self.cfg.num_kv_heads * self.cfg.head_dim
                     * self.caches[first_global].stored_tensors()[0].element_size())
        if keys is None or keys.nbytes % per_entry:
            return self.capacity  # the layout check refuses it
        capacity = keys.nbytes // per_entry
        if capacity != self.capacity and capacity < min(self.capacity, self.budget + self.block):
            from ..artifact import snapshot_file as sf

            raise sf.SnapshotError(f"{path}: its caches hold {capacity} entries, fewer than N + B = "
                                   f"{self.budget + self.block}; make it again")
        return capacity

    def decode(self, token_id: int) -> torch.Tensor:
        import time

        t0 = time.perf_counter()
        logits = self.step(torch.tensor([token_id], dtype=torch.long), decoding=True)
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_tokens += 1
        return logits

    def generate(self, prompt_ids, max_new_tokens: int, sampler=None, eos_ids=(), on_token=None, progress=None):
        """Prefill then decode (``edgekv.session.generate``, greedy unless a sampler is given);
        returns the generated ids (the EOS token ends it and is included)."""
        from ..session import generate
        from .sampling import Sampler

        return generate(self, prompt_ids, sampler or Sampler(), max_new_tokens, eos_ids=eos_ids, on_token=on_token,
                        progress=progress)


def snapshot_kv_dtype(path) -> str:
    """The K/V format an eager snapshot holds, from its header ("fp32" for files made before int8
    caches existed): what `edgekv ask` / `edgekv run --load-cache` open it with."""
    import json

    from ..artifact import snapshot_file as sf

    return json.loads(sf.read_header(path).extra or "{}").get("kv_dtype", "fp32")
