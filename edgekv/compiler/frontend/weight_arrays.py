"""The weight arrays a compile starts from: views of the model's tensors, or — for a model whose
weights stay in their file (``models.gguf_weights.GGUFWeights``) — ``FileWeight`` handles that read
one tensor when something needs its values.

The export only needs shapes (``export.py`` traces placeholders), and a q4 build of a K-quant GGUF
takes most matrices' blocks straight from the file (``quant_formats.GGUFBlocks``), so a handle that
is never read costs nothing; those that are (the embedding re-stored as Q8_0, the F32 norms and
biases) are read one at a time by the weight layout (``pipeline.lay_out_weights``)."""

from __future__ import annotations

from typing import Any

import numpy as np


class FileWeight:
    """One weight kept in the model's file: its shape and dtype now, its values on ``np.asarray``
    (read anew each time, not cached). ``.T`` is the transposed handle, as numpy's ``.T`` is a view."""

    def __init__(self, weights: Any, name: str, shape: tuple[int, ...], transposed: bool = False):
        self.weights, self.name, self.transposed = weights, name, transposed
        self.shape = tuple(shape[::-1]) if transposed else tuple(shape)
        self.dtype = np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 4

    @property
    def T(self) -> "FileWeight":  # noqa: N802 - numpy's name
        base = self.shape[::-1] if self.transposed else self.shape
        return FileWeight(self.weights, self.name, base, not self.transposed)

    def __array__(self, dtype=None, copy=None):
        a = self.weights.array(self.name)
        a = a.T if self.transposed else a
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"FileWeight({self.name!r}, {self.shape}{', transposed' if self.transposed else ''})"


def model_weight_arrays(model: Any) -> dict[str, Any]:
    """HF name → the array a compile starts from: a ``FileWeight`` for weights kept in their file,
    else a float32 numpy view of the model's tensor (no copy for fp32 weights)."""
    import torch

    weights = model.weights
    if hasattr(weights, "array") and hasattr(weights, "shapes"):
        return {n: FileWeight(weights, n, s) for n, s in weights.shapes.items()}
    return {n: t.detach().to(torch.float32).numpy() for n, t in weights.items()}


def materialize(params: list[tuple[str, Any]]) -> None:
    """Read every ``FileWeight`` of ``params`` in place, one at a time (C-contiguous float32)."""
    for i, (n, a) in enumerate(params):
        if isinstance(a, FileWeight):
            params[i] = (n, np.ascontiguousarray(np.asarray(a)))
