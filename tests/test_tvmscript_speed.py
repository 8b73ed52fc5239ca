"""``compiler/tvmscript_speed``: T.macro expansion finds its parser by a plain frame walk instead of
TVM's ``inspect.getouterframes`` (a third less CPU per tiny compile at new shapes), and the
per-process kernel memos (``kernels.build_*``, ``policy_kernels._build_*``,
``passes.pack_weights.packed_kernel``). Neither may change what is built: a compile with TVM's
lookup and fresh kernels, one with the walk and fresh kernels, and one that takes every kernel from
the memo write the same program, library and parameters byte for byte."""

from __future__ import annotations

import json

import pytest

tvm = pytest.importorskip("tvm")

from edgekv.compiler import compile_model, kernels, policy_kernels, tvmscript_speed  # noqa: E402
from edgekv.compiler.passes import pack_weights  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import SnapKVPolicy  # noqa: E402

TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}


def _fresh_kernels():
    """Forget the per-process kernel builds, so the next compile parses every kernel again."""
    for build in (kernels.build_attention, kernels.build_select, policy_kernels._build_score,
                  policy_kernels._build_observe, pack_weights.packed_kernel):
        build.cache_clear()


def test_the_frame_walk_is_installed_for_this_tvm():
    # False would mean TVM's lookup changed from the one tvmscript_speed read: re-read it
    assert tvmscript_speed.install()


@pytest.mark.parametrize("policy", [SnapKVPolicy(window=4, kernel=3)], ids=["snapkv"])
def test_compiles_with_either_lookup_or_the_memo_are_byte_identical(tmp_path, policy):
    model = tiny_random_model(0)
    outs = {}
    try:
        for name, use, fresh in (("tvm", tvmscript_speed.uninstall, True), ("walk", tvmscript_speed.install, True),
                                 ("memo", tvmscript_speed.install, False)):
            use()
            if fresh:
                _fresh_kernels()
            outs[name] = tmp_path / name
            compile_model(model, policy, 24, 8, TARGET, outs[name])
        assert pack_weights.packed_kernel.cache_info().hits > 0  # the memo was used (the last compile)
    finally:
        tvmscript_speed.install()
        _fresh_kernels()
    for file in ("program.ekv", "model.so", "params.safetensors"):
        assert (outs["tvm"] / file).read_bytes() == (outs["walk"] / file).read_bytes(), file
        assert (outs["tvm"] / file).read_bytes() == (outs["memo"] / file).read_bytes(), file

    def without_timings(path):
        manifest = json.loads((path / "manifest.json").read_text())
        manifest.pop("timings")  # seconds each step took
        return manifest
    assert without_timings(outs["tvm"]) == without_timings(outs["walk"]) == without_timings(outs["memo"])
