"""D2O's compiled kernels against the reference in edgekv/policies/d2o.py, on random tensors:
the score kernel (``observe`` + ``score``: column sums, accumulated state, sinks and recent pins)
and the eviction kernel (``select``: top-N_l, ``best_matches``, the EMA τ, ``merge_into``, then the
engine's compaction of K, V, positions and the accumulated state), for every merge mode; then the
compiled model end to end against ``BlockEngine`` on a tiny random Llama (layer budgets, kept
positions after every block and decode step, merged keys, logits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from edgekv.compiler.policy_kernels.d2o import build_d2o_evict_kernel, build_d2o_score_kernel  # noqa: E402
from edgekv.policies.attention_rows import attention_column_sums  # noqa: E402
from edgekv.policies.base import EvictionContext, PolicyError  # noqa: E402
from edgekv.policies.d2o import STATE, D2OPolicy  # noqa: E402

H, HQ, N, B, D = 2, 4, 24, 8, 16
NB = N + B
SCALE = D ** -0.5
SINKS = 2
TARGET = tvm.target.Target({"kind": "llvm", "opt-level": 0, "num-cores": 2})
MODES = [("weighted", "ema"), ("code", "ema"), ("average", "ema"), ("weighted", "none"), ("none", "ema")]
BETA = 0.7


def _ty(shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


CACHE_TY = [_ty((H, N, D)), _ty((H, N, D)), _ty((H, N), "int32"), _ty((1,), "int32")]
BLOCK_TY = [_ty((1, H, B, D)), _ty((1, H, B, D)), _ty((B,), "int32"), _ty((1,), "int32")]
EVICT_TY = CACHE_TY + BLOCK_TY + [_ty((H, NB)), _ty((H, NB)), _ty((2,), "int32"), _ty((1, H, N)), _ty((2,))]
SCORE_TY = [_ty((1, HQ, B, D)), _ty((H, N, D)), _ty((H, N), "int32"), _ty((1,), "int32"), _ty((1, H, B, D)),
            _ty((B,), "int32"), _ty((1,), "int32"), _ty((1, H, N)), _ty((2,), "int32")]


@pytest.fixture(scope="module")
def vm():
    """One module: the score function, and an eviction function per (merge, threshold) mode."""
    bb = relax.BlockBuilder()
    vars_ = [relax.Var(f"s{i}", t) for i, t in enumerate(SCORE_TY)]
    with bb.function("score", vars_):
        gv = bb.add_func(build_d2o_score_kernel(HQ, H, N, B, D, SCALE, "float32", SINKS), "k_score")
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(gv, vars_, [_ty((H, NB)), _ty((H, NB)), _ty((HQ, NB))]))
        bb.emit_func_output(out)
    for merge, threshold in MODES:
        vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(EVICT_TY)]
        with bb.function(f"evict_{merge}_{threshold}", vars_):
            gv = bb.add_func(build_d2o_evict_kernel(H, N, B, D, "float32", merge, threshold, BETA),
                             f"k_{merge}_{threshold}")
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir_inplace(gv, vars_, [0, 1, 2, 3, 11, 12],
                                                            [EVICT_TY[i] for i in (0, 1, 2, 3, 11, 12)]))
            bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=TARGET), tvm.cpu())


def _layer(rng, fill, n_valid, near_copies=False):
    """A layer's cache (its own increasing positions per head, sinks among them) and a block."""
    kc = rng.standard_normal((H, N, D)).astype("float32")
    kb = rng.standard_normal((1, H, B, D)).astype("float32")
    if near_copies:  # block keys close to cached ones: high similarities, so many pass τ
        kb[0, :, : B // 2] = kc[:, : B // 2] + 0.05 * rng.standard_normal((H, B // 2, D)).astype("float32")
    vc = rng.standard_normal((H, N, D)).astype("float32")
    vb = rng.standard_normal((1, H, B, D)).astype("float32")
    pc = np.zeros((H, N), dtype="int32")
    for h in range(H):
        pc[h, :fill] = np.sort(rng.choice(np.arange(3 * N), size=fill, replace=False))
        pc[h, : min(fill, SINKS)] = np.arange(min(fill, SINKS))
    start = int(pc[:, :fill].max()) + 1 if fill else 0
    pb = np.arange(start, start + B, dtype="int32")
    return kc, vc, pc, kb, vb, pb


def _cand(cache, blk, fill, n_valid):
    return torch.from_numpy(np.concatenate([cache[:, :fill], blk[0, :, :n_valid]], axis=1))


def _cand_pos(pc, pb, fill, n_valid):
    return torch.from_numpy(np.concatenate([pc[:, :fill], np.tile(pb[:n_valid], (H, 1))], axis=1))


def _run(vm, name, arrays):
    return [o.numpy() for o in vm[name](*[tvm.runtime.tensor(a, tvm.cpu()) for a in arrays])]


@pytest.mark.parametrize("fill,n_valid,keep", [(N, B, N), (N, B, 17), (20, 5, 11), (0, B, 6), (N, 1, 19), (5, 3, 20)])
def test_score_kernel_matches_observe_and_score(vm, fill, n_valid, keep):
    rng = np.random.default_rng(fill * 31 + n_valid)
    kc, vc, pc, kb, vb, pb = _layer(rng, fill, n_valid)
    q = rng.standard_normal((1, HQ, B, D)).astype("float32")
    acc = rng.random((H, N)).astype("float32") * 3
    n = fill + n_valid
    policy = D2OPolicy(sinks=SINKS)
    state = torch.cat([torch.from_numpy(acc[:, :fill]), torch.zeros(H, n_valid)], dim=1)
    ctx = EvictionContext(layer=0, num_layers=1, budget=keep, keys=_cand(kc, kb, fill, n_valid),
                          values=_cand(vc, vb, fill, n_valid), positions=_cand_pos(pc, pb, fill, n_valid),
                          n_cache=fill, queries=torch.from_numpy(q[0, :, :n_valid]),
                          query_positions=torch.from_numpy(pb[:n_valid]), scale=SCALE, state={STATE: state})
    policy.observe(ctx)
    want_score = policy.score(ctx)
    want_sums = attention_column_sums(ctx.keys, ctx.positions, ctx.queries, ctx.query_positions, SCALE)
    score, acc_cand, col_sums = _run(vm, "score", [q, kc, pc, np.array([fill], "int32"), kb, pb,
                                                   np.array([n_valid], "int32"), acc[None],
                                                   np.array([keep, policy.recent_size(keep)], "int32")])
    np.testing.assert_allclose(col_sums[:, :n], want_sums.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc_cand[:, :n], ctx.state[STATE].numpy(), rtol=1e-5, atol=1e-6)
    pinned = torch.isinf(want_score).numpy()
    assert pinned.any() and not pinned.all()
    np.testing.assert_array_equal(np.isinf(score[:, :n]), pinned)
    np.testing.assert_allclose(score[:, :n][~pinned], want_score.numpy()[~pinned], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("merge,threshold", MODES)
@pytest.mark.parametrize("fill,n_valid,keep,tau0", [
    (N, B, N, None),          # full cache + full block at N_l = N, the first eviction sets τ
    (N, B, 17, 0.1),          # a smaller layer budget N_l, τ already set (an EMA step)
    (20, 5, 11, None),        # partial block, partial cache
    (N, 1, 19, 0.3),          # a decode step at N_l < N (the cache holds 19 of its 24 rows)
    (0, B, 5, None),          # the first block alone over N_l
])
@pytest.mark.parametrize("near_copies", [False, True])
def test_evict_kernel_matches_select_and_compaction(vm, merge, threshold, fill, n_valid, keep, tau0, near_copies):
    rng = np.random.default_rng(fill * 100 + n_valid * 7 + keep)
    kc, vc, pc, kb, vb, pb = _layer(rng, fill, n_valid, near_copies)
    acc_cand = np.full((H, NB), -1.0, dtype="float32")
    n = fill + n_valid
    acc_cand[:, :n] = rng.random((H, n)).astype("float32")
    policy = D2OPolicy(sinks=SINKS, beta=BETA, merge=merge, threshold=threshold)
    if tau0 is not None:
        policy.tau[0] = tau0
    ctx = EvictionContext(layer=0, num_layers=1, budget=keep, keys=_cand(kc, kb, fill, n_valid),
                          values=_cand(vc, vb, fill, n_valid), positions=_cand_pos(pc, pb, fill, n_valid),
                          n_cache=fill, state={STATE: torch.from_numpy(acc_cand[:, :n].copy())})
    score = np.full((H, NB), -np.inf, dtype="float32")
    score[:, :n] = policy.score(ctx).numpy()
    sel = policy.select(ctx)
    rows = torch.arange(H)[:, None]
    want_k = sel.keys if sel.keys is not None else ctx.keys[rows, sel.kept]
    want_v = sel.values if sel.values is not None else ctx.values[rows, sel.kept]
    assert (sel.keys is not None) == (merge != "none"), "the case must merge something to test the merge"

    tau_state = np.array([0.0 if tau0 is None else tau0, 0.0 if tau0 is None else 1.0], dtype="float32")
    acc = np.zeros((H, N), "float32")
    acc[:, :fill] = acc_cand[:, :fill]
    k_cache, v_cache, pos_cache, fill_out, acc_out, tau_out = _run(vm, f"evict_{merge}_{threshold}", [
        kc, vc, pc, np.array([fill], "int32"), kb, vb, pb, np.array([n_valid], "int32"), score, acc_cand,
        np.array([keep, policy.recent_size(keep)], "int32"), acc[None], tau_state])
    assert fill_out.tolist() == [keep]
    np.testing.assert_array_equal(pos_cache[:, :keep], ctx.positions[rows, sel.kept].numpy())
    np.testing.assert_array_equal(acc_out[0, :, :keep], acc_cand[:, :n][rows.numpy(), sel.kept.numpy()])
    np.testing.assert_allclose(k_cache[:, :keep], want_k.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_cache[:, :keep], want_v.numpy(), rtol=1e-5, atol=1e-5)
    if merge == "none":  # plain top-N_l: τ is never touched
        np.testing.assert_array_equal(tau_out, tau_state)
        return
    assert tau_out[1] == 1.0
    assert tau_out[0] == pytest.approx(policy.tau[0], rel=1e-5, abs=1e-6)


def test_evict_kernel_appends_below_the_layer_budget(vm):
    rng = np.random.default_rng(5)
    kc, vc, pc, kb, vb, pb = _layer(rng, 10, 4, True)
    acc_cand = rng.random((H, NB)).astype("float32")
    k_cache, v_cache, pos_cache, fill_out, acc_out, tau_out = _run(vm, "evict_weighted_ema", [
        kc, vc, pc, np.array([10], "int32"), kb, vb, pb, np.array([4], "int32"), np.zeros((H, NB), "float32"),
        acc_cand, np.array([14, 3], "int32"), np.zeros((1, H, N), "float32"), np.array([0.5, 1.0], "float32")])
    assert fill_out.tolist() == [14]
    np.testing.assert_array_equal(k_cache[:, :10], kc[:, :10])
    np.testing.assert_array_equal(k_cache[:, 10:14], kb[0, :, :4])
    np.testing.assert_array_equal(v_cache[:, 10:14], vb[0, :, :4])
    np.testing.assert_array_equal(pos_cache[:, 10:14], np.tile(pb[:4], (H, 1)))
    np.testing.assert_array_equal(acc_out[0, :, :14], acc_cand[:, :14])
    np.testing.assert_array_equal(tau_out, [0.5, 1.0])


def test_evict_kernel_refuses_unknown_merge_mode():
    with pytest.raises(PolicyError, match="use weighted, code, average or none"):
        build_d2o_evict_kernel(H, N, B, D, merge="max")


# ---- end to end: the compiled block step vs the reference engine on a tiny random model ----------
E2E_B = 8
E2E_PROMPT = 45  # 5 full blocks + a 5-token tail block (n_valid padding)


@pytest.fixture(scope="module")
def tiny():
    from edgekv.models import tiny_random_model

    return tiny_random_model(seed=0, layers=2)


# the third case runs under `-m slow` (this same test): its merge mode, threshold and sinks are each
# checked against the reference by the kernel tests above (MODES, SINKS) in the default suite
@pytest.mark.parametrize("policy,budget", [
    (D2OPolicy(), 16),                                   # paper defaults: variance budgets, Eq. 12, EMA τ
    (D2OPolicy(layers="uniform", merge="code", recent_ratio=0.5), 13),
    pytest.param(D2OPolicy(merge="average", threshold="none", sinks=2), 20, marks=pytest.mark.slow),
])
def test_compiled_d2o_matches_engine(tiny, policy, budget):
    """Same layer budgets, same kept positions after every block and decode step, logits within
    1e-3 — the compiled probe → budgets → score → merge/evict chain against ``BlockEngine``."""
    from edgekv.compiler import compile_model
    from edgekv.engine import BlockEngine
    from edgekv.runtime import HostRuntime

    prompt = torch.randint(0, 256, (E2E_PROMPT,), generator=torch.Generator().manual_seed(1))
    res = compile_model(tiny, policy, budget, E2E_B, target={"kind": "llvm", "opt-level": 0, "num-cores": 2})
    rt = HostRuntime.from_executable(res.executable, res.manifest, res.params)
    eng = BlockEngine(tiny, policy, budget, E2E_B, record_kept=True)
    want = eng.prefill(prompt).numpy()
    rt.prepare(prompt.numpy())
    layer_budgets = [int(rt.cache_field(layer, "d2o_budget")[0]) for layer in range(tiny.config.num_layers)]
    assert layer_budgets == eng.layer_budgets
    if policy.layers == "variance":
        assert len(set(eng.layer_budgets)) > 1, "the case must give the layers different budgets"
    for step, start in enumerate(range(0, E2E_PROMPT, E2E_B)):
        got = rt.step_block(prompt[start:start + E2E_B].numpy())
        for layer in range(tiny.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.stats.steps[step].kept_positions[layer].numpy(),
                                          err_msg=f"block {step}, layer {layer}")
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3
    assert rt.cache_lengths() == [min(b, E2E_PROMPT) for b in eng.layer_budgets]
    for _ in range(4):  # decode: one eviction (and maybe a merge) per layer and step
        tok = int(np.argmax(got))
        got, want = rt.decode(tok), eng.decode(tok).numpy()
        assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3
        for layer in range(tiny.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())
    # merged keys: the caches hold the same (merged) K and V, not only the same positions
    for layer in range(tiny.config.num_layers):
        n = rt.cache_lengths()[layer]
        np.testing.assert_allclose(rt._field(layer, "k").numpy()[:, :n], eng.caches[layer].keys[:, :n].numpy(),
                                   rtol=1e-3, atol=1e-4)
