"""Decode GEMVs over int8 activations (``kernels/int8_gemv.py``, ``--decode-activations int8``):
each kernel against a numpy reference of the SAME scheme (x per 32: dx = max|x|/127, q = rint(x/dx);
exact integer block sums, so a tight tolerance), against the fp32-activation kernel within the
bound x's rounding allows (|Δ| ≤ Σ_blocks dx/2 · Σ|w|), on both paths (avx2 where this CPU has it,
generic everywhere); and a tiny model compiled with int8 decode activations."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgekv.compiler import CompileError, compile_model  # noqa: E402
from edgekv.compiler import kquant_formats as kq  # noqa: E402
from edgekv.compiler import quant_formats as qf  # noqa: E402
from edgekv.compiler.kernels import int8_gemv as ig  # noqa: E402
from edgekv.compiler.kernels.kquant_dense import build_kquant_gemv_kernel  # noqa: E402
from edgekv.compiler.kernels.quant_dense import build_q8_gemv_nt_kernel, build_quant_gemv_kernel  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}
HOST_ISA = ig.int8_isa(tvm.target.Target({"kind": "llvm", "mcpu": str(tvm.target.codegen.llvm_get_system_cpu())}))
ISAS = ["generic"] + (["avx2"] if HOST_ISA == "avx2" else [])


def run_kernel(func, args, mcpu: str | None = None):
    tgt = dict(TARGET, mcpu=mcpu or str(tvm.target.codegen.llvm_get_system_cpu()))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm.target.Target(tgt))
    nd = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]
    lib["main"](*nd)
    return nd[-1].numpy().reshape(-1)


def quantized_x(x: np.ndarray):
    """The scheme in numpy: per 32-block (zeros past K) q (int64), dx, and dx·Σq (fp32: the minimum terms' sum)."""
    kp = -(-x.size // 32) * 32
    b = np.zeros(kp, np.float32)
    b[:x.size] = x
    b = b.reshape(-1, 32)
    am = np.abs(b).max(1)
    inv = np.where(am > 0, np.float32(127) / np.maximum(am, np.float32(1e-30)), np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[:, None]).astype(np.int64)
    dx = (am / np.float32(127)).astype(np.float32)
    return q, dx, (dx * q.sum(1).astype(np.float32)).astype(np.float32)


def rounding_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per output: Σ_blocks dx/2 · Σ_k∈block |w[n, k]| (w [N, K] dequantised): the most x's rounding can move it."""
    _, dx, _ = quantized_x(x)
    kp = dx.size * 32
    wa = np.zeros((w.shape[0], kp))
    wa[:, :w.shape[1]] = np.abs(w)
    return (wa.reshape(w.shape[0], -1, 32).sum(2) * (dx / 2)).sum(1)


def q4_1_reference(x, b: qf.Blocks) -> np.ndarray:
    q, dx, xs = quantized_x(x)
    isum = np.einsum("nbk,bk->nb", b.q.astype(np.int64).reshape(b.q.shape[0], -1, 32), q)
    return (b.d.astype(np.float64) * (dx.astype(np.float64) * isum) + b.m.astype(np.float64) * xs).sum(1)


def kquant_reference(x, b: kq.KBlocks) -> np.ndarray:
    q, dx, xs = quantized_x(x)
    f, n = b.fmt, b.u.shape[0]
    isum = np.einsum("nsk,sk->ns", (b.u.astype(np.int64) - f.offset).reshape(n, -1, f.sub), q.reshape(-1, f.sub))
    per = f.superblock // f.sub
    s = np.repeat(b.scales["d"].astype(np.float64), per, 1) * b.scales["sc"].astype(np.float64)
    out = (s * np.repeat(dx.astype(np.float64), 32 // f.sub) * isum).sum(1)
    if f.has_min:
        m = np.repeat(b.scales["dm"].astype(np.float64), per, 1) * b.scales["m"].astype(np.float64)
        out -= (m * xs).sum(1)
    return out


def rel(got, ref) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def check_against_fp32(got, fp32, x, w):
    """Within x's rounding bound of the fp32-activation kernel (plus fp32 summation slack)."""
    slack = 1e-5 * np.abs(fp32).max() + 1e-6
    assert np.all(np.abs(got - fp32) <= rounding_bound(x, w) + slack)


def random_kblocks(ggml: str, K: int, N: int, rng) -> kq.KBlocks:
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, ggml)
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // bs * ts), dtype=np.uint8)
    blk = raw.reshape(-1, ts)
    for o in {"Q4_K": (0, 2), "Q6_K": (208,)}[ggml]:  # finite fp16 super-scales
        blk[:, o:o + 2] = (rng.uniform(-1, 1, (blk.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return kq.kblocks_from_ggml(raw, kq.KFORMATS[ggml], K)


# (K, N, NR): K not a whole number of blocks, N not of panels, the three panel widths
Q4_SHAPES = [(70, 40, 16), (64, 64, 64), (96, 200, 64), (576, 192, 32)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", Q4_SHAPES, ids=lambda s: "k{}n{}nr{}".format(*s))
def test_q4_1_int8_gemv(isa, shape):
    K, N, NR = shape
    rng = np.random.default_rng(K + N + NR)
    b = qf.quantize(rng.standard_normal((N, K)).astype(np.float32), qf.Q4_1)
    x = rng.standard_normal(K).astype(np.float32)
    arrays = qf.panel_arrays(b, NR)
    got = run_kernel(ig.build_q4_int8_gemv_kernel((1, 1, K), (1, 1, N), qf.Q4_1, K, N, NR, isa),
                     [x[None, None], *arrays, np.zeros((1, 1, N), np.float32)])
    assert rel(got, q4_1_reference(x, b)) < 2e-6
    fp32 = run_kernel(build_quant_gemv_kernel((1, 1, K), (1, 1, N), qf.Q4_1, K, N, NR),
                      [x[None, None], *arrays, np.zeros((1, 1, N), np.float32)])
    check_against_fp32(got, fp32, x, b.dequantize()[:, :K])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(256, 40, 32), (512, 48, 16), (256, 128, 64)], ids=lambda s: "k{}n{}nr{}".format(*s))
def test_kquant_int8_gemv(isa, ggml, shape):
    K, N, NR = shape
    rng = np.random.default_rng(K + N + NR + len(ggml))
    b = random_kblocks(ggml, K, N, rng)
    x = rng.standard_normal(K).astype(np.float32)
    arrays = kq.kpanel_arrays(b, NR)
    got = run_kernel(ig.build_kquant_int8_gemv_kernel((1, 1, K), (1, 1, N), b.fmt, K, N, NR, isa),
                     [x[None, None], *arrays, np.zeros((1, 1, N), np.float32)])
    assert rel(got, kquant_reference(x, b)) < 2e-6
    fp32 = run_kernel(build_kquant_gemv_kernel((1, 1, K), (1, 1, N), b.fmt, K, N, NR),
                      [x[None, None], *arrays, np.zeros((1, 1, N), np.float32)])
    check_against_fp32(got, fp32, x, b.dequantize())


@pytest.mark.parametrize("isa", ISAS)
def test_q8_int8_gemv_nt(isa):
    rng = np.random.default_rng(5)
    V, K = 96, 160
    b = qf.quantize(rng.standard_normal((V, K)).astype(np.float32), qf.Q8_0)
    x = (rng.standard_normal(K) * np.repeat(rng.uniform(0.01, 10, K // 32), 32)).astype(np.float32)
    x[32:64] = 0  # an all-zero block: dx = 0, q = 0
    got = run_kernel(ig.build_q8_int8_gemv_nt_kernel((1, 1, K), (1, 1, V), V, K, isa),
                     [x[None, None], b.q, b.d, np.zeros((1, 1, V), np.float32)])
    q, dx, _ = quantized_x(x)
    isum = np.einsum("vbk,bk->vb", b.q.astype(np.int64).reshape(V, -1, 32), q)
    assert rel(got, (b.d.astype(np.float64) * dx.astype(np.float64) * isum).sum(1)) < 2e-6
    fp32 = run_kernel(build_q8_gemv_nt_kernel((1, 1, K), (1, 1, V), V, K),
                      [x[None, None], b.q, b.d, np.zeros((1, 1, V), np.float32)])
    check_against_fp32(got, fp32, x, b.dequantize())


@settings(max_examples=6, deadline=None)
@given(kb=st.integers(1, 5), ktail=st.integers(0, 31), n=st.integers(1, 70), nr=st.sampled_from([16, 32, 64]),
       isa=st.sampled_from(ISAS), seed=st.integers(0, 2**16))
def test_q4_1_int8_gemv_any_shape(kb, ktail, n, nr, isa, seed):
    """Odd K (a partial last block) and N (a partial last panel): the same-scheme reference, tightly."""
    K = kb * 32 - (ktail if kb > 1 else 0)
    rng = np.random.default_rng(seed)
    b = qf.quantize(rng.standard_normal((n, K)).astype(np.float32), qf.Q4_1)
    x = rng.standard_normal(K).astype(np.float32)
    got = run_kernel(ig.build_q4_int8_gemv_kernel((1, 1, K), (1, 1, n), qf.Q4_1, K, n, nr, isa),
                     [x[None, None], *qf.panel_arrays(b, nr), np.zeros((1, 1, n), np.float32)])
    assert rel(got, q4_1_reference(x, b)) < 2e-6


def test_int8_isa_by_target():
    assert ig.int8_isa({"kind": "llvm", "mcpu": "znver3"}) == "avx2"
    assert ig.int8_isa({"kind": "llvm", "mcpu": "x86-64"}) == "generic"  # SSE2 only
    assert ig.int8_isa({"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon"]}) == "generic"
    with pytest.raises(ValueError, match="int8 GEMV path"):
        ig.check_isa("neon")


@pytest.fixture(scope="module")
def tied():
    return tiny_random_model(seed=2, tie_embeddings=True, intermediate=96)


def test_int8_decode_artifact_tracks_fp32(tied):
    """A q4 build with int8 decode activations: its decode GEMVs are the int8 kernels, the manifest
    says so, and its logits stay close to the fp32-activation build's (the prefill GEMMs are the same
    kernels; the last-token head and every decode GEMV read int8 x)."""
    pol = make_policy("keydiff")
    ids = np.random.default_rng(4).integers(0, 256, 40)
    builds = {a: compile_model(tied, pol, 24, 8, TARGET, weights="q4", decode_activations=a) for a in ("fp32", "int8")}
    w = builds["int8"].manifest["weights"]
    assert w["decode_activations"] in ("int8/avx2", "int8/generic")
    assert builds["fp32"].manifest["weights"]["decode_activations"] == "fp32"
    names = [str(g.name_hint) for g in builds["int8"].final_module.get_global_vars()]
    assert any(n.endswith("_x8") and "gemv" in n for n in names) and any("nt_q8" in n and n.endswith("_x8") for n in names)
    rt = {a: HostRuntime.from_executable(r.executable, r.manifest, r.params) for a, r in builds.items()}
    a, b = rt["int8"].prefill(ids), rt["fp32"].prefill(ids)
    la, lb = rt["int8"].decode(int(np.argmax(b))), rt["fp32"].decode(int(np.argmax(b)))
    for x, y in ((a, b), (la, lb)):  # a random tiny model: x's rounding through 2 layers moves logits by a few %
        x, y = np.ravel(x), np.ravel(y)
        assert rel(x, y) < 0.15 and np.corrcoef(x, y)[0, 1] > 0.99


def test_int8_decode_activations_refused_where_no_kernels(tied):
    pol = make_policy("keydiff")
    with pytest.raises(CompileError, match="--decode-activations int8 has kernels for quantised weights"):
        compile_model(tied, pol, 24, 8, TARGET, weights="fp32", decode_activations="int8")
    with pytest.raises(CompileError, match="not an activation format"):
        compile_model(tied, pol, 24, 8, TARGET, weights="q4", decode_activations="int4")


def test_generic_path_compiles_for_aarch64():
    """The android-cpu kind of target (no AVX2): the plain-integer path, which LLVM turns into NEON
    widening multiply-accumulates (``smlal``), not per-lane scalar code."""
    import re

    tgt = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon"], "num-cores": 4})
    assert ig.int8_isa(tgt) == "generic"
    f = ig.build_q4_int8_gemv_kernel((1, 1, 64), (1, 1, 64), qf.Q4_1, 64, 64, 64, "generic")
    lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=tgt)
    asm = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("asm")
    assert re.search(r"\bsmlal2?\b", asm)


@pytest.mark.skipif(HOST_ISA != "avx2", reason="needs an AVX2 CPU (the avx2 path's instructions)")
def test_avx2_path_uses_integer_dot_products():
    import re

    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    f = ig.build_q4_int8_gemv_kernel((1, 1, 64), (1, 1, 64), qf.Q4_1, 64, 64, 64, "avx2")
    lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=tgt)
    asm = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("asm")
    assert re.search(r"\bvpmaddubsw\b", asm) and re.search(r"\bvpunpcklbw\b", asm)


def test_cli_refuses_an_unknown_activation_format_before_loading(tmp_path):
    from typer.testing import CliRunner

    from edgekv.cli import app

    res = CliRunner().invoke(app, ["compile", str(tmp_path / "no-such-model.gguf"), "--decode-activations", "int4",
                                   "-o", str(tmp_path / "out")])
    assert res.exit_code != 0 and "--decode-activations 'int4': use one of fp32, int8" in res.output
