"""Each policy's TIR score kernel against its reference scorer, and the shared top-N select +
compaction kernel against ``topk_keep`` (ties → lower index), on random tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from edgekv.compiler.kernels import build_score, build_select  # noqa: E402
from edgekv.policies.base import EvictionContext, topk_keep  # noqa: E402
from edgekv.policies.keydiff import KeyDiffPolicy  # noqa: E402
from edgekv.policies.lagkv import LagKVPolicy  # noqa: E402
from edgekv.policies.streaming import StreamingPolicy  # noqa: E402

H, N, B, D = 2, 24, 8, 16
TARGET = tvm.target.Target({"kind": "llvm", "opt-level": 0, "num-cores": 2})
POLICIES = {
    "streaming": (StreamingPolicy(sinks=3), {"sinks": 3}),
    "keydiff": (KeyDiffPolicy(), {"recent": 0}),
    "keydiff_recent": (KeyDiffPolicy(recent_window=5), {"recent": 5}),
    "lagkv": (LagKVPolicy(sinks=2, lag=5), {"sinks": 2, "lag": 5, "value_weight": 1.0, "unbiased_std": True,
                                             "eps": 1e-6}),
}


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
