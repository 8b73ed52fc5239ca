"""The GGUF formats a q4 artifact keeps as they are (issue 30): Q4_K, Q6_K and Q5_0 blocks
repacked into column panels whose weights equal ``gguf.quants.dequantize`` bit for bit, the
kernels over them, the architecture-aware block source (names and q/k row order as transformers'
GGUF loader has them), a tiny Qwen2 artifact over such a file, and the refusal of a type the
compiler does not take. The real Qwen2.5 / Gemma 3 files: ``test_kquant_real.py`` (-m slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
gguf = pytest.importorskip("gguf")

from edgekv.compiler import CompileError, compile_model  # noqa: E402
from edgekv.compiler import kquant_formats as kq  # noqa: E402
from edgekv.compiler import quant_formats as qf  # noqa: E402
from edgekv.compiler.kernels.kquant_dense import (build_kquant_dequant_kernel, build_kquant_gemm_kernel,  # noqa: E402
                                                  build_kquant_gemv_kernel, subpanel_cols)
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.models.loaded import LoadedModel  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}
KFORMATS = list(kq.KFORMATS.values())
FP16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "IQ4_NL": (0,)}


def random_blocks(ggml: str, n: int, k: int, rng, scale: float = 1.0) -> np.ndarray:
    """[N, K/block · block_bytes] uint8: every byte random (any bit pattern of quants and 6-bit
    scales is a valid block) except the fp16 scales, which are random finite values."""
    qtype = getattr(gguf.GGMLQuantizationType, ggml)
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // bs * ts), dtype=np.uint8)
    blk = raw.reshape(-1, ts)
    for o in FP16_FIELDS[ggml]:
        blk[:, o:o + 2] = (rng.uniform(-1, 1, (blk.shape[0], 1)) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def run_kernel(func, args):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm.target.Target(TARGET))
    nd = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]
    lib["main"](*nd)
    return nd[-1].numpy()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("fmt", KFORMATS, ids=lambda f: f.ggml)
def test_blocks_dequantise_exactly_as_gguf(fmt):
    """Parsed blocks, the stored panels, and the GEMM's dequantised panel (the kernel's own
    arithmetic) all give gguf's dequantisation bit for bit; bytes per weight as documented."""
    rng = np.random.default_rng(1)
    N, K, NR = 40, 512, 16
    raw = random_blocks(fmt.ggml, N, K, rng)
    ref = gguf.quants.dequantize(raw, fmt.ggml_type)
    b = kq.kblocks_from_ggml(raw, fmt, K)
    np.testing.assert_array_equal(bits(b.dequantize()), bits(ref))
    arrays = kq.kpanel_arrays(b, NR)
    assert [(a.shape, str(a.dtype)) for a in arrays] == kq.kpanel_shapes(fmt, K, N, NR)
    nj = -(-N // NR)
    w = run_kernel(build_kquant_dequant_kernel(fmt, K, N, NR), [np.zeros(1, np.float32), *arrays,
                                                                np.zeros(nj * K * NR, np.float32)])
    ns = subpanel_cols(NR)  # the GEMM's layout: per panel, NR / NS blocks of K × NS
    w = w.reshape(nj, NR // ns, K, ns).transpose(0, 1, 3, 2).reshape(nj * NR, K)
    np.testing.assert_array_equal(bits(w[:N]), bits(ref))
    assert not w[N:].any()  # the padded panel rows are zero weights
    assert b.nbytes / (N * K) == fmt.bytes_per_weight() == {"Q4_K": 0.578125, "Q6_K": 0.8203125, "Q5_0": 0.6875}[fmt.ggml]
    if fmt.ggml != "Q4_K":  # the same bytes as the GGUF (Q4_K: its 6-bit scales unpacked to bytes)
        assert b.nbytes == raw.nbytes


@pytest.mark.parametrize("fmt", KFORMATS, ids=lambda f: f.ggml)
@pytest.mark.parametrize("shape", [(1, 256, 40, 16), (1, 512, 64, 64), (5, 256, 48, 16), (7, 768, 100, 32)],
                         ids=lambda s: "m{}k{}n{}nr{}".format(*s))
def test_kquant_kernels_match_dequantised_matmul(fmt, shape):
    M, K, N, NR = shape
    rng = np.random.default_rng(M * 1000 + K + N)
    b = kq.kblocks_from_ggml(random_blocks(fmt.ggml, N, K, rng), fmt, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    ref = x.astype(np.float64) @ b.dequantize().T.astype(np.float64)
    arrays = kq.kpanel_arrays(b, NR)
    got = run_kernel(build_kquant_gemm_kernel((M, K), (M, N), fmt, K, N, NR), [x, *arrays, np.zeros((M, N), np.float32)])
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6
    if M == 1:
        got = run_kernel(build_kquant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, NR),
                         [x[None], *arrays, np.zeros((1, 1, N), np.float32)])
        assert np.abs(got[0] - ref).max() / np.abs(ref).max() < 2e-6


def test_k_not_a_whole_superblock_is_refused():
    with pytest.raises(ValueError, match="Q4_K needs K a multiple of 256, got 320"):
        build_kquant_gemv_kernel((1, 320), (1, 16), kq.Q4_K, 320, 16, 16)


# ---- a tiny GGUF: the block source against transformers' own per-architecture processing ----------

# the tiny model's matrices and the type each gets in the file (every kept format)
TYPES = {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q6_K", "self_attn.v_proj": "Q8_0",
         "self_attn.o_proj": "Q5_0", "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q4_1", "mlp.down_proj": "Q6_K",
         "embed_tokens": "Q8_0", "lm_head": "Q4_1"}


def hf_from_gguf(arch: str, gguf_name: str, w: np.ndarray, hf_config) -> np.ndarray:
    """What transformers' GGUF loader makes of a dequantised tensor (its per-architecture processor)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    cfg = {"num_attention_heads": hf_config.num_attention_heads, "num_key_value_heads": hf_config.num_key_value_heads}
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg).process(w, gguf_name).weights


def write_tiny_gguf(model: LoadedModel, arch: str, path, rng, types=TYPES) -> LoadedModel:
    """A GGUF holding ``model``'s matrices as random valid blocks of ``types``; returns the model
    with those weights replaced by what transformers' loader would give (the converted HF model)."""
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], model.config.num_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    weights = dict(model.weights)
    for hf, t in model.weights.items():
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        key = next((k for k in types if k in hf), None)
        if t.ndim != 2 or key is None:
            writer.add_tensor(gname, t.numpy().astype(np.float32))
            continue
        n, k = t.shape
        kind = types[key]
        raw = random_blocks(kind, n, k, rng, scale=0.02)
        writer.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        w = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
        weights[hf] = torch.from_numpy(np.ascontiguousarray(hf_from_gguf(arch, gname, w, model.hf_config)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return LoadedModel(model_id=model.model_id, config=model.config, hf_config=model.hf_config, weights=weights,
                       source=path)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    base = tiny_random_model(seed=3, model_type="qwen2", hidden=256, heads=4, kv_heads=2, head_dim=64,
                             intermediate=512)
    return write_tiny_gguf(base, "qwen2", tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf",
                           np.random.default_rng(7))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_block_source_gives_the_converted_hf_weights(arch, tmp_path, tiny_qwen2):
    """Every matrix the source finds dequantises to exactly the weight transformers' loader makes
    of that file: the architecture's tensor names, and q/k rows un-permuted only for llama."""
    model = tiny_qwen2 if arch == "qwen2" else write_tiny_gguf(
        tiny_random_model(seed=3, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512), "llama",
        tmp_path / "tiny-llama.gguf", np.random.default_rng(8))
    src = qf.open_source_blocks(model)
    assert src.arch == arch and not src.unsupported()
    found = 0
    for hf, t in model.weights.items():
        key = next((k for k in TYPES if k in hf), None)
        if t.ndim != 2 or key is None:
            continue
        fmt = src.kept_format(hf, tuple(t.shape))
        assert fmt is not None and fmt.ggml == TYPES[key], hf
        b = src.get(hf, fmt, tuple(t.shape))
        np.testing.assert_array_equal(bits(b.dequantize()), bits(t.numpy()), err_msg=hf)
        found += 1
    assert found == 7 * model.config.num_layers + 2


def test_q4_artifact_keeps_the_files_blocks(tiny_qwen2):
    """A q4 artifact of the tiny Qwen2 GGUF keeps every matrix in the file's own format (none
    requantised) and computes what an fp32 artifact of the converted weights computes."""
    pol = make_policy("keydiff")
    q = compile_model(tiny_qwen2, pol, 24, 8, TARGET, weights="q4", decode_activations="fp32")  # fp32 arithmetic
    w = q.manifest["weights"]
    L = tiny_qwen2.config.num_layers
    assert {k: v for k, v in w["tensors"].items() if k != "fp32"} == {
        "Q4_K": 2 * L, "Q6_K": 2 * L, "Q8_0": L + 1, "Q5_0": L, "Q4_1": L + 1}
    assert (w["blocks_from_source"], w["quantized_here"]) == (7 * L + 2, 0)
    f = compile_model(LoadedModel(model_id="f", config=tiny_qwen2.config, hf_config=tiny_qwen2.hf_config,
                                  weights=dict(tiny_qwen2.weights)), pol, 24, 8, TARGET, weights="fp32")
    ids = np.random.default_rng(4).integers(0, 256, 70)
    rq, rf = (HostRuntime.from_executable(r.executable, r.manifest, r.params) for r in (q, f))
    a, b = rq.prefill(ids), rf.prefill(ids)
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-5
    assert list(rq.generate(ids, 8)) == list(rf.generate(ids, 8))


def test_unsupported_tensor_type_is_refused_before_the_export(tmp_path, tiny_qwen2):
    types = dict(TYPES, **{"mlp.up_proj": "IQ4_NL"})
    model = write_tiny_gguf(tiny_random_model(seed=3, model_type="qwen2", hidden=256, heads=4, kv_heads=2,
                                              head_dim=64, intermediate=512),
                            "qwen2", tmp_path / "iq.gguf", np.random.default_rng(9), types)
    with pytest.raises(CompileError, match=r"tensor 'blk\.0\.ffn_up\.weight' is IQ4_NL \(and 1 more tensors\), a GGUF "
                                           r"type the compiler does not support; supported: Q4_1, Q8_0, Q4_K, Q6_K, "
                                           r"Q5_0, F32, F16, BF16"):
        compile_model(model, make_policy("keydiff"), 24, 8, TARGET, weights="q4")
