"""Each policy's TIR score kernel against its reference scorer, and the shared top-N select +
compaction kernel against ``topk_keep`` (ties → lower index), on random tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from edgekv.compiler.kernels import build_select  # noqa: E402
from edgekv.compiler.policy_kernels import build_score, kernel_params  # noqa: E402
from edgekv.policies.base import EvictionContext, topk_keep  # noqa: E402
from edgekv.policies.keydiff import KeyDiffPolicy  # noqa: E402
from edgekv.policies.lagkv import LagKVPolicy  # noqa: E402
from edgekv.policies.streaming import StreamingPolicy  # noqa: E402

H, N, B, D = 2, 24, 8, 16
TARGET = tvm.target.Target({"kind": "llvm", "opt-level": 0, "num-cores": 2})
# each policy's kernel gets its parameters from its compiled face (``kernel_params``)
POLICIES = {name: (pol, kernel_params(pol, N)) for name, pol in {
    "streaming": StreamingPolicy(sinks=3),
    "keydiff": KeyDiffPolicy(),
    "keydiff_recent": KeyDiffPolicy(recent_window=5),
    "lagkv": LagKVPolicy(sinks=2, lag=5),
}.items()}


def _ty(shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


@pytest.fixture(scope="module")
def vm():
    """One module: a score function per policy, and select (in place) taking scores as input."""
    bb = relax.BlockBuilder()
    args_ty = [_ty((H, N, D)), _ty((H, N, D)), _ty((H, N), "int32"), _ty((1,), "int32"),
               _ty((1, H, B, D)), _ty((1, H, B, D)), _ty((B,), "int32"), _ty((1,), "int32")]
    for name, (_, params) in POLICIES.items():
        policy = "keydiff" if name.startswith("keydiff") else name
        vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(args_ty)]
        with bb.function(f"score_{name}", vars_):
            gv = bb.add_func(build_score(policy, H, N, B, D, "float32", params), f"k_{name}")
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir(gv, vars_, _ty((H, N + B))))
            bb.emit_func_output(out)
    vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(args_ty + [_ty((H, N + B))])]
    with bb.function("select", vars_):
        gv = bb.add_func(build_select(H, N, B, D, "float32", True), "k_select")
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir_inplace(gv, vars_, [0, 1, 2, 3], [t for t in args_ty[:4]]))
        bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=TARGET), tvm.cpu())


def _inputs(rng, fill, n_valid, dup=False):
    kc = rng.standard_normal((H, N, D)).astype("float32")
    kb = rng.standard_normal((1, H, B, D)).astype("float32")
    if dup:  # many identical keys → exactly tied scores
        kc[:, 1::3] = kc[:, :1]
        kb[0, :, ::2] = kc[:, :1]
    vc = rng.standard_normal((H, N, D)).astype("float32")
    vb = rng.standard_normal((1, H, B, D)).astype("float32")
    pc = np.tile(np.arange(N, dtype="int32"), (H, 1))
    pb = np.arange(fill, fill + B, dtype="int32")
    return [kc, vc, pc, np.array([fill], "int32"), kb, vb, pb, np.array([n_valid], "int32")]


def _ctx(a, fill, n_valid):
    kc, vc, pc, _, kb, vb, pb, _ = (torch.from_numpy(x) for x in a)
    keys = torch.cat([kc[:, :fill], kb[0, :, :n_valid]], 1)
    values = torch.cat([vc[:, :fill], vb[0, :, :n_valid]], 1)
    pos = torch.cat([pc[:, :fill], pb[None, :n_valid].expand(H, n_valid)], 1)
    return EvictionContext(layer=0, num_layers=1, budget=N, keys=keys, values=values, positions=pos, n_cache=fill)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("fill,n_valid,dup", [(N, B, False), (N - 3, 5, False), (N, B, True), (20, 8, True)])
def test_score_and_select_match_reference(vm, name, fill, n_valid, dup):
    rng = np.random.default_rng(fill * 31 + n_valid + dup)
    a = _inputs(rng, fill, n_valid, dup)
    n = fill + n_valid
    score = vm[f"score_{name}"](*[tvm.runtime.tensor(x) for x in a]).numpy()[:, :n]
    policy, _ = POLICIES[name]
    ctx = _ctx(a, fill, n_valid)
    ref = policy.score(ctx).numpy()
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(score), finite)
    np.testing.assert_allclose(score[finite], ref[finite], rtol=1e-5, atol=1e-6)
    # selection on the reference's own scores: exactly topk_keep, in temporal order, in place
    tens = [tvm.runtime.tensor(x) for x in a]
    padded = np.full((H, N + B), -np.inf, "float32")
    padded[:, :n] = ref
    vm["select"](*tens, tvm.runtime.tensor(padded))
    kept = topk_keep(torch.from_numpy(ref), N).numpy()
    assert int(tens[3].numpy()[0]) == min(n, N)
    np.testing.assert_array_equal(tens[2].numpy()[:, : kept.shape[1]], np.take_along_axis(ctx.positions.numpy(), kept, 1))
    k_ref = np.take_along_axis(ctx.keys.numpy(), kept[..., None], 1)
    np.testing.assert_array_equal(tens[0].numpy()[:, : kept.shape[1]], k_ref)
    v_ref = np.take_along_axis(ctx.values.numpy(), kept[..., None], 1)
    np.testing.assert_array_equal(tens[1].numpy()[:, : kept.shape[1]], v_ref)


def test_ties_go_to_the_lower_index(vm):
    a = _inputs(np.random.default_rng(0), N, B)
    score = np.zeros((H, N + B), "float32")  # all tied: keep the N oldest
    score[1, 5] = -1.0  # one loser on head 1: it goes, the first newcomer stays
    tens = [tvm.runtime.tensor(x) for x in a]
    vm["select"](*tens, tvm.runtime.tensor(score))
    pos = tens[2].numpy()
    assert pos[0].tolist() == list(range(N))
    assert pos[1].tolist() == [p for p in range(N + 1) if p != 5]


def test_policy_files_hold_their_kernels_and_import_no_tvm(monkeypatch):
    """One policy file holds the scorer, one compiler file its compiled face; ``edgekv.policies`` never
    imports the compiler, and neither it nor the face registry imports tvm."""
    import pathlib
    import re
    import subprocess
    import sys

    import edgekv.policies
    from edgekv.compiler.policy_kernels import KERNELS, UnsupportedPolicyError, compiled_policy_names
    from edgekv.policies import REGISTRY

    for module in ("edgekv.policies", "edgekv.compiler.policy_kernels"):
        code = f"import sys, {module}; assert 'tvm' not in sys.modules, 'tvm was imported'"
        subprocess.run([sys.executable, "-c", code], check=True)
    for path in pathlib.Path(edgekv.policies.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+\S*compiler", text, re.M), path
        assert len(text.splitlines()) <= 500, path
    assert compiled_policy_names() == ["d2o", "dapq", "full", "h2o", "keydiff", "lagkv", "reconstruct", "rocketkv",
                                       "snapkv", "snapkv++", "streaming", "tova"]
    assert sorted(REGISTRY) == compiled_policy_names() == sorted(KERNELS)
    for name in compiled_policy_names():  # each face's builders sit in its policy's compiler file
        face = KERNELS[name]
        module = f"edgekv.compiler.policy_kernels.{REGISTRY[name].__module__.rsplit('.', 1)[1]}"
        for builder in (face.evict_kernel, face.observe_kernel, face.gpu_evict_kernel, face.gpu_observe_kernel,
                        face.emit_site_eviction, face.emit_decode_attention, face.emit_after_select):
            assert builder is None or builder.__module__ == module, (name, builder)
    assert POLICIES["keydiff_recent"][1]["recent"] == 5 and POLICIES["lagkv"][1]["lag"] == 5
    # the refusal of a policy without a compiled face, on a stand-in
    from dataclasses import dataclass

    from edgekv.policies.base import Policy

    @dataclass
    class Uncompiled(Policy):
        name = "uncompiled"

    monkeypatch.setitem(REGISTRY, "uncompiled", Uncompiled)
    with pytest.raises(UnsupportedPolicyError, match="no compiled kernel yet"):
        kernel_params(Uncompiled(), N)
    with pytest.raises(UnsupportedPolicyError, match="no compiled kernel yet"):
        build_score("uncompiled", H, N, B, D)


# ---- block attention (tiled online softmax) against a float64 numpy oracle ----

def _attention_oracle(q, kb, vb, kc, vc, nf, nv, scale):
    _, Hq, Bq, _ = q.shape
    G = Hq // kc.shape[0]
    out = np.zeros(q.shape, np.float64)
    for h in range(Hq):
        keys = np.concatenate([kc[h // G, :nf], kb[0, h // G]], 0).astype(np.float64)
        vals = np.concatenate([vc[h // G, :nf], vb[0, h // G]], 0).astype(np.float64)
        s = q[0, h].astype(np.float64) @ keys.T * scale
        s[np.arange(Bq)[:, None] < np.arange(keys.shape[0])[None, :] - nf] = -np.inf  # causal in block
        p = np.exp(s - s.max(1, keepdims=True))
        out[0, h] = (p / p.sum(1, keepdims=True)) @ vals
    out[0, :, nv:] = 0
    return out


# (Hq, H, N, B, D, fill, n_valid): SmolLM2's shapes (full and partial cache / block, decode),
# prime and odd sizes (tiles that do not divide N, B = 1 with G = 2, D not a multiple of 16)
ATTN_CASES = [(9, 3, 1024, 128, 64, 1024, 128), (9, 3, 1024, 128, 64, 997, 77), (9, 3, 1024, 1, 64, 1024, 1),
              (4, 2, 37, 13, 24, 29, 11), (6, 3, 67, 7, 16, 0, 7), (2, 1, 131, 1, 8, 61, 1), (3, 1, 5, 3, 4, 5, 2)]


@pytest.mark.parametrize("cores", [1, 2, 4])  # row tiles of 192 / 192 / 96 rows at SmolLM2's shape
@pytest.mark.parametrize("case", ATTN_CASES, ids=[str(c) for c in ATTN_CASES])
def test_block_attention_matches_oracle(case, cores):
    from edgekv.compiler.kernels import build_attention

    Hq, H, Nc, Bc, Dc, nf, nv = case
    scale = 1 / np.sqrt(Dc)
    f = build_attention(Hq, H, Nc, Bc, Dc, scale, "float32", 0, cores).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    rng = np.random.default_rng(sum(case))
    a = [rng.standard_normal(s).astype("float32") * 2 for s in
         [(1, Hq, Bc, Dc), (1, H, Bc, Dc), (1, H, Bc, Dc), (H, Nc, Dc), (H, Nc, Dc)]]
    a[3][:, nf:] = np.nan  # rows past fill are never read into a result
    a += [np.array([nf], "int32"), np.array([nv], "int32"), np.full((1, Hq, Bc, Dc), 7, "float32")]
    t = [tvm.runtime.tensor(x) for x in a]
    lib["main"](*t)
    ref = _attention_oracle(*a[:5], nf, nv, scale)
    np.testing.assert_allclose(t[-1].numpy(), ref, rtol=2e-5, atol=2e-5)


# (Hq, H, W, B, D, fill, n_valid): a sliding-window layer (Gemma 3's local layers) — a full window with a
# full / partial block, decode, a window smaller than the block, windows spanning several key tiles
WINDOW_CASES = [(4, 1, 16, 8, 32, 16, 8), (4, 1, 16, 8, 32, 9, 5), (4, 1, 16, 1, 32, 16, 1), (4, 2, 5, 13, 24, 5, 11),
                (2, 1, 100, 64, 16, 100, 64), (2, 1, 100, 64, 16, 37, 50)]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[str(c) for c in WINDOW_CASES])
def test_window_attention_and_ring_write_match_oracle(case):
    """A local layer's step: attention over cache ⊕ block masked to the last W positions (the cache is a
    ring: token p in slot p mod W, a full one wrapped so that slot order is not position order), then the
    block's valid rows written to their slots in place — nothing else moves."""
    from edgekv.compiler.kernels import build_attention, build_window

    Hq, H, W, Bc, Dc, nf, nv = case
    start = nf if nf < W else 2 * W + 3  # the block's first position: a partial ring has never wrapped
    scale = 1 / np.sqrt(Dc)
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    f = build_attention(Hq, H, W, Bc, Dc, scale, "float32", 0, 2, W).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=target)
    rng = np.random.default_rng(sum(case))
    a = [rng.standard_normal(s).astype("float32") * 2 for s in
         [(1, Hq, Bc, Dc), (1, H, Bc, Dc), (1, H, Bc, Dc), (H, W, Dc), (H, W, Dc)]]
    a[3][:, nf:] = np.nan  # slots past fill are never read into a result
    cached = np.arange(start - nf, start)  # the positions the ring holds, each in slot p mod W
    pc = np.full((H, W), -1, "int32")
    pc[:, cached % W] = cached
    pb = np.arange(start, start + Bc, dtype="int32")
    args = a[:5] + [pc, np.array([nf], "int32"), pb, np.array([nv], "int32"), np.full((1, Hq, Bc, Dc), 7, "float32")]
    t = [tvm.runtime.tensor(x) for x in args]
    lib["main"](*t)
    q, kb, vb, kc, vc = a[:5]
    G = Hq // H
    ref = np.zeros(q.shape)
    key_pos = np.concatenate([pc[0, :nf], pb])  # cache slots [0, fill), then the block's rows
    for h in range(Hq):
        keys = np.concatenate([kc[h // G, :nf], kb[0, h // G]], 0).astype(np.float64)
        vals = np.concatenate([vc[h // G, :nf], vb[0, h // G]], 0).astype(np.float64)
        s = q[0, h].astype(np.float64) @ keys.T * scale
        rows = pb[:, None]
        s[(key_pos[None, :] > rows) | (key_pos[None, :] <= rows - W)] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        ref[0, h] = (p / p.sum(1, keepdims=True)) @ vals
    ref[0, :, nv:] = 0
    np.testing.assert_allclose(t[-1].numpy(), ref, rtol=2e-5, atol=2e-5)

    g = build_window(H, W, Bc, Dc).with_attr("global_symbol", "main")
    ring = tvm.compile(tvm.IRModule({"main": g}), target=target)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    c = [tvm.runtime.tensor(x) for x in (kc, vc, pc, np.array([nf], "int32"), kb, vb, pb, np.array([nv], "int32"))]
    ring["main"](*c)
    want_k, want_p = kc.copy(), pc.copy()
    for i in range(max(0, nv - W), nv):  # the block's rows at p mod W, the newest last
        want_k[:, pb[i] % W] = kb[0, :, i]
        want_p[:, pb[i] % W] = pb[i]
    assert int(c[3].numpy()[0]) == min(nf + nv, W)
    np.testing.assert_array_equal(c[0].numpy(), want_k)
    np.testing.assert_array_equal(c[2].numpy(), want_p)
    held = np.sort(c[2].numpy()[:, :min(nf + nv, W)], 1)  # the valid slots hold exactly the newest W
    end = start + nv
    np.testing.assert_array_equal(held, np.tile(np.arange(max(0, end - W), end), (H, 1)))


def test_attention_row_tiles_split_evenly_over_the_cores():
    from edgekv.compiler.kernels.attention import MAX_QT, attention_tiles

    for cores, qt in ((1, 192), (2, 192), (3, 192), (4, 96)):
        t = attention_tiles(9, 3, 128, 64, cores)
        assert t["QT"] == qt and (3 * 9 // 3 * 128 // t["QT"]) % cores == 0, (cores, t)
    assert attention_tiles(9, 3, 1, 64, 2)["QT"] == 3  # decode: one tile of the G rows
    assert attention_tiles(4, 2, 13, 24, 2)["QT"] <= MAX_QT


def _scheduled_vs_default(mod, inputs, pre=()):
    """(the rules ScheduleCPU applied, [output of the edgekv CPU pipeline, output of TVM's
    default unscheduled lowering]) for ``mod``'s ``main`` on ``inputs``; ``pre``: Relax passes
    the pipeline runs before legalization (FuseTransposeMatmul)."""
    from tvm.relax.backend.cpu_generic import pipeline as P

    from edgekv.compiler.backend.cpu_schedule import ScheduleCPU, cpu_pipeline

    tgt = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    with tgt:
        rules = ScheduleCPU()
        rules(tvm.transform.Sequential(list(pre) + P.legalize_passes(tgt))(mod))
    outs = []
    for pipe in (cpu_pipeline(tgt), None):
        ex = tvm.compile(mod, target=tgt, relax_pipeline=pipe) if pipe else tvm.compile(mod, target=tgt)
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(v) for v in inputs]).numpy())
    return rules.scheduled, outs


# ---- GEMM / GEMV rules (cpu_schedule.ScheduleCPU) against TVM's unscheduled lowering ----

# (lead dims, M, K, N): SmolLM2's prefill GEMMs and decode GEMVs, and odd sizes (prime M/K,
# N without a register tile → the generic rule or no rule at all)
GEMM_CASES = [((1,), 128, 576, 192), ((), 128, 1536, 576), ((1,), 128, 576, 576), ((1,), 1, 576, 1536), ((), 1, 1536, 576),
              ((), 13, 37, 48), ((1,), 7, 29, 16), ((), 5, 11, 13), ((), 3, 17, 96)]


@pytest.mark.parametrize("case", GEMM_CASES, ids=[str(c) for c in GEMM_CASES])
def test_scheduled_gemm_equals_unscheduled(case):
    lead, M, K, Nn = case
    bb = relax.BlockBuilder()
    x = relax.Var("x", _ty(lead + (M, K)))
    w = relax.Var("w", _ty((K, Nn)))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(y)
    rng = np.random.default_rng(M * K + Nn)
    a = [rng.standard_normal(lead + (M, K)).astype("float32"), rng.standard_normal((K, Nn)).astype("float32")]
    scheduled, outs = _scheduled_vs_default(bb.get(), a)
    if Nn % 16 == 0:
        assert scheduled and scheduled[0][1] == "dense", scheduled
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6 * np.abs(outs[1]).max())
    np.testing.assert_allclose(outs[0], a[0] @ a[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,K,N,cores", [(128, 576, 576, 2), (128, 576, 192, 2), (128, 576, 1536, 2),
                                          (128, 576, 576, 4), (128, 576, 576, 1), (64, 96, 96, 2)])
def test_dense_tiles_split_panels_evenly_over_the_cores(M, K, N, cores):
    """The parallel loop runs over N / NR panels: the tile keeps every core busy to the end
    (a panel count that divides evenly, or ≥ 4 per core), and its MR × NS accumulators fit the
    registers this CPU's tile may use (``register_tile``)."""
    from edgekv.compiler.kernels.dense import dense_tiles
    from edgekv.compiler.kernels.register_tile import subpanel_cols, vector_registers

    mr, nr = dense_tiles(M, K, N, cores)
    panels = N // nr
    assert N % nr == 0 and M % mr == 0
    assert panels % cores == 0 or panels >= 4 * cores, (mr, nr)
    regs = vector_registers()
    assert mr * subpanel_cols(nr) // regs.lanes <= regs.accumulators


# (lead dims, M, K, N, NR): SmolLM2's prefill GEMMs and decode GEMVs on packed panels, odd M / K
PACKED_CASES = [((1,), 128, 576, 192, 32), ((1,), 128, 1536, 576, 64), ((1,), 1, 576, 1536, 64),
                ((), 1, 1536, 576, 64), ((), 13, 37, 48, 16), ((1,), 7, 29, 96, 32)]


@pytest.mark.parametrize("case", PACKED_CASES, ids=[str(c) for c in PACKED_CASES])
def test_packed_dense_and_gemv_equal_the_matmul(case):
    """The kernels of ``pack_weights.py`` on [N / NR, K, NR] panels (``pack_weight``) give the
    float64 product of the unpacked weight (sequential k summation: fp32 rounding only)."""
    from edgekv.compiler.kernels.dense import build_dense_kernel, build_packed_gemv_kernel, pack_weight, unpack_weight

    lead, M, K, Nn, nr = case
    a_shape, c_shape = lead + (M, K), lead + (M, Nn)
    build = build_packed_gemv_kernel if M == 1 else (lambda a, w, c, r: build_dense_kernel(a, w, c, 2, packed_nr=r))
    f = build(a_shape, (K, Nn), c_shape, nr).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    rng = np.random.default_rng(M + K + Nn)
    a = rng.standard_normal(a_shape).astype("float32")
    w = rng.standard_normal((K, Nn)).astype("float32")
    np.testing.assert_array_equal(unpack_weight(pack_weight(w, nr)), w)
    out = tvm.runtime.tensor(np.full(c_shape, np.nan, "float32"))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(pack_weight(w, nr)), out)
    ref = a.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_pack_weights_packs_only_weights_used_by_matmuls_alone():
    """In a tiny Llama: every projection (and its untied LM head) is packed, its matmuls become
    the packed kernels; the embedding table — also read by ``take`` — keeps its layout."""
    from edgekv.compiler import BlockCacheSpec
    from edgekv.compiler.passes.pack_weights import PackWeights, packed_name
    from edgekv.compiler.pipeline import FUNCTIONS, import_model, lower_module
    from edgekv.models.tiny import tiny_random_model

    mod, params, _ = import_model(tiny_random_model(), 8)
    mod, _, _ = lower_module(mod, BlockCacheSpec(budget=32, policy="full"))
    packer = PackWeights(list(FUNCTIONS), cores=2)
    packed_mod = packer(mod)
    names = {p.name for p in packed_mod["prefill_block"].params}
    assert packer.packed and all(".T" in n and ("proj" in n or "lm_head" in n) for n in packer.packed)
    assert all(packed_name(n, r) in names for n, r in packer.packed.items())
    assert not any("embed" in n for n in packer.packed)
    assert any(gv.name_hint.startswith("matmul_packed_gemv") for gv in packed_mod.functions)
    assert any(gv.name_hint.startswith("matmul_packed_gemm") for gv in packed_mod.functions)


def test_dense_tiles_without_a_balanced_width_take_the_widest():
    from edgekv.compiler.kernels.dense import dense_tiles

    assert dense_tiles(64, 96, 48, 2)[1] == 16  # 3 panels of 16: nothing divides evenly
    assert dense_tiles(64, 96, 40, 2) is None  # no 16-multiple: the generic rule's case


@pytest.mark.parametrize("fill,n_valid", [(1024, 128), (1000, 77), (1024, 1)])
def test_select_at_model_shape_with_special_scores(fill, n_valid):
    """SmolLM2's cache shape; scores with ties, ±0, ±inf and NaN (never evicted, like topk_keep)."""
    Hm, Nm, Bm, Dm = 3, 1024, 128, 64
    f = build_select(Hm, Nm, Bm, Dm, "float32", True).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    rng = np.random.default_rng(fill + n_valid)
    n = fill + n_valid
    sc = rng.choice(np.array([-1.5, -0.0, 0.0, 0.25, 2.0], "float32"), (Hm, Nm + Bm))
    sc[:, ::7] = rng.standard_normal((Hm, len(range(0, Nm + Bm, 7)))).astype("float32")
    sc[:, 3::11] = np.inf
    sc[:, 5::13] = -np.inf
    sc[:, 9::17] = np.nan
    kc = rng.standard_normal((Hm, Nm, Dm)).astype("float32")
    kb = rng.standard_normal((1, Hm, Bm, Dm)).astype("float32")
    pc = np.tile(np.arange(Nm, dtype="int32"), (Hm, 1))
    pb = np.arange(Nm, Nm + Bm, dtype="int32")
    a = [kc, kc.copy(), pc, np.array([fill], "int32"), kb, kb.copy(), pb, np.array([n_valid], "int32"), sc]
    t = [tvm.runtime.tensor(x) for x in a]
    lib["main"](*t)
    kept = topk_keep(torch.from_numpy(sc[:, :n]), Nm).numpy()
    cand = np.concatenate([pc[:, :fill], np.tile(pb[:n_valid], (Hm, 1))], 1)
    assert int(t[3].numpy()[0]) == min(n, Nm)
    np.testing.assert_array_equal(t[2].numpy()[:, : kept.shape[1]], np.take_along_axis(cand, kept, 1))


# (lead dims, M, K, N) of ``x · Wᵀ`` (FuseTransposeMatmul's NT form: the tied LM head)
NT_CASES = [((), 1, 576, 4096), ((1,), 1, 64, 256), ((), 3, 32, 12), ((), 2, 24, 8)]


@pytest.mark.parametrize("case", NT_CASES, ids=[str(c) for c in NT_CASES])
def test_scheduled_nt_gemm_equals_unscheduled(case):
    lead, M, K, Nn = case
    bb = relax.BlockBuilder()
    x = relax.Var("x", _ty(lead + (M, K)))
    w = relax.Var("w", _ty((Nn, K)))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
        bb.emit_func_output(y)
    rng = np.random.default_rng(K + Nn)
    a = [rng.standard_normal(lead + (M, K)).astype("float32"), rng.standard_normal((Nn, K)).astype("float32")]
    scheduled, outs = _scheduled_vs_default(bb.get(), a, [relax.transform.FuseTransposeMatmul()])
    assert scheduled and scheduled[0][1] == ("dense" if K % 16 == 0 else "nt_matmul"), scheduled
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6 * np.abs(outs[1]).max())


@pytest.mark.parametrize("fill,n_valid", [(N, B), (N - 3, 5), (10, 8), (0, 3)])
@pytest.mark.parametrize("with_score", [True, False])
def test_select_compacts_entry_state_with_kv(fill, n_valid, with_score):
    """Per-entry state [S, H, N] is appended / compacted with the same kept indices as K/V/pos."""
    S = 2
    if not with_score and fill + n_valid > N:
        pytest.skip("append-only never evicts")
    bb = relax.BlockBuilder()
    args_ty = [_ty((H, N, D)), _ty((H, N, D)), _ty((H, N), "int32"), _ty((1,), "int32"),
               _ty((1, H, B, D)), _ty((1, H, B, D)), _ty((B,), "int32"), _ty((1,), "int32")]
    args_ty += ([_ty((H, N + B))] if with_score else []) + [_ty((S, H, N)), _ty((S, H, N + B))]
    vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(args_ty)]
    with bb.function("select", vars_):
        gv = bb.add_func(build_select(H, N, B, D, "float32", with_score, S), "k_select")
        with bb.dataflow():
            st = len(args_ty) - 2
            out = bb.emit_output(relax.call_tir_inplace(gv, vars_, [0, 1, 2, 3, st], args_ty[:4] + [args_ty[st]]))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=TARGET), tvm.cpu())
    rng = np.random.default_rng(fill + 7 * n_valid)
    a = _inputs(rng, fill, n_valid)
    n = fill + n_valid
    score = rng.standard_normal((H, N + B)).astype("float32")
    state = rng.standard_normal((S, H, N)).astype("float32")
    cand = rng.standard_normal((S, H, N + B)).astype("float32")
    tens = [tvm.runtime.tensor(x) for x in a + ([score] if with_score else []) + [state, cand]]
    vm["select"](*tens)
    kept = topk_keep(torch.from_numpy(score[:, :n]), N).numpy() if n > N else np.tile(np.arange(n), (H, 1))
    got = tens[-2].numpy()[:, :, : kept.shape[1]]
    np.testing.assert_array_equal(got, np.take_along_axis(cand[:, :, :n], np.broadcast_to(kept, (S,) + kept.shape), 2))
    ctx = _ctx(a, fill, n_valid)
    np.testing.assert_array_equal(tens[2].numpy()[:, : kept.shape[1]], np.take_along_axis(ctx.positions.numpy(), kept, 1))
    assert int(tens[3].numpy()[0]) == min(n, N)


# ---- query-based policies (kernel inputs: the block's queries; H2O: per-entry state) -----------------
from edgekv.compiler.policy_kernels import build_observe, site_params  # noqa: E402
from edgekv.policies.h2o import H2OPolicy  # noqa: E402
from edgekv.policies.snapkv import SnapKVPolicy  # noqa: E402
from edgekv.policies.snapkv_pp import SnapKVPlusPlusPolicy  # noqa: E402
from edgekv.policies.tova import TOVAPolicy  # noqa: E402

HQ, SCALE = 4, 0.25  # G = 2 query heads per KV head
Q_POLICIES = {
    "snapkv": SnapKVPolicy(window=4, kernel=3),
    "snapkv_max": SnapKVPolicy(window=3, kernel=5, pooling="max"),
    "snapkv_wide": SnapKVPolicy(window=32, kernel=7),  # window clipped to the block, κ > some spans
    "snapkv++": SnapKVPlusPlusPolicy(window=4, kernel_short=3, kernel_long=7, long_threshold=30),
    "tova": TOVAPolicy(),
    "tova_layer": TOVAPolicy(heads="layer"),
    "h2o": H2OPolicy(recent_ratio=0.25),
    "h2o_pure": H2OPolicy(recent_ratio=0.0),
}


@pytest.fixture(scope="module")
def qvm():
    bb = relax.BlockBuilder()
    common = [_ty((H, N, D)), _ty((H, N, D)), _ty((H, N), "int32"), _ty((1,), "int32"),
              _ty((1, H, B, D)), _ty((1, H, B, D)), _ty((B,), "int32"), _ty((1,), "int32"), _ty((1, HQ, B, D))]
    for name, pol in Q_POLICIES.items():
        params = dict(kernel_params(pol, N), **site_params(pol.name, HQ, SCALE))
        state = [_ty((1, H, N + B))] if pol.entry_state else []
        vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(common + state)]
        with bb.function(f"score_{name}", vars_):
            gv = bb.add_func(build_score(pol.name, H, N, B, D, "float32", params), f"k_{name}")
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir(gv, vars_, _ty((H, N + B))))
            bb.emit_func_output(out)
        if pol.entry_state:
            vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(common + [_ty((1, H, N))])]
            with bb.function(f"observe_{name}", vars_):
                gv = bb.add_func(build_observe(pol.name, H, N, B, D, "float32", params), f"o_{name}")
                with bb.dataflow():
                    out = bb.emit_output(relax.call_tir(gv, vars_, _ty((1, H, N + B))))
                bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=TARGET), tvm.cpu())


def _q_ctx(a, q, fill, n_valid):
    ctx = _ctx(a, fill, n_valid)
    ctx.queries = torch.from_numpy(q[0, :, :n_valid])
    ctx.query_positions = torch.from_numpy(a[6][:n_valid])
    ctx.scale = SCALE
    return ctx


@pytest.mark.parametrize("name", list(Q_POLICIES))
@pytest.mark.parametrize("fill,n_valid", [(N, B), (N - 3, 5), (20, 8), (N, 1), (17, 8)])
def test_query_policy_kernels_match_reference(qvm, name, fill, n_valid):
    pol = Q_POLICIES[name]
    rng = np.random.default_rng(fill * 13 + n_valid)
    a = _inputs(rng, fill, n_valid)
    q = (2 * rng.standard_normal((1, HQ, B, D))).astype("float32")
    n = fill + n_valid
    ctx = _q_ctx(a, q, fill, n_valid)
    extra = [q]
    if pol.entry_state:
        old = rng.random((1, H, N)).astype("float32") * 3
        cand = qvm[f"observe_{name}"](*[tvm.runtime.tensor(x) for x in a + [q, old]]).numpy()
        ctx.state = {"h2o_acc": torch.cat([torch.from_numpy(old[0, :, :fill]), torch.zeros(H, n_valid)], 1)}
        pol.observe(ctx)
        np.testing.assert_allclose(cand[0, :, :n], ctx.state["h2o_acc"].numpy(), rtol=1e-5, atol=1e-6)
        extra.append(cand)
    if n <= N:
        return  # the score is not read (nothing to evict); the observe kernel ran above
    score = qvm[f"score_{name}"](*[tvm.runtime.tensor(x) for x in a + extra]).numpy()[:, :n]
    ref = pol.score(ctx).numpy()
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(score), finite)
    np.testing.assert_array_equal(score[~finite], ref[~finite])
    np.testing.assert_allclose(score[finite], ref[finite], rtol=1e-5, atol=1e-6)
    kept = topk_keep(torch.from_numpy(score), N).numpy()
    np.testing.assert_array_equal(kept, pol.select(ctx).kept.numpy())

# ---- ElementwiseRule (fused elementwise / norm / RoPE kernels) and the sigmoid lowering ----

def _rmsnorm(bb, x, w, shapes):
    ms = bb.emit(relax.op.mean(relax.op.multiply(x, x), axis=[-1], keepdims=True))
    return bb.emit(relax.op.multiply(relax.op.multiply(x, relax.op.rsqrt(relax.op.add(ms, relax.const(1e-5)))), w))


def _silu_mul(bb, x, y, shapes):
    return bb.emit(relax.op.multiply(relax.op.multiply(x, relax.op.sigmoid(x)), y))


def _rope(bb, x, cos, shapes):
    # [1, T, H*d] → [1, H, T, d], rotate halves, scale: the reshape/transpose/slice/concat chain
    (_, Tn, HD), (_, d) = shapes
    h = bb.emit(relax.op.permute_dims(relax.op.reshape(x, (1, Tn, HD // d, d)), [0, 2, 1, 3]))
    a = relax.op.strided_slice(h, axes=[3], begin=[0], end=[d // 2])
    b = relax.op.strided_slice(h, axes=[3], begin=[d // 2], end=[d])
    rot = relax.op.concat([relax.op.negative(b), a], axis=3)
    return bb.emit(relax.op.add(relax.op.multiply(h, cos), relax.op.multiply(rot, cos)))


# (name, input shapes): SmolLM2's prefill and decode shapes, and odd sizes (prime rows and
# widths not a multiple of the 16 vector lanes)
EW_CASES = [("silu_mul", [(128, 1536), (128, 1536)]), ("silu_mul", [(1, 1536), (1, 1536)]),
            ("silu_mul", [(13, 37), (13, 37)]), ("rmsnorm", [(1, 128, 576), (576,)]),
            ("rmsnorm", [(1, 7, 29), (29,)]), ("rope", [(1, 128, 576), (128, 64)]), ("rope", [(1, 11, 30), (11, 10)])]


@pytest.mark.parametrize("case", EW_CASES, ids=[f"{n}-{s}" for n, s in EW_CASES])
def test_elementwise_rule_equals_unscheduled(case):
    kind, shapes = case
    bb = relax.BlockBuilder()
    vs = [relax.Var(f"a{i}", _ty(s)) for i, s in enumerate(shapes)]
    with bb.function("main", vs):
        with bb.dataflow():
            out = {"silu_mul": _silu_mul, "rmsnorm": _rmsnorm, "rope": _rope}[kind](bb, *vs, shapes)
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    rng = np.random.default_rng(sum(map(sum, shapes)))
    a = [rng.standard_normal(s).astype("float32") * 3 for s in shapes]
    scheduled, outs = _scheduled_vs_default(bb.get(), a)
    assert any(r == "elementwise" for _, r in scheduled), scheduled
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    x = a[0].astype(np.float64)
    if kind == "silu_mul":  # and both against float64 numpy (the sigmoid is the polynomial one)
        np.testing.assert_allclose(outs[0], x / (1 + np.exp(-x)) * a[1], rtol=1e-5, atol=1e-5)
    elif kind == "rmsnorm":
        np.testing.assert_allclose(outs[0], x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * a[1],
                                   rtol=1e-5, atol=1e-5)


def test_sigmoid_lowering_matches_numpy_at_extremes():
    """``T.sigmoid`` lowered through the polynomial exp (cpu_schedule registers it for llvm):
    vectorised and scalar, over the whole float range including ±inf."""
    import edgekv.compiler.backend.cpu_schedule  # noqa: F401 - registers the lowering
    from tvm.script import tirx as T

    n = 4096

    @T.prim_func
    def sig(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32"), c: T.Buffer((n,), "float32")):
        for i in T.serial(n // 16):
            for l in T.vectorized(16):
                b[i * 16 + l] = T.sigmoid(a[i * 16 + l])
        for i in T.serial(n):
            c[i] = T.sigmoid(a[i])

    lib = tvm.compile(tvm.IRModule({"main": sig}), target=tvm.target.Target({"kind": "llvm"}))
    x = np.concatenate([np.linspace(-120, 120, n - 6), [-np.inf, np.inf, -88.5, 88.5, 0.0, -0.0]]).astype("float32")
    t = [tvm.runtime.tensor(v) for v in (x, np.zeros(n, "float32"), np.zeros(n, "float32"))]
    lib["main"](*t)
    ref = 1 / (1 + np.exp(-x.astype(np.float64)))
    for got in (t[1].numpy(), t[2].numpy()):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
