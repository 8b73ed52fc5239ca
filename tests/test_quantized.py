"""Quantised weights (issue 14): the GGML block formats, the fused-dequantisation kernels against
a dequantise-then-matmul reference, whole q4/q8 artifacts against an fp32 artifact of the
dequantised model, the native runtime on a q4 artifact, the memory plan, SmolLM2's own blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.artifact import PARAMS_FILE  # noqa: E402
from edgekv.artifact.params_file import map_params  # noqa: E402
from edgekv.compiler import CompileError, compile_model  # noqa: E402
from edgekv.compiler import quant_formats as qf  # noqa: E402
from edgekv.compiler.kernels.quant_dense import (build_q8_gemv_nt_kernel, build_q8_take_kernel,  # noqa: E402
                                                 build_quant_gemm_kernel, build_quant_gemv_kernel)
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.models.loaded import LoadedModel  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.runtime import HostRuntime, native  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}
FORMATS = [qf.Q4_1, qf.Q8_0]


def run_kernel(func, args):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm.target.Target(TARGET))
    nd = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]
    lib["main"](*nd)
    return nd[-1].numpy()


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_blocks_round_trip_ggml_layout(fmt):
    """Blocks parsed from gguf's own quantiser output dequantise to what gguf dequantises, and the
    per-weight error is within half a step d/2, plus what storing d (and m) as float16 adds
    (≤ 2^-11 relative each, times the largest quant: 127 for Q8_0, 15 for Q4_1)."""
    import gguf

    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, fmt.ggml_type)
    b = qf.blocks_from_ggml(raw, fmt, 96, "quantized")
    np.testing.assert_array_equal(b.dequantize(), gguf.quants.dequantize(raw, fmt.ggml_type))
    step = np.abs(np.repeat(b.d.astype(np.float32), qf.GROUP, axis=1))
    low = 0.0 if b.m is None else np.abs(np.repeat(b.m.astype(np.float32), qf.GROUP, axis=1))
    qmax = 127 if fmt.bits == 8 else 15
    assert np.all(np.abs(b.dequantize() - w) <= (0.5 + qmax * 2.0**-11) * step + low * 2.0**-11 + 1e-6)
    assert b.nbytes == raw.nbytes


# (M, K, N, NR): K not a multiple of the group, N not a multiple of the panel, M not of the register rows
SHAPES = [(1, 70, 40, 16), (1, 64, 64, 64), (5, 64, 48, 16), (6, 100, 96, 32), (7, 96, 200, 64)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}k{}n{}nr{}".format(*s))
def test_quant_kernels_match_dequantised_matmul(fmt, shape):
    M, K, N, NR = shape
    rng = np.random.default_rng(M * 1000 + K + N)
    b = qf.quantize(rng.standard_normal((N, K)).astype(np.float32), fmt)
    x = rng.standard_normal((M, K)).astype(np.float32)
    ref = x.astype(np.float64) @ b.dequantize().T.astype(np.float64)
    arrays = qf.panel_arrays(b, NR)
    assert [(a.shape, str(a.dtype)) for a in arrays] == qf.panel_shapes(fmt, K, N, NR)
    got = run_kernel(build_quant_gemm_kernel((M, K), (M, N), fmt, K, N, NR), [x, *arrays, np.zeros((M, N), np.float32)])
    assert rel_err(got, ref) < 2e-6
    if M == 1:
        got = run_kernel(build_quant_gemv_kernel((1, 1, K), (1, 1, N), fmt, K, N, NR),
                         [x[None], *arrays, np.zeros((1, 1, N), np.float32)])
        assert rel_err(got[0], ref) < 2e-6


def test_q8_row_kernels_match_reference():
    rng = np.random.default_rng(3)
    V, K = 64, 96
    b = qf.quantize(rng.standard_normal((V, K)).astype(np.float32), qf.Q8_0)
    ids = np.array([3, 0, 63, 7, 3], np.int64)
    got = run_kernel(build_q8_take_kernel(5, "int64", V, K), [b.q, b.d, ids, np.zeros((5, K), np.float32)])
    np.testing.assert_array_equal(got, b.dequantize()[ids])
    x = rng.standard_normal((1, K)).astype(np.float32)
    got = run_kernel(build_q8_gemv_nt_kernel((1, K), (1, V), V, K), [x, b.q, b.d, np.zeros((1, V), np.float32)])
    assert rel_err(got, x.astype(np.float64) @ b.dequantize().T) < 2e-6


def dequantized(model: LoadedModel, weights: str) -> LoadedModel:
    """The model with every matrix replaced by its quantised-then-dequantised values (what a q4/q8
    artifact computes with)."""
    out = {}
    for name, t in model.weights.items():
        a = t.numpy()
        if a.ndim == 2:
            fmt = qf.EMBEDDING_FORMAT if "embed_tokens" in name else qf.LINEAR_FORMAT[weights]
            a = qf.quantize(a, fmt).dequantize()
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    return LoadedModel(model_id=model.model_id, config=model.config, hf_config=model.hf_config, weights=out)


@pytest.fixture(scope="module")
def tied():
    return tiny_random_model(seed=2, tie_embeddings=True, intermediate=96)


# The tied model's q4 KeyDiff build (N = 24, B = 8) for this CPU and for OpenCL, each compiled once
# for the module: several tests read the same build (its runtime, plan, files).
@pytest.fixture(scope="module")
def tied_q4(tied, tmp_path_factory):
    out = tmp_path_factory.mktemp("tied-q4") / "cpu"
    # fp32 decode activations: these tests compare with fp32 arithmetic (int8 ones: test_int8_gemv.py)
    return compile_model(tied, make_policy("keydiff"), 24, 8, TARGET, out_dir=out, weights="q4", decode_activations="fp32")


@pytest.fixture(scope="module")
def tied_q4_opencl(tied, tmp_path_factory):
    out = tmp_path_factory.mktemp("tied-q4") / "ocl"
    return compile_model(tied, make_policy("keydiff"), 24, 8, "opencl-host", out, weights="q4")


@pytest.mark.parametrize("tie,weights", [(True, "q4"), (False, "q8"), pytest.param(True, "q8", marks=pytest.mark.slow),
                                         pytest.param(False, "q4", marks=pytest.mark.slow)],
                         ids=["tied-head-q4", "own-head-q8", "tied-head-q8", "own-head-q4"])
def test_quantised_artifact_equals_fp32_of_dequantised_model(weights, tie, tied, request):
    model = tied if tie else tiny_random_model(seed=2, intermediate=96)
    pol = make_policy("keydiff")
    ids = np.random.default_rng(4).integers(0, 256, 70)
    q = (request.getfixturevalue("tied_q4") if (tie, weights) == (True, "q4")
         else compile_model(model, pol, 24, 8, TARGET, weights=weights, decode_activations="fp32"))
    f = compile_model(dequantized(model, weights), pol, 24, 8, TARGET, weights="fp32")
    rq, rf = (HostRuntime.from_executable(r.executable, r.manifest, r.params) for r in (q, f))
    a, b = rq.prefill(ids), rf.prefill(ids)
    assert rel_err(a, b) < 1e-5
    for layer in range(model.config.num_layers):  # the same eviction decisions
        np.testing.assert_array_equal(rq.kept_positions(layer), rf.kept_positions(layer))
    ta, tb = rq.generate(ids, 8), rf.generate(ids, 8)
    assert list(ta) == list(tb)
    w = q.manifest["weights"]
    fmt = qf.LINEAR_FORMAT[weights].ggml
    assert w["format"] == weights and w["tensors"][fmt] >= 7 * model.config.num_layers
    # the plan counts the stored arrays exactly (with the file's 64-byte alignment), 3.5-6x below fp32
    assert w["bytes"] == sum(a.nbytes for _, a in q.params)
    assert q.manifest["memory_plan"]["weights_bytes"] == sum(-(-a.nbytes // 64) * 64 for _, a in q.params)
    assert f.manifest["memory_plan"]["weights_bytes"] > (3 if weights == "q8" else 5) * w["bytes"]


def test_default_weights_and_bad_choices(tied):
    assert qf.default_weights(tied) == "fp32"  # no 4-bit source
    pol = make_policy("keydiff")
    with pytest.raises(CompileError, match="--weights 'q3' is not a weight format; use one of q4, q8, fp32"):
        compile_model(tied, pol, 24, 8, TARGET, weights="q3")
    with pytest.raises(CompileError, match="no kernels for this target yet; compile it with --weights fp32"):
        compile_model(tied, pol, 24, 8, "hexagon", weights="q4")


def test_mem_limit_counts_quantised_weights(tied, tied_q4):
    pol = make_policy("keydiff")
    total = tied_q4.manifest["memory_plan"]["total_bytes"]
    compile_model(tied, pol, 24, 8, TARGET, weights="q4", mem_limit=total)  # exactly the plan: accepted
    with pytest.raises(CompileError, match="above the limit"):
        compile_model(tied, pol, 24, 8, TARGET, weights="q4", mem_limit=total - 1)


@pytest.mark.skipif(not native.available(), reason="the native runtime is not built: `pip install -e .` builds runtime/")
def test_native_runtime_runs_q4_artifact(tied, tmp_path):
    """The artifact is the contract: quantised weights are uint8/int8/float16 buffers the native
    runtime maps like any other; its logits and kept sets equal HostRuntime's."""
    out = tmp_path / "q4"
    compile_model(tied, make_policy("snapkv"), 24, 8, TARGET, out_dir=out, weights="q4")
    ids = np.random.default_rng(5).integers(0, 256, 53).tolist()
    host, nat = HostRuntime(out), native.NativeRuntime(out)
    a, b = host.prefill(ids), nat.prefill(ids)
    assert rel_err(b, a) < 1e-6
    for layer in range(tied.config.num_layers):
        np.testing.assert_array_equal(host.kept_positions(layer), nat.kept_positions(layer))
    manifest = json.loads((out / "manifest.json").read_text())
    mapped = map_params(out / PARAMS_FILE)
    assert {str(a.dtype) for a in mapped.values()} >= {"uint8", "int8", "float16"}
    # the native plan maps the whole params file: the compiler's plan plus the file's JSON header
    mapped_bytes = nat.memory_plan()["weights"]
    assert mapped_bytes == (out / PARAMS_FILE).stat().st_size
    assert 0 <= mapped_bytes - manifest["memory_plan"]["weights_bytes"] <= 64 * 1024


def test_smollm2_gguf_blocks_are_taken_exactly(smol):
    """SmolLM2's GGUF holds its linear layers as Q4_1 and its embedding as Q8_0: the blocks the
    compiler takes dequantise to exactly the fp32 weights the eager engine uses (q/k rows put back
    in HF order), so a q4 artifact of it computes with the same weights as the fp32 one."""
    src = qf.open_source_blocks(smol)
    assert src is not None and qf.default_weights(smol) == "q4"
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.7.self_attn.v_proj.weight",
             "model.layers.29.mlp.down_proj.weight", "model.layers.11.self_attn.o_proj.weight"]
    for name in names:
        w = smol.weights[name].numpy()
        fmt = qf.Q8_0 if "embed" in name else qf.Q4_1
        b = src.get(name, fmt, w.shape)
        assert b is not None and b.source == "gguf", name
        np.testing.assert_array_equal(b.dequantize(), w, err_msg=name)
    assert src.get(names[1], qf.Q8_0, smol.weights[names[1]].shape) is None  # not in that format: quantised


def test_simulate_estimates_read_the_stored_weight_bytes(tied, tied_q4):
    """`edgekv simulate ARTIFACT` estimates decode from the bytes a step reads: a q4 artifact's
    weights are its plan's (4-bit) bytes, not 4 bytes per parameter."""
    from edgekv.artifact import Manifest
    from edgekv.simulate.work import work_from_manifest

    pol = make_policy("keydiff")
    q4, fp32 = tied_q4.manifest, compile_model(tied, pol, 24, 8, TARGET, weights="fp32").manifest
    dq, df = (work_from_manifest(Manifest.from_json(m), tied.config).decode(24, True) for m in (q4, fp32))
    saved = fp32["memory_plan"]["weights_bytes"] - q4["memory_plan"]["weights_bytes"]
    assert dq.flops == df.flops
    # everything but the weights is counted alike; the table moves into the weights for both
    assert df.bytes - dq.bytes == pytest.approx(saved, rel=0.01)


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_q4_artifact_answers_like_fp32(smol, tmp_path):
    """The README's main job compiled both ways: the q4 artifact (SmolLM2's own Q4_1/Q8_0 blocks)
    and the fp32 one keep the same entries and answer the same greedy text."""
    from pathlib import Path

    from edgekv.job import encode_prompt

    doc = (Path(__file__).resolve().parents[1] / "examples" / "long_document.txt").read_text()
    ids = encode_prompt(smol, doc, chat=True).tolist()
    pol = make_policy("keydiff")
    runs = {}
    for weights in ("q4", "fp32"):
        out = tmp_path / weights
        res = compile_model(smol, pol, 512, 128, "host", out_dir=out, weights=weights)
        assert res.manifest["weights"]["format"] == weights
        rt = native.NativeRuntime(out) if native.available() else HostRuntime(out)
        tokens = rt.generate(ids, 24)
        runs[weights] = (list(tokens), [rt.kept_positions(layer) for layer in (0, 15, 29)])
    assert runs["q4"][0] == runs["fp32"][0]
    for a, b in zip(runs["q4"][1], runs["fp32"][1]):
        np.testing.assert_array_equal(a, b)


def test_gpu_q4_build_is_scheduled_on_device(tied, tied_q4_opencl):
    """GPU builds keep the blocks row by row (float32 scales) and dlight schedules the dequantising
    matmuls and the lookup: every kernel is bound to GPU threads (CheckAllOnDevice), for each GPU
    code generator."""
    for target in ("opencl-host", "cuda", "metal"):
        res = (tied_q4_opencl if target == "opencl-host"
               else compile_model(tied, make_policy("keydiff"), 24, 8, target, weights="q4"))
        w = res.manifest["weights"]
        assert w["layout"] == "rows" and w["scale_dtype"] == "float32" and w["tensors"]["Q4_1"] >= 14, target
        names = [n for n, _ in res.params]
        assert any(n.endswith(".q4r.q") for n in names) and any(n.endswith(".q8r.d") for n in names)


@pytest.mark.skipif(not native.available() or native.opencl_unavailable_reason() is not None,
                    reason="needs the native runtime with OpenCL and a platform: apt-get install pocl-opencl-icd "
                           "ocl-icd-opencl-dev opencl-c-headers, then pip install -e .")
def test_opencl_q4_artifact_agrees_with_cpu_q4(tied, tied_q4, tied_q4_opencl):
    """The q4 artifact for OpenCL (PoCL here) against the q4 CPU artifact: the same quantised
    weights, so the same kept positions and logits up to summation order."""
    cpu, gpu = tied_q4.out_dir, tied_q4_opencl.out_dir
    ids = np.random.default_rng(6).integers(0, 256, 61).tolist()
    a, b = native.NativeRuntime(cpu), native.NativeRuntime(gpu)
    la, lb = a.prefill(ids), b.prefill(ids)
    assert rel_err(lb, la) < 1e-4
    for layer in range(tied.config.num_layers):
        np.testing.assert_array_equal(a.kept_positions(layer), b.kept_positions(layer))
    assert list(a.generate(ids, 8)) == list(b.generate(ids, 8))
