"""One layer's fixed-size KV cache: buffers allocated once, never grown.

Capacity is N + B (+ the policy's extra query rows, e.g. DapQ's pseudo tokens, whose K/V
live in the tail only while their block runs). Entries [0, length) are the live cache in
temporal order; a block is written at [length, length + b), attended, then the policy's
kept indices are gathered back to the front (compaction)."""

from __future__ import annotations

import torch

from ..policies.base import Selection

POSITION_DTYPE = torch.int32


class LayerCache:
    def __init__(self, num_kv_heads: int, capacity: int, head_dim: int, state_names=(), dtype=torch.float32):
        self.capacity = capacity
        self.keys = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype)
        self.values = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype)
        self.positions = torch.zeros(num_kv_heads, capacity, dtype=POSITION_DTYPE)
        self.state = {name: torch.zeros(num_kv_heads, capacity, dtype=torch.float32) for name in state_names}
        self.length = 0

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, self.positions, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write b new entries at slots [start, start + b); positions [b] are shared by all heads."""
        end = start + keys.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"cache overflow: {end} entries > capacity {self.capacity}")
        self.keys[:, start:end] = keys
        self.values[:, start:end] = values
        self.positions[:, start:end] = positions.to(POSITION_DTYPE)
        for buf in self.state.values():
            buf[:, start:end] = 0.0

    def view(self, n: int):
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
        new_keys = selection.keys if selection.keys is not None else self.keys[rows, idx]
        new_values = selection.values if selection.values is not None else self.values[rows, idx]
        new_positions = self.positions[rows, idx]
        new_state = {name: buf[rows, idx] for name, buf in self.state.items()}
        self.keys[:, :k] = new_keys
        self.values[:, :k] = new_values
        self.positions[:, :k] = new_positions
        for name, buf in self.state.items():
            buf[:, :k] = new_state[name]
        self.length = k
