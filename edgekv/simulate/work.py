"""Work per prefill block and per decode step: FLOPs and bytes moved.

Two sources share one interface (``WorkModel``):

- ``GeometryWork`` counts from the model geometry, N and B (every GEMM of the layer step,
  attention over the keys the step really sees, the eviction pass, the last-row LM head),
  in the layout the eager engine and the compiled ``prefill_block`` / ``decode`` use.
- ``ManifestWork`` reads counts that a compiled artifact records from its own graph
  (``manifest.json`` → ``"work"``: ``{"prefill_block": {"flops": F, "bytes": M}, "decode": {...}}``;
  static shapes make them constant per call). Until the compiler writes that entry, an
  artifact falls back to ``GeometryWork`` on its manifest's geometry with static shapes
  (every call sees N + B keys), and ``source`` says so.

Bytes moved assume nothing stays in on-chip caches between steps (the weights, 0.5 GB in
fp32 for SmolLM2-135M, are far larger than any phone's system cache): every step reads all
layer weights and the LM head once, reads the keys and values it attends to, and writes
its new entries and the compacted cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..artifact.manifest import Keys, Manifest
from ..models.config import ModelConfig


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, k: float) -> "Work":
        return Work(self.flops * k, self.bytes * k)


ZERO = Work(0.0, 0.0)


class WorkModel(Protocol):
    source: str

    def block(self, n_cache: int, b: int, evicts: bool, value_bytes: int = 4) -> Work: ...

    def decode(self, n_cache: int, evicts: bool, value_bytes: int = 4) -> Work: ...


@dataclass
class GeometryWork:
    cfg: ModelConfig
    static_keys: int | None = None  # compiled: every call attends to this many slots (N + B)
    source: str = "geometry (model config + N + B)"
    # an artifact's stored weight bytes (its memory plan: 4-bit blocks for --weights q4); None:
    # every parameter at the precision's bytes per value
    weight_bytes: int | None = None

    def _layer_weights(self) -> int:
        c = self.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        n = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        n += 2 * c.hidden_size + ((q + 2 * kv) if c.attention_bias else 0)
        return n

    def weight_params(self) -> int:
        """Parameters one step reads: all layers, final norm, LM head (the embedding's b rows aside)."""
        c = self.cfg
        return c.num_layers * self._layer_weights() + c.hidden_size + c.vocab_size * c.hidden_size

    def _step(self, n_cache: int, b: int, evicts: bool, vb: int) -> Work:
        c = self.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        keys = self.static_keys if self.static_keys is not None else n_cache + b
        # per layer: q/k/v/o projections, SwiGLU MLP, attention (QK^T and PV over `keys`
        # keys, masked dense as the kernels run it), softmax, norms, RoPE
        gemm = 2 * b * c.hidden_size * (q + 2 * kv) + 2 * b * q * c.hidden_size
        gemm += 2 * b * c.hidden_size * c.intermediate_size * 3
        attn = 4 * b * q * keys + 5 * b * c.num_heads * keys
        elem = b * (8 * c.hidden_size + 4 * c.intermediate_size + 6 * (q + kv))
        kv_read = c.num_kv_heads * keys * 2 * c.head_dim * vb
        kv_write = c.num_kv_heads * b * (2 * c.head_dim * vb + 4)
        act = vb * b * (6 * c.hidden_size + 2 * (q + 2 * kv) + 3 * c.intermediate_size)
        ev_flops = ev_bytes = 0
        if evicts:  # score every candidate key (norm, anchor, cosine), top-k, gather kept K/V/pos
            cand = self.static_keys if self.static_keys is not None else n_cache + b
            ev_flops = c.num_kv_heads * cand * (6 * c.head_dim + 16)
            ev_bytes = c.num_kv_heads * (cand * c.head_dim * vb + 2 * cand * (2 * c.head_dim * vb + 4))
        per_layer = Work(gemm + attn + elem + ev_flops, kv_read + kv_write + act + ev_bytes)
        head_rows = b if self.weight_bytes is not None else c.vocab_size + b  # the table is in weight_bytes
        head = Work(2 * c.hidden_size * c.vocab_size + 4 * c.hidden_size,
                    vb * head_rows * c.hidden_size)  # LM head (last row) + embedding rows
        weights = Work(0.0, float(self.weight_bytes if self.weight_bytes is not None else vb * self.weight_params()))
        return per_layer.scaled(c.num_layers) + head + weights

    def block(self, n_cache: int, b: int, evicts: bool, value_bytes: int = 4) -> Work:
        return self._step(n_cache, b, evicts, value_bytes)

    def attention_and_eviction_flops(self, b: int, keys: int) -> float:
        """FLOPs of the block-attention and eviction kernels alone (all layers)."""
        c = self.cfg
        attn = 4 * b * c.num_heads * c.head_dim * keys + 5 * b * c.num_heads * keys
        return float(c.num_layers * (attn + c.num_kv_heads * keys * (6 * c.head_dim + 16)))

    def decode(self, n_cache: int, evicts: bool, value_bytes: int = 4) -> Work:
        return self._step(n_cache, 1, evicts, value_bytes)


@dataclass
class ManifestWork:
    """Counts a compiled artifact measured from its own graph (static shapes: constant per call)."""

    prefill: Work
    decode_step: Work
    value_bytes: int = 4
    source: str = "artifact graph (manifest.json 'work')"

    def block(self, n_cache: int, b: int, evicts: bool, value_bytes: int = 4) -> Work:
        k = value_bytes / self.value_bytes
        return Work(self.prefill.flops, self.prefill.bytes * k)

    def decode(self, n_cache: int, evicts: bool, value_bytes: int = 4) -> Work:
        k = value_bytes / self.value_bytes
        return Work(self.decode_step.flops, self.decode_step.bytes * k)


def work_from_manifest(manifest: Manifest, cfg: ModelConfig) -> WorkModel:
    """Counts the artifact recorded from its graph (``graph_work.count_module``), else geometry."""
    W, C = Keys.Work, Keys.WorkCount
    n_static = manifest.budget + manifest.block
    w = manifest.work
    if w is not None and W.PREFILL_BLOCK in w and W.DECODE in w:
        vb = {"float32": 4, "float16": 2, "int8": 1}.get(manifest.dtype, 4)
        pre, dec = w[W.PREFILL_BLOCK], w[W.DECODE]
        source = "artifact graph (manifest.json 'work')"
        pre_f, dec_f = float(pre[C.FLOPS]), float(dec[C.FLOPS])
        if pre.get(C.UNESTIMATED) or dec.get(C.UNESTIMATED):
            # TVM cannot estimate kernels with data-dependent loops (attention, top-k): add their
            # FLOPs from the geometry, and say so
            g = GeometryWork(cfg, static_keys=n_static)
            b = manifest.block
            if pre.get(C.UNESTIMATED):
                pre_f += g.attention_and_eviction_flops(b, n_static)
            if dec.get(C.UNESTIMATED):
                dec_f += g.attention_and_eviction_flops(1, n_static)
            source += " + geometry FLOPs for kernels TVM cannot estimate (" + ", ".join(
                sorted(set(pre.get(C.UNESTIMATED, []) + dec.get(C.UNESTIMATED, [])))[:4]) + ")"
        return ManifestWork(Work(pre_f, float(pre[C.BYTES])), Work(dec_f, float(dec[C.BYTES])), vb, source)
    weights = manifest.memory_plan.weights_bytes
    fmt = (manifest.weights or {}).get(Keys.Weights.FORMAT, "fp32")
    return GeometryWork(cfg, static_keys=n_static, weight_bytes=weights,
                        source=f"geometry of the artifact's manifest (static N + B shapes; its {fmt} weights, "
                               f"{weights / 2**20:.1f} MiB read per step); the manifest has no 'work' counts")


@dataclass(frozen=True)
class Schedule:
    """Cache length seen by each prefill block and decode step of one run."""

    prompt: int
    new_tokens: int
    budget: int
    block: int
    evicting: bool  # False for `full`: the cache just grows

    def blocks(self):
        n = 0
        for start in range(0, self.prompt, self.block):
            b = min(self.block, self.prompt - start)
            evicts = self.evicting and n + b > self.budget
            yield n, b, evicts
            n = min(n + b, self.budget) if self.evicting else n + b

    def decode_steps(self):
        n = min(self.prompt, self.budget) if self.evicting else self.prompt
        for _ in range(max(0, self.new_tokens - 1)):  # the first token comes from prefill's logits
            evicts = self.evicting and n + 1 > self.budget
            yield n, evicts
            n = min(n + 1, self.budget) if self.evicting else n + 1


def total_prefill(model: WorkModel, sched: Schedule, value_bytes: int = 4) -> tuple[Work, list[Work]]:
    per = [model.block(n, b, e, value_bytes) for n, b, e in sched.blocks()]
    total = ZERO
    for w in per:
        total = total + w
    return total, per
