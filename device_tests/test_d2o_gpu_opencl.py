"""D2O's GPU kernels (``edgekv/policies/d2o.py``) on a real OpenCL device (pocl on a CPU will do)
against the CPU kernels they replace, on random inputs — the harness of
``test_gpu_kernels_opencl.py``. Skips when pyopencl or a device is absent."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_kernels_opencl import CTX, _state, run_cpu, run_opencl  # noqa: E402  (same folder)

from edgekv.compiler.policy_kernels.d2o import build_d2o_evict_kernel, build_d2o_score_kernel  # noqa: E402
from edgekv.compiler.policy_kernels.d2o_gpu import build_d2o_evict_kernel_gpu, build_d2o_score_kernel_gpu  # noqa: E402

pytestmark = pytest.mark.skipif(CTX is None, reason="needs an OpenCL device")

SHAPES = [(2, 16, 8, 16), (3, 40, 8, 64)]
FILLS = [(0, 8), (5, 3), (16, 8), (12, 5), (9, 8)]
MODES = [("weighted", "ema"), ("code", "ema"), ("average", "none"), ("none", "ema")]


def _d2o_state(H, N, B, D, nf, nv, keep, seed):
    st = _state(H, N, B, D, nf, nv, seed)
    rng = np.random.default_rng(seed + 1)
    st["k_blk"][0, :, : B // 2] = st["k_cache"][:, : B // 2] + 0.05 * rng.standard_normal((H, B // 2, D))
    st["acc"] = rng.random((1, H, N)).astype("float32")  # the generic per-entry state [S=1, H, N]
    st["d2o_budget"] = np.array([keep, keep // 4], "int32")
    return st


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nf,nv", FILLS)
def test_d2o_score(shape, nf, nv):
    H, N, B, D = shape
    G = 3
    st = _d2o_state(H, N, B, D, nf, nv, N - 3, 7)
    st["q"] = np.random.default_rng(8).standard_normal((1, H * G, B, D)).astype("float32")
    for k, shp in (("score", (H, N + B)), ("acc_cand", (H, N + B)), ("col_sums", (H * G, N + B))):
        st[k] = np.full(shp, 5.0, "float32")
    names = ["q", "k_cache", "pos_cache", "fill", "k_blk", "pos_blk", "n_valid", "acc", "d2o_budget", "score",
             "acc_cand", "col_sums"]
    want = run_cpu(build_d2o_score_kernel(H * G, H, N, B, D, D ** -0.5, "float32", 2), st, names)
    got = run_opencl(build_d2o_score_kernel_gpu(H * G, H, N, B, D, D ** -0.5, "float32", 2), st)
    n = min(nf, N) + nv
    for k in ("col_sums", "acc_cand", "score"):
        np.testing.assert_allclose(got[k][:, :n], want[k][:, :n], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nf,nv", FILLS)
@pytest.mark.parametrize("merge,threshold", MODES)
def test_d2o_evict(shape, nf, nv, merge, threshold):
    H, N, B, D = shape
    keep = N - 5
    st = _d2o_state(H, N, B, D, nf, nv, keep, 9)
    rng = np.random.default_rng(10)
    st["score"] = rng.standard_normal((H, N + B)).astype("float32")
    st["score"][:, :2] = np.inf
    st["acc_cand"] = rng.random((H, N + B)).astype("float32")
    st["d2o_tau"] = np.array([0.2, 1.0] if nf % 2 else [0.0, 0.0], "float32")
    names = ["k_cache", "v_cache", "pos_cache", "fill", "k_blk", "v_blk", "pos_blk", "n_valid", "score", "acc_cand",
             "d2o_budget", "acc", "d2o_tau"]
    want = run_cpu(build_d2o_evict_kernel(H, N, B, D, "float32", merge, threshold), st, names)
    # the GPU kernel's global scratch (host-allocated workspaces in a real build)
    scratch = {"gone": ((H, N + B), "int32"), "best": ((H, N + B), "float32"), "target": ((H, N + B), "int32"),
               "unit": ((H, N + B, D), "float32"), "k_new": ((H, B, D), "float32"), "v_new": ((H, B, D), "float32"),
               "thr": ((1,), "float32"), "den_all": ((H, N + B), "float32"), "hit_all": ((H, N + B), "int32")}
    got = run_opencl(build_d2o_evict_kernel_gpu(H, N, B, D, "float32", merge, threshold),
                     {**st, **{k: np.zeros(s, dt) for k, (s, dt) in scratch.items()}})
    n = int(want["fill"][0])
    assert got["fill"][0] == n
    np.testing.assert_array_equal(got["pos_cache"][:, :n], want["pos_cache"][:, :n])
    np.testing.assert_array_equal(got["acc"][0, :, :n], want["acc"][0, :, :n])
    for k in ("k_cache", "v_cache"):
        np.testing.assert_allclose(got[k][:, :n], want[k][:, :n], rtol=1e-5, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(got["d2o_tau"], want["d2o_tau"], rtol=1e-5, atol=1e-6)
