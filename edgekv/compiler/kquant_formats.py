"""GGUF block formats kept as they are in a q4 artifact: llama.cpp's K-quants Q4_K and Q6_K
and the 5-bit Q5_0 (what Q4_K_M files of Qwen2.5 and Gemma 3 hold), repacked losslessly into
column panels the CPU kernels (``kernels/kquant_dense.py``) read.

Every weight is ``S·q − M`` over small sub-blocks along K, with S and M built exactly as
``gguf.quants.dequantize`` builds them (fp32, the same operations in the same order), so the
weights the kernels multiply by equal gguf's dequantisation bit for bit:

* **Q4_K** — super-blocks of 256 with fp16 ``d``, ``dmin``; 8 sub-blocks of 32 with 6-bit
  scale ``sc`` and min ``m``; 4-bit q: w = (d·sc)·q − dmin·m.
* **Q6_K** — super-blocks of 256 with fp16 ``d``; 16 sub-blocks of 16 with int8 ``sc``;
  6-bit q: w = (d·sc)·(q − 32).
* **Q5_0** — blocks of 32 with fp16 ``d``; 5-bit q: w = d·(q − 16).

Stored per weight, column panels ``[N/NR, X, NR]`` like Q4_1's (``quant_formats``):

* ``ql`` [.., K/2, ..] uint8: the low 4 bits, quants i and i + 16 of each 32-group in byte i
  (GGML's Q4_1 pairing);
* ``qh`` [.., K·h/8, ..] uint8 (h = 2 for Q6_K, 1 for Q5_0): the high bits; per 32-group of
  HB = 4·h bytes, byte i1 holds the high bits of quants t·HB + i1 at bit t·h;
* the scales unpacked from GGML's 6-bit packing to one byte each (``sc``, ``m``), and the fp16
  super-block scales (``d``, ``dm``).

Bytes per weight: Q4_K 0.578 (GGUF 0.5625: the 6-bit scales take a byte each), Q6_K 0.8203
(= GGUF), Q5_0 0.6875 (= GGUF).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..units import padded

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class KFormat:
    name: str  # tag in input names: "q4k" | "q6k" | "q5"
    ggml: str  # GGML's block type
    sub: int  # weights per scale (sub-block)
    superblock: int  # weights per fp16 super-scale (0: the sub-block's own fp16 d)
    hbits: int  # high bits above the low nibble
    offset: int  # q − offset is the signed quant
    sc_dtype: str | None  # the sub-block scale's type (None: no sub-scale, d per sub-block)
    has_min: bool

    @property
    def ggml_type(self):
        import gguf

        return getattr(gguf.GGMLQuantizationType, self.ggml)

    @property
    def parts(self) -> tuple[str, ...]:
        """The stored arrays, in kernel argument order."""
        p = ("ql",) + (("qh",) if self.hbits else ()) + (("sc",) if self.sc_dtype else ())
        p += ("m",) if self.has_min else ()
        return p + (("d", "dm") if self.has_min else ("d",))

    @property
    def k_multiple(self) -> int:
        return self.superblock or self.sub

    def row_shapes(self, k: int) -> list[tuple[int, str]]:
        """(columns per row, dtype) of each part for a row of K weights."""
        cols = {"ql": (k // 2, "uint8"), "qh": (k * self.hbits // 8, "uint8"),
                "sc": (k // self.sub, self.sc_dtype), "m": (k // self.sub, "uint8"),
                "d": (k // (self.superblock or self.sub), "float16"), "dm": (k // self.superblock if self.superblock else 0, "float16")}
        return [cols[p] for p in self.parts]

    def bytes_per_weight(self) -> float:
        k = QK_K
        return sum(c * np.dtype(dt).itemsize for c, dt in self.row_shapes(k)) / k


Q4_K = KFormat("q4k", "Q4_K", 32, QK_K, 0, 0, "uint8", True)
Q6_K = KFormat("q6k", "Q6_K", 16, QK_K, 2, 32, "int8", False)
Q5_0 = KFormat("q5", "Q5_0", 32, 0, 1, 16, None, False)
KFORMATS = {f.ggml: f for f in (Q4_K, Q6_K, Q5_0)}


@dataclass
class KBlocks:
    """One [N, K] weight in a ``KFormat``: ``u`` [N, K] uint8 the unsigned quants (0 .. 2^(4+h) − 1)
    and the row arrays ``scales`` (``sc``, ``m``, ``d``, ``dm`` as the format has them)."""

    fmt: KFormat
    u: np.ndarray
    scales: dict[str, np.ndarray]
    k: int
    source: str = "gguf"

    def dequantize(self) -> np.ndarray:
        """[N, K] float32 with gguf's operations in gguf's order (the bit-exact reference)."""
        f, n = self.fmt, self.u.shape[0]
        q = (self.u.astype(np.int8) - np.int8(f.offset)).astype(np.float32).reshape(n, -1, f.sub)
        d = self.scales["d"].astype(np.float32)
        if f.superblock:
            per = f.superblock // f.sub
            s = (np.repeat(d, per, axis=1) * self.scales["sc"].astype(np.float32))[..., None]
        else:
            s = d[..., None]
        w = s * q
        if f.has_min:
            per = f.superblock // f.sub
            w = w - (np.repeat(self.scales["dm"].astype(np.float32), per, axis=1) * self.scales["m"].astype(np.float32))[..., None]
        return w.reshape(n, -1)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.row_arrays())

    def row_arrays(self) -> list[np.ndarray]:
        """The parts row by row ([N, X] each, ``fmt.parts`` order)."""
        n, k = self.u.shape
        f = self.fmt
        g = self.u.reshape(n, k // 32, 2, 16)
        out = {"ql": ((g[:, :, 0] & 15) | ((g[:, :, 1] & 15) << 4)).astype(np.uint8).reshape(n, k // 2)}
        if f.hbits:
            hb = 4 * f.hbits  # bytes of high bits per 32-group
            hi = (self.u >> 4).reshape(n, k // 32, 32 // hb, hb)  # [.., t, i1]: quant t·HB + i1
            shifts = (np.arange(32 // hb, dtype=np.uint8) * f.hbits)[None, None, :, None]
            out["qh"] = np.bitwise_or.reduce(hi << shifts, axis=2).astype(np.uint8).reshape(n, -1)
        out.update(self.scales)
        return [np.ascontiguousarray(out[p]) for p in f.parts]


def kblocks_from_ggml(raw: np.ndarray, fmt: KFormat, k: int) -> KBlocks:
    """GGML block bytes [N, K/block · block_bytes] (``ggml-common.h`` layouts, read the way
    ``gguf.quants`` reads them) → ``KBlocks``."""
    import gguf

    n = raw.shape[0]
    if fmt is Q4_K:
        blk = raw.reshape(-1, 144)
        d, dm = (np.ascontiguousarray(blk[:, o:o + 2]).view(np.float16) for o in (0, 2))
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blk[:, 4:16]))
        qs = blk[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        u = (qs & 15).reshape(n, k)
        scales = {"sc": sc.reshape(n, -1).astype(np.uint8), "m": m.reshape(n, -1).astype(np.uint8),
                  "d": d.reshape(n, -1), "dm": dm.reshape(n, -1)}
    elif fmt is Q6_K:
        blk = raw.reshape(-1, 210)
        ql = blk[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blk[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        u = ((ql & 15).reshape(-1, 8, 32) | ((qh & 3).reshape(-1, 8, 32) << 4)).reshape(n, k)
        scales = {"sc": np.ascontiguousarray(blk[:, 192:208]).view(np.int8).reshape(n, -1),
                  "d": np.ascontiguousarray(blk[:, 208:210]).view(np.float16).reshape(n, -1)}
    elif fmt is Q5_0:
        blk = raw.reshape(-1, 22)
        qh = np.ascontiguousarray(blk[:, 2:6]).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
        ql = blk[:, 6:].reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
        u = ((ql & 15).reshape(-1, 32) | ((qh & 1).astype(np.uint8) << 4)).reshape(n, k)
        scales = {"d": np.ascontiguousarray(blk[:, 0:2]).view(np.float16).reshape(n, -1)}
    else:
        raise ValueError(f"not a K-format: {fmt}")
    return KBlocks(fmt, np.ascontiguousarray(u.astype(np.uint8)), {a: np.ascontiguousarray(b) for a, b in scales.items()}, k)


def kpanel_shapes(fmt: KFormat, k: int, n: int, nr: int) -> list[tuple[tuple[int, ...], str]]:

    nj = padded(n, nr) // nr
    return [((nj, c, nr), dt) for c, dt in fmt.row_shapes(k)]


def kpanel_arrays(b: KBlocks, nr: int) -> list[np.ndarray]:
    """The row arrays as column panels [N/NR, X, NR] (N padded with zero rows)."""

    out = []
    for a in b.row_arrays():
        n = a.shape[0]
        p = np.zeros((padded(n, nr),) + a.shape[1:], a.dtype)
        p[:n] = a
        out.append(np.ascontiguousarray(p.reshape(-1, nr, a.shape[1]).transpose(0, 2, 1)))
    return out
