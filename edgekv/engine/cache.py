"""One layer's fixed-size KV cache: buffers allocated once, never grown.

Capacity is N + B (+ the policy's extra query rows, e.g. DapQ's pseudo tokens, whose K/V
live in the tail only while their block runs). Entries [0, length) are the live cache in
temporal order; a block is written at [length, length + b), attended, then the policy's
kept indices are gathered back to the front (compaction).

A local (sliding-window) layer's cache is a ``RingLayerCache``: exactly window + B slots, a token
written in place at slot position mod capacity, nothing scored or compacted — the oldest entries
it overwrites are ones no query of the window can see any more.

Two storage formats (``memory.KV_DTYPES``): ``LayerCache`` holds K and V in float32;
``Int8LayerCache`` holds int8 codes and float16 scales (``kv_quant``: quantised on write) and
gives every reader the dequantised rows through the same ``keys`` / ``values`` / ``view``."""

from __future__ import annotations

import torch

from ..memory import DEFAULT_KV_DTYPE, check_kv_dtype, int8_scale_groups
from ..policies.base import Selection
from .kv_quant import SCALE_DTYPE, dequantize_rows, quantize_rows

POSITION_DTYPE = torch.int32


class LayerCache:
    kv_dtype = "fp32"

    def __init__(self, num_kv_heads: int, capacity: int, head_dim: int, state_names=(), dtype=torch.float32):
        self.capacity = capacity
        self.keys = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype)
        self.values = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype)
        self.positions = torch.zeros(num_kv_heads, capacity, dtype=POSITION_DTYPE)
        self.state = {name: torch.zeros(num_kv_heads, capacity, dtype=torch.float32) for name in state_names}
        self.length = 0

    # ---- what is stored (memory accounting, snapshots) ---------------------------------------
    def stored_tensors(self) -> list[torch.Tensor]:
        """Every buffer this cache holds, in a snapshot's order: K, V, positions, the policy's state."""
        return [self.keys, self.values, self.positions, *self.state.values()]

    def restore_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Take buffers shaped as ``stored_tensors`` (a loaded snapshot's)."""
        self.keys, self.values, self.positions = tensors[:3]
        self.state = dict(zip(self.state, tensors[3:]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())

    # ---- writing, reading, compaction ------------------------------------------------------------
    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write b new entries at slots [start, start + b); positions [b] are shared by all heads."""
        end = start + keys.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"cache overflow: {end} entries > capacity {self.capacity}")
        self._store_rows(start, end, keys, values)
        self.positions[:, start:end] = positions.to(POSITION_DTYPE)
        for buf in self.state.values():
            buf[:, start:end] = 0.0

    def _store_rows(self, start: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[:, start:end] = keys
        self.values[:, start:end] = values

    def view(self, n: int):
        """(keys [H, n, d], values [H, n, d], positions [H, n]) of the first n slots, as attention and
        the policies read them."""
        return self.keys[:, :n], self.values[:, :n], self.positions[:, :n]

    def compact(self, n: int, selection: Selection) -> None:
        """Keep selection.kept (indices into the first n slots, [H, k]) and move them to the front."""
        kept = selection.kept
        heads, k = kept.shape
        if k > n or (k and (int(kept.min()) < 0 or int(kept.max()) >= n)):
            raise RuntimeError(f"policy returned invalid indices for {n} candidates")
        idx = kept.long()
        rows = torch.arange(heads)[:, None]
        # advanced indexing copies [H, k] rows in one pass (torch.gather on a strided view is
        # ~50x slower on CPU here)
        self._compact_rows(rows, idx, k, selection)
        new_positions = self.positions[rows, idx]
        new_state = {name: buf[rows, idx] for name, buf in self.state.items()}
        self.positions[:, :k] = new_positions
        for name, buf in self.state.items():
            buf[:, :k] = new_state[name]
        self.length = k

    def _compact_rows(self, rows: torch.Tensor, idx: torch.Tensor, k: int, selection: Selection) -> None:
        new_keys = selection.keys if selection.keys is not None else self.keys[rows, idx]
        new_values = selection.values if selection.values is not None else self.values[rows, idx]
        self.keys[:, :k] = new_keys
        self.values[:, :k] = new_values


class Int8LayerCache(LayerCache):
    """K and V as int8 codes [H, capacity, d] with float16 scales [H, capacity, ⌈d/32⌉]
    (``kv_quant``): rows are quantised when they are written and dequantised whenever they are read.
    ``keys`` / ``values`` (the whole buffer) and ``view(n)`` return fresh float32 dequantised tensors,
    so the fp32 originals of a cached row are never kept and never seen by attention or a policy;
    nothing else in float32 stays allocated between reads."""

    kv_dtype = "int8"

    def __init__(self, num_kv_heads: int, capacity: int, head_dim: int, state_names=()):
        groups = int8_scale_groups(head_dim)
        self.capacity = capacity
        self.key_codes = torch.zeros(num_kv_heads, capacity, head_dim, dtype=torch.int8)
        self.value_codes = torch.zeros(num_kv_heads, capacity, head_dim, dtype=torch.int8)
        self.key_scales = torch.zeros(num_kv_heads, capacity, groups, dtype=SCALE_DTYPE)
        self.value_scales = torch.zeros(num_kv_heads, capacity, groups, dtype=SCALE_DTYPE)
        self.positions = torch.zeros(num_kv_heads, capacity, dtype=POSITION_DTYPE)
        self.state = {name: torch.zeros(num_kv_heads, capacity, dtype=torch.float32) for name in state_names}
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        return dequantize_rows(self.key_codes, self.key_scales)

    @property
    def values(self) -> torch.Tensor:
        return dequantize_rows(self.value_codes, self.value_scales)

    def stored_tensors(self) -> list[torch.Tensor]:
        """K codes, V codes, positions, the policy's state, then K scales and V scales (the first
        entries line up with an fp32 cache's: a snapshot's layer 0 field 0 is always the keys)."""
        return [self.key_codes, self.value_codes, self.positions, *self.state.values(),
                self.key_scales, self.value_scales]

    def restore_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.key_codes, self.value_codes, self.positions = tensors[:3]
        states = len(self.state)
        self.state = dict(zip(self.state, tensors[3 : 3 + states]))
        self.key_scales, self.value_scales = tensors[3 + states :]

    def _store_rows(self, start: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.key_codes[:, start:end], self.key_scales[:, start:end] = quantize_rows(keys)
        self.value_codes[:, start:end], self.value_scales[:, start:end] = quantize_rows(values)

    def view(self, n: int):
        return (dequantize_rows(self.key_codes[:, :n], self.key_scales[:, :n]),
                dequantize_rows(self.value_codes[:, :n], self.value_scales[:, :n]), self.positions[:, :n])

    def _compact_rows(self, rows: torch.Tensor, idx: torch.Tensor, k: int, selection: Selection) -> None:
        for codes, scales, replacement in ((self.key_codes, self.key_scales, selection.keys),
                                           (self.value_codes, self.value_scales, selection.values)):
            new_codes, new_scales = codes[rows, idx], scales[rows, idx]
            if replacement is not None:
                # a merge-on-evict policy (D2O) hands back rows of its own: the merged ones are new values,
                # quantised on write like any row; a row it left as read keeps its codes bit for bit
                changed = (replacement.float() != dequantize_rows(new_codes, new_scales)).any(dim=-1)
                if bool(changed.any()):
                    fresh_codes, fresh_scales = quantize_rows(replacement)
                    new_codes = torch.where(changed[..., None], fresh_codes, new_codes)
                    new_scales = torch.where(changed[..., None], fresh_scales, new_scales)
            codes[:, :k] = new_codes
            scales[:, :k] = new_scales


def new_layer_cache(num_kv_heads: int, capacity: int, head_dim: int, state_names=(),
                    kv_dtype: str = DEFAULT_KV_DTYPE) -> LayerCache:
    """A layer's cache in the ``kv_dtype`` storage format (``memory.KV_DTYPES``)."""
    if check_kv_dtype(kv_dtype, "kv_dtype") == "int8":
        return Int8LayerCache(num_kv_heads, capacity, head_dim, state_names)
    return LayerCache(num_kv_heads, capacity, head_dim, state_names)


# the position of a ring slot not written yet: below every query's window, so attention masks it
EMPTY_POSITION = -(1 << 30)


class RingLayerCache:
    """A sliding-window layer's cache: ``capacity`` = window + B slots (``memory.ring_capacity``) of
    either storage format, token p at slot p mod capacity. A block of b ≤ B tokens at p … p+b−1
    overwrites positions ≤ p+b−1−capacity = p−W−(B−b+1), older than every query's window (a query at q
    sees keys > q − W), so the ring is exact: the local layer's attention equals a full cache's with
    the window mask. No policy state, no scores, no compaction."""

    def __init__(self, num_kv_heads: int, capacity: int, head_dim: int, kv_dtype: str = DEFAULT_KV_DTYPE):
        self.inner = new_layer_cache(num_kv_heads, capacity, head_dim, (), kv_dtype)
        self.inner.positions.fill_(EMPTY_POSITION)
        self.capacity = capacity
        self.state: dict = {}
        self.filled = 0  # slots [0, filled) have been written (the ring fills from slot 0)

    @property
    def kv_dtype(self) -> str:
        return self.inner.kv_dtype

    @property
    def positions(self) -> torch.Tensor:
        return self.inner.positions

    @property
    def length(self) -> int:
        return self.filled

    @length.setter
    def length(self, n: int) -> None:  # a snapshot's restore
        self.filled = int(n)

    def write_block(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write b consecutive positions in place (at most two runs of slots: the ring wraps once)."""
        b = positions.numel()
        if b > self.capacity:
            raise RuntimeError(f"a block of {b} tokens does not fit a ring of {self.capacity} slots")
        start = int(positions[0]) % self.capacity
        first = min(b, self.capacity - start)
        self.inner.write(start, keys[:, :first], values[:, :first], positions[:first])
        if first < b:
            self.inner.write(0, keys[:, first:], values[:, first:], positions[first:])
        self.filled = max(self.filled, min(self.capacity, start + b))

    def view(self, n: int | None = None):
        """(keys, values, positions) of every written slot, in slot order (not temporal: attention
        masks by position)."""
        return self.inner.view(self.filled)

    def stored_tensors(self) -> list[torch.Tensor]:
        return self.inner.stored_tensors()

    def restore_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.inner.restore_tensors(tensors)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes
