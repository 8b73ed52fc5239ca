"""The CPU GEMMs' register tile, sized from the target's vector registers — one piece shared by
the fp32 GEMM (``dense.py``), the Q4_1 / Q8_0 one (``quant_dense.py``) and the K-quant one
(``kquant_dense.py``).

Each GEMM runs one parallel task per NR-wide weight panel (K × NR, packed or dequantised). The
panel is multiplied in sub-panels of NS columns by MR rows of A: an MR × NS accumulator tile
(MR · NS / lanes vector registers) over K blocks of KC, so a KC × NS slice of the panel stays in
L1 while every row block of A uses it. The tile takes at most three quarters of the register
file (the rest holds the W vectors and the broadcast of A): on AVX2 (16 ymm) 6 × 16 = 12
accumulators, on AVX-512 (32 zmm) 8 × 32 = 16, on NEON (32 q) 6 × 16 = 24. The previous tile,
4 × 64 for every CPU, is 32 ymm accumulators on AVX2 — twice the register file: it spilled on
every k (``docs/COMPILER.md``, "K-quant kernel schedule").

The target is ``tvm.target.Target.current()`` (the pipeline enters it around the weight layout
and the schedule), else this machine's CPU. The sum over k runs in order, carried through C
from one K block to the next (an exact fp32 store and load): the same sequential sum as an
unblocked MR × NR tile, so the results do not depend on the tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tvm.script import tirx as T

PANEL_LANES = 16  # panel widths are multiples of 16 columns (``dense.VEC``)


@dataclass(frozen=True)
class VectorRegisters:
    """A CPU's vector register file as the GEMM tile sees it."""

    lanes: int  # fp32 lanes of one register
    count: int  # architectural vector registers

    @property
    def accumulators(self) -> int:
        """Registers the accumulator tile may hold: the rest carry W vectors and A broadcasts."""
        return self.count * 3 // 4


AVX512 = VectorRegisters(16, 32)
AVX2 = VectorRegisters(8, 16)
SSE = VectorRegisters(4, 16)
NEON = VectorRegisters(4, 32)


@functools.lru_cache(maxsize=32)
def _registers_of(kind: str, mtriple: str, mcpu: str, mattr: tuple[str, ...]) -> VectorRegisters:
    import tvm
    from tvm.target import codegen

    arch = (mtriple or str(codegen.llvm_get_system_triple())).split("-")[0]
    if arch in ("aarch64", "arm64"):
        return NEON
    if arch not in ("x86_64", "i686", "i386") or kind != "llvm":
        return AVX2  # no model for it: a mid-sized tile
    spec = {"kind": "llvm", **({"mtriple": mtriple} if mtriple else {}), **({"mcpu": mcpu} if mcpu else {}),
            **({"mattr": list(mattr)} if mattr else {})}
    features = set(codegen.llvm_get_cpu_features(tvm.target.Target(spec)))
    if "avx512f" in features:
        return AVX512
    return AVX2 if "avx" in features else SSE


def vector_registers(target=None) -> VectorRegisters:
    """The vector registers of ``target`` (a TVM target; default: the current one, else this
    machine's CPU as LLVM names it). An llvm target without ``mcpu`` compiles for the generic CPU
    of its triple (x86-64: SSE2), and gets that CPU's tile."""
    import tvm
    from tvm.target import codegen

    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return _registers_of("llvm", "", str(codegen.llvm_get_system_cpu()), ())
    attrs = target.attrs
    return _registers_of("llvm", str(attrs.get("mtriple", "") or ""), str(attrs.get("mcpu", "") or ""),
                         tuple(str(a) for a in (attrs.get("mattr") or ())))


def tile_cols(regs: VectorRegisters | None = None) -> int:
    """NS: two vector registers per row of the tile (at least one 16-column panel unit)."""
    regs = regs or vector_registers()
    return max(PANEL_LANES, 2 * regs.lanes)


def subpanel_cols(NR: int, regs: VectorRegisters | None = None) -> int:
    """The sub-panel width for an NR-wide panel: ``tile_cols`` where it divides NR, else 16."""
    ns = tile_cols(regs)
    if NR % ns == 0:
        return ns
    return PANEL_LANES if NR % PANEL_LANES == 0 else NR


def tile_rows(M: int, NS: int, regs: VectorRegisters | None = None) -> int:
    """MR: the most rows of A (a divisor of M, at most 8) whose MR × NS tile fits the accumulators."""
    regs = regs or vector_registers()
    cap = max(1, min(8, regs.accumulators // max(1, NS // regs.lanes)))
    return next(c for c in range(min(cap, M), 0, -1) if M % c == 0)


def k_block(K: int) -> int:
    """KC: the K rows of a sub-panel the row blocks of A share from L1 (256 × 16 fp32: 16 KB)."""
    return next((c for c in (256, 128, 64, 32) if K % c == 0), K)


def panel_gemm(M: int, K: int, N: int, NR: int, NS: int, MR: int):
    """Macro ``tile(A, W, C, acc, jo, w_base, s_stride, k_stride)``: C[:, panel jo] = A · panel
    for A [M·K] and C [M·N] flat, the panel's element (k, s·NS + j) at
    ``W[w_base + s·s_stride + k·k_stride + j]`` — contiguous K × NS sub-panels (s_stride = K·NS,
    k_stride = NS), a packed K × NR panel (NS, NR) or a column slice of [K, N] (NS, N). ``acc``:
    the [MR, NS] register tile. A last panel past N writes its first N mod NR columns only."""
    NI, NSUB, KC = M // MR, NR // NS, k_block(K)
    KB = K // KC
    LAST = N - (-(-N // NR) - 1) * NR
    TAIL = LAST != NR

    @T.macro
    def tile(A, W, C, acc, jo, w_base, s_stride, k_stride):
        for s in T.serial(NSUB):
            for kb in T.serial(KB):
                for io in T.serial(NI):
                    if kb == 0:
                        for r in T.unroll(MR):
                            for j in T.vectorized(NS):
                                acc[r, j] = T.float32(0)
                    elif TAIL:
                        for r in T.unroll(MR):
                            for j in T.serial(NS):
                                acc[r, j] = T.if_then_else(jo * NR + s * NS + j < N,
                                                           C[(io * MR + r) * N + T.min(jo * NR + s * NS + j, N - 1)],
                                                           T.float32(0))
                    else:
                        for r in T.unroll(MR):
                            for j in T.vectorized(NS):
                                acc[r, j] = C[(io * MR + r) * N + jo * NR + s * NS + j]
                    for k in T.serial(KC):
                        for r in T.unroll(MR):
                            for j in T.vectorized(NS):
                                acc[r, j] = acc[r, j] + A[(io * MR + r) * K + kb * KC + k] * W[
                                    w_base + s * s_stride + (kb * KC + k) * k_stride + j]
                    if TAIL:
                        for r in T.unroll(MR):
                            for j in T.serial(NS):
                                if jo * NR + s * NS + j < N:
                                    C[(io * MR + r) * N + jo * NR + s * NS + j] = acc[r, j]
                    else:
                        for r in T.unroll(MR):
                            for j in T.vectorized(NS):
                                C[(io * MR + r) * N + jo * NR + s * NS + j] = acc[r, j]

    return tile
