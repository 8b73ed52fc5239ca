"""Weight formats of a compiled artifact: fp32, and llama.cpp's Q4_1 and Q8_0 blocks.

``--weights q4`` stores every linear layer in GGML's **Q4_1** blocks (32 weights along the
input dimension K, a float16 scale ``d`` and float16 minimum ``m``, 4-bit quants ``q``:
w = d·q + m; 5 bits per weight) and the embedding / tied LM head in **Q8_0** (32 weights, a
float16 scale, int8 quants: w = d·q; 8.5 bits per weight) — the formats SmolLM2's GGUF ships.
``--weights q8`` stores the linear layers in Q8_0 too.

Where the source file holds a tensor in exactly the format asked for, its blocks are taken as
they are (the quants and scales byte for byte; only their order changes); otherwise the fp32
weights are quantised with ``gguf.quants`` (llama.cpp's reference quantiser in numpy). llama.cpp
stores q/k projections with their rows permuted for its RoPE; the rows are put back in the order
the HF weights use (a row permutation moves whole blocks, so it is exact).

The kernels (``kernels/quant_dense.py``) read a linear weight as column panels, like the fp32
ones (``pack_weights.py``): quants [N/NR, Kp/2, NR] uint8 (Q4_1: byte i of a block holds quants
i and i + 16, GGML's own pairing) or [N/NR, Kp, NR] int8 (Q8_0), scales and minima
[N/NR, Kp/32, NR] float16 — Kp is K rounded up to whole blocks (zero blocks pad it), N is
padded to whole panels the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..units import padded  # noqa: F401 - re-exported to the kernels

GROUP = 32  # weights per block along K (GGML's QK4_1 = QK8_0 = 32)
WEIGHT_CHOICES = ("q4", "q8", "fp32")


@dataclass(frozen=True)
class WeightFormat:
    name: str  # "q4" | "q8"
    ggml: str  # GGML's name of the block type
    bits: int  # bits per quant
    has_min: bool  # Q4_1 has a per-block minimum; Q8_0 is symmetric

    @property
    def ggml_type(self):
        import gguf

        return getattr(gguf.GGMLQuantizationType, self.ggml)

    @property
    def quant_dtype(self) -> str:
        return "uint8" if self.bits == 4 else "int8"

    def block_bytes(self) -> int:
        return 2 * (2 if self.has_min else 1) + GROUP * self.bits // 8


Q4_1 = WeightFormat("q4", "Q4_1", 4, True)
Q8_0 = WeightFormat("q8", "Q8_0", 8, False)
LINEAR_FORMAT = {"q4": Q4_1, "q8": Q8_0}
EMBEDDING_FORMAT = Q8_0  # the embedding / tied LM head in both q4 and q8 (as SmolLM2's GGUF has it)


@dataclass
class Blocks:
    """One [N, K] weight as blocks along K: ``q`` [N, Kp] quants (uint8 0..15 for Q4_1, int8 for
    Q8_0; one value per weight), ``d`` and ``m`` [N, Kp/32] float16 (``m`` None for Q8_0)."""

    fmt: WeightFormat
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    k: int  # the true K (Kp − k zero weights pad the last block)
    source: str  # "gguf" (the file's own blocks) | "quantized" (from fp32 with gguf.quants)

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, w = d·q (+ m): the reference the kernels are tested against."""
        n, kp = self.q.shape
        q = self.q.astype(np.float32).reshape(n, kp // GROUP, GROUP)
        w = q * self.d.astype(np.float32)[..., None]
        if self.m is not None:
            w = w + self.m.astype(np.float32)[..., None]
        return w.reshape(n, kp)[:, :self.k]

    @property
    def nbytes(self) -> int:
        return self.q.shape[0] * self.q.shape[1] * self.fmt.bits // 8 + self.d.nbytes + (0 if self.m is None else self.m.nbytes)


def blocks_from_ggml(raw: np.ndarray, fmt: WeightFormat, k: int, source: str) -> Blocks:
    """GGML block bytes [N, Kp/32 · block_bytes] → ``Blocks`` (the layout of ``ggml-common.h``:
    Q4_1 = d, m, 16 bytes of quants with quant i in the low and i + 16 in the high nibble of
    byte i; Q8_0 = d, 32 int8 quants)."""
    n = raw.shape[0]
    blk = raw.reshape(n, -1, fmt.block_bytes())
    d = np.ascontiguousarray(blk[..., 0:2]).view(np.float16)[..., 0]
    if fmt.has_min:
        m = np.ascontiguousarray(blk[..., 2:4]).view(np.float16)[..., 0]
        qs = blk[..., 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
    else:
        m = None
        q = np.ascontiguousarray(blk[..., 2:]).view(np.int8).reshape(n, -1)
    return Blocks(fmt, np.ascontiguousarray(q), np.ascontiguousarray(d), m, k, source)


def quantize(w: np.ndarray, fmt: WeightFormat, rows: int = 8192) -> Blocks:
    """[N, K] float32 → ``Blocks`` with GGML's reference quantiser (K padded with zeros to whole blocks),
    ``rows`` rows at a time: blocks are independent, and the quantiser's fp32 temporaries of a whole
    151,936 × 1,536 embedding would be gigabytes."""
    import gguf

    n, k = w.shape
    kp = padded(k, GROUP)
    parts = []
    for r in range(0, n, rows):
        wp = np.zeros((min(rows, n - r), kp), np.float32)
        wp[:, :k] = w[r:r + rows]
        parts.append(gguf.quants.quantize(wp, fmt.ggml_type))
    raw = np.concatenate(parts) if len(parts) != 1 else parts[0]
    return blocks_from_ggml(raw, fmt, k, "quantized")


# GGUF tensor types a quantised artifact takes: kept block for block (Q4_1, Q8_0 and the
# ``kquant_formats``), or exact floats (quantised here like any fp32 weight)
KEPT_TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0")
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = KEPT_TYPES + FLOAT_TYPES
# transformers' GGUF loader undoes llama.cpp's q/k row permutation for these architectures only
# (its TENSOR_PROCESSORS: convert_hf_to_gguf permutes Llama's q/k, not Qwen2's or Gemma 3's)
PERMUTED_ARCHS = ("llama",)


def _ggml_format(type_name: str):
    from .kquant_formats import KFORMATS

    return {"Q4_1": Q4_1, "Q8_0": Q8_0, **KFORMATS}.get(type_name)


class GGUFBlocks:
    """The quantised tensors of a GGUF file under their HF names, in HF row order — the tensor-name
    map of the file's own architecture (``general.architecture``: llama, qwen2, gemma3 ...) and
    the q/k rows put back where transformers' loader puts them (``PERMUTED_ARCHS``)."""

    def __init__(self, path: str | Path, hf_config: Any, num_layers: int, reader: Any = None):
        import gguf

        self.path = Path(path)
        self.reader = reader or gguf.GGUFReader(str(path))  # a 151K-token header takes ~15 s to read: pass it
        self.by_name = {t.name: t for t in self.reader.tensors}
        field = self.reader.fields.get("general.architecture")
        self.arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "llama"
        archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        self.names = gguf.get_tensor_name_map(archs.get(self.arch, gguf.MODEL_ARCH.LLAMA), num_layers)
        self.heads = int(hf_config.num_attention_heads)
        self.kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self.heads)

    def unsupported(self) -> list[tuple[str, str]]:
        """(tensor name, type) of every tensor whose type a quantised artifact cannot take."""
        return [(t.name, t.tensor_type.name) for t in self.reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]

    def _row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """llama.cpp permutes q/k rows for its RoPE (Llama only); the index that undoes it
        (transformers' own inverse permutation, applied to row numbers)."""
        if self.arch not in PERMUTED_ARCHS or (".attn_q." not in gguf_name and ".attn_k." not in gguf_name):
            return None
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        kv = self.heads if ".attn_q." in gguf_name else self.kv_heads
        idx = np.arange(rows, dtype=np.float64)[:, None]
        return LlamaTensorProcessor()._reverse_permute_weights(idx, self.heads, kv)[:, 0].astype(np.int64)

    def tensor(self, hf_name: str, shape: tuple[int, int]):
        """The file's tensor behind ``hf_name`` when it has this [N, K] shape, else None."""
        gname = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = self.by_name.get(gname) if gname else None
        if t is None or tuple(int(s) for s in t.shape[::-1]) != tuple(shape):
            return None
        return t

    def kept_format(self, hf_name: str, shape: tuple[int, int]):
        """The format a q4 artifact keeps ``hf_name`` in: its own (Q4_1, Q8_0, Q4_K, Q6_K, Q5_0)
        when the kernels take that shape, else None (quantised to Q4_1 from fp32)."""
        t = self.tensor(hf_name, shape)
        fmt = _ggml_format(t.tensor_type.name) if t is not None else None
        if fmt is None or shape[1] % getattr(fmt, "k_multiple", GROUP):
            return None
        return fmt

    def get(self, hf_name: str, fmt, shape: tuple[int, int]):
        """The file's blocks of ``hf_name`` (``Blocks``, or ``KBlocks`` for a K-format) when it
        stores them in ``fmt`` with this [N, K] shape, else None."""
        from .kquant_formats import KFormat, kblocks_from_ggml

        t = self.tensor(hf_name, shape)
        if t is None or t.tensor_type.name != fmt.ggml:
            return None
        raw = np.asarray(t.data).reshape(shape[0], -1)
        order = self._row_order(t.name, shape[0])
        if order is not None:
            raw = raw[order]
        if isinstance(fmt, KFormat):
            return kblocks_from_ggml(raw, fmt, shape[1])
        return blocks_from_ggml(raw, fmt, shape[1], "gguf")


def weight_blocks(w: np.ndarray, fmt: WeightFormat, source: GGUFBlocks | None, hf_name: str) -> Blocks:
    """The source file's blocks when it has this weight in ``fmt``, else ``w`` quantised."""
    got = source.get(hf_name, fmt, w.shape) if source is not None else None
    return got if got is not None else quantize(np.asarray(w, np.float32), fmt)


def open_source_blocks(model: Any) -> GGUFBlocks | None:
    """The model's GGUF file as a block source (None for HF directories and ONNX files)."""
    path = getattr(model, "source", None)
    if path is None or Path(path).suffix.lower() != ".gguf" or not Path(path).is_file():
        return None
    reader = getattr(getattr(model, "weights", None), "reader", None)  # weights left in the file: its reader
    return GGUFBlocks(path, model.hf_config, model.config.num_layers, reader)


def unsupported_types_message(model: Any) -> str | None:
    """Why a quantised artifact of ``model`` is refused (a tensor type it cannot take), else None."""
    src = open_source_blocks(model)
    bad = src.unsupported() if src is not None else []
    if not bad:
        return None
    name, kind = bad[0]
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return (f"{src.path.name}: tensor {name!r} is {kind}{more}, a GGUF type the compiler does not support; "
            f"supported: {', '.join(SUPPORTED_TYPES)}. Use a GGUF quantised to one of those (e.g. Q4_K_M), "
            "or compile with --weights fp32")


def default_weights(model: Any) -> str:
    """``q4`` when most source weights are 4- to 6-bit blocks (a GGUF whose matrices are
    Q4_1/Q4_K/Q5_0/Q6_K...), else fp32."""
    src = open_source_blocks(model)
    if src is None:
        return "fp32"
    kinds = [t.tensor_type.name for t in src.reader.tensors if len(t.shape) == 2]
    return "q4" if kinds and sum(k[:2] in ("Q4", "Q5", "Q6") for k in kinds) * 2 > len(kinds) else "fp32"


# ---- panel layouts for the kernels ----------------------------------------------------------

def stored_quants(b: Blocks, sequential: bool = False) -> np.ndarray:
    """[N, Kp/2] uint8 with quants i and i + 16 of each block in byte i (Q4_1, GGML's pairing) —
    or, ``sequential``, quants 2j and 2j + 1 in byte j (the GPU layout: an index dlight's GEMV rule
    follows) — or the [N, Kp] int8 quants as they are (Q8_0)."""
    if b.fmt.bits != 4:
        return b.q
    n, kp = b.q.shape
    if sequential:
        q = b.q.reshape(n, kp // 2, 2)
        return (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8)
    q = b.q.reshape(n, kp // GROUP, 2, GROUP // 2)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).astype(np.uint8).reshape(n, kp // 2)


def panel_arrays(b: Blocks, nr: int) -> list[np.ndarray]:
    """``Blocks`` of a [N, K] weight → the kernels' panel arrays (module docstring): quants
    [N/NR, Kp/2, NR] uint8 (Q4_1) or [N/NR, Kp, NR] int8 (Q8_0), then d (and m) [N/NR, Kp/32, NR] float16;
    N padded to whole panels with zero blocks."""
    n, kp = b.q.shape
    np_ = padded(n, nr)

    def panels(a):  # [N, X] → [Np/NR, X, NR]
        out = np.zeros((np_,) + a.shape[1:], a.dtype)
        out[:n] = a
        return np.ascontiguousarray(out.reshape(np_ // nr, nr, -1).transpose(0, 2, 1))

    arrays = [panels(stored_quants(b)), panels(b.d)]
    if b.m is not None:
        arrays.append(panels(b.m))
    return arrays


def panel_shapes(fmt: WeightFormat, k: int, n: int, nr: int) -> list[tuple[tuple[int, ...], str]]:
    kp, np_ = padded(k, GROUP), padded(n, nr)
    qk = kp // 2 if fmt.bits == 4 else kp
    shapes = [((np_ // nr, qk, nr), fmt.quant_dtype), ((np_ // nr, kp // GROUP, nr), "float16")]
    if fmt.has_min:
        shapes.append(((np_ // nr, kp // GROUP, nr), "float16"))
    return shapes


def row_arrays(b: Blocks, gpu: bool = False) -> list[np.ndarray]:
    """Blocks row by row: quants ``stored_quants`` [N, Kp/2 or Kp], d (and m) [N, Kp/32] —
    float16 as stored (the CPU's embedding / tied LM head), or for GPU builds float32 (widened
    exactly, for devices without cl_khr_fp16) with sequential nibble pairs."""
    scales = [b.d] + ([b.m] if b.m is not None else [])
    return [stored_quants(b, sequential=gpu)] + [np.ascontiguousarray(a.astype("float32" if gpu else "float16"))
                                                 for a in scales]
