"""RocketKV compiled: the stage-2 decode attention and summaries kernels against the eager reference
(``edgekv/policies/rocketkv.py``) on random tensors, then the compiled model end to end against
``BlockEngine`` on a tiny random Llama — with the cache full during decode (an eviction and a
rebuild of the summaries every step) and with room left (the new rows folded in) — and the refusal
of GPU targets, which have no stage-2 kernels yet."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

tvm = pytest.importorskip("tvm")

from edgekv.compiler import compile_model, import_model  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.compiler.policy_kernels import gpu_policy_names  # noqa: E402
from edgekv.compiler.policy_kernels.rocketkv import (build_rocketkv_decode_attention_kernel,  # noqa: E402
                                                     build_rocketkv_summaries_kernel, summary_pages)
from edgekv.policies import make_policy  # noqa: E402
from edgekv.policies.base import topk_keep  # noqa: E402
from edgekv.policies.rocketkv import approximate_page_scores, page_minmax, select_channels, token_weights  # noqa: E402
from edgekv.runtime import HostRuntime  # noqa: E402

H, HQ, N, D = 2, 4, 40, 16
SCALE = D ** -0.5
TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}


def _run(func, arrays):
    ex = tvm.compile(tvm.IRModule({"f": func.with_attr("global_symbol", "f")}), target=tvm.target.Target(TARGET))
    names = [p.name for p in func.params]
    tens = [tvm.runtime.tensor(np.ascontiguousarray(arrays[n]).copy()) for n in names]
    ex["f"](*tens)
    return {n: t.numpy() for n, t in zip(names, tens)}


def _reference_attention(q, k_blk, v_blk, k_cache, v_cache, fill, page, channels, topk):
    """Eager stage 2 over the fill cache rows and the new token (the functions ``decode_attention`` runs)."""
    keys = torch.cat([torch.from_numpy(k_cache[:, :fill]), torch.from_numpy(k_blk[0])], 1)
    values = torch.cat([torch.from_numpy(v_cache[:, :fill]), torch.from_numpy(v_blk[0])], 1)
    n, qq = fill + 1, torch.from_numpy(q[0])
    if topk >= n:
        return F.scaled_dot_product_attention(qq[None], keys[None], values[None], scale=SCALE, enable_gqa=True)[0]
    group = qq[:, 0].reshape(H, -1, D)
    chosen, positive = select_channels(group, channels)
    lo, hi = page_minmax(keys, page)
    selected = topk_keep(token_weights(group, approximate_page_scores(group, lo, hi, chosen, positive), chosen,
                                       page, n), topk)
    heads = torch.arange(H)[:, None]
    return F.scaled_dot_product_attention(qq[None], keys[heads, selected][None], values[heads, selected][None],
                                          scale=SCALE, enable_gqa=True)[0]


@pytest.mark.parametrize("page,channels,topk", [(2, 8, 10), (4, 3, N + 1), *(pytest.param(*c, marks=pytest.mark.slow)
                                                                           for c in [(3, 5, 7), (1, 16, 12), (5, 8, 1)])])
def test_decode_attention_and_summaries_kernels_match_the_reference(page, channels, topk):
    """Summaries folded one decode step at a time (a rebuild once full) equal ``page_minmax`` exactly;
    the attention equals eager stage 2 within fp32 rounding, at fills that leave the new token alone
    in its page, share a page, fill the cache, or start from an empty one."""
    rng = np.random.default_rng(page * 100 + topk)
    pages = summary_pages(N, page)
    attention = build_rocketkv_decode_attention_kernel(HQ, H, N, D, SCALE, page=page, channels=channels, topk=topk)
    summaries = build_rocketkv_summaries_kernel(H, N, D, 1, page)
    for fill in (N, N - 1, 7, 0, 12):
        k_cache, v_cache = (rng.standard_normal((H, N, D)).astype("float32") for _ in range(2))
        q = rng.standard_normal((1, HQ, 1, D)).astype("float32")
        k_blk, v_blk = (rng.standard_normal((1, H, 1, D)).astype("float32") for _ in range(2))
        kmin, kmax = np.zeros((H, D, pages), "float32"), np.zeros((H, D, pages), "float32")
        for rows in range(1, fill + 1):  # decode steps appending one row each (the last one fills the cache)
            out = _run(summaries, {"k_cache": k_cache, "fill": np.array([rows], "int32"),
                                   "n_valid": np.array([1], "int32"), "kmin": kmin, "kmax": kmax})
            kmin, kmax = out["kmin"], out["kmax"]
        if fill:
            lo, hi = page_minmax(torch.from_numpy(k_cache[:, :fill]), page)
            np.testing.assert_array_equal(kmin[:, :, :lo.shape[-1]], lo.numpy())
            np.testing.assert_array_equal(kmax[:, :, :hi.shape[-1]], hi.numpy())
        got = _run(attention, {"q": q, "k_blk": k_blk, "v_blk": v_blk, "k_cache": k_cache, "v_cache": v_cache,
                               "fill": np.array([fill], "int32"), "kmin": kmin, "kmax": kmax,
                               "out": np.zeros((1, HQ, 1, D), "float32")})["out"]
        want = _reference_attention(q, k_blk, v_blk, k_cache, v_cache, fill, page, channels, topk)
        np.testing.assert_allclose(got[0], want.numpy(), atol=2e-6, err_msg=f"fill {fill}")


B, PROMPT = 8, 45


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def imported(model):
    return import_model(model, B)


def _rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


@pytest.mark.parametrize("budget,args", [
    (16, {"window": "4", "kernel_short": "3", "page": "2", "topk": "5"}),  # full: evicts and rebuilds every step
    (16, {"window": "4", "kernel_short": "3", "page": "3", "topk": "6"}),  # full, N % p ≠ 0: a partial last page
    (64, {"window": "4", "kernel_short": "3", "page": "3", "topk": "9"}),  # room left: decode folds rows in
])
def test_compiled_rocketkv_matches_the_engine(model, imported, budget, args):
    """Logits, kept positions and summaries after every block and decode step: the compiled model's
    summaries equal a recomputation from its own cache exactly, and the eager engine's to rounding
    (the keys themselves differ by rounding)."""
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))
    res = compile_model(model, make_policy("rocketkv", args), budget, B, target=TARGET, imported=imported)
    assert res.manifest["cache"][0]["rk_kmin"] == [model.config.num_kv_heads, model.config.head_dim,
                                                   summary_pages(budget, int(args["page"]))]
    rt = HostRuntime.from_executable(res.executable, res.manifest, res.params)
    policy = make_policy("rocketkv", args)
    eng = BlockEngine(model, policy, budget, B)
    steps = [prompt[s:s + B] for s in range(0, PROMPT, B)] + [None] * 6
    logits = None
    sparse = 0
    for chunk in steps:
        if chunk is None:  # greedy decode from the compiled model's logits
            tok = int(np.argmax(logits))
            logits, want = rt.decode(tok), eng.decode(tok).numpy()
        else:
            logits, want = rt.step_block(chunk.numpy()), eng.step(chunk).numpy()
        assert _rel(logits, want) < 1e-4
        for layer in range(model.config.num_layers):
            np.testing.assert_array_equal(rt.kept_positions(layer), eng.kept_positions(layer).numpy())
            summary = policy.summaries(layer)
            pages = math.ceil(summary.rows / summary.page)
            keys = torch.from_numpy(rt.cache_field(layer, "k")[:, :summary.rows])
            lo, hi = page_minmax(keys, summary.page)
            kmin, kmax = (rt.cache_field(layer, f)[:, :, :pages] for f in ("rk_kmin", "rk_kmax"))
            np.testing.assert_array_equal(kmin, lo.numpy())
            np.testing.assert_array_equal(kmax, hi.numpy())
            np.testing.assert_allclose(kmin, summary.kmin[:, :, :pages].numpy(), atol=1e-5)
            np.testing.assert_allclose(kmax, summary.kmax[:, :, :pages].numpy(), atol=1e-5)
        if chunk is None:
            sparse += int(policy.last_selected[0].shape[-1] < policy.last_fill[0])
    assert sparse == 6  # stage 2 selected a subset at every decode step


def test_gpu_targets_are_refused_with_the_reason(model, imported):
    from edgekv.compiler import CompileError

    assert "rocketkv" not in gpu_policy_names() and "snapkv++" in gpu_policy_names()
    with pytest.raises(CompileError, match="policy .rocketkv. has no GPU kernels yet.*compile it for a CPU target"):
        compile_model(model, make_policy("rocketkv", {"window": "4"}), 16, B, target="opencl")


def test_settings_the_model_cannot_take_are_refused_before_compiling(model, imported):
    from edgekv.policies import PolicyError

    with pytest.raises(PolicyError, match="channels=99 is more than this model's head dim"):
        compile_model(model, make_policy("rocketkv", {"window": "4", "channels": "99"}), 16, B, target=TARGET,
                      imported=imported)
