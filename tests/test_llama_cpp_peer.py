"""The llama.cpp peer (edgekv/bench/llama_cpp.py): finding the built llama-bench, running it as a
child with its own peak RSS, reading its JSON; and the bench tool's input checks."""

import json
import os
import stat
import sys

import pytest

from edgekv.bench import llama_cpp


def test_missing_binary_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    with pytest.raises(RuntimeError, match="build_llama_cpp.py"):
        llama_cpp.find_binary("llama-bench", cache=tmp_path)


def test_build_dir_is_versioned_under_the_cache(tmp_path):
    assert llama_cpp.build_dir(tmp_path) == tmp_path / "llama.cpp" / llama_cpp.LLAMA_CPP_PYTHON


def test_run_measured_reports_the_child_peak(tmp_path):
    # a child that touches 64 MiB: its own peak, not the test process's
    out, _, peak = llama_cpp.run_measured([sys.executable, "-c", "b = bytearray(64 << 20); print(len(b))"])
    assert out.strip() == str(64 << 20)
    assert 64 << 20 < peak < 1 << 30


def test_run_measured_raises_with_the_childs_error():
    with pytest.raises(RuntimeError, match="exit 3.*boom"):
        llama_cpp.run_measured([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])


def _fake_llama_bench(tmp_path, rows):
    """A stand-in for llama-bench that records its arguments and prints ``rows`` as its JSON."""
    script = tmp_path / "llama-bench"
    script.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(tmp_path / 'args.json')!r}, 'w')"
                      f".write(json.dumps(sys.argv[1:]))\nprint(json.dumps({rows!r}))\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_llama_bench_arguments_and_result(tmp_path):
    exe = _fake_llama_bench(tmp_path, [{"avg_ts": 86.9, "samples_ts": [86.5, 87.3], "n_threads": 2,
                                        "build_commit": "abc", "type_k": "f16"}])
    r = llama_cpp.llama_bench("m.gguf", 2, generate=32, depth=1024, flash_attn=True, binary=exe)
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[args.index("-p") + 1] == "0" and args[args.index("-n") + 1] == "32"
    assert args[args.index("-d") + 1] == "1024" and args[args.index("-fa") + 1] == "1"
    assert args[args.index("-t") + 1] == "2" and args[args.index("-o") + 1] == "json"
    assert r["tok_s"] == 86.9 and r["samples_tok_s"] == [86.5, 87.3] and r["flash_attn"] is True
    assert r["peak_rss"] > 0


def test_llama_bench_one_phase_only(tmp_path):
    with pytest.raises(ValueError):
        llama_cpp.llama_bench("m.gguf", 2, prompt=8, generate=8, binary=tmp_path / "x")


def test_bench_tool_refuses_a_folder_without_an_artifact(tmp_path):
    from tools.bench import bench_llama_cpp

    with pytest.raises(SystemExit, match="holds no program.ekv"):
        bench_llama_cpp.main(["--artifact", str(tmp_path)])
    with pytest.raises(SystemExit, match="1k,8k"):
        bench_llama_cpp.parse_lengths("one")


@pytest.mark.slow
def test_real_llama_bench_on_smollm2():
    """llama-bench itself (built by tools/bench/build_llama_cpp.py) on SmolLM2's GGUF."""
    try:
        exe = llama_cpp.find_binary("llama-bench")
    except RuntimeError as e:
        pytest.skip(str(e))
    from edgekv.models.sources import resolve

    r = llama_cpp.llama_bench(resolve("smollm2-135m").path, min(2, os.cpu_count() or 1), prompt=64, binary=exe)
    assert r["tok_s"] > 0 and r["peak_rss"] > 50 << 20


def test_bench_tables_from_runs():
    """The summary and markdown of the bench tool from runs shaped as it records them."""
    from tools.bench import bench_llama_cpp as b

    def llama(pp, tg, rss):
        runs = {f"{ph}_fa{fa}": {"tok_s": v * (1 + fa / 10), "peak_rss": rss, "flash_attn": bool(fa)}
                for ph, v in (("pp", pp), ("tg", tg)) for fa in (0, 1)}
        return {"prefill_tok_s": pp * 1.1, "decode_tok_s": tg * 1.1, "peak_rss": rss, "runs": runs}

    raw = {"edgekv": {1024: [{"prefill_tok_s": 600.0, "decode_tok_s": 70.0, "peak_rss": 150 << 20, "plan_bytes": 120 << 20}]},
           "llama.cpp": {1024: [llama(300.0, 80.0, 160 << 20)]}}
    rows = b.summarize(raw, [1024])
    assert rows[0]["ratio"]["decode_tok_s"] == pytest.approx(70.0 / 88.0)
    assert rows[0]["llama.cpp"]["decode_tok_s_fa0"] == 80.0
    result = {"meta": {"command": "x", "machine": {"cores": 2, "cpu": "cpu"}, "load_before": "1", "load_after": "1",
                       "commit": "c"}, "llama_cpp_build": {"llama_cpp_python": "0.3.36", "version": "v\nb",
                                                           "cmake_flags": ["-DGGML_NATIVE=ON"]},
              "threads": 2, "gguf": "/m.gguf", "model": "smollm2-135m", "artifact_summary": "a", "decode_tokens": 32,
              "rounds": 1, "rows": rows, "wall_seconds": 1.0,
              "decode_profile": {"depth": 1024, "tokens": 4, "token_seconds": 0.02, "kernels_seconds": 0.03,
                                 "by_kind": {"attention": {"seconds": 0.01, "share": 0.5}},
                                 "kernels": [{"name": "decode_attention", "calls_per_token": 30, "seconds": 0.01}]}}
    md = b.markdown(result)
    assert "machine was shared" in md and "0.80×" in md and "decode_attention" in md


def test_bench_tables_with_one_flash_attention_setting():
    """``--flash-attn off``: only the off runs exist; the tables show the other setting as absent
    and say which one ran."""
    from tools.bench import bench_llama_cpp as b

    runs = {"pp_fa0": {"tok_s": 300.0, "peak_rss": 160 << 20, "flash_attn": False},
            "tg_fa0": {"tok_s": 80.0, "peak_rss": 160 << 20, "flash_attn": False}}
    raw = {"edgekv": {1024: [{"prefill_tok_s": 600.0, "decode_tok_s": 70.0, "peak_rss": 150 << 20, "plan_bytes": 120 << 20}]},
           "llama.cpp": {1024: [{"prefill_tok_s": 300.0, "decode_tok_s": 80.0, "peak_rss": 160 << 20, "runs": runs}]}}
    rows = b.summarize(raw, [1024])
    assert rows[0]["ratio"]["prefill_tok_s"] == pytest.approx(2.0)
    assert "prefill_tok_s_fa1" not in rows[0]["llama.cpp"]
    result = {"meta": {"command": "x", "machine": {"cores": 2, "cpu": "cpu"}, "load_before": "1", "load_after": "1",
                       "commit": "c"}, "llama_cpp_build": {}, "threads": 2, "gguf": "/m.gguf", "model": "smollm2-135m",
              "artifact_summary": "a", "decode_tokens": 32, "rounds": 1, "rows": rows, "wall_seconds": 1.0,
              "flash_attn": "off"}
    md = b.markdown(result)
    assert "flash attention **off** only" in md and "300.0 / —" in md and "2.00×" in md
