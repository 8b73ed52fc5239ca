"""`edgekv simulate`: device profiles and their validation, the memory cap on a child process
(refusal before start, a run that fits with its peak under the cap, a run that does not fit
reported cleanly while the parent survives), work counts, roofline and sweep arithmetic.

Child runs use tiny random models the child rebuilds from a spec string ("tiny:SEED:..."),
so nothing is downloaded; each child pays a torch import (a few seconds)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgekv.cli import app
from edgekv.simulate import limits
from edgekv.simulate.profiles import DEVICE_DIR, ProfileError, load_profile, load_profile_file, load_profiles, validate_all
from edgekv.simulate.roofline import estimate
from edgekv.simulate.runner import DOES_NOT_FIT, FITS, REFUSED, Job, plan_for, run_job
from edgekv.simulate.source import describe
from edgekv.simulate.sweep import Series, longest_prompt, need_bytes
from edgekv.simulate.work import GeometryWork, Schedule

MiB, GiB = 2**20, 2**30
TINY = "tiny:0"


@pytest.fixture(scope="module")
def tiny_target():
    return describe(TINY)


@pytest.fixture(scope="module")
def mech():
    return limits.choose("auto")


# ---- profiles ------------------------------------------------------------------------------

def test_shipped_profiles_validate():
    profiles = {p.name: p for p in validate_all()}
    assert {"midrange-android", "flagship-android-sd8gen3", "iphone-15-pro"} <= set(profiles)
    for p in profiles.values():
        assert set(p.units) == {"cpu", "gpu", "npu"}
        assert 0 < p.app_usable_bytes < 8 * GiB and p.bandwidth_bytes_per_s > 1e10
        assert all(src.strip() for src in p.sources().values())
    sd = profiles["flagship-android-sd8gen3"]
    assert "Adreno" in sd.units["gpu"].description and "Hexagon" in sd.units["npu"].description


def _broken(tmp_path, mutate) -> Path:
    data = json.loads((DEVICE_DIR / "flagship-android-sd8gen3.json").read_text())
    data = copy.deepcopy(data)
    mutate(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["memory"]["bandwidth"].pop("source"), "memory.bandwidth.source"),
    (lambda d: d["memory"].pop("app_usable"), "memory.app_usable"),
    (lambda d: d.pop("compute_units"), "compute_units"),
    (lambda d: d["compute_units"]["gpu"]["fp32_gflops"].pop("estimate"), "compute_units.gpu.fp32_gflops.estimate"),
    (lambda d: d["compute_units"]["gpu"]["fp32_gflops"].update(value=-1), "compute_units.gpu.fp32_gflops.value"),
    (lambda d: d["compute_units"].pop("cpu"), "compute_units.cpu"),
    (lambda d: d["memory"]["app_usable"].update(unit="bananas"), "memory.app_usable.unit"),
])
def test_profile_missing_or_bad_field_names_file_and_field(tmp_path, mutate, field):
    path = _broken(tmp_path, mutate)
    with pytest.raises(ProfileError) as info:
        load_profile_file(path)
    assert str(path) in str(info.value) and f"'{field}" in str(info.value)


def test_unknown_device_lists_known():
    with pytest.raises(ProfileError, match="known devices.*iphone-15-pro"):
        load_profile("pixel-99")
    assert len(load_profiles(["all"])) == len(validate_all())


# ---- work, roofline, sweep arithmetic ---------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_geometry_work_reads_every_weight_once(tied):
    from edgekv.models import tiny_random_model

    m = tiny_random_model(0, tie_embeddings=tied)
    g = GeometryWork(m.config)
    embed = m.config.vocab_size * m.config.hidden_size
    # a step reads layers + norm + LM head; the embedding table is read only for its b rows
    assert 4 * (g.weight_params() + (0 if tied else embed)) == m.weight_bytes
    d = g.decode(100, evicts=False)
    assert d.flops >= 2 * g.weight_params() and d.bytes >= 4 * g.weight_params()
    assert g.decode(1000, False).bytes > d.bytes  # a longer cache is read every step


def test_roofline_memory_bound_decode_is_bytes_over_bandwidth(tiny_target):
    p = load_profile("midrange-android")
    g = GeometryWork(tiny_target.config)
    e = estimate(p, g, Schedule(prompt=256, new_tokens=8, budget=128, block=32, evicting=True), "gpu")
    w = g.decode(128, evicts=True)
    assert e.decode_bound == "memory"
    assert math.isclose(e.decode_s_per_token, w.bytes / p.bandwidth_bytes_per_s)
    npu = estimate(p, g, Schedule(256, 8, 128, 32, True), "npu")
    assert npu.precision == "int8" and "int8" in npu.note  # no fp32 rate: says what it assumed


def test_schedule_full_grows_evicting_stays_bounded():
    full = list(Schedule(1000, 4, 1004, 128, False).blocks())
    kd = list(Schedule(1000, 4, 256, 128, True).blocks())
    assert [n for n, _, _ in full][-1] == 896 and not any(e for *_, e in full)
    assert max(n for n, _, _ in kd) <= 256 and any(e for *_, e in kd)


def test_sweep_longest_prompt(tiny_target):
    full, kd = Series("full", None), Series("keydiff", 128)
    cap, over = 64 * MiB, 10 * MiB
    n = longest_prompt(tiny_target, full, cap, 32, 4, over)
    assert 0 < n < math.inf
    assert need_bytes(tiny_target, full, n, 32, 4, over) <= cap < need_bytes(tiny_target, full, n + 1, 32, 4, over)
    assert longest_prompt(tiny_target, kd, cap, 32, 4, over) == math.inf
    assert longest_prompt(tiny_target, kd, 1 * MiB, 32, 4, over) == 0


# ---- the capped child ----------------------------------------------------------------------------

def test_cap_below_plan_is_refused_before_the_child_starts(tiny_target, mech, monkeypatch):
    def no_child(*a, **k):
        raise AssertionError("a child was started")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    plan = plan_for(tiny_target, "streaming", {}, 64, 32)
    out = run_job(Job(tiny_target, list(range(100)), "streaming", {}, 64, 32, 4, plan.total - 1, mech))
    assert out.status == REFUSED and not out.fits
    assert out.needs_bytes == plan.total and "static plan" in out.needs_basis


def test_run_under_a_sufficient_cap_fits_and_peak_stays_under_it(tiny_target, mech):
    cap = 2 * GiB
    out = run_job(Job(tiny_target, list(range(200)), "streaming", {}, 64, 32, 4, cap, mech, threads=1))
    assert out.status == FITS, out.error
    assert out.measured_peak is not None and out.plan["total"] < out.measured_peak <= cap
    assert out.report["generated_tokens"] == 4 and out.report["prompt_tokens"] == 200
    assert out.runtime_overhead == out.measured_peak - out.plan["total"]
    assert out.host["prefill_seconds"] > 0


def test_full_cache_under_a_too_small_cap_fails_cleanly_and_the_parent_survives(mech):
    # A full cache sized for ~1.4M tokens (≈ 0.7 GB of KV: a short prompt and a very long output, as the
    # cache holds what prompt + output need) — the plan is under the cap, but the plan plus what Python
    # and torch need at run time is not: the child hits the cap (or sees that the plan no longer fits
    # what the cap leaves) before the cache exists, and the parent reports it.
    target = describe(TINY)
    n = 1_400_000
    plan = plan_for(target, "full", {}, n, 1, n)
    cap = plan.total + 150 * MiB
    out = run_job(Job(target, list(range(48)), "full", {}, n, 1, n - 48, cap, mech, threads=1))
    assert out.status == DOES_NOT_FIT and not out.fits
    assert out.needs_bytes > cap and out.needs_bytes >= plan.total
    assert out.measured_peak is None or out.measured_peak <= cap
    assert out.exit  # how the child ended is reported


def test_child_that_dies_at_startup_is_reported_not_raised(tiny_target, mech):
    out = run_job(Job(tiny_target, list(range(50)), "streaming", {}, 64, 32, 2, 48 * MiB, mech))
    assert out.status == DOES_NOT_FIT and out.needs_bytes > 48 * MiB and out.needs_lower_bound, (out.status, out.exit, out.error)
    assert "importing" in out.needs_basis or "loading" in out.needs_basis
    assert out.exit  # e.g. "killed by SIGABRT": torch's import aborts when it cannot allocate


def test_mechanism_choice():
    m = limits.choose("auto")
    assert m.name in ("cgroup2", "rlimit-data") and m.reason and m.measures
    with pytest.raises(limits.LimitError):
        limits.choose("bogus")


# ---- the command ------------------------------------------------------------------------------------

cli = CliRunner()


def test_cli_refuses_a_cap_below_the_plan_exit_2_and_writes_nothing(tmp_path):
    report = tmp_path / "r.json"
    res = cli.invoke(app, ["simulate", TINY, "--prompt", "hello " * 30, "--mem-limit", "100KiB", "--policy", "full",
                           "--block", "32", "--max-new-tokens", "2", "--device", "midrange-android", "--report", str(report)])
    assert res.exit_code == 2, res.output
    flat = " ".join(res.output.split())
    assert "does not fit" in flat and "refused" in flat and "Traceback" not in flat
    assert "error: the memory plan is above the cap of 100.0KiB (--mem-limit): full N=" in flat
    assert "nothing ran and no report was written" in flat
    assert not report.exists()


def test_cli_exit_1_when_one_of_several_runs_does_not_fit(tmp_path):
    from edgekv.simulate.runner import plan_for

    report = tmp_path / "r.json"
    target = describe(TINY)
    prompt_tokens = len(target.tokenizer("hello " * 30)["input_ids"])
    fits = plan_for(target, "streaming", {}, 64, 32, prompt_tokens + 2).total
    refused = plan_for(target, "full", {}, prompt_tokens + 2, 32, prompt_tokens + 2).total
    assert fits < refused
    cap = (fits + refused) // 2
    res = cli.invoke(app, ["simulate", TINY, "--prompt", "hello " * 30, "--mem-limit", f"{cap}B", "--policy",
                           "full,streaming", "--budget", "64", "--block", "32", "--max-new-tokens", "2", "--device",
                           "midrange-android", "-o", str(report)])
    data = json.loads(report.read_text())
    statuses = {r["policy"]: r["status"] for r in data["runs"]}
    assert statuses["full"] == REFUSED and res.exit_code == (0 if statuses["streaming"] == FITS else 1)


def test_cli_bad_inputs_exit_2_and_write_nothing(tmp_path):
    report = tmp_path / "r.json"
    res = cli.invoke(app, ["simulate", TINY, "--prompt", "hi", "--device", "pixel-99", "--report", str(report)])
    assert res.exit_code == 2 and "unknown device 'pixel-99'" in res.output and not report.exists()
    res = cli.invoke(app, ["simulate", TINY, "--prompt", "hi", "--mechanism", "magic"])
    assert res.exit_code == 2 and "unknown --mechanism" in res.output
    res = cli.invoke(app, ["simulate", TINY, "--prompt", "hi", "--plot", str(tmp_path / "p.txt")])
    assert res.exit_code == 2 and ".png" in res.output


# ---- compiled artifacts ------------------------------------------------------------------------------

def _fake_artifact(tmp_path, target_tvm: dict, work: dict | None = None) -> Path:
    """A manifest-only artifact (enough for the plan check, the estimates and the cross-target rule)."""
    from edgekv.models import tiny_random_model

    cfg = tiny_random_model(0).config
    manifest = {"format": "edgekv-artifact", "format_version": 1,
                "model": {"id": "tiny-llama-0", "config": cfg.to_dict()},
                "policy": {"name": "keydiff", "params": {"recent_window": 0.0}}, "budget": 32, "block": 8,
                "dtype": "float32", "target": {"profile": "x", "tvm": target_tvm},
                "memory_plan": {"weights_bytes": 400_000, "cache_bytes": 20_000, "activation_bytes": 60_000,
                                "total_bytes": 480_000}}
    if work is not None:
        manifest["work"] = work
    d = tmp_path / "art"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_artifact_plan_from_its_manifest_is_refused_before_start(tmp_path):
    from edgekv.simulate.command import SimRequest, simulate

    art = _fake_artifact(tmp_path, {"kind": "llvm"})
    res = simulate(SimRequest(model=str(art), prompt_ids=list(range(40)), mem_limit=400_000, max_new_tokens=2,
                              devices=["iphone-15-pro"]))
    run = res["runs"][0]
    assert res["target_kind"] == "artifact" and run["status"] == REFUSED and run["needs_bytes"] == 480_000
    assert "static N + B" in res["work_source"]


def test_cross_compiled_artifact_gets_estimates_without_a_run(tmp_path):
    from edgekv.simulate.command import SimRequest, simulate
    from edgekv.simulate.runner import NOT_RUN

    work = {"prefill_block": {"flops": 1e6, "bytes": 2e6, "unestimated": ["prefill_block_attention_h4_2_d16"]},
            "decode": {"flops": 2e5, "bytes": 1e6, "unestimated": []}}
    art = _fake_artifact(tmp_path, {"kind": "llvm", "mtriple": "aarch64-linux-android"}, work)
    res = simulate(SimRequest(model=str(art), prompt_ids=list(range(40)), mem_limit="1GiB", max_new_tokens=2,
                              devices=["flagship-android-sd8gen3"]))
    run = res["runs"][0]
    assert run["status"] == NOT_RUN and run["estimates"]
    assert res["work_source"].startswith("artifact graph") and "geometry FLOPs" in res["work_source"]
    est = run["estimates"][0]
    assert est["decode_flops"] == pytest.approx(2e5) and est["decode_bytes"] == pytest.approx(1e6)


@pytest.mark.slow
def test_compiled_artifact_runs_under_the_cap_with_graph_counted_work(tmp_path):
    """Compile a tiny KeyDiff artifact, record its graph-counted work in the manifest, simulate it."""
    pytest.importorskip("tvm")
    from edgekv.compiler import compile_model, lower
    from edgekv.compiler import BlockCacheSpec
    from edgekv.compiler.policy_kernels import kernel_params
    from edgekv.models import tiny_random_model
    from edgekv.policies.keydiff import KeyDiffPolicy
    from edgekv.simulate.command import SimRequest, simulate
    from edgekv.simulate.graph_work import count_module

    model, pol = tiny_random_model(0, layers=2), KeyDiffPolicy()
    out = tmp_path / "kd"
    compile_model(model, pol, 32, 8, target={"kind": "llvm", "opt-level": 0, "num-cores": 2}, out_dir=out)
    lowered = lower(model, BlockCacheSpec(budget=32, policy="keydiff", policy_params=kernel_params(pol, 32)), 8)
    work = count_module(lowered.mod)
    assert work["prefill_block"]["flops"] > work["decode"]["flops"] > 0
    # the geometry count agrees with TVM's own count of the graph (+ the kernels it cannot estimate)
    g = GeometryWork(model.config, static_keys=32 + 8)
    for fn, b in (("prefill_block", 8), ("decode", 1)):
        graph = work[fn]["flops"] + (g.attention_and_eviction_flops(b, 40) if work[fn]["unestimated"] else 0)
        assert graph == pytest.approx(g._step(32, b, True, 4).flops, rel=0.02)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["work"] = work
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = simulate(SimRequest(model=str(out), prompt_ids=list(range(100)), mem_limit="2GiB", max_new_tokens=4,
                              devices=["midrange-android"]))
    run = res["runs"][0]
    assert run["status"] == FITS and run["measured_peak"] <= 2 * GiB
    assert run["engine"].startswith("compiled artifact") and res["work_source"].startswith("artifact graph")


def test_compiled_artifact_runs_in_the_native_runtime_under_the_cap(tmp_path, monkeypatch):
    """An artifact with a flat program is simulated in `edgekv-run` (no Python, torch or TVM in
    the capped process): it fits a cap the host runtime's Python could not, and a cap below what
    the runtime itself needs is out of memory, not an error."""
    pytest.importorskip("tvm")
    from edgekv.compiler import compile_model
    from edgekv.models import tiny_random_model
    from edgekv.policies.keydiff import KeyDiffPolicy
    from edgekv.runtime import native
    from edgekv.simulate.command import SimRequest, simulate

    if native.cli_path() is None:
        pytest.skip("edgekv-run is not built (pip install -e . builds runtime/)")
    out = tmp_path / "kd"
    compile_model(tiny_random_model(0, layers=2), KeyDiffPolicy(), 32, 8,
                  target={"kind": "llvm", "opt-level": 0, "num-cores": 2}, out_dir=out)
    ids = list(range(100))
    res = simulate(SimRequest(model=str(out), prompt_ids=ids, mem_limit="96MiB", max_new_tokens=4))
    run = res["runs"][0]
    assert run["engine"] == "compiled artifact (native runtime, edgekv-run)"
    assert run["status"] == FITS and 0 < run["measured_peak"] <= 96 * 2**20, run
    assert run["report"]["generated_tokens"] == 4 and run["report"]["engine"] == "native (edgekv-run)"
    res = simulate(SimRequest(model=str(out), prompt_ids=ids, mem_limit="4MiB", max_new_tokens=4))
    assert res["runs"][0]["status"] == DOES_NOT_FIT, res["runs"][0]
    # the host runtime stays reachable; it cannot run under the same cap (Python + torch + TVM)
    monkeypatch.setenv("EDGEKV_SIMULATE_HOST_RUNTIME", "1")
    res = simulate(SimRequest(model=str(out), prompt_ids=ids, mem_limit="96MiB", max_new_tokens=4))
    assert res["runs"][0]["engine"] == "compiled artifact (host runtime, TVM Relax VM)"
    assert res["runs"][0]["status"] == DOES_NOT_FIT, res["runs"][0]
