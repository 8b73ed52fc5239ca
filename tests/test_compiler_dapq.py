"""Compiled DapQ: the pseudo-row plumbing (block attention with trailing pseudo rows, the score
kernel over the pseudo rows' attention) against the references, and the compiled block step
against the eager engine on a tiny random model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.compiler import CompileError, compile_model, import_model  # noqa: E402
from edgekv.compiler.kernels import build_attention, build_select  # noqa: E402
from edgekv.compiler.policy_kernels import build_score, kernel_params  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies.base import EvictionContext, PolicyError, topk_keep  # noqa: E402
from edgekv.policies.dapq import DapQPolicy  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402

TARGET = tvm.target.Target({"kind": "llvm", "opt-level": 0, "num-cores": 2})
H, HQ, N, B, W, D = 2, 4, 24, 8, 4, 16
T_ROWS = B + W  # a compiled prefill step: B real rows, then the W pseudo rows


def _compile_prim(func):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)["main"]


# ---- block attention with pseudo rows vs a float64 oracle ------------------------------------------

def _attention_oracle(q, kb, vb, kc, vc, nf, nv, scale, w):
    """Cache rows all visible; block key j visible to row i iff j ≤ i and (j < n_valid or j is a
    pseudo row); padding rows [n_valid, T − w) output 0, pseudo rows keep theirs."""
    _, hq, rows, _ = q.shape
    g = hq // kc.shape[0]
    real = rows - w
    out = np.zeros(q.shape)
    for h in range(hq):
        keys = np.concatenate([kc[h // g, :nf], kb[0, h // g]]).astype(np.float64)
        vals = np.concatenate([vc[h // g, :nf], vb[0, h // g]]).astype(np.float64)
        s = q[0, h].astype(np.float64) @ keys.T * scale
        i, j = np.arange(rows)[:, None], np.arange(keys.shape[0])[None, :] - nf
        s[~((j < 0) | ((j <= i) & ((j < nv) | (j >= real))))] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        out[0, h] = (p / p.sum(1, keepdims=True)) @ vals
    out[0, :, nv:real] = 0
    return out


# (Hq, H, N, real rows, pseudo rows, d, fill, n_valid): full/short blocks, SmolLM2's shapes
ATTN_CASES = [(4, 2, 24, 8, 4, 16, 24, 8), (4, 2, 24, 8, 4, 16, 19, 3), (9, 3, 256, 128, 32, 64, 256, 128),
              (9, 3, 256, 128, 32, 64, 200, 77), (6, 3, 37, 5, 3, 8, 0, 5)]


@pytest.mark.parametrize("case", ATTN_CASES, ids=[str(c) for c in ATTN_CASES])
def test_attention_with_pseudo_rows_matches_oracle(case):
    hq, h, n, b, w, d, nf, nv = case
    rows = b + w
    run = _compile_prim(build_attention(hq, h, n, rows, d, d ** -0.5, "float32", w))
    rng = np.random.default_rng(sum(case))
    a = [rng.standard_normal(s).astype("float32") for s in
         [(1, hq, rows, d), (1, h, rows, d), (1, h, rows, d), (h, n, d), (h, n, d)]]
    a[1][0, :, nv:b] = 1e4  # padding keys: a pseudo row that saw them would attend to nothing else
    t = [tvm.runtime.tensor(x) for x in a + [np.array([nf], "int32"), np.array([nv], "int32"),
                                             np.zeros((1, hq, rows, d), "float32")]]
    run(*t)
    ref = _attention_oracle(*a, nf, nv, d ** -0.5, w)
    np.testing.assert_allclose(t[-1].numpy(), ref, rtol=2e-5, atol=2e-5)


# ---- the score kernel vs DapQPolicy.score, and select on it vs topk_keep ---------------------------

POLICIES = {
    "default": DapQPolicy(window=W, prefix=1),
    "prompt_softmax": DapQPolicy(window=W, prefix=1, softmax_over="prompt"),
    "avg_pool_recent": DapQPolicy(window=W, prefix=1, kernel=3, pooling="avg", keep_recent=3),
    "max_pool": DapQPolicy(window=W, prefix=1, kernel=5, pooling="max"),
}


def _inputs(rng, fill, n_valid, rows):
    kc = rng.standard_normal((H, N, D)).astype("float32")
    kc[:, fill:] = np.nan  # rows past fill are never read
    kb = rng.standard_normal((1, H, rows, D)).astype("float32")
    kb[0, :, n_valid: rows - (W if rows > W else 0)] = np.nan  # nor are padding rows
    q = rng.standard_normal((1, HQ, rows, D)).astype("float32") * 2
    pc = np.tile(rng.permutation(200)[:N].astype("int32"), (H, 1))  # any order: masks go by index
    pb = np.arange(300, 300 + rows, dtype="int32")
    return [kc, kc * 0 + 1, pc, np.array([fill], "int32"), kb, kb * 0 + 1, pb, np.array([n_valid], "int32"), q]


def _ctx(a, fill, n_valid, rows):
    kc, vc, pc, _, kb, vb, pb, _, q = (torch.from_numpy(x) for x in a)
    ctx = EvictionContext(layer=0, num_layers=1, budget=N, n_cache=fill, scale=D ** -0.5,
                          keys=torch.cat([kc[:, :fill], kb[0, :, :n_valid]], 1),
                          values=torch.cat([vc[:, :fill], vb[0, :, :n_valid]], 1),
                          positions=torch.cat([pc[:, :fill], pb[None, :n_valid].expand(H, n_valid)], 1))
    if rows > W:  # a prefill step: the pseudo rows are the last W (queries and keys, as the engine hands them)
        ctx.extra_queries, ctx.extra_query_positions = q[0, :, rows - W:], pb[rows - W:].long()
        ctx.extra_keys = kb[0, :, rows - W:]
    else:  # decode: the step's own real queries
        ctx.queries, ctx.query_positions = q[0, :, :n_valid], pb[:n_valid].long()
    return ctx


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("rows,fill,n_valid", [(T_ROWS, N, B), (T_ROWS, N - 3, 5), (T_ROWS, 17, 8), (1, N, 1)],
                         ids=["full_block", "short_block", "partial_cache", "decode"])
def test_score_and_select_match_reference(name, rows, fill, n_valid):
    policy = POLICIES[name]
    params = {**kernel_params(policy, N), "num_q_heads": HQ, "sm_scale": D ** -0.5}
    score_fn = _compile_prim(build_score("dapq", H, N, rows, D, "float32", params))
    select_fn = _compile_prim(build_select(H, N, rows, D, "float32", True))
    rng = np.random.default_rng(fill * 7 + n_valid + rows)
    a = _inputs(rng, fill, n_valid, rows)
    n = fill + n_valid
    out = tvm.runtime.tensor(np.zeros((H, N + rows), "float32"))
    score_fn(*[tvm.runtime.tensor(x) for x in a], out)
    score = out.numpy()
    assert np.all(score[:, n:] == -np.inf)  # no candidate beyond the valid rows (pseudo rows never are)
    ctx = _ctx(a, fill, n_valid, rows)
    ref = policy.score(ctx).numpy()
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(score[:, :n]), finite)
    np.testing.assert_allclose(score[:, :n][finite], ref[finite], rtol=1e-5, atol=1e-7)
    # the kernel's own scores select exactly topk_keep of the reference's (no near ties here)
    tens = [tvm.runtime.tensor(x) for x in a[:8]]
    select_fn(*tens, out)
    kept = topk_keep(torch.from_numpy(ref), N).numpy()
    np.testing.assert_array_equal(tens[2].numpy()[:, :kept.shape[1]], np.take_along_axis(ctx.positions.numpy(), kept, 1))
    assert int(tens[3].numpy()[0]) == min(n, N)


def test_kernel_refuses_missing_query_heads():
    with pytest.raises(ValueError, match="num_q_heads"):
        build_score("dapq", H, N, T_ROWS, D, "float32", kernel_params(DapQPolicy(window=W), N))


# ---- compiled block step vs the engine ----------------------------------------------------------------

PROMPT = 45  # 5 full blocks + a 5-token tail block


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))


_BUILDS: dict = {}


def _runtime(model, policy, budget):
    key = (repr(policy), budget)
    if key not in _BUILDS:
        imported = import_model(model, B, policy.window)
        _BUILDS[key] = compile_model(model, policy, budget, B, target={"kind": "llvm", "opt-level": 0, "num-cores": 2},
                                     imported=imported)
    res = _BUILDS[key]
    return HostRuntime.from_executable(res.executable, res.manifest, res.params)


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(b).max())


@pytest.mark.parametrize("policy,budget", [
    (DapQPolicy(window=W, prefix=1), 13),  # budget not a multiple of the block
    (DapQPolicy(window=3, prefix=1, positions="block", softmax_over="prompt", kernel=3, keep_recent=2), 16),
], ids=["default", "variant"])
def test_kept_positions_and_logits_match_engine(model, prompt, policy, budget):
    rt = _runtime(model, policy, budget)
    assert rt.manifest.extra_rows == policy.window
    eng = BlockEngine(model, DapQPolicy(**policy.params()), budget, B)
    eng.policy.prepare(prompt, eng)
    rt.prepare(prompt.numpy())
    evictions = 0
    for s in range(0, PROMPT, B):
        chunk = prompt[s: s + B]
        extra = eng.extra_rows_for(len(chunk))  # the engine's own rule: pseudo rows on evicting blocks
        want = eng.step(chunk, extra=extra).numpy()
        got = rt.step_block(chunk.numpy())
        assert _rel(got, want) < 1e-3
        for layer in range(model.config.num_layers):
            kept = rt.kept_positions(layer)
            np.testing.assert_array_equal(kept, eng.kept_positions(layer).numpy(), err_msg=f"block {s}, layer {layer}")
            assert kept.max() < PROMPT  # pseudo rows (positions ≥ the prompt length) never enter the cache
        evictions += extra is not None
    assert evictions >= 3
    logits = got
    for _ in range(3):  # decode: no pseudo rows, the step's own query observes
        tok = int(np.argmax(logits))
        logits = rt.decode(tok)
        assert _rel(logits, eng.decode(tok).numpy()) < 1e-3
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())


def test_prefill_equals_engine_prefill(model, prompt):
    policy = DapQPolicy(window=W, prefix=1)
    rt = _runtime(model, policy, 13)
    eng = BlockEngine(model, DapQPolicy(window=W, prefix=1), 13, B)
    assert _rel(rt.prefill(prompt.numpy()), eng.prefill(prompt).numpy()) < 1e-3
    for layer in range(model.config.num_layers):
        np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())


def test_runtime_needs_the_prompt_first(model, prompt):
    rt = _runtime(model, DapQPolicy(window=W, prefix=1), 13)
    with pytest.raises(PolicyError, match="prepare"):
        rt.step_block(prompt[:B].numpy())


def test_short_prompt_with_too_few_pseudo_tokens_is_refused(model):
    rt = _runtime(model, DapQPolicy(window=W, prefix=1), 13)
    short = torch.arange(2)  # 1 + 2 = 3 < 4 pseudo tokens: fine while nothing is evicted
    rt.prefill(short.numpy())
    rt.reset()
    rt.prepare(torch.arange(2).numpy())
    rt.position = 0
    for _ in range(2):  # fill the cache to 13 rows would need an eviction on the next block
        rt.step_block(np.arange(6))
    with pytest.raises(PolicyError, match="pseudo tokens"):
        rt.step_block(np.arange(6))


def test_import_at_the_wrong_step_size_is_refused(model):
    with pytest.raises(CompileError, match="pseudo rows"):
        compile_model(model, DapQPolicy(window=W), 13, B, target={"kind": "llvm", "opt-level": 0},
                      imported=import_model(model, B))
