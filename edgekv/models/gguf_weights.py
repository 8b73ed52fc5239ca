"""A GGUF's weights under HF names, dequantised when asked for and not kept.

``GGUFWeights`` is the mapping a ``LoadedModel`` holds when nothing needs the whole fp32 model at
once: a compile exports shapes only (``compiler/frontend/export.py``), keeps the file's own
blocks for the quantised matrices and dequantises just the tensors it re-stores (the embedding's
Q8_0 copy, the F32 norms and biases), one at a time — so a 1.5B compile never holds the 5.8 GiB
fp32 model nor waits for its conversion. The streamed conversion (``loader.convert_gguf_streamed``)
writes the same tensors to disk for the eager engine, which reads every weight on every step.

Each tensor is exactly ``gguf.quants.dequantize`` of the file's data, with llama.cpp's q/k row
permutation undone where the architecture has one (``STREAMED_ARCHS``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ModelError

# GGUF architectures whose tensors map to HF names with at most llama.cpp's q/k row permutation
# (transformers' TENSOR_PROCESSORS do the same: llama.cpp permutes Llama's q/k, not Qwen2's)
STREAMED_ARCHS = {"llama": True, "qwen2": False}  # arch → q/k rows permuted in the file
ROWS = 8192  # rows dequantised at a time (the 151,936-row Q4_K embedding: ~50 MiB of fp32 per step, not 0.9 GiB × temporaries)


def hf_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every HF weight name of the model class and its shape (a meta-device model: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(hf_config).state_dict().items()}


class GGUFWeights(Mapping):
    """HF name → fp32 ``torch.Tensor``, dequantised from the file on each access (not cached).

    ``shapes`` gives every tensor's shape without reading it; ``array(name)`` the numpy array."""

    def __init__(self, path: Path, reader: Any, hf_config: Any, arch: str):
        import gguf

        if arch not in STREAMED_ARCHS:
            raise ModelError(f"'{path}': GGUF architecture '{arch}' is not read tensor by tensor "
                             f"(only {', '.join(STREAMED_ARCHS)})")
        self.path, self.reader, self.arch = Path(path), reader, arch
        self.heads = int(hf_config.num_attention_heads)
        self.kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self.heads)
        shapes = hf_shapes(hf_config)
        names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                         hf_config.num_hidden_layers)
        by_name = {t.name: t for t in reader.tensors}
        self.sources: dict[str, Any] = {}
        for hf_name in shapes:
            gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gname in by_name:
                self.sources[hf_name] = by_name[gname]
            elif not (hf_name == "lm_head.weight" and hf_config.tie_word_embeddings):
                raise ModelError(f"'{path}' has no tensor for {hf_name} (GGUF name {gname}); the file is not a "
                                 f"complete {arch} model")
        self.shapes = {n: shapes[n] for n in self.sources}

    def array(self, name: str) -> np.ndarray:
        """The tensor as a new, writable fp32 numpy array in HF layout."""
        import gguf

        t = self.sources[name]
        data = t.data
        if data.ndim == 2 and data.shape[0] > ROWS:  # rows at a time: the dequantiser's temporaries stay small
            w = None
            for r in range(0, data.shape[0], ROWS):
                part = gguf.quants.dequantize(data[r:r + ROWS], t.tensor_type)
                if w is None:
                    w = np.empty((data.shape[0],) + part.shape[1:], np.float32)
                w[r:r + len(part)] = part
        else:  # own and writable: F32 tensors come back as views of the file
            w = np.array(gguf.quants.dequantize(data, t.tensor_type), np.float32)
        w = w.reshape(self.shapes[name])
        if STREAMED_ARCHS[self.arch] and (".attn_q." in t.name or ".attn_k." in t.name):
            from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

            kv = self.heads if ".attn_q." in t.name else self.kv_heads
            w = np.ascontiguousarray(LlamaTensorProcessor()._reverse_permute_weights(w, self.heads, kv))
        return w

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.sources:
            raise KeyError(name)
        return torch.from_numpy(self.array(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def __contains__(self, name: object) -> bool:
        return name in self.sources

    @property
    def fp32_bytes(self) -> int:
        return sum(4 * int(np.prod(s)) for s in self.shapes.values())
