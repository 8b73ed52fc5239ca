"""`--compress reconstruct` (issue 34), eager: KVzip's reconstruction score, block-wise
(``edgekv/policies/reconstruct.py``).

On a tiny random model: the kept sets equal a reference that recomputes every block's scores with
explicit loops (softmax over the sinks, the block and the rows, max over rows and group heads) and
keeps its own top N by position; the cache is query-agnostic (the same whatever the question);
a saved cache answered later equals one uninterrupted run; the plan counts the extra rows; the
CLI's --compress is refused with a conflicting --policy before any work."""

from __future__ import annotations

import pytest
import torch

from edgekv.engine import BlockEngine
from edgekv.engine.session import open_eager_session
from edgekv.models import tiny_random_model
from edgekv.policies import compress_policy, make_policy
from edgekv.policies.base import PolicyError
from edgekv.policies.reconstruct import CONTINUATION, ReconstructPolicy, RepeatPrompt, block_rows

MODEL = tiny_random_model(5, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=97)
N, B = 24, 8
DOC = torch.randint(1, 97, (90,), generator=torch.Generator().manual_seed(3))
PROMPT = RepeatPrompt(first=(7, 8, 9), later=(10, 11), suffix=(12,))


def new_engine(**kw) -> BlockEngine:
    policy = make_policy("reconstruct")
    policy.set_repeat_prompt(PROMPT)
    return BlockEngine(MODEL, policy, N, B, **kw)


class Recording(ReconstructPolicy):
    """The policy, recording what each layer's step saw (for the reference)."""

    def __post_init__(self):
        super().__post_init__()
        self.seen = []

    def observe(self, ctx):
        self.seen.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in
                          dict(layer=ctx.layer, keys=ctx.keys, positions=ctx.positions, n_cache=ctx.n_cache,
                               rq=ctx.extra_queries, rk=ctx.extra_keys, rp=ctx.extra_query_positions).items()})
        super().observe(ctx)


def reference_scores(step, sinks: int, scale: float) -> dict[tuple[int, int], float]:
    """{(head, position): score} of the block's entries, by explicit loops over heads and rows."""
    keys, pos, n_cache = step["keys"], step["positions"], step["n_cache"]
    rq, rk, rp = step["rq"], step["rk"], step["rp"]
    num_kv, n, _ = keys.shape
    groups = rq.shape[0] // num_kv
    out = {}
    for h in range(num_kv):
        visible = [j for j in range(n) if j >= n_cache or int(pos[h, j]) < sinks]
        best = torch.zeros(n - n_cache)
        for g in range(groups):
            for r in range(rq.shape[1]):
                own = [i for i in range(rq.shape[1]) if int(rp[i]) <= int(rp[r])]
                k = torch.cat([keys[h, visible], rk[h, own]])
                p = torch.softmax(k @ rq[h * groups + g, r] * scale, dim=0)[: len(visible)]
                for slot, j in enumerate(visible):
                    if j >= n_cache:
                        best[j - n_cache] = max(best[j - n_cache], p[slot])
        for j in range(n_cache, n):
            p_j = int(pos[h, j])
            out[(h, p_j)] = 1.0 if p_j < sinks else float(best[j - n_cache])
    return out


def test_kept_sets_equal_the_reference_computation():
    policy = Recording()
    policy.set_repeat_prompt(PROMPT)
    eng = BlockEngine(MODEL, policy, N, B, record_kept=True)
    eng.prefill(DOC)
    scores: dict[int, dict] = {0: {}, 1: {}}
    steps = iter(eng.stats.steps)
    seen = iter(policy.seen)
    for step in steps:
        for layer in range(2):
            obs = next(seen)
            assert obs["layer"] == layer and obs["rq"] is not None, "every block carries reconstruction rows"
            # the rows: the repeat prompt (+ the previous block's tail), the suffix, the block, after it
            ids, rows_pos = block_rows(PROMPT, DOC, step.start, step.length, policy.tail)
            assert obs["rp"].tolist() == rows_pos.tolist()
            scores[layer].update(reference_scores(obs, policy.sinks, eng.scale))
            kept = step.kept_positions[layer]
            for h in range(2):
                present = sorted({p for (hh, p) in scores[layer] if hh == h and p < step.start + step.length}
                                 & set(obs["positions"][h].tolist()))
                ranked = sorted(present, key=lambda p: (-scores[layer][(h, p)], present.index(p)))
                expect = sorted(ranked[:N]) if len(present) > N else present
                got = sorted(kept[h].tolist())
                # equal up to float ties: every kept entry scores at least the best dropped one
                if got != expect:
                    dropped = set(present) - set(got)
                    assert min(scores[layer][(h, p)] for p in got) >= max(scores[layer][(h, p)] for p in dropped) - 1e-6
    assert eng.stats.eviction_events > 0


def test_rows_of_a_block():
    ids, pos = block_rows(PROMPT, DOC, 0, B, 8)
    assert ids.tolist() == [7, 8, 9, 12, *DOC[:B].tolist()] and pos.tolist() == list(range(B, B + 4 + B))
    ids, pos = block_rows(PROMPT, DOC, 16, B, 3)
    assert ids.tolist() == [10, 11, *DOC[13:16].tolist(), 12, *DOC[16:24].tolist()] and int(pos[0]) == 24


def test_query_agnostic_same_cache_whatever_the_question():
    caches = []
    for question in (None, torch.tensor([5, 6, 7]), torch.tensor([40, 41, 42, 43, 44])):
        eng = new_engine(question_rows=8)
        eng.prefill(DOC, question=question)
        caches.append([(c.keys[:, : c.length].clone(), c.positions[:, : c.length].clone()) for c in eng.caches])
    for other in caches[1:]:
        for (k0, p0), (k1, p1) in zip(caches[0], other):
            assert torch.equal(p0, p1) and torch.equal(k0, k1)


def test_saved_cache_then_question_equals_one_run(tmp_path):
    question = torch.tensor([3, 14, 15, 92, 65])
    one = new_engine()
    one.prefill(DOC)
    one.prefill(question)
    a = [one.decode(t) for t in (4, 5, 6)]
    saved = new_engine()
    saved.prefill(DOC)
    saved.save_cache(tmp_path / "doc.ekv")
    later = new_engine()
    later.load_cache(tmp_path / "doc.ekv")
    later.prefill(question)
    b = [later.decode(t) for t in (4, 5, 6)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for layer in range(2):
        assert torch.equal(one.kept_positions(layer), later.kept_positions(layer))
    # after the document nothing is reconstructed: the question and the answer score CONTINUATION
    state = later.caches[0].state["reconstruction"][:, : later.caches[0].length]
    newest = later.caches[0].positions[:, : later.caches[0].length] >= DOC.numel()
    assert bool((state[newest] == CONTINUATION).all())


def test_document_within_the_budget_is_kept_whole_without_rows():
    eng = new_engine(record_kept=True)
    eng.prefill(DOC[:N])
    assert eng.cache_lengths() == [N, N] and eng.stats.eviction_events == 0
    assert eng.kept_positions(0)[0].tolist() == list(range(N))


def test_plan_counts_the_extra_rows():
    plain = open_eager_session(MODEL, "keydiff", {}, str(N), B, None, None)
    recon = open_eager_session(MODEL, "keydiff", {}, str(N), B, None, None, compress="reconstruct")
    rows = recon.engine.policy.max_extra_tokens
    assert recon.policy_name == "reconstruct"
    assert recon.engine.policy.name == "reconstruct" and rows == 32 + B
    assert recon.engine.capacity == N + B + rows
    assert recon.plan.activations > plain.plan.activations and recon.plan.kv_cache > plain.plan.kv_cache


def test_compress_option_resolves_or_refuses():
    assert compress_policy(None, "reconstruct") == "reconstruct"
    assert compress_policy("reconstruct", "reconstruct") == "reconstruct"
    assert compress_policy("keydiff", None) == "keydiff" and compress_policy("keydiff", "none") == "keydiff"
    for policy, mode, message in (("keydiff", "reconstruct", "drop --policy keydiff"),
                                  (None, "zip", "not a compression mode")):
        try:
            compress_policy(policy, mode)
        except PolicyError as exc:
            assert message in str(exc)
        else:
            raise AssertionError("refused")


def test_cli_refuses_a_conflicting_policy_before_loading(tmp_path):
    from typer.testing import CliRunner

    from edgekv.cli import app

    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    result = CliRunner().invoke(app, ["run", "no-such-model", "--prompt-file", str(doc), "--policy", "snapkv",
                                      "--compress", "reconstruct", "--save-cache", str(tmp_path / "d.ekv")])
    text = " ".join((result.stdout + result.stderr).split())
    assert result.exit_code == 2 and "drop --policy snapkv" in text and "Traceback" not in text
    assert not (tmp_path / "d.ekv").exists()


def test_repeat_prompt_prompt_rows_are_checked():
    policy = ReconstructPolicy(prompt_rows=4)
    try:
        policy.set_repeat_prompt(RepeatPrompt(first=(1, 2, 3), later=(1,), suffix=(2,)))
    except PolicyError as exc:
        assert "prompt_rows=" in str(exc)
    else:
        raise AssertionError("refused")


def test_run_settings_take_the_mode():
    from edgekv import job

    plan = job.plan_run(job.RunSettings(model=None, text="some document", save_cache=None, compress="reconstruct",
                                        questions=["what?"]))
    assert plan.settings.policy == "reconstruct"
    try:
        job.plan_run(job.RunSettings(model=None, text="x", policy="lagkv", compress="reconstruct"))
    except PolicyError as exc:
        assert "drop --policy lagkv" in str(exc)
    else:
        raise AssertionError("refused")


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak bytes of the tensors made inside the mode and still alive (storages, so a view
    counts its base once)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if id(s) not in self._seen:
                    self._seen.add(id(s))
                    self.live += s.nbytes()
                    weakref.finalize(s, self._free, id(s), s.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def test_plan_covers_the_scorers_probabilities(monkeypatch):
    """The scorer's softmax over [H, G, rows, n + e] is taken SCORE_ROWS rows at a time, in place, so
    everything it holds at once fits the attention-score matrix the plan counts for a step
    (Hq × (B + extra rows) × capacity fp32, ``block_activation_bytes``); all rows at once would not."""
    from edgekv.policies import reconstruct

    session = open_eager_session(MODEL, "keydiff", {}, str(N), B, None, None, compress="reconstruct")
    eng, cfg = session.engine, MODEL.config
    # a repeat prompt as long as prompt_rows allows, so a step's rows (40) exceed one chunk (32)
    eng.policy.set_repeat_prompt(RepeatPrompt(first=tuple(range(2, 26)), later=tuple(range(30, 46)), suffix=(50,) * 8))
    extra = eng.policy.max_extra_tokens
    planned_scores = 4 * cfg.num_heads * (B + extra) * eng.capacity
    assert planned_scores < session.plan.activations
    peaks, rows = {}, []
    real = reconstruct.reconstruction_scores

    def measured(*args, chunk_rows=reconstruct.SCORE_ROWS, **kw):
        rows.append(args[3].shape[1])
        for c in (chunk_rows, 10 ** 6):
            with _LiveBytes() as m:
                out = real(*args, chunk_rows=c, **kw)
                del out
            peaks[c] = max(peaks.get(c, 0), m.peak)
        return real(*args, chunk_rows=chunk_rows, **kw)

    monkeypatch.setattr(reconstruct, "reconstruction_scores", measured)
    eng.prefill(DOC)
    assert max(rows) == 40 > reconstruct.SCORE_ROWS
    assert 0 < peaks[reconstruct.SCORE_ROWS] <= planned_scores, (peaks, planned_scores)
    assert peaks[10 ** 6] > planned_scores  # the measure can fail: every row at once is over the plan


def aligned_reference(step, sinks: int, scale: float) -> dict[tuple[int, int], float]:
    """{(head, position): score} of ``score=aligned`` by explicit loops: entry j of the block scores
    the softmax weight it gets from the row before its copy (the rows end with the block's copy), over
    the whole cache, the block and the rows up to that row; max over the group's query heads."""
    keys, pos, n_cache = step["keys"], step["positions"], step["n_cache"]
    rq, rk, rp = step["rq"], step["rk"], step["rp"]
    num_kv, n, _ = keys.shape
    groups = rq.shape[0] // num_kv
    b, e = n - n_cache, rq.shape[1]
    out = {}
    for h in range(num_kv):
        for j in range(b):
            r = max(e - b - 1 + j, 0)
            own = [i for i in range(e) if int(rp[i]) <= int(rp[r])]
            k = torch.cat([keys[h], rk[h, own]])
            best = max(float(torch.softmax(k @ rq[h * groups + g, r] * scale, dim=0)[n_cache + j]) for g in range(groups))
            p_j = int(pos[h, n_cache + j])
            out[(h, p_j)] = 1.0 if p_j < sinks else best
    return out


def test_aligned_scoring_equals_the_reference_computation():
    """``--policy-arg score=aligned``: every block's stored scores equal the explicit loops', and the
    kept sets are the top N of them (scores never change once written)."""
    policy = Recording(score="aligned")
    policy.set_repeat_prompt(PROMPT)
    eng = BlockEngine(MODEL, policy, N, B, record_kept=True)
    eng.prefill(DOC)
    scores: dict[int, dict] = {0: {}, 1: {}}
    for obs in policy.seen:
        scores[obs["layer"]].update(aligned_reference(obs, policy.sinks, eng.scale))
    for layer in range(2):
        cache = eng.caches[layer]
        state = cache.state["reconstruction"][:, : cache.length]
        for h in range(2):
            for slot, p in enumerate(cache.positions[h, : cache.length].tolist()):
                assert abs(float(state[h, slot]) - scores[layer][(h, p)]) < 1e-5
            ranked = sorted((p for (hh, p) in scores[layer] if hh == h), key=lambda p: -scores[layer][(h, p)])
            kept = set(cache.positions[h, : cache.length].tolist())
            dropped = set(ranked) - kept
            assert min(scores[layer][(h, p)] for p in kept) >= max(scores[layer][(h, p)] for p in dropped) - 1e-6
    assert eng.stats.eviction_events > 0


def test_unknown_scoring_is_refused_when_the_policy_is_made():
    with pytest.raises(PolicyError, match="score=.*kvzip, aligned"):
        make_policy("reconstruct", {"score": "max"})
