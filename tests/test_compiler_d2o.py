"""D2O's compiled parts against the reference functions of edgekv/policies/d2o.py: the merge-on-evict
kernel (evicted set at the layer budget N_l, ``best_matches``, the EMA threshold of
``D2OPolicy.update_threshold``, ``merge_into``) on random tensors, for every merge mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from edgekv.policies.base import topk_keep  # noqa: E402
from edgekv.policies.d2o import D2OPolicy, best_matches, build_d2o_merge_kernel, merge_into  # noqa: E402

H, N, B, D = 2, 24, 8, 16
TARGET = tvm.target.Target({"kind": "llvm", "opt-level": 0, "num-cores": 2})
MODES = [("weighted", "ema"), ("code", "ema"), ("average", "ema"), ("weighted", "none")]
BETA = 0.7


def _ty(shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


ARGS_TY = [_ty((H, N, D)), _ty((H, N, D)), _ty((H, N), "int32"), _ty((1,), "int32"),
           _ty((1, H, B, D)), _ty((1, H, B, D)), _ty((B,), "int32"), _ty((1,), "int32"),
           _ty((H, N + B)), _ty((2,), "int32"), _ty((2,))]


@pytest.fixture(scope="module")
def vm():
    """One module, a merge function per (merge, threshold) mode."""
    bb = relax.BlockBuilder()
    for merge, threshold in MODES:
        vars_ = [relax.Var(f"a{i}", t) for i, t in enumerate(ARGS_TY)]
        with bb.function(f"merge_{merge}_{threshold}", vars_):
            gv = bb.add_func(build_d2o_merge_kernel(H, N, B, D, "float32", merge, threshold, BETA),
                             f"k_{merge}_{threshold}")
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir_inplace(
                    gv, vars_, [0, 1, 10, -1, -1], [ARGS_TY[0], ARGS_TY[1], ARGS_TY[10], ARGS_TY[4], ARGS_TY[4]]))
            bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=TARGET), tvm.cpu())


def _case(rng, fill, n_valid, near_copies):
    kc = rng.standard_normal((H, N, D)).astype("float32")
    kb = rng.standard_normal((1, H, B, D)).astype("float32")
    if near_copies:  # evicted keys close to kept ones: high similarities, so many pass τ
        kb[0, :, : B // 2] = kc[:, : B // 2] + 0.05 * rng.standard_normal((H, B // 2, D)).astype("float32")
    vc = rng.standard_normal((H, N, D)).astype("float32")
    vb = rng.standard_normal((1, H, B, D)).astype("float32")
    pc = np.tile(np.arange(N, dtype="int32"), (H, 1))
    pb = np.arange(fill, fill + B, dtype="int32")
    score = rng.standard_normal((H, N + B)).astype("float32")
    score[:, :2] = np.inf  # pinned entries (sinks) as the score kernel writes them
    return kc, vc, pc, pb, kb, vb, score


def _candidates(cache, blk, fill, n_valid):
    return torch.from_numpy(np.concatenate([cache[:, :fill], blk[0, :, :n_valid]], axis=1))


@pytest.mark.parametrize("merge,threshold", MODES)
@pytest.mark.parametrize("fill,n_valid,keep,tau0", [
    (N, B, N, None),          # full cache + full block, layer budget = N, first eviction sets τ
    (N, B, 17, 0.1),          # a smaller layer budget N_l, τ already set (EMA step)
    (20, 5, 11, None),        # partial block, partial cache
    (N, 1, 19, 0.3),          # decode step: n = N + 1 over N_l = 19
])
@pytest.mark.parametrize("near_copies", [False, True])
def test_merge_kernel_matches_reference(vm, merge, threshold, fill, n_valid, keep, tau0, near_copies):
    rng = np.random.default_rng(fill * 100 + n_valid * 7 + keep)
    kc, vc, pc, pb, kb, vb, score = _case(rng, fill, n_valid, near_copies)
    n = fill + n_valid
    # reference: the kept set at N_l, matches, τ, merge — as D2OPolicy.select does it
    keys, values = _candidates(kc, kb, fill, n_valid), _candidates(vc, vb, fill, n_valid)
    kept = topk_keep(torch.from_numpy(score[:, :n]), keep)
    gone = torch.ones(H, n, dtype=torch.bool).scatter_(1, kept, False)
    evicted = gone.nonzero()[:, 1].view(H, n - keep)
    gather = lambda x, idx: torch.gather(x, 1, idx[..., None].expand(H, idx.shape[1], D))  # noqa: E731
    best, target = best_matches(gather(keys, evicted), gather(keys, kept))
    policy = D2OPolicy(beta=BETA, merge=merge, threshold=threshold)
    if tau0 is not None:
        policy.tau[0] = tau0
    tau = policy.update_threshold(0, best)
    do_merge = best >= tau if threshold == "ema" else torch.ones_like(best, dtype=torch.bool)
    want_k = merge_into(gather(keys, kept), gather(keys, evicted), target, best, do_merge, merge)
    want_v = merge_into(gather(values, kept), gather(values, evicted), target, best, do_merge, merge)

    dev = tvm.cpu()
    tau_state = np.array([0.0 if tau0 is None else tau0, 0.0 if tau0 is None else 1.0], dtype="float32")
    ins = [kc, vc, pc, np.array([fill], "int32"), kb, vb, pb, np.array([n_valid], "int32"), score,
           np.array([keep, policy.recent_size(keep)], "int32"), tau_state]
    out = vm[f"merge_{merge}_{threshold}"](*[tvm.runtime.tensor(a, dev) for a in ins])
    k_cache, v_cache, tau_out, k_blk, v_blk = (o.numpy() for o in out)
    got_k = gather(_candidates(k_cache, k_blk, fill, n_valid), kept)
    got_v = gather(_candidates(v_cache, v_blk, fill, n_valid), kept)
    assert bool(do_merge.any()), "the case must merge something to test the merge"
    np.testing.assert_allclose(got_k.numpy(), want_k.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_v.numpy(), want_v.numpy(), rtol=1e-5, atol=1e-5)
    assert tau_out[1] == 1.0
    assert tau_out[0] == pytest.approx(tau, rel=1e-5, abs=1e-6)
    # the evicted rows are only read: a cache row that is evicted keeps its old contents
    for h in range(H):
        for i in evicted[h].tolist():
            if i < fill:
                np.testing.assert_array_equal(k_cache[h, i], kc[h, i])


def test_no_eviction_leaves_everything(vm):
    rng = np.random.default_rng(5)
    kc, vc, pc, pb, kb, vb, score = _case(rng, 10, 4, True)
    ins = [kc, vc, pc, np.array([10], "int32"), kb, vb, pb, np.array([4], "int32"), score,
           np.array([14, 3], "int32"), np.array([0.5, 1.0], "float32")]
    out = vm["merge_weighted_ema"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in ins])
    k_cache, v_cache, tau_out, k_blk, v_blk = (o.numpy() for o in out)
    np.testing.assert_array_equal(k_cache, kc)
    np.testing.assert_array_equal(v_cache, vc)
    np.testing.assert_array_equal(k_blk, kb)
    np.testing.assert_array_equal(tau_out, [0.5, 1.0])


def test_merge_kernel_refuses_unknown_mode():
    from edgekv.policies.base import PolicyError

    with pytest.raises(PolicyError, match="merge=none needs no merge kernel"):
        build_d2o_merge_kernel(H, N, B, D, merge="none")
