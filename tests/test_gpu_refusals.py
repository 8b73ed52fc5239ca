"""What the GPU targets still refuse (issue 35, deliverable 6), each before any work and naming
exactly what has no GPU version: question rows (the GPU score / observe kernels take none), the
int8 KV cache (kernels/kv_int8.py is CPU loops) and RocketKV (its stage-2 decode attention and page
summaries are CPU kernels)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("tvm")

from edgekv.compiler import CompileError, compile_model  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=1, layers=2)


def refused(fn) -> str:
    t0 = time.perf_counter()
    with pytest.raises(CompileError) as err:
        fn()
    assert time.perf_counter() - t0 < 5, "refused only after work"  # before export / lowering
    return str(err.value)


@pytest.mark.parametrize("target", ["opencl-host", "cuda"])
def test_question_rows_name_the_score_kernels(model, target, tmp_path):
    msg = refused(lambda: compile_model(model, make_policy("snapkv"), 32, 8, target=target, out_dir=tmp_path,
                                        question_rows=4))
    assert "--question-rows has no GPU kernels yet" in msg and "attention_scores.py" in msg
    assert "build_dapq_evict_kernel_gpu" in msg and "position -1" in msg and "CPU target" in msg


def test_int8_cache_names_its_kernels(model, tmp_path):
    msg = refused(lambda: compile_model(model, make_policy("keydiff"), 32, 8, target="opencl-host", out_dir=tmp_path,
                                        kv_dtype="int8"))
    assert "kernels/kv_int8.py" in msg and "--kv-dtype fp32" in msg


def test_rocketkv_names_its_stage_two(model, tmp_path):
    msg = refused(lambda: compile_model(model, make_policy("rocketkv", {"window": "4"}), 16, 8, target="opencl-host",
                                        out_dir=tmp_path))
    assert "emit_decode_attention" in msg and "stage 2" in msg and "page summaries" in msg
