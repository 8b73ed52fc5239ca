"""`edgekv bench` harness: peers that are missing or lack their input are reported, not failed;
each system runs in its own worker process and reports timings and its own peak RSS. Speeds
are measured by the benchmark itself, never asserted here."""

from __future__ import annotations

import pytest

from edgekv.bench import runner as bench_runner
from edgekv.bench.runner import BenchConfig, run_bench, run_once, summarize


def test_missing_peers_and_inputs_are_reported_not_run(monkeypatch):
    monkeypatch.setitem(bench_runner.NEEDS, "hf", "a_module_that_is_not_installed")
    cfg = BenchConfig(systems=["hf", "edgekv-compiled", "onnxruntime"], lengths=[8], memory_only_lengths=[],
                      repeats=1)
    results = run_bench(cfg, lambda n: list(range(n)))
    assert results["runs"] == []
    assert "not installed" in results["skipped"]["hf"] and "bench" in results["skipped"]["hf"]
    assert "--artifact" in results["skipped"]["edgekv-compiled"]
    assert "--onnx" in results["skipped"]["onnxruntime"] and "export-onnx" in results["skipped"]["onnxruntime"]


def test_summary_is_the_median_of_the_runs_that_worked():
    runs = [{"prefill_tok_s": 10.0, "peak_rss": 3}, {"error": "exit 1"}, {"prefill_tok_s": 30.0, "peak_rss": 1},
            {"prefill_tok_s": 20.0, "peak_rss": 2}]
    assert summarize(runs) == {"repeats": 3, "prefill_tok_s": 20.0, "peak_rss": 2}
    assert summarize([{"error": "boom"}]) == {"error": "boom"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """The tiny random model as an HF directory and exported to ONNX (past_key_values form)."""
    from edgekv.models import tiny_random_model

    tiny = tiny_random_model(0)
    root = tmp_path_factory.mktemp("bench")
    tiny.to_hf().save_pretrained(root / "hf")
    onnx = None
    try:
        from edgekv.compiler.frontend.onnx_export import export_onnx

        onnx = export_onnx(tiny, root / "onnx", form="past")
    except ImportError:
        pass
    return root / "hf", onnx


@pytest.mark.parametrize("system", ["edgekv-eager", "hf", "onnxruntime"])
def test_worker_process_reports_timings_and_peak_rss(tiny_dirs, system):
    hf_dir, onnx = tiny_dirs
    if system == "onnxruntime" and (onnx is None or not bench_runner.installed("onnxruntime")):
        pytest.skip("onnx/onnxruntime not installed (the dev extra installs them)")
    cfg = BenchConfig(model=str(hf_dir), budget=16, block=8, threads=1, onnx=str(onnx) if onnx else None, timeout=300)
    out = run_once(cfg, system, list(range(3, 43)), decode_tokens=4)
    assert "error" not in out, out
    assert out["prefill_seconds"] > 0 and out["decode_seconds"] > 0 and out["peak_rss"] > 0
    assert out["prefill_tok_s"] == pytest.approx(40 / out["prefill_seconds"])


def test_question_tokens_time_the_question_aware_prefill(tiny_dirs):
    """--question-tokens: the eager system reads the prompt's document knowing its last Q tokens;
    a query-agnostic policy cannot take them (BlockEngine gives it no question rows) — it still
    runs, unchanged — and a query-aware one scores with them."""
    hf_dir, _ = tiny_dirs
    for policy in ("snapkv", "keydiff"):
        cfg = BenchConfig(model=str(hf_dir), budget=16, block=8, threads=1, timeout=300, policy=policy,
                          question_tokens=6)
        out = run_once(cfg, "edgekv-eager", list(range(3, 43)), decode_tokens=2)
        assert "error" not in out, out
        assert out["prefill_seconds"] > 0
