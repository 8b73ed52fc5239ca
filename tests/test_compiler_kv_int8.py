"""The int8 KV cache compiled (``--kv-dtype int8``): every policy's artifact against the eager int8
engine on a tiny random model — same kept rows, the same codes and scales bit for bit, logits
within 1e-3 — and what the artifact records and refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.compiler import compile_model  # noqa: E402
from edgekv.compiler import CompileError  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.engine.kv_quant import dequantize_rows  # noqa: E402
from edgekv.memory import kv_row_bytes  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402

B, N, PROMPT = 8, 24, 61  # 7 full blocks and a 5-row tail; evicting from the fourth block on
TEST_TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}
# every policy with a compiled kernel; the ones in the default suite cover each way the pass
# wires a policy: score only, per-entry state (h2o), its own site kernels and a prepare
# function (d2o), pseudo rows (dapq), its own decode attention and cache tensors (rocketkv)
FAST = ("keydiff", "h2o", "d2o", "dapq", "rocketkv")
SLOW = ("full", "streaming", "lagkv", "snapkv", "snapkv++", "tova")


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _same_cache(rt, eng, where, merges=False):
    """Kept positions equal, and the stored rows the same int8 rows: the compiled graph computes K
    and V in another float order than torch (≈1e-7 relative; DapQ's steps of B + w rows more so),
    so a value within that of a rounding boundary may take the neighbouring code, or a group's
    scale the neighbouring float16. So: every dequantised value within one quantisation step of
    the engine's, and ≥ 99 % of the codes and of the scales bit-equal (the kernels' own
    bit-exactness on equal inputs: ``test_kernels_match_the_eager_format_bit_for_bit``). A merging
    policy (D2O) writes rows of its own, equal to the engine's within 1e-3 relative in fp32 too
    (test_compiler_d2o): its rows are held to one step plus that."""
    for layer in range(len(eng.caches)):
        cache = eng.caches[layer]
        n = cache.length
        np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy(),
                                      err_msg=f"{where}, layer {layer}")
        for field, codes, scales in (("k", cache.key_codes, cache.key_scales), ("v", cache.value_codes, cache.value_scales)):
            got_codes, got_scales = rt.cache_field(layer, field)[:, :n], rt.cache_field(layer, f"{field}_scale")[:, :n]
            want_codes, want_scales = codes[:, :n].numpy(), scales[:, :n].numpy()
            assert got_codes.dtype == np.int8 and got_scales.dtype == np.float16
            if not merges:
                assert (got_codes == want_codes).mean() >= 0.99, f"{where}, layer {layer} {field}"
                assert (got_scales.view(np.uint16) == want_scales.view(np.uint16)).mean() >= 0.99, f"{where}, {layer}"
            step = np.maximum(got_scales, want_scales).astype(np.float32).repeat(32, axis=-1)[..., :got_codes.shape[-1]]
            want = _dequantized(want_codes, want_scales)
            diff = np.abs(_dequantized(got_codes, got_scales) - want)
            assert (diff <= step * 1.01 + (1e-3 * np.abs(want) if merges else 0)).all(), f"{where}, {layer} {field}"


def _dequantized(codes, scales):
    return dequantize_rows(torch.from_numpy(codes), torch.from_numpy(scales)).numpy()


@pytest.mark.parametrize("d", [64, 16, 40])  # two groups, one short group, a short last group
def test_kernels_match_the_eager_format_bit_for_bit(d):
    """On the same fp32 rows the TIR kernels give ``kv_quant``'s codes, scales and round trip bit for
    bit — zero rows, tiny values (float16 subnormal scales), an outlier — and re-quantising a
    dequantised row gives back its codes and scales (why moving a kept row's codes is exact)."""
    from edgekv.compiler.kernels.kv_int8 import build_dequantize_kernel, build_round_trip_kernel, build_store_kernel
    from edgekv.engine.kv_quant import quantize_rows, round_trip

    H, R = 3, 37
    g = torch.Generator().manual_seed(d)
    x = torch.randn(H, R, d, generator=g) * torch.rand(H, R, 1, generator=g) * 5
    x[0, 3] = 0
    x[1, 2, :5] = 1e-6
    x[2, 4, 7] = 300.0
    codes, scales = quantize_rows(x)

    def run(prim, *arrays):
        ex = tvm.compile(tvm.IRModule({"main": prim.with_attr("global_symbol", "main")}), target="llvm")
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        ex["main"](*tensors)
        return [t.numpy() for t in tensors]

    positions, fill = np.tile(np.arange(R, dtype=np.int32), (H, 1)), np.array([R], np.int32)
    unmatched = np.full((H, R), -1, np.int32)  # no row was in the cache: every row is quantised

    def store(rows, before):
        *_, got_codes, got_scales = run(build_store_kernel(H, R, d), rows, positions, fill, before,
                                        np.zeros((H, R, d), np.int8), np.zeros(scales.shape, np.float16))
        return got_codes, got_scales

    def same(got):
        return np.array_equal(got[0], codes.numpy()) and np.array_equal(got[1].view(np.uint16),
                                                                        scales.numpy().view(np.uint16))

    assert same(store(x.numpy(), unmatched))
    *_, deq = run(build_dequantize_kernel(H, R, d), codes.numpy(), scales.numpy(), np.zeros((H, R, d), np.float32))
    assert np.array_equal(deq, _dequantized(codes.numpy(), scales.numpy()))
    _, trip = run(build_round_trip_kernel(H, R, d), x.numpy(), np.zeros((H, R, d), np.float32))
    assert np.array_equal(trip, round_trip(x).numpy())
    assert same(store(deq, unmatched))  # re-quantising a dequantised row is exact


def test_store_moves_kept_rows_and_quantises_the_others():
    """``store`` after a compaction: rows kept from the cache (moved down, order kept) take their
    old codes, block rows and a row rewritten in place (D2O's merge: same position, new values)
    are quantised — the bits ``kv_quant`` gives the compacted rows, in place."""
    from edgekv.compiler.kernels.kv_int8 import build_store_kernel
    from edgekv.engine.kv_quant import quantize_rows

    H, N, d = 2, 40, 64
    rng = np.random.default_rng(0)
    old = torch.from_numpy(rng.standard_normal((H, N, d)).astype(np.float32))
    old_codes, old_scales = quantize_rows(old)
    old_rows = _dequantized(old_codes.numpy(), old_scales.numpy())
    before = np.tile(np.arange(N, dtype=np.int32), (H, 1))
    rows, positions = np.zeros((H, N, d), np.float32), np.zeros((H, N), np.int32)
    for h in range(H):
        keep = np.sort(rng.choice(N, 30, replace=False))
        rows[h, :30], positions[h, :30] = old_rows[h, keep], keep
        rows[h, 30:36], positions[h, 30:36] = rng.standard_normal((6, d)), 100 + np.arange(6)
        rows[h, 5] += 0.5
    want_codes, want_scales = quantize_rows(torch.from_numpy(rows[:, :36]))
    ex = tvm.compile(tvm.IRModule({"main": build_store_kernel(H, N, d).with_attr("global_symbol", "main")}),
                     target="llvm")
    codes, scales = tvm.runtime.tensor(old_codes.numpy()), tvm.runtime.tensor(old_scales.numpy())
    ex["main"](*[tvm.runtime.tensor(a) for a in (rows, positions, np.array([36], np.int32), before)], codes, scales)
    assert np.array_equal(codes.numpy()[:, :36], want_codes.numpy())
    assert np.array_equal(scales.numpy()[:, :36].view(np.uint16), want_scales.numpy().view(np.uint16))


@pytest.mark.parametrize("name", [*FAST, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW)])
def test_compiled_int8_equals_the_eager_int8_engine(model, prompt, name):
    budget = PROMPT + 8 if name == "full" else N
    res = compile_model(model, make_policy(name, {}), budget, B, target=TEST_TARGET, kv_dtype="int8")
    assert res.manifest["kv_dtype"] == "int8"
    rt = HostRuntime.from_executable(res.executable, res.manifest, res.params)
    eng = BlockEngine(model, make_policy(name, {}), budget, B, kv_dtype="int8")
    got, want = rt.prefill(prompt.numpy()), eng.prefill(prompt).numpy()
    assert _rel(got, want) < 1e-3
    _same_cache(rt, eng, "after the prompt", name == "d2o")
    for step in range(4):  # decode: one more row quantised per step (and, when full, one evicted)
        tok = int(np.argmax(got))
        got, want = rt.decode(tok), eng.decode(tok).numpy()
        assert _rel(got, want) < 1e-3
        _same_cache(rt, eng, f"decode step {step}", name == "d2o")


def test_int8_artifact_plans_codes_and_scales(model, tmp_path):
    """The manifest's layout and plan count int8 codes with float16 scales; the plan's cache bytes
    equal the layout's, and K/V take ``kv_row_bytes(d, "int8")`` per row (68 against 256 at d = 64)."""
    out = tmp_path / "a"
    res = compile_model(model, make_policy("keydiff", {}), N, B, target=TEST_TARGET, out_dir=out, kv_dtype="int8")
    fp32 = compile_model(model, make_policy("keydiff", {}), N, B, target=TEST_TARGET, kv_dtype="fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_dtype"] == "int8"
    assert manifest["cache_fields"] == [["k", "int8"], ["v", "int8"], ["pos", "int32"], ["fill", "int32"],
                                        ["k_scale", "float16"], ["v_scale", "float16"]]
    cfg = model.config
    layer = manifest["cache"][0]
    assert layer["k"] == [cfg.num_kv_heads, N, cfg.head_dim] and layer["k_scale"] == [cfg.num_kv_heads, N, 1]
    kv = 2 * cfg.num_kv_heads * N * kv_row_bytes(cfg.head_dim, "int8")
    other = cfg.num_kv_heads * N * 4 + 4  # positions and fill
    assert res.manifest["memory_plan"]["cache_bytes"] == cfg.num_layers * (kv + other)
    kv32 = 2 * cfg.num_kv_heads * N * kv_row_bytes(cfg.head_dim, "fp32")
    assert fp32.manifest["memory_plan"]["cache_bytes"] == cfg.num_layers * (kv32 + other)
    rt = HostRuntime(out)  # loads from disk with its int8 / float16 cache tensors
    rt.prefill(np.arange(30) % 200)
    assert rt.cache_field(0, "k").dtype == np.int8 and rt.cache_field(0, "k_scale").dtype == np.float16
    assert rt.cache_lengths() == [N] * cfg.num_layers


def test_int8_is_refused_for_gpu_targets_before_compiling(model):
    with pytest.raises(CompileError, match="--kv-dtype int8 has no GPU kernels yet.*--kv-dtype fp32"):
        compile_model(model, make_policy("keydiff", {}), N, B, target="opencl", kv_dtype="int8")


# ---- the native runtime and the commands users call -------------------------------------------------

def _native_missing() -> str | None:
    from edgekv.runtime import native

    if native.available() and native.cli_path() is not None:
        return None
    return "the native runtime is not built: `pip install -e .` builds runtime/ (needs cmake and a C compiler)"


@pytest.fixture(scope="module")
def int8_artifacts(model, tmp_path_factory):
    """keydiff compiled with int8 and fp32 caches (same N and B), on disk."""
    out = {}
    for kv in ("int8", "fp32"):
        out[kv] = tmp_path_factory.mktemp(f"kv-{kv}") / "art"
        compile_model(model, make_policy("keydiff", {}), N, B, target=TEST_TARGET, out_dir=out[kv], kv_dtype=kv)
    return out


def test_native_runtime_runs_int8_like_the_host_runtime(int8_artifacts, prompt, tmp_path):
    """The C runtime reads the int8 layout from program.ekv like any other cache fields: the same
    kept rows after every block, logits to 1e-5, the same greedy tokens; its snapshots record the
    format, load in HostRuntime, and an fp32 artifact refuses them naming both formats."""
    if _native_missing():
        pytest.skip(_native_missing())
    from edgekv.artifact import snapshot_file as sf
    from edgekv.runtime import native

    art = int8_artifacts["int8"]
    ids = prompt.tolist()
    host, nat = HostRuntime(art), native.NativeRuntime(art)
    host.prepare(ids)
    kept_host = []
    for s in range(0, len(ids), B):
        want = host.step_block(ids[s: s + B])
        kept_host.append([host.kept_positions(layer) for layer in range(host.num_layers)])
    kept_nat = []
    got = nat.prefill(ids, on_block=lambda rt: kept_nat.append([rt.kept_positions(layer)
                                                                 for layer in range(rt.num_layers)]))
    for a, b in zip(kept_host, kept_nat, strict=True):
        for layer in range(host.num_layers):
            np.testing.assert_array_equal(a[layer], b[layer])
    assert _rel(np.asarray(got), want) <= 1e-5
    snap = tmp_path / "doc.ekv"
    nat.save_cache(snap)
    assert sf.read_header(snap).kv_dtype == sf.KV_DTYPE_CODES["int8"]
    loaded = HostRuntime(art)
    loaded.load_cache(snap)
    tok = int(np.argmax(want))
    assert _rel(loaded.decode(tok), host.decode(tok)) <= 1e-5
    host.reset()
    nat.reset()
    assert nat.generate(ids, 12) == host.generate(ids, 12)
    for runtime in (HostRuntime(int8_artifacts["fp32"]), native.NativeRuntime(int8_artifacts["fp32"])):
        with pytest.raises(Exception, match="stored as int8, this artifact stores float32"):
            runtime.load_cache(snap)


def test_cli_compiles_and_runs_an_int8_artifact(tiny_dir, tmp_path):
    """`edgekv compile --kv-dtype int8 --budget 24KiB` buys the entries the int8 plan says; `edgekv run`
    takes the same byte budget and reports the format; asking an int8 artifact for fp32 is refused
    with the fix."""
    from typer.testing import CliRunner

    from edgekv.budget import parse_budget
    from edgekv.cli import app

    runner = CliRunner()
    art = tmp_path / "a"
    res = runner.invoke(app, ["compile", str(tiny_dir), "--kv-dtype", "int8", "--budget", "24KiB", "--block", "8",
                              "-o", str(art)])
    assert res.exit_code == 0, res.stdout + res.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    cfg = tiny_random_model(0).config
    assert manifest["kv_dtype"] == "int8"
    assert manifest["budget"] == parse_budget("24KiB", cfg, 8, kv_dtype="int8") > parse_budget("24KiB", cfg, 8)
    runtimes = ["tvm"] + ([] if _native_missing() else ["native"])
    for runtime in runtimes:
        # the byte budget it was compiled with names the same N (counted in the artifact's format)
        res = runner.invoke(app, ["run", str(art), "--prompt", "the cat sat on the mat " * 12, "--max-new-tokens", "4",
                                  "--runtime", runtime, "--budget", "24KiB"])
        text = " ".join((res.stdout + res.stderr).split())
        assert res.exit_code == 0, text
        assert "(int8, N=" in text, text
    res = runner.invoke(app, ["run", str(art), "--prompt", "hi", "--kv-dtype", "fp32"])
    text = " ".join((res.stdout + res.stderr).split())
    assert res.exit_code == 2 and "stores its KV cache in int8" in text and "--kv-dtype fp32" in text, text
