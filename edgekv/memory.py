"""Memory: a static plan in exact bytes before running, and the measured peak after.

The plan counts the tensors the engine itself allocates: weights, the fixed cache buffers
(N + B (+ pseudo rows) entries per layer and KV head: K, V, int32 positions, per-entry
policy state), and the largest set of per-block activations live at once in a layer step.
K and V are stored in one of ``KV_DTYPES`` (``--kv-dtype``): fp32, or int8 codes with one
float16 scale per ``INT8_GROUP`` channels of a row (``edgekv/engine/kv_quant.py`` says why);
every byte count here (and the byte budgets of ``budget.py``) counts the codes and their
scales exactly.
A family with sliding-window layers (``ModelConfig.layer_kinds``) has two kinds of cache: a local
layer holds a ring of exactly window + B entries (K, V, positions; no policy state), a global layer
the policy's N + B; every count below sums the two kinds.
The measured side is the process RSS high-water mark (what the OS charged) next to the
engine's own cache bytes, so a reader sees both what edgekv planned and what Python,
torch and the allocator added."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass

from .models.config import ModelConfig
from .units import human_bytes


# the element formats of the KV cache (`--kv-dtype`); the compiled path stores fp32 only (for now)
KV_DTYPES = ("fp32", "int8")
DEFAULT_KV_DTYPE = "fp32"
# channels of one K or V row that share one scale in the int8 format (GGML Q8_0's block)
INT8_GROUP = 32
SCALE_BYTES = 2  # the int8 format's scales are float16


class KVDtypeError(ValueError):
    """A KV cache format that edgekv does not have; the message names the choices."""


def check_kv_dtype(kv_dtype: str, option: str = "--kv-dtype") -> str:
    """``kv_dtype`` when it is one of ``KV_DTYPES``; otherwise a KVDtypeError naming the choices."""
    if kv_dtype not in KV_DTYPES:
        raise KVDtypeError(f"{option} {kv_dtype!r} is not a KV cache format edgekv has; choose one of "
                           f"{', '.join(KV_DTYPES)} (int8: 8-bit codes with a float16 scale per {INT8_GROUP} channels)")
    return kv_dtype


def int8_scale_groups(head_dim: int) -> int:
    """Scales per int8 row: one per ``INT8_GROUP`` channels (a shorter last group when d is not a multiple)."""
    return -(-head_dim // INT8_GROUP)


def kv_row_bytes(head_dim: int, kv_dtype: str = DEFAULT_KV_DTYPE, dtype_bytes: int = 4) -> int:
    """Bytes one K (or one V) row of one KV head occupies in the cache: d elements of ``dtype_bytes``
    (fp32), or d int8 codes plus their float16 scales (int8)."""
    if check_kv_dtype(kv_dtype, "kv_dtype") == "int8":
        return head_dim + SCALE_BYTES * int8_scale_groups(head_dim)
    return head_dim * dtype_bytes


def kv_entry_bytes(cfg: ModelConfig, kv_dtype: str = DEFAULT_KV_DTYPE, state_buffers: int = 0,
                   dtype_bytes: int = 4) -> int:
    """Bytes one entry of ONE layer's cache takes over its KV heads: K + V rows, the int32 position,
    ``state_buffers`` float32 policy states."""
    return cfg.num_kv_heads * (2 * kv_row_bytes(cfg.head_dim, kv_dtype, dtype_bytes) + 4 + 4 * state_buffers)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes one token of budget occupies in the cache over all the layers that a budget sizes (every
    layer, or a family's global layers: local layers hold their window whatever the budget) and KV
    heads: K + V (codes and scales for int8) plus its int32 position — what a byte budget divides by
    (``budget.parse_budget``)."""
    return len(cfg.global_layers) * kv_entry_bytes(cfg, kv_dtype)


def ring_capacity(window: int, block: int, max_tokens: int | None = None) -> int:
    """Entries of a local (sliding-window) layer's ring: window + B, or fewer when the whole
    sequence (``max_tokens``) is shorter (then nothing is ever overwritten)."""
    full = window + block
    return full if max_tokens is None else max(1, min(full, int(max_tokens)))


def local_kv_bytes(cfg: ModelConfig, block: int, kv_dtype: str = DEFAULT_KV_DTYPE, max_tokens: int | None = None,
                   dtype_bytes: int = 4) -> int:
    """The rings of every local layer (0 for a family without them)."""
    if not cfg.local_layers:
        return 0
    ring = ring_capacity(cfg.sliding_window, block, max_tokens)
    return len(cfg.local_layers) * ring * kv_entry_bytes(cfg, kv_dtype, 0, dtype_bytes)


@dataclass
class MemoryPlan:
    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def kv_cache_bytes(cfg: ModelConfig, capacity: int, state_buffers: int = 0, dtype_bytes: int = 4,
                   kv_dtype: str = DEFAULT_KV_DTYPE, block: int | None = None, max_tokens: int | None = None) -> int:
    """The cache buffers of all layers: ``capacity`` entries per global layer and KV head (K and V rows
    (``kv_row_bytes``), the int32 position and ``state_buffers`` float32 policy states per entry), and
    each local layer's ring of window + ``block`` entries (K, V, position; ``max_tokens`` bounds it).
    Without ``block`` every layer counts ``capacity`` entries: a uniform cache (the full cache of a
    sequence that a run is compared with)."""
    per_entry = kv_entry_bytes(cfg, kv_dtype, state_buffers, dtype_bytes)
    if block is None or not cfg.local_layers:
        return cfg.num_layers * capacity * per_entry
    rings = local_kv_bytes(cfg, block, kv_dtype, max_tokens, dtype_bytes)
    return len(cfg.global_layers) * capacity * per_entry + rings


def block_activation_bytes(cfg: ModelConfig, block: int, capacity: int, dtype_bytes: int = 4,
                           kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Largest live activation set of one layer step with b = block rows attending to
    `capacity` keys: residual + normed input, q/k/v, attention scores (the math path's
    [Hq, b, n] matrix, an upper bound for fused kernels), attention output, the MLP's gate,
    up and product, plus the last row's logits. With an int8 cache the eager engine also holds
    the layer's K and V dequantised to float32 while the layer attends and scores (``capacity`` rows)."""
    b = block
    per_row = cfg.hidden_size * 3 + cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.intermediate_size * 3
    scores = cfg.num_heads * b * capacity
    dequantised = 2 * cfg.num_kv_heads * capacity * cfg.head_dim if check_kv_dtype(kv_dtype, "kv_dtype") == "int8" else 0
    return dtype_bytes * (b * per_row + scores + cfg.vocab_size + dequantised)


def cache_capacity(budget: int, block: int, extra_rows: int = 0, max_tokens: int | None = None) -> int:
    """Entries per layer and KV head that the cache buffers hold: N + B (+ a policy's pseudo rows)
    — but never more than the sequence can fill. With ``max_tokens`` = prompt + output ≤ N
    nothing is ever evicted (and no pseudo rows are appended), so ``max_tokens`` entries suffice;
    above N, a step never writes past the sequence's length, so at most ``max_tokens`` + pseudo rows."""
    full = budget + block + extra_rows
    if max_tokens is None:
        return full
    max_tokens = max(1, int(max_tokens))
    return min(full, max_tokens if max_tokens <= budget else max_tokens + extra_rows)


def plan_memory(cfg: ModelConfig, weight_bytes: int, capacity: int, block: int, state_buffers: int = 0,
                kv_dtype: str = DEFAULT_KV_DTYPE, max_tokens: int | None = None, extra_rows: int = 0) -> MemoryPlan:
    """``extra_rows``: rows a step carries after its block (pseudo, question or reconstruction rows),
    which its activations hold too."""
    ring = ring_capacity(cfg.sliding_window, block, max_tokens) if cfg.local_layers else 0
    return MemoryPlan(
        weights=weight_bytes,
        kv_cache=kv_cache_bytes(cfg, capacity, state_buffers, kv_dtype=kv_dtype, block=block, max_tokens=max_tokens),
        activations=block_activation_bytes(cfg, block + int(extra_rows), max(capacity, ring), kv_dtype=kv_dtype),
    )


def peak_rss_bytes() -> int:
    """Process RSS high-water mark (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def available_bytes() -> tuple[int, str]:
    """Memory a new allocation can still get, and what sets it: the machine's available memory
    (``MemAvailable``), or less where a cgroup v2 ``memory.max`` or an address-space / data
    rlimit of this process leaves less."""
    import psutil

    avail, source = int(psutil.virtual_memory().available), "available memory of this machine"
    try:
        from pathlib import Path

        rel = next((ln.split("::", 1)[1] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::")), None)
        if rel is not None:
            d = Path("/sys/fs/cgroup") / rel.lstrip("/")
            limit = (d / "memory.max").read_text().strip() if (d / "memory.max").is_file() else "max"
            if limit != "max":
                left = int(limit) - int((d / "memory.current").read_text())
                if left < avail:
                    avail, source = max(0, left), f"memory left under this cgroup's memory.max ({int(limit)} bytes)"
    except (OSError, ValueError, StopIteration):
        pass
    try:  # cgroup v1 (memory controller): memory.limit_in_bytes
        from pathlib import Path

        rel = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.split(":", 2)[1] == "memory"), None)
        d = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") if rel is not None else None
        if d is not None and (d / "memory.limit_in_bytes").is_file():
            limit = int((d / "memory.limit_in_bytes").read_text())
            left = limit - int((d / "memory.usage_in_bytes").read_text())
            if limit < (1 << 60) and left < avail:
                avail, source = max(0, left), f"memory left under this cgroup's memory.limit_in_bytes ({limit} bytes)"
    except (OSError, ValueError, IndexError):
        pass
    for name, field in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft != resource.RLIM_INFINITY:
            from .simulate.limits import proc_status

            used = proc_status("self").get(field, 0)
            if soft - used < avail:
                avail, source = max(0, soft - used), f"what this process's {name} leaves"
    return avail, source


class MemoryPlanError(ValueError, MemoryError):
    """The static memory plan does not fit the limit or the machine; the message gives the numbers.
    (A MemoryError too: under ``edgekv simulate``'s cap it means "does not fit".)"""


def check_plan(plan: MemoryPlan, *, mem_limit: int | None = None, resident: int = 0, hint: str = "") -> None:
    """Refuse a plan before anything of it is allocated: above ``mem_limit`` (the whole plan), or
    above what the machine can still give (the plan minus ``resident``: bytes of it already in
    memory, such as loaded weights)."""
    h = human_bytes  # the messages below name many sizes
    parts = (f"weights {h(plan.weights)} + KV cache {h(plan.kv_cache)} + activations {h(plan.activations)}")
    if mem_limit is not None and plan.weights > mem_limit:
        raise MemoryPlanError(f"the model's weights alone need {h(plan.weights)}, above --mem-limit {h(mem_limit)} "
                              f"(the whole plan: {h(plan.total)} = {parts}); raise --mem-limit or use a smaller model")
    if mem_limit is not None and plan.total > mem_limit:
        raise MemoryPlanError(f"the memory plan needs {h(plan.total)} ({parts}), above --mem-limit {h(mem_limit)}"
                              + (f"; {hint}" if hint else ""))
    need = plan.total - resident
    avail, source = available_bytes()
    if need > avail:
        raise MemoryPlanError(f"the memory plan needs {h(plan.total)} ({parts}); {h(need)} of it is still to be "
                              f"allocated and only {h(avail)} is free ({source})" + (f"; {hint}" if hint else ""))


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss
