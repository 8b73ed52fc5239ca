"""`edgekv eval`: the harness is sane (quick tier). No accuracy threshold of a real policy
is asserted here — only that the full cache scores as the full cache, that the passkey
answers equal HF transformers' own greedy generate, that a starved sliding window loses
an early needle, and that the JSON report holds every field."""

from __future__ import annotations

import json

import pytest
import torch

from edgekv.engine import BlockEngine
from edgekv.errors import InputError
from edgekv.evaluation import ONE_BLOCK, EvalSpec, compare, run_trace
from edgekv.evaluation.command import build_spec, parse_blocks, parse_tasks, run_eval
from edgekv.evaluation.report import (FIDELITY_FIELDS, PASSKEY_FIELDS, ROW_FIELDS, RUN_FIELDS, TOP_FIELDS,
                                      summarize)
from edgekv.evaluation.tasks import build_fidelity, build_passkey, corpus_paragraphs, extract_key
from edgekv.policies import make_policy


# ---- no model needed --------------------------------------------------------------------------
def test_option_parsing():
    assert parse_tasks("all") == ["passkey", "multikey", "fidelity"]
    assert parse_blocks("128", one_block=True) == [128, ONE_BLOCK]
    assert parse_blocks("one,64", one_block=False) == [64, ONE_BLOCK]  # the reference runs at a real B
    spec = build_spec("passkey", "full,keydiff,streaming", "128,1k", "128", False, "1k,2k", "0.5", "0,1", 4, "text",
                      10, "2k", 512, 16, ["streaming:sinks=8"])
    assert spec.budgets == [128, 1024] and spec.lengths == [1024, 2048] and spec.seeds == [0, 1]
    assert spec.policy_args == {"streaming": {"sinks": "8"}}
    with pytest.raises(Exception, match="not among the chosen ones"):  # a typo'd or forgotten policy
        build_spec("passkey", "full,keydiff", "128", "128", False, "1k", "0.5", "0", 4, "text", 10, "2k", 512, 16,
                   ["streaming:sinks=8"])
    with pytest.raises(Exception, match="unknown policy"):
        build_spec("passkey", "nope", "128", "128", False, "1k", "0.5", "0", 4, "text", 10, "2k", 512, 16, None)
    with pytest.raises(InputError):
        parse_tasks("passkeys")


def test_policy_variants_run_side_by_side():
    """``name#tag`` labels a variant of a policy with its own --policy-arg (a κ sweep in one run,
    sharing each prompt's full-cache reference); unnamed arguments reach every variant."""
    spec = build_spec("passkey", "snapkv++,snapkv++#k3", "512", "128", False, "1k", "0.5", "0", 4, "repeat", 10,
                      "2k", 512, 16, ["snapkv++#k3:kernel=3", "window=16"])
    assert spec.policies == ["snapkv++", "snapkv++#k3"]
    assert spec.policy_args == {"snapkv++": {"window": "16"}, "snapkv++#k3": {"kernel": "3", "window": "16"}}
    variant = make_policy("snapkv++#k3", spec.policy_args["snapkv++#k3"])
    assert variant.name == "snapkv++" and variant.kernel == 3 and variant.window == 16
    assert make_policy("snapkv++", spec.policy_args["snapkv++"]).kernel == 0
    with pytest.raises(Exception, match="unknown policy 'nope#k3'"):
        build_spec("passkey", "nope#k3", "512", "128", False, "1k", "0.5", "0", 4, "repeat", 10, "2k", 512, 16, None)


def test_extract_key():
    assert extract_key(" 58916.") == "58916"
    assert extract_key(" the pass key that is") is None


def test_offline_corpus():
    paras = corpus_paragraphs()
    assert len(paras) > 500 and sum(len(p.split()) for p in paras) > 30_000


def test_fidelity_compare_identical_and_tiny_engine(tiny):
    """On a tiny random model: full vs full is exactly 1.0 / 0.0; a starved streaming cache is not."""
    ids = torch.randint(0, tiny.config.vocab_size, (160,), generator=torch.Generator().manual_seed(1))
    ref = run_trace(BlockEngine(tiny, make_policy("full"), 200, 32), ids, 96, 6)
    again = run_trace(BlockEngine(tiny, make_policy("full"), 200, 32), ids, 96, 6)
    m = compare(ref, again)
    assert m["top1_agreement"] == 1.0 and m["mean_kl"] == 0.0 and m["greedy_prefix_match"] == 1.0
    starved = compare(ref, run_trace(BlockEngine(tiny, make_policy("streaming"), 16, 32), ids, 96, 6))
    assert starved["mean_kl"] > 0.0 and starved["positions"] == 64


# ---- the real model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep(smol, one_thread, tmp_path_factory):
    """One tiny sweep through the whole command path: passkey (needle early in a 1K prompt) and
    fidelity, policies full + streaming at N = 128, block-wise and one block."""
    # the classic haystack: this checks the harness, and its full cache is known to find this needle
    spec = EvalSpec(tasks=["passkey", "fidelity"], policies=["full", "streaming"], budgets=[128], haystack="repeat",
                    blocks=[128, ONE_BLOCK], lengths=[1024], depths=[0.1], seeds=[0], max_new_tokens=8,
                    fidelity_lengths=[512], fidelity_window=128, greedy_tokens=6)
    out = tmp_path_factory.mktemp("eval")
    data = run_eval(spec, out, argv=["edgekv", "eval", "(test)"], progress=False)
    return data, out


@pytest.mark.realmodel
def test_full_policy_fidelity_is_exactly_one(sweep):
    data, _ = sweep
    rows = [r for r in data["results"] if r["task"] == "fidelity" and r["policy"] == "full"]
    assert rows
    for r in rows:
        assert r["top1_agreement"] == 1.0 and r["mean_kl"] == 0.0 and r["max_kl"] == 0.0
        assert r["greedy_prefix_match"] == 1.0 and r["greedy_token_agreement"] == 1.0


@pytest.mark.realmodel
def test_starved_streaming_loses_an_early_needle(sweep):
    data, _ = sweep
    ref = next(v for k, v in data["references"].items() if k.startswith("passkey"))
    assert ref["correct"], f"full cache must find the needle for the test to mean anything: {ref['output_text']!r}"
    rows = [r for r in data["results"] if r["task"] == "passkey" and r["policy"] == "streaming"]
    assert {r["mode"] for r in rows} == {"block", "one_block"}
    for r in rows:
        assert not r["correct"] and r["needle_retention"] == 0.0 and not r["no_eviction"]
    full = [r for r in data["results"] if r["task"] == "passkey" and r["policy"] == "full"]
    assert all(r["correct"] and r["agrees_with_full"] for r in full)


@pytest.mark.realmodel
def test_full_passkey_answers_equal_hf_generate(sweep, smol, smol_hf, one_thread):
    data, _ = sweep
    prompt = build_passkey(smol.tokenizer, 1024, 0.1, 0, haystack="repeat")
    ref = data["references"][prompt.id]
    n = len(ref["output_ids"])
    with torch.no_grad():
        hf = smol_hf.generate(prompt.ids[None], max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt.ids[None]),
                              pad_token_id=smol.tokenizer.eos_token_id)
    assert hf[0, prompt.tokens:].tolist() == ref["output_ids"]


@pytest.mark.realmodel
def test_json_report_has_every_field(sweep):
    data, out = sweep
    saved = json.loads((out / "results.json").read_text())
    assert set(TOP_FIELDS) <= set(saved) and saved["complete"] is True
    assert {"command", "commit", "machine", "model", "weight_sha256", "text_source"} <= set(saved["meta"])
    # 2 prompts × 2 policies × 1 budget × 2 block modes
    assert len(saved["results"]) == 8
    for r in saved["results"]:
        want = set(ROW_FIELDS) | set(RUN_FIELDS) | set(PASSKEY_FIELDS if r["task"] == "passkey" else FIDELITY_FIELDS)
        assert want <= set(r), want - set(r)
    assert saved["summary"] == summarize(saved["results"])
    assert (out / "results.md").read_text().count("| streaming |") >= 2
    pytest.importorskip("matplotlib")
    assert sorted(p.name for p in out.glob("*.png")) == ["fidelity_B128.png", "fidelity_one.png", "passkey_B128.png",
                                                          "passkey_one.png"]


@pytest.mark.realmodel
def test_prompt_builders(smol):
    tok = smol.tokenizer
    p = build_passkey(tok, 2048, 0.5, 3, haystack="repeat")  # the classic layout, a labelled variant
    assert abs(p.tokens - 2048) < 64 and p.answer in tok.decode(p.ids)
    assert tok.decode(p.ids[p.needle_positions[0]:p.needle_positions[0] + 8]).startswith("IMPORTANT")
    assert 0.4 < p.needle_positions[0] / p.tokens < 0.6
    varied = build_passkey(tok, 2048, 0.5, 3)  # the default: varied prose, a seed-chosen needle phrasing
    assert varied.haystack == "varied" and abs(varied.tokens - 2048) < 64
    assert 0.4 < varied.needle_positions[0] / varied.tokens < 0.6
    assert varied.answer in tok.decode(varied.ids[varied.needle_positions[0]:varied.needle_positions[0] + 40])
    mk = build_passkey(tok, 2048, 0.1, 0, keys=4, haystack="repeat")
    assert len(mk.needle_positions) == 4 and mk.task == "multikey"
    text = tok.decode(mk.ids)
    # the asked needle is the pass key, the others are distractors of other kinds with other values
    assert text.count("The pass key is") == 2 and f"The pass key is {mk.answer}." in text
    assert len(set(mk.distractors) | {mk.answer}) == 4 and all(d in text for d in mk.distractors)
    assert build_passkey(tok, 2048, 0.5, 3, haystack="repeat").ids.tolist() == p.ids.tolist()  # deterministic
    assert build_passkey(tok, 2048, 0.5, 3).ids.tolist() == varied.ids.tolist()
    f = build_fidelity(tok, 1024, 0, 256)
    assert f.tokens == 1024 and f.eval_start == 768


@pytest.mark.realmodel
def test_resume_reuses_finished_prompts_and_reruns_changed_ones(sweep, tmp_path, monkeypatch):
    """--resume takes a finished prompt's rows from the earlier results.json instead of running the
    engine again; a prompt whose earlier record differs (here: its needle moved) runs again."""
    import edgekv.evaluation.runner as runner_mod

    data, out = sweep
    spec = EvalSpec(**{k: v for k, v in data["config"].items() if k in EvalSpec.__dataclass_fields__})
    earlier = json.loads((out / "results.json").read_text())
    ran: list[str] = []
    real_run_one = runner_mod.run_one
    monkeypatch.setattr(runner_mod, "run_one", lambda m, prompt, *a, **k: ran.append(prompt.id) or real_run_one(m, prompt, *a, **k))
    for meta in earlier["prompts"]:  # a record written before a field was added is still reusable
        meta.pop("distractors", None)
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    again = run_eval(spec, tmp_path, argv=["edgekv", "eval", "(test)"], progress=False, resume=True)
    assert ran == [] and again["complete"] is True
    assert json.loads((tmp_path / "results.earlier.json").read_text())["results"] == earlier["results"]
    key = lambda r: (r["prompt_id"], r["policy"], r["budget"], r["mode"])  # noqa: E731
    assert sorted(map(key, again["results"])) == sorted(map(key, earlier["results"]))
    assert again["summary"] == earlier["summary"]
    # the earlier run's passkey prompt had its needle elsewhere: that prompt is not reusable
    for meta in earlier["prompts"]:
        if meta["task"] == "passkey":
            meta["needle_positions"] = [p + 1 for p in meta["needle_positions"]]
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    run_eval(spec, tmp_path, argv=["edgekv", "eval", "(test)"], progress=False, resume=True)
    assert ran and {pid.split("-")[0] for pid in ran} == {"passkey"}


def _without_timings(data: dict) -> dict:
    """The results without what differs between any two runs: wall times and the run's meta."""
    timing = {"seconds", "prefill_seconds", "runtime_seconds"}

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in timing and k != "_files"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip({k: v for k, v in data.items() if k != "meta"})


@pytest.mark.realmodel
# the local worker pool runs by default; the Ray pool (a local Ray instance: ~50 s on 2 cores) is this
# same test under `-m slow`
@pytest.mark.parametrize("where", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_workers_and_ray_give_the_results_of_one_process(sweep, tmp_path, where):
    """The same small grid over two local worker processes, or two Ray actors on a local Ray
    instance, gives the in-process JSON (one thread each, as the in-process sweep), in the same
    order; the meta records where it ran."""
    data, _ = sweep
    spec = EvalSpec(**{k: v for k, v in data["config"].items() if k in EvalSpec.__dataclass_fields__})
    if where == "ray":
        pytest.importorskip("ray", reason="the Ray path needs Ray: pip install 'ray>=2.9' (in the dev extra)")
        again = run_eval(spec, tmp_path, argv=["edgekv", "eval", "(test)"], progress=False, workers=2, ray="auto",
                         threads=1)
    else:
        again = run_eval(spec, tmp_path, argv=["edgekv", "eval", "(test)"], progress=False, workers=2, threads=1)
    assert again["meta"]["execution"]["workers"] == 2 and again["meta"]["execution"]["threads"] == 1
    assert _without_timings(again) == _without_timings(data)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert _without_timings(on_disk) == _without_timings(json.loads(json.dumps(data, default=str)))


def test_bad_worker_options(tmp_path):
    from edgekv.evaluation.workers import make_pool

    with pytest.raises(InputError, match="--workers must be"):
        make_pool(0, None, None, None, 1)
    assert make_pool(1, None, None, None, 1) is None  # one worker: this process


def test_a_killed_eval_takes_its_workers_with_it(tmp_path):
    """A local eval worker ends when its eval process is killed (SIGKILL: no shutdown runs),
    instead of running on as an orphan that holds a model and a core."""
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, os\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time, sys; "
        "from edgekv.evaluation.workers import _exit_with_parent; "
        "_exit_with_parent(int(sys.argv[1]), 0.1); time.sleep(60)', str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    def gone() -> bool:  # exited: no such process, or a zombie nobody reaps (a container's init may not)
        try:
            return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    while time.time() < deadline:
        if gone():
            break
        time.sleep(0.2)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the worker outlived its killed eval process")
