"""The GPU select + compaction kernel (``kernels/select.py``, ``build_select_compact_kernel_gpu``:
a work-group per KV head, radix select of the order-preserving key, tie cut by prefix sum, chunked in-place
compaction) on PoCL, held against the eviction rule itself (``topk_keep``: the N highest scores,
ties keeping the lower index, survivors in candidate order) and against the CPU kernel it replaces,
with hypothesis: random scores, heavy ties, every candidate equal, −0.0 beside +0.0, N + B not a
power of two, per-entry state, append steps. Each case runs twice: PoCL optimising (the kernel
must not need the runtime's unoptimised build of eviction kernels) and with ``-cl-opt-disable``.

Needs pyopencl and an OpenCL device (``apt-get install pocl-opencl-icd``; pyopencl is in the dev
extra); skips, saying so, without them."""

from __future__ import annotations

import functools

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
cl = pytest.importorskip("pyopencl")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgekv.compiler.kernels import build_select  # noqa: E402
from edgekv.compiler.kernels.select import build_select_compact_kernel_gpu  # noqa: E402
from tools.bench.bench_gpu_select import opencl_program  # noqa: E402  (the same build the bench times)


def _device():
    try:
        for plat in cl.get_platforms():
            devs = plat.get_devices()
            if devs:
                return devs[0]
    except Exception:  # noqa: BLE001 - no ICD loader / platform
        return None
    return None


DEVICE = _device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs an OpenCL device (apt-get install pocl-opencl-icd)")

# (H, N, B, D, S): N + B = 43, 32 (a power of two), 70, 21; one head, three; state or none.
# B = 1 (decode) takes the one-pass minimum select instead of the radix select: N + 1 = 38, 32,
# 301 (more candidates than the work-group's 256 threads) and 9 heads (two rounds of 8 heads)
SHAPES = [(2, 37, 6, 8, 0), (3, 24, 8, 4, 1), (1, 61, 9, 16, 0), (3, 16, 5, 8, 2),
          (3, 37, 1, 8, 0), (1, 31, 1, 4, 1), (2, 300, 1, 4, 0), (9, 12, 1, 64, 2)]
OPTIONS = ["", "-cl-opt-disable"]
@functools.lru_cache(maxsize=None)
def _context():
    return cl.Context([DEVICE])


@functools.lru_cache(maxsize=None)
def _gpu_program(shape, options):
    """(program, [(kernel name, [buffer names]), ...], [(groups, local)]) of the GPU kernel."""
    H, N, B, D, S = shape
    func = build_select_compact_kernel_gpu(H, N, B, D, "float32", True, S)
    program, kernels, launches = opencl_program(func, _context(), options)
    assert len(kernels) == len(launches) == 2, (kernels, launches)  # evict per head, then append + fill
    return program, kernels, launches


@functools.lru_cache(maxsize=None)
def _cpu_kernel(shape):
    H, N, B, D, S = shape
    func = build_select(H, N, B, D, "float32", True, S)
    return tvm.compile(tvm.IRModule({"f": func.with_attr("global_symbol", "f")}), target="llvm")["f"], \
        [p.name for p in func.params]


def run_gpu(shape, options, arrays):
    prog, kernels, launches = _gpu_program(shape, options)
    ctx = _context()
    queue = cl.CommandQueue(ctx)
    host = {k: np.ascontiguousarray(v).copy() for k, v in arrays.items()}
    mf = cl.mem_flags
    bufs = {k: cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=v) for k, v in host.items()}
    for (name, args), (groups, local) in zip(kernels, launches):
        cl.Kernel(prog, name)(queue, (groups * local,), (local,), *[bufs[a] for a in args])
    for k, b in bufs.items():
        cl.enqueue_copy(queue, host[k], b)
    queue.finish()
    return host


def run_cpu(shape, arrays):
    f, names = _cpu_kernel(shape)
    tens = {n: tvm.runtime.tensor(np.ascontiguousarray(arrays[n]).copy()) for n in names}
    f(*[tens[n] for n in names])
    return {n: t.numpy() for n, t in tens.items()}


def reference(arrays, N):
    """What the kept cache must hold: per head the candidates topk_keep picks, in candidate order."""
    nf, nv = int(arrays["fill"][0]), int(arrays["n_valid"][0])
    n = nf + nv
    score = arrays["score"]
    H = score.shape[0]
    cand_k = np.concatenate([arrays["k_cache"][:, :nf], arrays["k_blk"][0, :, :nv]], axis=1)
    cand_v = np.concatenate([arrays["v_cache"][:, :nf], arrays["v_blk"][0, :, :nv]], axis=1)
    cand_p = np.concatenate([arrays["pos_cache"][:, :nf], np.tile(arrays["pos_blk"][:nv], (H, 1))], axis=1)
    out = {"k": [], "v": [], "pos": [], "state": [], "fill": min(n, N)}
    for h in range(H):
        if n <= N:
            kept = np.arange(n)
        else:  # a stable sort of the negated scores: −0.0 and +0.0 tie, ties keep the lower index
            kept = np.sort(np.argsort(-score[h, :n].astype(np.float64), kind="stable")[:N])
        out["k"].append(cand_k[h, kept])
        out["v"].append(cand_v[h, kept])
        out["pos"].append(cand_p[h, kept])
        if "cand_state" in arrays:
            out["state"].append(arrays["cand_state"][:, h, kept])
    return out


def make_inputs(shape, nf, nv, scores, seed):
    H, N, B, D, S = shape
    rng = np.random.default_rng(seed)
    a = {
        "k_cache": rng.standard_normal((H, N, D)).astype("float32"),
        "v_cache": rng.standard_normal((H, N, D)).astype("float32"),
        "pos_cache": (np.arange(N, dtype="int32")[None, :] * 3 + np.arange(H, dtype="int32")[:, None]),
        "fill": np.array([nf], "int32"),
        "k_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
        "v_blk": rng.standard_normal((1, H, B, D)).astype("float32"),
        "pos_blk": (1000 + np.arange(B, dtype="int32")),
        "n_valid": np.array([nv], "int32"),
        "score": scores.astype("float32"),
    }
    if S:
        a["state"] = rng.standard_normal((S, H, N)).astype("float32")
        a["cand_state"] = rng.standard_normal((S, H, N + B)).astype("float32")
    return a


KINDS = ("random", "few_values", "all_equal", "signed_zeros", "infinities")


def make_scores(kind, H, NB, rng):
    if kind == "random":
        return rng.standard_normal((H, NB))
    if kind == "few_values":  # heavy ties
        return rng.integers(-2, 3, (H, NB)).astype("float64") / 2
    if kind == "all_equal":
        return np.full((H, NB), float(rng.standard_normal()))
    if kind == "signed_zeros":  # −0.0 and +0.0 tie, as they do as floats (and in torch's sort)
        return np.where(rng.random((H, NB)) < 0.5, -0.0, 0.0) + np.where(rng.random((H, NB)) < 0.2, 1.0, 0.0)
    s = rng.standard_normal((H, NB))  # pinned rows (+inf) and masked ones (−inf), as policies write them
    s[rng.random((H, NB)) < 0.2] = np.inf
    s[rng.random((H, NB)) < 0.1] = -np.inf
    return s


def check(shape, nf, nv, kind, seed, options):
    H, N, B, D, S = shape
    a = make_inputs(shape, nf, nv, make_scores(kind, H, N + B, np.random.default_rng(seed)), seed)
    got = run_gpu(shape, options, a)
    want = reference(a, N)
    k = want["fill"]
    assert int(got["fill"][0]) == k
    np.testing.assert_array_equal(got["pos_cache"][:, :k], np.stack(want["pos"]))
    np.testing.assert_array_equal(got["k_cache"][:, :k], np.stack(want["k"]))
    np.testing.assert_array_equal(got["v_cache"][:, :k], np.stack(want["v"]))
    if S:
        np.testing.assert_array_equal(got["state"][:, :, :k], np.stack(want["state"], axis=1))
    # and bit for bit what the CPU kernel leaves (rows past fill are scratch on both)
    cpu = run_cpu(shape, a)
    assert int(cpu["fill"][0]) == k
    for name in ("k_cache", "v_cache", "pos_cache") + (("state",) if S else ()):
        np.testing.assert_array_equal(got[name][..., :k, :] if got[name].ndim == 3 and name != "state"
                                      else got[name][..., :k],
                                      cpu[name][..., :k, :] if cpu[name].ndim == 3 and name != "state"
                                      else cpu[name][..., :k], err_msg=name)


@st.composite
def cases(draw):
    shape = draw(st.sampled_from(SHAPES))
    H, N, B, D, S = shape
    nv = draw(st.integers(1, B))
    # mostly evicting steps (a full cache, or one that overflows this step), some appends
    nf = draw(st.one_of(st.just(N), st.integers(max(0, N - nv + 1), N), st.integers(0, N - nv)))
    return shape, nf, nv, draw(st.sampled_from(KINDS)), draw(st.integers(0, 2 ** 31 - 1))


@pytest.mark.parametrize("options", OPTIONS, ids=["optimised", "unoptimised"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_gpu_select_keeps_what_topk_keep_keeps(options, case):
    shape, nf, nv, kind, seed = case
    check(shape, nf, nv, kind, seed, options)


@pytest.mark.parametrize("options", OPTIONS, ids=["optimised", "unoptimised"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_select_edge_cases(options, kind):
    """The cases hypothesis may not draw every time: every candidate evicted from the cache's front,
    one eviction (decode), a whole block of evictions, an append that just fits."""
    for shape in SHAPES:
        H, N, B, D, S = shape
        for nf, nv in ((N, 1), (N, B), (N - 1, B), (N - B, B)):
            check(shape, nf, nv, kind, nf * 31 + nv, options)


def test_gpu_select_launches_a_work_group_per_head():
    """Two launches per step, neither of a single work-item: a work-group of 256 threads per KV head
    (selection and compaction of that head), then one work-group that appends and writes ``fill``
    (the fill update rides in it: every work-group of the first launch reads ``fill``)."""
    for shape in SHAPES:
        _, _, launches = _gpu_program(shape, "")
        assert launches == [(shape[0], 256), (1, 256)], launches
